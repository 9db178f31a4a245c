"""The data-parallel strategies: what each adds to, or takes from, one rank's step.

Numpy and plain Python, no torch: the estimate of one rank is the single-device step of the
profile (at the per-rank batch) changed by its strategy's rule, found in :data:`STRATEGIES`.
A rule is checked against the real engine (``measure(..., gpus=N, strategy=...)``, which
runs torch.distributed on N processes), never against itself.

Modelled so far:

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` with its defaults. Its reducer keeps
  one flat buffer per gradient bucket for the whole run, beside the gradients
  (``gradient_as_bucket_view=False``: the gradients are copied into the buckets, reduced
  there, and copied back), so each rank holds the trainable parameters' bytes once more.

* ``zero1``: DDP plus ``torch.distributed.optim.ZeroRedundancyOptimizer`` with its defaults
  (``parameters_as_bucket_view=False``): DDP's buckets as above, and each rank's optimizer
  over its own shard of the parameters only (ZeRO's greedy partition, :func:`zero_partition`),
  so its state and step temporaries are the shard's; the updated shards are broadcast in
  place. Ranks differ; the estimate is the worst one.

* ``zero2`` / ``zero3``: FSDP2's ``fully_shard`` on each repeated block and then on the root
  (:func:`fsdp_step_edits`). Each rank keeps its dim-0 shard of every parameter (padded to
  the world size), of every gradient and of the optimizer state; each unit's parameters are
  all-gathered into a flat buffer and copied out before its forward, and its gradients are
  copied into a flat buffer and reduce-scattered after its backward. ``zero3`` frees a
  block's gathered parameters after its forward and gathers them again (one unit ahead) in
  the backward; ``zero2`` keeps them from forward to backward.

* ``hsdp``: ``zero3`` within each node of ``gpus_per_node`` ranks (the shards are a node's),
  replicated across nodes: each unit's gradient shards are all-reduced across the nodes in
  place, after the reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .fsdp_post_backward import hold_seeds, redistributed_grads, release_seeds
from .options import CATEGORY_CODE, PHASE_CODE, Category, Phase, Precision, Strategy, parse_option

__all__ = [
    "DDP_BUCKET_CAP_BYTES",
    "DDP_FIRST_BUCKET_CAP_BYTES",
    "DEFAULT_GPUS_PER_NODE",
    "FSDP_PARAM_DTYPE",
    "ITEMSIZE",
    "SINGLE_DEVICE",
    "STRATEGIES",
    "FsdpParam",
    "Parallel",
    "StepEdits",
    "StrategyRule",
    "TrainableParam",
    "check_rank",
    "ddp_bucket_bytes",
    "fsdp_step_edits",
    "gloo_average_bytes",
    "local_shard_shape",
    "resolve_fsdp_units",
    "resolve_parallel",
    "zero_partition",
]

# DistributedDataParallel's default bucket_cap_mb, 25 MiB (torch/nn/parallel/distributed.py,
# _DEFAULT_BUCKET_CAP_MB = 25, times _MB_TO_BYTES = 1024 * 1024) ...
DDP_BUCKET_CAP_BYTES = 25 * 2**20
# ... and its smaller first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB,
# used where bucket_cap_mb is left at its default; _BucketCapacityConfig.create)
DDP_FIRST_BUCKET_CAP_BYTES = 2**20


# bytes per element of the dtypes a gradient is kept in
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class TrainableParam:
    """One parameter that gets a gradient, as a strategy's rule sees it."""

    name: str
    numel: int  # elements (what ZeRO balances its shards by)
    dtype: str  # its gradient's (the parameter's); buckets hold one dtype each

    @property
    def nbytes(self) -> int:
        """Its gradient's bytes."""
        return self.numel * ITEMSIZE[self.dtype]


def ddp_bucket_bytes(
    params: Sequence[TrainableParam],
    first_cap_bytes: int = DDP_FIRST_BUCKET_CAP_BYTES,
    cap_bytes: int = DDP_BUCKET_CAP_BYTES,
) -> list[int]:
    """The sizes of DDP's flat gradient buckets for ``params`` (in registration order).

    After its first iteration DDP rebuilds its buckets in the order the gradients became
    ready, about the reverse of registration (``torch/nn/parallel/distributed.py``: "reverse
    list of buckets because we want to approximate the order in which their gradients are
    produced"), with the limits ``[first_cap_bytes, cap_bytes]``: the reducer's
    ``compute_bucket_assignment_by_size`` (``torch/csrc/distributed/c10d/reducer.cpp``) adds
    tensors to the open bucket of their dtype and closes it once it holds at least its
    limit, the first bucket's limit being the small one. The sizes sum to the parameters'
    bytes whatever the order; they matter for the caching allocator's segments.

    Examples
    --------
    >>> mib = 2**20  # fp32 parameters of 30, 2, 1 and 1 MiB
    >>> ps = [TrainableParam(f"p{i}", n * mib // 4, "float32") for i, n in enumerate([30, 2, 1, 1])]
    >>> # reversed: 1 MiB fills the 1 MiB first bucket; 1 + 2 + 30 passes the 25 MiB limit
    >>> ddp_bucket_bytes(ps) == [1 * mib, 33 * mib]
    True
    """
    buckets: list[int] = []
    open_bytes: dict[str, int] = {}
    closed_per_dtype: dict[str, int] = {}
    for p in reversed(params):
        size = open_bytes.get(p.dtype, 0) + p.nbytes
        limit = first_cap_bytes if closed_per_dtype.get(p.dtype, 0) == 0 else cap_bytes
        if size >= limit:
            buckets.append(size)
            open_bytes[p.dtype] = 0
            closed_per_dtype[p.dtype] = closed_per_dtype.get(p.dtype, 0) + 1
        else:
            open_bytes[p.dtype] = size
    buckets.extend(n for n in open_bytes.values() if n)
    return buckets


def zero_partition(params: Sequence[TrainableParam], world_size: int) -> list[list[str]]:
    """The parameter names each rank's ``ZeroRedundancyOptimizer`` steps.

    Its rule (``torch/distributed/optim/zero_redundancy_optimizer.py``,
    ``_partition_parameters``): the parameters sorted by element count, largest first
    (``sorted``, so ties keep their order), each to the rank with the fewest elements so far
    (the first such rank, ``_get_min_index``).

    Examples
    --------
    >>> ps = [TrainableParam(n, k, "float32") for n, k in [("a", 5), ("b", 9), ("c", 4)]]
    >>> zero_partition(ps, 2)   # b (9) -> rank 0; a (5) -> rank 1; c (4) -> rank 1 (5 < 9)
    [['b'], ['a', 'c']]
    """
    shards: list[list[str]] = [[] for _ in range(world_size)]
    sizes = [0] * world_size
    for p in sorted(params, key=lambda t: t.numel, reverse=True):
        rank = sizes.index(min(sizes))
        shards[rank].append(p.name)
        sizes[rank] += p.numel
    return shards


def _zero_ranks(
    params: Sequence[TrainableParam], world_size: int, rank: int | None
) -> list[tuple[int, tuple[str, ...]]]:
    """``rank``'s shard, or (None) the ranks whose step can be the worst, with their shards.

    What differs between ZeRO ranks is their optimizer's state (their shard's elements) and
    its step's temporaries: on CUDA a foreach step's grow with the shard's elements; a
    single-tensor step (the CPU's) keeps one parameter's ``denom`` while it makes the next
    one's two (``torch/optim/adam.py``, ``_single_tensor_adam``), so its largest moment
    follows the shard's first two parameters (ZeRO orders each shard largest first). The
    candidates are the two ranks with the most elements, the two with the largest such
    moment, and rank 0; the estimate is the worst of them."""
    shards = zero_partition(params, world_size)
    if rank is not None:
        return [(rank, tuple(shards[rank]))]
    numel = {p.name: p.numel for p in params}
    elements = [sum(numel[n] for n in shard) for shard in shards]
    # the largest moment of a single-tensor step: the first parameter's two temporaries, or
    # its denom kept while the second one's two are made
    firsts = [[numel[n] for n in shard[:2]] + [0, 0] for shard in shards]
    moment = [max(2 * a, a + 2 * b) for a, b, *_ in firsts]
    chosen = {0}
    for per_rank in (elements, moment):
        chosen.update(sorted(range(world_size), key=lambda r: (-per_rank[r], r))[:2])
    return [(r, tuple(shards[r])) for r in sorted(chosen)]


def shard_dim0(dim0: int, world_size: int) -> int:
    """Rows of dim 0 in each rank's padded shard: FSDP2 pads dim 0 up to a multiple of the
    world size and gives each rank one chunk (``_fsdp_param.py``, ``_init_sharded_param``:
    ``padded_sharded_size = chunks[0].size()`` of ``torch.chunk(param, world_size)``, with
    ``_get_dim0_padded_size`` in ``_fsdp_common.py``)."""
    return -(-dim0 // world_size)


def local_shard_shape(shape: tuple[int, ...], world_size: int, rank: int) -> tuple[int, ...]:
    """The shape of ``rank``'s shard of a parameter of ``shape`` without the padding (its
    ``DTensor.to_local()``, what the optimizer's state is made like): the padded chunk's
    rows, or fewer for the ranks at the end (none past the last row).

    Examples
    --------
    >>> local_shard_shape((5, 3), 2, 0), local_shard_shape((5, 3), 2, 1)  # chunks of 3 rows
    ((3, 3), (2, 3))
    >>> local_shard_shape((2, 3), 4, 3)     # 4 ranks, 2 rows: ranks 2 and 3 hold none
    (0, 3)
    """
    if not shape:
        return shape
    rows = shard_dim0(shape[0], world_size)
    return (max(0, min(rows, shape[0] - rank * rows)), *shape[1:])


# gloo carries out ReduceOp.AVG by reducing with SUM and then dividing its copy in place by
# the group's size, a Python number: ``aten::div_`` wraps it in an 8-byte (double) scalar
# tensor and casts that to the copy's dtype, both freed within the call (measured with the
# CPU profiler inside torch 2.13's ``c10d::_reduce_scatter_base_`` on ProcessGroupGloo:
# ``aten::clone``, ``gloo:all_reduce``, ``aten::div_`` with 8 B and an ``aten::to`` of 4 B
# in fp32, 2 B in bf16). NCCL averages natively (torch/csrc/distributed/c10d/
# ProcessGroupNCCL.cpp, the ``ncclOp`` map: ``{ReduceOp::AVG, ncclAvg}`` from NCCL 2.10):
# nothing is allocated for it on a GPU.
GLOO_WRAPPED_NUMBER_BYTES = 8


def gloo_average_bytes(itemsize: int) -> int:
    """The bytes gloo allocates beside its staging copy to average a collective's result
    (``ReduceOp.AVG``) of ``itemsize``-byte elements: the wrapped divisor and its cast.

    Examples
    --------
    >>> gloo_average_bytes(4), gloo_average_bytes(2)  # fp32, bf16
    (12, 10)
    """
    return GLOO_WRAPPED_NUMBER_BYTES + itemsize


@dataclass(frozen=True)
class FsdpParam:
    """One parameter as FSDP2 shards it."""

    name: str
    shape: tuple[int, ...]
    itemsize: int  # bytes per element of its shard as stored (the precision's)
    row: int  # the module row that owns it
    unit: int  # its FSDP unit: 0 the root, i >= 1 the i-th block
    trainable: bool  # gets a gradient (reduce-scattered)
    # MixedPrecisionPolicy: the dtype it is gathered (and its gradient made) in, and the one
    # gradients are reduced in; None: its own
    gather_itemsize: int | None = None
    reduce_itemsize: int | None = None

    def padded_shard_numel(self, world_size: int) -> int:
        """Its shard's elements on every rank, padding included."""
        if not self.shape:
            return 1
        rest = int(np.prod(self.shape[1:], dtype=np.int64))
        return shard_dim0(self.shape[0], world_size) * rest

    def padded_shard_bytes(self, world_size: int) -> int:
        """Its shard's bytes on every rank, padding included (one storage per parameter)."""
        return self.padded_shard_numel(world_size) * self.itemsize

    @property
    def gathered_itemsize(self) -> int:
        return self.gather_itemsize or self.itemsize

    @property
    def reduced_itemsize(self) -> int:
        return self.reduce_itemsize or self.gathered_itemsize


@dataclass(frozen=True)
class StepEdits:
    """What a sharding strategy inserts into one rank's step of the single-device timeline,
    and the resident bytes it changes. Events are inserted before ``position`` (an index of
    the single-device events), in order; ``storage`` ids ``>= 0`` are the timeline's own
    (the unsharded gradients freed), ids ``< 0`` are new, each allocated once and freed at
    most once."""

    position: np.ndarray  # int64, non-decreasing
    nbytes: np.ndarray  # int64, signed
    category: np.ndarray  # int8 category code
    row: np.ndarray  # int32 module row
    phase: np.ndarray  # int8 phase code
    storage: np.ndarray  # int64
    param_rows: np.ndarray  # int64 per row: each rank's parameter shards (padded)
    param_blocks: np.ndarray  # int64: one storage per parameter shard
    grad_rows: np.ndarray  # int64 per row: the gradient shards after the backward
    freed_gradients: frozenset[int]  # the timeline's gradient storages freed in the step


class _Inserts:
    """Events collected in program order at positions of the single-device timeline."""

    def __init__(self) -> None:
        self.cols: list[tuple[int, int, int, int, int, int]] = []
        self.next_id = -1

    def alloc(self, at: int, nbytes: int, category: Category, row: int, phase: Phase) -> int:
        sid = self.next_id
        self.next_id -= 1
        self.cols.append((at, nbytes, CATEGORY_CODE[category], row, PHASE_CODE[phase], sid))
        return sid

    def free(
        self, at: int, nbytes: int, category: Category, row: int, phase: Phase, sid: int
    ) -> None:
        self.cols.append((at, -nbytes, CATEGORY_CODE[category], row, PHASE_CODE[phase], sid))

    def temporary(self, at: int, nbytes: int, row: int, phase: Phase) -> None:
        sid = self.alloc(at, nbytes, Category.COMMUNICATION, row, phase)
        self.free(at, nbytes, Category.COMMUNICATION, row, phase, sid)


def _unit_spans(
    unit_of_row: np.ndarray, event_module: np.ndarray, lo: int, hi: int, n_units: int
) -> tuple[np.ndarray, np.ndarray]:
    """First and one-past-last event in ``[lo, hi)`` of each unit's own rows (-1 if none)."""
    units = unit_of_row[event_module[lo:hi]]
    first = np.full(n_units, -1, np.int64)
    last = np.full(n_units, -1, np.int64)
    idx = np.arange(lo, hi)
    for u in range(1, n_units):
        mine = idx[units == u]
        if len(mine):
            first[u], last[u] = mine[0], mine[-1] + 1
    return first, last


def fsdp_step_edits(
    params: Sequence[FsdpParam],
    unit_rows: Sequence[int],
    unit_of_row: np.ndarray,
    *,
    world_size: int,
    reshard_after_forward: bool,
    gloo: bool,
    event_module: np.ndarray,
    loss_row: int,
    micro_batches: Sequence[tuple[int, int, int]],
    optimizer_at: int,
    gradient_allocs: Sequence[tuple[int, int, int, int]],
    n_rows: int,
    accumulate_frees: Sequence[tuple[int, int, int, int]] = (),
    zero_grad_frees: Sequence[tuple[int, int, int, int]] = (),
    seed_frees: Sequence[tuple[int, int, int, int]] = (),
    compiled_units: bool = False,
    averaged: bool = False,
    replicated: bool = False,
) -> StepEdits:
    """FSDP2's events in one rank's training step, in the order its hooks run them.

    ``unit_rows[u]`` is the module row of unit ``u`` (0: the root, then the blocks in forward
    order), ``unit_of_row`` each row's innermost unit. ``micro_batches`` are the
    single-device timeline's ``(forward start, backward start, backward end)`` event
    indices, one per micro-batch (gradient accumulation). ``gradient_allocs`` are its
    gradient storages: ``(storage id, bytes, row, event index of its allocation)``;
    ``accumulate_frees`` the gradients a later micro-batch frees once ``AccumulateGrad`` has
    added them into the resident ones, ``zero_grad_frees`` the resident gradients
    ``zero_grad`` frees, ``seed_frees`` the frees of each backward's gradient seed (all
    three ``(storage id, bytes, row, event index)``). The rules,
    from ``torch/distributed/fsdp/_fully_shard`` (``_fsdp_param_group.py``,
    ``_fsdp_collectives.py``, ``_fsdp_state.py``):

    * ``unshard``: ``foreach_all_gather`` allocates one flat output of ``world_size`` times
      the unit's padded shards; ``wait_for_unshard`` copies it out into one buffer per
      parameter (``init_all_gather_outputs``, ``world_size`` times its padded shard), then
      drops the flat buffer: in the backward at once, in the forward only once the next
      unit's copy-out is done (``comm_ctx.all_gather_state``, freed in the root's
      ``post_forward`` at the latest).
    * the blocks' ``post_forward`` reshards (frees the per-parameter buffers) under
      ``reshard_after_forward=True`` (``zero3``); the root keeps its parameters ("for the
      root, do not reshard after forward since ... they would be all-gathered immediately",
      ``_fsdp_state._lazy_init``, the library's default for the root).
    * ``pre_backward`` all-gathers a resharded unit again and prefetches the unit before it
      in forward order (``_backward_prefetch``); the root's prefetches the last block.
    * ``post_backward`` reshards, drops the previous unit's reduce-scatter input
      (``reduce_scatter_max_input_buffers = 1``), then ``foreach_reduce``: a flat input of
      ``world_size`` times the padded gradient shards, the unsharded gradients copied in
      and freed, a flat output of one shard (the sharded gradients are views of it). The
      root's runs last (the final backward callback), and its input is dropped at the end.
      Before it reshards, a tensor-parallel gradient whose placements are not its
      parameter's is redistributed (``fsdp_post_backward.redistributed_grads``); the
      loss's gradient seed lives until after the final callback
      (``fsdp_post_backward.hold_seeds``).
    * ``gloo`` (the CPU backend) stages each all-gather through two flat temporaries of the
      output's size and each reduce-scatter through one of the input's (measured on torch
      2.13's ``ProcessGroupGloo``, ``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``;
      NCCL works in the buffers themselves). With ``averaged`` (FSDP2 reduces with
      ``ReduceOp.AVG``), gloo divides that copy by the group's size in place, with a
      wrapped divisor beside it (:func:`gloo_average_bytes`).
    * ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` (``gather_itemsize``,
      ``reduce_itemsize``): the shards are first cast into one flat buffer of the gather
      dtype (``_get_param_all_gather_inputs``'s foreach copy; freed when
      ``foreach_all_gather`` returns), gathered and copied out in it; the reduce-scatter
      buffers, and the gradient shards, are in the reduce dtype.
    * one shard (``world_size=1``: ``hsdp`` with one GPU per node) gathers nothing: the
      copy-out copies the shard (``wait_for_unshard``), and ``foreach_reduce`` copies the
      gradients into its output instead of reduce-scattering; its loop over the gradients
      (``if world_size > 1``) does not run, so no gradient outlives the copy-in.
    * ``hsdp`` (``replicated``) all-reduces each unit's gradient shards across the nodes
      in place (``foreach_reduce``'s ``dist.all_reduce(reduce_output)``): nothing allocated
      but, with ``averaged`` on gloo, the wrapped divisor and its cast of the average
      (:func:`gloo_average_bytes`), while the reduce input and output are both held (it
      decides a peak only with a shard of one rank, where no staging copy is larger).
    * every micro-batch gathers and reduce-scatters again. FSDP2 leaves no unsharded
      gradient behind, so a later micro-batch's gradients become ``.grad`` as the first
      one's do (not added into resident ones: their single-device frees are undone and
      they are freed after the reduce-scatter), and its reduce-scatter output is added
      into the gradient shards in place and dropped (``foreach_reduce``: ``_local_tensor
      += new_sharded_grad``).
    * ``zero_grad`` drops the gradient shards, not whole gradients.
    * ``compiled_units``: each unit is a compiled block (``torch.compile`` per block, then
      ``fully_shard``), whose events the timeline gives to the block's own row, its
      gradients included; a unit's last gradient is then found on the unit's row too.
    """
    n_units = len(unit_rows)
    world = world_size
    gathered = [0] * n_units  # bytes of a unit's flat all-gather output
    reduced = [0] * n_units  # bytes of a unit's gradient shards (the reduce-scatter output)
    cast_in = [0] * n_units  # MixedPrecisionPolicy: the shards cast to the gather dtype
    reduced_item = [0] * n_units  # bytes per element of a unit's reduce-scatter (one dtype)
    for p in params:
        shard = p.padded_shard_numel(world)
        gathered[p.unit] += world * shard * p.gathered_itemsize
        if p.gather_itemsize is not None:  # cast into one flat buffer first
            cast_in[p.unit] += shard * p.gathered_itemsize
        if p.trainable:
            reduced[p.unit] += shard * p.reduced_itemsize
            reduced_item[p.unit] = p.reduced_itemsize
    by_unit: list[list[FsdpParam]] = [[] for _ in range(n_units)]
    for p in params:
        by_unit[p.unit].append(p)
    grads_of: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n_units)]
    for sid, nbytes, row, at in gradient_allocs:
        grads_of[int(unit_of_row[row])].append((sid, nbytes, row, at))

    first_forward = micro_batches[0][0]
    f_first, _ = _unit_spans(unit_of_row, event_module, first_forward, micro_batches[0][1], n_units)
    blocks = [u for u in range(1, n_units) if f_first[u] >= 0]
    blocks.sort(key=lambda u: f_first[u])

    ins = _Inserts()
    fwd, bwd = Phase.FORWARD, Phase.BACKWARD
    unsharded: dict[int, list[tuple[int, int, int]]] = {}  # unit -> (sid, bytes, row)

    def all_gather(u: int, at: int, phase: Phase) -> int | None:
        if world == 1:  # one shard (hsdp with one GPU per node): copied out, not gathered
            return None
        cast = None
        if cast_in[u]:
            cast = ins.alloc(at, cast_in[u], Category.COMMUNICATION, unit_rows[u], phase)
        flat = ins.alloc(at, gathered[u], Category.COMMUNICATION, unit_rows[u], phase)
        if gloo:
            ins.temporary(at, gathered[u], unit_rows[u], phase)
            ins.temporary(at, gathered[u], unit_rows[u], phase)
        if cast is not None:  # foreach_all_gather's locals hold it until it returns
            ins.free(at, cast_in[u], Category.COMMUNICATION, unit_rows[u], phase, cast)
        return flat

    def copy_out(u: int, at: int, phase: Phase) -> None:
        unsharded[u] = []
        for p in by_unit[u]:
            nbytes = world * p.padded_shard_numel(world) * p.gathered_itemsize
            sid = ins.alloc(at, nbytes, Category.PARAMETER, p.row, phase)
            unsharded[u].append((sid, nbytes, p.row))

    def reshard(u: int, at: int, phase: Phase) -> None:
        for sid, nbytes, row in unsharded.pop(u, []):
            ins.free(at, nbytes, Category.PARAMETER, row, phase, sid)

    def free_flat(u: int, sid: int | None, at: int, phase: Phase) -> None:
        if sid is None:
            return
        ins.free(at, gathered[u], Category.COMMUNICATION, unit_rows[u], phase, sid)

    # a later micro-batch's gradients stay (no AccumulateGrad into resident ones): each
    # single-device free is undone right after it (emitted first: first at its position)
    for sid, nbytes, row, j in accumulate_frees:
        ins.cols.append((j + 1, nbytes, CATEGORY_CODE[Category.GRADIENT], row,
                         PHASE_CODE[bwd], sid))  # fmt: skip
        grads_of[int(unit_of_row[row])].append((sid, nbytes, row, j))

    freed: set[int] = set()
    shards_made: list[tuple[int, int]] = []  # (unit, storage) of each gradient-shard output

    def micro_batch(f0: int, b0: int, b1: int, accumulating: bool) -> None:
        f_first, f_last = _unit_spans(unit_of_row, event_module, f0, b0, n_units)
        b_first, b_last = _unit_spans(unit_of_row, event_module, b0, b1, n_units)
        forward_rows = np.nonzero(event_module[f0:b0] != loss_row)[0]
        root_forward_end = f0 + (int(forward_rows[-1]) + 1 if len(forward_rows) else 0)
        backward_rows = np.nonzero(event_module[b0:b1] != loss_row)[0]
        root_backward_start = b0 + (int(backward_rows[0]) if len(backward_rows) else 0)
        seeds = hold_seeds(ins, seed_frees, b0, b1)  # first: before any edit at its position

        # forward: the root, then each block; a flat output lives until the next copy-out
        held = (0, all_gather(0, f0, fwd))
        copy_out(0, f0, fwd)
        for u in blocks:
            at = max(int(f_first[u]), f0)
            flat = all_gather(u, at, fwd)
            copy_out(u, at, fwd)
            free_flat(*held, at, fwd)
            held = (u, flat)
            if reshard_after_forward:
                reshard(u, int(f_last[u]), fwd)
        free_flat(*held, root_forward_end, fwd)

        # backward: the blocks the backward reaches, in reverse; each hook prefetches the
        # unit before it in forward order (post_forward_order), reached or not
        pending: dict[int, int | None] = {}
        order = [u for u in reversed(blocks) if b_first[u] >= 0]

        def prefetch(u: int, at: int) -> None:
            if u not in unsharded and u not in pending:
                pending[u] = all_gather(u, at, bwd)

        def previous(u: int) -> int | None:
            i = blocks.index(u)
            return blocks[i - 1] if i > 0 else None

        if blocks:
            prefetch(blocks[-1], root_backward_start)
        reduce_input: tuple[int, int, int] | None = None  # (unit, sid, bytes), one unit

        def post_backward(u: int, at: int) -> None:
            nonlocal reduce_input
            grads = [g for g in grads_of[u] if b0 <= g[3] < b1]
            local = redistributed_grads(by_unit[u], grads, ins, at)
            reshard(u, at, bwd)
            if reduce_input is not None:
                prev, sid, nbytes = reduce_input
                ins.free(at, nbytes, Category.COMMUNICATION, unit_rows[prev], bwd, sid)
                reduce_input = None
            if not reduced[u]:
                return
            nbytes = world * reduced[u]
            sid = ins.alloc(at, nbytes, Category.COMMUNICATION, unit_rows[u], bwd)
            # foreach_reduce's loop over (fsdp_param, unsharded_grad) leaves the unit's last
            # gradient (its last parameter's, in registration order) bound to the loop
            # variable until it returns: that one is freed after the reduce-scatter. The
            # loop runs for world_size > 1 only (_fsdp_collectives.py, foreach_reduce)
            late = []
            last = next((p for p in reversed(by_unit[u]) if p.trainable), None)
            if last is not None and world > 1:
                nbytes_last = int(np.prod(last.shape, dtype=np.int64)) * last.gathered_itemsize
                rows = {last.row, unit_rows[u]} if compiled_units else {last.row}
                match = [g for g in local if g[2] in rows and g[1] == nbytes_last]
                late = match[-1:]
            for grad in local:
                if grad not in late:
                    ins.free(at, grad[1], Category.GRADIENT, grad[2], bwd, grad[0])
            output = ins.alloc(at, reduced[u], Category.GRADIENT, unit_rows[u], bwd)
            if gloo and world > 1:
                average = gloo_average_bytes(reduced_item[u]) if averaged else 0
                ins.temporary(at, nbytes + average, unit_rows[u], bwd)
            if gloo and averaged and replicated:  # the all-reduce across the replicas
                ins.temporary(at, gloo_average_bytes(reduced_item[u]), unit_rows[u], bwd)
            for gid, gbytes, row, _at in late:
                ins.free(at, gbytes, Category.GRADIENT, row, bwd, gid)
            if accumulating:  # added into the gradient shards; dropped as it returns
                ins.free(at, reduced[u], Category.GRADIENT, unit_rows[u], bwd, output)
            else:
                shards_made.append((u, output))
            freed.update(g[0] for g in grads)
            reduce_input = (u, sid, nbytes)

        for u in order:
            at = int(b_first[u])
            if u not in unsharded:
                flat = pending.pop(u) if u in pending else all_gather(u, at, bwd)
                copy_out(u, at, bwd)
                free_flat(u, flat, at, bwd)
            before = previous(u)
            if before is not None:
                prefetch(before, at)
            post_backward(u, int(b_last[u]))
        # the final callback: the root, then each unit the backward never reached, in
        # forward order, each followed by its finalize_backward (a prefetched gather never
        # waited on is dropped there); then the last reduce-scatter input
        for u in [0, *(b for b in blocks if b_first[b] < 0)]:
            post_backward(u, b1)
            if u in pending:
                free_flat(u, pending.pop(u), b1, bwd)
        if reduce_input is not None:
            prev, sid, nbytes = reduce_input
            ins.free(b1, nbytes, Category.COMMUNICATION, unit_rows[prev], bwd, sid)
        release_seeds(ins, seeds, b1)

    for m, (f0, b0, b1) in enumerate(micro_batches):
        micro_batch(f0, b0, b1, accumulating=m > 0)

    # zero_grad (after the optimizer): the gradient shards go; the whole gradients the
    # single-device step frees there are already gone (undone just before each free)
    zero = PHASE_CODE[Phase.ZERO_GRAD]
    first_zero = min((j for *_r, j in zero_grad_frees), default=optimizer_at)
    for u, output in shards_made:
        ins.cols.append((first_zero, -reduced[u], CATEGORY_CODE[Category.GRADIENT],
                         unit_rows[u], zero, output))  # fmt: skip
    for sid, nbytes, row, j in zero_grad_frees:
        if sid in freed:
            ins.cols.append((j, nbytes, CATEGORY_CODE[Category.GRADIENT], row, zero, sid))

    cols = sorted(enumerate(ins.cols), key=lambda item: (item[1][0], item[0]))
    table = np.asarray([c for _i, c in cols], dtype=np.int64).reshape(-1, 6)
    param_rows = np.zeros(n_rows, np.int64)
    grad_rows = np.zeros(n_rows, np.int64)
    for p in params:
        param_rows[p.row] += p.padded_shard_bytes(world)
        if p.trainable:
            grad_rows[p.row] += p.padded_shard_numel(world) * p.reduced_itemsize
    return StepEdits(
        position=table[:, 0],
        nbytes=table[:, 1],
        category=table[:, 2].astype(np.int8),
        row=table[:, 3].astype(np.int32),
        phase=table[:, 4].astype(np.int8),
        storage=table[:, 5],
        param_rows=param_rows,
        param_blocks=np.asarray([p.padded_shard_bytes(world) for p in params], np.int64),
        grad_rows=grad_rows,
        freed_gradients=frozenset(freed),
    )


def _ddp_only(_params: Sequence[TrainableParam], _world_size: int, _rank: int | None) -> None:
    return None


def _no_buffers(_params: Sequence[TrainableParam]) -> list[int]:
    return []


@dataclass(frozen=True)
class StrategyRule:
    """What a strategy changes in one rank's step."""

    # the buffers each rank keeps resident for the whole step, from the trainable parameters
    resident_buffers: Callable[[Sequence[TrainableParam]], list[int]]
    # None: every rank's optimizer steps every parameter; else the asked rank, or (rank
    # None) the ranks whose step can be the worst, each with the parameter names its
    # optimizer steps, in the order it steps them
    optimizer_shards: Callable[
        [Sequence[TrainableParam], int, int | None], list[tuple[int, tuple[str, ...]]] | None
    ]
    # FSDP2: None where parameters are whole on every rank; else whether the blocks reshard
    # after their forward (fsdp_step_edits)
    reshard_after_forward: bool | None = None
    # NCCL communicators on each rank: one per process group that communicates (HSDP's
    # shard and replicate mesh dims are two groups: FSDP2's HSDPMeshInfo,
    # torch/distributed/fsdp/_fully_shard/_fsdp_common.py)
    communicators: int = 1


# FSDP2 under autocast runs with MixedPrecisionPolicy(param_dtype=<the autocast dtype>,
# reduce_dtype=torch.float32), as torchtitan's mixed_precision_param / _reduce settings do
# (torchtitan/config: mixed_precision_param "bfloat16", mixed_precision_reduce "float32")
FSDP_PARAM_DTYPE: dict[Precision, str] = {
    Precision.AMP_BF16: "bfloat16",
    Precision.AMP_FP16: "float16",
}

# GPUs per node where none is given: the 8 of NVIDIA's DGX / HGX A100 and H100 systems
# (NVIDIA DGX H100 User Guide, "Hardware Overview": 8x NVIDIA H100 GPUs).
DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Parallel:
    """How many devices one step is spread over, and how (``gpus=1``: one device, no
    wrapper, whatever the strategy)."""

    gpus: int
    strategy: Strategy
    # the GPUs of one node: ``hsdp`` shards within a node and replicates across nodes
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    # FSDP2's units (module names, outermost); None: each repeated block
    fsdp_units: tuple[str, ...] | None = None

    @property
    def distributed(self) -> bool:
        return self.gpus > 1

    def param_dtype(self, precision: Precision) -> str | None:
        """The dtype FSDP2 gathers the parameters in where it casts them (its
        MixedPrecisionPolicy under autocast, :data:`FSDP_PARAM_DTYPE`); None: their own."""
        if self.reshard_after_forward is None:
            return None
        return FSDP_PARAM_DTYPE.get(precision)

    @property
    def shard_ranks(self) -> int:
        """The ranks one parameter is sharded over: every rank, but under ``hsdp`` the
        ranks of one node (``min(gpus, gpus_per_node)``)."""
        if self.strategy is Strategy.HSDP:
            return min(self.gpus, self.gpus_per_node)
        return self.gpus

    @property
    def reshard_after_forward(self) -> bool | None:
        """None unless the strategy shards the parameters (FSDP2); else whether its blocks
        reshard after their forward."""
        if not self.distributed:
            return None
        return STRATEGIES[self.strategy].reshard_after_forward

    def communication_blocks(self, params: Sequence[TrainableParam]) -> list[int]:
        """The buffers the strategy keeps resident on each rank for the whole step."""
        if not self.distributed:
            return []
        return STRATEGIES[self.strategy].resident_buffers(params)

    def optimizer_shards(
        self, params: Sequence[TrainableParam], rank: int | None = None
    ) -> list[tuple[int, tuple[str, ...]]] | None:
        """None where each rank's optimizer steps every parameter; else ``rank``'s shard, or
        the candidate worst ranks', with the parameters their optimizers step."""
        if not self.distributed:
            return None
        return STRATEGIES[self.strategy].optimizer_shards(params, self.gpus, rank)


SINGLE_DEVICE = Parallel(1, Strategy.DDP)

# strategy -> what it changes in one rank's step
STRATEGIES: dict[Strategy, StrategyRule] = {
    Strategy.DDP: StrategyRule(ddp_bucket_bytes, _ddp_only),
    Strategy.ZERO1: StrategyRule(ddp_bucket_bytes, _zero_ranks),
    Strategy.ZERO2: StrategyRule(_no_buffers, _ddp_only, reshard_after_forward=False),
    Strategy.ZERO3: StrategyRule(_no_buffers, _ddp_only, reshard_after_forward=True),
    # zero3 within each node; across nodes the gradient shards are all-reduced in place
    Strategy.HSDP: StrategyRule(
        _no_buffers, _ddp_only, reshard_after_forward=True, communicators=2
    ),
}


def check_rank(rank: object, gpus: int) -> int | None:
    """``estimate``'s ``rank`` keyword: None (the worst rank) or 0 <= rank < gpus."""
    if rank is None:
        return None
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < gpus:
        raise ValueError(
            f"rank must be None (the worst rank) or an int in [0, {gpus}) for gpus={gpus}; "
            f"got {rank!r}"
        )
    return rank


def resolve_fsdp_units(
    names: Sequence[str], types: Sequence[str], units: object
) -> tuple[str, ...] | None:
    """``fsdp_units``: None (each repeated block, :func:`levers.repeated_blocks`), or a
    module name or class name, or a list of them, resolved to the outermost modules they
    match (the root, ``""``, is always a unit of its own).

    Examples
    --------
    >>> names, types = ("", "h", "h.0", "h.0.fc", "h.1"), ("M", "ModuleList", "B", "L", "B")
    >>> resolve_fsdp_units(names, types, "B"), resolve_fsdp_units(names, types, ["h.1", "L"])
    (('h.0', 'h.1'), ('h.0.fc', 'h.1'))
    """
    if units is None:
        return None
    items = [units] if isinstance(units, str) else units
    if (
        not isinstance(items, (list, tuple))
        or not items
        or not all(isinstance(u, str) and u for u in items)
    ):
        raise ValueError(
            "fsdp_units must be None (each repeated block), a module name or class name, or "
            f"a list of them; got {units!r}"
        )
    chosen: set[str] = set()
    for item in items:
        found = {n for n, t in zip(names, types, strict=True) if n and item in (n, t)}
        if not found:
            examples = ", ".join(repr(n) for n in names[1:4])
            classes = ", ".join(sorted({repr(t) for t in types[1:]})[:4])
            raise ValueError(
                f"fsdp_units {item!r} matches no module (by qualified name or class name); "
                f"names such as {examples}; classes such as {classes}"
            )
        chosen |= found
    outermost = [n for n in chosen if not any(n.startswith(o + ".") for o in chosen)]
    return tuple(sorted(outermost, key=list(names).index))


def resolve_parallel(
    gpus: object = 1,
    strategy: object = "ddp",
    *,
    gpus_per_node: object = DEFAULT_GPUS_PER_NODE,
    modelled: bool = True,
) -> Parallel:
    """``estimate``'s ``gpus`` and ``strategy`` keywords, checked (a ValueError naming the
    problem and the valid forms). ``modelled=False`` accepts a strategy without a rule yet
    (``measure`` runs the real engine for those it can set up).

    Examples
    --------
    >>> resolve_parallel(8, "ddp")
    Parallel(gpus=8, strategy=<Strategy.DDP: 'ddp'>, gpus_per_node=8, fsdp_units=None)
    >>> resolve_parallel(0)
    Traceback (most recent call last):
    ...
    ValueError: gpus must be an int >= 1 (the number of data-parallel ranks); got 0
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(
            f"gpus must be an int >= 1 (the number of data-parallel ranks); got {gpus!r}"
        )
    chosen = parse_option(Strategy, strategy, "strategy")
    if modelled and chosen not in STRATEGIES and gpus > 1:
        rules = ", ".join(repr(s.value) for s in STRATEGIES)
        raise ValueError(
            f"strategy {chosen.value!r} is not modelled yet (each strategy is added once it "
            f"matches real torch.distributed runs); modelled: {rules}"
        )
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be an int >= 1; got {gpus_per_node!r}")
    parallel = Parallel(gpus, chosen, gpus_per_node)
    if chosen is Strategy.HSDP and gpus % parallel.shard_ranks:
        raise ValueError(
            f"hsdp shards over the {gpus_per_node} GPUs of a node and replicates across "
            f"nodes: gpus={gpus} is not a whole number of nodes of gpus_per_node="
            f"{gpus_per_node} (give gpus a multiple of it, or at most one node's)"
        )
    return parallel
