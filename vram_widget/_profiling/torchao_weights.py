"""Base weights quantized by torchao's ``quantize_`` (``weights="int8-torchao"`` /
``"int4-torchao"``), on a copy of the model.

- The configs: ``Int8WeightOnlyConfig()`` (per-row ``Int8Tensor``) and, on the CPU,
  ``PrototypeInt4WeightOnlyConfig(group_size)`` (``Int4OpaqueTensor``: torch's
  ``_convert_weight_to_int4pack_for_cpu`` layout and ``_weight_int4pack_mm_for_cpu``
  kernel, torchao/prototype/quantization/int4/). torchao 0.18's ``Int4WeightOnlyConfig``
  has no CPU packing (``Int4PackingFormat``: plain and preshuffled run mslk's CUDA
  kernels, tile_packed_to_4d tinygemm's on CUDA, plain_int32 XPU / NPU). Both are made
  with ``set_inductor_config=False``: the default's ``recommended_inductor_config_setter``
  changes the process's Inductor settings, not the weights.
- Which modules: ``quantize_``'s default ``filter_fn``, ``_is_linear``
  (torchao/quantization/quant_api.py: an ``nn.Linear``, subclasses included, except
  ``NonDynamicallyQuantizableLinear``, attention's output projection); on a transformers
  model, what ``TorchAoConfig`` leaves out too (transformers/quantizers/quantizer_torchao.py,
  ``_process_model_before_weight_loading``: ``get_modules_to_not_convert``, the output
  embeddings and tied weights, or ``modules_to_not_convert`` where given, as
  ``Weights.skip_modules``). int4 also leaves a Linear whose input size the group size does
  not divide (``_int4_weight_only_opaque_tensor_quantize``: "Skipping quantizing weight").
- The profile's copy: each quantized Linear's weight is made by the real ``quantize_`` on an
  ``nn.Linear`` of its shape built inside the fake mode, so the tensor subclass holds fake
  ``qdata`` / ``scale`` / ... of exactly torchao's shapes and dtypes; its ``F.linear``
  (``implements_torch_function``) then runs torchao's own forward, op by op, through the
  recorder. The subclass's own storage is a size-only wrapper: only its inner tensors
  (``__tensor_flatten__``) are memory.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from .._estimating.recipe.weights import WeightFormat, Weights

# torch's CPU int4 packing needs the output size to be a multiple of 16
# (aten/src/ATen/native/cpu/int4mm_kernel.cpp, _convert_weight_to_int4pack_cpu:
# "expect N to be dividable by 16")
_INT4_CPU_N_MULTIPLE = 16

# the attribute marking a meta copy's weight that torchao quantizes
_MARK = "_vram_widget_torchao"


def require_torchao() -> ModuleType:
    """torchao, or an ImportError naming the ``pip install`` that provides it."""
    try:
        import torchao
        import torchao.quantization
    except ImportError:
        raise ImportError(
            "weights='int8-torchao' and 'int4-torchao' are applied by torchao's quantize_ "
            "itself, which is not installed: pip install torchao"
        ) from None
    return torchao


def torchao_config(weights: Weights) -> Any:
    """The torchao config ``quantize_`` applies for ``weights`` (on the CPU)."""
    require_torchao()
    if weights.format is WeightFormat.INT8_TORCHAO:
        from torchao.quantization import Int8WeightOnlyConfig

        return Int8WeightOnlyConfig(set_inductor_config=False)
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    return PrototypeInt4WeightOnlyConfig(group_size=weights.group_size, set_inductor_config=False)


def _kept(model: torch.nn.Module, weights: Weights) -> list[str]:
    """The modules ``TorchAoConfig`` leaves unquantized on a transformers model; on any
    other module, ``skip_modules`` (``quantize_`` itself keeps none)."""
    if hasattr(model, "all_tied_weights_keys") and hasattr(model, "get_output_embeddings"):
        from .quantized import modules_kept

        return modules_kept(model, weights)
    return list(weights.skip_modules or [])


def torchao_modules(model: torch.nn.Module, weights: Weights) -> list[str]:
    """The names of the Linear layers torchao quantizes in ``model``, or a ValueError
    naming the problem (no such layer; on the CPU, an int4 layer torch cannot pack), before
    any profiling."""
    require_torchao()
    from torchao.quantization.quant_api import _is_linear

    kept = _kept(model, weights)
    if kept:
        from transformers.quantizers.quantizers_utils import should_convert_module

        def convert(name: str) -> bool:
            return bool(should_convert_module(name, kept))
    else:

        def convert(name: str) -> bool:
            return True

    int4 = weights.format is WeightFormat.INT4_TORCHAO
    names, left, outs = [], [], {}
    for name, m in model.named_modules():
        if not (_is_linear(m) and convert(name)):
            continue
        assert isinstance(m, torch.nn.Linear)
        if int4 and m.in_features % weights.group_size:
            left.append(name)
            continue
        names.append(name)
        outs[name] = m.out_features
    fmt = weights.format.value if weights.format else None
    if not names:
        why = (
            f"; int4 groups of {weights.group_size} do not divide the input size of "
            f"{', '.join(left)} (torchao leaves them unquantized: a smaller group_size, 32 "
            "or 64, may)"
            if left
            else ""
        )
        raise ValueError(
            f"weights={fmt!r} quantizes the nn.Linear layers (torchao's _is_linear), and "
            f"{type(model).__name__} has none to quantize (kept unquantized: "
            f"{sorted(kept) or 'none'}{why}); transformers' Conv1D (GPT-2) is not an "
            "nn.Linear. Leave weights=None"
        )
    if int4:
        odd = [f"{n} ({outs[n]})" for n in names if outs[n] % _INT4_CPU_N_MULTIPLE]
        if odd:
            raise ValueError(
                "weights='int4-torchao' on the CPU packs each weight with torch's "
                "_convert_weight_to_int4pack_for_cpu, which needs the output size to be a "
                f"multiple of {_INT4_CPU_N_MULTIPLE}; these Linear layers are not: "
                f"{', '.join(odd)}. Keep them unquantized with "
                f"Weights('int4-torchao', skip_modules=(...)), or use weights='int8-torchao'"
            )
    return names


def _only(names: list[str]) -> Callable[[torch.nn.Module, str], bool]:
    """``quantize_``'s ``filter_fn`` for exactly ``names``."""
    chosen = set(names)
    return lambda _module, fqn: fqn in chosen


def torchao_copy(model: torch.nn.Module, weights: Weights) -> torch.nn.Module:
    """A meta copy of ``model`` whose quantized Linear layers hold a new frozen meta weight
    (as ``quantize_`` gives each a new ``nn.Parameter(..., requires_grad=False)``: a tied
    weight is untied), marked for :func:`fake_torchao_weight`."""
    from .step import meta_copy

    names = torchao_modules(model, weights)
    copy_ = meta_copy(model)
    for name in names:
        module = copy_.get_submodule(name)
        assert isinstance(module, torch.nn.Linear)
        weight = torch.nn.Parameter(module.weight.detach(), requires_grad=False)
        setattr(weight, _MARK, weights)
        module.weight = weight
    return copy_


def is_torchao_weight(p: torch.Tensor) -> bool:
    """Whether ``p`` is a meta copy's weight that torchao quantizes."""
    return hasattr(p, _MARK)


def fake_torchao_weight(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight torchao's ``quantize_`` makes of ``p`` (loaded in ``dtype``), made by the
    real ``quantize_`` on an ``nn.Linear`` of its shape in the active fake mode."""
    from torchao.quantization import quantize_

    weights: Weights = getattr(p, _MARK)
    out_features, in_features = (int(d) for d in p.shape)
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    quantize_(linear, torchao_config(weights))
    return linear.weight


def torchao_inner(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors holding a torchao weight (its ``__tensor_flatten__`` names), or
    None for any other tensor."""
    if not type(t).__module__.startswith("torchao."):
        return None
    names, _ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    found = (getattr(t, name) for name in names)
    return [x for x in found if isinstance(x, torch.Tensor)]


def real_torchao(model: torch.nn.Module, weights: Weights) -> torch.nn.Module:
    """``model`` (a real CPU copy, changed in place) with its Linear layers quantized by
    torchao's own ``quantize_`` (the layers :func:`torchao_modules` names)."""
    from torchao.quantization import quantize_

    names = torchao_modules(model, weights)
    quantize_(model, torchao_config(weights), filter_fn=_only(names))
    return model
