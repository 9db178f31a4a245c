"""The caching-allocator replay: one hand-worked sequence per rule of
c10/cuda/CUDACachingAllocator.cpp (the module docstring lists them), the arithmetic in the
comments. No torch, no GPU."""

from __future__ import annotations

import pytest

from vram_widget._estimating.allocator import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    CachingAllocator,
    ExpandableAllocator,
    OutOfMemory,
    allocation_size,
    replay,
    round_size,
)

MIB = 1 << 20


def test_round_size_is_512_bytes_at_least() -> None:
    # round_size: below 512 -> 512; else up to a multiple of 512
    assert [round_size(n) for n in (0, 1, 511, 512, 513, 1_000_000)] == [
        512,
        512,
        512,
        512,
        1024,
        1_000_448,  # 1,000,000 / 512 = 1953.1 -> 1954 x 512
    ]


def test_segment_sizes() -> None:
    # get_allocation_size: <= 1 MiB -> 2 MiB; < 10 MiB -> 20 MiB; else up to 2 MiB
    assert allocation_size(1 * MIB) == K_SMALL_BUFFER
    assert allocation_size(1 * MIB + 512) == K_LARGE_BUFFER
    assert allocation_size(10 * MIB - 512) == K_LARGE_BUFFER
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(10 * MIB + 512) == 12 * MIB


def test_small_requests_share_a_2_mib_segment() -> None:
    # 1 B and 1,000 B: 512 + 1,024 B allocated, one 2 MiB segment split twice
    a = CachingAllocator()
    a.malloc(1)
    a.malloc(1000)
    assert (a.allocated, a.reserved, len(a.segments)) == (1536, 2 * MIB, 1)


def test_large_block_is_split_only_past_1_mib() -> None:
    # 11.5 MiB: a 12 MiB segment, 0.5 MiB left (not > 1 MiB): not split, charged 12 MiB.
    a = CachingAllocator()
    a.malloc(11 * MIB + MIB // 2)
    assert (a.allocated, a.reserved) == (12 * MIB, 12 * MIB)
    # 10.5 MiB: a 12 MiB segment, 1.5 MiB left (> 1 MiB): split, charged 10.5 MiB.
    b = CachingAllocator()
    b.malloc(10 * MIB + MIB // 2)
    assert (b.allocated, b.reserved) == (10 * MIB + MIB // 2, 12 * MIB)
    # 1.5 MiB: a 20 MiB segment, split (18.5 MiB left)
    c = CachingAllocator()
    c.malloc(MIB + MIB // 2)
    assert (c.allocated, c.reserved) == (MIB + MIB // 2, 20 * MIB)


def test_best_fit_takes_the_smallest_cached_block() -> None:
    # Two segments of 12 and 14 MiB, both freed (whole, cached). 11 MiB takes the 12 MiB
    # block (12 - 11 = 1 MiB left, not > 1 MiB: unsplit, charged 12 MiB); no new segment.
    a = CachingAllocator()
    x = a.malloc(12 * MIB)
    y = a.malloc(14 * MIB)
    a.free(x)
    a.free(y)
    z = a.malloc(11 * MIB)
    assert z.size == 12 * MIB and a.reserved == 26 * MIB and a.allocated == 12 * MIB


def test_freed_neighbours_coalesce() -> None:
    # Three 3 MiB blocks cut from one 20 MiB segment (11 MiB left at the end). Freeing the
    # first two merges them into one 6 MiB block: a 6 MiB request reuses it, and no second
    # segment is made; without the merge it would need 6 MiB of one piece.
    a = CachingAllocator()
    blocks = [a.malloc(3 * MIB) for _ in range(3)]
    a.free(blocks[0])
    a.free(blocks[1])
    reused = a.malloc(6 * MIB)
    assert reused.address == blocks[0].address
    assert (a.reserved, len(a.segments), a.allocated) == (20 * MIB, 1, 9 * MIB)


def test_cached_segments_are_released_before_out_of_memory() -> None:
    # Capacity 24 MiB. 12 MiB in use then freed stays cached (reserved 12 MiB). A 16 MiB
    # request needs a 16 MiB segment: 12 + 16 = 28 > 24, so the cached 12 MiB segment is
    # released (release_cached_blocks) and the malloc retried: reserved 16 MiB.
    a = CachingAllocator(capacity_bytes=24 * MIB)
    a.free(a.malloc(12 * MIB))
    assert a.reserved == 12 * MIB
    a.malloc(16 * MIB)
    assert (a.reserved, a.segment_frees, a.peak_reserved) == (16 * MIB, 1, 16 * MIB)
    # with 16 MiB in use, another 16 MiB cannot fit: out of memory
    with pytest.raises(OutOfMemory, match="16,777,216-byte segment"):
        a.malloc(16 * MIB)


def test_a_split_segment_with_a_block_in_use_is_not_released() -> None:
    # 3 MiB in use in a 20 MiB segment (17 MiB cached beside it); capacity 30 MiB. A 12 MiB
    # request fits the 17 MiB remainder: no new segment. Then 14 MiB: nothing cached fits
    # (5 MiB left), the 14 MiB segment would make 34 MiB > 30, and the 20 MiB segment
    # cannot be released (a block is in use): out of memory.
    a = CachingAllocator(capacity_bytes=30 * MIB)
    a.malloc(3 * MIB)
    a.malloc(12 * MIB)
    assert a.reserved == 20 * MIB
    with pytest.raises(OutOfMemory):
        a.malloc(14 * MIB)


def test_replay_measures_the_steady_state_iteration() -> None:
    # Residents: a 4 MiB weight (a 20 MiB segment, split). The step: 6 MiB, 6 MiB, then both
    # freed. Iteration 1 cuts both from the weight's segment remainder (16 MiB: 6 + 6 fit,
    # 4 MiB left); iteration 2 finds the same blocks cached: reserved stays 20 MiB, and the
    # peak allocated is 4 + 6 + 6 = 16 MiB.
    events = [(0, 6 * MIB), (1, 6 * MIB), (0, -6 * MIB), (1, -6 * MIB)]
    r = replay([4 * MIB], events)
    assert (r.peak_reserved_bytes, r.peak_allocated_bytes) == (20 * MIB, 16 * MIB)
    assert r.segments == 1


def test_fragmentation_needs_a_new_segment() -> None:
    # Three 8 MiB requests: the first opens a 20 MiB segment (12 MiB left, split), the
    # second takes that remainder (4 MiB left, split), the third finds 4 MiB only and opens a
    # second 20 MiB segment (40 MiB reserved for 24 MiB in use). Freeing the middle block
    # merges it with the 4 MiB after it: 12 MiB free at its address. A 12 MiB request ties
    # with the second segment's 12 MiB remainder; the lower address wins (size, then
    # address), and reserved stays 40 MiB.
    a = CachingAllocator()
    first, middle, _third = (a.malloc(8 * MIB) for _ in range(3))
    assert a.reserved == 40 * MIB
    a.free(middle)
    reused = a.malloc(12 * MIB)
    assert reused.address == middle.address and a.reserved == 40 * MIB
    assert first.allocated


def test_expandable_segment_grows_in_20_mib_pages() -> None:
    # expandable_segments:True. 11.5 MiB maps one 20 MiB page and splits off the 8.5 MiB
    # left (a remainder of 512 B or more is split in either pool). A second 11.5 MiB does
    # not fit the 8.5 MiB at the end: the segment grows by what is missing, 3 MiB, rounded
    # to one 20 MiB page (28.5 MiB free at the end, 17 MiB left after the split): 40 MiB
    # reserved for 23 MiB allocated. Without expandable segments the two get 12 MiB
    # segments each, unsplit: 24 MiB reserved and charged.
    e = ExpandableAllocator()
    for _ in range(2):
        e.malloc(11 * MIB + MIB // 2)
    assert (e.reserved, e.allocated) == (40 * MIB, 23 * MIB)
    a = CachingAllocator()
    for _ in range(2):
        a.malloc(11 * MIB + MIB // 2)
    assert (a.reserved, a.allocated) == (24 * MIB, 24 * MIB)


def test_expandable_segments_tile_a_slightly_larger_batch() -> None:
    # The case of Note [Expandable Segments]: ten 12 MiB tensors, freed, then ten of
    # 12.5 MiB (the next batch is a little larger). Plain segments: ten 12 MiB segments,
    # which no 12.5 MiB request fits, then ten 14 MiB ones (12.5 MiB rounded up to 2 MiB):
    # 120 + 140 = 260 MiB reserved. Expandable: the ten 12 MiB tile 120 MiB (six 20 MiB
    # pages), free they merge into one 120 MiB block at the end, nine 12.5 MiB take 112.5
    # MiB of it and the tenth grows the segment by one page: 140 MiB.
    sizes = [12 * MIB] * 10 + [12 * MIB + MIB // 2] * 10

    def run(allocator: CachingAllocator) -> int:
        first = [allocator.malloc(n) for n in sizes[:10]]
        for block in first:
            allocator.free(block)
        for n in sizes[10:]:
            allocator.malloc(n)
        return allocator.peak_reserved

    assert run(CachingAllocator()) == 260 * MIB
    assert run(ExpandableAllocator()) == 140 * MIB
    events = [(i, n) for i, n in enumerate(sizes[:10])] + [
        (i, -n) for i, n in enumerate(sizes[:10])
    ]
    events += [(10 + i, n) for i, n in enumerate(sizes[10:])]
    assert replay([], events, iterations=1, expandable_segments=True).peak_reserved_bytes == (
        140 * MIB
    )


def test_expandable_best_fit_prefers_a_block_not_at_the_growing_end() -> None:
    # A 6 MiB hole in the middle and 14 MiB free at the end of a 40 MiB mapping: a 5 MiB
    # request takes the hole (the end's block could grow, so it counts as larger).
    e = ExpandableAllocator()
    a = e.malloc(10 * MIB)
    hole = e.malloc(6 * MIB)
    e.malloc(10 * MIB)
    e.free(hole)
    assert e.reserved == 40 * MIB  # 26 MiB in blocks, 14 MiB free at the end
    taken = e.malloc(5 * MIB)
    assert taken.address == a.address + 10 * MIB and e.reserved == 40 * MIB
