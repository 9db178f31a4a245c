"""Every import from a private torch namespace lives here, so that a torch release that moves
one of them breaks one file, and the rest of the package only uses public names.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint_module
from torch._C._autograd import _get_sequence_nr
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .tensor_parallel import DTENSOR_TYPES

# torch.Tag.inplace arrived after 2.11 (native_functions.yaml tags); where it is missing, an
# in-place op is one whose schema writes its first argument in place (``Tensor(a!) self``)
# under a trailing-underscore name, the convention native_functions.yaml follows.
_INPLACE_TAG = getattr(torch.Tag, "inplace", None)


def is_in_place(func: Any) -> bool:
    """Whether an ATen op writes its first argument in place (``add_``, ``_foreach_mul_``)."""
    if _INPLACE_TAG is not None:
        return _INPLACE_TAG in func.tags
    schema = func._schema
    if not schema.name.endswith("_") or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


try:  # private, and not in every torch the package accepts: see _cheap_keys_fit
    from torch._subclasses.fake_tensor import (
        _DISPATCH_HANDLE_DIRECTLY,
        _DISPATCH_META_HANDLERS,
        _BypassDispatchCache,
        in_kernel_invocation_manager,
    )
except ImportError:  # pragma: no cover - older torch

    class _BypassDispatchCache(Exception):  # type: ignore[no-redef]
        """Stand-in; the subclass that raises it is not used on such a torch."""


__all__ = [
    "DATA_DEPENDENT_ERRORS",
    "FakeTensor",
    "FakeTensorMode",
    "MetaShortcuts",
    "TorchDispatchMode",
    "checkpoint_recompute_context",
    "current_autograd_node_name",
    "current_autograd_sequence_nr",
    "ddp_bucket_sizes",
    "new_fake_mode",
    "next_sequence_nr",
    "quiet_fake_tensor_log",
    "quiet_third_party",
    "quieted",
    "reparametrized",
    "tree_flatten",
    "tree_map",
]

# Errors a FakeTensor raises when an op's output depends on tensor values (``nonzero``,
# ``.item()``, ...) or when an op has no fake/meta kernel: the profiler falls back to a
# real run at a tiny batch for these.
DATA_DEPENDENT_ERRORS: tuple[type[BaseException], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)


# Marks a tensor in the cache keys of _ProfilingFakeTensorMode: its keys hold tensors in
# their own (shorter) form, so they can never equal a key of another FakeTensorMode of the
# process, which shares the same class-level cache.
_TENSOR_KEY = object()
# Argument types hashed as (type, value), as FakeTensorMode does for every plain value.
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)


class _ProfilingFakeTensorMode(FakeTensorMode):
    """FakeTensorMode with a cheaper dispatch-cache key for plain dense fake tensors.

    A cache hit costs mostly its key: per tensor argument, the stock key builds a
    ``TensorMetadata`` dataclass (memory-format, sparsity and contiguity checks in Python)
    and flattens each field recursively. Here a dense, non-symbolic fake tensor of this mode
    becomes one tuple of the same facts read from C++ (dtype, sizes, strides, device, storage
    offset and bytes, requires_grad, conj/neg bits, inference flag; the memory format the
    stock key stores follows from the sizes and strides). Anything else (symbolic sizes,
    sparse or constant tensors, other types) takes the stock path, argument by argument.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Without this, TorchDispatchMode.__init_subclass__ wraps the __torch_dispatch__
        # below in torch._disable_dynamo (torch/utils/_python_dispatch.py), the wrapper it
        # is written to go without: no torch.compile frame is traced inside a profiling run.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """``FakeTensorMode.dispatch`` without what a profile does not need on each of its
        ~10,000 ops: the ``torch._dynamo`` disable wrapper and the op counter around
        ``__torch_dispatch__``, and the ``no_dispatch()`` context around a debug log line
        (7-10 % of a ResNet-50 profile, measured A/B). What it dispatches to is the stock code."""
        handler = _DISPATCH_META_HANDLERS.get(func)
        if handler is not None:  # prim.device, prim.layout, ...: answered from metadata
            return handler(args)
        kwargs = kwargs or {}
        if func in _DISPATCH_HANDLE_DIRECTLY:
            with in_kernel_invocation_manager(self):
                return func(*args, **kwargs)
        if self.cache_enabled:
            return self._cached_dispatch_impl(func, types, args, kwargs)
        return self._dispatch_impl(func, types, args, kwargs)

    def _prep_args_for_hash(
        self,
        result: list[object],
        args: Any,
        state: Any,
        id_hashed_objects: list[object],
    ) -> None:
        if isinstance(args, (list, tuple, dict)):
            result.append(type(args))
            result.append(f"length_{len(args)}")
        if isinstance(args, dict):
            self._prep_args_for_hash(result, args.keys(), state, id_hashed_objects)
            self._prep_args_for_hash(result, args.values(), state, id_hashed_objects)
            return
        for arg in args:
            kind = type(arg)
            if kind in _PLAIN:
                result.append(kind)
                result.append(arg)
            elif kind is FakeTensor and self._plain_fake(arg):
                if arg.constant is not None:
                    raise _BypassDispatchCache("constant attribute")
                result.append(_TENSOR_KEY)
                result.append(
                    (
                        arg.dtype,
                        tuple(arg.shape),
                        arg.stride(),
                        arg.fake_device,
                        arg.storage_offset(),
                        arg.untyped_storage().nbytes(),
                        arg.requires_grad,
                        arg.is_conj(),
                        arg.is_neg(),
                        arg.is_inference(),
                    )
                )
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                super()._prep_args_for_hash(result, iter((arg,)), state, id_hashed_objects)

    def _plain_fake(self, t: FakeTensor) -> bool:
        return (
            t.fake_mode is self
            and t.layout is torch.strided
            and not t.is_quantized
            and not t._has_symbolic_sizes_strides
        )


def _meta_only(*groups: Any) -> bool | None:
    """True when the tensors among the arguments (tensors and lists of them) are all on the
    meta device, False when one is not, None when there is none."""
    found: bool | None = None
    for group in groups:
        for arg in group:
            if isinstance(arg, torch.Tensor):
                if arg.device.type != "meta":
                    return False
                found = True
            elif isinstance(arg, (list, tuple)):
                inner = _meta_only(arg)
                if inner is False:
                    return False
                found = found or inner
    return found


def _meta_key(arg: object) -> object:
    """A hashable stand-in for one argument of a meta op: a tensor by the facts its meta kernel
    reads, plain values by themselves; TypeError for anything else."""
    if isinstance(arg, torch.Tensor):
        if arg.layout is not torch.strided:
            raise TypeError("not a strided tensor")
        return (arg.dtype, tuple(arg.shape), arg.stride(), arg.storage_offset(), arg.device.type)
    if isinstance(arg, (list, tuple)):
        return tuple(_meta_key(a) for a in arg)
    if isinstance(arg, (*_PLAIN, torch.memory_format)):
        return (type(arg), arg)
    raise TypeError(type(arg).__name__)


class MetaShortcuts(TorchDispatchMode):
    """Skips the work of pointwise meta kernels whose result is known without it.

    The optimizer trace runs ``torch.optim`` on meta tensors, where the kernels of
    ``addcmul_``, ``addcdiv_``, ``lerp_``, ``sqrt`` and their ``_foreach_`` forms are Python
    reference implementations (``torch._refs``, type promotion and broadcasting in Python):
    about 0.3 ms per tensor, a third of a ResNet-50 profile. Two shortcuts, for ops whose
    tensor arguments are all on the meta device (the optimizer's CPU ``step`` counters are
    real and always run):

    * an in-place pointwise op (``Tag.inplace`` with ``Tag.pointwise``, or an in-place
      ``_foreach_`` op; never an ``inplace_view`` op such as ``resize_``) allocates nothing
      and returns its ``self`` (``Tensor(a!)``) or nothing (``()``), so it is not run: a meta
      tensor has no values to update;
    * any other op that returns new tensors (no alias annotation on its returns) is run once
      per distinct argument metadata, and later calls get new meta tensors of the remembered
      sizes, strides and dtypes.

    The recorder above this mode sees every op and its outputs exactly as without it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._outputs: dict[tuple[object, ...], list[tuple[Any, ...]] | None] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t in DTENSOR_TYPES for t in types):
            return NotImplemented  # a DTensor's op: its local shards come back here
        kwargs = kwargs or {}
        if _meta_only(args, kwargs.values()) is not True:
            return func(*args, **kwargs)
        tags = func.tags
        schema = func._schema
        if (
            is_in_place(func)
            and torch.Tag.inplace_view not in tags
            and (torch.Tag.pointwise in tags or schema.name.startswith("aten::_foreach_"))
        ):
            return args[0] if schema.returns else None
        if any(r.alias_info is not None for r in schema.returns):
            return func(*args, **kwargs)
        try:
            key = (func, _meta_key(args), _meta_key(tuple(sorted(kwargs.items()))))
        except TypeError:
            return func(*args, **kwargs)
        if key in self._outputs:
            described = self._outputs[key]
            if described is not None:
                outs = [
                    torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                    for shape, stride, dtype in described
                ]
                return outs if isinstance(schema.returns[0].type, torch._C.ListType) else outs[0]
        result = func(*args, **kwargs)
        outs_list = result if isinstance(result, (list, tuple)) else [result]
        plain = (
            all(
                isinstance(o, torch.Tensor) and o.device.type == "meta" and o.storage_offset() == 0
                for o in outs_list
            )
            and len(schema.returns) == 1
        )
        self._outputs[key] = (
            [(tuple(o.shape), o.stride(), o.dtype) for o in outs_list] if plain else None
        )
        return result


def new_fake_mode(stock: bool = False) -> FakeTensorMode:
    """A FakeTensorMode that converts stray real tensors (constants held as plain attributes)
    on the fly instead of raising. Its dispatch cache stays on: it is shared across modes,
    so the second and later runs of a model mostly hit it (3-4x faster here).

    ``stock``: torch's own class, never the faster subclass, whose ``__torch_dispatch__``
    is not wrapped in ``torch._disable_dynamo``: where dynamo traces a model on its
    tensors (``compile``), it would trace into that dispatch and break the graph there."""
    mode_class = _ProfilingFakeTensorMode if _CHEAP_KEYS_FIT and not stock else FakeTensorMode
    return mode_class(allow_non_fake_inputs=True)


def _cheap_keys_fit() -> bool:
    """Whether this torch's private hooks have the signatures the subclass overrides and
    calls (torch 2.13's); any other torch (the package accepts >= 2.4) gets the stock mode,
    slower but never wrong."""
    if _BypassDispatchCache.__module__ == __name__:  # the stand-in: torch lacks the hooks
        return False
    expected = {
        "_prep_args_for_hash": ["self", "result", "args", "state", "id_hashed_objects"],
        "dispatch": ["self", "func", "types", "args", "kwargs"],
        "_cached_dispatch_impl": ["self", "func", "types", "args", "kwargs"],
        "_dispatch_impl": ["self", "func", "types", "args", "kwargs"],
    }
    try:
        for name, params in expected.items():
            if list(inspect.signature(getattr(FakeTensorMode, name)).parameters) != params:
                return False
    except (AttributeError, TypeError, ValueError):
        return False
    return isinstance(_DISPATCH_META_HANDLERS, dict)


_CHEAP_KEYS_FIT = _cheap_keys_fit()


@contextlib.contextmanager
def quieted(logger_name: str, level: int) -> Iterator[None]:
    """The named logger (and the children that inherit its level) silent below ``level``
    for the block, its own level restored after."""
    logger = logging.getLogger(logger_name)
    before = logger.level
    logger.setLevel(max(level, logger.getEffectiveLevel()))  # never louder than it was
    try:
        yield
    finally:
        logger.setLevel(before)


# The libraries a profile runs, whose log records during the fake runs are about those runs
# (transformers' "`loss_type=None` was set in the config but it is unrecognized", logged at
# WARNING by PreTrainedModel.loss_function on every GPT-2 with labels), not news for the user.
# torchao and bitsandbytes log at import (torchao: each CUDA extension it cannot load on a
# CPU-only build), which transformers triggers while it builds a model
_QUIET_LOGGERS = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "huggingface_hub",
    "torchao",
    "bitsandbytes",
)


@contextlib.contextmanager
def quiet_third_party() -> Iterator[None]:
    """Keep what third-party libraries log or warn during the block from the user.

    The loggers of :data:`_QUIET_LOGGERS` pass only ERROR and above; a Python warning whose
    ``warnings.warn`` call is in an installed library (a module under ``site-packages`` or
    ``dist-packages``, or the standard library) is not shown. Warnings that vram_widget
    itself issues, and those of the user's own code (a model defined in a notebook or a
    project), still reach the user, as do warnings that a filter turns into errors (a
    filter acts before anything is shown). Usable as a decorator."""
    shown = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if not _issued_by_library(sys._getframe(1)):
            shown(message, category, filename, lineno, file, line)

    with contextlib.ExitStack() as stack:
        for name in _QUIET_LOGGERS:
            stack.enter_context(quieted(name, logging.ERROR))
        warnings.showwarning = show
        try:
            yield
        finally:
            warnings.showwarning = shown


def _issued_by_library(frame: FrameType | None) -> bool:
    """Whether the first frame outside the ``warnings`` module, from ``frame`` outwards (the
    caller of ``warnings.warn``), is in an installed library other than vram_widget."""
    while frame is not None and frame.f_globals.get("__name__") == "warnings":
        frame = frame.f_back
    if frame is None:
        return False
    module = str(frame.f_globals.get("__name__", ""))
    top = module.partition(".")[0]
    if top == "vram_widget":
        return False
    parts = Path(frame.f_code.co_filename).parts
    return "site-packages" in parts or "dist-packages" in parts or top in sys.stdlib_module_names


def quiet_fake_tensor_log() -> contextlib.AbstractContextManager[None]:
    """FakeTensorMode logs a full traceback at ERROR level before re-raising a failed meta
    kernel; the profiler turns that failure into its own one-line message, so the log would
    only put a traceback wall in the user's notebook."""
    return quieted("torch._subclasses.fake_tensor", logging.CRITICAL)


@contextlib.contextmanager
def reparametrized(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Swap ``state`` (fake parameters and buffers) into ``module`` for the whole block.

    ``torch.func.functional_call`` swaps them only for the length of the forward call, so a
    forward that a checkpoint re-runs during the backward would see the module's own
    parameters there (a bf16 profile recomputing in fp32). This is the context manager
    ``functional_call`` itself uses (torch/nn/utils/stateless.py), held across forward,
    loss and backward; tied weights are tied as ``functional_call(tie_weights=True)`` ties
    them."""
    with _reparametrize_module(module, state, tie_weights=True, strict=False):
        _repoint_flat_weights(module)
        try:
            yield
        finally:
            _repoint_flat_weights(module)
    _repoint_flat_weights(module)


def _repoint_flat_weights(module: torch.nn.Module) -> None:
    """Point each RNN's ``_flat_weights`` (the list its forward reads) at the weights it
    holds now. ``nn.RNNBase.__setattr__`` keeps that list in step with ``self.weight_ih_l0 =
    ...`` (torch/nn/modules/rnn.py), but the swap above writes the parameter dicts
    directly, so without this a run reads the weights the module held before it, and the
    module keeps a run's fake weights after it (and later runs read those)."""
    for m in module.modules():
        if isinstance(m, torch.nn.RNNBase):
            m._flat_weights = [
                getattr(m, name) if hasattr(m, name) else None for name in m._flat_weights_names
            ]


@contextlib.contextmanager
def checkpoint_recompute_context(
    make_context: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Iterator[None]:
    """Make every non-reentrant ``torch.utils.checkpoint`` region that starts in this block
    re-run its forward (during the backward) inside ``make_context()`` as well.

    The forward ran inside the profiler's CUDA emulation (kernel choices, autocast lists); a
    recompute runs in the backward, outside it, and would save other tensors than the
    forward did ("a different number of tensors was saved"). On CUDA the recompute repeats
    the forward's kernel choices, and checkpoint restores CUDA autocast around it
    (torch/utils/checkpoint.py, ``_checkpoint_without_reentrant_generator``: ``recompute_fn``
    enters ``device_autocast_ctx`` and the ``recompute_context`` of ``context_fn``). Each
    region's ``context_fn`` is composed with ours by wrapping that generator function, which
    ``checkpoint`` looks up at call time, so it also reaches a ``functools.partial`` of
    ``checkpoint`` made earlier (Hugging Face's ``_gradient_checkpointing_func``)."""
    original = getattr(_checkpoint_module, "_checkpoint_without_reentrant_generator", None)
    if original is None:  # a torch without it: recomputes run as they are
        yield
        return

    def generator(
        fn: Any,
        preserve_rng_state: bool = True,
        context_fn: Callable[[], tuple[Any, Any]] = _checkpoint_module.noop_context_fn,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        def contexts() -> tuple[Any, Any]:
            forward, recompute = context_fn()
            return forward, _both(recompute, make_context)

        return original(fn, preserve_rng_state, contexts, *args, **kwargs)

    _checkpoint_module._checkpoint_without_reentrant_generator = generator
    try:
        yield
    finally:
        _checkpoint_module._checkpoint_without_reentrant_generator = original


@contextlib.contextmanager
def _both(
    first: contextlib.AbstractContextManager[Any],
    make_second: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Iterator[None]:
    with first, make_second():
        yield


def next_sequence_nr() -> int:
    """The sequence number autograd will give the next node created on this thread.

    Autograd creates an op's backward node before it redispatches below autograd, so inside
    ``__torch_dispatch__`` every node with a number below this one already exists.
    """
    return int(_get_sequence_nr())


def current_autograd_sequence_nr() -> int | None:
    """The sequence number of the autograd node whose backward is running, or None."""
    node: Any = torch._C._current_autograd_node()
    return None if node is None else int(node._sequence_nr())


def current_autograd_node_name() -> str | None:
    """The name of the autograd node whose backward is running (``"NllLossBackward0"``), or
    None outside one (the engine's own work between nodes)."""
    node: Any = torch._C._current_autograd_node()
    return None if node is None else str(node.name())


def checkpoint_wrapped(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` inside torch's own activation-checkpoint wrapper, non-reentrant: the
    wrapper torchtitan and torchtune put around each block (torch/distributed/algorithms/
    _checkpoint/checkpoint_wrapper.py, ``checkpoint_wrapper(..., CheckpointImpl.NO_REENTRANT)``
    calls ``torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False)``, so the
    block's own hooks run, and re-run, inside the checkpoint)."""
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


@contextlib.contextmanager
def recorded_cuda_memory(device: torch.device) -> Iterator[list[dict[str, Any]]]:
    """Record the CUDA caching allocator's history over the block
    (``torch.cuda.memory._record_memory_history``, Python stacks) and append its
    ``torch.cuda.memory._snapshot()`` to the yielded list at the end; recording stops in
    any case."""
    snapshots: list[dict[str, Any]] = []
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        yield snapshots
        snapshots.append(torch.cuda.memory._snapshot(device))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def ddp_bucket_sizes(model: torch.nn.Module) -> list[int]:
    """The bytes of each gradient bucket a ``DistributedDataParallel`` model's reducer holds
    now, from the reducer itself (``Reducer._get_zeros_like_grad_buckets``: a zero tensor
    shaped like each bucket, made and dropped here)."""
    buckets = model.reducer._get_zeros_like_grad_buckets()  # type: ignore[operator,union-attr]
    return [int(b.buffer().untyped_storage().nbytes()) for b in buckets]
