"""The bytes a rank sends per step: its collectives (recorded from its step on a fake process
group, ``_profiling/collectives.py``) or, for data-parallel layouts, the strategy's
collectives over the parameters and gradients. No torch here.

A rank's **sent bytes** of one collective of ``S`` payload bytes over a group of ``k`` ranks
are those of the ring algorithms, the factors NCCL's own tests apply to turn an operation's
size into the bytes each rank moves (nccl-tests, doc/PERFORMANCE.md, "Bus bandwidth":
AllReduce ``2(n-1)/n``, ReduceScatter and AllGather ``(n-1)/n``, AllToAll ``(n-1)/n``,
Broadcast ``1``):

- all-reduce of ``S`` bytes: ``2 (k-1) / k * S`` (a reduce-scatter then an all-gather, each
  moving ``(k-1)/k`` of the tensor);
- all-gather: ``(k-1) / k * S``, ``S`` the gathered (whole) tensor;
- reduce-scatter: ``(k-1) / k * S``, ``S`` the whole input;
- all-to-all: the input less the rank's own share, ``S - S_own`` (``(k-1) / k * S`` where
  the split is even);
- broadcast: ``S`` (a ring broadcast forwards the whole tensor);
- send: ``S``; a receive sends nothing.

Each collective's count is rounded down to a whole byte before they are summed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from .options import Strategy, StrEnum


class CollectiveKind(StrEnum):
    """The kinds of collective a rank's step issues."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a rank issued.

    Attributes
    ----------
    kind : CollectiveKind
    payload_bytes : int
        The tensor the collective is about: an all-reduce's tensor, an all-gather's
        gathered output, a reduce-scatter's whole input, an all-to-all's input, a
        broadcast's or a point-to-point message's tensor.
    group_size : int
        The ranks of its group.
    own_bytes : int
        An all-to-all's share the rank keeps (its own split); 0 for the other kinds.
    """

    kind: CollectiveKind
    payload_bytes: int
    group_size: int
    own_bytes: int = 0

    @property
    def sent_bytes(self) -> int:
        """The bytes this rank sends for it (the module's definition).

        Examples
        --------
        >>> Collective(CollectiveKind.ALL_REDUCE, 4096, 4).sent_bytes  # 2 * 3/4 * 4096
        6144
        >>> Collective(CollectiveKind.ALL_TO_ALL, 4096, 4, own_bytes=1024).sent_bytes
        3072
        """
        return sent_bytes(self.kind, self.payload_bytes, self.group_size, self.own_bytes)


def sent_bytes(
    kind: CollectiveKind, payload_bytes: int, group_size: int, own_bytes: int = 0
) -> int:
    """The bytes a rank sends for one collective of ``payload_bytes`` over ``group_size``
    ranks (the module's definition).

    Examples
    --------
    >>> sent_bytes(CollectiveKind.ALL_GATHER, 1000, 2)  # 1/2 * 1000
    500
    >>> sent_bytes(CollectiveKind.RECV, 1000, 2)
    0
    """
    k, s = group_size, payload_bytes
    if k < 1 or s < 0:
        raise ValueError(f"a collective needs group_size >= 1 and payload_bytes >= 0: {k}, {s}")
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (k - 1) * s // k
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
        return (k - 1) * s // k
    if kind is CollectiveKind.ALL_TO_ALL:
        return s - own_bytes
    if kind in (CollectiveKind.BROADCAST, CollectiveKind.SEND):
        return 0 if k == 1 and kind is CollectiveKind.BROADCAST else s
    return 0  # a receive


@dataclasses.dataclass(frozen=True)
class CommunicationVolume:
    """What a rank sends in one step, in total and by collective kind.

    Attributes
    ----------
    sent_bytes : int
        The bytes the rank sends per step (the sum of ``sent_bytes_by_kind``).
    sent_bytes_by_kind : Mapping[CollectiveKind, int]
        The same by kind; kinds the step does not issue are left out.
    collective_count : int
        The collectives issued (receives included).
    """

    sent_bytes: int
    sent_bytes_by_kind: Mapping[CollectiveKind, int]
    collective_count: int


def volume_of(collectives: Iterable[Collective]) -> CommunicationVolume:
    """The volume of ``collectives``.

    Examples
    --------
    >>> v = volume_of([Collective(CollectiveKind.ALL_REDUCE, 4096, 2),
    ...                Collective(CollectiveKind.SEND, 100, 2)])
    >>> v.sent_bytes, v.collective_count  # 2 x 1/2 x 4096 + 100
    (4196, 2)
    >>> {str(kind): sent for kind, sent in v.sent_bytes_by_kind.items()}
    {'all_reduce': 4096, 'send': 100}
    """
    by_kind: dict[CollectiveKind, int] = {}
    count = 0
    for c in collectives:
        by_kind[c.kind] = by_kind.get(c.kind, 0) + c.sent_bytes
        count += 1
    by_kind = {k: v for k, v in by_kind.items() if v or k is not CollectiveKind.RECV}
    return CommunicationVolume(sum(by_kind.values()), by_kind, count)


def scaled(volume: CommunicationVolume, numerator: int, denominator: int) -> CommunicationVolume:
    """``volume`` times ``numerator / denominator``, each kind's bytes rounded down.

    Examples
    --------
    >>> v = volume_of([Collective(CollectiveKind.ALL_REDUCE, 4096, 2)] * 2)  # 2 x 4096
    >>> scaled(v, 8, 2).sent_bytes  # 8 micro-batches where 2 were recorded: 4 x 8192
    32768
    """
    by_kind = {k: v * numerator // denominator for k, v in volume.sent_bytes_by_kind.items()}
    count = volume.collective_count * numerator // denominator
    return CommunicationVolume(sum(by_kind.values()), by_kind, count)


def data_parallel_volume(
    strategy: Strategy | None,
    dp: int,
    parameter_bytes: int,
    gradient_bytes: int,
    gpus_per_node: int,
    gather_bytes: int | None = None,
) -> CommunicationVolume:
    """What one of ``dp`` data-parallel ranks sends per optimizer step, from the whole
    model's ``parameter_bytes`` and ``gradient_bytes`` (the trainable parameters'
    gradients) by the strategy's collectives (``layouts.DATA_PARALLEL_TRAFFIC`` counts the
    same collectives in copies of the parameters, ``k`` large). FSDP2 all-gathers
    ``gather_bytes`` of parameters (default ``parameter_bytes``; under autocast its
    ``MixedPrecisionPolicy`` gathers them in the autocast dtype, ``sharding.
    FSDP_PARAM_DTYPE``: half the fp32 bytes):

    - ddp: an all-reduce of the gradients (DistributedDataParallel's buckets);
    - zero1: the same, then ZeroRedundancyOptimizer broadcasts each rank's updated shard
      (``_sync_params``): ``(k-1)/k`` of the trainable parameters, as an all-gather;
    - zero2: FSDP2 all-gathers the parameters once and reduce-scatters the gradients;
    - zero3: the parameters all-gathered twice (forward and backward);
    - hsdp: zero3 within each node of ``gpus_per_node`` ranks, then an all-reduce of each
      node's gradient shard (``G / gpus_per_node``) across the nodes.

    Examples
    --------
    >>> v = data_parallel_volume(Strategy.DDP, 4, 1000, 1000, 8)  # 2 * 3/4 * 1000
    >>> v.sent_bytes
    1500
    >>> data_parallel_volume(Strategy.ZERO3, 4, 1000, 1000, 8).sent_bytes  # 3 * 3/4 * 1000
    2250
    """
    if strategy is None or dp == 1:
        return volume_of(())
    K, G = CollectiveKind, gradient_bytes
    P = parameter_bytes if gather_bytes is None else gather_bytes
    collectives: list[Collective]
    if strategy is Strategy.DDP:
        collectives = [Collective(K.ALL_REDUCE, G, dp)]
    elif strategy is Strategy.ZERO1:
        collectives = [Collective(K.ALL_REDUCE, G, dp), Collective(K.ALL_GATHER, G, dp)]
    elif strategy is Strategy.ZERO2:
        collectives = [Collective(K.ALL_GATHER, P, dp), Collective(K.REDUCE_SCATTER, G, dp)]
    else:
        node = min(dp, gpus_per_node) if strategy is Strategy.HSDP else dp
        collectives = [
            Collective(K.ALL_GATHER, P, node),
            Collective(K.ALL_GATHER, P, node),
            Collective(K.REDUCE_SCATTER, G, node),
        ]
        if strategy is Strategy.HSDP and dp > node:
            collectives.append(Collective(K.ALL_REDUCE, G // node, dp // node))
    return volume_of(collectives)
