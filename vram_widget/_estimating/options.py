"""The vocabulary shared by every stage: precisions, optimizers, modes, phases, categories.

No torch here: the estimator and the widget import this module too.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10 shim with the same behaviour for our use

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)


class Precision(StrEnum):
    """How parameters and activations are stored.

    ``fp32``/``bf16``/``fp16`` store everything in that dtype; ``amp-*`` keep fp32 master
    weights, gradients and optimizer state and run the forward under ``torch.autocast``.
    """

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    AMP_BF16 = "amp-bf16"
    AMP_FP16 = "amp-fp16"


class OptimizerName(StrEnum):
    """The optimizers the estimate can run by name (``None`` means no optimizer): the
    ``torch.optim`` classes, and the low-bit and factored optimizers of other libraries
    (bitsandbytes ``AdamW8bit`` / ``PagedAdamW8bit``, torchao ``AdamW8bit`` / ``AdamW4bit``,
    transformers ``Adafactor``), each installed apart (:data:`OPTIMIZER_PACKAGES`)."""

    SGD = "sgd"
    SGD_MOMENTUM = "sgd-momentum"
    ADAM = "adam"
    ADAMW = "adamw"
    ADAGRAD = "adagrad"
    RMSPROP = "rmsprop"
    ADAMW8BIT = "adamw8bit"
    PAGED_ADAMW8BIT = "paged-adamw8bit"
    ADAMW8BIT_TORCHAO = "adamw8bit-torchao"
    ADAMW4BIT_TORCHAO = "adamw4bit-torchao"
    ADAFACTOR = "adafactor"


# The library each optimizer outside torch.optim comes from: (module to import, the
# ``pip install`` that provides it). The extra ``vram_widget[optimizers]`` installs them all.
OPTIMIZER_PACKAGES: dict[OptimizerName, tuple[str, str]] = {
    OptimizerName.ADAMW8BIT: ("bitsandbytes", "pip install bitsandbytes"),
    OptimizerName.PAGED_ADAMW8BIT: ("bitsandbytes", "pip install bitsandbytes"),
    OptimizerName.ADAMW8BIT_TORCHAO: ("torchao", "pip install torchao"),
    OptimizerName.ADAMW4BIT_TORCHAO: ("torchao", "pip install torchao"),
    OptimizerName.ADAFACTOR: ("transformers", "pip install transformers"),
}


def require_optimizer_library(name: OptimizerName | None) -> None:
    """Raise an ImportError naming the ``pip install`` to run when ``name`` comes from a
    library that is not installed (checked without importing it).

    Examples
    --------
    >>> require_optimizer_library(OptimizerName.ADAMW)  # torch.optim: always there
    """
    if name not in OPTIMIZER_PACKAGES:
        return
    module, command = OPTIMIZER_PACKAGES[name]
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"optimizer {name.value!r} needs the {module} library, which is not installed: "
            f"run `{command}` (or `pip install vram_widget[optimizers]`)"
        )


@dataclasses.dataclass(frozen=True)
class CustomOptimizer:
    """An ``optimizer=`` given as a callable ``params -> torch.optim.Optimizer`` (an
    optimizer class or a ``functools.partial`` of one): its own ``step()`` is traced on the
    fake parameters. Equal (and hashed) by the callable's identity; ``value`` is its
    display name.

    Examples
    --------
    >>> import functools
    >>> class MySGD:  # stands for a torch.optim.Optimizer subclass
    ...     pass
    >>> CustomOptimizer(MySGD).value
    'MySGD'
    >>> CustomOptimizer(functools.partial(MySGD)).value
    'partial(MySGD)'
    """

    factory: Callable[..., Any]
    label: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if not callable(self.factory):
            raise TypeError(f"a custom optimizer must be callable, got {self.factory!r}")
        if not self.label:
            object.__setattr__(self, "label", _callable_name(self.factory))

    @property
    def value(self) -> str:
        """The display name (an :class:`OptimizerName`'s ``value`` is its name)."""
        return self.label

    def __str__(self) -> str:
        return self.label


def _callable_name(factory: Callable[..., Any]) -> str:
    if isinstance(factory, functools.partial):
        return f"partial({_callable_name(factory.func)})"
    return str(getattr(factory, "__qualname__", None) or type(factory).__qualname__)


# What names an optimizer: a registered name, or a user's callable.
OptimizerChoice = OptimizerName | CustomOptimizer


class OptimizerImplementation(StrEnum):
    """How ``torch.optim`` runs an optimizer's step: one fused kernel per parameter group
    (``fused=True``), ``_foreach_`` ops over the whole group (``foreach=True``), or a Python
    loop over the parameters one at a time (``foreach=False``). The memory differs: a foreach
    step's temporaries span the group, a loop's one parameter, a fused step has none; and a
    fused (or capturable) Adam keeps its ``step`` counters on the parameters' device
    (torch/optim/adam.py, ``Adam._init_group``)."""

    FUSED = "fused"
    FOREACH = "foreach"
    FORLOOP = "forloop"


# The optimizers torch.optim implements with ``fused=True`` too (torch 2.13: SGD and Adam /
# AdamW; ``_get_fused_kernels_supported_devices`` lists CUDA and CPU among others): each
# takes a ``-fused``, ``-foreach`` and ``-forloop`` suffix in an optimizer name.
IMPLEMENTED_OPTIMIZERS: tuple[OptimizerName, ...] = (
    OptimizerName.SGD,
    OptimizerName.SGD_MOMENTUM,
    OptimizerName.ADAM,
    OptimizerName.ADAMW,
)


def default_implementation(device: Device) -> OptimizerImplementation:
    """The implementation torch.optim picks when neither ``fused`` nor ``foreach`` is given.

    ``torch.optim.optimizer._default_to_fused_or_foreach`` (torch 2.13) picks foreach when
    every parameter is on a device of ``_get_foreach_kernels_supported_devices()`` (CUDA,
    XPU, MTIA, the private-use backend; not CPU) and the optimizer is not differentiable,
    and never fused unless asked: so foreach on CUDA, the for-loop on CPU.

    Examples
    --------
    >>> default_implementation(Device.CUDA), default_implementation(Device.CPU)
    (<OptimizerImplementation.FOREACH: 'foreach'>, <OptimizerImplementation.FORLOOP: 'forloop'>)
    """
    return (
        OptimizerImplementation.FOREACH
        if device is Device.CUDA
        else OptimizerImplementation.FORLOOP
    )


def optimizer_names() -> tuple[str, ...]:
    """Every name ``optimizer=`` accepts (besides None).

    Examples
    --------
    >>> "adamw-fused" in optimizer_names(), "rmsprop-fused" in optimizer_names()
    (True, False)
    >>> optimizer_names()[-1]
    'adafactor'
    """
    names = [m.value for m in OptimizerName if m not in OPTIMIZER_PACKAGES]
    for opt in IMPLEMENTED_OPTIMIZERS:
        names.extend(f"{opt.value}-{impl.value}" for impl in OptimizerImplementation)
    # then the other libraries' optimizers
    names.extend(m.value for m in OPTIMIZER_PACKAGES)
    return tuple(names)


def parse_optimizer_choice(
    value: object,
) -> tuple[OptimizerChoice | None, OptimizerImplementation | None]:
    """An optimizer name as ``(optimizer, implementation)``: ``"adamw-fused"`` is AdamW with
    ``fused=True``; a plain ``"adamw"`` leaves the implementation to torch's default for the
    device (None here; :func:`default_implementation`); None or ``"none"`` is no optimizer.

    Examples
    --------
    >>> parse_optimizer_choice("sgd-momentum-foreach")
    (<OptimizerName.SGD_MOMENTUM: 'sgd-momentum'>, <OptimizerImplementation.FOREACH: 'foreach'>)
    >>> parse_optimizer_choice("adam")
    (<OptimizerName.ADAM: 'adam'>, None)

    A callable ``params -> torch.optim.Optimizer`` is a :class:`CustomOptimizer`; a name
    from a library that is not installed raises an ImportError naming the ``pip install``.
    """
    if isinstance(value, (OptimizerName, CustomOptimizer)):
        require_optimizer_library(value if isinstance(value, OptimizerName) else None)
        return value, None
    if callable(value) and not isinstance(value, (str, type(None))):
        return CustomOptimizer(value), None
    if isinstance(value, str):
        key = value.strip().lower()
        for opt in IMPLEMENTED_OPTIMIZERS:
            for impl in OptimizerImplementation:
                if key == f"{opt.value}-{impl.value}":
                    return opt, impl
    try:
        name = parse_optimizer(value)
    except ValueError:
        valid = ", ".join(repr(n) for n in optimizer_names())
        raise ValueError(
            f"unknown optimizer {value!r}; valid values are {valid}, None, or a callable "
            "params -> torch.optim.Optimizer"
        ) from None
    require_optimizer_library(name)
    return name, None


class Mode(StrEnum):
    """One training step, one forward pass under ``torch.no_grad()``, or generation: a
    prompt's prefill and decode steps with the model's KV cache (Hugging Face's greedy
    ``model.generate``)."""

    TRAIN = "train"
    INFERENCE = "inference"
    GENERATE = "generate"


class StepOutputs(StrEnum):
    """How long a training step holds the model's outputs: ``KEPT`` to the end of the step
    (``output = model(x); loss = loss_fn(output)``, the output alive through the backward,
    the optimizer step and ``zero_grad``), or ``FREED`` right after the loss is computed,
    before the backward (Hugging Face ``Trainer.compute_loss`` returns the loss alone;
    torchtune's recipes ``del logits`` before the backward)."""

    KEPT = "kept"
    FREED = "freed"


class ParamGroups(StrEnum):
    """The optimizer's parameter groups: ``ONE`` holds every trainable parameter in the
    model's order; ``DECAY_SPLIT`` is Hugging Face ``Trainer.create_optimizer``'s two groups,
    the parameters weight decay applies to, then the others (norms and biases)."""

    ONE = "one"
    DECAY_SPLIT = "decay-split"


class FitBasis(StrEnum):
    """What "fits" compares with a capacity: ``ALLOCATED`` is the allocated peak plus the
    accelerator extras (``MemoryEstimate.total_bytes``); ``DEVICE`` replays the CUDA caching
    allocator under the capacity less the CUDA context and asks whether a segment it needs
    could not be reserved even after releasing its cached ones
    (``MemoryEstimate.fits_device``). On ``device="cpu"`` both are the allocated basis."""

    ALLOCATED = "allocated"
    DEVICE = "device"


class Strategy(StrEnum):
    """How a training step is spread over data-parallel ranks (``sharding``): DDP,
    ZeRO-1 (``ZeroRedundancyOptimizer``), ZeRO-2 / ZeRO-3 (FSDP2 ``fully_shard`` without /
    with resharding after the forward) and HSDP (ZeRO-3 in a node, replicated across)."""

    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    HSDP = "hsdp"


class PipelineSchedule(StrEnum):
    """How ``torch.distributed.pipelining`` orders a pipeline-parallel step's micro-batches:
    ``ScheduleGPipe`` (every forward, then every backward), ``Schedule1F1B`` (one forward,
    one backward in the steady state) or ``ScheduleInterleaved1F1B`` (several stages a rank)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"


class Device(StrEnum):
    """Whose kernels and defaults the estimate is for."""

    CUDA = "cuda"
    CPU = "cpu"


class Phase(StrEnum):
    """When an allocation happens within a step."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    ZERO_GRAD = "zero_grad"
    INFERENCE = "inference"
    # generation: the prompt's forward (and what generate sets up before it), then one
    # forward per new token after the first
    PREFILL = "prefill"
    DECODE = "decode"


class Category(StrEnum):
    """What a block of memory holds (PyTorch's own memory-snapshot vocabulary)."""

    PARAMETER = "Parameter"
    BUFFER = "Buffer"
    GRADIENT = "Gradient"
    OPTIMIZER_STATE = "Optimizer state"
    ACTIVATION = "Activation"
    TEMPORARY = "Temporary"
    INPUT = "Input"
    # buffers a data-parallel strategy keeps for its collectives (DDP's gradient buckets)
    COMMUNICATION = "Communication buffer"
    # the past keys and values a generating model keeps between its forwards
    KV_CACHE = "KV cache"


# Stable small-integer codes, used in the profile's numpy arrays.
PHASES: tuple[Phase, ...] = tuple(Phase)
CATEGORIES: tuple[Category, ...] = tuple(Category)
PHASE_CODE: dict[Phase, int] = {p: i for i, p in enumerate(PHASES)}
CATEGORY_CODE: dict[Category, int] = {c: i for i, c in enumerate(CATEGORIES)}

_E = TypeVar("_E", bound=StrEnum)


def parse_option(enum_type: type[_E], value: object, what: str) -> _E:
    """Return ``value`` as a member of ``enum_type`` or raise a ValueError listing valid values.

    Examples
    --------
    >>> parse_option(Precision, "bf16", "precision")
    <Precision.BF16: 'bf16'>
    """
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for member in enum_type:
            if member.value.lower() == key:
                return member
    valid = ", ".join(repr(m.value) for m in enum_type)
    raise ValueError(f"unknown {what} {value!r}; valid values are {valid}")


def parse_optimizer(value: object) -> OptimizerName | None:
    """Like :func:`parse_option` for optimizers, where ``None`` (or ``"none"``) means none."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    try:
        return parse_option(OptimizerName, value, "optimizer")
    except ValueError as exc:
        raise ValueError(f"{exc}, or None") from None


def parse_batch_size(value: object) -> int:
    """Validate a batch size: a positive Python int (bools and floats are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy integers are fine; anything else is a user error worth naming
        try:
            import numpy as np

            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise TypeError(
                f"batch_size must be a positive integer, got {value!r} ({type(value).__name__})"
            ) from None
    assert isinstance(value, int)
    if value < 1:
        raise ValueError(f"batch_size must be >= 1, got {value}")
    return value
