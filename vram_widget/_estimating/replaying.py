"""The caching-allocator replay without recording: flat integers, run at most once per setting.

:func:`~vram_widget._estimating.allocator.replay` walks :class:`~vram_widget._estimating.
allocator.CachingAllocator`, one object per block: the reference, and what records a
snapshot. This module replays the same rules (the allocator module's docstring, each cited
to ``CUDACachingAllocator.cpp``) over plain ints, for the numbers alone, and remembers each
outcome, so that every caller asking about the same step (``MemoryEstimate.allocator``,
``device_bytes``, ``fits``, the searches, the widget) shares one replay per setting.

The state, and why it is the reference's:

* A block is its address and size. Free blocks are kept per pool in a list of packed keys
  ``size << shift | address``, sorted, so ``bisect`` finds the reference's best fit: the
  smallest size of at least the request, the lowest address among equal sizes. Two dicts
  index them by start and by end, which is how a freed block finds its free neighbours
  (``try_merge_blocks``). A block split keeps its end, so the rest it leaves takes over
  the block's end entry, and its place in the pool where the rest is at least the request
  (every key before it is below the request's); a block merged with the free one after it
  takes that one's place where no key lies between them.
* Sizes and addresses are counted in 512-byte units (``kMinBlockSize``), which keeps them
  small ints.
* Segments are laid out in creation order, as ``cudaMalloc`` addresses are in the reference,
  with one unused unit between two segments: blocks compare in the same order as there,
  and the end of one segment is never the start of another, so only blocks of the same
  segment are ever neighbours.
* A block in use is known by its size alone to be small-pool or large-pool: small-pool
  blocks are split whenever 512 bytes or more remain (and every size is a multiple of 512),
  so one in use is the rounded request, at most 1 MiB; a large-pool block in use is at least
  its request, above 1 MiB. With expandable segments both pools split at 512 bytes, so the
  same holds.
* With expandable segments each pool is one segment growing at its end; the block at the
  growing end is the one whose end is the mapped end (the reference's ``_last``).

The events are paired up front (:func:`plan`): each free names the allocation it returns, as
the reference's ``live`` dict pairs them by storage (a free of a storage not live is
skipped; an allocation over a live storage leaves the earlier block in use to the end).
Allocated bytes are not counted in the loop: an iteration's peak is summed afterwards, in
numpy, from the blocks its slots were given.

The loop costs about 0.55 us an op (Llama-7B shape, batch 8 x 128, bf16, AdamW: 875
residents and 6,744 ops an iteration, about 8 ms for two iterations), nearly all of it the
interpreter's work on each op: dispatch and slot bookkeeping alone are about 0.3 ms an
iteration. The step's repeated layers (a period of 55 ops over its forward, of 126 over its
backward) do not make a layer's replay repeat the previous one's from an equal state: at
every period boundary of both iterations the free blocks differ from the previous
boundary's (a layer's saved activations take blocks and leave remainders, so the cache
shrinks or grows by the same few blocks each layer), as they do on GPT-2's step; so no
layer is skipped.

A replay under a cap is the free replay until the first new segment that would pass the cap
(only then does the allocator release cached segments), and the free replay's reserved bytes
only grow; so a replay may keep its state there (a checkpoint), and a later replay of the
same step under any cap at least the reserved bytes of that state starts from it. The free
replay keeps one where a given mark is first passed (``device_bytes`` marks the least cap it
tries), each capped replay one where it first binds: the climb of capped replays behind
``device_bytes`` replays the common prefix once.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .allocator import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorReplay,
    OutOfMemory,
    round_size,
)

__all__ = [
    "ReplayPlan",
    "ReplayStream",
    "cached_replay",
    "fast_replay",
    "forget_replays",
    "plan",
    "replays_run",
]

# Sizes and addresses are counted in 512-byte units (kMinBlockSize: every rounded size is
# a multiple of it, and so is every segment), which keeps them small ints: the
# allocator's constants in those units
_UNIT = K_MIN_BLOCK_SIZE
_SMALL_SIZE = K_SMALL_SIZE // _UNIT
_SMALL_BUFFER = K_SMALL_BUFFER // _UNIT
_LARGE_BUFFER = K_LARGE_BUFFER // _UNIT
_MIN_LARGE_ALLOC = K_MIN_LARGE_ALLOC // _UNIT
_ROUND_LARGE = K_ROUND_LARGE // _UNIT

_replays = [0]  # replays run by fast_replay since import (tests count them)


def replays_run() -> int:
    """How many replays :func:`fast_replay` has run in this process (cached ones not).

    Examples
    --------
    >>> before = replays_run()
    >>> _ = fast_replay(plan([1024], [], []))
    >>> replays_run() - before
    1
    """
    return _replays[0]


@dataclass(frozen=True, eq=False)
class ReplayPlan:
    """A step's allocation stream, paired and rounded for :func:`fast_replay`.

    Attributes
    ----------
    resident_sizes : list of int
        ``round_size`` of each resident request (those of at least one byte), in order, in
        512-byte units (every size and address of the replay is counted in them).
    resident_requests : list of int
        The same requests unrounded (an out-of-memory error names the request).
    ops : list of int
        One iteration: an allocation as its rounded size in units (> 0), in order, the i-th
        allocation being slot i; a free as ``~slot`` (< 0); the storages still live at the
        end freed last, in the reference's order.
    requests : list of int
        Each slot's unrounded request.
    leaked : list of int
        The slots never freed (an allocation over a live storage leaves the earlier block
        in use): what each iteration leaves allocated.
    shift : int
        Bits of an address in a packed free-block key (every address the default
        allocator's replay can reach, gaps included, is below ``1 << shift``).
    """

    resident_sizes: list[int]
    resident_requests: list[int]
    ops: list[int]
    requests: list[int]
    leaked: list[int]
    shift: int
    # where replays under caps may start (see _Checkpoint), by (iterations, run, op index);
    # each op's slot and sign, and each slot's op index (_op_slots)
    checkpoints: dict[tuple[int, int, int], _Checkpoint] = field(default_factory=dict, repr=False)
    op_slots: list[np.ndarray] = field(default_factory=list, repr=False)


def _rounded(nbytes: np.ndarray) -> list[int]:
    """``round_size`` of each (positive) request in 512-byte units; exact Python ints for
    object arrays."""
    if nbytes.dtype == object:
        return [round_size(int(n)) // _UNIT for n in nbytes]
    return np.maximum(1, (nbytes.astype(np.int64) + _UNIT - 1) // _UNIT).tolist()


def _exact(a: np.ndarray) -> list[int]:
    """An integer array as Python ints (``tolist`` gives them for numeric dtypes)."""
    return [int(r) for r in a.tolist()] if a.dtype == object else a.tolist()


def _paired_by_dict(ids: list[int], signs: list[int], sizes: list[int]) -> list[int]:
    """The ops of one iteration, paired as the reference's ``live`` dict pairs them."""
    live: dict[int, int] = {}
    ops: list[int] = []
    slot = 0
    for s, sign in zip(ids, signs, strict=True):
        if sign > 0:
            live[s] = slot  # over a live storage: the earlier block stays in use
            ops.append(sizes[slot])
            slot += 1
        elif sign < 0:
            freed = live.pop(s, None)
            if freed is not None:
                ops.append(~freed)
    ops.extend(~freed for freed in live.values())
    return ops


def _paired(ids: np.ndarray, nbytes: np.ndarray, sizes: list[int]) -> list[int] | None:
    """:func:`_paired_by_dict` in numpy, where each storage's events alternate allocation,
    free, allocation, ... (the recorded steps); None where they do not."""
    keep = nbytes != 0
    ids, nbytes = ids[keep], nbytes[keep]
    if not len(ids):
        return []
    alloc = nbytes > 0
    slots = np.cumsum(alloc) - 1  # each allocation's slot
    order = np.argsort(ids, kind="stable")  # by storage, in time within each
    grouped = ids[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = grouped[1:] != grouped[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    even = (np.arange(len(order)) - start) % 2 == 0
    if not np.array_equal(alloc[order], even):
        return None
    ops = np.zeros(len(ids), dtype=np.int64)
    ops[alloc] = sizes
    frees = np.flatnonzero(~alloc[order])  # positions in ``order``, each after its allocation
    ops[order[frees]] = ~slots[order[frees - 1]]
    last = np.ones(len(order), dtype=bool)
    last[:-1] = grouped[1:] != grouped[:-1]
    open_slots = np.sort(slots[order[last & even]])  # live at the end: in allocation order
    return [*ops.tolist(), *(~open_slots).tolist()]


def plan(
    resident_bytes: Sequence[int] | np.ndarray,
    storage: Sequence[int] | np.ndarray,
    nbytes: Sequence[int] | np.ndarray,
) -> ReplayPlan:
    """Pair and round a step's events for :func:`fast_replay`: the arguments of
    ``allocator.replay`` (``events`` as two columns, storage ids and signed bytes).

    Examples
    --------
    >>> p = plan([100], [0, 1, 0, 2], [1024, 600, -1024, 2_000_000])
    >>> p.resident_sizes, p.ops  # in 512-byte units: 1024 B is 2, 2,000,000 B rounds to 3,907
    ([1], [2, 2, -1, 3907, -2, -3])
    """
    residents = np.asarray(resident_bytes)
    residents = residents[residents > 0]
    n = np.asarray(nbytes)
    ids = np.asarray(storage)
    alloc = n > 0
    sizes = _rounded(n[alloc])
    requests = _exact(n[alloc])
    ops = _paired(ids, n, sizes) if n.dtype != object else None
    if ops is None:
        ops = _paired_by_dict(ids.tolist(), np.sign(n).tolist(), sizes)
    leaked: list[int] = []
    if len(ops) != 2 * len(sizes):  # each slot is freed at most once
        leaked = sorted(set(range(len(sizes))).difference(~v for v in ops if v < 0))
    resident_sizes = _rounded(residents)
    # every address reachable: at most one segment per request and iteration (a segment
    # released under a cap is not reused: addresses only grow), each at most the request
    # plus 20 MiB (allocation_size), plus a gap unit each
    requests_count = len(resident_sizes) + 2 * len(sizes)
    bound = sum(resident_sizes) + 2 * sum(sizes) + requests_count * (_LARGE_BUFFER + 1)
    return ReplayPlan(
        resident_sizes=resident_sizes,
        resident_requests=_exact(residents),
        ops=ops,
        requests=requests,
        leaked=leaked,
        shift=int(bound).bit_length() + 1,
    )


def fast_replay(
    step: ReplayPlan,
    *,
    iterations: int = 2,
    capacity_bytes: int | None = None,
    expandable_segments: bool = False,
    checkpoint_above: int | None = None,
) -> AllocatorReplay:
    """``allocator.replay`` of a planned step, without recording: the same numbers (and
    the same ``OutOfMemory`` under a cap), from flat ints.

    A replay under a cap starts from the latest state of the free replay it passes
    through that an earlier replay of the same plan kept (``_Checkpoint``): the state
    before the first new segment that took the free replay's reserved bytes past a cap
    (``capacity_bytes``, or ``checkpoint_above`` for a free replay, which changes nothing
    else). Up to there a capped replay is the free one; from there it runs on as a
    replay from the start would, so the numbers are the same, for less work.

    Examples
    --------
    >>> # the example of allocator.replay: 2 MiB small + 20 MiB large segment
    >>> events = [(0, 1024), (1, 1_572_864), (2, 12_058_624), (1, -1_572_864), (3, 943_718)]
    >>> ids, nbytes = zip(*events)
    >>> r = fast_replay(plan([], ids, nbytes), iterations=1)
    >>> r.peak_reserved_bytes >> 20, r.segments, r.peak_allocated_bytes
    (22, 2, 13632512)
    """
    if expandable_segments and capacity_bytes is not None:
        raise ValueError("a capacity is not modelled with expandable_segments")
    _replays[0] += 1
    if expandable_segments:
        return _expandable(step, iterations)
    return _caching(step, iterations, capacity_bytes, checkpoint_above)


@dataclass(eq=False)
class _Checkpoint:
    """The free (uncapped) replay's state just before an allocation that needs a new
    segment: a replay under any cap of at least ``reserved`` passes through it unchanged
    (``reserved`` only grows without a cap, so no earlier segment passed that cap), and so
    may start there instead of from the residents."""

    iterations: int
    run: int  # 0: the residents, then the iterations
    at: int  # the allocation's index among the run's ops
    k: int  # its slot
    reserved: int  # in units; also the reserved peak so far: without a cap it only grows
    top: int
    base: int  # bytes allocated when the run began
    small: list[int] = field(repr=False)
    large: list[int] = field(repr=False)
    free_start: dict[int, int] = field(repr=False)
    free_end: dict[int, int] = field(repr=False)
    segments: dict[int, int] = field(repr=False)
    slot_addr: list[int] = field(repr=False)
    slot_size: list[int] = field(repr=False)


# per plan: a climb of capped replays (device_bytes) leaves a few, the later ones the most
# useful to the next climb; each is a copy of the replay's state (about 0.3 MB for the
# Llama-7B shape's step)
_CHECKPOINTS_KEPT = 4


def _resume_point(step: ReplayPlan, iterations: int, cap: int | None) -> _Checkpoint | None:
    """The latest checkpoint a replay under ``cap`` passes through, if any."""
    if cap is None:
        return None
    best = None
    for c in step.checkpoints.values():
        later = best is None or (c.run, c.at) > (best.run, best.at)
        if c.iterations == iterations and c.reserved * _UNIT <= cap and later:
            best = c
    return best


def _op_slots(step: ReplayPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each op's slot and sign (1: its allocation, -1: its free), and each slot's op index,
    once per plan."""
    if not step.op_slots:
        # every op is below 2**shift in size: int64 where that fits
        o = np.array(step.ops, dtype=np.int64 if step.shift < 62 else object)
        alloc = o > 0
        slot = np.where(alloc, np.cumsum(alloc) - 1, ~o).astype(np.int64)
        step.op_slots.extend((slot, np.where(alloc, 1, -1), np.flatnonzero(alloc)))
    slot, sign, allocation_at = step.op_slots
    return slot, sign, allocation_at


def _allocated(step: ReplayPlan, run: int, at: int, slot_size: list[int], base: int) -> int:
    """Bytes allocated before op ``at`` of ``run``, from the blocks its slots were given."""
    if run == 0:
        return base + sum(slot_size[:at])
    slot, sign, _ = _op_slots(step)
    if step.shift < 62:  # as in _peak_allocated: int64 is exact
        return base + int((np.asarray(slot_size, dtype=np.int64)[slot[:at]] * sign[:at]).sum())
    pairs = zip(slot[:at].tolist(), sign[:at].tolist(), strict=True)
    return base + sum(slot_size[s] * g for s, g in pairs)


def _peak_allocated(step: ReplayPlan, slot_size: list[int], base: int) -> int:
    """The peak of allocated bytes over an iteration that began with ``base`` allocated,
    from the blocks its slots were given (each allocation charges its block, each free
    gives it back)."""
    if not step.ops:
        return base
    slot, sign, _ = _op_slots(step)
    if step.shift < 62:  # every size and sum below 2**62 (plan's bound): int64 is exact
        charges = np.asarray(slot_size, dtype=np.int64)[slot] * sign
        return base + max(0, int(np.cumsum(charges).max()))
    allocated = peak = base
    for s, g in zip(slot.tolist(), sign.tolist(), strict=True):
        allocated += slot_size[s] * g
        peak = max(peak, allocated)
    return peak


def _past_limit(
    step: ReplayPlan,
    where: tuple[int, int, int],
    reserved: int,
    top: int,
    base: int,
    segment: int,
    cap: int | None,
    departed: bool,
    state: tuple[
        list[int], list[int], dict[int, int], dict[int, int], dict[int, int], list[int], list[int]
    ],
) -> int:
    """A new ``segment`` would take reserved bytes past the limit: keep the state as a
    checkpoint where the replay has not yet departed from the free one; under a cap,
    release the cached segments and fail as the reference does. Returns what stays
    reserved."""
    iterations, run, k = where
    small, large, free_start, free_end, segments, slot_addr, slot_size = state
    at = k
    if run:
        at = int(_op_slots(step)[2][k])
    if not departed and (iterations, run, at) not in step.checkpoints:
        step.checkpoints[iterations, run, at] = _Checkpoint(
            iterations, run, at, k, reserved, top, base, small.copy(), large.copy(),
            free_start.copy(), free_end.copy(), segments.copy(), slot_addr.copy(),
            slot_size.copy(),
        )  # fmt: skip
        while len(step.checkpoints) > _CHECKPOINTS_KEPT:
            del step.checkpoints[next(iter(step.checkpoints))]  # the oldest
    if cap is None:
        return reserved
    reserved = _release(small, large, free_start, free_end, segments, reserved, step.shift)
    if reserved + segment > cap:
        requests = step.requests if run else step.resident_requests
        allocated = _allocated(step, run, at, slot_size, base)
        raise OutOfMemory(requests[k], segment * _UNIT, reserved * _UNIT, allocated * _UNIT)
    return reserved


def _caching(
    step: ReplayPlan, iterations: int, cap: int | None, mark: int | None = None
) -> AllocatorReplay:
    """The default allocator (``CachingAllocator``), one loop over plain ints; under a cap,
    from the latest checkpoint it passes through, leaving one where it first departs
    from the free replay (its first failed ``cudaMalloc``); without one, leaving one
    where reserved bytes would first pass ``mark``, where given. Allocated bytes are
    summed after each iteration from the blocks its slots were given (each iteration
    frees all it allocates but what ``step.leaked`` names), not in the loop.

    One function with the loop inline, longer than the others: splitting it would add a
    Python call to each of the step's thousands of events."""
    shift = step.shift
    mask = (1 << shift) - 1
    small_limit = _SMALL_SIZE
    # each pool's sorted keys end with one above every key: a best fit past the blocks
    # cached finds it (no length to check) and it is never taken
    end_key = 1 << (2 * shift + 1)
    c = _resume_point(step, iterations, cap)
    if c is None:
        n_slots = max(len(step.requests), len(step.resident_sizes))
        pools = ([end_key], [end_key])
        c = _Checkpoint(
            iterations, 0, 0, 0, 0, 0, 0, *pools, {}, {}, {}, [0] * n_slots, [0] * n_slots
        )
    # copies: the checkpoint stays as it is for the next replay
    state = (
        c.small.copy(), c.large.copy(), c.free_start.copy(), c.free_end.copy(),
        c.segments.copy(), c.slot_addr.copy(), c.slot_size.copy(),
    )  # fmt: skip
    small, large, free_start, free_end, segments, slot_addr, slot_size = state
    top, reserved, peak_reserved, base = c.top, c.reserved, c.reserved, c.base
    if cap is not None:  # in units: a count of units passes cap bytes where it passes this
        cap //= _UNIT
    if mark is not None:
        mark //= _UNIT
    limit = mark if cap is None else cap  # where a checkpoint is taken
    departed = limit is None  # from the free replay: no more checkpoints to take
    for run in range(c.run, iterations + 1):
        ops = step.ops if run else step.resident_sizes
        k = 0
        if run == c.run and c.at:
            ops, k = ops[c.at :], c.k  # resumed: the peak already reset where due
        elif run == iterations:  # reset_peak_memory_stats() before the last iteration
            peak_reserved = reserved
        for v in ops:
            if v > small_limit:  # a large-pool malloc of a rounded size v
                i = bisect_left(large, v << shift)
                key = large[i]
                if key != end_key:
                    addr = key & mask
                    bsize = key >> shift
                    rest = bsize - v
                    if rest > small_limit:  # should_split, large pool
                        # the rest keeps the block's end (free_end's key) and, being at
                        # least v, its place in the pool: every key before i is below
                        # v << shift, every key after it above the block's
                        raddr = addr + v
                        del free_start[addr]
                        free_start[raddr] = rest
                        free_end[raddr + rest] = raddr
                        if rest >= v:
                            large[i] = rest << shift | raddr
                        else:
                            del large[i]
                            insort(large, rest << shift | raddr, 0, i)
                        bsize = v
                    else:
                        del large[i]
                        del free_start[addr]
                        del free_end[addr + bsize]
                else:  # get_allocation_size (allocator.allocation_size), inline
                    if v < _MIN_LARGE_ALLOC:
                        bsize = _LARGE_BUFFER
                    else:
                        bsize = -(-v // _ROUND_LARGE) * _ROUND_LARGE
                    if limit is not None and reserved + bsize > limit:
                        where = (iterations, run, k)
                        reserved = _past_limit(
                            step, where, reserved, top, base, bsize, cap, departed, state
                        )
                        departed = True
                        limit = cap
                    addr = top
                    top += bsize + 1
                    segments[addr] = bsize
                    reserved += bsize
                    if reserved > peak_reserved:
                        peak_reserved = reserved
                    rest = bsize - v
                    if rest > small_limit:  # should_split, large pool
                        raddr = addr + v
                        insort(large, rest << shift | raddr)
                        free_start[raddr] = rest
                        free_end[raddr + rest] = raddr
                        bsize = v
                slot_addr[k] = addr
                slot_size[k] = bsize
                k += 1
            elif v > 0:  # a small-pool one: blocks of a 2 MiB segment, split to 512 bytes
                i = bisect_left(small, v << shift)
                key = small[i]
                if key != end_key:
                    addr = key & mask
                    rest = (key >> shift) - v
                    if rest:  # should_split: every size is a multiple of 512
                        raddr = addr + v  # as in the large pool
                        del free_start[addr]
                        free_start[raddr] = rest
                        free_end[raddr + rest] = raddr
                        if rest >= v:
                            small[i] = rest << shift | raddr
                        else:
                            del small[i]
                            insort(small, rest << shift | raddr, 0, i)
                    else:
                        del small[i]
                        del free_start[addr]
                        del free_end[addr + v]
                else:
                    bsize = _SMALL_BUFFER
                    if limit is not None and reserved + bsize > limit:
                        where = (iterations, run, k)
                        reserved = _past_limit(
                            step, where, reserved, top, base, bsize, cap, departed, state
                        )
                        departed = True
                        limit = cap
                    addr = top
                    top += bsize + 1
                    segments[addr] = bsize
                    reserved += bsize
                    if reserved > peak_reserved:
                        peak_reserved = reserved
                    raddr = addr + v
                    rest = bsize - v
                    insort(small, rest << shift | raddr)
                    free_start[raddr] = rest
                    free_end[raddr + rest] = raddr
                slot_addr[k] = addr
                slot_size[k] = v
                k += 1
            else:  # free of slot ~v
                v = ~v
                addr = slot_addr[v]
                bsize = slot_size[v]
                pool = small if bsize <= small_limit else large
                end = addr + bsize
                if addr in free_end:  # merge with the free block before it
                    before = free_end.pop(addr)
                    size_before = free_start[before]  # its entry is overwritten below
                    del pool[bisect_left(pool, size_before << shift | before)]
                    addr = before
                    bsize += size_before
                if end in free_start:  # and with the one after it, whose end stays
                    after = free_start.pop(end)
                    i = bisect_left(pool, after << shift | end)
                    bsize += after
                    end += after
                    key = bsize << shift | addr
                    # the merged block, larger, takes the place of the one after where
                    # no key lies between them (the end key follows every block)
                    if pool[i + 1] > key:
                        pool[i] = key
                    else:
                        del pool[i]
                        insort(pool, key, i)
                else:
                    insort(pool, bsize << shift | addr)
                free_start[addr] = bsize
                free_end[end] = addr
        if run == 0:  # the residents, in use to the end
            base = sum(slot_size[: len(step.resident_sizes)])
        elif run < iterations:  # what the iteration left in use
            base += sum(slot_size[s] for s in step.leaked)
    peak_allocated = _peak_allocated(step, slot_size, base) if iterations else base
    return AllocatorReplay(
        peak_reserved_bytes=peak_reserved * _UNIT,
        peak_allocated_bytes=peak_allocated * _UNIT,
        reserved_at_end_bytes=reserved * _UNIT,
        segments=len(segments),
    )


def _release(
    small: list[int],
    large: list[int],
    free_start: dict[int, int],
    free_end: dict[int, int],
    segments: dict[int, int],
    reserved: int,
    shift: int,
) -> int:
    """``release_cached_blocks``: every free block that is a whole segment goes back;
    returns what stays reserved."""
    for base, size in list(segments.items()):
        if free_start.get(base) == size:
            del free_start[base]
            del free_end[base + size]
            # a small-pool segment is 2 MiB; a large-pool one 20 MiB or at least 10 MiB
            pool = small if size == _SMALL_BUFFER else large
            del pool[bisect_left(pool, size << shift | base)]
            del segments[base]
            reserved -= size
    return reserved


def _expandable(step: ReplayPlan, iterations: int) -> AllocatorReplay:
    """``ExpandableAllocator``: one segment per pool growing at its end, no capacity.

    Every block handed out is its rounded request (both pools split at 512 bytes), and
    no page is unmapped: allocated bytes follow from the ops alone (summed afterwards, as
    in :func:`_caching`), and reserved bytes only grow, so their peak over the last
    iteration is what is reserved at its end."""
    # the large pool's segment above every address the small pool's can reach
    large_base = 1 << step.shift
    shift = step.shift + 2
    mask = (1 << shift) - 1
    small_limit = _SMALL_SIZE
    pools: tuple[list[int], list[int]] = ([], [])
    bases = (0, large_base)
    pages = (_SMALL_BUFFER, _LARGE_BUFFER)
    mapped = [0, large_base]  # each pool's mapped end
    free_start: dict[int, int] = {}
    free_end: dict[int, int] = {}
    n_slots = max(len(step.requests), len(step.resident_sizes))
    slot_addr = [0] * n_slots
    slot_size = [0] * n_slots
    base = 0  # allocated when the last iteration begins
    for run in range(iterations + 1):
        ops = step.ops if run else step.resident_sizes
        k = 0
        for v in ops:
            if v > 0:
                p = 0 if v <= small_limit else 1
                pool = pools[p]
                tail = mapped[p]
                i = bisect_left(pool, v << shift)
                n = len(pool)
                if i < n:
                    key = pool[i]
                    addr = key & mask
                    bsize = key >> shift
                    at = i  # where a rest of at least v keeps the block's place
                    if addr + bsize == tail and i + 1 < n:  # the growing end: the next one
                        at = -1
                        i += 1
                        key = pool[i]
                        addr = key & mask
                        bsize = key >> shift
                    rest = bsize - v
                    if rest:  # should_split at 512 bytes in both pools: one unit
                        # the rest keeps the block's end (free_end's key), and its
                        # place in the pool where at least v (as in _caching)
                        raddr = addr + v
                        del free_start[addr]
                        free_start[raddr] = rest
                        free_end[raddr + rest] = raddr
                        if rest >= v and at >= 0:
                            pool[i] = rest << shift | raddr
                        else:
                            del pool[i]
                            insort(pool, rest << shift | raddr)
                    else:
                        del pool[i]
                        del free_start[addr]
                        del free_end[addr + bsize]
                else:  # try_allocate_expandable_block: grow at the end
                    if tail in free_end:  # the free block at the end grows
                        addr = free_end.pop(tail)
                        bsize = free_start.pop(addr)
                        del pool[bisect_left(pool, bsize << shift | addr)]
                    else:
                        addr, bsize = tail, 0
                    page = pages[p]
                    grow = page * ((v - bsize + page - 1) // page)
                    bsize += grow
                    mapped[p] = tail + grow
                    rest = bsize - v
                    if rest:
                        raddr = addr + v
                        insort(pool, rest << shift | raddr)
                        free_start[raddr] = rest
                        free_end[raddr + rest] = raddr
                slot_addr[k] = addr
                slot_size[k] = v
                k += 1
            else:
                v = ~v
                addr = slot_addr[v]
                bsize = slot_size[v]
                pool = pools[0] if bsize <= small_limit else pools[1]
                end = addr + bsize
                if addr in free_end:  # merge with the free block before it
                    before = free_end.pop(addr)
                    size_before = free_start[before]  # its entry is overwritten below
                    del pool[bisect_left(pool, size_before << shift | before)]
                    addr = before
                    bsize += size_before
                if end in free_start:  # and with the one after it, whose end stays
                    after = free_start.pop(end)
                    del pool[bisect_left(pool, after << shift | end)]
                    bsize += after
                    end += after
                insort(pool, bsize << shift | addr)
                free_start[addr] = bsize
                free_end[end] = addr
        if run == 0:  # the residents, in use to the end
            base = sum(slot_size[: len(step.resident_sizes)])
        elif run < iterations:  # what the iteration left in use
            base += sum(slot_size[s] for s in step.leaked)
    peak_allocated = _peak_allocated(step, slot_size, base) if iterations else base
    reserved = mapped[0] + mapped[1] - large_base
    return AllocatorReplay(
        peak_reserved_bytes=reserved * _UNIT,
        peak_allocated_bytes=peak_allocated * _UNIT,
        reserved_at_end_bytes=reserved * _UNIT,
        segments=sum(1 for p in (0, 1) if mapped[p] > bases[p]),
    )


# -- one replay per setting ---------------------------------------------------------------

_PLANS_KEPT = 32  # steps whose plan is kept (a widget session visits a few dozen settings)
_PLANS_CHECKPOINTED = 4  # the most recently used plans keep their checkpoints
_OUTCOMES_KEPT = 512  # replays kept: each step's plain, expandable and capped ones
_plans: OrderedDict[bytes, ReplayPlan] = OrderedDict()
# an outcome: the replay, or an out-of-memory error's fields (request, segment, reserved,
# allocated), kept without the error's traceback (which would hold the replay's state)
_outcomes: OrderedDict[
    tuple[bytes, int | None, bool], AllocatorReplay | tuple[int, int, int, int]
] = OrderedDict()


def forget_replays() -> None:
    """Forget every remembered plan and replay (benchmarks time cold replays with it)."""
    _plans.clear()
    _outcomes.clear()


def _ints(a: np.ndarray) -> np.ndarray:
    """An integer array as int64 where every value fits (object arrays of Python ints)."""
    if a.dtype == object:
        try:
            return np.asarray(a.tolist(), dtype=np.int64)
        except OverflowError:
            return a
    return a


@dataclass(frozen=True, eq=False)
class ReplayStream:
    """A step's allocation stream as ``allocator.replay`` takes it: the resident requests
    (in order) and the events (storage ids, signed bytes), with a digest of their contents
    that names the step in the replays remembered (:func:`cached_replay`).

    Examples
    --------
    >>> a = ReplayStream.of([1024], [0, 0], [4096, -4096])
    >>> a.digest == ReplayStream.of([1024], [0, 0], [4096, -4096]).digest
    True
    >>> a.digest == ReplayStream.of([1024], [0, 0], [8192, -8192]).digest
    False
    """

    resident_bytes: np.ndarray
    storage: np.ndarray
    nbytes: np.ndarray
    digest: bytes

    @classmethod
    def of(
        cls,
        resident_bytes: Sequence[int] | np.ndarray,
        storage: Sequence[int] | np.ndarray,
        nbytes: Sequence[int] | np.ndarray,
    ) -> ReplayStream:
        arrays = [_ints(np.asarray(a)) for a in (resident_bytes, storage, nbytes)]
        h = hashlib.blake2b(digest_size=16)
        for a in arrays:
            if a.dtype == object:  # past int64: Python ints by their decimal text
                h.update(b"o" + ",".join(map(str, a.tolist())).encode())
            else:
                h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
            h.update(len(a).to_bytes(8, "little"))
        residents, ids, nbytes = arrays
        return cls(residents, ids, nbytes, h.digest())


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any, kept: int) -> None:
    cache[key] = value
    while len(cache) > kept:
        cache.popitem(last=False)  # the least recently used


def cached_replay(
    stream: ReplayStream,
    *,
    capacity_bytes: int | None = None,
    expandable_segments: bool = False,
    checkpoint_above: int | None = None,
) -> AllocatorReplay:
    """:func:`fast_replay` of a step (two iterations), remembered per step and setting: a
    stream of the same contents (its digest), capacity and ``expandable_segments`` gives
    the remembered outcome (an ``OutOfMemory`` raised again) without a replay.
    ``checkpoint_above`` (a free replay's, see :func:`fast_replay`) changes no outcome,
    only where later capped replays of the step may start.

    Examples
    --------
    >>> before = replays_run()
    >>> a = cached_replay(ReplayStream.of([1024], [0, 0], [4096, -4096]))
    >>> b = cached_replay(ReplayStream.of([1024], [0, 0], [4096, -4096]))
    >>> a is b, replays_run() - before
    (True, 1)
    """
    key = (stream.digest, capacity_bytes, expandable_segments)
    outcome = _outcomes.get(key)
    if outcome is None:
        step = _plans.get(stream.digest)
        if step is None:
            step = plan(stream.resident_bytes, stream.storage, stream.nbytes)
            _remember(_plans, stream.digest, step, _PLANS_KEPT)
        else:
            _plans.move_to_end(stream.digest)
        for older in list(_plans.values())[:-_PLANS_CHECKPOINTED]:
            older.checkpoints.clear()
        try:
            outcome = fast_replay(
                step,
                capacity_bytes=capacity_bytes,
                expandable_segments=expandable_segments,
                checkpoint_above=checkpoint_above,
            )
        except OutOfMemory as short:
            outcome = (short.request, short.segment, short.reserved, short.allocated)
        _remember(_outcomes, key, outcome, _OUTCOMES_KEPT)
    else:
        _outcomes.move_to_end(key)
    if isinstance(outcome, tuple):
        raise OutOfMemory(*outcome)
    return outcome
