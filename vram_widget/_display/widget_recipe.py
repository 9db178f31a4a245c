"""A :class:`~vram_widget.Recipe` as the widget's starting state: the settings that have a
control become the controls' values; the others are held fixed beside them and passed to every
estimate; and what the config the Recipe was read from sets but the estimate leaves out stays
listed in the summary."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .._estimating.options import CustomOptimizer
from .._estimating.recipe import Recipe
from .._estimating.recipe.recipe import KEYWORD_FIELDS
from .widget_settings import offload_choice
from .widget_weights import recipe_weights_choice

__all__ = ["CONTROLLED", "RecipeSettings", "recipe_settings"]

# The Recipe's settings that have a control in the widget (a trait of the same name). Every
# other setting is held as the Recipe gives it, for every estimate of the widget (a setting
# the Recipe gains before the widget has a control for it is held too), but those in
# _NO_CONTROL, which the widget cannot hold.
CONTROLLED: tuple[str, ...] = (
    "batch_size", "seq_len", "precision", "mode", "optimizer", "optimizer_in_backward",
    "set_to_none", "expandable_segments", "checkpoint", "checkpoint_policy", "trainable",
    "grad_accumulation", "lora_rank", "loss_chunks", "offload_activations", "gpus", "strategy",
    "gpus_per_node", "new_tokens", "kv_cache", "kv_bits", "compile", "activation_memory_budget",
    "tp", "pp", "pp_schedule", "microbatches", "stages_per_rank", "ep", "cp", "weights", "float8",
)  # fmt: skip
# (compute_capability is the chosen GPU's, which the "GPU" control sets.)
_NO_CONTROL = ("rank", "base_quantization", "compute_capability")


@dataclasses.dataclass(frozen=True)
class RecipeSettings:
    """The controls' starting values, the settings held fixed, and the config's ignored
    settings, from one Recipe."""

    controls: Mapping[str, Any]
    fixed: Mapping[str, Any]
    ignored: tuple[str, ...]


def recipe_settings(recipe: object) -> RecipeSettings:
    """Split ``recipe`` into the widget's starting settings.

    Every setting that differs from a default Recipe's is kept: a control's value where the
    widget has one (:data:`CONTROLLED`), else held fixed (``lora_targets``, ``lora_dtype``,
    ``context_bytes``, ``lazy_loading``, ``fsdp_units``, the training loop's ``outputs``,
    ``loss_scaled``, ``carried_scalars``, ``clip_grad_norm``, ``param_groups``, and any
    other setting with no control). What the widget cannot hold is a ValueError naming it:
    a user's optimizer or checkpoint policy callable, a ``rank`` (the widget shows the
    worst rank), 4-bit base weights and a compute capability (the GPU control sets it).

    Examples
    --------
    >>> s = recipe_settings(Recipe().with_(batch_size=8, optimizer="adamw-fused",
    ...                                    lora_rank=8, lora_dtype="bf16", loss_chunks=8))
    >>> dict(s.controls)
    {'batch_size': 8, 'optimizer': 'adamw-fused', 'lora_rank': 8, 'loss_chunks': 8}
    >>> dict(s.fixed)
    {'lora_dtype': 'bf16'}
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a vram_widget.Recipe, got {type(recipe).__name__}")
    default = Recipe()
    controls: dict[str, Any] = {}
    fixed: dict[str, Any] = {}
    for key in KEYWORD_FIELDS:
        value = recipe.get(key)
        if value == default.get(key):
            continue
        if key in ("weights", "float8"):  # held as given where no choice of its control is it
            choice = recipe_weights_choice(key, value, recipe.step.precision.value)
            if choice is None:
                fixed[key] = value
            else:
                controls[key] = choice
        elif key not in CONTROLLED and key not in _NO_CONTROL:
            fixed[key] = value
        elif key in _NO_CONTROL:
            raise ValueError(
                f"the recipe's {key}={value!r} has no control in the widget (the GPU control "
                "sets the compute capability; the widget shows the worst rank); estimate it "
                "with profile.estimate(recipe=...)"
            )
        else:
            controls[key] = _control_value(key, value)
    return RecipeSettings(controls, fixed, tuple(recipe.ignored))


def _control_value(key: str, value: Any) -> Any:
    """A Recipe value as its control holds it."""
    if key == "optimizer":
        if value.name is None:
            return None
        if isinstance(value.name, CustomOptimizer):
            raise ValueError(
                f"the recipe's optimizer {value.name.value!r} is a callable, which the "
                "widget's optimizer control cannot hold; estimate it with "
                "profile.estimate(recipe=...)"
            )
        suffix = "" if value.implementation is None else f"-{value.implementation.value}"
        return f"{value.name.value}{suffix}"
    if key == "checkpoint_policy" and callable(value):
        name = getattr(value, "__qualname__", type(value).__name__)
        raise ValueError(
            f"the recipe's checkpoint_policy {name} is a callable, which the widget's "
            "checkpoint policy control cannot hold ('full', 'op' or every k-th block); "
            "estimate it with profile.estimate(recipe=...)"
        )
    if key == "offload_activations":
        return offload_choice(value)  # True: "torchtune", as estimate reads it
    if key in ("checkpoint", "trainable") and isinstance(value, tuple):
        return ",".join(value)  # the text boxes take comma-separated patterns
    return getattr(value, "value", value)  # an option's text
