"""Optimizers outside ``torch.optim``: the low-bit ones of bitsandbytes and torchao,
transformers' Adafactor, and a user's own callable, each built and stepped by its library.

What each keeps is read from the library's own ``step()`` on the fake parameters, never
from a formula:

* bitsandbytes ``AdamW8bit`` (``bitsandbytes/optim/optimizer.py``, ``Optimizer2State.
  init_state``, 0.50): for a parameter of at least ``min_8bit_size`` (4096) elements,
  ``state1`` / ``state2`` are uint8 tensors of the parameter's shape, ``absmax1`` /
  ``absmax2`` float32 tensors of one value per block of 256 elements, and ``qmap1`` /
  ``qmap2`` the optimizer's two 256-entry float32 maps (``name2qmap``, shared by every
  parameter); a smaller parameter keeps float32 ``state1`` / ``state2``. Its step is one
  custom op, ``bitsandbytes::optimizer_update_8bit_blockwise`` (or ``..._32bit``), updating
  the state in place. On CUDA it is one kernel call that allocates nothing
  (``bitsandbytes/backends/cuda/ops.py``, ``_optimizer_update_8bit_blockwise_impl`` and
  ``_optimizer_update_32bit_impl``: ``lib.c*_8bit_blockwise_grad_*`` on the given
  pointers), which is what the op's fake implementation (``bitsandbytes/_ops.py``) does
  (UNCONFIRMED on a GPU);
  its CPU kernel is Python over torch ops (``bitsandbytes/backends/cpu/ops.py``,
  ``_optimizer_update_8bit_blockwise_cpu``): it dequantizes both states to float32,
  updates them and the parameter, and quantizes them back, so its temporaries are those
  tensors. :class:`CpuKernels` runs that Python kernel on the fake tensors for a
  ``device="cpu"`` profile.
* bitsandbytes ``PagedAdamW8bit``: the same, with ``state1`` / ``state2`` of a parameter
  of at least 1e5 elements in CUDA unified memory (``Optimizer8bit.get_state_buffer``:
  ``F.get_paged`` -> ``cget_managed_ptr``, ``cudaMallocManaged``), outside PyTorch's
  caching allocator: the driver pages them between host and device on demand, so they are
  not in ``torch.cuda.max_memory_allocated`` and are reported apart (``paged_bytes``). On
  CPU, bitsandbytes 0.50 warns and allocates them as ordinary tensors (the same function).
* torchao ``AdamW8bit`` / ``AdamW4bit`` (``torchao/optim/adam.py``, ``_AdamBase.
  _new_buffer``, 0.18): a parameter of at least 4096 elements whose count divides by the
  block size (256 for 8-bit, 128 for 4-bit) keeps each state as a tensor subclass of codes
  (uint8; two 4-bit codes a byte), one float32 scale per block and its own float32 qmap
  (256 or 16 entries); any other parameter keeps full-precision state. Read through the
  subclass's ``__tensor_flatten__``. Its step is ``torch.compile``'d (:func:`eager_step`).
* transformers ``Adafactor`` with the Trainer's ``optim="adafactor"`` settings.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._estimating.options import (
    OPTIMIZER_PACKAGES,
    CustomOptimizer,
    OptimizerChoice,
    OptimizerName,
    require_optimizer_library,
)
from .._estimating.profile_source import ProfilingError

# bitsandbytes keeps a paged state tensor of a parameter this large in CUDA unified memory
# (bitsandbytes/optim/optimizer.py, Optimizer8bit.get_state_buffer: ``if not self.is_paged
# or p.numel() < 1e5: torch.zeros_like(...)`` else ``F.get_paged``); 0.50.
BNB_PAGED_MIN_NUMEL = 100_000
# The state keys get_state_buffer allocates (init_state of Optimizer2State); absmax and the
# qmaps are ordinary torch tensors (the same function).
BNB_PAGED_KEYS = ("state1", "state2")
# transformers' Trainer builds optim="adafactor" as Adafactor(params, lr=learning_rate,
# scale_parameter=False, relative_step=False) (transformers/trainer_optimizer.py,
# _get_adafactor, 5.x); TrainingArguments.learning_rate defaults to 5e-5.
ADAFACTOR_KWARGS: dict[str, Any] = {"lr": 5e-5, "scale_parameter": False, "relative_step": False}


def library_optimizer(name: OptimizerName) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """The factory of a library optimizer, the library imported when asked (hyper-parameters
    are the library's defaults; they do not change memory)."""
    require_optimizer_library(name)
    if name in (OptimizerName.ADAMW8BIT, OptimizerName.PAGED_ADAMW8BIT):
        import bitsandbytes as bnb

        cls = bnb.optim.AdamW8bit if name is OptimizerName.ADAMW8BIT else bnb.optim.PagedAdamW8bit
        return lambda params: cls(params)
    if name in (OptimizerName.ADAMW8BIT_TORCHAO, OptimizerName.ADAMW4BIT_TORCHAO):
        import torchao.optim

        ao = (
            torchao.optim.AdamW8bit
            if name is OptimizerName.ADAMW8BIT_TORCHAO
            else torchao.optim.AdamW4bit
        )
        return lambda params: ao(params)
    if name is OptimizerName.ADAFACTOR:
        from transformers.optimization import Adafactor

        return lambda params: Adafactor(params, **ADAFACTOR_KWARGS)
    raise KeyError(name)


def is_library_optimizer(choice: OptimizerChoice) -> bool:
    """Whether ``choice`` is built here rather than from the ``torch.optim`` registry."""
    return isinstance(choice, CustomOptimizer) or choice in _LIBRARY_NAMES


_LIBRARY_NAMES = frozenset(
    {
        OptimizerName.ADAMW8BIT,
        OptimizerName.PAGED_ADAMW8BIT,
        OptimizerName.ADAMW8BIT_TORCHAO,
        OptimizerName.ADAMW4BIT_TORCHAO,
        OptimizerName.ADAFACTOR,
    }
)


def build_optimizer(choice: OptimizerChoice, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """A library optimizer or a user's callable over ``params``; a callable that fails or
    returns something else than an optimizer is named in the error."""
    if isinstance(choice, CustomOptimizer):
        try:
            with _quiet_library_warnings():
                opt = choice.factory(params)
        except Exception as exc:
            raise ProfilingError(
                f"the optimizer callable {choice.label!r} failed when called with the "
                f"parameters: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer callable {choice.label!r} must return a "
                f"torch.optim.Optimizer, got {type(opt).__name__}"
            )
        return opt
    with _quiet_library_warnings():
        return library_optimizer(choice)(params)


@contextlib.contextmanager
def _quiet_library_warnings() -> Iterator[None]:
    """bitsandbytes warns that paged optimizers fall back to ordinary tensors on CPU
    (``Optimizer8bit.get_state_buffer``): the estimate says so itself (``paged_bytes``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        yield


def state_tensors(value: object) -> list[torch.Tensor]:
    """The plain tensors holding one optimizer-state value: itself, or the inner tensors
    of a tensor subclass (torchao's ``OptimState8bit`` holds ``codes``, ``scale`` and
    ``qmap``, read through ``__tensor_flatten__``); nothing for a non-tensor.

    Examples
    --------
    >>> import torch
    >>> [t.shape for t in state_tensors(torch.zeros(3))], state_tensors(7)
    ([torch.Size([3])], [])
    """
    if not isinstance(value, torch.Tensor):
        return []
    flatten = getattr(type(value), "__tensor_flatten__", None)
    if flatten is None:
        return [value]
    names, _ctx = value.__tensor_flatten__()  # type: ignore[attr-defined]
    out: list[torch.Tensor] = []
    for name in names:
        out.extend(state_tensors(getattr(value, name)))
    return out


def is_paged_state(opt: torch.optim.Optimizer, param: torch.Tensor, key: str) -> bool:
    """Whether bitsandbytes keeps this state tensor in CUDA unified memory on a CUDA
    device (see :data:`BNB_PAGED_MIN_NUMEL`)."""
    return (
        bool(getattr(opt, "is_paged", False))
        and key in BNB_PAGED_KEYS
        and param.numel() >= BNB_PAGED_MIN_NUMEL
    )


class CpuKernels(TorchDispatchMode):
    """Runs bitsandbytes' CPU optimizer kernels (Python over torch ops,
    ``bitsandbytes/backends/cpu/ops.py``) on fake or meta tensors, in place of the ops'
    fake implementations, which allocate nothing: so the CPU step's temporaries (the
    float32 dequantized states, the re-quantized codes and block maxima) are traced. The
    ops these kernels call (``dequantize_blockwise``, ``quantize_blockwise``) have fake
    implementations of the real kernels' output sizes (``bitsandbytes/_ops.py``)."""

    def __init__(self) -> None:
        super().__init__()
        from bitsandbytes.backends.cpu import ops as cpu_ops

        ops = torch.ops.bitsandbytes
        self.kernels: dict[Any, Callable[..., Any]] = {
            ops.optimizer_update_8bit_blockwise.default: (
                cpu_ops._optimizer_update_8bit_blockwise_cpu
            ),
            ops.optimizer_update_32bit.default: cpu_ops._optimizer_update_32bit_cpu,
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kernel = self.kernels.get(func)
        if kernel is not None:
            return kernel(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def cuda_default_foreach(opt: torch.optim.Optimizer) -> None:
    """A user's ``torch.optim`` optimizer (or a subclass) left at ``foreach=None`` runs
    foreach on CUDA parameters (``torch.optim.optimizer._default_to_fused_or_foreach``: every
    parameter on a foreach-capable device, not differentiable), but on the fake parameters
    that check sees a FakeTensor and picks the loop (``step.make_optimizer``): so for a
    ``device="cuda"`` trace the groups ask for foreach, as CUDA would choose."""
    for group in opt.param_groups:
        if (
            "foreach" in group
            and group["foreach"] is None
            and not group.get("fused")
            and not group.get("differentiable")
        ):
            group["foreach"] = True


def unpaged(opt: torch.optim.Optimizer) -> None:
    """Make a bitsandbytes paged optimizer allocate its state as ordinary tensors on the
    parameters' (fake or meta) device, as its CPU branch does (``Optimizer8bit.
    get_state_buffer``: ``torch.zeros_like(p, dtype=dtype, device=p.device)``): the trace
    then counts the paged tensors apart (:func:`is_paged_state`), since unified memory
    cannot be allocated for tensors without data."""
    if getattr(opt, "is_paged", False):

        def zeros(p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros_like(p, dtype=dtype, device=p.device)

        opt.get_state_buffer = zeros  # type: ignore[attr-defined]


def cpu_kernels(opt: torch.optim.Optimizer) -> contextlib.AbstractContextManager[Any]:
    """:class:`CpuKernels` for a bitsandbytes optimizer, else a no-op context."""
    if type(opt).__module__.startswith("bitsandbytes"):
        return CpuKernels()
    return contextlib.nullcontext()


@contextlib.contextmanager
def eager_step(opt: torch.optim.Optimizer) -> Iterator[None]:
    """torchao's low-bit Adam compiles its per-parameter update (``torchao/optim/adam.py``,
    ``_AdamBase.step``: ``torch.compile(single_param_adam, fullgraph=True,
    dynamic=False)``), and torch.compile refuses to trace under a dispatch mode (the
    recorder): the update runs eagerly here, so its temporaries are those of the eager
    ops, not the compiled kernel's (Inductor's buffers are allocated outside the dispatcher
    and cannot be traced; docs/known-gaps.md gives the measured difference)."""
    if not type(opt).__module__.startswith("torchao"):
        yield
        return
    real = torch.compile

    def eager(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        return fn

    torch.compile = eager  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = real


class OpWatch(TorchDispatchMode):
    """Notes the first op whose kernel raised, so that a failing optimizer step can name it."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: str = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            self.failed = self.failed or str(func)
            raise


# DTensor's dispatch refuses an op over a list mixing DTensors and plain tensors
# (torch/distributed/tensor/_dispatch.py: "got mixed torch.Tensor and DTensor"); a foreach or
# fused step runs one op over each group of parameters of one device and dtype
# (torch/optim/optimizer.py, ``_group_tensors_by_device_and_dtype``), so a group that mixes
# a tensor-parallel plan's DTensors with the parameters it leaves plain fails in torch's own
# step, on any device. A for-loop step runs one parameter at a time and steps them.
_MIXED_DTENSOR = "got mixed torch.Tensor and DTensor"


def mixed_dtensor_refusal(choice: OptimizerChoice, plain: list[str], kind: str) -> str:
    """Why a ``kind`` ("foreach" or "fused") step of ``choice`` cannot step parameters of
    which ``plain`` (names) are plain tensors and the others DTensors."""
    label = choice.value
    shown = ", ".join(plain[:3]) + (f" and {len(plain) - 3} more" if len(plain) > 3 else "")
    forloop = (
        f"optimizer='{label}-forloop'"
        if f"{label}-forloop" in _forloop_names()
        else ("a for-loop step (a callable optimizer= that builds it with foreach=False)")
    )
    return (
        f"optimizer {label!r} with torch.optim's {kind} step cannot step this rank: its "
        f"parameters mix DTensors (the tensor-parallel plan's) and plain tensors ({shown}), "
        f"and a {kind} step over one group mixing them raises {_MIXED_DTENSOR!r} in torch's "
        "own step too (DTensor's dispatch). Ask for " + forloop + ", or a plan that makes "
        "every parameter a DTensor"
    )


def _forloop_names() -> tuple[str, ...]:
    from .._estimating.options import optimizer_names

    return tuple(name for name in optimizer_names() if name.endswith("-forloop"))


def check_mixed_dtensors(
    choice: OptimizerChoice, named: list[tuple[str, torch.Tensor]], kind: str | None
) -> None:
    """Refuse (ValueError, :func:`mixed_dtensor_refusal`) a foreach or fused step (``kind``;
    None or "forloop": nothing to check) over ``named`` parameters that mix DTensors and
    plain tensors."""
    if kind not in ("foreach", "fused"):
        return
    if not isinstance(choice, OptimizerName) or choice in OPTIMIZER_PACKAGES:
        return  # not torch.optim's: its own step says what it cannot take (named_failure)
    from .tensor_parallel import DTENSOR_TYPES

    plain = [name for name, p in named if type(p) not in DTENSOR_TYPES]
    if plain and len(plain) < len(named):
        raise ValueError(mixed_dtensor_refusal(choice, plain, kind))


@contextlib.contextmanager
def named_failure(choice: OptimizerChoice, watch: OpWatch) -> Iterator[None]:
    """Re-raise a failing ``step()`` of a user's (or a library's) optimizer on fake
    tensors as a ProfilingError naming the optimizer and the op that failed."""
    try:
        with _quiet_library_warnings():
            yield
    except ProfilingError:
        raise
    except Exception as exc:
        label = choice.value
        if _MIXED_DTENSOR in str(exc):  # an optimizer whose own default is a foreach step
            raise ValueError(
                f"optimizer {label!r} cannot step this rank: its step runs one op over "
                f"parameters that mix DTensors (the tensor-parallel plan's) and plain "
                f"tensors, which raises {_MIXED_DTENSOR!r} in torch's own step too "
                "(DTensor's dispatch). Ask for a step that takes one parameter at a time, "
                "or a plan that makes every parameter a DTensor"
            ) from exc
        at = f" at {watch.failed}" if watch.failed else ""
        raise ProfilingError(
            f"optimizer {label!r} failed in its step() on fake tensors{at}: "
            f"{type(exc).__name__}: {exc}. Its step must run on tensors without data "
            "(meta / fake tensors): no .item(), .tolist() or data_ptr()"
        ) from exc


def each_state(
    opt: torch.optim.Optimizer, params: Iterable[torch.Tensor]
) -> Iterator[tuple[torch.Tensor, str, torch.Tensor]]:
    """``(parameter, key, tensor)`` for every plain tensor of every parameter's state."""
    for p in params:
        for key, value in opt.state.get(p, {}).items():
            for tensor in state_tensors(value):
                yield p, key, tensor
