"""``torch.compile`` as a setting of the step: what is compiled, and the partitioner's budget.

No torch here (plain Python): the settings are checked before any model runs, by the stage
that runs the compiled step (``_profiling/compiled.py``) and by whatever estimates it.
"""

from __future__ import annotations

import dataclasses
import math

from .levers import Levers
from .options import Mode, StrEnum
from .sharding import Parallel

__all__ = [
    "CompileScope",
    "compile_levers",
    "decided_at",
    "parse_activation_memory_budget",
    "parse_compile",
]


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


def compile_levers(
    levers: Levers, value: object, budget: object, mode: Mode, parallel: Parallel
) -> Levers:
    """``levers`` with ``compile`` and ``activation_memory_budget`` applied, or a ValueError
    naming why not: a bad setting (``parse_compile``, ``parse_activation_memory_budget``),
    a mode other than training, or a lever the compiled step is not estimated with yet.

    Examples
    --------
    >>> from vram_widget._estimating.sharding import SINGLE_DEVICE
    >>> compile_levers(Levers(), True, 0.5, Mode.TRAIN, SINGLE_DEVICE).describe()
    'torch.compile (model), activation_memory_budget 0.5'
    >>> compile_levers(Levers(), "blocks", None, Mode.GENERATE, SINGLE_DEVICE)
    Traceback (most recent call last):
    ...
    ValueError: compile='blocks' with mode='generate': the compiled step is estimated ...
    >>> compile_levers(Levers(loss_chunks=4), True, None, Mode.TRAIN, SINGLE_DEVICE)
    Traceback (most recent call last):
    ...
    ValueError: compile='model' with loss_chunks: not estimated yet (the pairs not ...
    """
    scope = parse_compile(value)
    fraction = parse_activation_memory_budget(budget, scope)
    if scope is None:
        return levers
    if mode is not Mode.TRAIN:
        raise ValueError(
            f"compile={scope.value!r} with mode={mode.value!r}: the compiled step is "
            "estimated for mode='train' only (measure(compile=..., mode='inference') "
            "measures a compiled inference pass); leave compile=None"
        )
    blocking = {
        "loss_chunks": levers.loss_chunks is not None,
        "offload_activations": levers.offload_activations is not None,
        f"strategy={parallel.strategy.value!r}": parallel.distributed,
    }
    asked = [name for name, on in blocking.items() if on]
    if asked:
        raise ValueError(
            f"compile={scope.value!r} with {', '.join(asked)}: not estimated yet (the pairs "
            "not estimated are compile with loss_chunks, with offload_activations and with "
            "more than one GPU); the compiled step is estimated on one device with "
            "checkpointing and its policies, LoRA, trainable subsets, gradient accumulation "
            "and the optimizer settings (leave those unset, or compile=None for the eager "
            "step)"
        )
    return dataclasses.replace(levers, compile=scope.value, activation_memory_budget=fraction)


def decided_at(levers: Levers, batch_size: int) -> Levers:
    """``levers`` with the batch size the compiled step is profiled at: ``measure``
    compiles statically at its batch, and the partitioner weighs tensors by their sizes
    (torch/_functorch/partitioners.py: the min-cut's capacities are each node's
    ``_size_of``, and below a budget of 1 ``choose_saved_values_set`` solves a knapsack
    over them), so its choice may change with the batch (measured on a tiny GPT-2 at budget
    0.5: a different step at batches 2, 3 and 5). The compiled step is therefore profiled
    at the asked batch itself, not fitted across batch sizes (one run per batch, cached).

    Examples
    --------
    >>> decided_at(Levers(compile="model", activation_memory_budget=0.5), 8).compile_batch
    8
    >>> decided_at(Levers(), 8).compile_batch is None
    True
    """
    if levers.compile is None:
        return levers
    return dataclasses.replace(levers, compile_batch=batch_size)
