"""The settings ``measure`` runs a real step with: its keywords, or a Recipe and keywords that
agree with it (``Recipe.from_keywords``), resolved to one plain set of keywords."""

from __future__ import annotations

from typing import Any

from .._estimating.recipe import Recipe
from .._estimating.recipe.recipe import given

__all__ = ["MEASURED_SETTINGS", "measure_settings"]

MEASURED_SETTINGS = (
    "optimizer",
    "precision",
    "mode",
    "checkpoint",
    "checkpoint_policy",
    "trainable",
    "grad_accumulation",
    "lora_rank",
    "lora_targets",
    "lora_dtype",
    "weights",
    "float8",
    "float8_all_gather",
    "gpus",
    "strategy",
    "gpus_per_node",
    "fsdp_units",
    "tp",
    "tp_plan",
    "pp",
    "pp_schedule",
    "microbatches",
    "pp_split",
    "stages_per_rank",
    "ep",
    "new_tokens",
    "optimizer_in_backward",
    "set_to_none",
    "outputs",
    "loss_scaled",
    "clip_grad_norm",
    "param_groups",
    "carried_scalars",
    "loss_chunks",
    "offload_activations",
)
"""The Recipe settings a measured step runs with, by their flat names (``measure``'s
keywords)."""


def measure_settings(
    recipe: Recipe | None, batch_size: int, keywords: dict[str, Any]
) -> dict[str, Any]:
    """``measure``'s keywords (each of :data:`MEASURED_SETTINGS`) as the step will run them.

    Without ``recipe``: the keywords as given, each left out at its documented default.
    With one: the recipe's settings, a keyword given explicitly that disagrees with it being
    a ValueError naming both (as for ``ModelProfile.estimate``). A recipe setting that a
    measured step cannot follow is refused by name: a batch size other than the inputs'
    (and than the default 1), a sequence length (the inputs give it), a rank (every rank is
    measured) and ``expandable_segments``. The target GPU's settings
    (``compute_capability``, ``context_bytes``, ``lazy_loading``) size the estimate's extras
    only and are not read.

    Examples
    --------
    >>> from vram_widget._estimating.recipe.recipe import default
    >>> r = Recipe.from_keywords(precision="bf16", optimizer="adamw-fused")
    >>> s = measure_settings(r, 4, {"precision": default("fp32")})
    >>> s["precision"].value, s["optimizer"]
    ('bf16', 'adamw-fused')
    >>> measure_settings(r, 4, {"precision": "fp32"})
    Traceback (most recent call last):
    ...
    ValueError: precision='fp32' conflicts with the recipe's step.precision='bf16': ...
    """
    if recipe is None:
        return {key: given(value) for key, value in keywords.items()}
    resolved = Recipe.from_keywords(recipe, **keywords)
    _refuse_unmeasured(resolved, batch_size)
    settings = {key: resolved.get(key) for key in MEASURED_SETTINGS}
    opt = resolved.optimizer
    settings["optimizer"] = None
    if opt.name is not None:
        suffix = "" if opt.implementation is None else f"-{opt.implementation.value}"
        settings["optimizer"] = f"{opt.name.value}{suffix}"
    return settings


def _refuse_unmeasured(recipe: Recipe, batch_size: int) -> None:
    step = recipe.step
    if step.batch_size not in (1, batch_size):
        raise ValueError(
            f"the recipe's batch_size={step.batch_size} is not the inputs' batch of "
            f"{batch_size}: measure runs the inputs it is given; build them at that batch "
            "(or leave the recipe's batch_size at 1)"
        )
    if recipe.parallel.cp > 1:
        # torch's ring attention has no CPU kernel (context_parallel.py's docstring)
        raise ValueError(
            f"the recipe's cp={recipe.parallel.cp}: context parallelism is not measured (torch's "
            "ring attention runs the CUDA SDPA kernels only, and a CPU step raises "
            "NotImplementedError); leave cp at 1"
        )
    refused = {
        "seq_len": step.seq_len is not None,
        "rank": recipe.parallel.rank is not None,
        "expandable_segments": recipe.accelerator.expandable_segments,
    }
    asked = [name for name, on in refused.items() if on]
    if asked:
        raise ValueError(
            f"the recipe's {', '.join(asked)}: not something measure runs with (the inputs "
            "give the sequence length; every rank is measured); use recipe.with_(...) to "
            "leave it at its default"
        )
