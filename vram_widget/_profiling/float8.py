"""Float8 training applied by torchao itself, on a copy of the model.

- Which layers: torchao's ``convert_to_float8_training`` with its own default
  (``module_filter_fn=None``: every ``nn.Linear``, subclasses included;
  torchao/float8/float8_linear_utils.py, ``swap_linear_layers``), or with
  ``Float8.filter_fqns`` the layers whose names contain none of them (torchtitan's
  ``float8.filter_fqns``). torchtitan 0.3.0 also skips every layer whose dims are not
  multiples of 16 by itself (torchtitan/components/quantization/utils.py,
  ``module_filter_fn``) and its model configs name the output layer there
  (torchtitan/models/llama3/config_registry.py: ``filter_fqns=["lm_head"]``); torchao's
  default converts such a layer, whose float8 matmul then fails on a GPU
  (``torch._scaled_mm`` needs dims divisible by 16), so it is refused here by name,
  before any profiling, with the ``filter_fqns`` that keeps it.
- The config: ``Float8LinearConfig.from_recipe_name(recipe)`` with ``emulate`` set
  (torchao/float8/config.py).
- The device. ``emulate`` is read in one place only: the float8 matmul
  (torchao/float8/float8_ops.py, ``float8_mm`` / ``float8_addmm``: ``if
  scaled_mm_config.emulate: return torch.mm(a._data.float() / a._scale, b._data.float() /
  b._scale).to(output_dtype)``, else ``addmm_float8_unwrapped``, ``torch._scaled_mm``). The
  casts to float8 (``hp_tensor_to_float8_dynamic``), the saved tensors
  (``ctx.save_for_backward(input_hp, weight_hp_t)``), the parameters, gradients and
  optimizer state are the same either way, and so are ``preprocess_addmm``'s contiguous
  copies of the operands (made before the branch). What differs is inside the matmul:
  emulation makes a float32 copy of each float8 operand and a float32 product before the
  cast to the output dtype; ``_scaled_mm`` writes the output in its dtype (rowwise in
  fp32: a bf16 output cast up afterwards, ``addmm_float8_unwrapped``) and its cuBLAS /
  CUTLASS workspace is not seen on fake tensors (UNCONFIRMED on a GPU). So
  ``device="cpu"`` profiles and measures ``emulate=True``, which torchao runs on a CPU,
  and ``device="cuda"`` profiles ``emulate=False``: the ``_scaled_mm`` path, on fake
  tensors.
- :class:`Float8Kernels`: ``Float8TrainingTensor`` is a tensor subclass whose ops run in
  its ``__torch_dispatch__``; below the recorder they would be one op, their inner tensors
  unseen. This mode, entered above the recorder, runs each such op's torchao
  implementation, so that every tensor it makes reaches the recorder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._estimating.float8 import DIM_MULTIPLE, check_float8, check_float8_layout, indivisible
from .._estimating.options import Mode, Precision, parse_option
from .._estimating.recipe.float8 import Float8, parse_float8
from .._estimating.recipe.weights import Weights

INSTALL = "pip install torchao"


def require_torchao() -> ModuleType:
    """``torchao.float8``, or an ImportError naming the ``pip install`` that provides it."""
    try:
        # torchao's import prints which of its optional CUDA extensions it could not load
        with contextlib.redirect_stdout(io.StringIO()):
            import torchao.float8
    except ImportError:
        raise ImportError(
            "float8 training is applied by torchao itself (convert_to_float8_training), "
            f"which is not installed: {INSTALL}"
        ) from None
    return torchao.float8


def torchao_config(float8: Float8, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` of ``float8``'s recipe, with ``emulate`` and
    ``enable_fsdp_float8_all_gather`` (``float8.all_gather``) set."""
    ao = require_torchao()
    assert float8.recipe is not None
    config = ao.Float8LinearConfig.from_recipe_name(float8.recipe.value)
    return dataclasses.replace(
        config, emulate=emulate, enable_fsdp_float8_all_gather=float8.all_gather
    )


def _kept(name: str, float8: Float8) -> bool:
    return any(fqn in name for fqn in float8.filter_fqns)


def converted_layers(model: torch.nn.Module, float8: Float8) -> list[str]:
    """The names of the layers ``convert_to_float8_training`` converts, or a ValueError
    naming the problem (no layer to convert; layers whose dims are not multiples of 16)."""
    shapes = {
        name: (int(m.out_features), int(m.in_features))
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not _kept(name, float8)
    }
    recipe = float8.recipe.value if float8.recipe else None
    if not shapes:
        raise ValueError(
            f"float8={recipe!r} converts the nn.Linear layers, and {type(model).__name__} "
            "has none to convert (transformers' Conv1D is no nn.Linear; layers kept by "
            f"filter_fqns: {list(float8.filter_fqns) or 'none'}); leave float8=None"
        )
    bad = indivisible(shapes)
    if bad:
        listed = ", ".join(f"{n or '(the model)'} ({o} x {i})" for n, (o, i) in bad.items())
        names = tuple(n for n in bad if n)
        raise ValueError(
            f"float8={recipe!r}: torchao's float8 matmul (torch._scaled_mm) needs both dims "
            f"of each weight to be multiples of {DIM_MULTIPLE}, and these Linear layers' are "
            f"not: {listed}. Keep them in high precision, as torchtitan's float8 converter "
            f"does by itself: Float8({recipe!r}, filter_fqns={names!r})"
        )
    return list(shapes)


def _filter(float8: Float8) -> Any:
    if not float8.filter_fqns:
        return None  # torchao's own default: every nn.Linear

    def keep_high_precision(module: torch.nn.Module, fqn: str) -> bool:
        return not _kept(fqn, float8)

    return keep_high_precision


def converted(model: torch.nn.Module, float8: Float8, emulate: bool) -> torch.nn.Module:
    """``model`` (changed in place: give it a copy) with its Linear layers swapped for
    torchao's ``Float8Linear`` by ``convert_to_float8_training``."""
    ao = require_torchao()
    converted_layers(model, float8)
    return ao.convert_to_float8_training(
        model, module_filter_fn=_filter(float8), config=torchao_config(float8, emulate)
    )


def float8_copy(model: torch.nn.Module, float8: Float8, emulate: bool) -> torch.nn.Module:
    """A meta copy of ``model`` converted to float8 training (the model itself untouched)."""
    from .step import meta_copy

    require_torchao()
    converted_layers(model, float8)  # refused before the copy is made
    return converted(meta_copy(model), float8, emulate)


def checked_float8(
    model: torch.nn.Module, settings: dict[str, Any], weights: Weights, compile_scope: object
) -> Float8:
    """``measure``'s ``float8`` setting, refused as the estimate refuses it, before the
    copy is made: the step (``check_float8``), torchao missing, the layers' shapes."""
    float8 = parse_float8(settings["float8"])
    if settings.get("float8_all_gather"):  # checked by Float8 itself (tensorwise, float8 on)
        float8 = dataclasses.replace(float8, all_gather=True)
    if not float8.enabled:
        return float8
    gpus = int(settings["gpus"])
    check_float8(
        float8,
        parse_option(Mode, settings["mode"], "mode"),
        parse_option(Precision, settings["precision"], "precision"),
        weights,
        settings["lora_rank"],
        gpus,
        compile_scope,
    )
    strategy = str(getattr(settings["strategy"], "value", settings["strategy"]))
    layouts = {k: settings.get(k) for k in ("tp", "pp", "ep")}
    check_float8_layout(float8, gpus, strategy, layouts, estimating=False)
    require_torchao()
    converted_layers(model, float8)
    return float8


def has_float8(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds torchao ``Float8Linear`` layers."""
    return any(type(m).__name__ == "Float8Linear" for m in model.modules())


class Float8Kernels(TorchDispatchMode):
    """During a profiling run, each op on a ``Float8TrainingTensor`` as torchao runs it
    (``Float8TrainingTensor.__torch_dispatch__``, float8_training_tensor.py, and its ops
    table in float8_ops.py), from above the recorder: the ops on the inner data and scales
    reach the recorder below this mode one by one. Every other op passes through."""

    def __init__(self) -> None:
        super().__init__()
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        self._subclass = Float8TrainingTensor

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(t, self._subclass) for t in tree_leaves((args, kwargs))):
            return self._subclass.__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def float8_kernels(model: torch.nn.Module) -> Iterator[None]:
    """:class:`Float8Kernels` where ``model`` has float8 layers; nothing otherwise."""
    if not has_float8(model):
        yield
        return
    with Float8Kernels():
        yield
