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

Not yet: ``zero1`` (``ZeroRedundancyOptimizer``), ``zero2`` / ``zero3`` (FSDP2
``fully_shard``) and ``hsdp``; asking for them says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._options import Strategy, parse_option

__all__ = [
    "DDP_BUCKET_CAP_BYTES",
    "DDP_FIRST_BUCKET_CAP_BYTES",
    "SINGLE_DEVICE",
    "STRATEGIES",
    "Parallel",
    "TrainableParam",
    "ddp_bucket_bytes",
    "resolve_parallel",
]

# DistributedDataParallel's default bucket_cap_mb, 25 MiB (torch/nn/parallel/distributed.py,
# _DEFAULT_BUCKET_CAP_MB = 25, times _MB_TO_BYTES = 1024 * 1024) ...
DDP_BUCKET_CAP_BYTES = 25 * 2**20
# ... and its smaller first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB,
# used where bucket_cap_mb is left at its default; _BucketCapacityConfig.create)
DDP_FIRST_BUCKET_CAP_BYTES = 2**20


@dataclass(frozen=True)
class TrainableParam:
    """One parameter that gets a gradient, as a strategy's rule sees it."""

    name: str
    nbytes: int  # its gradient's bytes (the parameter's dtype)
    dtype: str  # buckets hold one dtype each


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
    >>> mib = 2**20
    >>> ps = [TrainableParam(f"p{i}", n * mib, "float32") for i, n in enumerate([30, 2, 1, 1])]
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
        return STRATEGIES[self.strategy](params)

    def describe(self) -> str:
        return "1 device" if not self.distributed else f"{self.gpus} GPUs, {self.strategy.value}"


SINGLE_DEVICE = Parallel(1, Strategy.DDP)

# strategy -> its rule: the resident communication buffers of one rank
STRATEGIES: dict[Strategy, Callable[[Sequence[TrainableParam]], list[int]]] = {
    Strategy.DDP: ddp_bucket_bytes,
}


def resolve_parallel(gpus: object = 1, strategy: object = "ddp") -> Parallel:
    """``estimate``'s ``gpus`` and ``strategy`` keywords, checked (a ValueError naming the
    problem and the valid forms).

    Examples
    --------
    >>> resolve_parallel(8, "ddp").describe()
    '8 GPUs, ddp'
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
    if chosen not in STRATEGIES and gpus > 1:
        modelled = ", ".join(repr(s.value) for s in STRATEGIES)
        raise ValueError(
            f"strategy {chosen.value!r} is not modelled yet (each strategy is added once it "
            f"matches real torch.distributed runs); modelled: {modelled}"
        )
    return Parallel(gpus, chosen)
