"""The tensors a loader leaves on the device, read from a meta build of the model (no weight
copied or touched), for ``ModelProfile.load_bytes``; and the real load's allocated bytes on
the CPU, which checks it (``loaded_cpu_bytes``).

- A Hugging Face ``PreTrainedModel`` is loaded as ``from_pretrained(..., dtype=...,
  quantization_config=...)`` loads it: built on the meta device from a copy of its config with
  the dtype as the default (``PreTrainedModel._from_config(config, dtype=...)``, which sets
  ``local_torch_dtype``, as ``from_pretrained`` does: transformers/modeling_utils.py), each
  parameter and persistent buffer then in the dtype the built model holds
  (``convert_and_load_state_dict_in_model``, transformers/core_model_loading.py:
  ``_dtype = empty_param.dtype``) or float32 where ``_get_dtype_plan`` keeps it
  (``_keep_in_fp32_modules`` with fp16, ``_keep_in_fp32_modules_strict`` with fp16 and bf16);
  the Linear layers replaced by ``replace_with_bnb_linear`` (``quantized.quantized_copy``'s
  rule: the modules ``get_modules_to_not_convert`` keeps stay in the dtype).
- Any other module, or a Hugging Face model whose build from its config has other
  parameters than it (resized embeddings, added heads), is ``model.to(dtype)``: every
  floating tensor cast, integer ones kept.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._estimating.loading import LoadedTensor, LoadLayout
from .._estimating.recipe.weights import WeightFormat, Weights
from .nf4_torchao import nf4_storage_bytes
from .quantized import bnb_config, is_quantized_param, modules_kept, require_bitsandbytes
from .step import meta_copy
from .torchao_weights import torchao_modules

FROM_PRETRAINED = "from_pretrained"
MODEL_TO = "model.to"


def load_layout(model: torch.nn.Module, dtype: str, weights: Weights) -> LoadLayout:
    """The tensors ``model`` holds once loaded in ``dtype`` with ``weights`` (module
    docstring), parameters then buffers, tied ones once."""
    torch_dtype = getattr(torch, dtype)
    notes: list[str] = []
    built = _from_config_on_meta(model, torch_dtype)
    if built is not None and _same_parameters(built, model):
        loader = FROM_PRETRAINED
        kept_fp32 = _fp32_plan(built, torch_dtype)
    else:
        if built is not None:
            notes.append(
                f"{type(model).__name__} built from its config has other parameters than the "
                "model given (resized or added layers): loaded as model.to(dtype)"
            )
        loader, kept_fp32 = MODEL_TO, None
        built = meta_copy(model).to(torch_dtype)
    torchao_weights: set[str] = set()
    nf4_weights: dict[str, tuple[int, ...]] = {}
    if weights.format is WeightFormat.NF4_TORCHAO:
        # torchtune's FrozenNF4Linear in place of each quantized Linear: its weight an
        # NF4Tensor of torchao's to_nf4, its bias and the other tensors as loaded
        nf4_weights = nf4_storage_bytes(built, weights)
    elif weights.torchao:
        # quantize_ replaces each chosen Linear's weight by its tensor subclass (a new
        # Parameter), the other tensors kept as loaded (torchao_weights.real_torchao)
        torchao_weights = {f"{name}.weight" for name in torchao_modules(built, weights)}
    elif weights.quantized:
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear

        require_bitsandbytes()
        # the new layers' biases in the dtype: from_pretrained replaces them with the dtype
        # as the default (and a plain module's copy keeps its cast bias, real_quantized)
        with warnings.catch_warnings(), default_dtype(torch_dtype):
            warnings.filterwarnings("ignore", module=r"(transformers|bitsandbytes)(\.|$)")
            replace_with_bnb_linear(
                built,
                modules_to_not_convert=modules_kept(built, weights),
                quantization_config=bnb_config(weights),
            )
    persistent = set(built.state_dict(keep_vars=True))
    tensors: list[LoadedTensor] = []
    for name, p in built.named_parameters():
        quantized = is_quantized_param(p) or name in torchao_weights or name in nf4_weights
        kind = "" if quantized else _loaded_dtype(name, p, kept_fp32, persistent)
        tensors.append(
            LoadedTensor(name, tuple(p.shape), kind, storage_bytes=nf4_weights.get(name, ()))
        )
    for name, b in built.named_buffers():
        kind = _loaded_dtype(name, b, kept_fp32, persistent)
        tensors.append(LoadedTensor(name, tuple(b.shape), kind, buffer=True))
    return LoadLayout(tuple(tensors), loader, tuple(notes))


def _loaded_dtype(
    name: str, t: torch.Tensor, kept_fp32: re.Pattern[str] | None, persistent: set[str]
) -> str:
    # the plan applies to the checkpoint's tensors (the state dict: parameters and
    # persistent buffers), core_model_loading.py: dtype_policy_alt.search(renamed_key)
    fp32 = kept_fp32 is not None and name in persistent and t.is_floating_point()
    if fp32 and kept_fp32 is not None and kept_fp32.search(name):
        return "float32"
    return str(t.dtype).removeprefix("torch.")


def _from_config_on_meta(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module | None:
    """``type(model)`` built from a copy of its config on the meta device under ``dtype``, as
    ``from_pretrained`` builds it; None where ``model`` is no ``PreTrainedModel`` or the build
    fails."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    config = copy.deepcopy(model.config)  # _from_config sets config.dtype
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return type(model)._from_config(config, dtype=dtype)
    except Exception:  # a model whose __init__ needs real tensors: model.to's rule
        return None


def _same_parameters(built: torch.nn.Module, model: torch.nn.Module) -> bool:
    shapes = lambda m: {n: tuple(p.shape) for n, p in m.named_parameters()}  # noqa: E731
    return shapes(built) == shapes(model)


def _fp32_plan(built: torch.nn.Module, dtype: torch.dtype) -> re.Pattern[str] | None:
    """``PreTrainedModel._get_dtype_plan``'s float32 modules as transformers matches them
    (``build_glob_alternation``, core_model_loading.py); None where there are none."""
    get_plan = getattr(built, "_get_dtype_plan", None)
    plan = get_plan(dtype) if callable(get_plan) else {}
    if not plan:
        return None
    from transformers.core_model_loading import build_glob_alternation

    return build_glob_alternation(list(plan))[0]


def loaded_cpu_bytes(load: Callable[[], object]) -> tuple[object, int]:
    """Run ``load`` on the CPU under the PyTorch profiler and return what it returns with
    the bytes its allocations left in use: the CPU allocator's allocation and free events
    (``profile(profile_memory=True)``, as ``measure`` reads them), summed over the load."""
    from torch.profiler import ProfilerActivity, profile

    from .probe import quiet_stderr_fd

    gc.collect()
    with quiet_stderr_fd(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loaded = load()
        gc.collect()
    total = 0
    for node in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if node.tag.name == "Allocation" and node.extra_fields.device.type == "cpu":
            total += int(node.extra_fields.alloc_size)
    return loaded, total


def _walk(roots: list[Any]) -> Iterator[Any]:
    stack = list(roots)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.set_default_dtype(dtype)`` for the block (restored after)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
