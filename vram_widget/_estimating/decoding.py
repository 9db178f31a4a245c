"""Decode steps as a pattern in the cache length: any number of new tokens from the few steps
the generation pass recorded (``generation``). numpy only.

A recorded generation is generate's set-up, the prefill (step 0) and decode steps 1..N, each
step's events between the starts of two forwards. Every decode step runs the same ops on one
new token with a cache one token longer than the step before, so from some step on, each
event's size is the last recorded step's plus a fixed amount per step (a cache of L tokens
concatenated with one more, attention over L keys). That pattern is read from the last
two recorded steps and checked exactly, event for event, against the one before them
(:func:`decode_pattern`); where it does not hold (a kernel that pads the length), the
generation is not extrapolated. A sliding window splits the steps in two patterns (the cache
grows below it and slides past it): a second run, recorded across the window, joins them
(:func:`_plan`).

Step ``N + m`` is then ``last + m * slope``. Live memory at its start grows by the steps'
net sizes, a sum in closed form, and its peak is the largest prefix of its events; both are
convex in ``m`` where the net growth per step does not shrink, so the peak over all steps is
at the first extrapolated step or the last (every step is evaluated otherwise). The unrolled
step is the recorded events, then each category's net over the steps before the peak step,
then the peak step's events, then each category's net over the steps after it: the live
curve is exact at every event it has, and its maximum is the generation's peak.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np

from .options import CATEGORY_CODE, PHASE_CODE, Category, Phase
from .table import N_CATEGORIES, Poly, Timeline, sum_by

# Decode steps the generation pass records after the prefill. The first may differ from the
# rest (the prefill's logits and set-up are let go in it); the pattern the later ones follow
# is read from two and checked exactly against a third (:func:`decode_pattern`).
DECODE_STEPS_PROFILED = 4
# Across a sliding window of W tokens, one run at a prompt of W - 5 records 9: its decode
# step j runs with W - 5 + j keys, so step 2 (W - 3 keys, the last below the window) is
# compared with the prompt's own run, steps 3-5 are where the window fills (W - 2 to W),
# and steps 6-9 are past it (W + 1 to W + 4), the pattern there read from the last three.
# The window's edges are measured (Mistral and Qwen2, window 24): one pattern up to W - 3
# keys, another from W + 1.
DECODE_STEPS_ACROSS_WINDOW = 9
PROMPT_BEFORE_WINDOW = 5

# A StaticCache is allocated for the prompt and every new token before the first step, so a
# recorded generation depends on the new tokens generate is asked for: it is recorded at
# these three, and its sizes, a line in them, read from two and checked exactly at the third.
STATIC_CACHE_TOKENS = (8, 16, 24)

_DECODE = PHASE_CODE[Phase.DECODE]
_KV = CATEGORY_CODE[Category.KV_CACHE]


class DecodePatternError(ValueError):
    """The recorded decode steps do not follow one pattern in the cache length."""


@dataclass(frozen=True)
class StepEvents:
    """Events of a recorded (or unrolled) generation, with the step each starts."""

    nbytes: np.ndarray  # int64, signed
    module: np.ndarray  # int32 row
    phase: np.ndarray  # int8 phase code
    category: np.ndarray  # int8 category code
    op: np.ndarray  # int32 op index (-1: none)
    # where each step starts (step 0: the set-up and the prefill) and which step it is; an
    # unrolled generation's (empty for the recorded events ``unroll`` reads)
    step_at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    step_number: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


@dataclass(frozen=True)
class Generation:
    """What a generation of ``new_tokens`` tokens holds beside its events."""

    new_tokens: int
    kv_cache_bytes: int  # the cache after the last step
    # what one more token adds to the cache, per sequence (0 past a sliding window, or for a
    # cache allocated whole up front)
    kv_cache_bytes_per_token: int


_Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _slice(events: StepEvents, lo: int, hi: int) -> _Arrays:
    return (
        events.nbytes[lo:hi],
        events.module[lo:hi],
        events.phase[lo:hi],
        events.category[lo:hi],
        events.op[lo:hi],
    )


def decode_pattern(events: StepEvents, starts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The last recorded decode step's events and their growth per step, checked exactly
    against the two steps before it. Raises :class:`DecodePatternError` where they differ in
    anything but sizes that grow by the same amount each step."""
    n = len(starts) - 1  # recorded steps (prefill included)
    if n < 4:
        raise DecodePatternError(f"{n - 1} decode steps recorded; the pattern needs 3")
    where = (
        f"generation past {n} new tokens is extrapolated from the last {n - 1} decode steps "
        "recorded, and "
    )
    a, b, c = (_slice(events, starts[k], starts[k + 1]) for k in (n - 3, n - 2, n - 1))
    same = len(a[0]) == len(b[0]) == len(c[0]) and all(
        np.array_equal(x, y) and np.array_equal(y, z)
        for x, y, z in zip(a[1:], b[1:], c[1:], strict=True)
    )
    if not same:
        raise DecodePatternError(
            where + "they run different ops or allocate in another order from step to step"
        )
    slope = c[0] - b[0]
    if not np.array_equal(b[0] - a[0], slope):
        raise DecodePatternError(
            where + "their sizes do not grow by the same amount each step (an attention "
            "window reached within them, a kernel that pads the length)"
        )
    return c[0], slope


@dataclass(frozen=True)
class Recording:
    """One recorded generation at one batch size: its events, where each forward starts
    (the last entry: where the recording ends), its prompt's length (decode step ``k`` runs
    with keys of ``prompt_len + k`` tokens) and the FLOPs per row counted before each
    forward and at the end (forwards + 1 x rows)."""

    events: StepEvents
    starts: tuple[int, ...]
    prompt_len: int
    flops: np.ndarray

    @property
    def forwards(self) -> int:
        """The forwards recorded: the prefill (step 0), then decode steps 1.."""
        return len(self.starts) - 1

    def step(self, k: int) -> _Arrays:
        return _slice(self.events, self.starts[k], self.starts[k + 1])

    def step_flops(self, k: int) -> np.ndarray:
        return self.flops[k + 1] - self.flops[k]

    def pattern(self) -> tuple[np.ndarray, np.ndarray]:
        """The last recorded step's events and their growth per step (checked)."""
        return decode_pattern(self.events, self.starts)

    def flops_slope(self) -> np.ndarray:
        """The FLOPs' growth per decode step, checked on the last three as the memory's."""
        a, b, c = (self.step_flops(k) for k in range(self.forwards - 3, self.forwards))
        if not np.array_equal(b - a, c - b):
            raise DecodePatternError("the recorded decode steps' FLOPs do not grow by one amount")
        return c - b


@dataclass(frozen=True)
class _Steps:
    """Recorded steps ``first..last`` of ``run``, as the generation's steps from ``number``."""

    run: Recording
    first: int
    last: int
    number: int


@dataclass(frozen=True)
class _Extrapolated:
    """The generation's steps ``number + m``, ``m`` in ``m1..m2``: the last recorded step of
    ``run`` plus ``m`` times its growth per step."""

    run: Recording
    m1: int
    m2: int
    number: int


_Segment = _Steps | _Extrapolated


def _same(a: _Arrays, b: _Arrays) -> bool:
    return len(a[0]) == len(b[0]) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _plan(run: Recording, new_tokens: int, across: Recording | None) -> list[_Segment]:
    """Where each step of a generation of ``new_tokens`` tokens comes from: ``run``'s
    recorded steps, then its pattern; or, where ``across`` (a run at another prompt whose
    recorded decode steps span a sliding window) is given, ``run``'s steps and its pattern
    below the window, ``across``'s recorded steps through it (a decode step depends on its
    key length, not on the prompt it started from: checked where both runs give the same
    length), then ``across``'s pattern past it."""
    last_step = new_tokens - 1
    n = run.forwards
    if last_step < n:
        return [_Steps(run, 0, last_step, 0)]
    plan: list[_Segment] = [_Steps(run, 0, n - 1, 0)]
    if across is None:
        return [*plan, _Extrapolated(run, 1, last_step - (n - 1), n - 1)]
    low = across.prompt_len + 2  # the key lengths of across's steps 2.. (its step 1 follows
    high = across.prompt_len + across.forwards - 1  # its own prefill)
    k = n  # the next step of the generation; its keys: run.prompt_len + k
    if run.prompt_len + k < low:  # below the window: run's pattern, up to across's steps
        k_end = min(last_step, low - 1 - run.prompt_len)
        plan.append(_Extrapolated(run, 1, k_end - (n - 1), n - 1))
        last, slope = run.pattern()
        m = low - run.prompt_len - (n - 1)
        if not _same((last + m * slope, *run.step(n - 1)[1:]), across.step(2)):
            raise DecodePatternError(
                "the decode step before the window differs between the prompt's run and "
                "the run across the window"
            )
        k = k_end + 1
    elif (
        n - 1 >= 2  # the last recorded step (not the first after the prefill), compared
        and run.prompt_len + n - 1 >= low
        and not _same(run.step(n - 1), across.step(run.prompt_len + n - 1 - across.prompt_len))
    ):
        raise DecodePatternError(
            "a decode step differs between the prompt's run and the run across the window"
        )
    if k > last_step:
        return plan
    j = run.prompt_len + k - across.prompt_len
    if j <= across.forwards - 1:
        j_end = min(across.forwards - 1, j + last_step - k)
        plan.append(_Steps(across, j, j_end, k))
        k += j_end - j + 1
    if k > last_step:
        return plan
    assert run.prompt_len + k - 1 == high
    return [*plan, _Extrapolated(across, 1, last_step - (k - 1), k - 1)]


def _category_nets(
    category: np.ndarray, last: np.ndarray, slope: np.ndarray, m1: int, m2: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each category's net bytes summed over extrapolated steps ``m1..m2`` (step ``m`` is
    ``last + m * slope``): codes and nets of the categories with a nonzero one."""
    count = m2 - m1 + 1
    steps = (m1 + m2) * count // 2  # m1 + ... + m2
    nets = count * sum_by(category, last, N_CATEGORIES) + steps * sum_by(
        category, slope, N_CATEGORIES
    )
    codes = np.flatnonzero(nets)
    return codes, nets[codes]


def _best_step(last: np.ndarray, slope: np.ndarray, m1: int, m2: int, live: int) -> int:
    """The ``m`` in ``m1..m2`` whose step peaks highest, the steps starting at ``live``
    (first of the highest). Live memory before step ``m`` grows by the steps' nets, a sum in
    closed form, and the step's peak is its largest prefix: both convex in ``m`` where the
    net growth per step does not shrink, so the peak is at an end (every step otherwise)."""
    total, growth = int(last.sum()), int(slope.sum())
    prefix, prefix_growth = np.cumsum(last), np.cumsum(slope)

    def peak_of(m: np.ndarray) -> np.ndarray:
        start = live + (m - m1) * total + growth * (m1 + m - 1) * (m - m1) // 2
        inner = (prefix[None, :] + m[:, None] * prefix_growth[None, :]).max(axis=1)
        return start + np.maximum(inner, 0)

    if growth >= 0:
        candidates = np.unique(np.asarray([m1, m2], dtype=np.int64))
        peaks = peak_of(candidates)
    else:  # a shrinking step (not seen in practice): every step, in chunks
        candidates = np.arange(m1, m2 + 1, dtype=np.int64)
        chunks = np.array_split(candidates, max(1, len(candidates) // 256))
        peaks = np.concatenate([peak_of(chunk) for chunk in chunks])
    return int(candidates[int(np.argmax(peaks))])


def _emit(plan: list[_Segment]) -> StepEvents:
    """The events of ``plan``: recorded steps as they are; each extrapolated run of steps as
    each category's net over the steps before its highest one, that step's events, then the
    nets over the steps after it (so the live curve is exact at every event it has, and its
    maximum is the generation's peak)."""
    parts: list[_Arrays] = []
    step_at: list[int] = []
    step_number: list[int] = []
    size = 0
    live = 0  # residents aside

    def add(arrays: _Arrays, number: int) -> None:
        nonlocal size, live
        step_at.append(size)
        step_number.append(number)
        parts.append(arrays)
        size += len(arrays[0])
        live += int(arrays[0].sum())

    for seg in plan:
        run = seg.run
        if isinstance(seg, _Steps):
            for k in range(seg.first, seg.last + 1):
                lo = 0 if k == 0 else run.starts[k]  # step 0 with generate's set-up
                add(_slice(run.events, lo, run.starts[k + 1]), seg.number + k - seg.first)
            continue
        last, slope = run.pattern()
        shape = run.step(run.forwards - 1)[1:]
        best = _best_step(last, slope, seg.m1, seg.m2, live)
        if best > seg.m1:
            nets = _category_nets(shape[2], last, slope, seg.m1, best - 1)
            add(_nets(*nets), seg.number + best - 1)
        add((last + best * slope, *shape), seg.number + best)
        if best < seg.m2:
            nets = _category_nets(shape[2], last, slope, best + 1, seg.m2)
            add(_nets(*nets), seg.number + seg.m2)
    nbytes, module, phase, category, op = (np.concatenate([p[i] for p in parts]) for i in range(5))
    return StepEvents(
        nbytes,
        module,
        phase,
        category,
        op,
        step_at=np.asarray(step_at, dtype=np.int64),
        step_number=np.asarray(step_number, dtype=np.int64),
    )


def _nets(codes: np.ndarray, nets: np.ndarray) -> _Arrays:
    """Net events, one per category, of extrapolated steps (at the root, in the decode)."""
    n = len(nets)
    return (
        nets,
        np.zeros(n, np.int32),
        np.full(n, _DECODE, np.int8),
        codes.astype(np.int8),
        np.full(n, -1, np.int32),
    )


def _plan_flops(plan: list[_Segment]) -> np.ndarray:
    """FLOPs per row of ``plan``'s steps (with generate's set-up)."""
    first = plan[0].run
    total = first.flops[0].copy()  # the set-up, before the prefill's forward
    for seg in plan:
        run = seg.run
        if isinstance(seg, _Steps):
            total = total + run.flops[seg.last + 1] - run.flops[seg.first]
            continue
        last = run.step_flops(run.forwards - 1)
        count = seg.m2 - seg.m1 + 1
        total = total + count * last + run.flops_slope() * ((seg.m1 + seg.m2) * count // 2)
    return total


def _last_step(plan: list[_Segment]) -> tuple[np.ndarray, np.ndarray]:
    """Bytes and categories of the events of ``plan``'s last step."""
    seg = plan[-1]
    run = seg.run
    if isinstance(seg, _Steps):
        step = run.step(seg.last)
        return step[0], step[3]
    last, slope = run.pattern()
    return last + seg.m2 * slope, run.step(run.forwards - 1)[3]


def _recorded_growth(out: StepEvents) -> int:
    """The KV cache's growth in the last decode step of ``out`` (recorded steps only) that
    did not shrink it; the last step's where every one did. A quantized cache's flush
    (``kv_cache.py``) shrinks it, as its residual is quantized: the step after grows by one
    unquantized token, as the steps before it did."""
    bounds = [*out.step_at.tolist(), len(out.nbytes)]
    growth = [
        int(out.nbytes[lo:hi][out.category[lo:hi] == _KV].sum())
        for lo, hi in itertools.pairwise(bounds)
    ]
    decode = [g for g, number in zip(growth, out.step_number.tolist(), strict=True) if number]
    grown = [g for g in decode if g >= 0]
    return grown[-1] if grown else (decode or growth)[-1]


def unroll(
    run: Recording, new_tokens: int, batch_size: int, across: Recording | None = None
) -> tuple[StepEvents, Generation, np.ndarray]:
    """The events of a generation of ``new_tokens`` tokens (the prefill makes the first;
    each further one is a decode step) from ``run``, recorded at the generation's prompt
    and batch size (and, across a sliding window, ``across``: :func:`_plan`); with its KV
    cache and its FLOPs per row."""
    plan = _plan(run, new_tokens, across)
    out = _emit(plan)
    flops = _plan_flops(plan)
    kv = int(out.nbytes[out.category == _KV].sum())
    try:  # what one more token adds: the step after the last
        after, category = _last_step(_plan(run, new_tokens + 1, across))
    except DecodePatternError:  # no pattern to take it from: the recorded steps' growth
        return out, Generation(new_tokens, kv, _recorded_growth(out) // batch_size), flops
    per_token = int(after[category == _KV].sum()) // batch_size
    return out, Generation(new_tokens, kv, per_token), flops


def at_new_tokens(timelines: tuple[Timeline, ...], new_tokens: int) -> Timeline:
    """The generation recorded with generate asked for ``new_tokens`` tokens, from the same
    generation recorded at :data:`STATIC_CACHE_TOKENS` (``timelines``): every size is a line
    in the new tokens (a ``StaticCache`` of prompt + new tokens - 1 positions, its mask,
    attention over all of them), read from the first two and checked exactly at the third.
    Raises :class:`DecodePatternError` where it is not."""
    a, b, c = timelines
    t0, t1, t2 = STATIC_CACHE_TOKENS
    same = (
        a.step_starts == b.step_starts == c.step_starts
        and all(
            np.array_equal(x, y) and np.array_equal(y, z)
            for x, y, z in (
                (a.event_module, b.event_module, c.event_module),
                (a.event_phase, b.event_phase, c.event_phase),
                (a.event_category, b.event_category, c.event_category),
                (a.event_op, b.event_op, c.event_op),
            )
        )
        and (a.batch_one is None) == (b.batch_one is None) == (c.batch_one is None)
    )
    if not same:
        raise DecodePatternError(
            "generate runs other ops or allocates in another order for other numbers of new "
            f"tokens ({t0}, {t1}, {t2}) with this cache"
        )

    def line(xa: np.ndarray, xb: np.ndarray, xc: np.ndarray) -> np.ndarray:
        if not xa.shape == xb.shape == xc.shape:
            raise DecodePatternError("the generation's sizes differ in shape across new tokens")
        step, rest = np.divmod(xb - xa, t1 - t0)
        if rest.any() or not np.array_equal(xc, xb + step * (t2 - t1)):
            raise DecodePatternError(
                f"the generation's sizes are not a line in the new tokens ({t0}, {t1}, {t2})"
            )
        return xa + step * (new_tokens - t0)

    def poly(pa: Poly | None, pb: Poly | None, pc: Poly | None) -> Poly | None:
        if pa is None or pb is None or pc is None:
            return None
        if not pa.monomials == pb.monomials == pc.monomials:
            raise DecodePatternError("the generation's sizes differ in form across new tokens")
        return Poly(line(pa.coef, pb.coef, pc.coef), pa.exponents)

    event_bytes = poly(a.event_bytes, b.event_bytes, c.event_bytes)
    storage_bytes = poly(a.storage_bytes, b.storage_bytes, c.storage_bytes)
    assert event_bytes is not None and storage_bytes is not None
    batch_one = None
    if a.batch_one is not None:
        assert b.batch_one is not None and c.batch_one is not None
        batch_one = at_new_tokens((a.batch_one, b.batch_one, c.batch_one), new_tokens)
    return dataclasses.replace(
        a,
        event_bytes=event_bytes,
        storage_bytes=storage_bytes,
        step_flops=poly(a.step_flops, b.step_flops, c.step_flops),
        workspace_bytes=line(a.workspace_bytes, b.workspace_bytes, c.workspace_bytes),
        batch_one=batch_one,
        collectives=None,  # not unrolled: unknown for other numbers of new tokens
    )


def crosses_window(prompt_len: int, new_tokens: int, recorded: int, window: int | None) -> bool:
    """Whether a generation's extrapolated decode steps cross the model's sliding window
    (``config.sliding_window``): there a sliding layer's cache stops growing and its mask
    appears, so the steps before and after follow two patterns, and one recorded run holds
    only one (the run at the prompt records ``recorded`` forwards). Steps the run recorded
    are exact whatever the window, and so are extrapolated ones on the pattern's side of it
    (a prompt past the window, or a generation that ends before it)."""
    if window is None or new_tokens <= recorded:
        return False
    first = prompt_len + recorded - 4  # the key length before the first step of the pattern
    last = prompt_len + new_tokens  # ... and after the last step generated
    # measured on Mistral and Qwen2 (window 24): steps are of one pattern from a key length
    # of the window on, and up to two below it
    return first < window and last > window - 2


def step_of(events: StepEvents, index: int) -> int:
    """The step (0: the prefill, k: decode step k) of the event at ``index``."""
    at = int(np.searchsorted(events.step_at, index, side="right")) - 1
    return int(events.step_number[max(at, 0)])


def check_generation(
    model_name: str, generates: bool, limit: int | None, prompt_len: int | None, new_tokens: object
) -> int:
    """``new_tokens`` for a generation checked (a ValueError naming the problem and the valid
    forms); returns it."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(
            "mode='generate' needs new_tokens, an int >= 1 (the tokens generated after the "
            f"prompt); got {new_tokens!r}"
        )
    if not generates:
        raise ValueError(
            "mode='generate' needs a model that generates with a cache of past keys and "
            "values (returns past_key_values: a Hugging Face model with generate()); "
            f"{model_name} has none. mode='inference' is one forward"
        )
    if limit is not None and prompt_len is not None and prompt_len + new_tokens > limit:
        raise ValueError(
            f"a prompt of {prompt_len} tokens plus new_tokens={new_tokens} is "
            f"{prompt_len + new_tokens} positions, beyond the model's limit of {limit} "
            "(config.max_position_embeddings)"
        )
    return new_tokens
