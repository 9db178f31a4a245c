"""``torch.compile`` as a setting of the step: what is compiled, and the partitioner's budget.

No torch here (plain Python): the settings are checked before any model runs, by the stage
that runs the compiled step (``_profiling/compiled.py``) and by whatever estimates it.
"""

from __future__ import annotations

import dataclasses
import math

from .levers import Levers
from .options import Mode, Precision, StrEnum
from .sharding import Parallel

__all__ = [
    "FSDP_COMPILE_PRECISIONS",
    "CompileScope",
    "check_compile_parallel",
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
    }
    asked = [name for name, on in blocking.items() if on]
    if asked:
        raise ValueError(
            f"compile={scope.value!r} with {', '.join(asked)}: not estimated yet (the pairs "
            "not estimated are compile with loss_chunks and with offload_activations); the "
            "compiled step is estimated with checkpointing and its policies, LoRA, trainable "
            "subsets, gradient accumulation and the optimizer settings on one device, and "
            "per block under FSDP2 (leave those unset, or compile=None for the eager step)"
        )
    check_compile_parallel(
        scope,
        parallel,
        levers={
            "checkpoint": bool(levers.checkpoint),
            "lora_rank": levers.lora_rank is not None,
            "trainable": levers.trainable is not None,
            "grad_accumulation": levers.grad_accumulation != 1,
        },
    )
    return dataclasses.replace(levers, compile=scope.value, activation_memory_budget=fraction)


# The precisions the per-block compiled step under FSDP2 is checked in against real gloo
# ranks (tests/test_compile_fsdp.py); under autocast FSDP2 casts the gathered parameters
# (MixedPrecisionPolicy), not checked with compiled blocks yet.
FSDP_COMPILE_PRECISIONS = (Precision.FP32, Precision.BF16)


def check_compile_parallel(
    scope: CompileScope,
    parallel: Parallel,
    *,
    precision: Precision | None = None,
    levers: dict[str, bool] | None = None,
) -> None:
    """A ValueError where ``scope`` is not estimated (or measured) across ``parallel``'s
    GPUs: compile across GPUs is FSDP2's (``"zero2"``, ``"zero3"``, ``"hsdp"``) with each
    repeated block compiled, as torchtitan composes them, on its default units (each
    block, then the root), in fp32 or bf16 (:data:`FSDP_COMPILE_PRECISIONS`), without
    the levers in ``levers`` that are set (name -> asked).

    torchtitan 0.3.0's ``parallelize_llama`` (torchtitan/models/llama3/parallelize.py)
    calls ``apply_compile`` (torchtitan/distributed/compile.py: ``for layer_id,
    transformer_block in model.layers.named_children(): transformer_block.compile(
    backend=backend, fullgraph=True)``) "after AC wrapping and before FSDP", then
    ``apply_fsdp_to_decoder`` (``fully_shard`` on each block and the root); it never
    compiles the whole model.

    Examples
    --------
    >>> from vram_widget._estimating.options import Strategy
    >>> check_compile_parallel(CompileScope.BLOCKS, Parallel(2, Strategy.ZERO3))
    >>> check_compile_parallel(CompileScope.MODEL, Parallel(2, Strategy.ZERO3))
    Traceback (most recent call last):
    ...
    ValueError: compile='model' with strategy='zero3': torchtitan compiles each block ...
    >>> check_compile_parallel(CompileScope.BLOCKS, Parallel(2, Strategy.DDP))
    Traceback (most recent call last):
    ...
    ValueError: compile='blocks' with strategy='ddp': not estimated (nor measured) yet; ...
    """
    if not parallel.distributed:
        return
    strategy = parallel.strategy.value
    if parallel.reshard_after_forward is None:  # DDP, ZeRO-1: the parameters whole
        raise ValueError(
            f"compile={scope.value!r} with strategy={strategy!r}: not estimated (nor "
            "measured) yet; a compiled step is estimated across GPUs with FSDP2 "
            "(strategy='zero2', 'zero3' or 'hsdp', compile='blocks'), or on one device "
            "(gpus=1)"
        )
    if scope is CompileScope.MODEL:
        raise ValueError(
            f"compile={scope.value!r} with strategy={strategy!r}: torchtitan compiles each "
            "block before fully_shard wraps it (torchtitan/distributed/compile.py, "
            "apply_compile: transformer_block.compile(fullgraph=True)) and never the whole "
            "model; a whole-model compile would trace the model around FSDP2's hooks, "
            "which dynamo does not trace (torch.distributed.fsdp's _dynamo_disable), so it "
            "would break into regions at every unit; use compile='blocks'"
        )
    asked = [name for name, on in (levers or {}).items() if on]
    if parallel.fsdp_units is not None:
        asked.append("fsdp_units")
    if precision is not None and precision not in FSDP_COMPILE_PRECISIONS:
        asked.append(f"precision={precision.value!r}")
    if asked:
        raise ValueError(
            f"compile={scope.value!r} with strategy={strategy!r} and {', '.join(asked)}: "
            "not estimated (nor measured) yet; the compiled blocks under FSDP2 are "
            "estimated in fp32 and bf16, with FSDP2's default units (each compiled block, "
            "then the root) and without checkpointing, LoRA, a trainable subset or "
            "gradient accumulation"
        )


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
