"""``torch.compile`` as a setting of the step: what is compiled, and the partitioner's budget.

No torch here (plain Python): the settings are checked before any model runs, by the stage
that runs the compiled step (``_profiling/compiled.py``) and by whatever estimates it.
"""

from __future__ import annotations

import math

from .options import StrEnum

__all__ = ["CompileScope", "parse_activation_memory_budget", "parse_compile"]


class CompileScope(StrEnum):
    """What ``torch.compile`` (the default Inductor backend) compiles.

    ``MODEL``: the whole model, ``torch.compile(model)`` (graph breaks allowed, each piece
    its own compiled region). ``BLOCKS``: each repeated block on its own, with
    ``fullgraph=True``, as torchtitan's ``apply_compile`` compiles each TransformerBlock
    (torchtitan/models/llama3/infra/parallelize.py: ``torch.compile(transformer_block,
    backend=..., fullgraph=...)``, ``True`` in its earlier copies, ``compile_config.fullgraph``
    in later ones) and torchtune's ``compile_model`` each layer
    (torchtune/training/_compile.py: ``m.compile(backend=backend)`` on every
    ``TransformerSelfAttentionLayer``); the rest of the model runs eagerly.
    """

    MODEL = "model"
    BLOCKS = "blocks"


def parse_compile(value: object) -> CompileScope | None:
    """``compile`` checked: None for an eager step (``False`` / ``None``), else the scope.

    Examples
    --------
    >>> parse_compile(True), parse_compile("blocks"), parse_compile(False)
    (<CompileScope.MODEL: 'model'>, <CompileScope.BLOCKS: 'blocks'>, None)
    >>> parse_compile("max-autotune")
    Traceback (most recent call last):
    ...
    ValueError: compile='max-autotune' is not a compile setting; valid values are False or ...
    """
    if value is None or value is False:
        return None
    if value is True:
        return CompileScope.MODEL
    if isinstance(value, str):
        key = value.strip().lower()
        for member in CompileScope:
            if member.value == key:
                return member
    raise ValueError(
        f"compile={value!r} is not a compile setting; valid values are False or None "
        "(eager), True or 'model' (torch.compile of the whole model), 'blocks' (each "
        "repeated block compiled on its own)"
    )


def parse_activation_memory_budget(value: object, scope: CompileScope | None) -> float | None:
    """``activation_memory_budget`` checked: None (the partitioner's default) or a number
    in [0, 1], and only with a compiled step.

    ``torch._functorch.config.activation_memory_budget`` (default 1.0) is the fraction of
    the saved activations, relative to the default min-cut partition, that the partitioner
    may keep; below 1.0 it recomputes more in the backward (0.0: the least memory it can
    reach). Read in ``torch/_functorch/partitioners.py`` (``min_cut_rematerialization_
    partition``, ``choose_saved_values_set``).

    Examples
    --------
    >>> parse_activation_memory_budget(0.5, CompileScope.MODEL)
    0.5
    >>> parse_activation_memory_budget(1.5, CompileScope.MODEL)
    Traceback (most recent call last):
    ...
    ValueError: activation_memory_budget=1.5 is outside [0, 1]: it is the fraction of ...
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"activation_memory_budget must be a number in [0, 1] or None, got {value!r}"
        )
    budget = float(value)
    if not (math.isfinite(budget) and 0.0 <= budget <= 1.0):
        raise ValueError(
            f"activation_memory_budget={value!r} is outside [0, 1]: it is the fraction of "
            "the default partition's saved activations torch.compile may keep (1.0 the "
            "default, 0.0 the least)"
        )
    if scope is None:
        raise ValueError(
            f"activation_memory_budget={value!r} is torch.compile's partitioner setting; "
            "give compile=True or 'blocks' too, or leave activation_memory_budget=None"
        )
    return budget
