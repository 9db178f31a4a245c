"""The CUDA caching allocator, replayed: what ``max_memory_reserved`` would be for a step.

No torch here: plain Python over an allocation and free sequence. The rules are those of
PyTorch's ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``; read at commit
001074d2, the one docs/cuda-semantics.md section 6.1 cites), with the default configuration
(no ``max_split_size_mb``, no ``roundup_power2_divisions``, no memory fraction, one stream):

* ``round_size``: a request is rounded up to a multiple of 512 bytes (``kMinBlockSize``), at
  least 512.
* ``get_pool``: a rounded size of at most 1 MiB (``kSmallSize``) goes to the small pool,
  larger ones to the large pool; freed blocks are reused within their pool only.
* ``get_free_block``: the smallest cached free block of at least the size, the lowest
  address among equal sizes (``BlockComparatorSize`` orders by stream, size, address).
* ``get_allocation_size``: a new segment (``cudaMalloc``) is 2 MiB (``kSmallBuffer``) for the
  small pool, 20 MiB (``kLargeBuffer``) for sizes under 10 MiB (``kMinLargeAlloc``), and the
  size rounded up to 2 MiB (``kRoundLarge``) above.
* ``should_split``: a block found is split when the remainder is at least 512 bytes (small
  pool) or more than 1 MiB (large pool); an unsplit block is charged in full to
  ``memory_allocated``.
* ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours in
  the same segment.
* ``malloc``: where ``cudaMalloc`` fails (a capacity is given and the new segment would pass
  it), every cached segment with no block in use is released (``release_cached_blocks``)
  and the segment is tried once more; failing that, the allocation is out of memory.

With ``expandable_segments:True`` (:class:`ExpandableAllocator`), each pool is one segment
that grows by mapping pages, 2 MiB for the small pool and 20 MiB for the large one (Note
[Expandable Segments]; ``find_expandable_block``, ``map_block``,
``try_allocate_expandable_block``): a request nothing cached fits extends the segment at its
end, taking the free block there if there is one; any remainder of 512 bytes or more is split
off (``should_split``); best fit prefers a block that is not at the growing end
(``get_free_block``'s ``expandable_size``). Pages are not unmapped here (that happens on
out-of-memory or ``empty_cache``), so no capacity is modelled with it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "AlignedAllocation",
    "AllocatorReplay",
    "CachingAllocator",
    "ExpandableAllocator",
    "OutOfMemory",
    "align_allocations",
    "allocation_size",
    "replay",
    "round_size",
]

# c10/cuda/CUDACachingAllocator.cpp, the constants at the top of the file
K_MIN_BLOCK_SIZE = 512  # "all sizes are rounded to at least 512 bytes"
K_SMALL_SIZE = 1_048_576  # "largest 'small' allocation is 1 MiB"
K_SMALL_BUFFER = 2_097_152  # "'small' allocations are packed in 2 MiB blocks"
K_LARGE_BUFFER = 20_971_520  # "'large' allocations may be packed in 20 MiB blocks"
K_MIN_LARGE_ALLOC = 10_485_760  # "allocations between 1 and 10 MiB may use kLargeBuffer"
K_ROUND_LARGE = 2_097_152  # "round up large allocations to 2 MiB"


def round_size(nbytes: int) -> int:
    """``round_size``: at least 512 bytes, else up to a multiple of 512.

    Examples
    --------
    >>> round_size(1), round_size(512), round_size(513)
    (512, 512, 1024)
    """
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc`` gets for a rounded ``size``.

    Examples
    --------
    >>> [allocation_size(s) >> 20 for s in (1024, 1_572_864, 11_534_336)]  # MiB
    [2, 20, 12]
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class OutOfMemory(Exception):
    """``cudaMalloc`` of a new segment failed even after the cached segments were released."""

    def __init__(self, request: int, segment: int, reserved: int, allocated: int) -> None:
        super().__init__(
            f"out of memory: a {request:,}-byte request needs a {segment:,}-byte segment with "
            f"{reserved:,} bytes reserved ({allocated:,} in use)"
        )
        self.request = request
        self.segment = segment
        self.reserved = reserved
        self.allocated = allocated


@dataclass(slots=True, eq=False)
class _Block:
    address: int
    size: int
    small: bool
    segment: int  # the segment's base address
    allocated: bool = False
    requested: int = 0  # the unrounded request (``requested_size``)
    frames: list[dict[str, Any]] = field(default_factory=list, repr=False)
    prev: _Block | None = field(default=None, repr=False)
    next: _Block | None = field(default=None, repr=False)


class CachingAllocator:
    """One device's caching allocator, one stream, default configuration (module docstring).

    ``malloc(nbytes)`` returns a block handle, ``free(handle)`` gives it back; the counters
    are those of ``torch.cuda.memory_stats()``: ``allocated`` (``allocated_bytes``, whole
    blocks), ``reserved`` (``reserved_bytes``, whole segments) and their peaks.

    ``capacity_bytes``: where given, a new segment that would take ``reserved`` past it fails
    as ``cudaMalloc`` would, and the allocator releases its unused cached segments and
    tries again before raising :class:`OutOfMemory`.

    Examples
    --------
    >>> a = CachingAllocator()
    >>> x = a.malloc(1024)                 # small pool: a new 2 MiB segment
    >>> a.allocated, a.reserved
    (1024, 2097152)
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.segments: dict[int, int] = {}  # base address -> size
        self.segment_allocs = 0
        self.segment_frees = 0
        self._next_address = 0
        # free cached blocks per pool, sorted by (size, address): best fit by bisection
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        # the same free blocks by address, per pool
        self._free_at: dict[bool, dict[int, _Block]] = {True: {}, False: {}}
        self._active: dict[int, _Block] = {}  # id -> block in use
        # torch.cuda.memory._record_memory_history's trace, where recording (else None),
        # and the frames the next request is made from
        self.trace: list[dict[str, Any]] | None = None
        self.frames: list[dict[str, Any]] = []

    # -- counters -------------------------------------------------------------------------
    def reset_peaks(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    # -- the pools ------------------------------------------------------------------------
    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.address))
        self._free_at[block.small][block.address] = block

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address))]
        del self._free_at[block.small][block.address]

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        _size, address = pool.pop(i)
        return self._free_at[small].pop(address)

    # -- segments -------------------------------------------------------------------------
    def _cuda_malloc(self, nbytes: int, small: bool) -> _Block | None:
        if self.capacity_bytes is not None and self.reserved + nbytes > self.capacity_bytes:
            return None
        address = self._next_address
        self._next_address += nbytes
        self.segments[address] = nbytes
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segment_allocs += 1
        self._record("segment_alloc", address, nbytes)
        return _Block(address, nbytes, small, address)

    def _record(self, action: str, address: int, nbytes: int) -> None:
        if self.trace is not None:
            entry = {"action": action, "addr": address, "size": nbytes, "stream": 0}
            self.trace.append({**entry, "frames": self.frames})

    def _release_cached_blocks(self) -> bool:
        """``release_cached_blocks``: return every free block that is a whole segment."""
        released = False
        for small in (False, True):
            for _size, address in list(self._free[small]):
                block = self._free_at[small][address]
                if block.prev is None and block.next is None:
                    self._remove_free(block)
                    del self.segments[block.segment]
                    self.reserved -= block.size
                    self.segment_frees += 1
                    self._record("segment_free", block.segment, block.size)
                    released = True
        return released

    # -- malloc / free --------------------------------------------------------------------
    def malloc(self, nbytes: int) -> _Block:
        """``DeviceCachingAllocator::malloc`` for a request of ``nbytes``."""
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        block = self._best_fit(size, small)
        if block is None:
            segment = allocation_size(size)
            block = self._cuda_malloc(segment, small)
            if block is None and self._release_cached_blocks():
                block = self._cuda_malloc(segment, small)
            if block is None:
                raise OutOfMemory(nbytes, segment, self.reserved, self.allocated)
        remaining = block.size - size
        # should_split: 512 bytes in the small pool, more than 1 MiB in the large one
        self._hand_out(
            block, size, remaining >= K_MIN_BLOCK_SIZE if small else remaining > K_SMALL_SIZE
        )
        self._handed_out(block, nbytes)
        return block

    def _handed_out(self, block: _Block, nbytes: int) -> None:
        block.requested = nbytes
        block.frames = self.frames
        self._active[id(block)] = block
        self._record("alloc", block.address, nbytes)

    def _hand_out(self, block: _Block, size: int, split: bool) -> _Block | None:
        """``alloc_found_block``: the front ``size`` bytes are handed out and, where
        ``split``, the rest stays cached as a block of its own (returned); an unsplit block
        is charged in full."""
        rest = None
        if split:
            rest = _Block(block.address + size, block.size - size, block.small, block.segment)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert_free(rest)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return rest

    def free(self, block: _Block) -> None:
        """``free`` / ``free_block``: back to its pool, merged with free neighbours."""
        self._record("free_requested", block.address, block.requested)
        self._record("free_completed", block.address, block.requested)
        del self._active[id(block)]
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated:
                continue
            self._remove_free(neighbour)  # try_merge_blocks
            if neighbour is block.prev:
                block.address = neighbour.address
                block.prev = neighbour.prev
                if block.prev is not None:
                    block.prev.next = block
            else:
                block.next = neighbour.next
                if block.next is not None:
                    block.next.prev = block
            block.size += neighbour.size
        self._insert_free(block)

    def snapshot(self) -> dict[str, Any]:
        """The allocator's state and trace in the format of ``torch.cuda.memory._snapshot()``
        (``segments`` with their ``blocks``, ``device_traces`` of one device), which
        PyTorch's memory viewer (``torch.cuda._memory_viz``, pytorch.org/memory_viz) reads."""
        blocks = [*self._active.values()]
        for pool in self._free_at.values():
            blocks.extend(pool.values())
        by_segment: dict[int, list[_Block]] = {}
        for block in blocks:
            by_segment.setdefault(block.segment, []).append(block)
        segments = []
        for base, size in sorted(self.segments.items()):
            held = sorted(by_segment.get(base, []), key=lambda b: b.address)
            active = [b for b in held if b.allocated]
            segments.append(
                {
                    "device": 0,
                    "address": base,
                    "total_size": size,
                    "stream": 0,
                    "segment_type": "small" if held and held[0].small else "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": isinstance(self, ExpandableAllocator),
                    "allocated_size": sum(b.size for b in active),
                    "active_size": sum(b.size for b in active),
                    "requested_size": sum(b.requested for b in active),
                    "frames": [],
                    "blocks": [
                        {
                            "address": b.address,
                            "size": b.size,
                            "requested_size": b.requested if b.allocated else 0,
                            "state": "active_allocated" if b.allocated else "inactive",
                            "frames": b.frames if b.allocated else [],
                        }
                        for b in held
                    ],
                }
            )
        return {"segments": segments, "device_traces": [list(self.trace or [])]}

    def cached_free_bytes(self) -> int:
        """Reserved but not in use: free blocks held in the pools."""
        return self.reserved - self.allocated


class ExpandableAllocator(CachingAllocator):
    """``expandable_segments:True``: one growing segment per pool (module docstring).

    Examples
    --------
    >>> a = ExpandableAllocator()
    >>> _ = a.malloc(11 * 2**20 + 2**19)   # 11.5 MiB: one 20 MiB page mapped
    >>> a.reserved >> 20, a.allocated >> 19  # split off the 8.5 MiB left: 11.5 MiB charged
    (20, 23)
    """

    # Note [Expandable Segments]: "we use 2MiB pages for our small pool and 20MiB pages for
    # our large pool" (find_expandable_block: kSmallBuffer / kLargeBuffer)
    PAGE_BYTES: ClassVar[Mapping[bool, int]] = {True: K_SMALL_BUFFER, False: K_LARGE_BUFFER}
    # the two pools' segments at distinct addresses
    BASE_ADDRESS: ClassVar[Mapping[bool, int]] = {True: 0, False: 1 << 50}

    def __init__(self) -> None:
        super().__init__(None)
        self._last: dict[bool, _Block | None] = {True: None, False: None}
        self._mapped_end = dict(self.BASE_ADDRESS)

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        last = self._last[small]
        tail: _Block | None = None
        for i in range(bisect.bisect_left(pool, (size, -1)), len(pool)):
            block = self._free_at[small][pool[i][1]]
            if block is last:  # its expandable size is the largest: taken only if alone
                tail = block
                continue
            self._remove_free(block)
            return block
        if tail is not None:
            self._remove_free(tail)
        return tail

    def _map(self, nbytes: int, small: bool) -> int:
        page = self.PAGE_BYTES[small]
        grow = page * ((nbytes + page - 1) // page)
        self._record("segment_map", self._mapped_end[small], grow)
        self._mapped_end[small] += grow
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segments[self.BASE_ADDRESS[small]] = (
            self._mapped_end[small] - (self.BASE_ADDRESS[small])
        )
        self.segment_allocs += 1
        return grow

    def malloc(self, nbytes: int) -> _Block:
        """``malloc`` with ``expandable_segments:True``."""
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        block = self._best_fit(size, small)
        if block is None:  # try_allocate_expandable_block: grow at the end
            last = self._last[small]
            if last is not None and not last.allocated:
                self._remove_free(last)
                last.size += self._map(size - last.size, small)
                block = last
            else:
                address = self._mapped_end[small]
                grow = self._map(size, small)
                block = _Block(address, grow, small, self.BASE_ADDRESS[small], prev=last)
                if last is not None:
                    last.next = block
                self._last[small] = block
        # should_split with expandable segments: 512 bytes in both pools
        rest = self._hand_out(block, size, block.size - size >= K_MIN_BLOCK_SIZE)
        if rest is not None and self._last[small] is block:
            self._last[small] = rest
        self._handed_out(block, nbytes)
        return block

    def free(self, block: _Block) -> None:
        last = self._last[block.small]
        absorbs_last = block.next is last and last is not None and not last.allocated
        super().free(block)
        if absorbs_last or block.next is None:
            self._last[block.small] = block


@dataclass(frozen=True)
class AllocatorReplay:
    """What the caching allocator holds over a replayed step.

    Attributes
    ----------
    peak_reserved_bytes : int
        ``max_memory_reserved()`` over the measured (last) iteration.
    peak_allocated_bytes : int
        ``max_memory_allocated()`` over it: whole blocks (512-byte rounding, unsplit large
        blocks charged in full).
    reserved_at_end_bytes : int
        ``memory_reserved()`` after it.
    segments : int
        Segments held at the end.
    """

    peak_reserved_bytes: int
    peak_allocated_bytes: int
    reserved_at_end_bytes: int
    segments: int
    # with record=True: the step in torch.cuda.memory._snapshot() format
    snapshot: dict[str, Any] | None = field(default=None, repr=False, compare=False)


def replay(
    resident_bytes: Iterable[int],
    events: Iterable[tuple[int, int]],
    *,
    iterations: int = 2,
    capacity_bytes: int | None = None,
    expandable_segments: bool = False,
    frames: Sequence[list[dict[str, Any]]] | None = None,
    record: bool = False,
) -> AllocatorReplay:
    """Replay a step through :class:`CachingAllocator`: the resident tensors allocated first
    (parameters, buffers, optimizer state, inputs, in that order), then ``iterations`` runs
    of ``events``, each ``(storage, nbytes)`` with ``nbytes > 0`` an allocation and ``< 0``
    the free of that storage; the peaks are those of the last iteration, after
    ``reset_peak_memory_stats()``, as ``measure`` reads them (the first iteration leaves
    the cache the second one finds). ``expandable_segments`` replays
    :class:`ExpandableAllocator` (no capacity with it). ``record=True`` keeps the trace and
    the final state as a ``torch.cuda.memory._snapshot()`` (``snapshot``), each request
    with ``frames[i]`` where given (the residents with a frame named "resident").

    This is the reference, one object per block; ``replaying.fast_replay`` gives the same
    numbers from flat ints (and ``MemoryEstimate`` replays through it, once per setting).

    Examples
    --------
    >>> # 1 KiB, then 1.5 MiB, then 11.5 MiB; free the 1.5 MiB; then 0.9 MiB. The 1 KiB
    >>> # opens a 2 MiB small segment; 1.5 MiB a 20 MiB large one, split (18.5 MiB left
    >>> # > 1 MiB); 11.5 MiB fits the 18.5 MiB remainder (best fit), split again; 0.9 MiB
    >>> # is small (944,128 B rounded) and fits the 2 MiB segment's remainder.
    >>> events = [(0, 1024), (1, 1_572_864), (2, 12_058_624), (1, -1_572_864), (3, 943_718)]
    >>> r = replay([], events, iterations=1)
    >>> r.peak_reserved_bytes >> 20, r.segments   # 2 + 20 MiB
    (22, 2)
    >>> r.peak_allocated_bytes  # 1,024 + 1,572,864 + 12,058,624, before the free
    13632512
    """
    sizes = [int(n) for n in resident_bytes]
    steps = [(int(s), int(n)) for s, n in events]
    if expandable_segments and capacity_bytes is not None:
        raise ValueError("a capacity is not modelled with expandable_segments")
    allocator = ExpandableAllocator() if expandable_segments else CachingAllocator(capacity_bytes)
    if record:
        allocator.trace = []
        allocator.frames = [{"filename": "resident", "line": 0, "name": "resident"}]
    for nbytes in sizes:
        if nbytes > 0:
            allocator.malloc(nbytes)
    for iteration in range(iterations):
        if iteration == iterations - 1:
            allocator.reset_peaks()
        live: dict[int, _Block] = {}
        for i, (storage, nbytes) in enumerate(steps):
            if record and frames is not None:
                allocator.frames = frames[i]
            if nbytes > 0:
                live[storage] = allocator.malloc(nbytes)
            elif nbytes < 0:
                block = live.pop(storage, None)
                if block is not None:
                    allocator.free(block)
        for block in live.values():  # what outlives the step (none in a steady state)
            allocator.free(block)
    return AllocatorReplay(
        peak_reserved_bytes=allocator.peak_reserved,
        peak_allocated_bytes=allocator.peak_allocated,
        reserved_at_end_bytes=allocator.reserved,
        segments=len(allocator.segments),
        snapshot=allocator.snapshot() if record else None,
    )


@dataclass(frozen=True)
class AlignedAllocation:
    """One allocation of a predicted step beside the real one made in its place."""

    module: str
    phase: str
    predicted_bytes: int
    measured_bytes: int


def align_allocations(
    predicted: Mapping[str, Any], measured: Mapping[str, Any]
) -> tuple[list[AlignedAllocation], str]:
    """The allocations of one measured step's trace (``torch.cuda.memory._snapshot()``
    recorded around that step, as ``measure(..., snapshot=True)`` does) beside those of the
    predicted step's last iteration (:meth:`MemoryEstimate.memory_snapshot`), in order: the
    same step makes the same allocations in the same order, so the i-th of each are the same
    tensor, and the predicted one's frame names its module and phase. Returns the pairs and
    a note ("" where the counts agree; else how they differ: the pairs then cover the
    common prefix only).

    Examples
    --------
    >>> def alloc(size, module="fc", phase="forward"):
    ...     return {"action": "alloc", "size": size,
    ...             "frames": [{"filename": module, "line": 0, "name": phase}]}
    >>> resident = alloc(64, "resident", "resident")
    >>> step = [alloc(512), alloc(1024)]
    >>> predicted = {"device_traces": [[resident, *step, *step]]}  # residents, two iterations
    >>> measured = {"device_traces": [[alloc(512), alloc(1536)]]}
    >>> pairs, note = align_allocations(predicted, measured)
    >>> [(p.predicted_bytes, p.measured_bytes) for p in pairs], note
    ([(512, 512), (1024, 1536)], '')
    """

    def allocs(snapshot: Mapping[str, Any]) -> list[dict[str, Any]]:
        traces = snapshot.get("device_traces") or [[]]
        return [e for trace in traces for e in trace if e.get("action") == "alloc"]

    ours = allocs(predicted)
    step = [e for e in ours if not (e["frames"] and e["frames"][0]["name"] == "resident")]
    last = step[len(step) // 2 :] if len(step) % 2 == 0 else step  # the second iteration
    theirs = allocs(measured)
    note = ""
    if len(theirs) != len(last):
        note = (
            f"the measured trace has {len(theirs):,} allocations, the predicted step "
            f"{len(last):,}: the first {min(len(theirs), len(last)):,} are compared"
        )
    pairs = []
    for mine, real in zip(last, theirs, strict=False):
        frame = mine["frames"][0] if mine["frames"] else {"filename": "?", "name": "?"}
        pairs.append(
            AlignedAllocation(
                frame["filename"], frame["name"], int(mine["size"]), int(real["size"])
            )
        )
    return pairs, note
