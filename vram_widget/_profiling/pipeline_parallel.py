"""Pipeline parallelism: each rank holds one stage of a decoder's layers and runs its part
of every micro-batch as ``torch.distributed.pipelining`` schedules it.

A stage is split as torchtitan splits a Hugging Face decoder (torchtitan 0.3,
torchtitan/experiments/transformers_modeling_backend/pipeline.py,
``generate_llm_fqn_per_model_part`` and ``pipeline_module_split``: the embedding with the
first stage, the final norm and the output head with the last, the decoder layers in
between, each stage a copy of the model with the other stages' modules removed). For
``ScheduleGPipe`` and ``Schedule1F1B`` (one stage a rank) the layers are split evenly
(``pp`` must divide them); for ``ScheduleInterleaved1F1B`` (``stages_per_rank`` stages a
rank, rank r holding stages r, r + pp, ...) they are split as torchtitan counts them, the
embedding and the head each weighing one layer (:func:`stage_layer_ranges`). Every stage
keeps the rotary embedding (a buffer, as torchtitan keeps ``rotary_emb`` on every stage).
With ``checkpoint``, each decoder layer of a stage is wrapped in torch's non-reentrant
``checkpoint_wrapper`` after the split, as torchtitan applies activation checkpointing to
each model part (torchtitan/distributed/pipeline_parallel.py, ``pipeline_llm``: each of the
``model_parts`` goes through ``parallelize_fn``, whose ``apply_ac`` in
torchtitan/distributed/activation_checkpoint.py wraps every child of ``layers``).

A rank's memory is that of the real schedule over its ``PipelineStage`` objects: the
estimate runs that schedule for one rank on fake tensors on PyTorch's fake process group
(no communication, receive buffers left as they are), and counts the live storages of every
op's outputs (``live_bytes.LiveBytes``); ``measure`` runs it on real gloo ranks. Where the fake run
would differ from a rank, it is made to hold what the rank holds: each send's tensor until
the schedule waits for it (``live_bytes.sends_held``), no (S, S) mask where Hugging Face's tests
would drop it (``data_dependent.example_mask_values``), the Python numbers ops wrap and the
CPU generator states checkpointing keeps (``live_bytes.LiveBytes``). A stage's layers may
be sharded further: by FSDP2 over data-parallel ranks (``pipeline_fsdp``) or by the
model's tensor-parallel plan over tensor-parallel ranks (``pipeline_tensor_parallel``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._estimating.communication import Collective
from .._estimating.options import OptimizerChoice, OptimizerImplementation, PipelineSchedule
from .._estimating.recipe.pipeline import StageQuestion
from .live_bytes import LiveBytes, sends_held
from .pipeline_tensor_parallel import dtensor_caches_cleared, meshes_concatenated_outside_fake_mode
from .tensor_parallel import local_part

__all__ = [
    "StagePeak",
    "check_pipeline_model",
    "checkpoint_layers",
    "measure_stage",
    "rank_stage_indices",
    "stage_copy",
    "stage_layer_ranges",
    "stage_peak",
]


def _decoder(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """A Hugging Face causal LM's decoder (``model.model``) and its layers."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if (
        base is None
        or not isinstance(layers, nn.ModuleList)
        or getattr(base, "embed_tokens", None) is None
        or getattr(model, "lm_head", None) is None
        or not callable(getattr(model, "loss_function", None))
    ):
        raise ValueError(
            f"pp > 1 splits a Hugging Face decoder (a ...ForCausalLM with model.embed_tokens, "
            f"model.layers, model.norm and lm_head) into stages as torchtitan does; "
            f"{type(model).__name__} is not one"
        )
    return base, layers


def check_pipeline_model(
    model: nn.Module,
    inputs: Any,
    pp: int,
    split: tuple[str, ...] | None = None,
    stages_per_rank: int = 1,
) -> None:
    """A clear error, before any profiling, where ``model`` or ``inputs`` cannot be split
    into ``pp * stages_per_rank`` stages: not a Hugging Face decoder, ``pp`` not dividing its
    layers (one stage a rank), too few layers for the stages (several a rank), a ``split``
    that does not name one layer fewer than the stages in order, inputs other than
    ``{"input_ids": ..., "labels": ...}``."""
    _base, layers = _decoder(model)
    stages = pp * stages_per_rank
    if split is not None or stages_per_rank > 1:
        stage_layer_ranges(len(layers), stages, split, weighted_ends=stages_per_rank > 1)
    elif len(layers) % pp:
        raise ValueError(
            f"pp={pp} does not divide the model's {len(layers)} decoder layers: each stage "
            f"holds the same number of layers; use a pp that divides {len(layers)}"
        )
    if not isinstance(inputs, dict) or set(inputs) != {"input_ids", "labels"}:
        keys = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        raise ValueError(
            f"pp > 1 takes inputs={{'input_ids': ..., 'labels': ...}} (the first stage reads "
            f"the ids, the last stage's loss the labels); got {keys}"
        )


def _weighted_layer_ranges(layer_count: int, stages: int) -> list[range]:
    """torchtitan's count rule (0.3, experiments/transformers_modeling_backend/pipeline.py,
    ``generate_llm_fqn_per_model_part`` with its defaults ``input_weight=1`` and
    ``output_weight=1``, ``pipeline_parallel_first_stage_less_layers`` and
    ``..._last_stage_less_layers`` in torchtitan/config/configs.py): the embedding and the
    head count as one layer each; ``layers + 2`` such layers are shared out, ``// stages``
    each and one more to each of the first ``% stages``; the first stage's embedding and the
    last stage's head take one of theirs."""
    effective = layer_count + 2
    if stages > effective:
        # generate_llm_fqn_per_model_part: "Number of stages ... cannot be greater than
        # effective layers"
        raise ValueError(
            f"{stages} pipeline stages need at least {stages - 2} decoder layers (torchtitan "
            f"counts the embedding and the head as one layer each); the model has "
            f"{layer_count}: give fewer stages_per_rank or a smaller pp"
        )
    per, extra = divmod(effective, stages)
    counts = [per + (s < extra) for s in range(stages)]
    counts[0] -= 1
    counts[-1] -= 1
    starts = list(itertools.accumulate(counts, initial=0))
    return [range(a, b) for a, b in itertools.pairwise(starts)]


def stage_layer_ranges(
    layer_count: int,
    stages: int,
    split: tuple[str, ...] | None = None,
    weighted_ends: bool = False,
) -> list[range]:
    """The decoder layers of each of ``stages`` stages: split evenly, as torchtitan counts
    them with ``weighted_ends`` (the embedding and the head one layer each, so the first and
    last stages may hold no decoder layer), or at ``split``, the first layer of each stage
    after the first (torchtitan's ``pipeline_parallel_split_points``, e.g. ``("layers.4",)``;
    ``model.layers.4`` too).

    Examples
    --------
    >>> stage_layer_ranges(4, 2)
    [range(0, 2), range(2, 4)]
    >>> stage_layer_ranges(4, 2, ("layers.1",))
    [range(0, 1), range(1, 4)]
    >>> stage_layer_ranges(2, 4, weighted_ends=True)
    [range(0, 0), range(0, 1), range(1, 2), range(2, 2)]
    """
    if split is None:
        if weighted_ends:
            return _weighted_layer_ranges(layer_count, stages)
        per = layer_count // stages
        return [range(s * per, (s + 1) * per) for s in range(stages)]
    starts = []
    for name in split:
        match = re.fullmatch(r"(?:model\.)?layers\.(\d+)", name)
        if match is None:
            raise ValueError(
                f"pp_split name {name!r} is not a decoder layer: give the first layer of "
                "each stage after the first, as 'layers.K' or 'model.layers.K'"
            )
        starts.append(int(match.group(1)))
    bounds = [0, *starts, layer_count]
    if len(starts) != stages - 1 or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ValueError(
            f"pp_split={list(split)} does not split the model's {layer_count} layers into "
            f"{stages} stages: give {stages - 1} layer names in increasing order, each of "
            f"layers.1 to layers.{layer_count - 1}"
        )
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


class StageModule(nn.Module):
    """One stage of a causal LM: the model with the other stages' modules removed; the
    first stage reads token ids, the others the previous stage's hidden states (the
    decoder's ``inputs_embeds``); the last returns the logits, the others hidden states."""

    def __init__(self, model: nn.Module, first: bool) -> None:
        super().__init__()
        self.model = model
        self.first = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = "input_ids" if self.first else "inputs_embeds"
        return self.model(**{key: x}, use_cache=False).logits


def stage_copy(
    model: nn.Module,
    stage: int,
    stages: int,
    meta: bool = False,
    split: tuple[str, ...] | None = None,
    weighted_ends: bool = False,
) -> StageModule:
    """A copy of stage ``stage`` of ``stages`` (a meta copy with ``meta``: no weight
    copied), its layers those :func:`stage_layer_ranges` gives it.

    Examples
    --------
    >>> import transformers
    >>> config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=32,
    ...     num_attention_heads=2, intermediate_size=64, vocab_size=100)
    >>> s = stage_copy(transformers.LlamaForCausalLM(config), 1, 2, meta=True)
    >>> len(s.model.model.layers), s.model.model.embed_tokens
    (2, None)
    """
    from .step import meta_copy

    source = meta_copy(model) if meta else model
    _base, layers = _decoder(source)
    keep = stage_layer_ranges(len(layers), stages, split, weighted_ends)[stage]
    # copy without the layers the stage does not hold (deepcopy's memo answers None)
    memo: dict[int, Any] = {id(layers[i]): None for i in range(len(layers)) if i not in keep}
    out = copy.deepcopy(source, memo)
    out_base, out_layers = _decoder(out)
    out_base.layers = nn.ModuleList([out_layers[i] for i in keep])
    if stage:
        out_base.register_module("embed_tokens", None)
    if stage != stages - 1:
        out_base.norm = nn.Identity()
        out.lm_head = nn.Identity()
    return StageModule(out, first=stage == 0)


def _loss_fn(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's own causal-LM loss (transformers' ``ForCausalLMLoss``: logits upcast to
    fp32, labels shifted, mean cross-entropy), as the last stage's ``loss_fn``."""
    function: Any = model.loss_function
    vocab = _config(model).vocab_size

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return function(logits, labels, vocab_size=vocab)

    return loss


def _config(model: nn.Module) -> Any:
    """The Hugging Face model's config (its ``hidden_size`` and ``vocab_size``)."""
    return model.config


def _schedule_class(schedule: PipelineSchedule) -> type:
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    classes = {
        PipelineSchedule.GPIPE: ScheduleGPipe,
        PipelineSchedule.ONE_F_ONE_B: Schedule1F1B,
        PipelineSchedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
    }
    return classes[schedule]


def rank_stage_indices(rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages rank ``rank`` holds: ``rank``, ``rank + pp``, ... (torchtitan's "loop"
    style, ``_get_stage_indices`` in its pipeline.py; ``PipelineStage`` maps stage ``i`` to
    rank ``i % group_size``, torch/distributed/pipelining/stage.py).

    Examples
    --------
    >>> rank_stage_indices(1, 2, 2)
    [1, 3]
    """
    return [rank + k * pp for k in range(stages_per_rank)]


@dataclasses.dataclass
class _Rank:
    """One rank's stages, schedule, optimizers and batch, and its step."""

    modules: list[StageModule]
    schedule: Any
    optimizers: list[torch.optim.Optimizer]
    batch: torch.Tensor  # the first stage's ids, the last stage's labels, or neither
    first: bool
    last: bool
    amp: torch.dtype | None = None  # the schedule's step under autocast to it
    accumulation: int = 1  # schedule steps before each optimizer step

    def iterate(self) -> None:
        for _ in range(self.accumulation):
            with torch.autocast("cpu", dtype=self.amp) if self.amp else contextlib.nullcontext():
                if self.first:
                    self.schedule.step(self.batch)
                elif self.last:
                    self.schedule.step(target=self.batch)
                else:
                    self.schedule.step()
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def stages(self) -> list[Any]:
        """The schedule's ``PipelineStage`` objects (one for GPipe and 1F1B)."""
        return list(getattr(self.schedule, "_stages", None) or [self.schedule._stage])

    def resident_tensors(self) -> Iterator[torch.Tensor]:
        """What the rank holds between steps: its stages' parameters, buffers and
        optimizer state, its batch, each stage's receive buffers (``PipelineStage`` keeps
        one a micro-batch, for activations and for gradients) and the last stage's outputs
        of the step before (``output_chunks``, dropped when the next step starts)."""
        for module in self.modules:
            yield from module.parameters()
            yield from module.buffers()
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        yield self.batch
        for stage in self.stages():
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
                for info in infos:
                    if isinstance(getattr(info, "buffer", None), torch.Tensor):
                        yield info.buffer
            for out in stage.output_chunks:
                leaves = torch.utils._pytree.tree_leaves(out)
                yield from (t for t in leaves if torch.is_tensor(t))

    def wrapper_bytes(self) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A pipeline's shape: ``pp`` ranks, the schedule, its stages a rank, the split."""

    pp: int
    schedule: PipelineSchedule
    microbatches: int
    stages_per_rank: int = 1
    split: tuple[str, ...] | None = None
    checkpoint: bool = False
    # FSDP2 over dp data-parallel ranks of each stage (pipeline_fsdp.py): None, none
    reshard_after_forward: bool | None = None
    dp: int = 1
    # tensor parallelism over tp ranks of each stage (pipeline_tensor_parallel.py)
    tp: int = 1
    # hsdp: the dp ranks are replicate x dp / replicate shard ranks (FSDP2 on a 2-D mesh)
    replicate: int = 1
    # amp precisions (FSDP2 over the stages only): the autocast dtype, which FSDP2's
    # MixedPrecisionPolicy gathers the parameters in too
    amp: torch.dtype | None = None
    # schedule steps whose gradients one optimizer step takes
    accumulation: int = 1

    @classmethod
    def of(cls, question: StageQuestion) -> _Layout:
        """The layout a :class:`~.._estimating.recipe.pipeline.StageQuestion` asks for."""
        from .step import autocast_dtype

        q = question
        return cls(
            q.pp, q.schedule, q.microbatches, q.stages_per_rank, q.split, q.checkpoint,
            q.reshard_after_forward, q.dp, q.tp, q.replicate, autocast_dtype(q.precision),
            q.accumulation,
        )  # fmt: skip

    @property
    def stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def sharded(self) -> bool:
        return self.reshard_after_forward is not None and self.dp > 1

    def copy(self, model: nn.Module, stage: int, meta: bool) -> StageModule:
        out = stage_copy(model, stage, self.stages, meta, self.split, self.stages_per_rank > 1)
        # with tensor parallelism, the layers are wrapped after they are sharded
        # (_shard_stages), as torchtitan's parallelize functions apply tensor parallelism
        # before activation checkpointing (torchtitan/models/llama3/parallelize.py)
        if self.checkpoint and self.tp == 1:
            checkpoint_layers(out)
        return out


def checkpoint_layers(stage: StageModule) -> None:
    """Wrap each decoder layer of ``stage`` in place in torch's non-reentrant
    ``checkpoint_wrapper`` (``fake.checkpoint_wrapped``, the wrapper the ``checkpoint``
    lever puts around a block), as torchtitan's ``apply_ac`` wraps each child of a model
    part's ``layers`` (module docstring).

    Examples
    --------
    >>> import transformers
    >>> config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32,
    ...     num_attention_heads=2, intermediate_size=64, vocab_size=100)
    >>> s = stage_copy(transformers.LlamaForCausalLM(config), 0, 2, meta=True)
    >>> checkpoint_layers(s)
    >>> type(s.model.model.layers[0]).__name__
    'CheckpointWrapper'
    """
    from .fake import checkpoint_wrapped

    layers = stage.model.get_submodule("model.layers")
    assert isinstance(layers, nn.ModuleList)
    for index, layer in enumerate(layers):
        layers[index] = checkpoint_wrapped(layer)


def _decoder_layers(module: StageModule) -> Any:
    """A stage's decoder layers (``stage_copy`` keeps them at ``model.model.layers``)."""
    base: Any = module.model.model
    return base.layers


def _meshes(layout: _Layout) -> Any:
    """The world's ``pp`` sub-mesh and its stage's data-parallel and ``tp`` sub-meshes
    (None where the layout has no such ranks), or None where the world is the pipeline: a
    mesh ``("pp", "dp_replicate", "dp_shard", "tp")`` of the degrees above 1, pp the outer
    and tp the inner dimension (``ParallelDims.build_mesh``,
    torchtitan/distributed/parallel_dims.py: ``["pp", "dp_replicate", "fsdp", "tp"]``); the
    data-parallel sub-mesh is ``dp_shard``, or ``(dp_replicate, dp_shard)`` for hsdp."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.dp == 1 and layout.tp == 1:
        return None
    shard = layout.dp // layout.replicate
    dims = [("pp", layout.pp), ("dp_replicate", layout.replicate), ("dp_shard", shard),
            ("tp", layout.tp)]  # fmt: skip
    # hsdp keeps a dp_shard of 1 (replicas only), as torchtitan's mesh does
    # (ParallelDims._mesh_exist: the "fsdp" dimension always exists)
    kept = ("pp", "dp_shard") if layout.replicate > 1 else ("pp",)
    dims = [(name, size) for name, size in dims if size > 1 or name in kept]
    names = tuple(name for name, _size in dims)
    mesh = init_device_mesh("cpu", tuple(size for _name, size in dims), mesh_dim_names=names)
    # hsdp's fully_shard takes the 2-D (dp_replicate, dp_shard) sub-mesh
    data = ("dp_replicate", "dp_shard") if layout.replicate > 1 else ("dp_shard",)
    dp_mesh = mesh[data] if "dp_shard" in names else None
    return mesh["pp"], dp_mesh, mesh["tp"] if "tp" in names else None


def _shard_stages(modules: list[StageModule], layout: _Layout, meshes: Any) -> Any:
    """The pipeline ranks' process group of a world of ``pp x dp x tp`` ranks (None where
    the world is the pipeline), each of ``modules`` sharded in torchtitan's order
    (torchtitan/models/llama3/parallelize.py, ``parallelize_llama``: tensor parallelism,
    then activation checkpointing, then FSDP2): over the stage's tensor-parallel ranks by
    the model's plan (``pipeline_tensor_parallel.parallelize_stage``), then by FSDP2 over
    its data-parallel ranks where the layout shards them (``pipeline_fsdp.shard_stage``);
    ``meshes`` the world's (:func:`_meshes`)."""
    from .pipeline_fsdp import shard_stage
    from .pipeline_tensor_parallel import parallelize_stage

    if meshes is None:
        return None
    pp_mesh, dp_mesh, tp_mesh = meshes
    for module in modules:
        if tp_mesh is not None:
            parallelize_stage(module, tp_mesh)
            if layout.checkpoint:
                checkpoint_layers(module)
        if layout.sharded:
            assert layout.reshard_after_forward is not None
            layers: Any = _decoder_layers(module)
            shard_stage(module, layers, dp_mesh, layout.reshard_after_forward, layout.amp)
    return pp_mesh.get_group()


def _pipeline_stage(
    module: StageModule,
    stage: int,
    stages: int,
    inputs: dict[str, torch.Tensor],
    micro: int,
    hidden_size: int,
    vocab_size: int,
    dtype: torch.dtype,
    group: Any = None,
) -> Any:
    """The ``PipelineStage`` over ``module`` on ``group`` (the pipeline ranks; None: the
    world), with its inputs' and outputs' shapes given (so no shape inference runs)."""
    from torch.distributed.pipelining import PipelineStage

    ids = inputs["input_ids"]
    seq = ids.shape[1]
    if stage == 0:
        example_in = torch.empty((micro, seq), dtype=ids.dtype, device="meta")
    else:
        example_in = torch.empty((micro, seq, hidden_size), dtype=dtype, device="meta")
        example_in.requires_grad_(True)
    width = vocab_size if stage == stages - 1 else hidden_size
    example_out = torch.empty((micro, seq, width), dtype=dtype, device="meta")
    example_out.requires_grad_(True)
    device = torch.device("cpu")
    return PipelineStage(
        module, stage, stages, device, input_args=(example_in,), output_args=(example_out,),
        group=group,
    )  # fmt: skip


def _rank(
    modules: list[StageModule],
    rank: int,
    layout: _Layout,
    inputs: dict[str, torch.Tensor],
    optimizer: OptimizerChoice | None,
    implementation: OptimizerImplementation | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    hidden_size: int,
    vocab_size: int,
    dtype: torch.dtype,
    group: Any = None,
) -> _Rank:
    """Pipeline rank ``rank``'s ``PipelineStage`` objects over ``modules`` (its stages, in
    order; on ``group``, the pipeline ranks) and the schedule over them; one optimizer a
    stage, as torchtitan's ``OptimizersContainer`` builds at least one a model part
    (torchtitan/components/optimizer/optimizer.py). Where the layout shards the stages
    (FSDP2 over data-parallel ranks), ``modules`` are sharded already."""
    from .step import make_optimizer

    micro = inputs["input_ids"].shape[0] // layout.microbatches
    indices = rank_stage_indices(rank, layout.pp, layout.stages_per_rank)
    pipes = [
        _pipeline_stage(m, i, layout.stages, inputs, micro, hidden_size, vocab_size, dtype, group)
        for m, i in zip(modules, indices, strict=True)
    ]
    schedule_class = _schedule_class(layout.schedule)
    if layout.stages_per_rank == 1:
        sched = schedule_class(pipes[0], layout.microbatches, loss_fn=loss_fn)
    else:
        sched = schedule_class(pipes, layout.microbatches, loss_fn=loss_fn)
    opts = []
    for module in modules:
        params = [p for p in module.parameters() if p.requires_grad]
        if optimizer is not None and params:
            opts.append(make_optimizer(optimizer, params, implementation))
    batch = inputs["input_ids"] if rank == 0 else inputs["labels"]
    first, last = rank == 0, rank == layout.pp - 1
    return _Rank(modules, sched, opts, batch, first, last, layout.amp, layout.accumulation)


@dataclasses.dataclass(frozen=True)
class StagePeak:
    """One pipeline stage's step on its rank.

    Attributes
    ----------
    peak_bytes : int
        Live tensor bytes at the stage's worst moment of a steady step.
    resident_bytes : int
        Live before the step: its parameters, buffers, optimizer state, batch, receive
        buffers and the last stage's outputs of the step before.
    parameter_bytes : int
        The stage's parameters.
    collectives : tuple of Collective
        What the stage's rank sends and receives in the step, in order: each
        micro-batch's activations to the next stage and its input's gradient to the one
        before (``torch.distributed.pipelining``'s point-to-point ops), as recorded on the
        fake process group (``collectives.CollectiveLog``).
    """

    peak_bytes: int
    resident_bytes: int
    parameter_bytes: int
    collectives: tuple[Collective, ...] = ()


def _steady_static(sched: Any) -> None:
    """Skip the schedule's first-step vote on how to learn the stages' shapes (a tensor
    ``.item()`` the fake tensors have no value for): every stage here was given its
    shapes, which that vote would find (``_PipelineSchedule._warmup_p2p``, schedules.py,
    ``InferenceMode.STATIC`` where each stage votes 1)."""
    from torch.distributed.pipelining.stage import InferenceMode

    def static(stages: list[Any], _has_backward: bool, _p2p_done: bool) -> None:
        for st in stages:
            st._inference_mode = InferenceMode.STATIC

    sched._warmup_p2p = static


def stage_peak(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    rank: int,
    question: StageQuestion,
) -> StagePeak:
    """Pipeline rank ``rank``'s step (its ``stages_per_rank`` stages) as ``question`` asks
    it and ``torch.distributed.pipelining`` runs it, on fake tensors and PyTorch's fake process
    group (``tensor_parallel.fake_process_group``): a meta copy of each stage's layers made
    fake, the schedule's third step counted by ``live_bytes.LiveBytes`` (the first two make the
    receive buffers and the optimizer state); with ``checkpoint``, every decoder layer
    checkpointed (:func:`checkpoint_layers`). With ``dp`` > 1 and ``reshard_after_forward``
    (not None), the stages are sharded by FSDP2 over ``dp`` data-parallel ranks
    (``pipeline_fsdp``; with ``replicate`` > 1, hsdp's ``replicate x dp / replicate``
    mesh), as data-parallel rank 0 of the stage holds them (its shards are padded, never
    short), each collective's gloo staging copies counted beside what is live at it
    (``pipeline_fsdp.GLOO_STAGING``). With ``tp`` > 1, the stages are sharded by the model's
    plan over ``tp`` tensor-parallel ranks (``pipeline_tensor_parallel``), as
    tensor-parallel rank 0 of the stage holds them, before FSDP2. The world is
    ``pp x dp x tp`` ranks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .step import fake_tensors_in_place, storage_dtype
    from .tensor_parallel import fake_process_group

    layout = _Layout.of(question)
    pp, dp, tp = layout.pp, layout.dp, layout.tp
    dtype, amp = storage_dtype(question.precision), layout.amp
    modules = [
        layout.copy(model, i, meta=True)
        for i in rank_stage_indices(rank, pp, layout.stages_per_rank)
    ]
    mode = FakeTensorMode()
    with mode:
        fake_tensors_in_place(modules, dtype)
        fake_inputs = {
            k: torch.empty(v.shape, dtype=v.dtype, device="cpu") for k, v in inputs.items()
        }
    config = _config(model)
    from .collectives import CollectiveLog
    from .data_dependent import example_mask_values
    from .probe import KernelProbe

    counter = LiveBytes(KernelProbe())
    log = CollectiveLog()
    # Hugging Face's mask and packed-sequence tests read values a fake tensor has not: they
    # answer as the example's tensors would (no padding mask, one sequence a row), so each
    # stage runs SDPA with is_causal and no (S, S) mask, as the real ranks do
    masks = example_mask_values(model, (), inputs)
    with (
        dtensor_caches_cleared() if tp > 1 else contextlib.nullcontext(),
        fake_process_group(pp * dp * tp, rank=rank * dp * tp),
        sends_held(),
        contextlib.ExitStack() as stack,
    ):
        # the meshes before the fake mode: a mesh reads its ranks' values
        meshes = _meshes(layout)
        stack.enter_context(mode)
        stack.enter_context(masks)
        with meshes_concatenated_outside_fake_mode():
            group = _shard_stages(modules, layout, meshes)
        if layout.sharded:
            from .pipeline_fsdp import GLOO_STAGING

            counter.staging = dict(GLOO_STAGING)
        run = _rank(
            modules, rank, layout, fake_inputs, question.optimizer, question.implementation,
            _loss_fn(model), config.hidden_size, config.vocab_size, amp or dtype, group,
        )  # fmt: skip
        _steady_static(run.schedule)
        for module in modules:
            for t in (*module.parameters(), *module.buffers()):
                counter.track(t)
        counter.track(run.batch)
        with counter, counter.rng_states():
            run.iterate()
            run.iterate()
            gc.collect()
            resident = counter.live_bytes
            counter.reset_peak()
            with log:  # innermost: it sees each op before the counter and the fake mode
                run.iterate()
        params = {
            local_part(p).untyped_storage(): None for module in modules for p in module.parameters()
        }
        param_bytes = sum(storage.nbytes() for storage in params)
    return StagePeak(counter.peak_with_workspaces(), resident, param_bytes, tuple(log.collectives))


def measure_stage(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    question: StageQuestion,
) -> tuple[int, int]:
    """On a real gloo rank of ``measure(gpus=pp x dp x tp, pp=pp)``: this rank's stages
    (copies of their layers only, in the precision's dtype; with ``tp`` > 1 sharded by the
    model's plan over its tensor-parallel ranks, ``pipeline_tensor_parallel``; with ``dp``
    > 1 by FSDP2 over the stage's data-parallel ranks, ``pipeline_fsdp``, on hsdp's 2-D mesh
    with ``replicate`` > 1)
    stepped by the schedule, two steps first, then five measured by the CPU profiler;
    (resident bytes, the least measured peak). The least: a send's buffer that gloo's
    worker thread drops last is a free the profiler, which records the calling thread, never
    sees (``distributed._collectives_release_on_caller``)."""
    import torch.distributed as dist

    from .measure_session import _run_cpu
    from .pipeline_fsdp import pipeline_rank
    from .step import storage_dtype

    layout = _Layout.of(question)
    pp, dp, tp = layout.pp, layout.dp, layout.tp
    rank, _dp_rank = pipeline_rank(dist.get_rank(), dp * tp)
    dtype, amp = storage_dtype(question.precision), layout.amp
    config = _config(model)
    meshes = _meshes(layout)

    def session() -> _Rank:
        modules = []
        for i in rank_stage_indices(rank, pp, layout.stages_per_rank):
            module = layout.copy(model, i, meta=False).to(dtype)
            module.train()
            modules.append(module)
        group = _shard_stages(modules, layout, meshes)
        ids = {k: v.clone() for k, v in inputs.items()}
        return _rank(
            modules, rank, layout, ids, question.optimizer, question.implementation,
            _loss_fn(model), config.hidden_size, config.vocab_size, amp or dtype, group,
        )  # fmt: skip

    with dtensor_caches_cleared() if tp > 1 else contextlib.nullcontext():
        resident, trace = _run_cpu(session, warmups=2, repeats=5)  # type: ignore[arg-type]
    return resident, resident + trace.peak_above_start(least=True)
