"""Decode steps as a pattern in the cache length: any number of new tokens from the few steps
the generation pass recorded (``_generation``). numpy only.

A recorded generation is generate's set-up, the prefill (step 0) and decode steps 1..N, each
step's events between the starts of two forwards. Every decode step runs the same ops on one
new token with a cache one token longer than the step before, so from some step on, each
event's size is the last recorded step's plus a fixed amount per step (a cache of L tokens
concatenated with one more, attention over L keys). That pattern is read from the last
two recorded steps and checked exactly, event for event, against the one before them
(:func:`decode_pattern`); where it does not hold (a sliding window that fills up within the
recorded steps, a kernel that pads the length), the generation is not extrapolated.

Step ``N + m`` is then ``last + m * slope``. Live memory at its start grows by the steps'
net sizes, a sum in closed form, and its peak is the largest prefix of its events; both are
convex in ``m`` where the net growth per step does not shrink, so the peak over all steps is
at the first extrapolated step or the last (every step is evaluated otherwise). The unrolled
step is the recorded events, then each category's net over the steps before the peak step,
then the peak step's events, then each category's net over the steps after it: the live
curve is exact at every event it has, and its maximum is the generation's peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._options import CATEGORY_CODE, PHASE_CODE, Category, Phase
from ._table import N_CATEGORIES, sum_by

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


def _step_after(
    events: StepEvents, starts: tuple[int, ...], new_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes and categories of the events of step ``new_tokens``, the one after a generation
    of ``new_tokens`` tokens: recorded, or the pattern's (the last recorded step's where
    the recorded steps follow none)."""
    recorded = len(starts) - 1
    k = min(new_tokens, recorded - 1)
    lo, hi = starts[k], starts[k + 1]
    step = events.nbytes[lo:hi]
    if new_tokens >= recorded:
        try:
            last, slope = decode_pattern(events, starts)
            step = last + (new_tokens - recorded + 1) * slope
        except DecodePatternError:
            pass
    return step, events.category[lo:hi]


def unroll(
    events: StepEvents, starts: tuple[int, ...], new_tokens: int, batch_size: int
) -> tuple[StepEvents, Generation]:
    """The events of a generation of ``new_tokens`` tokens (the prefill makes the first; each
    further one is a decode step) from a recorded one whose forwards start at ``starts``
    (the last entry: where the recording ends), at one batch size and prompt length."""
    out = _unrolled(events, starts, new_tokens)
    kv = int(out.nbytes[out.category == _KV].sum())
    after, category = _step_after(events, starts, new_tokens)
    per_token = int(after[category == _KV].sum()) // batch_size
    return out, Generation(new_tokens, kv, per_token)


def _unrolled(events: StepEvents, starts: tuple[int, ...], new_tokens: int) -> StepEvents:
    recorded = len(starts) - 1  # forwards recorded: the prefill, then decode steps
    if new_tokens <= recorded:  # the recorded steps, cut where step new_tokens starts
        return StepEvents(
            *_slice(events, 0, starts[new_tokens]),
            step_at=np.asarray([0, *starts[1:new_tokens]], dtype=np.int64),
            step_number=np.arange(new_tokens, dtype=np.int64),
        )
    last, slope = decode_pattern(events, starts)
    lo, hi = starts[-2], starts[-1]
    _, module, phase, category, op = _slice(events, lo, hi)
    n_more = new_tokens - recorded  # extrapolated steps m = 1..n_more
    base = _slice(events, 0, hi)
    live_end = int(base[0].sum())  # after the recorded steps (residents aside)
    total, growth = int(last.sum()), int(slope.sum())
    prefix, prefix_growth = np.cumsum(last), np.cumsum(slope)

    def peak_of(m: np.ndarray) -> np.ndarray:
        """Live bytes (residents aside) at the peak of extrapolated step ``m``."""
        start = live_end + (m - 1) * total + growth * (m - 1) * m // 2
        inner = (prefix[None, :] + m[:, None] * prefix_growth[None, :]).max(axis=1)
        return start + np.maximum(inner, 0)

    if growth >= 0:  # convex in m: the peak is at an end
        candidates = np.unique(np.asarray([1, n_more], dtype=np.int64))
        peaks = peak_of(candidates)
    else:  # a shrinking step (not seen in practice): every step, in chunks
        candidates = np.arange(1, n_more + 1, dtype=np.int64)
        peaks = np.concatenate(
            [peak_of(chunk) for chunk in np.array_split(candidates, max(1, n_more // 256))]
        )
    best = int(candidates[int(np.argmax(peaks))])

    parts = [list(base)]
    step_at = [0, *starts[1:recorded]]
    step_number = list(range(recorded))
    size = hi

    def add_nets(m1: int, m2: int) -> None:
        nonlocal size
        if m2 < m1:
            return
        codes, nets = _category_nets(category, last, slope, m1, m2)
        n = len(nets)
        parts.append(
            [
                nets,
                np.zeros(n, np.int32),
                np.full(n, _DECODE, np.int8),
                codes.astype(np.int8),
                np.full(n, -1, np.int32),
            ]
        )
        step_at.append(size)
        step_number.append(recorded + m2 - 1)  # the steps' end: the last of them
        size += n

    add_nets(1, best - 1)
    parts.append([last + best * slope, module, phase, category, op])
    step_at.append(size)
    step_number.append(recorded + best - 1)
    size += len(last)
    add_nets(best + 1, n_more)
    nbytes, module_, phase_, category_, op_ = (
        np.concatenate([p[i] for p in parts]) for i in range(5)
    )
    return StepEvents(
        nbytes,
        module_,
        phase_,
        category_,
        op_,
        step_at=np.asarray(step_at, dtype=np.int64),
        step_number=np.asarray(step_number, dtype=np.int64),
    )


def check_window(prompt_len: int, new_tokens: int, recorded: int, window: int | None) -> None:
    """Refuse a generation whose extrapolated decode steps cross the model's sliding window
    (``config.sliding_window``): there a sliding layer's cache stops growing and its mask
    appears, so the steps before and after follow two patterns, and one recorded run holds
    only one. ``recorded``: the forwards recorded (the prefill and the decode steps). Steps
    the run recorded are exact whatever the window, and so are extrapolated ones on the
    pattern's side of it (a prompt past the window, or a generation that ends before it)."""
    if window is None or new_tokens <= recorded:
        return
    first = prompt_len + recorded - 4  # the key length before the first step of the pattern
    last = prompt_len + new_tokens  # ... and after the last step generated
    # measured on Mistral and Qwen2 (window 24): steps are of one pattern from a key length
    # of the window on, and up to two below it
    if first < window and last > window - 2:
        raise ValueError(
            f"a generation of {new_tokens} tokens after a prompt of {prompt_len} crosses the "
            f"model's sliding window of {window} tokens (config.sliding_window), where its "
            "cache stops growing: not estimated yet. Estimates hold up to "
            f"prompt + new_tokens = {window - 2}, or for a prompt of {window + 4 - recorded} "
            "tokens or more"
        )


def generation_flops(counted: np.ndarray, new_tokens: int) -> np.ndarray:
    """FLOPs per row of a generation of ``new_tokens`` tokens, from the FLOPs per row counted
    before each recorded forward and at the end (``counted``: steps + 1 x rows). A decode
    step's FLOPs grow by the same amount each step (attention over one more key), checked
    on the recorded steps as their memory is."""
    steps = np.diff(counted, axis=0)  # the prefill (with generate's set-up), then each decode
    recorded = len(steps)
    if new_tokens <= recorded:
        return counted[new_tokens]
    slope = steps[-1] - steps[-2]
    if not np.array_equal(steps[-2] - steps[-3], slope):
        raise DecodePatternError("the recorded decode steps' FLOPs do not grow by one amount")
    n_more = new_tokens - recorded
    return counted[-1] + n_more * steps[-1] + slope * (n_more * (n_more + 1) // 2)


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
