"""The zoo's registry: :data:`ZOO`, each :class:`ZooModel` a builder with a deterministic
example batch, and :func:`zoo_model` to find one by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .llama import LLAMA_TINY, llama_decoder
from .sequence import (
    causal_decoder,
    dict_input_classifier,
    embedding_heavy,
    lstm_classifier,
    mlp,
    tied_autoencoder,
    transformer_encoder,
)
from .vision import alexnet, mobilenet_v2, resnet18, resnet50, vgg16

__all__ = [
    "ZOO",
    "ZooModel",
    "zoo_model",
]


# --------------------------------------------------------------------------------------------
# The registry.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A reference model with an example batch.

    Attributes
    ----------
    name
        The key in :data:`ZOO`.
    build
        Returns a freshly initialised model (on the current default device).
    make_inputs
        ``make_inputs(batch_size)`` returns an example batch: a tensor (one positional
        argument) or a dict (keyword arguments), dim 0 the batch. Deterministic, and it
        leaves the global RNG alone (it draws from its own generator, seeded with 0).
    description
        One line for tables and widgets, input shape included.
    """

    name: str
    build: Callable[[], nn.Module]
    make_inputs: Callable[[int], Any]
    description: str


# Example batches are real CPU tensors even under ``with torch.device("meta"):`` (which would
# otherwise capture factory calls): they must hold the same values everywhere, and the caller
# moves or fakes them as needed.
_CPU = torch.device("cpu")


def _generator() -> torch.Generator:
    # A private, freshly seeded generator per call: the same batch every time, and the
    # caller's global RNG stream (e.g. their model's initialisation) is left untouched.
    return torch.Generator(device=_CPU).manual_seed(0)


def _image_batch(side_px: int) -> Callable[[int], torch.Tensor]:
    def make(batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, 3, side_px, side_px, generator=_generator(), device=_CPU)

    return make


def _feature_batch(num_features: int) -> Callable[[int], torch.Tensor]:
    def make(batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, num_features, generator=_generator(), device=_CPU)

    return make


def _token_batch(seq_len: int, vocab_size: int) -> Callable[[int], torch.Tensor]:
    def make(batch_size: int) -> torch.Tensor:
        return torch.randint(
            0, vocab_size, (batch_size, seq_len), generator=_generator(), device=_CPU
        )

    return make


_DICT_INPUT_SEQ_LEN = 32


def _dict_input_batch(batch_size: int) -> dict[str, torch.Tensor]:
    generator = _generator()
    input_ids = torch.randint(
        0, 1000, (batch_size, _DICT_INPUT_SEQ_LEN), generator=generator, device=_CPU
    )
    # Right-padded rows of varying length (at least one real token each), as a tokenizer
    # would return them.
    lengths = torch.randint(
        1, _DICT_INPUT_SEQ_LEN + 1, (batch_size, 1), generator=generator, device=_CPU
    )
    attention_mask = (torch.arange(_DICT_INPUT_SEQ_LEN, device=_CPU) < lengths).long()
    labels = torch.randint(0, 4, (batch_size,), generator=generator, device=_CPU)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# Input sizes are the benchmark defaults. The vision models keep their exact ImageNet
# architectures and shrink the image instead (their adaptive pools accept small inputs).
# Measured real fp32 forward+backward+Adam step at batch 32, 2-core CPU, torch 2.13, on an
# otherwise idle machine: resnet50 ~1.0 s, alexnet ~0.65 s, resnet18 ~0.4 s, mobilenet_v2
# ~0.3 s, every sequence model and the MLPs ~0.1 s or less. VGG16 takes ~1.7-2.0 s and cannot
# be brought lower by the input: 32 px is already its minimum (five 2x2 pools), and about half
# the step is Adam over 138M parameters and the 124M-parameter classifier, neither of which
# depends on the image size. Use a smaller batch where that matters.
_ENTRIES: tuple[ZooModel, ...] = (
    ZooModel(
        "vgg16",
        vgg16,
        _image_batch(32),
        "VGG16, 138.4M params (fp32 weights+grads+Adam ~2.2 GB); images (B, 3, 32, 32)",
    ),
    ZooModel(
        "alexnet",
        alexnet,
        # 64 px: just above AlexNet's 63 px minimum.
        _image_batch(64),
        "AlexNet, 61.1M params; images (B, 3, 64, 64)",
    ),
    ZooModel("resnet18", resnet18, _image_batch(64), "ResNet-18, 11.7M params; (B, 3, 64, 64)"),
    ZooModel("resnet50", resnet50, _image_batch(64), "ResNet-50, 25.6M params; (B, 3, 64, 64)"),
    ZooModel(
        "mobilenet_v2",
        mobilenet_v2,
        _image_batch(64),
        "MobileNetV2, 3.5M params, depthwise convs; images (B, 3, 64, 64)",
    ),
    ZooModel("mlp", mlp, _feature_batch(784), "MLP 784-512-512-10; features (B, 784)"),
    ZooModel(
        "transformer_encoder",
        transformer_encoder,
        _token_batch(64, 1000),
        "nn.TransformerEncoder classifier, 2 layers d=128; token ids (B, 64)",
    ),
    ZooModel(
        "causal_decoder",
        causal_decoder,
        _token_batch(64, 1000),
        "GPT-style decoder with SDPA and tied LM head, 2 layers d=128; token ids (B, 64)",
    ),
    ZooModel(
        "lstm",
        lstm_classifier,
        _token_batch(32, 1000),
        "2-layer LSTM classifier, hidden 128; token ids (B, 32)",
    ),
    ZooModel(
        "embedding_heavy",
        embedding_heavy,
        _token_batch(16, 50_000),
        "50k x 64 embedding + mean + Linear; token ids (B, 16)",
    ),
    ZooModel(
        "tied_autoencoder",
        tied_autoencoder,
        _feature_batch(784),
        "784-128-784 autoencoder, decoder reuses encoder.weight.t(); features (B, 784)",
    ),
    ZooModel(
        "llama_tiny",
        llama_decoder,
        _token_batch(64, LLAMA_TINY.vocab_size),
        "Llama-style decoder (RMSNorm, SwiGLU, GQA 4q/2kv, RoPE), 2 layers d=128; "
        "token ids (B, 64)",
    ),
    ZooModel(
        "dict_input",
        dict_input_classifier,
        _dict_input_batch,
        "keyword inputs (input_ids, attention_mask, labels), output with .logits/.loss; "
        f"dict of (B, {_DICT_INPUT_SEQ_LEN}) ids and mask, (B,) labels",
    ),
)

ZOO: dict[str, ZooModel] = {entry.name: entry for entry in _ENTRIES}
"""The registry, by name. Entries are immutable; the dict is not, but treat it as read-only."""


def zoo_model(name: str) -> ZooModel:
    """Look up a :data:`ZOO` entry by name.

    Parameters
    ----------
    name
        A key of :data:`ZOO`.

    Returns
    -------
    ZooModel

    Raises
    ------
    KeyError
        If ``name`` is not in the zoo; the message lists the valid names.

    Examples
    --------
    >>> from vram_widget.zoo import zoo_model
    >>> zoo_model("resnet18").make_inputs(2).shape
    torch.Size([2, 3, 64, 64])
    >>> try:
    ...     zoo_model("nope")
    ... except KeyError as err:
    ...     print(err.args[0][:60])
    unknown zoo model 'nope'; valid names: vgg16, alexnet, resne
    """
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; valid names: {', '.join(ZOO)}") from None
