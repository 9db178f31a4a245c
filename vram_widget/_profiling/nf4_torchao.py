"""Base weights as torchao's ``NF4Tensor``, applied as torchtune's QLoRA applies them
(``weights="nf4-torchao"``), on a copy of the model.

- The modules: torchtune's own ``LoRALinear`` (torchtune/modules/peft/lora.py) with
  ``quantize_base=True`` on the LoRA targets, and its ``FrozenNF4Linear``
  (torchtune/modules/low_precision/nf4_linear.py) on every other quantized Linear, as the
  ``qlora_*`` builders make a decoder (torchtune/models/llama3/_component_builders.py,
  ``lora_llama3``: ``lora_attn_modules`` and ``apply_lora_to_mlp`` pick the LoRALinear
  layers, the other projections are ``FrozenNF4Linear``; the output projection is never
  quantized, "quantize_base is not applied to final output_proj", so with
  ``apply_lora_to_output`` it is a plain ``LoRALinear``). On a transformers model the output
  embeddings are kept so (or ``Weights.skip_modules`` where given); on any other module,
  ``skip_modules``. The targets are ``lora_targets`` as PEFT reads them (a name or a suffix
  of one, ``"all-linear"``, or PEFT's defaults for the architecture), ``alpha`` torchtune's
  builders' default 16, no dropout (``lora_dropout=0.0``: ``nn.Identity``). Every parameter
  but the adapters is frozen, as the recipe's ``set_trainable_params(model,
  get_adapter_params(model))`` freezes them; the adapters are built in the model's dtype (the
  recipe builds the model under ``set_default_dtype``).
- The stored layout: torchao's ``to_nf4`` itself, run on a fake tensor of the weight's shape
  and dtype (it runs on fake tensors: its ops have fake kernels), so the fake ``NF4Tensor``
  holds the same inner tensors as the real one; its own storage is a size-only wrapper.
- The step: ``linear_nf4`` (torchao's ``LinearNF4`` autograd function) saves the NF4 weight
  itself for backward and dequantizes it with ``weight.to(input.dtype)``
  (``get_original_weight``: the codes' two halves shifted, widened to int64 and looked up in
  the table, the scalers dequantized and their ``expand`` flattened into a copy, the two
  halves scaled, stacked and reshaped) in the forward and again in the backward
  (``grad_output @ weight.to(grad_output.dtype)``): each of these ops is run on the fake
  tensors and recorded.
- Loading torchtune: torchtune 0.6.1's ``lora.py`` and ``nf4_linear.py`` import
  ``torchao.dtypes.nf4tensor``, which torchao 0.18 moved to
  ``torchao.quantization.quantize_.workflows.nf4.nf4_tensor``, and ``import torchtune``
  fails beside it. Their files are run from torchtune's own directory, with the moved module
  (torchao's own, not a copy) under its old name and torchtune's package names stubbed in
  ``sys.modules`` only while they run (:func:`torchtune_nf4`). ``lora.py`` also runs
  torchtune's ``_register_nf4_dispatch_ops.py``, which registers its ``clone`` of an
  ``NF4Tensor`` in torchao's op table, as importing torchtune does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import pathlib
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .._estimating.recipe.weights import WeightFormat, Weights

# torchtune's qlora_* / lora_* builders' lora_alpha default
# (torchtune/models/llama3/_model_builders.py, qlora_llama3_8b: ``lora_alpha: float = 16``)
LORA_ALPHA = 16.0

# torchao's NF4 module, under its torchao 0.18 name and under the name torchtune imports
_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
_OLD_NF4_MODULE = "torchao.dtypes.nf4tensor"

# torchtune's files, relative to its package directory
_FILES = {
    "utils": ("modules", "peft", "_utils.py"),
    "dispatch": ("modules", "low_precision", "_register_nf4_dispatch_ops.py"),
    "lora": ("modules", "peft", "lora.py"),
    "nf4_linear": ("modules", "low_precision", "nf4_linear.py"),
}

# the attribute marking a meta copy's weight that becomes an NF4Tensor
_MARK = "_vram_widget_nf4_torchao"


def nf4_module() -> types.ModuleType:
    """torchao's ``nf4_tensor`` module (``to_nf4``, ``NF4Tensor``, ``linear_nf4``), or an
    ImportError naming the ``pip install`` that provides it."""
    try:
        import torchao  # noqa: F401
    except ImportError:
        pass
    else:
        for name in (_NF4_MODULE, _OLD_NF4_MODULE):
            try:
                return importlib.import_module(name)
            except ImportError:
                continue
    raise ImportError(
        "weights='nf4-torchao' is torchao's NF4Tensor (to_nf4), which is not installed: "
        "pip install torchao"
    )


def _torchtune_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("torchtune")  # a top-level find_spec runs no __init__
    if spec is not None and spec.submodule_search_locations:
        path = pathlib.Path(next(iter(spec.submodule_search_locations)))
        if all(path.joinpath(*parts).is_file() for parts in _FILES.values()):
            return path
    raise ImportError(
        "weights='nf4-torchao' is applied by torchtune's own LoRALinear and FrozenNF4Linear "
        "(its QLoRA), and torchtune is not installed: pip install torchtune"
    )


def _run_file(name: str, path: pathlib.Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _in_sys_modules(entries: dict[str, types.ModuleType]) -> Iterator[None]:
    """``entries`` in ``sys.modules`` while the block runs, then what was there before."""
    saved = {name: sys.modules.get(name) for name in entries}
    sys.modules.update(entries)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


@functools.cache
def torchtune_nf4() -> types.SimpleNamespace:
    """torchtune's ``LoRALinear`` and ``FrozenNF4Linear``, run from their own files (see the
    module's docstring), and torchao's ``to_nf4``.

    Examples
    --------
    >>> torchtune_nf4().LoRALinear.__name__  # doctest: +SKIP
    'LoRALinear'
    """
    nf4 = nf4_module()
    root = _torchtune_dir()
    stubs: dict[str, types.ModuleType] = {_OLD_NF4_MODULE: nf4}
    for name in ("torchtune", "torchtune.modules", "torchtune.modules.peft"):
        stubs[name] = types.ModuleType(name)
        stubs[name].__path__ = []
    low = stubs["torchtune.modules.low_precision"] = types.ModuleType(
        "torchtune.modules.low_precision"
    )
    low.__path__ = []
    with _in_sys_modules(stubs):
        utils = _run_file("_vram_widget_torchtune_peft_utils", root.joinpath(*_FILES["utils"]))
        stubs["torchtune.modules.peft"].AdapterModule = utils.AdapterModule  # type: ignore[attr-defined]
        dispatch = _run_file(
            "_vram_widget_torchtune_nf4_dispatch", root.joinpath(*_FILES["dispatch"])
        )
        # lora.py's ``from torchtune.modules.low_precision import _register_nf4_dispatch_ops``
        low._register_nf4_dispatch_ops = dispatch  # type: ignore[attr-defined]
        lora = _run_file("_vram_widget_torchtune_lora", root.joinpath(*_FILES["lora"]))
        linear = _run_file(
            "_vram_widget_torchtune_nf4_linear", root.joinpath(*_FILES["nf4_linear"])
        )
    return types.SimpleNamespace(
        LoRALinear=lora.LoRALinear,
        FrozenNF4Linear=linear.FrozenNF4Linear,
        to_nf4=nf4.to_nf4,
        NF4Tensor=nf4.NF4Tensor,
    )


def _kept(model: torch.nn.Module, weights: Weights) -> set[str]:
    """The Linear layers left unquantized: ``skip_modules`` where given; else, on a model with
    output embeddings (transformers'), those, as torchtune never quantizes the output
    projection; else none."""
    if weights.skip_modules is not None:
        return set(weights.skip_modules)
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {n for n, m in model.named_modules() if head is not None and m is head}


def _matches(name: str, patterns: set[str]) -> bool:
    """PEFT's reading of a list of module names: the name itself or a suffix of it after a
    dot (peft/tuners/tuners_utils.py, ``check_target_module_exists``)."""
    return any(name == p or name.endswith("." + p) for p in patterns)


def _default_targets(model: torch.nn.Module) -> set[str]:
    """PEFT's default LoRA targets for a transformers model's architecture
    (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``, peft/utils/constants.py)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    except ImportError:
        found = None
    else:
        found = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type or "")
    if not found:
        raise ValueError(
            f"weights='nf4-torchao' with lora_rank puts torchtune's LoRALinear on the layers "
            f"lora_targets names; {type(model).__name__} has no default targets (PEFT's "
            "defaults are for transformers models): name them, lora_targets=['q_proj', "
            "'v_proj'] (a name or a suffix of one), or 'all-linear'"
        )
    return set(found)


def nf4_layers(
    model: torch.nn.Module,
    weights: Weights,
    rank: int | None,
    targets: Sequence[str] | None,
    lora_dtype: str | None = None,
) -> dict[str, tuple[bool, bool]]:
    """Each ``nn.Linear`` torchtune's QLoRA changes in ``model``, by name: (whether it takes
    LoRA adapters, whether its weight becomes an ``NF4Tensor``); or a ValueError naming the
    problem (no layer to quantize, a size the blocks do not divide, a target that is no
    Linear, an adapter dtype of its own), before any profiling."""
    nf4_module()
    _torchtune_dir()
    if lora_dtype not in (None, "base"):
        raise ValueError(
            f"weights='nf4-torchao' with lora_dtype={lora_dtype!r}: torchtune's LoRALinear "
            "builds its adapters in the model's dtype and casts no input to another "
            "(torchtune/modules/peft/lora.py, forward: self.lora_a(self.dropout(x))); "
            "leave lora_dtype at None or 'base'"
        )
    kept = _kept(model, weights)
    linears = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    chosen: set[str] = set()
    if rank is not None:
        if targets is not None and tuple(targets) == ("all-linear",):
            heads = _kept(model, Weights(WeightFormat.NF4_TORCHAO))  # PEFT's: not the output
            chosen = linears - heads
        else:
            wanted = set(targets) if targets is not None else _default_targets(model)
            matched = {n for n, _m in model.named_modules() if n and _matches(n, wanted)}
            other = sorted(matched - linears)
            if other or not matched:
                raise ValueError(
                    f"weights='nf4-torchao' puts torchtune's LoRALinear on nn.Linear layers; "
                    f"lora_targets={sorted(wanted)} "
                    + (f"names {', '.join(other)}, not nn.Linear" if other else "names none")
                    + f" in {type(model).__name__}. Name Linear layers (a name or a suffix "
                    "of one), or 'all-linear'"
                )
            chosen = matched
    quantized = {n for n in linears if not _matches(n, kept)}
    if not quantized:
        raise ValueError(
            f"weights='nf4-torchao' stores nn.Linear weights as torchao's NF4Tensor, and "
            f"{type(model).__name__} has none to quantize (kept unquantized: "
            f"{sorted(kept) or 'none'}); leave weights=None"
        )
    per = weights.blocksize * weights.scaler_blocksize
    sizes = {n: model.get_submodule(n).get_parameter("weight").numel() for n in quantized}
    odd = [f"{n} ({sizes[n]})" for n in sorted(quantized) if sizes[n] % per]
    if odd:
        raise ValueError(
            "weights='nf4-torchao': torchao's to_nf4 needs a weight's size to be a multiple "
            f"of block_size x scaler_block_size = {weights.blocksize} x "
            f"{weights.scaler_blocksize} = {per} (NF4Tensor.from_tensor and "
            "double_quantize_scalers assert it); these Linear layers' sizes are not: "
            f"{', '.join(odd)}. Keep them unquantized with Weights('nf4-torchao', "
            "skip_modules=(...)), or choose smaller blocks (Weights('nf4-torchao', "
            "blocksize=..., scaler_blocksize=...))"
        )
    return {n: (n in chosen, n in quantized) for n in sorted(chosen | quantized)}


def _quantization_kwargs(weights: Weights) -> dict[str, int]:
    return {"block_size": weights.blocksize, "scaler_block_size": weights.scaler_blocksize}


def _new_module(
    old: torch.nn.Linear, weights: Weights, rank: int | None, lora: bool, quantized: bool
) -> Any:
    """torchtune's module for ``old``, built on the meta device (its weight and bias are set
    by the caller; the adapters, with ``lora``, in ``old``'s dtype)."""
    tt = torchtune_nf4()
    kwargs = _quantization_kwargs(weights) if quantized else {}
    with torch.device("meta"):
        if lora:
            assert rank is not None
            module = tt.LoRALinear(
                old.in_features,
                old.out_features,
                rank=rank,
                alpha=LORA_ALPHA,
                use_bias=old.bias is not None,
                quantize_base=quantized,
                **kwargs,
            )
            module.lora_a.to(old.weight.dtype)
            module.lora_b.to(old.weight.dtype)
        else:
            module = tt.FrozenNF4Linear(
                old.in_features,
                old.out_features,
                bias=old.bias is not None,
                dtype=old.weight.dtype,
                **kwargs,
            )
    return module


def _replace(
    model: torch.nn.Module,
    weights: Weights,
    rank: int | None,
    targets: Sequence[str] | None,
    lora_dtype: str | None,
    real: bool,
) -> None:
    """``model``'s Linear layers replaced in place by torchtune's (see the module's
    docstring), every parameter but the adapters frozen."""
    layers = nf4_layers(model, weights, rank, targets, lora_dtype)
    # the adapters' initialization draws from the global RNG: the user's is left as it was
    with torch.random.fork_rng(devices=[]):
        for name, (lora, quantized) in layers.items():
            old = model.get_submodule(name)
            assert isinstance(old, torch.nn.Linear)
            new = _new_module(old, weights, rank, lora, quantized)
            value = old.weight.detach()
            if not quantized:
                weight = torch.nn.Parameter(value, requires_grad=False)
            elif real:
                weight = torch.nn.Parameter(
                    torchtune_nf4().to_nf4(value, **_quantization_kwargs(weights)),
                    requires_grad=False,
                )
            else:  # made by to_nf4 on the fake tensors of each run (fake_nf4_weight)
                weight = torch.nn.Parameter(value, requires_grad=False)
                setattr(weight, _MARK, weights)
            new.weight = weight
            if old.bias is not None:
                new.bias = torch.nn.Parameter(old.bias.detach(), requires_grad=False)
            if lora and real:
                new.to_empty(device=value.device)  # the adapters only (LoRALinear's)
                new.initialize_parameters()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
    adapters = {
        f"{n}.{leaf}" for n, m in model.named_modules() if hasattr(m, "adapter_params")
        for leaf in m.adapter_params()
    }  # fmt: skip
    for n, p in model.named_parameters():  # set_trainable_params(model, get_adapter_params)
        p.requires_grad_(n in adapters)


def nf4_copy(
    model: torch.nn.Module,
    weights: Weights,
    rank: int | None,
    targets: Sequence[str] | None,
    lora_dtype: str | None,
) -> torch.nn.Module:
    """A meta copy of ``model`` with torchtune's QLoRA modules, their NF4 weights marked for
    :func:`fake_nf4_weight`."""
    from .step import meta_copy

    nf4_layers(model, weights, rank, targets, lora_dtype)  # refused before the copy is made
    copy_ = meta_copy(model)
    _replace(copy_, weights, rank, targets, lora_dtype, real=False)
    return copy_


def is_nf4_weight(p: torch.Tensor) -> bool:
    """Whether ``p`` is a meta copy's weight that becomes an ``NF4Tensor``."""
    return hasattr(p, _MARK)


def fake_nf4_weight(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``NF4Tensor`` torchao's ``to_nf4`` makes of ``p`` loaded in ``dtype``, made by
    ``to_nf4`` itself on an empty tensor of its shape in the active fake mode."""
    weights: Weights = getattr(p, _MARK)
    source = torch.empty(tuple(int(d) for d in p.shape), dtype=dtype)
    nf4: torch.Tensor = torchtune_nf4().to_nf4(source, **_quantization_kwargs(weights))
    return nf4


def real_nf4(
    model: torch.nn.Module,
    weights: Weights,
    rank: int | None,
    targets: Sequence[str] | None,
    lora_dtype: str | None,
) -> torch.nn.Module:
    """``model`` (a real CPU copy in the precision's dtype, changed in place) with
    torchtune's QLoRA modules, each NF4 weight made by torchao's ``to_nf4`` of the copy's
    weight (as loading a checkpoint into ``LoRALinear(quantize_base=True)`` re-quantizes it:
    torchao's ``copy_`` of a plain tensor into an ``NF4Tensor``)."""
    _replace(model, weights, rank, targets, lora_dtype, real=True)
    return model


def nf4_storage_bytes(model: torch.nn.Module, weights: Weights) -> dict[str, tuple[int, ...]]:
    """The bytes of the storages each ``NF4Tensor`` weight of ``model`` (built in its loaded
    dtype, on any device) holds once torchtune's ``FrozenNF4Linear`` layers replace its
    Linear layers (no adapters: a load, :func:`nf4_layers` with no rank), by qualified
    weight name, its 4-bit codes first: made by torchao's ``to_nf4`` itself on a fake tensor
    of each weight's shape and dtype, so each is the storage the real tensor holds (a
    one-value ``quantization_factor`` may sit in a larger storage), not a count of values."""
    from .fake import new_fake_mode

    layers = nf4_layers(model, weights, None, None, None)
    out: dict[str, tuple[int, ...]] = {}
    with new_fake_mode():
        for name, (_lora, quantized) in layers.items():
            if not quantized:
                continue
            weight = model.get_submodule(name).weight
            assert isinstance(weight, torch.Tensor)
            source = torch.empty(tuple(int(d) for d in weight.shape), dtype=weight.dtype)
            nf4 = torchtune_nf4().to_nf4(source, **_quantization_kwargs(weights))
            inner = [getattr(nf4, attr) for attr in nf4.__tensor_flatten__()[0]]
            storages: dict[int, int] = {}
            for t in [nf4.quantized_data, *inner]:  # one storage each, shared ones once
                storage = t.untyped_storage()
                storages.setdefault(storage._cdata, storage.nbytes())
            out[f"{name}.weight"] = tuple(storages.values())
    return out
