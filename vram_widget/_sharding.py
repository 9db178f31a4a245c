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

Not yet: ``zero2`` / ``zero3`` (FSDP2 ``fully_shard``) and ``hsdp``; asking for them says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._options import Strategy, parse_option

__all__ = [
    "DDP_BUCKET_CAP_BYTES",
    "DDP_FIRST_BUCKET_CAP_BYTES",
    "ITEMSIZE",
    "SINGLE_DEVICE",
    "STRATEGIES",
    "Parallel",
    "StrategyRule",
    "TrainableParam",
    "check_rank",
    "ddp_bucket_bytes",
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


def _ddp_only(_params: Sequence[TrainableParam], _world_size: int, _rank: int | None) -> None:
    return None


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


@dataclass(frozen=True)
class Parallel:
    """How many devices one step is spread over, and how (``gpus=1``: one device, no
    wrapper, whatever the strategy)."""

    gpus: int
    strategy: Strategy

    @property
    def distributed(self) -> bool:
        return self.gpus > 1

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


def resolve_parallel(
    gpus: object = 1, strategy: object = "ddp", *, modelled: bool = True
) -> Parallel:
    """``estimate``'s ``gpus`` and ``strategy`` keywords, checked (a ValueError naming the
    problem and the valid forms). ``modelled=False`` accepts a strategy without a rule yet
    (``measure`` runs the real engine for those it can set up).

    Examples
    --------
    >>> resolve_parallel(8, "ddp")
    Parallel(gpus=8, strategy=<Strategy.DDP: 'ddp'>)
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
    return Parallel(gpus, chosen)
