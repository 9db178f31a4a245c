"""The widget's settings as the estimate takes them, and their checks before any profiling:
the optimizer trait, the lever traits' arguments (activation offloading's included), the
optimizer's stepping settings and a ``gpu=`` setting in any capacity form."""

from __future__ import annotations

import dataclasses
from typing import Any

import traitlets

from .._estimating.checkpoint_policy import CheckpointPolicyName
from .._estimating.gpus import CUSTOM_GPU, GPUS, resolve_gpu
from .._estimating.levers import Levers
from .._estimating.offloading import resolve_offload
from .._estimating.options import Mode, optimizer_names
from .._estimating.recipe import Optimizer
from .._estimating.recipe.weights import Weights, weight_format
from .._estimating.sharding import DEFAULT_GPUS_PER_NODE, resolve_parallel
from .._estimating.stepping import stepping_levers
from .optimizer_control import NO_OPTIMIZER
from .widget_controls import CHECKPOINT_OFF, OFFLOAD_OFF, POLICY_NAMES

__all__ = [
    "OffloadTrait",
    "OptimizerTrait",
    "check_optimizer_settings",
    "check_policy_value",
    "checkpoint_arg",
    "gpu_settings",
    "offload_arg",
    "offload_choice",
    "paired_checkpoint",
    "policy_arg",
    "trainable_arg",
    "weights_arg",
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


def check_policy_value(value: object) -> None:
    """The ``checkpoint_policy`` trait's forms: "off", "full", "op" or an int k >= 1 (a
    TypeError / ValueError naming them; k's bound is the model's, which ``levers`` checks).

    Examples
    --------
    >>> check_policy_value("op"), check_policy_value(2)
    (None, None)
    >>> check_policy_value("sometimes")
    Traceback (most recent call last):
    ...
    ValueError: checkpoint_policy='sometimes': the widget takes 'off', 'full', 'op' or an int ...
    """
    forms = (
        "the widget takes 'off', 'full', 'op' or an int k >= 1 (every k-th block); a "
        "callable policy is estimated with profile.estimate(checkpoint_policy=...)"
    )
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise TypeError(f"checkpoint_policy={value!r} ({type(value).__name__}): {forms}")
    if isinstance(value, str) and value not in POLICY_NAMES:
        raise ValueError(f"checkpoint_policy={value!r}: {forms}")
    if isinstance(value, int) and value < 1:
        raise ValueError(f"checkpoint_policy={value}: {forms}")


def policy_arg(value: str | int) -> str | int | None:
    """The ``checkpoint_policy`` trait as ``estimate`` takes it ("off": None)."""
    return None if value == CHECKPOINT_OFF else value


def paired_checkpoint(
    checkpoint: str, policy: str | int, moved: str | None
) -> tuple[str, str | int]:
    """The ``checkpoint`` and ``checkpoint_policy`` traits after ``moved`` (one of them, or
    None at the start): they are "off" together. A policy with checkpointing off
    checkpoints the "auto" blocks (as ``estimate(checkpoint_policy=...)`` alone does);
    checkpointing turned on with the policy off is "full" (``torch.utils.checkpoint`` on
    each block, the default); either turned off turns the other off.

    Examples
    --------
    >>> paired_checkpoint("off", "op", "checkpoint_policy")
    ('auto', 'op')
    >>> paired_checkpoint("off", "op", "checkpoint")
    ('off', 'off')
    >>> paired_checkpoint("auto", "off", None), paired_checkpoint("Block", 2, "checkpoint")
    (('auto', 'full'), ('Block', 2))
    """
    off = CHECKPOINT_OFF
    if moved == "checkpoint_policy" and policy == off:
        return off, off
    if moved == "checkpoint" and checkpoint_arg(checkpoint) is None:
        return checkpoint, off
    if policy != off and checkpoint_arg(checkpoint) is None:
        return "auto", policy
    if policy == off and checkpoint_arg(checkpoint) is not None:
        return checkpoint, CheckpointPolicyName.FULL.value
    return checkpoint, policy


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


class OffloadTrait(traitlets.Unicode):
    """``offload_activations`` as the control holds it: "off", "torchtune" or
    "save_on_cpu"; estimate's None and False are stored as "off", True as "torchtune"."""

    info_text = "'off', 'torchtune' or 'save_on_cpu' (or None, False, True)"

    def validate(self, obj: Any, value: Any) -> Any:
        try:
            return offload_choice(value)
        except (TypeError, ValueError) as exc:
            raise traitlets.TraitError(str(exc)) from None


def offload_choice(value: object) -> str:
    """Any form ``estimate``'s ``offload_activations`` takes, or "off", as the trait holds
    it (a TypeError / ValueError naming the valid forms).

    Examples
    --------
    >>> offload_choice(True), offload_choice(None), offload_choice("off")
    ('torchtune', 'off', 'off')
    >>> offload_choice("nvme")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: offload_activations='nvme': offload_activations takes None or False (off), ...
    """
    if value == OFFLOAD_OFF and isinstance(value, str):
        return OFFLOAD_OFF
    offload = resolve_offload(value)
    return OFFLOAD_OFF if offload is None else offload.value


def offload_arg(choice: str) -> str | None:
    """The trait's value as ``estimate`` takes it (None: off).

    Examples
    --------
    >>> offload_arg("off"), offload_arg("save_on_cpu")
    (None, 'save_on_cpu')
    """
    return None if choice == OFFLOAD_OFF else choice


def weights_arg(choice: str | None, precision: str) -> Weights | None:
    """The ``weights`` trait's value as ``estimate``'s keyword: None for None, else
    ``Linear4bit`` computing in the precision's dtype (bf16 / fp16; fp32 otherwise), with
    double quantization for ``"nf4-dq"``; ``"int8"``: ``Linear8bitLt`` at threshold 0;
    ``"int8-torchao"`` / ``"int4-torchao"`` / ``"nf4-torchao"``: torchao's formats at their
    defaults.

    Examples
    --------
    >>> weights_arg("nf4-dq", "bf16")
    Weights(format=<WeightFormat.NF4: 'nf4'>, compute_dtype='bfloat16', double_quant=True, ...)
    >>> weights_arg(None, "bf16") is None
    True
    >>> weights_arg("int4-torchao", "bf16").describe()
    'int4-torchao (torchao int4 weight-only, groups of 128: Int4OpaqueTensor on the CPU)'
    """
    if choice is None:
        return None
    if choice == "int8":  # without the outlier split, whose memory depends on values
        return Weights(weight_format(choice), int8_threshold=0.0)
    if choice.endswith("-torchao"):  # torchao's defaults: no compute dtype of its own
        return Weights(weight_format(choice))
    compute = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")
    fmt = choice.removesuffix("-dq")
    return Weights(weight_format(fmt), compute_dtype=compute, double_quant=choice != fmt)
