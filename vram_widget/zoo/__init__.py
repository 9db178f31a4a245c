"""A zoo of reference models in plain ``torch.nn``, for tests, benchmarks and notebooks.

Nothing here downloads anything: the vision models re-create torchvision's architectures
module for module (same submodule names, same parameter counts), and the sequence models are
small, hand-written stand-ins for the shapes of model people train (an encoder, a GPT-style
decoder, an LSTM, an embedding-dominated model, a Llama-style decoder with grouped-query
attention).

Two layers of API:

* factory functions (:func:`vgg16`, :func:`resnet50`, :func:`llama_decoder`, ...) that return
  a freshly initialised ``nn.Module``; they honour ``with torch.device("meta"):`` so even a
  70B-parameter model can be built without allocating memory;
* the registry :data:`ZOO` of :class:`ZooModel` entries, each pairing a builder with a
  deterministic example batch, sized so that one real fp32 training step (forward, backward,
  Adam) at batch 32 runs in about a second or less on a two-core CPU (VGG16, about two
  seconds, is the exception; see the note above :data:`ZOO`). These are the benchmark
  defaults.

Examples
--------
>>> import torch
>>> from vram_widget.zoo import zoo_model
>>> entry = zoo_model("mlp")
>>> model = entry.build()
>>> model(entry.make_inputs(4)).shape
torch.Size([4, 10])
"""

from .llama import LLAMA_7B, LLAMA_70B, LLAMA_TINY, LlamaConfig, llama_decoder, llama_param_count
from .registry import ZOO, ZooModel, zoo_model
from .sequence import (
    SequenceClassifierOutput,
    causal_decoder,
    dict_input_classifier,
    embedding_heavy,
    lstm_classifier,
    mlp,
    tied_autoencoder,
    transformer_encoder,
)
from .vision import alexnet, mobilenet_v2, resnet, resnet18, resnet50, vgg16

__all__ = [
    "LLAMA_7B",
    "LLAMA_70B",
    "LLAMA_TINY",
    "ZOO",
    "LlamaConfig",
    "SequenceClassifierOutput",
    "ZooModel",
    "alexnet",
    "causal_decoder",
    "dict_input_classifier",
    "embedding_heavy",
    "llama_decoder",
    "llama_param_count",
    "lstm_classifier",
    "mlp",
    "mobilenet_v2",
    "resnet",
    "resnet18",
    "resnet50",
    "tied_autoencoder",
    "transformer_encoder",
    "vgg16",
    "zoo_model",
]
