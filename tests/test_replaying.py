"""The flat caching-allocator replay against the class-based reference, and the replays kept."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vram_widget import profile_model, zoo
from vram_widget._estimating import replaying
from vram_widget._estimating.allocator import (
    K_LARGE_BUFFER,
    K_MIN_LARGE_ALLOC,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocatorReplay,
    OutOfMemory,
    replay,
)
from vram_widget._estimating.estimator import MemoryEstimate
from vram_widget._estimating.replaying import (
    ReplayStream,
    cached_replay,
    fast_replay,
    plan,
    replays_run,
)

MiB = 2**20
Outcome = tuple[Any, ...]


def _outcome(run: Callable[[], AllocatorReplay]) -> Outcome:
    """Every number a replay gives, or every field of its out-of-memory error."""
    try:
        r = run()
    except OutOfMemory as short:
        return ("oom", short.request, short.segment, short.reserved, short.allocated)
    return (
        "ok",
        r.peak_reserved_bytes,
        r.peak_allocated_bytes,
        r.reserved_at_end_bytes,
        r.segments,
    )


def _both(
    residents: list[int],
    events: list[tuple[int, int]],
    *,
    iterations: int = 2,
    capacity_bytes: int | None = None,
    expandable_segments: bool = False,
) -> tuple[Outcome, Outcome]:
    """The reference replay's outcome and the flat one's, of the same stream and setting."""
    ids = [s for s, _ in events]
    nbytes = [n for _, n in events]
    kw: dict[str, Any] = {
        "iterations": iterations,
        "capacity_bytes": capacity_bytes,
        "expandable_segments": expandable_segments,
    }
    reference = _outcome(lambda: replay(residents, events, **kw))
    flat = _outcome(lambda: fast_replay(plan(residents, ids, nbytes), **kw))
    return reference, flat


# request sizes from every regime of the allocator: small pool (at most 1 MiB), the 20 MiB
# large buffer (1-10 MiB), rounded 2 MiB segments (10 MiB and up), and the boundaries
_sizes = st.one_of(
    st.integers(1, K_SMALL_SIZE),
    st.integers(K_SMALL_SIZE + 1, K_MIN_LARGE_ALLOC - 1),
    st.integers(K_MIN_LARGE_ALLOC, 48 * MiB),
    st.sampled_from(
        [512, K_SMALL_SIZE, K_SMALL_SIZE + 1, K_SMALL_BUFFER, K_MIN_LARGE_ALLOC, K_LARGE_BUFFER]
    ),
)
# an action: allocate a new storage, free a live one (by its index among the live), free a
# storage never allocated, allocate again over a live storage (the earlier block stays in
# use), or an event of zero bytes
_actions = st.lists(
    st.tuples(
        st.sampled_from(["alloc"] * 3 + ["free"] * 3 + ["stray", "over", "zero"]),
        _sizes,
        st.integers(0, 2**16),
    ),
    max_size=60,
)


def _stream(actions: list[tuple[str, int, int]]) -> list[tuple[int, int]]:
    events: list[tuple[int, int]] = []
    live: dict[int, int] = {}
    fresh = 0
    for kind, size, pick in actions:
        if kind == "alloc" or (kind in ("free", "over") and not live):
            events.append((fresh, size))
            live[fresh] = size
            fresh += 1
        elif kind == "free":
            storage = list(live)[pick % len(live)]
            events.append((storage, -live.pop(storage)))
        elif kind == "over":
            storage = list(live)[pick % len(live)]
            events.append((storage, size))
            live[storage] = size
        elif kind == "stray":
            events.append((10**6 + pick, -size))
        else:
            events.append((fresh, 0))
    return events


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    residents=st.lists(_sizes, max_size=6),
    actions=_actions,
    iterations=st.integers(1, 3),
    shortfalls=st.lists(st.integers(0, 40), min_size=1, max_size=4),
)
def test_flat_replay_equals_the_reference_on_random_streams(
    residents: list[int], actions: list[tuple[str, int, int]], iterations: int,
    shortfalls: list[int],
) -> None:  # fmt: skip
    # Exactly the reference's numbers: peaks of the last iteration, reserved at the end,
    # segments; under caps below the free replay's reserved peak (2 MiB steps, where the
    # allocator releases cached segments, runs on or fails), the same error fields.
    events = _stream(actions)
    reference, flat = _both(residents, events, iterations=iterations)
    assert flat == reference
    reference, flat = _both(residents, events, iterations=iterations, expandable_segments=True)
    assert flat == reference
    free_peak = _outcome(lambda: replay(residents, events, iterations=iterations))[1]
    for shortfall in shortfalls:
        cap = max(0, free_peak - shortfall * K_SMALL_BUFFER)
        reference, flat = _both(residents, events, iterations=iterations, capacity_bytes=cap)
        assert flat == reference, cap


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    residents=st.lists(_sizes, max_size=6),
    actions=_actions,
    iterations=st.integers(1, 3),
    mark=st.integers(0, 40),
    shortfalls=st.lists(st.integers(0, 40), min_size=1, max_size=8),
)
def test_capped_replays_from_checkpoints_equal_the_reference(
    residents: list[int], actions: list[tuple[str, int, int]], iterations: int, mark: int,
    shortfalls: list[int],
) -> None:  # fmt: skip
    # One plan replayed free (leaving a checkpoint where reserved would pass ``mark``), then
    # under caps in any order, each starting from the latest checkpoint that the earlier
    # replays left and that it passes through: every outcome is the reference's, replayed
    # from the start.
    events = _stream(actions)
    step = plan(residents, [s for s, _ in events], [n for _, n in events])
    free_peak = _outcome(lambda: replay(residents, events, iterations=iterations))[1]
    flat = _outcome(
        lambda: fast_replay(
            step, iterations=iterations, checkpoint_above=free_peak - mark * K_SMALL_BUFFER
        )
    )
    assert flat == _outcome(lambda: replay(residents, events, iterations=iterations))
    for shortfall in shortfalls:
        cap = max(0, free_peak - shortfall * K_SMALL_BUFFER)
        reference = _outcome(
            lambda c=cap: replay(residents, events, iterations=iterations, capacity_bytes=c)
        )
        flat = _outcome(lambda c=cap: fast_replay(step, iterations=iterations, capacity_bytes=c))
        assert flat == reference, cap


def _periodic_stream(
    prefix: list[tuple[str, int, int]], period: list[tuple[str, int, int]], repeats: int
) -> list[tuple[int, int]]:
    """``prefix``'s events, then ``period``'s ``repeats`` times: the same sizes in the same
    order each time, on fresh storages, as the layers of a deep model make them. In a
    repetition, "keep" allocates a storage left live to the next one (as a layer's output
    or its activations saved for the backward), which that one frees by "free" where it
    holds none of its own to free; what stays live at the end is freed last."""
    events = _stream(prefix)
    fresh = 1 + max((s for s, _ in events if s < 10**6), default=-1)
    kept: list[tuple[int, int]] = []  # the previous repetition's storages left live
    for _ in range(repeats):
        live: dict[int, int] = {}
        carried, kept = kept, []
        for kind, size, pick in period:
            if kind in ("alloc", "keep", "over", "stray", "zero") or not (live or carried):
                events.append((fresh, size))
                (kept.append((fresh, size)) if kind == "keep" else live.update({fresh: size}))
                fresh += 1
            elif live:
                storage = list(live)[pick % len(live)]
                events.append((storage, -live.pop(storage)))
            else:
                storage, size = carried.pop(pick % len(carried))
                events.append((storage, -size))
        kept += carried  # not freed: left live for the next repetitions
    return events


_period = st.lists(
    st.tuples(st.sampled_from(["alloc", "alloc", "keep", "free", "free", "free"]), _sizes,
              st.integers(0, 2**16)),
    min_size=1, max_size=12,
)  # fmt: skip


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    residents=st.lists(_sizes, max_size=4),
    prefix=st.lists(st.tuples(st.sampled_from(["alloc", "free"]), _sizes, st.integers(0, 99)),
                    max_size=6),
    period=_period,
    repeats=st.integers(2, 8),
    iterations=st.integers(1, 2),
    shortfalls=st.lists(st.integers(0, 40), min_size=1, max_size=3),
)  # fmt: skip
def test_flat_replay_equals_the_reference_on_periodic_streams(
    residents: list[int], prefix: list[tuple[str, int, int]],
    period: list[tuple[str, int, int]], repeats: int, iterations: int, shortfalls: list[int],
) -> None:  # fmt: skip
    # A period of events repeated (the same sizes in the same order), where what each
    # repetition leaves live shifts the state the next one starts from, as a deep model's
    # layers do: blocks split and merged in every order, the same numbers as the reference,
    # plain, expandable and under caps.
    events = _periodic_stream(prefix, period, repeats)
    for expandable in (False, True):
        reference, flat = _both(
            residents, events, iterations=iterations, expandable_segments=expandable
        )
        assert flat == reference
    free_peak = _outcome(lambda: replay(residents, events, iterations=iterations))[1]
    for shortfall in shortfalls:
        cap = max(0, free_peak - shortfall * K_SMALL_BUFFER)
        reference, flat = _both(residents, events, iterations=iterations, capacity_bytes=cap)
        assert flat == reference, cap


def test_a_split_rest_and_a_merged_block_keep_the_best_fit_order() -> None:
    # Large-pool blocks whose place in the sorted pool must move, one iteration (MiB):
    #  1. s0 = 18: 10 MiB and up, a segment of its own, 18 (2 MiB steps), unsplit.
    #  2. p = 5 opens a 20 MiB segment; 3. q = 12 from its 15 left, 3 left.
    #  4. s0 freed: pool [3, 18].
    #  5. 16 from the 18: 2 left, smaller than 3, so ahead of it: pool [2, 3].
    #  6. 2 takes the 2 exactly (a 3 taken instead would be charged whole: 1 MiB left is
    #     not split off in the large pool).
    #  7. the 16 freed (the 2 after it in use), then p: pool [3, 5, 16].
    #  8. q freed merges with p before it and the 3 after it: 20, past the 16: pool
    #     [16, 20]. 9. 16 takes the 16; 10. 20 takes the 20: no third segment.
    # Allocated: 18, 23, 35, 17, 33, 35, 19, 14, 2, 18, 38: peak 38; reserved 18 + 20 = 38
    # throughout, two segments.
    events = [
        (0, 18 * MiB), (1, 5 * MiB), (2, 12 * MiB), (0, -18 * MiB), (3, 16 * MiB),
        (4, 2 * MiB), (3, -16 * MiB), (1, -5 * MiB), (2, -12 * MiB), (5, 16 * MiB),
        (6, 20 * MiB),
    ]  # fmt: skip
    reference, flat = _both([], events, iterations=1)
    assert flat == reference == ("ok", 38 * MiB, 38 * MiB, 38 * MiB, 2)
    reference, flat = _both([], events, iterations=1, expandable_segments=True)
    assert flat == reference


def test_a_capped_replay_starts_where_the_free_one_would_pass_its_cap() -> None:
    # Two 30 MiB storages (10 MiB and up: a segment of their own each), then both freed.
    # The free replay, marked at 40 MiB: the first segment takes reserved to 30 MiB, the
    # second would take it to 60 > 40, so the state before the second allocation (run 1,
    # op 1, slot 1, 30 MiB reserved) is kept.
    step = plan([], [0, 1, 0, 1], [30 * MiB, 30 * MiB, -30 * MiB, -30 * MiB])
    fast_replay(step, iterations=1, checkpoint_above=40 * MiB)
    (kept,) = step.checkpoints.values()
    assert (kept.run, kept.at, kept.k, kept.reserved) == (1, 1, 1, 30 * MiB // 512)  # units
    # a cap of at least 30 MiB passes through it; 20 MiB does not (its first segment fails)
    assert replaying._resume_point(step, 1, 50 * MiB) is kept
    assert replaying._resume_point(step, 1, 20 * MiB) is None
    assert replaying._resume_point(step, 2, 50 * MiB) is None  # another iteration count
    # under 50 MiB, from it: nothing cached to release (the first 30 MiB is in use), so the
    # second 30 MiB segment fails with 30 MiB reserved and allocated; as the reference
    events = [(0, 30 * MiB), (1, 30 * MiB), (0, -30 * MiB), (1, -30 * MiB)]
    flat = _outcome(lambda: fast_replay(step, iterations=1, capacity_bytes=50 * MiB))
    reference = _outcome(lambda: replay([], events, iterations=1, capacity_bytes=50 * MiB))
    assert flat == reference == ("oom", 30 * MiB, 30 * MiB, 30 * MiB, 30 * MiB)
    # at 60 MiB it runs: peaks of 60 MiB reserved and allocated, two segments
    flat = _outcome(lambda: fast_replay(step, iterations=1, capacity_bytes=60 * MiB))
    assert flat == ("ok", 60 * MiB, 60 * MiB, 60 * MiB, 2)


def test_only_the_latest_plans_keep_checkpoints() -> None:
    # Five steps replayed free, each marked where its second 30 MiB segment passes 40 MiB:
    # each keeps a checkpoint, and once a newer step's replay is asked for, only the four
    # most recently used steps' plans still hold theirs (each is a copy of the state).
    replaying.forget_replays()
    streams = [
        ReplayStream.of([], [0, 1, 0, 1], [30 * MiB + i, 30 * MiB, -30 * MiB - i, -30 * MiB])
        for i in range(5)
    ]
    for stream in streams:
        cached_replay(stream, checkpoint_above=40 * MiB)
    kept = [len(replaying._plans[s.digest].checkpoints) for s in streams]
    assert kept == [0, 1, 1, 1, 1]


def test_flat_replay_releases_and_runs_on_under_a_cap() -> None:
    # A cap that binds and is then met by releasing a cached segment: 30 MiB (its own
    # 30 MiB segment: 10 MiB and up round to 2 MiB), freed and cached; 32 MiB does not fit
    # it and needs a 32 MiB segment: 30 + 32 > 40, the free 30 MiB segment is released, and
    # 32 <= 40 runs on. One iteration: peaks 32 MiB reserved and allocated, and at the end
    # (the 32 MiB freed into its cached segment) 32 MiB in one segment.
    events = [(0, 30 * MiB), (0, -30 * MiB), (1, 32 * MiB)]
    reference, flat = _both([], events, iterations=1, capacity_bytes=40 * MiB)
    assert flat == reference == ("ok", 32 * MiB, 32 * MiB, 32 * MiB, 1)
    # under 32 MiB the segment cannot be had even with nothing cached: the error names the
    # request, the segment, and what is left reserved and allocated after the release (0)
    reference, flat = _both([], events, iterations=1, capacity_bytes=31 * MiB)
    assert flat == reference == ("oom", 32 * MiB, 32 * MiB, 0, 0)


def test_sizes_past_int64_replay_as_the_reference() -> None:
    # Requests of 2**70 bytes and more (object arrays, Python ints; the allocated bytes
    # summed without numpy's int64): the same outcomes, free and under caps on either side
    # of what the step needs (under the second request's segment: out of memory).
    big = 2**70
    residents = [big]
    events = [(0, big), (1, 3 * big), (0, -big), (2, big // 2), (1, -3 * big), (2, -(big // 2))]
    reference, flat = _both(residents, events)
    assert flat == reference and flat[0] == "ok"
    for cap in (4 * big, 5 * big, 6 * big):
        reference, flat = _both(residents, events, capacity_bytes=cap)
        assert flat == reference, cap
    assert _both(residents, events, capacity_bytes=4 * big)[0][0] == "oom"


def test_plan_pairs_frees_as_the_reference_does() -> None:
    # storage 0 allocated over while live: slot 0 stays in use (never freed), slot 1 is
    # freed; a stray free is dropped; storage 2 lives to the end and is freed there
    # (sizes in 512-byte units: 1024 B is 2); slot 0 is what each iteration leaves in use
    p = plan([], [0, 0, 9, 0, 2], [1024, 2048, -64, -2048, 4096])
    assert p.ops == [2, 4, ~1, 8, ~2]
    assert p.leaked == [0]
    # the numpy pairing (alternating storages) and the dict one agree (700 B rounds to
    # 1024 B, 100 B to 512 B)
    ids, nbytes = [3, 4, 3, 4, 3], [512, 700, -512, -700, 100]
    assert plan([], ids, nbytes).ops == [1, 2, ~0, ~1, 1, ~2]
    assert plan([], ids, nbytes).leaked == []


def _gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("which", ["resnet18", "resnet50", "gpt2"])
def test_flat_replay_equals_the_reference_on_real_steps(which: str) -> None:
    # Real profiles' streams, at capacities around device_bytes (2 MiB steps either side,
    # and the free reserved peak), plain and expandable.
    if which == "gpt2":
        ids = torch.zeros(2, 32, dtype=torch.long)
        profile = profile_model(_gpt2(), inputs={"input_ids": ids, "labels": ids})
        est = profile.estimate(4, "fp32", "adamw")
    else:
        model = zoo.resnet18() if which == "resnet18" else zoo.resnet50()
        est = profile_model(model, input_size=(3, 64, 64)).estimate(8, "fp32", "adamw")
    stream = est._replay_stream
    assert stream is not None and est.device_bytes is not None
    residents = stream.resident_bytes.tolist()
    events = list(zip(stream.storage.tolist(), stream.nbytes.tolist(), strict=True))
    for expandable in (False, True):
        reference, flat = _both(residents, events, expandable_segments=expandable)
        assert flat == reference
    context = est.extras.cuda_context_bytes
    caps = [est.device_bytes - context + k * K_SMALL_BUFFER for k in range(-3, 4)]
    caps.append(_outcome(lambda: replay(residents, events))[1])
    # and every 2 MiB step between device_bytes' bounds, one past them either side
    bounds = est._device_bounds()
    assert bounds is not None
    low, high = (b - context for b in bounds)
    caps += range(low - K_SMALL_BUFFER, high + 2 * K_SMALL_BUFFER, K_SMALL_BUFFER)
    outcomes = set()
    for cap in caps:
        reference, flat = _both(residents, events, capacity_bytes=cap)
        assert flat == reference, cap
        outcomes.add(reference[0])
    assert outcomes == {"ok", "oom"}  # the caps straddle the least that runs
    # one plan for every cap, climbing and then descending, so that each capped replay
    # starts from the checkpoints the free replay (marked at the lowest cap) and the
    # earlier ones left: the same outcomes
    step = plan(residents, stream.storage, stream.nbytes)
    assert (
        _outcome(lambda: fast_replay(step, checkpoint_above=min(caps)))
        == _both(residents, events)[0]
    )
    runs = {}
    for cap in [*sorted(caps), *sorted(caps, reverse=True)]:
        reference = _outcome(lambda c=cap: replay(residents, events, capacity_bytes=c))
        assert _outcome(lambda c=cap: fast_replay(step, capacity_bytes=c)) == reference, cap
        runs[cap] = reference[0] == "ok"
    assert step.checkpoints  # kept, and started from
    # device_bytes by its definition, from the reference: the first 2 MiB step between the
    # bounds under which the step runs (at the upper bound, the free reserved peak, it does)
    steps = range(low, high + K_SMALL_BUFFER, K_SMALL_BUFFER)
    assert est.device_bytes == next(cap for cap in steps if runs[cap]) + context


def test_flat_replay_equals_the_reference_on_a_llama_7b_shaped_step() -> None:
    # Two decoder layers of Llama-2-7B's shape on the meta device (4,096 wide, 11,008 FFN,
    # 32 heads, 32,000-word vocabulary), 128 tokens, batch 8, bf16, AdamW: the sizes of
    # the full model's step, with its repeated layers. The same numbers as the reference,
    # plain and expandable, and under caps on either side of device_bytes, replayed from
    # one plan (so from the checkpoints the free replay and the earlier caps leave).
    config = dataclasses.replace(zoo.LLAMA_7B, n_layer=2)
    with torch.device("meta"):
        model = zoo.llama_decoder(config)
    profile = profile_model(model, inputs=torch.zeros(1, 128, dtype=torch.long))
    est = profile.estimate(8, "bf16", "adamw")
    stream = est._replay_stream
    assert stream is not None and est.device_bytes is not None
    residents = stream.resident_bytes.tolist()
    events = list(zip(stream.storage.tolist(), stream.nbytes.tolist(), strict=True))
    for expandable in (False, True):
        reference, flat = _both(residents, events, expandable_segments=expandable)
        assert flat == reference
    least = est.device_bytes - est.extras.cuda_context_bytes  # the least cap that runs
    caps = [least + k * K_SMALL_BUFFER for k in (-2, -1, 0, 1, 3)]
    step = plan(residents, stream.storage, stream.nbytes)
    fast_replay(step, checkpoint_above=caps[0])
    outcomes = []
    for cap in caps:
        reference = _outcome(lambda c=cap: replay(residents, events, capacity_bytes=c))
        assert _outcome(lambda c=cap: fast_replay(step, capacity_bytes=c)) == reference, cap
        outcomes.append(reference[0])
    assert outcomes == ["oom", "oom", "ok", "ok", "ok"]
    assert step.checkpoints


def _fresh_setting() -> tuple[Any, int]:
    """A profile and a batch size whose replays this process has not run before."""
    model = torch.nn.Sequential(
        torch.nn.Linear(1000, 3000), torch.nn.ReLU(), torch.nn.Linear(3000, 700)
    )
    return profile_model(model, input_size=(1000,)), 1000 + int(replays_run()) % 997


def test_each_setting_is_replayed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # fits, device_bytes, allocator and the expandable replay of one estimate replay each
    # setting (capacity, expandable) at most once; a fresh estimate of the same setting,
    # as another caller makes it, replays nothing.
    profile, batch = _fresh_setting()
    asked: list[tuple[int | None, bool]] = []
    real = replaying.fast_replay

    def counted(step: replaying.ReplayPlan, **kw: Any) -> AllocatorReplay:
        asked.append((kw.get("capacity_bytes"), kw.get("expandable_segments", False)))
        return real(step, **kw)

    monkeypatch.setattr(replaying, "fast_replay", counted)
    est = profile.estimate(batch, "fp32", "adamw")
    bounds = est._device_bounds()
    assert bounds is not None and bounds[0] < bounds[1]  # device_bytes climbs capped replays
    capacity = (bounds[0] + bounds[1]) // 2
    est.fits(capacity)
    assert est.device_bytes is not None
    est.fits(est.device_bytes)
    assert est.allocator is not None
    assert est.replayed(expandable_segments=True) is not None
    assert len(asked) == len(set(asked))  # no setting twice
    assert (None, False) in asked and (None, True) in asked
    assert len(asked) >= 3  # the free replay, the expandable one, one capped at least
    before = len(asked)
    again = profile.estimate(batch, "fp32", "adamw")
    assert again is not est
    assert again.fits(capacity) == est.fits(capacity)
    assert again.device_bytes == est.device_bytes
    assert again.allocator == est.allocator
    assert again.replayed(expandable_segments=True) == est.replayed(expandable_segments=True)
    assert len(asked) == before  # zero new replays


def test_a_remembered_out_of_memory_is_raised_again() -> None:
    # 30 MiB of resident parameters, then a step under a 10 MiB cap: the same error
    # (fields) both times, the second without a replay
    stream = ReplayStream.of([30 * MiB + 7], np.array([0, 0]), np.array([4096, -4096]))
    errors = []
    before = replays_run()
    for _ in range(2):
        with pytest.raises(OutOfMemory) as raised:
            cached_replay(stream, capacity_bytes=10 * MiB)
        e = raised.value
        errors.append((e.request, e.segment, e.reserved, e.allocated))
    assert replays_run() - before == 1
    # 30 MiB + 7 bytes rounds to 30 MiB + 512, in a 30 MiB + 2 MiB segment (2 MiB steps)
    assert errors[0] == errors[1] == (30 * MiB + 7, 32 * MiB, 0, 0)


def test_estimate_replays_match_the_reference() -> None:
    # MemoryEstimate.allocator goes through the flat replay; the recording reference
    # (memory_snapshot) gives the same segments.
    est: MemoryEstimate = profile_model(zoo.resnet18(), input_size=(3, 32, 32)).estimate(2)
    snap = est.memory_snapshot()
    assert est.allocator is not None and snap is not None
    assert est.allocator.segments == len(snap["segments"])
    assert est.allocator.reserved_at_end_bytes == sum(s["total_size"] for s in snap["segments"])
