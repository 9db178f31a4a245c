"""A shared zoo of small, awkward models for the tests (a plain module, not a test file).

Each entry builds a fresh model (initialised from a fixed seed, the caller's global RNG
left alone) and makes an example batch of any size from its own seeded generator.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def mlp_input(batch: int, features: int = 784) -> torch.Tensor:
    """A batch for ``zoo.mlp``, seeded: each call at a batch size gives the same tensor."""
    return torch.randn(batch, features, generator=torch.Generator().manual_seed(0))


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _features(n: int) -> Callable[[int], torch.Tensor]:
    def make(batch: int) -> torch.Tensor:
        return torch.randn(batch, n, generator=_generator())

    return make


def _images(channels: int, side: int) -> Callable[[int], torch.Tensor]:
    def make(batch: int) -> torch.Tensor:
        return torch.randn(batch, channels, side, side, generator=_generator())

    return make


def _sequence(seq_len: int, d_model: int) -> Callable[[int], torch.Tensor]:
    def make(batch: int) -> torch.Tensor:
        return torch.randn(batch, seq_len, d_model, generator=_generator())

    return make


def _tokens(seq_len: int, vocab: int) -> Callable[[int], torch.Tensor]:
    def make(batch: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, seq_len), generator=_generator())

    return make


# --------------------------------------------------------------------------------------------
# The models
# --------------------------------------------------------------------------------------------


class TiedLinears(nn.Module):
    """Two Linear modules sharing one weight Parameter (and nothing else)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)
        self.second.weight = self.first.weight  # tied: one Parameter, two owners

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def inplace_convnet(inplace: bool = True) -> nn.Module:
    """Conv -> ReLU(inplace) -> Flatten -> Linear -> ReLU(inplace) -> Linear."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(inplace=inplace),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 32),
        nn.ReLU(inplace=inplace),
        nn.Linear(32, 5),
    )


@dataclasses.dataclass
class ClassifierOutput:
    """A Hugging Face-like output: a dataclass with ``.logits`` (and no ``.loss``)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class DictInputModel(nn.Module):
    """``forward(input_ids, attention_mask)`` returning a dataclass with ``.logits``."""

    def __init__(self, vocab: int = 100, d_model: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> ClassifierOutput:
        h = torch.tanh(self.proj(self.embed(input_ids)))
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return ClassifierOutput(logits=self.head(pooled), hidden=h)


def _dict_inputs(batch: int) -> dict[str, torch.Tensor]:
    gen = _generator()
    ids = torch.randint(0, 100, (batch, 12), generator=gen)
    lengths = torch.randint(1, 13, (batch, 1), generator=gen)
    mask = (torch.arange(12) < lengths).long()
    return {"input_ids": ids, "attention_mask": mask}


class LSTMModel(nn.Module):
    """A one-layer LSTM over float sequences, a Linear on the last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _out, (h_n, _c_n) = self.lstm(x)
        return self.head(h_n[-1])


class MHAModel(nn.Module):
    """``nn.MultiheadAttention`` self-attention, residual, LayerNorm."""

    def __init__(self, d_model: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _weights = self.attn(x, x, x, need_weights=False)
        return self.norm(x + y)


class SDPABlock(nn.Module):
    """A hand-written causal attention block on ``F.scaled_dot_product_attention``."""

    def __init__(self, d_model: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class ReusedLinear(nn.Module):
    """One Linear called ``times`` times in one forward (weights once, activations n times)."""

    def __init__(self, width: int = 16, times: int = 5) -> None:
        super().__init__()
        self.times = times
        self.layer = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            x = self.layer(x)
        return x


def frozen_first_layer() -> nn.Module:
    """An MLP whose first Linear does not require grad."""
    model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 6))
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def batchnorm_net() -> nn.Module:
    """Conv -> BatchNorm2d (parameters and buffers) -> ReLU -> pool -> Linear."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    )


def dropout_net(p: float = 0.5) -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 4))


class ModelOutputLike(OrderedDict):  # type: ignore[type-arg]
    """A minimal look-alike of Hugging Face's ``transformers.utils.ModelOutput`` (transformers
    is not installed here): subclasses are dataclasses whose fields default to None; the
    fields that are not None are also the mapping's items, in field order; an int index
    gives the tuple of those values (``to_tuple()``), a str index the item. As in
    transformers (``ModelOutput.__post_init__`` / ``__setattr__`` / ``__getitem__``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return dict(self.items())[key]
        return self.to_tuple()[key]

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self[k] for k in self.keys())


@dataclasses.dataclass
class SequenceClassifierOutputLike(ModelOutputLike):
    """Like ``transformers.modeling_outputs.SequenceClassifierOutput``: ``loss`` is None
    unless labels were given."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


OUTPUT_KINDS = ("tensor", "tuple", "list", "dict", "dataclass", "model_output")


class OutputKinds(nn.Module):
    """One small net (Linear -> sigmoid -> Linear) returning its logits, and for every kind
    but ``"tensor"`` also its hidden features, as a tensor, a tuple, a list, a dict, a
    ``@dataclass`` or a Hugging Face-style ``ModelOutput``; the default loss takes the logits
    (the first floating tensor; the ``ModelOutput`` has no ``.loss`` without labels)."""

    def __init__(self, kind: str = "tuple") -> None:
        super().__init__()
        if kind not in OUTPUT_KINDS:
            raise ValueError(f"kind must be one of {OUTPUT_KINDS}, got {kind!r}")
        self.kind = kind
        self.body = nn.Linear(10, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.sigmoid(self.body(x))
        logits = self.head(h)
        if self.kind == "tensor":
            return logits
        if self.kind == "tuple":
            return logits, h
        if self.kind == "list":
            return [logits, h]
        if self.kind == "dict":
            return {"logits": logits, "hidden": h}
        if self.kind == "dataclass":
            return ClassifierOutput(logits=logits, hidden=h)
        return SequenceClassifierOutputLike(logits=logits, hidden_states=h)


def output_case_name(kind: str) -> str:
    """The ``CASES`` name of an ``OutputKinds`` kind: "tuple_output", ..., "model_output"."""
    return kind if kind.endswith("_output") else f"{kind}_output"


class HFStyleClassifier(nn.Module):
    """``forward(input_ids, attention_mask, labels=None)`` called with keyword tensors,
    returning a ``ModelOutput`` look-alike whose ``.loss`` (cross-entropy) the default loss
    uses when labels are given."""

    def __init__(self, vocab: int = 100, d_model: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> SequenceClassifierOutputLike:
        h = torch.tanh(self.proj(self.embed(input_ids)))
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        logits = self.head(pooled)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SequenceClassifierOutputLike(loss=loss, logits=logits)


def _labelled_dict_inputs(batch: int) -> dict[str, torch.Tensor]:
    inputs = _dict_inputs(batch)
    inputs["labels"] = torch.randint(0, 3, (batch,), generator=_generator())
    return inputs


class GRUModel(nn.Module):
    """A two-layer GRU over float sequences, a Linear on every step's output."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _h_n = self.gru(x)
        return self.head(out)


class NoParameters(nn.Module):
    """No parameters at all: a fixed function of the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x * 2.0).softmax(dim=-1)


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """A test model: ``build()`` makes a fresh one, ``make_inputs(batch)`` an example batch."""

    name: str
    factory: Callable[[], nn.Module]
    make_inputs: Callable[[int], Any]

    def build(self) -> nn.Module:
        """A fresh model, initialised from seed 0 without touching the global RNG."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return self.factory()


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("tied", TiedLinears, _features(16)),
        Case("inplace", inplace_convnet, _images(3, 8)),
        Case("dict_input", DictInputModel, _dict_inputs),
        Case("lstm", LSTMModel, _sequence(6, 8)),
        Case("mha", MHAModel, _sequence(5, 16)),
        Case("sdpa", SDPABlock, _sequence(5, 16)),
        Case("reused", ReusedLinear, _features(16)),
        Case("frozen", frozen_first_layer, _features(12)),
        Case("batchnorm", batchnorm_net, _images(3, 6)),
        Case("dropout", dropout_net, _features(10)),
        *(
            Case(output_case_name(kind), functools.partial(OutputKinds, kind), _features(10))
            for kind in OUTPUT_KINDS
        ),
        Case("hf_keywords", HFStyleClassifier, _labelled_dict_inputs),
        Case("gru", GRUModel, _sequence(6, 8)),
        Case("no_parameters", NoParameters, _features(10)),
    )
}


def unique_param_count(model: nn.Module) -> int:
    """Parameters of ``model``, a Parameter shared by several modules counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


__all__ = [
    "CASES",
    "OUTPUT_KINDS",
    "Case",
    "ClassifierOutput",
    "ModelOutputLike",
    "OutputKinds",
    "SequenceClassifierOutputLike",
    "output_case_name",
    "unique_param_count",
]


# --------------------------------------------------------------------------------------------
# The model is left alone: every entry point's promise, checked the same way everywhere
# --------------------------------------------------------------------------------------------

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_GLOBAL_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_forward_hooks_always_called",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _hooks(obj: Any, names: tuple[str, ...]) -> dict[str, dict[Any, int]]:
    return {n: {k: id(v) for k, v in getattr(obj, n, {}).items()} for n in names}


def _tensor_state(t: torch.Tensor) -> dict[str, Any]:
    return {
        "value": t.detach().clone(),
        "data_ptr": t.data_ptr(),
        "dtype": t.dtype,
        "device": t.device,
        "shape": tuple(t.shape),
        "requires_grad": t.requires_grad,
        "version": t._version,
    }


def snapshot_model(model: nn.Module) -> dict[str, Any]:
    """Everything ``profile_model`` promises to leave alone."""
    import torch.nn.modules.module as module_mod

    return {
        "params": {
            name: {
                **_tensor_state(p),
                "id": id(p),
                "grad": None if p.grad is None else _tensor_state(p.grad),
            }
            for name, p in model.named_parameters(remove_duplicate=False)
        },
        "buffers": {
            name: _tensor_state(b) for name, b in model.named_buffers(remove_duplicate=False)
        },
        "training": {name: m.training for name, m in model.named_modules(remove_duplicate=False)},
        "hooks": {
            name: _hooks(m, _HOOK_DICTS) for name, m in model.named_modules(remove_duplicate=False)
        },
        "global_hooks": _hooks(module_mod, _GLOBAL_HOOK_DICTS),
        "rng": torch.random.get_rng_state(),
        "grad_enabled": torch.is_grad_enabled(),
    }


def _assert_tensor_state(now: torch.Tensor, then: dict[str, Any], what: str) -> None:
    assert now.dtype == then["dtype"], what
    assert now.device == then["device"], what
    assert tuple(now.shape) == then["shape"], what
    assert now.data_ptr() == then["data_ptr"], what
    assert now.requires_grad == then["requires_grad"], what
    assert now._version == then["version"], f"{what} was modified in place"
    assert torch.equal(now.detach(), then["value"]), f"{what} changed value"


def assert_model_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    """Parameters (value, storage, dtype, device, requires_grad, identity, tying), gradients,
    buffers, training flags, hook dictionaries (the modules' and the global ones) and the
    global RNG state are as ``snapshot_model`` recorded them."""
    after = snapshot_model(model)
    assert after["params"].keys() == before["params"].keys()
    for name, p in model.named_parameters(remove_duplicate=False):
        then = before["params"][name]
        _assert_tensor_state(p, then, f"parameter {name}")
        assert id(p) == then["id"], f"parameter {name} was replaced"
        if then["grad"] is None:
            assert p.grad is None, f"parameter {name} got a .grad"
        else:
            assert p.grad is not None, f"parameter {name} lost its .grad"
            _assert_tensor_state(p.grad, then["grad"], f"{name}.grad")
    assert after["buffers"].keys() == before["buffers"].keys()
    for name, b in model.named_buffers(remove_duplicate=False):
        _assert_tensor_state(b, before["buffers"][name], f"buffer {name}")
    assert after["training"] == before["training"]
    assert after["hooks"] == before["hooks"]
    assert after["global_hooks"] == before["global_hooks"]
    assert torch.equal(after["rng"], before["rng"]), "the global RNG state changed"
    assert after["grad_enabled"] == before["grad_enabled"]


# Small Hugging Face models built from configs (no download, random weights), shared by the
# tests that bring transformers architectures (callers skip where transformers is missing).
HF_VOCAB = 1000


def hf_gpt2() -> nn.Module:
    """GPT-2: 2 layers of 64, 4 heads, 64 positions (a learned position table)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=HF_VOCAB, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


# The Llama family's shape (Llama, Mistral, Mixtral): 2 layers of 64, 4 heads over 2
# key/value heads (grouped-query attention)
_LLAMA_SHAPE = {
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": HF_VOCAB,
    "bos_token_id": 0, "eos_token_id": 0,
}  # fmt: skip


def hf_llama() -> nn.Module:
    """Llama of :data:`_LLAMA_SHAPE`."""
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA_SHAPE))


def hf_tokens(batch: int, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """``input_ids`` and, as causal-LM labels, the same ids."""
    ids = torch.randint(0, HF_VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def hf_mistral(window: int = 24) -> nn.Module:
    """Mistral: Llama's shape with a sliding window of ``window`` tokens on every layer."""
    import transformers

    config = transformers.MistralConfig(**_LLAMA_SHAPE, sliding_window=window)
    return transformers.MistralForCausalLM(config)


def hf_mixtral() -> nn.Module:
    """Mixtral: Llama's shape with a mixture of 4 experts, 2 per token (all 4 are weights)."""
    import transformers

    config = transformers.MixtralConfig(**_LLAMA_SHAPE, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def routed_experts(model: nn.Module, rows: str) -> nn.Module:
    """A Mixtral of 4 experts, 2 per token, with every router's weight rows set (in place)
    so that the routing is known.

    ``"balanced"``: rows ``[w, -w, u, -u]``. A token's logits are then ``a, -a, b, -b``
    (``a = h.w``, ``b = h.u``), whose top 2 are the positive one of each pair: one expert of
    experts 0-1 (rank 0's of 2 expert-parallel ranks) and one of experts 2-3 (rank 1's) for
    every token, so each rank's experts receive exactly ``tokens * top_k / 2`` pairs (the
    routing the estimate assumes, ``expert_parallel.routed_sizes``). ``"all-to-one"``: zero
    rows, equal logits, and ``torch.topk`` picks experts 2 and 3 for every token (measured
    on the CPU, torch 2.13): every pair goes to rank 1's experts.
    """
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                if rows == "balanced":
                    w, u = torch.randn(2, module.weight.shape[1])
                    module.weight.copy_(torch.stack([w, -w, u, -u]))
                else:
                    module.weight.zero_()
    return model


def hf_t5() -> nn.Module:
    """T5: an encoder-decoder of 2 + 2 layers of 64, 4 heads of 16 (relative positions)."""
    import transformers

    config = transformers.T5Config(
        vocab_size=HF_VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def assert_optimizers_match_cpu_step(case: str, precision: str, names: Any) -> None:
    """Each optimizer of ``names`` on the zoo MLP (``case="mlp"``, batch 4) or the small GPT-2
    (``"gpt2"``, batch 2): the estimate from the plain model's CPU profile equals, to the
    byte, the peak ``measure`` reads from the real CPU step with that optimizer."""
    from vram_widget import measure, profile_model, zoo

    torch.manual_seed(0)
    if case == "mlp":
        model, inputs, batch = zoo.mlp(), torch.randn(4, 784), 4
    else:
        model, inputs, batch = hf_gpt2(), hf_tokens(2), 2
    profile = profile_model(model, inputs=inputs, device="cpu")
    for name in names:
        est = profile.estimate(batch, precision=precision, optimizer=name)
        real = measure(model, inputs, optimizer=name, precision=precision)
        assert est.peak_bytes == real.peak_bytes, name


# torchtitan 0.3.0's own Llama 3 (torchtitan/models/llama3), tiny dims. Where triton is not
# installed (a CPU build of torch brings none), its one module that imports triton on the
# way to the model, the expert-parallel kernels (distributed/minimal_async_ep/kernels.py,
# imported by models/common/token_dispatcher.py for mixture-of-experts layers, never run by a
# dense Llama), is loaded with a stand-in for triton in that module's own namespace: triton
# never enters sys.modules, where torch would take it for the real package.


class _TritonStandIn:
    """What ``triton.language`` gives to that module's definitions (type annotations and
    constants, never run): anything called or looked up is this object again."""

    def __call__(self, *args: Any, **kwargs: Any) -> _TritonStandIn:
        return self

    def __getattr__(self, name: str) -> _TritonStandIn:
        if name.startswith("__"):
            raise AttributeError(name)
        return self


def _load_torchtitan_kernels_without_triton() -> None:
    import builtins
    import importlib.util
    import sys
    import types

    name = "torchtitan.distributed.minimal_async_ep.kernels"
    package = importlib.util.find_spec("torchtitan")
    if name in sys.modules or package is None or not package.submodule_search_locations:
        return
    root = package.submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(
        name, f"{root}/distributed/minimal_async_ep/kernels.py"
    )
    if spec is None or spec.loader is None:
        return
    triton = types.ModuleType("triton")
    # @triton.jit and @triton.jit(do_not_specialize=[...]): the function itself, unrun
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)  # type: ignore[attr-defined]
    triton.language = _TritonStandIn()  # type: ignore[attr-defined]
    real_import = builtins.__import__

    def import_(module: str, *args: Any, **kwargs: Any) -> Any:
        if module == "triton" or module.startswith("triton."):
            return triton
        return real_import(module, *args, **kwargs)

    module = importlib.util.module_from_spec(spec)
    module.__dict__["__builtins__"] = {**vars(builtins), "__import__": import_}
    spec.loader.exec_module(module)
    sys.modules[name] = module


def torchtitan_llama3(
    dim: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2
) -> nn.Module:
    """torchtitan 0.3.0's ``Llama3Model`` from its model config, built as its own
    ``llama3_configs`` entries build theirs (``_build_llama3_layers``: fused QKV, grouped
    key/value heads, depth-scaled inits; ``ComplexRoPE`` with Llama 3's scaling), vocabulary
    :data:`HF_VOCAB`, weights from ``init_states()``. The inner attention is torchtitan's
    ``ScaledDotProductAttention`` (causal): its language-model backends are FlexAttention,
    always run through ``torch.compile``, and varlen attention, a CUDA kernel. Raises
    ImportError where torchtitan is not installed."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        _load_torchtitan_kernels_without_triton()
    from torchtitan.models import llama3
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention

    layers = llama3._build_llama3_layers(
        n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
        rope=ComplexRoPE.Config(
            dim=dim // n_heads, max_seq_len=256, theta=500000, scaling="llama"
        ),
        attn_backend="flex",
    )  # fmt: skip
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = llama3.Llama3Model.Config(
        dim=dim, vocab_size=HF_VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=HF_VOCAB, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=HF_VOCAB,
            param_init=llama3._output_linear_init(dim),
        ),
        layers=layers,
    )  # fmt: skip
    model: nn.Module = config.build()
    model.init_states()  # type: ignore[operator]
    return model


def titan_tokens(batch: int, seq: int = 32) -> torch.Tensor:
    """Token ids for :func:`torchtitan_llama3` (its forward takes ``tokens`` alone)."""
    return torch.randint(0, HF_VOCAB, (batch, seq), generator=torch.Generator().manual_seed(batch))
