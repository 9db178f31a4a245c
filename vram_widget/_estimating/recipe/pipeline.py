"""Pipeline parallelism's layouts (``pp > 1``): the micro-batches and stages a rank, the
data-parallel ranks each stage has (FSDP2 over them, hsdp's replicas), the checks and
refusals made before any profiling, and the question each pipeline rank's step is asked
(:class:`StageQuestion`), which the estimate and ``measure`` both build from the Recipe."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from ..options import OptimizerImplementation, PipelineSchedule, Precision, Strategy
from .parallel import ParallelSettings, parallel_refusals


def pipeline_microbatches(parallel: ParallelSettings) -> int:
    """The micro-batches of a pipeline-parallel step: ``microbatches``, else ``pp``."""
    return parallel.pp if parallel.microbatches is None else parallel.microbatches


def pipeline_stages_per_rank(parallel: ParallelSettings) -> int:
    """The stages a pipeline rank holds: ``stages_per_rank``, else 2 for
    ``"interleaved-1f1b"`` (torchtitan 0.3, experiments/transformers_modeling_backend/
    pipeline.py: "For multi-stage schedules, default is 2 virtual stages per rank") and 1
    for the others.

    Examples
    --------
    >>> pipeline_stages_per_rank(ParallelSettings(gpus=2, pp=2, pp_schedule="interleaved-1f1b"))
    2
    """
    if parallel.stages_per_rank is not None:
        return parallel.stages_per_rank
    return 2 if parallel.pp_schedule is PipelineSchedule.INTERLEAVED_1F1B else 1


def _check_stages_per_rank(parallel: ParallelSettings, m: int) -> None:
    """The stages a rank and the micro-batches the schedule runs them with."""
    pp, v = parallel.pp, parallel.stages_per_rank
    interleaved = parallel.pp_schedule is PipelineSchedule.INTERLEAVED_1F1B
    if not interleaved and v not in (None, 1):
        raise ValueError(
            f"stages_per_rank={v} with pp_schedule={parallel.pp_schedule.value!r}: that "
            "schedule runs one stage a rank; use pp_schedule='interleaved-1f1b' for several"
        )
    if interleaved and v is not None and v < 2:
        # torchtitan (experiments/transformers_modeling_backend/pipeline.py): "Multi-stage
        # schedule requires at least 2 stages per rank"
        raise ValueError(
            f"pp_schedule='interleaved-1f1b' with stages_per_rank={v}: the schedule holds "
            "several stages a rank; give stages_per_rank >= 2 (or 'gpipe' / '1f1b')"
        )
    # ScheduleInterleaved1F1B.__init__ (torch/distributed/pipelining/schedules.py, torch
    # 2.13 lines 2935-2942): number_of_rounds = max(1, n_microbatches // pp_group_size),
    # and "Interleaved 1F1B requires the number of microbatches to be a multiple of the
    # number of rounds"
    rounds = max(1, m // pp)
    if interleaved and m % rounds:
        fits = [k for k in range(1, 4 * pp + 1) if k % max(1, k // pp) == 0]
        raise ValueError(
            f"pp_schedule='interleaved-1f1b' with microbatches={m} and pp={pp}: torch's "
            f"ScheduleInterleaved1F1B runs max(1, microbatches // pp) = {rounds} rounds and "
            f"needs microbatches to be a multiple of them; give one of {fits}, ..."
        )


def pipeline_data_parallel(parallel: ParallelSettings) -> int:
    """The data-parallel ranks of each pipeline stage: ``gpus / (pp x tp)`` (1: the
    pipeline alone, or its stages' tensor-parallel ranks alone).

    Examples
    --------
    >>> pipeline_data_parallel(ParallelSettings(gpus=4, pp=2, strategy="zero3"))
    2
    """
    return parallel.gpus // (parallel.pp * parallel.tp)


def pipeline_reshard_after_forward(parallel: ParallelSettings) -> bool | None:
    """FSDP2's ``reshard_after_forward`` for the decoder layers of each stage of
    ``gpus = dp x pp`` (dp > 1): ``"zero3"`` True, ``"zero2"`` False; None where the
    stages are not sharded (the pipeline alone).

    Examples
    --------
    >>> pipeline_reshard_after_forward(ParallelSettings(gpus=4, pp=2, strategy="zero2"))
    False
    """
    if parallel.pp == 1 or pipeline_data_parallel(parallel) == 1:
        return None
    return parallel.strategy is not Strategy.ZERO2


def pipeline_replicas(parallel: ParallelSettings) -> int:
    """The replicas of each pipeline stage under ``"hsdp"`` (FSDP2's ``dp_replicate``
    dimension; 1 under the other strategies): the ranks are laid out ``("pp",
    "dp_replicate", "dp_shard", "tp")``, pp outer (``ParallelDims.build_mesh``,
    torchtitan/distributed/parallel_dims.py), so a node of ``gpus_per_node`` consecutive
    ranks holds ``gpus_per_node / tp`` shard ranks of one stage (all its ranks where a
    node holds more), and the nodes of a stage replicate it.

    Examples
    --------
    >>> pipeline_replicas(ParallelSettings(gpus=8, pp=2, strategy="hsdp", gpus_per_node=2))
    2
    >>> pipeline_replicas(ParallelSettings(gpus=8, pp=2, strategy="hsdp", gpus_per_node=8))
    1
    """
    if parallel.pp == 1 or parallel.strategy is not Strategy.HSDP:
        return 1
    stage_ranks = parallel.gpus // parallel.pp
    return stage_ranks // min(stage_ranks, parallel.gpus_per_node)


STAGE_DATA_PARALLEL: tuple[Strategy, ...] = (Strategy.ZERO2, Strategy.ZERO3, Strategy.HSDP)
"""The strategies estimated over the ``dp > 1`` data-parallel ranks of each pipeline stage
(``gpus = dp x pp``): FSDP2, as torchtitan composes it with pipelining (``"hsdp"`` on a
(dp_replicate, dp_shard) mesh a stage); the others are refused by name
(:func:`check_pipeline_parallel`)."""


def _check_pipeline_data_parallel(parallel: ParallelSettings) -> None:
    """``gpus = dp x pp``: the pipeline alone (``dp=1``, no strategy), or FSDP2 over the
    ``dp`` data-parallel ranks of each stage (``"zero2"`` / ``"zero3"``), one stage a rank;
    what is not estimated is refused by name, with the reason."""
    pp, gpus, strategy = parallel.pp, parallel.gpus, parallel.strategy
    if gpus % pp:
        raise ValueError(
            f"pp={pp} with gpus={gpus}: gpus is the world size, data-parallel ranks x "
            f"pipeline stages, so pp must divide it; give gpus={pp} for the pipeline alone, "
            f"or a multiple of {pp} with strategy='zero2' or 'zero3'"
        )
    dp = gpus // pp
    if dp == 1:
        if strategy is not Strategy.DDP:
            raise ValueError(
                f"pp={pp} on gpus={gpus} with strategy={strategy.value!r}: every rank is a "
                "pipeline stage, so there are no data-parallel ranks to shard over; leave "
                f"strategy at its default, or give gpus a multiple of {pp} (dp x pp)"
            )
        return
    _check_stage_fsdp(parallel, dp, f"pp={pp} on gpus={gpus}")


def _check_stage_fsdp(parallel: ParallelSettings, dp: int, layout: str) -> None:
    """FSDP2 over the ``dp`` > 1 data-parallel ranks of each pipeline stage (``layout``
    names the layout in the errors): the strategies and settings estimated, the others
    refused by name, with the reason."""
    pp, strategy = parallel.pp, parallel.strategy
    alone = f"gpus={pp * parallel.tp}"
    # the FSDP2 that torchtitan composes with pipelining (its parallelize functions wrap
    # each stage's model part: torchtitan/distributed/pipeline_parallel.py, pipeline_llm)
    reasons = {
        Strategy.DDP: "DistributedDataParallel over stages is not estimated yet (the schedule "
        "defers its all-reduce with no_sync to the last micro-batch, not checked; torchtitan "
        "replicates stages through FSDP2, its DDP refusing a mesh of more than one dimension)",
        Strategy.ZERO1: "ZeroRedundancyOptimizer over stages is not estimated yet (torchtitan "
        "has no ZeRO-1)",
    }
    if strategy not in STAGE_DATA_PARALLEL:
        raise ValueError(
            f"{layout} with strategy={strategy.value!r}: {dp} data-parallel "
            f"ranks of each stage are estimated with FSDP2 only (strategy='zero2', "
            f"'zero3' or 'hsdp'); {reasons[strategy]}; or give {alone} for the pipeline alone"
        )
    if strategy is Strategy.HSDP:
        _check_stage_hsdp(parallel, dp, layout)
    if parallel.fsdp_units is not None:
        raise ValueError(
            f"{layout} with fsdp_units: FSDP2 over pipeline stages wraps each "
            "stage's decoder layers, then the stage, as torchtitan does; leave fsdp_units "
            "at None"
        )


def _check_stage_hsdp(parallel: ParallelSettings, dp: int, layout: str) -> None:
    """``hsdp`` over each stage's ``dp`` ranks: a node holds whole tensor-parallel groups
    of one stage, or whole stages (:func:`pipeline_replicas`); one group a node is a shard
    dimension of 1, replicas only, as torchtitan keeps it."""
    tp, node = parallel.tp, parallel.gpus_per_node
    stage_ranks = dp * tp
    fits = stage_ranks % node == 0 if node < stage_ranks else node % stage_ranks == 0
    if node % tp or not fits:
        raise ValueError(
            f"{layout} with strategy='hsdp' and gpus_per_node={node}: hsdp shards within a "
            f"node, and a node holds whole tensor-parallel groups ({tp} ranks) of one stage "
            f"or whole stages ({stage_ranks} ranks each, pp the mesh's outer dimension); give "
            f"gpus_per_node a multiple of {tp} that divides {stage_ranks}, or a multiple of "
            f"{stage_ranks}"
        )


def _check_pipeline_tensor_parallel(parallel: ParallelSettings) -> None:
    """``gpus = dp x pp x tp``: each pipeline stage sharded by the model's own
    tensor-parallel plan over ``tp`` ranks (a mesh ``("pp", "tp")``, or with ``dp`` > 1
    ``("pp", "dp_shard", "tp")`` and FSDP2 over the stage's ``dp`` data-parallel ranks, as
    torchtitan composes them), one stage a rank; what is not estimated is refused by name,
    with the reason."""
    pp, tp, gpus = parallel.pp, parallel.tp, parallel.gpus
    if gpus % (pp * tp):
        raise ValueError(
            f"pp={pp} x tp={tp} does not divide gpus={gpus}: gpus is the world size, "
            f"data-parallel ranks x pipeline stages x tensor-parallel ranks; give gpus={pp * tp}, "
            f"or a multiple of {pp * tp} with strategy='zero2' or 'zero3'"
        )
    dp = gpus // (pp * tp)
    if dp == 1 and parallel.strategy is not Strategy.DDP:
        raise ValueError(
            f"pp={pp} x tp={tp} on gpus={gpus} with strategy={parallel.strategy.value!r}: "
            "every rank is a tensor-parallel rank of a stage, so there are no data-parallel "
            f"ranks to shard over; leave strategy at its default, or give gpus a multiple of "
            f"{pp * tp} (dp x pp x tp)"
        )
    if dp > 1:
        _check_stage_fsdp(parallel, dp, f"pp={pp} x tp={tp} on gpus={gpus}")
    if parallel.tp_plan is not None:
        raise ValueError(
            f"pp={pp} with tp={tp} and tp_plan: pipeline stages are sharded by the model's "
            "own Hugging Face plan only (each stage takes the plan's entries for the modules "
            "it holds); leave tp_plan at None, or pp at 1 for a plan of your own"
        )


def check_pipeline_parallel(parallel: ParallelSettings, batch_size: int) -> None:
    """A clear error for a pipeline-parallel layout that is not estimated (yet), before
    any profiling.

    Examples
    --------
    >>> check_pipeline_parallel(ParallelSettings(gpus=2, pp=2, microbatches=4), 6)
    Traceback (most recent call last):
    ...
    ValueError: batch_size=6 is not split evenly into microbatches=4: ...
    """
    pp, tp = parallel.pp, parallel.tp
    m = pipeline_microbatches(parallel)
    if pp == 1:
        if parallel.pp_split is not None:
            raise ValueError("pp_split names where pipeline stages begin: give pp=... too")
        if parallel.microbatches is not None:
            raise ValueError("microbatches splits a pipeline-parallel step: give pp=... too")
        if parallel.stages_per_rank is not None:
            raise ValueError("stages_per_rank counts pipeline stages a rank: give pp=... too")
        return
    if tp > 1:
        _check_pipeline_tensor_parallel(parallel)
    else:
        _check_pipeline_data_parallel(parallel)
    _check_stages_per_rank(parallel, m)
    # Schedule1F1B.__init__ (torch/distributed/pipelining/schedules.py): "Number of
    # microbatches ... must be greater than or equal to the number of stages"
    if parallel.pp_schedule is PipelineSchedule.ONE_F_ONE_B and m < pp:
        raise ValueError(
            f"pp_schedule='1f1b' with microbatches={m} < pp={pp}: torch's Schedule1F1B needs "
            f"at least one micro-batch a stage; give microbatches >= {pp}"
        )
    if batch_size % m:
        raise ValueError(
            f"batch_size={batch_size} is not split evenly into microbatches={m}: "
            "batch_size is the whole step's batch, split by the schedule into "
            "micro-batches of batch_size / microbatches; give a batch that microbatches divides"
        )


def pipeline_parallel_refusals(recipe: Any) -> list[str]:
    """The settings of ``recipe`` not estimated with ``pp > 1`` yet, by name: each one
    not checked against real pipeline ranks (fp32 and bf16 training, amp-bf16 over FSDP2
    ranks and accumulation are).

    Examples
    --------
    >>> from vram_widget._estimating.recipe import Recipe
    >>> pipeline_parallel_refusals(Recipe.from_keywords(gpus=2, pp=2, checkpoint_policy="op"))
    ["checkpoint_policy='op'"]
    """
    lv, step = recipe.levers, recipe.step
    policy = lv.checkpoint_policy
    asked = {
        # full checkpointing of every decoder layer is estimated (pipeline_checkpoint_layers)
        f"checkpoint_policy={policy!r}": policy not in (None, "full"),
        "trainable": lv.trainable is not None,
        # amp through FSDP2's MixedPrecisionPolicy over the stages' data-parallel ranks, as
        # torchtitan runs it (maybe_enable_amp: no autocast with pipelining alone)
        f"precision={step.precision.value!r}": step.precision
        not in (Precision.FP32, Precision.BF16)
        and not (
            step.precision is Precision.AMP_BF16 and pipeline_data_parallel(recipe.parallel) > 1
        ),
        f"mode={step.mode.value!r}": step.mode.value != "train",
    }
    refused = [name for name, on in asked.items() if on]
    return refused + [n for n in parallel_refusals(recipe) if n not in refused]


def pipeline_checkpoint_layers(checkpoint: Sequence[str], module_names: Sequence[str]) -> bool:
    """Whether ``checkpoint`` (the resolved names of the modules to checkpoint) asks for
    every decoder layer of a pipeline-split decoder (``model.layers.K``), each recomputed
    whole: True for all of them, False for none, a ValueError for any other set (each
    stage's layers are wrapped as torchtitan's ``apply_ac`` wraps the blocks of each model
    part; a subset or other modules are not estimated with pipeline stages yet).

    Examples
    --------
    >>> names = ["", "model", "model.layers", "model.layers.0", "model.layers.1"]
    >>> pipeline_checkpoint_layers(("model.layers.0", "model.layers.1"), names)
    True
    >>> pipeline_checkpoint_layers((), names)
    False
    >>> pipeline_checkpoint_layers(("model.layers.0",), names)
    Traceback (most recent call last):
    ...
    ValueError: pp > 1 with checkpoint=['model.layers.0']: ...
    """
    if not checkpoint:
        return False
    layers = {n for n in module_names if re.fullmatch(r"model\.layers\.\d+", n)}
    if set(checkpoint) != layers:
        raise ValueError(
            f"pp > 1 with checkpoint={list(checkpoint)}: with pipeline stages, activation "
            f"checkpointing is estimated for every decoder layer ({len(layers)} of them, "
            "each wrapped in its stage); give checkpoint='auto', or leave pp at 1 for "
            "other modules"
        )
    return True


def check_pipeline_parallel_settings(recipe: Any) -> None:
    """A ValueError naming the settings :func:`pipeline_parallel_refusals` finds."""
    refused = pipeline_parallel_refusals(recipe)
    if refused and recipe.parallel.pp > 1:
        raise ValueError(
            f"pp={recipe.parallel.pp} with {', '.join(refused)}: not estimated with pipeline "
            "parallelism yet (fp32 and bf16 training with any torch.optim optimizer, "
            "amp-bf16 with FSDP2 over the stages, grad_accumulation and checkpoint='auto', "
            "are); leave pp at 1 for these"
        )


@dataclasses.dataclass(frozen=True)
class StageQuestion:
    """What each pipeline rank's step is asked to be: one ``pp > 1`` layout and step
    (:func:`stage_question`), the key of one run of the stages.

    Attributes
    ----------
    pp, schedule, microbatches
        Pipeline ranks, the schedule and the micro-batches it splits each step's batch into.
    batch_size, seq_len
        The whole step's batch (each data-parallel rank's) and its length (None: the
        profile's).
    precision, optimizer, implementation
        The step's precision and optimizer.
    split, stages_per_rank
        Where stages begin (None: torchtitan's even split) and the stages a rank holds.
    checkpoint
        Every decoder layer checkpointed.
    dp, reshard_after_forward, replicate
        Data-parallel ranks of each stage and FSDP2's ``reshard_after_forward`` for its
        layers (None: not sharded); hsdp's replicas among the ``dp`` ranks (1: none).
    tp
        Tensor-parallel ranks of each stage.
    accumulation
        Schedule steps (each of ``batch_size``) whose gradients one optimizer step takes.
    """

    pp: int
    schedule: PipelineSchedule
    microbatches: int
    batch_size: int
    seq_len: int | None
    precision: Precision
    optimizer: Any  # OptimizerChoice | None
    implementation: OptimizerImplementation | None = None
    split: tuple[str, ...] | None = None
    stages_per_rank: int = 1
    checkpoint: bool = False
    dp: int = 1
    reshard_after_forward: bool | None = None
    tp: int = 1
    replicate: int = 1
    accumulation: int = 1


def stage_question(recipe: Any, checkpoint: bool) -> StageQuestion:
    """The :class:`StageQuestion` of ``recipe`` (a ``pp > 1`` Recipe, checked), with
    ``checkpoint`` its resolved checkpointing (:func:`pipeline_checkpoint_layers`).

    Examples
    --------
    >>> from vram_widget._estimating.recipe import Recipe
    >>> r = Recipe.from_keywords(batch_size=8, gpus=8, pp=2, tp=2, strategy="zero3", microbatches=4)
    >>> q = stage_question(r, checkpoint=False)
    >>> q.pp, q.microbatches, q.dp, q.tp, q.reshard_after_forward
    (2, 4, 2, 2, True)
    """
    par, step, opt = recipe.parallel, recipe.step, recipe.optimizer
    return StageQuestion(
        pp=par.pp,
        schedule=par.pp_schedule,
        microbatches=pipeline_microbatches(par),
        batch_size=step.batch_size,
        seq_len=step.seq_len,
        precision=step.precision,
        optimizer=opt.name,
        implementation=opt.implementation,
        split=par.pp_split,
        stages_per_rank=pipeline_stages_per_rank(par),
        checkpoint=checkpoint,
        dp=pipeline_data_parallel(par),
        reshard_after_forward=pipeline_reshard_after_forward(par),
        tp=par.tp,
        replicate=pipeline_replicas(par),
        accumulation=recipe.levers.grad_accumulation,
    )
