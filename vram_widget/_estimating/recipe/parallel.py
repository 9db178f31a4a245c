"""How a training step is spread over data-parallel ranks, as asked (``sharding`` resolves
it into a :class:`~vram_widget._estimating.sharding.Parallel`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..options import PipelineSchedule, Strategy, parse_option
from ..sharding import DEFAULT_GPUS_PER_NODE


@dataclasses.dataclass(frozen=True)
class ParallelSettings:
    """Data-parallel ranks and the strategy that shares the step among them.

    Attributes
    ----------
    gpus : int
        Data-parallel ranks (1: one device, no wrapper).
    strategy : Strategy
        ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"hsdp"``.
    rank : int, optional
        The rank to estimate where ranks differ; None: the worst.
    gpus_per_node : int
        GPUs per node (``"hsdp"`` shards within one).
    fsdp_units : str or tuple of str, optional
        FSDP2's units besides the root; None: each repeated block.
    tp : int
        Tensor-parallel ranks among ``gpus`` (1: none); ``gpus = data-parallel x tp``.
    tp_plan : dict, optional
        Module patterns -> ``torch.distributed.tensor.parallel`` styles; None: the
        model's own plan (a Hugging Face model's ``base_model_tp_plan``).
    pp : int
        Pipeline ranks among ``gpus`` (1: none); ``gpus = dp x pp x tp`` (``dp > 1``
        with ``strategy="zero2"`` or ``"zero3"`` only, :data:`STAGE_DATA_PARALLEL`).
    pp_schedule : PipelineSchedule
        ``"gpipe"``, ``"1f1b"`` (one stage a rank) or ``"interleaved-1f1b"``
        (``stages_per_rank`` stages a rank, rank r holding stages r, r + pp, ...).
    stages_per_rank : int, optional
        Stages a rank holds under ``"interleaved-1f1b"`` (at least 2); None: 2 for it
        (torchtitan's default for a multi-stage schedule), 1 for the others.
    microbatches : int, optional
        Micro-batches the step's batch is split into; None: ``pp``.
    pp_split : tuple of str, optional
        The first decoder layer of each stage after the first (``"layers.K"``, torchtitan's
        ``pipeline_parallel_split_points``; ``pp x stages_per_rank - 1`` names); None: the
        layers evenly (as torchtitan counts them for ``"interleaved-1f1b"``).
    ep : int
        Expert-parallel ranks (1: none): a mixture-of-experts model's experts split over
        ``ep`` ranks that share one batch, the dense modules whole on each (transformers'
        ``base_model_ep_plan`` alone, ``DistributedConfig(enable_expert_parallel=True)``);
        ``gpus = ep``.
    cp : int
        Context-parallel ranks (1: none): each holds ``seq_len / cp`` of every sequence and
        runs ``torch.distributed.tensor.experimental.context_parallel``'s ring attention in
        place of ``F.scaled_dot_product_attention``; ``gpus = cp``.

    Examples
    --------
    >>> ParallelSettings(gpus=8, strategy="zero3").strategy
    <Strategy.ZERO3: 'zero3'>
    """

    gpus: int = 1
    strategy: Strategy = Strategy.DDP
    rank: int | None = None
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    fsdp_units: object = None
    tp: int = 1
    tp_plan: object = dataclasses.field(default=None, compare=False, hash=False)
    pp: int = 1
    pp_schedule: PipelineSchedule = PipelineSchedule.GPIPE
    microbatches: int | None = None
    pp_split: tuple[str, ...] | None = None
    ep: int = 1
    stages_per_rank: int | None = None
    cp: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.pp_split, (list, str)):
            split = [self.pp_split] if isinstance(self.pp_split, str) else self.pp_split
            object.__setattr__(self, "pp_split", tuple(split))
        object.__setattr__(self, "strategy", parse_option(Strategy, self.strategy, "strategy"))
        object.__setattr__(
            self, "pp_schedule", parse_option(PipelineSchedule, self.pp_schedule, "pp_schedule")
        )
        for name in ("tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of ranks >= 1, got {value!r}")
        for name in ("microbatches", "stages_per_rank"):
            m = getattr(self, name)
            if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
                raise ValueError(f"{name} must be a whole number >= 1 or None, got {m!r}")
        if isinstance(self.fsdp_units, list):
            object.__setattr__(self, "fsdp_units", tuple(self.fsdp_units))


# torchtitan shares the step among data-parallel groups of tensor-parallel ranks with
# FSDP2 only: its DDP refuses a mesh of more than one dimension (torchtitan 0.2.2,
# torchtitan/models/llama3/infra/parallelize.py:150-151, ``if parallel_dims.world_size !=
# dp_replicate_mesh.size(): raise RuntimeError("DDP has not supported > 1D parallelism")``),
# torchtitan 0.3.0 runs a replicate degree through ``fully_shard`` on the
# ("dp_replicate", "fsdp") mesh, whatever the shard degree (torchtitan/models/llama3/
# parallelize.py:68-80: "Always run apply_fsdp_to_decoder"), and neither has a ZeRO-1
TP_REFUSED_STRATEGIES: dict[Strategy, str] = {
    Strategy.DDP: "torchtitan's DDP refuses a mesh of more than one dimension ('DDP has "
    "not supported > 1D parallelism', torchtitan 0.2.2 models/llama3/infra/parallelize.py:"
    "151) and torchtitan 0.3 replicates tensor-parallel groups through FSDP2",
    Strategy.ZERO1: "ZeroRedundancyOptimizer over DDP does not compose with tensor-parallel "
    "ranks in torchtitan (its DDP refuses a mesh of more than one dimension, and it has no "
    "ZeRO-1)",
}


def tensor_parallel_hsdp(parallel: ParallelSettings) -> tuple[int, int]:
    """``(dp_replicate, dp_shard)`` of ``hsdp`` over tensor-parallel ranks: a node of
    ``gpus_per_node`` GPUs holds ``gpus_per_node / tp`` data-parallel shard ranks of ``tp``
    tensor-parallel ranks each (one node where ``gpus`` is at most a node's), the nodes
    replicate.

    Examples
    --------
    >>> tensor_parallel_hsdp(ParallelSettings(gpus=8, tp=2, strategy="hsdp", gpus_per_node=4))
    (2, 2)
    >>> tensor_parallel_hsdp(ParallelSettings(gpus=8, tp=2, strategy="hsdp", gpus_per_node=8))
    (1, 4)
    """
    node = min(parallel.gpus, parallel.gpus_per_node)
    shard = node // parallel.tp
    return parallel.gpus // node, shard


def check_tensor_parallel(parallel: ParallelSettings) -> None:
    """A clear error for a tensor-parallel layout that is not estimated (yet).

    ``gpus = dp x tp``: with ``dp`` > 1 the data-parallel ranks shard the tensor-parallel
    ranks' parameters with FSDP2, as torchtitan composes them: ``strategy="zero2"`` or
    ``"zero3"`` on a 2-D mesh ``("dp_shard", "tp")``, or ``"hsdp"`` on a 3-D mesh
    ``("dp_replicate", "dp_shard", "tp")``, a node of ``gpus_per_node`` GPUs holding
    ``gpus_per_node / tp`` shard ranks (:func:`tensor_parallel_hsdp`). ``"ddp"`` and
    ``"zero1"`` are refused by name (:data:`TP_REFUSED_STRATEGIES`).

    Examples
    --------
    >>> check_tensor_parallel(ParallelSettings(gpus=4, tp=2, strategy="zero3"))
    >>> check_tensor_parallel(ParallelSettings(gpus=8, tp=2, strategy="hsdp", gpus_per_node=4))
    >>> check_tensor_parallel(ParallelSettings(gpus=4, tp=2))
    Traceback (most recent call last):
    ...
    ValueError: tp=2 on gpus=4 with strategy='ddp': ...
    """
    tp, gpus = parallel.tp, parallel.gpus
    if tp == 1:
        return
    if tp > gpus or gpus % tp:
        raise ValueError(
            f"tp={tp} with gpus={gpus}: gpus is the world size, data-parallel x tensor-parallel "
            f"ranks, so tp must divide it; give gpus={tp} for tensor parallelism alone, or a "
            f"multiple of {tp} with strategy='zero2', 'zero3' or 'hsdp'"
        )
    strategy = parallel.strategy
    if gpus == tp and strategy is not Strategy.DDP:
        raise ValueError(
            f"tp={tp} on gpus={gpus} with strategy={strategy.value!r}: every rank is a "
            "tensor-parallel rank, so there are no data-parallel ranks to shard over; leave "
            f"strategy at its default, or give gpus a multiple of {tp} (dp x tp)"
        )
    if gpus > tp and strategy in TP_REFUSED_STRATEGIES:
        raise ValueError(
            f"tp={tp} on gpus={gpus} with strategy={strategy.value!r}: {gpus // tp} "
            f"data-parallel ranks of tp={tp} each are estimated with FSDP2 over the "
            "tensor-parallel ranks only, as torchtitan composes them: give strategy='zero2' "
            "or 'zero3' (a 2-D mesh, dp_shard x tp), or 'hsdp' (dp_replicate x dp_shard x "
            f"tp, a node of gpus_per_node GPUs holding gpus_per_node / {tp} shard ranks), "
            f"or gpus={tp} for tensor parallelism alone; {TP_REFUSED_STRATEGIES[strategy]}"
        )
    if strategy is Strategy.HSDP:
        _check_tensor_parallel_hsdp(parallel)


def _check_tensor_parallel_hsdp(parallel: ParallelSettings) -> None:
    """``hsdp`` over tensor-parallel ranks: each node a whole number of tensor-parallel
    groups, and ``gpus`` a whole number of nodes."""
    tp, gpus, node = parallel.tp, parallel.gpus, parallel.gpus_per_node
    if node % tp:
        raise ValueError(
            f"tp={tp} with strategy='hsdp' and gpus_per_node={node}: hsdp shards within a "
            "node, and a node holds whole tensor-parallel groups (tp the mesh's inner "
            f"dimension, as torchtitan lays it out); give gpus_per_node a multiple of {tp}"
        )
    if gpus > node and gpus % node:
        raise ValueError(
            f"tp={tp} on gpus={gpus} with strategy='hsdp': hsdp shards over the "
            f"{node} GPUs of a node and replicates across nodes, so gpus must be a whole "
            f"number of nodes of gpus_per_node={node}; give gpus a multiple of it"
        )


def _check_sharing_one_batch(
    parallel: ParallelSettings, name: str, kind: str, refused: dict[str, str]
) -> None:
    """The checks of a layout whose ``name`` ranks share one batch (expert and context
    parallelism): none of the ``refused`` layouts beside it (each with its reason), no
    data-parallel strategy over it, and its ranks the whole world."""
    degree, gpus = getattr(parallel, name), parallel.gpus
    for other, why in refused.items():
        if getattr(parallel, other) > 1:
            raise ValueError(f"{name}={degree} with {other}={getattr(parallel, other)}: {why}")
    if parallel.strategy is not Strategy.DDP:
        raise ValueError(
            f"{name}={degree} with strategy={parallel.strategy.value!r}: {kind} parallelism "
            "does not compose with a data-parallel strategy yet; leave strategy at its default"
        )
    if gpus != degree:
        raise ValueError(
            f"{name}={degree} with gpus={gpus}: the {name} ranks share one batch and are the "
            f"whole world (data parallelism over {kind}-parallel groups is not estimated yet); "
            f"give gpus={degree}"
        )


def check_expert_parallel(parallel: ParallelSettings) -> None:
    """A clear error for an expert-parallel layout that is not estimated (yet); the model's
    side (experts, their number) is checked by the profile (``expert_parallel.resolve_ep_plan``).

    Examples
    --------
    >>> check_expert_parallel(ParallelSettings(gpus=4, ep=2))
    Traceback (most recent call last):
    ...
    ValueError: ep=2 with gpus=4: ...
    """
    if parallel.ep == 1:
        return
    refused = {
        "tp": "experts split over tensor-parallel ranks are not estimated yet; give tp=1 "
        "(ep alone) or ep=1 (tp alone)",
        "pp": "pipeline stages of expert-parallel ranks are not estimated yet (transformers "
        "refuses token dispatch with pipeline parallelism, DistributedConfig."
        "_validate_resolved_ep_plan); give pp=1",
    }
    _check_sharing_one_batch(parallel, "ep", "expert", refused)


def check_context_parallel(parallel: ParallelSettings, seq_len: int | None) -> None:
    """A clear error for a context-parallel layout that is not estimated (yet), before any
    profiling; ``seq_len`` is the step's whole sequence length (None: not known yet).

    Examples
    --------
    >>> check_context_parallel(ParallelSettings(gpus=2, cp=2), 127)
    Traceback (most recent call last):
    ...
    ValueError: cp=2 with seq_len=127: ...
    """
    cp = parallel.cp
    if cp == 1:
        return
    combined = "context parallelism combined with other layouts is not estimated yet"
    refused = {name: f"{combined}; give {name}=1 (cp alone)" for name in ("tp", "pp", "ep")}
    _check_sharing_one_batch(parallel, "cp", "context", refused)
    if seq_len is None:  # not known yet (the command line's model default)
        return
    # context_parallel shards each buffer with DTensor's Shard(seq_dim) (torch/distributed/
    # tensor/experimental/_context_parallel/_attention.py, _context_parallel_buffers) and its
    # ring attention reshapes every rotated K/V block to the local shape: equal shards only
    if seq_len % cp:
        raise ValueError(
            f"cp={cp} with seq_len={seq_len}: each rank holds seq_len / cp tokens, so cp must "
            f"divide the sequence length; give a seq_len that is a multiple of {cp} (of "
            f"{2 * cp} for the head-tail load balancing of a causal mask)"
        )


def parallel_refusals(recipe: Any) -> list[str]:
    """The settings of ``recipe`` (a :class:`~vram_widget.Recipe`) not estimated with
    ``ep > 1``, ``cp > 1`` or ``pp > 1`` yet, by name: those not checked against real ranks
    of these layouts (activation checkpointing, a frozen subset, accumulation and the
    precisions are).

    Examples
    --------
    >>> from vram_widget._estimating.recipe import Recipe
    >>> parallel_refusals(Recipe.from_keywords(gpus=2, ep=2, lora_rank=8))
    ['lora_rank']
    """
    lv, step, optimizer = recipe.levers, recipe.step, recipe.optimizer
    asked = {
        "lora_rank": lv.lora_rank is not None,
        "weights": recipe.weights.quantized,
        "float8": recipe.float8.recipe is not None,
        "compile": lv.compile not in (None, False),
        "loss_chunks": lv.loss_chunks is not None,
        "offload_activations": lv.offload_activations not in (None, False),
        "optimizer_in_backward": optimizer.in_backward,
        "mode='generate'": step.mode.value == "generate",
    }
    return [name for name, on in asked.items() if on]


# the settings of parallel_refusals checked against real tensor-parallel ranks
_TENSOR_PARALLEL_CHECKED = frozenset({"lora_rank", "loss_chunks"})


def tensor_parallel_refusals(recipe: Any) -> list[str]:
    """The settings of ``recipe`` not estimated with ``tp > 1`` yet, by name: those of
    :func:`parallel_refusals` but PEFT's LoRA (:func:`check_tensor_parallel_lora` says
    where it is) and torchtune's chunked loss (with tp alone).

    Examples
    --------
    >>> from vram_widget._estimating.recipe import Recipe
    >>> tensor_parallel_refusals(Recipe.from_keywords(gpus=2, tp=2, lora_rank=8, compile=True))
    ['compile']
    """
    return [n for n in parallel_refusals(recipe) if n not in _TENSOR_PARALLEL_CHECKED]


def check_tensor_parallel_lora(tp: int, gpus: int, tp_plan: object) -> None:
    """A clear error for PEFT's LoRA on a tensor-parallel layout not estimated: a plan of
    the user's own (PEFT lays adapters out by the model's transformers plan only) or FSDP2
    over the tensor-parallel ranks (``gpus > tp``, not checked against real ranks yet).

    Examples
    --------
    >>> check_tensor_parallel_lora(2, 4, None)
    Traceback (most recent call last):
    ...
    ValueError: lora_rank with tp=2 on gpus=4: ...
    """
    if tp_plan is not None:
        # peft 0.21.2, peft/tuners/lora/model.py, get_tp_plan_and_mesh: the base layer's
        # style is read from model.tp_plan (the transformers plan) and nothing else
        raise ValueError(
            f"lora_rank with tp={tp} and a tp_plan of your own: PEFT lays LoRA adapters out "
            "over tensor-parallel ranks by the model's own transformers plan (model.tp_plan) "
            "only, and leaves them whole beside a layer sharded otherwise; leave tp_plan at "
            "None (the model's plan)"
        )
    if gpus != tp:
        raise ValueError(
            f"lora_rank with tp={tp} on gpus={gpus}: LoRA with FSDP2 over tensor-parallel "
            f"ranks is not estimated yet; LoRA is estimated with tp alone (gpus={tp})"
        )


def context_parallel_refusals(recipe: Any) -> list[str]:
    """The settings of ``recipe`` not estimated with ``cp > 1`` yet, by name: those
    :func:`parallel_refusals` finds and activation checkpointing (its recompute would
    run the ring attention again in the backward, not checked).

    Examples
    --------
    >>> from vram_widget._estimating.recipe import Recipe
    >>> context_parallel_refusals(Recipe.from_keywords(gpus=2, cp=2, checkpoint="auto"))
    ['checkpoint']
    """
    checkpoint = recipe.levers.checkpoint not in (None, False)
    return ["checkpoint"] * checkpoint + parallel_refusals(recipe)


def check_tensor_parallel_settings(recipe: Any) -> None:
    """A ValueError naming the settings :func:`tensor_parallel_refusals` finds, LoRA's
    layouts :func:`check_tensor_parallel_lora` refuses, and the chunked loss with FSDP2
    over the tensor-parallel ranks."""
    par = recipe.parallel
    if par.tp == 1:
        return
    refused = tensor_parallel_refusals(recipe)
    if refused:
        raise ValueError(
            f"tp={par.tp} with {', '.join(refused)}: not estimated with tensor "
            "parallelism yet (activation checkpointing, trainable, grad_accumulation, "
            "lora_rank and every precision are); leave tp at 1 for these"
        )
    if par.tp_plan is not None and recipe.levers.checkpoint not in (None, False):
        # measured on torchtitan's Llama of tests/models.py under a plan splitting its MLPs
        # (benchmarks/accuracy_parallel.py, batch 4, fp32 AdamW): tp=2 alone 4,680,908 B
        # estimated against 5,270,732 B on each real rank (-11 %), FSDP2 over them -14 %;
        # without checkpointing both match to the byte, as the model's own plan does with it
        raise ValueError(
            f"tp={par.tp} with tp_plan and checkpoint: not estimated yet (real ranks of a "
            "test model under a plan of torch styles held 11-14 % more than the estimate "
            "with activation checkpointing); checkpoint is estimated with the model's own "
            "plan (tp_plan=None), and a tp_plan without checkpoint"
        )
    if recipe.levers.lora_rank is not None:
        check_tensor_parallel_lora(par.tp, par.gpus, par.tp_plan)
    if recipe.levers.loss_chunks is not None and par.gpus != par.tp:
        raise ValueError(
            f"loss_chunks with tp={par.tp} on gpus={par.gpus}: the chunked loss with FSDP2 "
            "over tensor-parallel ranks is not estimated yet; it is estimated with tp alone "
            f"(gpus={par.tp})"
        )
