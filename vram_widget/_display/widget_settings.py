"""The widget's settings as the estimate takes them, and their checks before any profiling:
the optimizer trait, the lever traits' arguments, the optimizer's stepping settings and a
``gpu=`` setting in any capacity form."""

from __future__ import annotations

import dataclasses
from typing import Any

import traitlets

from .._estimating.gpus import CUSTOM_GPU, GPUS, resolve_gpu
from .._estimating.levers import Levers
from .._estimating.options import Mode, optimizer_names
from .._estimating.recipe import Optimizer
from .._estimating.sharding import DEFAULT_GPUS_PER_NODE, resolve_parallel
from .._estimating.stepping import stepping_levers
from .optimizer_control import NO_OPTIMIZER
from .widget_controls import CHECKPOINT_OFF

__all__ = [
    "OptimizerTrait",
    "check_optimizer_settings",
    "checkpoint_arg",
    "gpu_settings",
    "trainable_arg",
]


class OptimizerTrait(traitlets.Unicode):
    """An optimizer name ``estimate`` takes (any of ``optimizer_names()`` when set, an
    implementation suffix included: ``"adamw-fused"``); ``None`` is stored as ``"none"``."""

    info_text = "an optimizer name of optimizer_names(), or None"

    def validate(self, obj: Any, value: Any) -> Any:
        if value is None:
            return NO_OPTIMIZER
        valid = (*optimizer_names(), NO_OPTIMIZER)
        key = value.strip().lower() if isinstance(value, str) else value
        if key not in valid:
            raise traitlets.TraitError(
                f"unknown optimizer {value!r}; valid values are "
                f"{', '.join(repr(n) for n in valid)}, or None"
            )
        return key


def checkpoint_arg(value: str) -> str | None:
    """The ``checkpoint`` trait as ``estimate`` takes it ("off": None)."""
    return None if value in (CHECKPOINT_OFF, "") else value


def trainable_arg(value: str) -> list[str] | None:
    """The ``trainable`` trait (comma-separated patterns) as ``estimate`` takes it."""
    patterns = [p.strip() for p in value.split(",") if p.strip()]
    return patterns or None


def check_optimizer_settings(settings: dict[str, Any]) -> None:
    """The optimizer's settings, checked before the model is run: its name, how it steps
    (``optimizer_in_backward``, ``set_to_none``), and what stepping in the backward cannot
    go with in training (micro-batches, several GPUs); each error names the valid forms."""
    try:
        name = OptimizerTrait("adam").validate(None, settings.get("optimizer", "adam"))
    except traitlets.TraitError as exc:
        raise ValueError(f"invalid setting: {exc}") from None
    in_backward = settings.get("optimizer_in_backward", False)
    set_to_none = settings.get("set_to_none", True)
    record = dataclasses.replace(
        Optimizer.parse(None if name == NO_OPTIMIZER else name),
        in_backward=in_backward,
        set_to_none=set_to_none,
    )  # a flag that is not a bool, or in backward with set_to_none=False: refused here
    if settings.get("mode", Mode.TRAIN.value) != Mode.TRAIN.value or (
        set_to_none and not in_backward
    ):
        return
    accumulation = settings.get("grad_accumulation", 1)
    parallel = resolve_parallel(
        settings.get("gpus", 1),
        settings.get("strategy", "ddp"),
        gpus_per_node=settings.get("gpus_per_node", DEFAULT_GPUS_PER_NODE),
    )
    if isinstance(accumulation, int):  # else the control's own check says why
        stepping_levers(Levers(grad_accumulation=accumulation), record, None, parallel)


def gpu_settings(value: Any) -> dict[str, Any]:
    """The ``gpu`` (and ``custom_gib``) traits for a ``gpu=`` setting in any capacity form."""
    if value == CUSTOM_GPU:
        return {"gpu": CUSTOM_GPU}
    target = resolve_gpu(value)
    if target.name in GPUS:
        return {"gpu": target.name}
    return {"gpu": CUSTOM_GPU, "custom_gib": target.memory_bytes / 2**30}
