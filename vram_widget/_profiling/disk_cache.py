"""Profiles cached on disk: a second process that profiles the same model runs nothing.

A profile asks its source (:class:`~vram_widget._estimating.profile.ProfileSource`) for one
timeline or optimizer trace per setting, and each answer is a deterministic function of

* the **profile key** (:func:`profile_key`): the model's structure (every module's qualified
  name, class with its module path, ``extra_repr()`` and plain attributes; every parameter's
  and buffer's name, shape, dtype and ``requires_grad``; which weights are tied), the code
  that runs (the methods of each module class outside torch, transformers, peft and this
  package, recursively through nested code objects and the module-level functions they
  name; a Hugging Face model's ``config.to_json_string()``), the example inputs (names,
  shapes, dtypes, the values of integer and boolean tensors, which decide mask and packing
  paths), the device, the sequence axes, the ``loss_fn``'s code, the versions of Python,
  torch, numpy, transformers, peft and this package (with a digest of its source files) and
  of the cache format, and the CPU's kernel selection (``torch.backends.cpu.
  get_cpu_capability()``, the thread count, oneDNN's switch, the ``ONEDNN_MAX_CPU_ISA`` and
  ``ATEN_CPU_CAPABILITY`` variables): the probed CPU kernel workspaces depend on them
  (``probe.py``), and so, through the rules probed on real kernels, may other devices'
  profiles; the CUDA attention switches (``torch.backends.cuda.*_sdp_enabled``), which the
  CUDA emulation honours, are in it too;
* the **call key** (:func:`call_key`): the method and its arguments (precision, mode,
  sequence length, levers, optimizer, shard, ...), canonicalized field by field from the
  frozen dataclasses and enums themselves, so a field added to :class:`Levers` later is
  in the key without a change here.

:class:`DiskCachedSource` wraps a source: a hit reads the answer from
``<cache dir>/<profile key>/<call key>.pkl``; a miss asks the wrapped source (the model is
run as before) and writes its answer there. What the run warned is stored with it and warned
again on every hit, so a cached estimate says what a profiled one says. Runs that fell back
to real CPU tensors (values decide them) and failures are not stored.

The directory is ``platformdirs.user_cache_dir("vram_widget")``, or ``VRAM_WIDGET_CACHE_DIR``;
``VRAM_WIDGET_CACHE=0`` (or ``off``, ``false``, ``no``) or ``profile_model(..., cache=False)``
turns caching off. Entries are Python pickles, read only from that directory: like any
pickle, one written there by someone else can run code when read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import os
import pickle
import sys
import tempfile
import types
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._estimating.decoding import DECODE_STEPS_PROFILED
from .._estimating.levers import NO_LEVERS, Levers
from .._estimating.options import Mode, Precision

# Bumped whenever what an entry holds changes shape: old entries are then misses.
CACHE_FORMAT = 1

CACHE_DIR_ENV = "VRAM_WIDGET_CACHE_DIR"
CACHE_ENV = "VRAM_WIDGET_CACHE"
_OFF = frozenset({"0", "off", "false", "no"})

# Classes of these packages are identified by their qualified name and the package's version
# (their code is what that version ships); every other class's code is hashed.
_VERSIONED_PACKAGES = ("torch", "transformers", "peft", "vram_widget")
_VERSIONED_PREFIXES = tuple(p + "." for p in _VERSIONED_PACKAGES)

# How deep the code of module-level helpers named by a method is followed.
_HELPER_DEPTH = 3


class CacheWarning(UserWarning):
    """The on-disk profile cache could not be read or written; the model was profiled as
    without it. Silence it with ``warnings.filterwarnings("ignore", category=CacheWarning)``
    or turn the cache off (``VRAM_WIDGET_CACHE=0``)."""


class _Uncacheable(Exception):
    """A part of the key has no canonical form (a closure over a tensor, an object)."""


# -- where -----------------------------------------------------------------------------------


def cache_directory(cache: object = True) -> Path | None:
    """The directory profiles are cached in, or None where caching is off.

    ``cache``: True (the environment decides: ``VRAM_WIDGET_CACHE``, ``VRAM_WIDGET_CACHE_DIR``,
    else the user cache directory), False (off), or a directory (str or path).

    Examples
    --------
    >>> cache_directory(False) is None
    True
    >>> cache_directory("/tmp/profiles").name
    'profiles'
    """
    if cache is False or cache is None:
        return None
    if isinstance(cache, str | os.PathLike) and not isinstance(cache, bool):
        return Path(cache)
    if cache is not True:
        raise TypeError(
            f"cache must be True (the user cache directory, or ${CACHE_DIR_ENV}), False (off) "
            f"or a directory path; got {cache!r}"
        )
    if os.environ.get(CACHE_ENV, "").strip().lower() in _OFF:
        return None
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured)
    import platformdirs

    return Path(platformdirs.user_cache_dir("vram_widget"))


# -- canonical forms -------------------------------------------------------------------------


def _canon(value: Any) -> str:
    """A canonical text of a value built from plain data, enums, frozen dataclasses and numpy
    arrays (independent of hash randomization: sets are sorted); _Uncacheable otherwise."""
    if value is None or isinstance(value, bool | int | float | str | bytes | complex):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, tuple | list):
        return "(" + ",".join(_canon(v) for v in value) + ")"
    if isinstance(value, frozenset | set):
        return "{" + ",".join(sorted(_canon(v) for v in value)) + "}"
    if isinstance(value, dict):
        items = sorted((_canon(k), _canon(v)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={_field(value, f.name)}" for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    if isinstance(value, np.ndarray):
        digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
        return f"ndarray({value.dtype.str},{value.shape},{digest})"
    if isinstance(value, np.generic):
        return _canon(value.item())
    if isinstance(value, torch.dtype | torch.device | torch.Size):
        return repr(value)
    raise _Uncacheable(type(value).__name__)


def _field(record: Any, name: str) -> str:
    """One field of a frozen dataclass; a callable ``Levers.checkpoint_policy`` by its code,
    defaults, closure and the globals it names, as a ``loss_fn`` is keyed (_Uncacheable where
    one of them holds state: a bound method, a tensor, an object). Other callables (a user's
    optimizer factory) stay keyed by identity only: not stored."""
    value = getattr(record, name)
    if isinstance(record, Levers) and name == "checkpoint_policy" and callable(value):
        if not isinstance(value, types.FunctionType | functools.partial):
            raise _Uncacheable("a checkpoint_policy that is not a plain function")
        return _value(value, _HELPER_DEPTH, set())
    return _canon(value)


def _config_state(config: Any, depth: int = 0) -> str:
    """Every attribute of a Hugging Face config, private ones included, as text: a value with
    no canonical form by its type and repr (a repr with an address is a miss, never a stale
    hit); a nested config recursively."""
    parts = []
    for name, value in sorted(vars(config).items()):
        if depth < 3 and hasattr(value, "to_json_string") and hasattr(value, "__dict__"):
            text = _config_state(value, depth + 1)
        else:
            try:
                text = _canon(value)
            except _Uncacheable:
                text = f"{type(value).__module__}.{type(value).__qualname__}:{value!r}"
        parts.append(f"{name}={text}")
    attention = getattr(config, "_attn_implementation", None)
    return "{" + ",".join(parts) + f"}}attn={attention!r}"


def _code(code: types.CodeType) -> str:
    """A code object's bytecode, constants (nested code objects recursively) and names."""
    consts = ",".join(
        _code(c) if isinstance(c, types.CodeType) else _canon(c) for c in code.co_consts
    )
    return (
        f"code({code.co_name},{code.co_code.hex()},[{consts}],{code.co_names},"
        f"{code.co_varnames},{code.co_freevars},{code.co_cellvars},{code.co_argcount},"
        f"{code.co_kwonlyargcount},{code.co_flags})"
    )


def _names(code: types.CodeType) -> Iterable[str]:
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _names(c)


def _is_versioned(module_name: str) -> bool:
    return module_name in _VERSIONED_PACKAGES or module_name.startswith(_VERSIONED_PREFIXES)


def _function(fn: types.FunctionType, depth: int, seen: set[int]) -> str:
    """A plain function: its code, defaults and closure, and the globals it names (module
    names, versioned library objects by name, user functions and classes by their code, plain
    constants by value); _Uncacheable where one of them holds other state (a tensor, an
    object)."""
    if id(fn) in seen:
        return f"seen({fn.__qualname__})"
    seen.add(id(fn))
    if _is_versioned(fn.__module__ or ""):
        return f"fn({fn.__module__}.{fn.__qualname__})"
    parts = [_code(fn.__code__), _canon(fn.__defaults__), _canon(fn.__kwdefaults__)]
    for cell in fn.__closure__ or ():
        parts.append(_value(cell.cell_contents, depth, seen))
    if depth > 0:
        for name in sorted(set(_names(fn.__code__))):
            if name in fn.__globals__:
                parts.append(f"{name}={_value(fn.__globals__[name], depth - 1, seen)}")
    return f"fn({fn.__module__}.{fn.__qualname__},{','.join(parts)})"


def _value(value: Any, depth: int, seen: set[int]) -> str:
    """A value a function refers to (a global, a closure cell)."""
    if isinstance(value, types.ModuleType):
        return f"module({value.__name__})"
    if isinstance(value, types.FunctionType):
        return _function(value, depth, seen)
    if isinstance(value, type):
        return _class(value)
    if isinstance(value, types.BuiltinFunctionType | types.BuiltinMethodType):
        return f"builtin({getattr(value, '__module__', None)}.{value.__qualname__})"
    if isinstance(value, functools.partial):
        return (
            f"partial({_value(value.func, depth, seen)},{_canon(value.args)},"
            f"{_canon(value.keywords)})"
        )
    if isinstance(value, torch.nn.Module):
        return _module_instance(value)
    if isinstance(value, torch.Tensor):
        raise _Uncacheable("a tensor")
    if isinstance(value, tuple | list | frozenset | set):
        items = [_value(v, depth, seen) for v in value]
        if isinstance(value, frozenset | set):
            items.sort()
        return f"{type(value).__name__}({','.join(items)})"
    if callable(value) and _is_versioned(getattr(value, "__module__", None) or ""):
        # torch's ops and their overload packets: identified by name
        return f"callable({type(value).__qualname__},{getattr(value, '__name__', '')})"
    return _canon(value)


_classes_in_progress: set[type] = set()


def _class(cls: type) -> str:
    """A class by its module path and qualified name; the code of every method its own
    classes (outside the versioned packages) define, through its MRO."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls in _classes_in_progress:  # ``super()``'s ``__class__`` cell, a recursive helper
        return f"class({name})"
    _classes_in_progress.add(cls)
    try:
        return _class_code(cls)
    finally:
        _classes_in_progress.discard(cls)


@functools.cache
def _class_code(cls: type) -> str:
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for base in cls.__mro__:
        if _is_versioned(base.__module__) or base is object:
            continue
        for name, attr in sorted(vars(base).items()):
            fn = attr.__func__ if isinstance(attr, classmethod | staticmethod) else attr
            if isinstance(attr, property):
                fn = attr.fget
            if isinstance(fn, types.FunctionType):
                try:
                    parts.append(f"{name}:{_function(fn, _HELPER_DEPTH, set())}")
                except _Uncacheable:
                    # a helper over module-level state: identified by name only
                    parts.append(f"{name}:{_code(fn.__code__)}")
    return ";".join(parts)


def _module_instance(module: torch.nn.Module) -> str:
    """A module used as a loss or helper: its class and settings (no tensors read)."""
    return f"instance({_class(type(module))},{module.extra_repr()},{_attributes(module)})"


def _attributes(module: torch.nn.Module) -> str:
    """A module's plain public attributes (``self.scale = 0.5``): they steer forward code.
    Objects, tensors and the training flag (the profiler sets it per run) are left out."""
    parts = []
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or name == "training":
            continue
        try:
            parts.append(f"{name}={_canon(value)}")
        except _Uncacheable:
            continue
    return ",".join(parts)


def _loss(loss_fn: Callable[[Any], Any] | None) -> str:
    if loss_fn is None:
        return "default"
    if isinstance(loss_fn, types.MethodType):
        raise _Uncacheable("a bound method (its object's state is not hashed)")
    return _value(loss_fn, _HELPER_DEPTH, set())


def _tensor(name: str, t: torch.Tensor) -> str:
    text = f"{name}:{tuple(t.shape)}:{t.stride()}:{t.dtype}:{t.requires_grad}"
    if t.device.type != "meta" and not t.is_floating_point() and not t.is_complex():
        # integer and boolean values decide paths (attention masks, position ids)
        data = t.detach().to("cpu").contiguous().numpy().tobytes()
        text += ":" + hashlib.sha256(data).hexdigest()
    return text


# -- the profile key -------------------------------------------------------------------------


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


@functools.cache
def _package_digest() -> str:
    """A digest of this package's source files: the profiler's code is part of every entry's
    meaning, and an edited checkout keeps its version number."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _environment(device: str) -> list[str]:
    # the package's version, read without importing the package's display stage
    version = getattr(sys.modules.get("vram_widget"), "__version__", "-")
    cpu = torch.backends.cpu.get_cpu_capability()
    return [
        f"format={CACHE_FORMAT}",
        f"python={sys.version_info[:2]}",
        f"torch={torch.__version__}",
        f"numpy={np.__version__}",
        f"transformers={_version('transformers')}",
        f"peft={_version('peft')}",
        f"vram_widget={version}:{_package_digest()}",
        f"device={device}",
        f"cpu={cpu}:{torch.get_num_threads()}:{torch.backends.mkldnn.enabled}",
        *(f"{k}={os.environ.get(k)}" for k in _ENV_VARIABLES),
        "sdp="
        + _canon(
            (
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(),
            )
        ),
    ]


# Environment variables that change which kernels run: oneDNN's and ATen's CPU dispatch
# (https://uxlfoundation.github.io/oneDNN/dev_guide_cpu_dispatcher_control.html;
# aten/src/ATen/native/DispatchStub.cpp), and the linear flattening the composites read.
_ENV_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "TORCH_LINEAR_FLATTEN_3D")


def profile_key(
    model: torch.nn.Module,
    named_inputs: Iterable[tuple[str, Any]],
    input_size: tuple[int, ...] | None,
    loss_fn: Callable[[Any], Any] | None,
    device: str,
    seq_axes: dict[str, int],
) -> str | None:
    """The sha256 of everything a profile's answers depend on (see the module docstring), or
    None where a part has no canonical form: a ``loss_fn`` that is a bound method, or that
    closes over (or names a global) tensor or other object whose state is not hashed; such a
    profile is not cached, without a warning.

    Examples
    --------
    >>> import torch
    >>> a = profile_key(torch.nn.Linear(4, 2), [], (4,), None, "cpu", {})
    >>> b = profile_key(torch.nn.Linear(4, 3), [], (4,), None, "cpu", {})
    >>> len(a), a == b
    (64, False)
    """
    h = hashlib.sha256()

    def add(text: str) -> None:
        h.update(text.encode())
        h.update(b"\n")

    try:
        for line in _environment(device):
            add(line)
        add(f"loss={_loss(loss_fn)}")
        add(f"input_size={input_size}")
        for name, value in named_inputs:
            if isinstance(value, torch.Tensor):
                add("input " + _tensor(name, value))
            else:
                add(f"input {name}={_canon(value)}")
        add(f"seq_axes={_canon(seq_axes)}")
        config = getattr(model, "config", None)
        to_json = getattr(config, "to_json_string", None)
        if callable(to_json):
            add("config=" + to_json(use_diff=False))
            # what the JSON leaves out and the model still reads: the attention kernel
            # (``config._attn_implementation``, not serialized) and other private settings
            add("config state=" + _config_state(config))
        owners: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            add(f"module {name} {_class(type(module))} ({module.extra_repr()})")
            add(f"attrs {_attributes(module)}")
            tensors = [*module.named_parameters(recurse=False)]
            tensors += [(n, b) for n, b in module.named_buffers(recurse=False) if b is not None]
            for pname, p in tensors:
                qualified = f"{name}.{pname}" if name else pname
                tied = owners.setdefault(id(p), qualified)
                add(
                    f"tensor {qualified} {tuple(p.shape)} {p.stride()} {p.dtype} "
                    f"{p.requires_grad} {isinstance(p, torch.nn.Parameter)} {tied}"
                )
    except _Uncacheable:
        return None
    return h.hexdigest()


def call_key(method: str, *args: Any, **extra: Any) -> str:
    """The sha256 of one source call: the method and its arguments, canonical.

    Examples
    --------
    >>> from vram_widget import Mode, Precision
    >>> a = call_key("timeline", Precision.FP32, Mode.TRAIN, None)
    >>> a == call_key("timeline", Precision.BF16, Mode.TRAIN, None)
    False
    """
    text = f"{method}:{_canon(args)}:{_canon(extra)}"
    return hashlib.sha256(text.encode()).hexdigest()


# -- the wrapper -----------------------------------------------------------------------------

_warned_dirs: set[str] = set()
_module_of_file: dict[str, str] = {}


def _module_name(filename: str) -> str | None:
    """The imported module a file is, so a warning stored from it is warned again as from
    that module (warning filters match module names)."""
    if filename not in _module_of_file:
        for name, mod in list(sys.modules.items()):
            path = getattr(mod, "__file__", None)
            if path:
                _module_of_file.setdefault(path, name)
    return _module_of_file.get(filename)


def _category_path(category: type[Warning]) -> tuple[str, str]:
    return category.__module__, category.__qualname__


def _category(path: tuple[str, str]) -> type[Warning]:
    module, qualname = path
    try:
        obj: Any = sys.modules.get(module) or __import__(module, fromlist=["_"])
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return UserWarning
    return obj if isinstance(obj, type) and issubclass(obj, Warning) else UserWarning


Stored = tuple[tuple[str, str], str, str, int]  # category, message, filename, line


def _rewarn(stored: list[Stored]) -> None:
    for category, message, filename, lineno in stored:
        module = _module_name(filename)
        warnings.warn_explicit(
            message,
            _category(category),
            filename,
            lineno,
            module=module,
            registry=sys.modules[module].__dict__.setdefault("__warningregistry__", {})
            if module in sys.modules
            else None,
        )


class DiskCachedSource:
    """A profile source whose answers are read from disk where a process made them before.

    Parameters
    ----------
    inner : ProfileSource
        The profiler's source (``profiler._Source``), asked on a miss.
    directory : Path
        The cache directory.
    key : str
        The profile key (:func:`profile_key`).
    """

    def __init__(self, inner: Any, directory: Path, key: str) -> None:
        self.inner = inner
        self.directory = directory
        self.key = key

    @property
    def profiler(self) -> Any:
        return self.inner.profiler

    def made_before(self) -> bool:
        """Whether this profile has entries on disk: a run of it succeeded before (entries
        are written for successful runs only)."""
        try:
            return any((self.directory / self.key).glob("*.pkl"))
        except OSError:
            return False

    # -- the ProfileSource protocol ----------------------------------------------------------
    def timeline(
        self,
        precision: Precision,
        mode: Mode,
        seq_len: int | None = None,
        levers: Levers = NO_LEVERS,
    ) -> Any:
        return self._cached(
            "timeline",
            (precision, mode, seq_len, levers),
            lambda: self.inner.timeline(precision, mode, seq_len, levers),
            levers if mode is Mode.TRAIN else None,
        )

    def timeline_across_lengths(
        self, precision: Precision, mode: Mode, base: Any, levers: Levers = NO_LEVERS
    ) -> Any:
        # ``base`` is the timeline of (precision, mode, levers) at the example's length, a
        # function of the same key: the arguments name it
        return self._cached(
            "timeline_across_lengths",
            (precision, mode, levers),
            lambda: self.inner.timeline_across_lengths(precision, mode, base, levers),
            levers if mode is Mode.TRAIN else None,
        )

    def optimizer_trace(self, precision: Precision, optimizer: Any, *args: Any) -> Any:
        # every argument is in the key, whatever the source takes (levers, a ZeRO or FSDP2
        # shard, the implementation, ...): a setting added later cannot be left out of it
        return self._cached(
            "optimizer_trace",
            (precision, optimizer, *args),
            lambda: self.inner.optimizer_trace(precision, optimizer, *args),
            None,
        )

    def lora_profile(self, rank: int, targets: tuple[str, ...] | None, *args: Any) -> Any:
        # a profile of PEFT's wrapping of a meta copy, cached by its own profile key (the
        # wrapped structure holds the rank, the targets and the adapters' dtypes)
        return self.inner.lora_profile(rank, targets, *args)

    def tensor_parallel_estimate(self, *args: Any) -> Any:
        # one rank's sub-profile under a fake process group, made by the wrapped source
        return self.inner.tensor_parallel_estimate(*args)

    def expert_parallel_estimate(self, *args: Any) -> Any:
        # one expert-parallel rank's sub-profiles under a fake process group
        return self.inner.expert_parallel_estimate(*args)

    def context_parallel_estimate(self, *args: Any) -> Any:
        # one context-parallel rank's sub-profile under a fake process group
        return self.inner.context_parallel_estimate(*args)

    def expert_parallel_refusal(self, ep: int) -> str | None:
        refusal: str | None = self.inner.expert_parallel_refusal(ep)
        return refusal

    def tensor_parallel_cached(self, *args: Any) -> bool:
        return bool(self.inner.tensor_parallel_cached(*args))

    def tensor_parallel_refusal(self, tp: int) -> str | None:
        refusal: str | None = self.inner.tensor_parallel_refusal(tp)
        return refusal

    def context_parallel_refusal(self) -> str | None:
        refusal: str | None = self.inner.context_parallel_refusal()
        return refusal

    def pipeline_parallel_refusal(
        self, pp: int, stages_per_rank: int = 1, tp: int = 1
    ) -> str | None:
        refusal: str | None = self.inner.pipeline_parallel_refusal(pp, stages_per_rank, tp)
        return refusal

    def pipeline_stage_peaks(self, *args: Any) -> Any:
        # each pipeline stage's step on fake tensors, run by the wrapped source
        return self.inner.pipeline_stage_peaks(*args)

    def quantized_profile(self, *args: Any) -> Any:
        # a profile of bitsandbytes' quantized meta copy, made by the wrapped source
        return self.inner.quantized_profile(*args)

    def float8_fsdp_step(self, *args: Any) -> Any:
        # one FSDP2 rank's float8 all-gather step on fake tensors, run by the wrapped source
        return self.inner.float8_fsdp_step(*args)

    def float8_fsdp_cached(self, *args: Any) -> bool:
        return bool(self.inner.float8_fsdp_cached(*args))

    def float8_profile(self, *args: Any) -> Any:
        # a profile of torchao's float8 conversion of a meta copy, made by the wrapped source
        return self.inner.float8_profile(*args)

    def kv_cache_profile(self, *args: Any) -> Any:
        # a profile of a meta copy with the quantized KV cache, made by the wrapped source
        return self.inner.kv_cache_profile(*args)

    def load_layout(self, *args: Any) -> Any:
        # read from a meta build of the model, no run: not cached on disk
        return self.inner.load_layout(*args)

    def generation(
        self,
        precision: Precision,
        seq_len: int | None,
        *,
        decode_steps: int = DECODE_STEPS_PROFILED,
        new_tokens: int | None = None,
    ) -> Any:
        return self._cached(
            "generation",
            (precision, seq_len, decode_steps, new_tokens),
            lambda: self.inner.generation(
                precision, seq_len, decode_steps=decode_steps, new_tokens=new_tokens
            ),
            None,
        )

    # -- reading and writing -----------------------------------------------------------------
    def _subject(self) -> Any:
        return self.inner.profiler.subject

    def _cached(
        self, method: str, args: tuple[Any, ...], run: Callable[[], Any], stepped: Levers | None
    ) -> Any:
        subject = self._subject()
        try:
            # parameters kept in their own dtype (PEFT's adapters) change half-precision answers
            key = call_key(method, *args, fixed_dtypes=subject.fixed_dtypes)
        except _Uncacheable:
            # an argument with no canonical form across processes (a user's optimizer class or
            # factory, known only by its identity): run, and store nothing
            return run()
        path = self.directory / self.key / f"{key}.pkl"
        entry = self._read(path)
        if entry is not None:
            if stepped is not None and entry["params_with_grad"] is not None:
                # what the training step would have said: the optimizer's state is made for
                # the parameters that got a gradient
                subject.params_with_grad[stepped] = set(entry["params_with_grad"])
            _rewarn(entry["warnings"])
            return entry["result"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run()
        # each distinct warning once (a warning in a loop is recorded at every pass here)
        stored: list[Stored] = list(
            dict.fromkeys(
                (_category_path(w.category), str(w.message), w.filename, w.lineno) for w in caught
            )
        )
        if not self.inner.profiler.real:  # a real-tensor fallback depends on values
            got_grad = subject.params_with_grad.get(stepped) if stepped is not None else None
            self._write(
                path,
                {
                    "format": CACHE_FORMAT,
                    "result": result,
                    "warnings": stored,
                    "params_with_grad": None if got_grad is None else sorted(got_grad),
                },
            )
        _rewarn(stored)
        return result

    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            if not isinstance(entry, dict) or entry.get("format") != CACHE_FORMAT:
                raise ValueError("not an entry of this cache format")
            return entry
        except (FileNotFoundError, NotADirectoryError):  # not cached (yet)
            return None
        except Exception as exc:
            warnings.warn(
                f"the cached profile {path} cannot be read ({type(exc).__name__}: {exc}); "
                "profiling the model again and replacing it",
                CacheWarning,
                stacklevel=5,
            )
            return None

    def _write(self, path: Path, entry: dict[str, Any]) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    pickle.dump(entry, f, protocol=5)
                os.replace(temp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
        except (OSError, pickle.PicklingError) as exc:
            where = str(self.directory)
            if where in _warned_dirs:
                return
            _warned_dirs.add(where)
            warnings.warn(
                f"profiles cannot be cached in {where} ({type(exc).__name__}: {exc}); the "
                f"model is profiled as without a cache. Set {CACHE_DIR_ENV} to a writable "
                f"directory, or {CACHE_ENV}=0 to turn the cache off",
                CacheWarning,
                stacklevel=5,
            )


def cached_source(
    inner: Any,
    cache: object,
    model: torch.nn.Module,
    named_inputs: Iterable[tuple[str, Any]],
    input_size: tuple[int, ...] | None,
    loss_fn: Callable[[Any], Any] | None,
    device: str,
    seq_axes: dict[str, int],
) -> Any:
    """``inner`` wrapped in a :class:`DiskCachedSource` where caching is on and the profile
    has a key; ``inner`` itself otherwise."""
    directory = cache_directory(cache)
    if directory is None:
        return inner
    key = profile_key(model, named_inputs, input_size, loss_fn, device, seq_axes)
    if key is None:
        return inner
    return DiskCachedSource(inner, directory, key)


__all__ = [
    "CACHE_FORMAT",
    "CacheWarning",
    "DiskCachedSource",
    "cache_directory",
    "cached_source",
    "call_key",
    "profile_key",
]
