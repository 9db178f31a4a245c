"""The layouts of N GPUs as data-parallel x tensor-parallel x pipeline ranks: which to try,
how each is named and ordered, and the result of :meth:`~.profile.ModelProfile.plan_layouts`.
No torch here; the estimates themselves are the profile's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from .communication import CollectiveKind
from .estimator import MemoryEstimate
from .options import FitBasis, PipelineSchedule, Strategy

# The data-parallel collectives' volume each rank moves in one optimizer step, in copies of
# the model's parameters, as the ZeRO paper counts it for ring collectives (Rajbhandari et
# al. 2020, arXiv:1910.02054, section 7: an all-reduce moves 2 copies, a reduce-scatter or
# an all-gather 1):
# - ddp: one all-reduce of the gradients (DistributedDataParallel's buckets): 2.
# - zero1: DDP's all-reduce, then ZeroRedundancyOptimizer broadcasts each rank's updated
#   shard to the others (torch/distributed/optim/zero_redundancy_optimizer.py,
#   ``_sync_params``: one ``dist.broadcast`` per rank's bucket), 1 more: 3.
# - zero2: FSDP2 with ``reshard_after_forward=False`` gathers each unit once, before its
#   forward, and reduce-scatters its gradients: 2.
# - zero3: gathered again for the backward (``reshard_after_forward=True``): 3.
# - hsdp: zero3 within a node, plus an all-reduce of each node's gradient shards across the
#   nodes (``foreach_reduce``'s ``all_reduce`` on the replicate group): 2 / gpus_per_node
#   more past one node.
# A step of ``grad_accumulation`` micro-batches repeats FSDP2's gathers and reduce-scatters
# per micro-batch; these count one. Tensor and pipeline parallelism move activations: None
# here; their bytes are the estimate's ``communication_sent_bytes``, recorded from the rank's
# step. The same collectives in bytes, with the ring's (k-1)/k: communication.py's
# ``data_parallel_volume``. FSDP2 over tensor-parallel ranks (dp x tp, zero2 / zero3 / hsdp)
# gathers and reduce-scatters the rank's own tp shard of the parameters only (FSDP2 shards
# each DTensor's local tensor): the same count over 1 / tp of the model (a parameter the
# plan replicates, such as a norm's weight, is counted at 1 / tp of its size too).
DATA_PARALLEL_TRAFFIC = {
    Strategy.DDP: 2.0,
    Strategy.ZERO1: 3.0,
    Strategy.ZERO2: 2.0,
    Strategy.ZERO3: 3.0,
    Strategy.HSDP: 3.0,
}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout to try: ``dp x tp x pp`` ranks, with the data-parallel ``strategy``
    (None where ``dp`` is 1), the pipeline's ``pp_schedule`` and ``microbatches`` (None
    where ``pp`` is 1) and the batch each rank is estimated at (``rank_batch_size``)."""

    dp: int
    tp: int
    pp: int
    strategy: Strategy | None
    pp_schedule: PipelineSchedule | None
    microbatches: int | None
    rank_batch_size: int

    @property
    def label(self) -> str:
        """The layout in a few words: ``"dp=4 zero3"``, ``"tp=2"``, ``"pp=2 1f1b m=4"``.

        Examples
        --------
        >>> Candidate(2, 1, 2, Strategy.DDP, PipelineSchedule.GPIPE, 2, 4).label
        'dp=2 ddp x pp=2 gpipe m=2'
        """
        parts = []
        if self.dp > 1 or (self.tp == 1 and self.pp == 1):
            strategy = "" if self.strategy is None else f" {self.strategy.value}"
            parts.append(f"dp={self.dp}{strategy}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        if self.pp > 1:
            assert self.pp_schedule is not None
            parts.append(f"pp={self.pp} {self.pp_schedule.value} m={self.microbatches}")
        return " x ".join(parts)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layout of the GPUs that the estimate answers, and its worst rank's step.

    Attributes
    ----------
    dp, tp, pp : int
        Data-parallel, tensor-parallel and pipeline ranks; ``dp * tp * pp`` is the GPUs.
    strategy : Strategy or None
        How the data-parallel ranks share the step (None where ``dp`` is 1).
    pp_schedule : PipelineSchedule or None
        The pipeline's schedule (None where ``pp`` is 1).
    microbatches : int or None
        The micro-batches of a pipeline step (None where ``pp`` is 1).
    rank_batch_size : int
        The batch the estimate was asked for: the plan's batch over ``dp`` (each
        data-parallel rank's share; a pipeline splits it into ``microbatches``).
    peak_bytes : int
        The worst rank's (or pipeline stage's) allocated peak, ``estimate.peak_bytes``.
    fit_bytes : int
        The worst rank's figure compared with the capacity on the plan's basis:
        ``estimate.device_bytes`` on ``"device"`` where the allocator is replayed, else
        ``estimate.total_bytes`` (peak plus the accelerator extras).
    fits : bool
        ``estimate.fits(capacity, basis)``.
    communication_bytes : int or None
        The communication buffers the rank keeps resident, as the estimate counts them
        (``estimate.communication_bytes``: DDP's gradient buckets, kept by ``"ddp"`` and
        ``"zero1"``; 0 for FSDP2, whose gather and reduce buffers are temporaries of the
        step). None with ``tp`` or ``pp`` above 1: their collectives' buffers are in the
        step, not counted apart.
    traffic_params : float or None
        The data-parallel collectives' volume per rank and optimizer step, in copies of the
        parameters (``DATA_PARALLEL_TRAFFIC``, the ZeRO paper's count); 0 for one rank.
        With ``dp`` and ``tp`` above 1 (FSDP2 over tensor-parallel ranks) the count over
        the rank's own tp shard, ``1 / tp`` of the parameters. None for ``tp`` alone and
        with ``pp`` above 1 (their volume is in ``communication_sent_bytes``).
    estimate : MemoryEstimate
        The worst rank's estimate itself.
    warnings : tuple of str
        What the estimate warned of for this layout, once each.
    communication_sent_bytes : int or None
        The bytes a rank sends per step (``communication.py``: each collective's ring
        count). With ``tp`` or ``pp`` above 1, the estimate's own, recorded from the rank's
        step (the pipeline stage that sends most); for a data-parallel layout, its
        strategy's collectives over the whole model's parameter and gradient bytes
        (``communication.data_parallel_volume``); 0 for one device. None where not
        estimated.
    communication_sent_bytes_by_kind : Mapping[CollectiveKind, int]
        The same by collective kind.
    """

    dp: int
    tp: int
    pp: int
    strategy: Strategy | None
    pp_schedule: PipelineSchedule | None
    microbatches: int | None
    rank_batch_size: int
    peak_bytes: int
    fit_bytes: int
    fits: bool
    communication_bytes: int | None
    traffic_params: float | None
    estimate: MemoryEstimate = dataclasses.field(repr=False, compare=False)
    warnings: tuple[str, ...] = ()
    communication_sent_bytes: int | None = None
    communication_sent_bytes_by_kind: Mapping[CollectiveKind, int] = dataclasses.field(
        default_factory=dict, compare=False
    )

    @property
    def label(self) -> str:
        """The layout in a few words (``Candidate.label``)."""
        return _candidate_of(self).label


@dataclasses.dataclass(frozen=True)
class RefusedLayout:
    """A layout of the GPUs the estimate does not answer, and its own reason."""

    dp: int
    tp: int
    pp: int
    strategy: Strategy | None
    pp_schedule: PipelineSchedule | None
    microbatches: int | None
    reason: str

    @property
    def label(self) -> str:
        """The layout in a few words (``Candidate.label``)."""
        return _candidate_of(self).label


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """The layouts of ``gpus`` GPUs for one step, best first (:func:`layout_order`), and
    those refused with their reasons.

    Attributes
    ----------
    gpus : int
        The GPUs every layout uses.
    batch_size : int
        The step's whole batch (every data-parallel rank takes ``batch_size / dp``).
    capacity_bytes : int
        Each GPU's memory.
    basis : FitBasis
        What "fits" compares with the capacity (``MemoryEstimate.fits``).
    layouts : tuple of Layout
        The answered layouts, best first.
    refused : tuple of RefusedLayout
        The layouts not estimated, in the order tried.
    """

    gpus: int
    batch_size: int
    capacity_bytes: int
    basis: FitBasis
    layouts: tuple[Layout, ...]
    refused: tuple[RefusedLayout, ...]

    @property
    def best(self) -> Layout | None:
        """The first layout that fits, or None where none does."""
        return next((layout for layout in self.layouts if layout.fits), None)

    @property
    def fitting(self) -> tuple[Layout, ...]:
        """The layouts that fit, best first."""
        return tuple(layout for layout in self.layouts if layout.fits)


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending.

    Examples
    --------
    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    gpus: int,
    batch_size: int,
    microbatches: int | None,
    strategies: tuple[Strategy, ...] = tuple(Strategy),
) -> Iterator[Candidate | RefusedLayout]:
    """Every ``dp x tp x pp = gpus`` layout, tensor-parallel ranks ascending, then pipeline
    stages: each data-parallel strategy where ``dp > 1``, each schedule where ``pp > 1``
    (``microbatches``, default ``pp``). A ``dp`` that does not divide ``batch_size`` is
    refused here; every other refusal is the estimate's.

    Examples
    --------
    >>> [c.label for c in candidates(2, 4, None, (Strategy.DDP,))]
    ['dp=2 ddp', 'pp=2 gpipe m=2', 'pp=2 1f1b m=2', 'pp=2 interleaved-1f1b m=2', 'tp=2']
    """
    for tp in divisors(gpus):
        for pp in divisors(gpus // tp):
            dp = gpus // (tp * pp)
            shares: tuple[Strategy | None, ...] = strategies if dp > 1 else (None,)
            schedules: tuple[PipelineSchedule | None, ...] = (
                tuple(PipelineSchedule) if pp > 1 else (None,)
            )
            m = (pp if microbatches is None else microbatches) if pp > 1 else None
            for strategy in shares:
                for schedule in schedules:
                    if batch_size % dp:
                        yield RefusedLayout(
                            dp, tp, pp, strategy, schedule, m,
                            f"batch_size={batch_size} is not split evenly over dp={dp} "
                            "data-parallel ranks: give a batch that dp divides",
                        )  # fmt: skip
                        continue
                    yield Candidate(dp, tp, pp, strategy, schedule, m, batch_size // dp)


def traffic_params(candidate: Candidate, gpus_per_node: int) -> float | None:
    """The data-parallel collectives' volume of ``candidate`` per rank and step, in copies
    of the parameters (``DATA_PARALLEL_TRAFFIC``); with ``dp`` and ``tp`` above 1, FSDP2's
    count over the rank's own tp shard (``1 / tp`` of the parameters); None for ``tp``
    alone and with ``pp`` above 1.

    Examples
    --------
    >>> c = Candidate(16, 1, 1, Strategy.HSDP, None, None, 1)
    >>> traffic_params(c, gpus_per_node=8)  # 3 within a node + 2 / 8 across the 2 nodes
    3.25
    >>> traffic_params(Candidate(2, 2, 1, Strategy.ZERO3, None, None, 1), 8)  # 3 / tp
    1.5
    >>> traffic_params(Candidate(4, 2, 1, Strategy.HSDP, None, None, 1), 4)  # 3 / 2 + 2 / 4
    2.0
    """
    if candidate.pp > 1 or (candidate.tp > 1 and candidate.strategy is None):
        return None
    if candidate.strategy is None:
        return 0.0
    # FSDP2 over the tp ranks: the rank's own tp shard is gathered and reduced
    volume = DATA_PARALLEL_TRAFFIC[candidate.strategy] / candidate.tp
    if candidate.strategy is Strategy.HSDP and candidate.dp * candidate.tp > gpus_per_node:
        # the gradient shard all-reduced across the nodes: 1 / gpus_per_node of the
        # parameters (a node's gpus_per_node / tp shard ranks of a 1 / tp shard)
        volume += 2.0 / gpus_per_node
    return volume


def layout_order(layout: Layout) -> tuple[bool, bool, int, int, int]:
    """The plan's order, as a sort key: layouts that fit first; then the fewest bytes a
    rank sends per step (``communication_sent_bytes``; layouts where it is not estimated
    after the others); then the lowest ``fit_bytes``; then the fewest model-parallel
    ranks.

    Examples
    --------
    >>> from vram_widget import profile_model, zoo
    >>> est = profile_model(zoo.mlp(), input_size=(784,), device="cpu").estimate(1)
    >>> def row(strategy, sent, fit_bytes):
    ...     return Layout(2, 1, 1, strategy, None, None, 1, fit_bytes, fit_bytes, True,
    ...                   0, None, est, communication_sent_bytes=sent)
    >>> rows = [row(Strategy.ZERO3, 300, 10), row(Strategy.DDP, 200, 30),
    ...         row(Strategy.ZERO2, 200, 20), row(Strategy.ZERO1, None, 5)]
    >>> [r.strategy.value for r in sorted(rows, key=layout_order)]
    ['zero2', 'ddp', 'zero3', 'zero1']
    """
    sent = layout.communication_sent_bytes
    return (
        not layout.fits,
        sent is None,
        0 if sent is None else sent,
        layout.fit_bytes,
        layout.tp * layout.pp,
    )


def fit_bytes(est: MemoryEstimate, basis: FitBasis) -> int:
    """The figure ``est.fits(capacity, basis)`` compares with the capacity."""
    if basis is FitBasis.DEVICE and est.device_bytes is not None:
        return est.device_bytes
    return est.total_bytes


def _candidate_of(row: Layout | RefusedLayout) -> Candidate:
    return Candidate(row.dp, row.tp, row.pp, row.strategy, row.pp_schedule, row.microbatches, 1)
