"""Decode steps unrolled from a recorded generation (``decoding``), on hand-made events."""

from __future__ import annotations

import numpy as np
import pytest

from vram_widget._estimating.decoding import (
    DECODE_STEPS_ACROSS_WINDOW,
    DECODE_STEPS_PROFILED,
    PROMPT_BEFORE_WINDOW,
    DecodePatternError,
    Recording,
    StepEvents,
    check_generation,
    crosses_window,
    step_of,
    unroll,
)
from vram_widget._estimating.options import CATEGORY_CODE, PHASE_CODE, Category, Phase

KV = CATEGORY_CODE[Category.KV_CACHE]
TMP = CATEGORY_CODE[Category.TEMPORARY]
WINDOW = 24


def _prefill(prompt: int, window: int | None) -> list[tuple[int, int]]:
    """A 16-byte mask (generate's set-up is step 0's), a 200-byte activation, and a cache of
    10 bytes per token it keeps (at most ``window`` tokens)."""
    kept = prompt if window is None else min(prompt, window)
    return [(16, TMP), (200, TMP), (10 * kept, KV), (-200, TMP)]


def _decode_step(keys: int, window: int | None) -> list[tuple[int, int]]:
    """A toy decode step with ``keys`` keys: the cache of ``keys - 1`` tokens of 10 bytes
    concatenated with one more (the new cache, then the old one freed; a sliding window keeps
    ``window`` tokens at most), a score row of 4 bytes per key it attends to, a logits copy
    of 40."""
    old, new = keys - 1, keys
    if window is not None:
        old, new = min(old, window), min(new, window)
    seen = new
    return [
        (10 * new, KV),
        (-10 * old, KV),
        (4 * seen, TMP),
        (-4 * seen, TMP),
        (40, TMP),
        (-40, TMP),
    ]


def _flops(keys: int, window: int | None) -> int:
    """A decode step's FLOPs: 10, and 2 per key attended to."""
    return 10 + 2 * (keys if window is None else min(keys, window))


def _recording(prompt: int, steps: int, window: int | None = None) -> Recording:
    """The prefill at ``prompt`` tokens (100 FLOPs), then decode steps 1..steps (step k
    with ``prompt + k`` keys)."""
    events = _prefill(prompt, window)
    starts, flops = [1], [0, 100]  # the mask is the set-up, before the prefill's forward
    for k in range(1, steps + 1):
        starts.append(len(events))
        events += _decode_step(prompt + k, window)
        flops.append(_flops(prompt + k, window))
    starts.append(len(events))
    n = len(events)
    recorded = StepEvents(
        nbytes=np.asarray([b for b, _c in events], np.int64),
        module=np.zeros(n, np.int32),
        phase=np.full(n, PHASE_CODE[Phase.DECODE], np.int8),
        category=np.asarray([c for _b, c in events], np.int8),
        op=np.full(n, -1, np.int32),
    )
    counted = np.cumsum(flops)[:, None]  # one row
    return Recording(recorded, tuple(starts), prompt, counted)


def _written_out(prompt: int, new_tokens: int, window: int | None = None) -> tuple[int, int, int]:
    """Peak live bytes, the step it falls in and the FLOPs, every step written out."""
    events = [b for b, _c in _prefill(prompt, window)]
    step = [0] * len(events)
    flops = 100
    for k in range(1, new_tokens):
        part = [b for b, _c in _decode_step(prompt + k, window)]
        events += part
        step += [k] * len(part)
        flops += _flops(prompt + k, window)
    live = np.cumsum(events)
    at = int(np.argmax(live))
    return int(live[at]), step[at], flops


def _peak(out: StepEvents) -> tuple[int, int]:
    live = np.cumsum(out.nbytes)
    at = int(np.argmax(live))
    return int(live[at]), step_of(out, at)


@pytest.mark.parametrize("new_tokens", [1, 2, 5, 6, 7, 40, 1000])
def test_unrolled_peak_is_every_step_written_out(new_tokens: int) -> None:
    run = _recording(8, DECODE_STEPS_PROFILED)
    out, gen, flops = unroll(run, new_tokens, batch_size=1)
    peak, step, expected_flops = _written_out(8, new_tokens)
    assert _peak(out) == (peak, step)
    assert int(flops[0]) == expected_flops
    # the cache after the last step: 80 bytes after the prefill, 10 per decode step
    assert gen.kv_cache_bytes == 80 + 10 * (new_tokens - 1)
    assert gen.kv_cache_bytes_per_token == 10
    # the unrolled events add up to where the last step ends
    assert int(out.nbytes.sum()) == 16 + 80 + 10 * (new_tokens - 1)


def test_a_long_generation_peaks_at_its_last_step() -> None:
    # the peak of decode step k is the mask, the cache and its concatenated copy:
    # 16 + 10 (7 + k) + 10 (8 + k) = 166 + 20 k, above the prefill's 16 + 200 + 80 = 296
    # from k = 7 on
    out, _gen, _flops = unroll(_recording(8, DECODE_STEPS_PROFILED), 1000, batch_size=1)
    assert _peak(out) == (166 + 20 * 999, 999)
    assert len(out.nbytes) < 60  # 1000 steps without 6000 events


@pytest.mark.parametrize(("prompt", "new_tokens"), [(4, 50), (10, 40), (16, 30), (17, 9), (2, 30)])
def test_a_sliding_window_is_crossed_as_every_step_written_out(
    prompt: int, new_tokens: int
) -> None:
    # the prompt's own run below the window, a run across it at a prompt of 24 - 5, and the
    # steps written out one by one agree on the peak, its step, the cache and the FLOPs
    assert crosses_window(prompt, new_tokens, DECODE_STEPS_PROFILED + 1, WINDOW)
    run = _recording(prompt, DECODE_STEPS_PROFILED, WINDOW)
    across = _recording(WINDOW - PROMPT_BEFORE_WINDOW, DECODE_STEPS_ACROSS_WINDOW, WINDOW)
    out, gen, flops = unroll(run, new_tokens, batch_size=1, across=across)
    peak, step, expected_flops = _written_out(prompt, new_tokens, WINDOW)
    assert _peak(out) == (peak, step)
    assert int(flops[0]) == expected_flops
    assert gen.kv_cache_bytes == 10 * min(prompt + new_tokens - 1, WINDOW)
    assert gen.kv_cache_bytes_per_token == (0 if prompt + new_tokens >= WINDOW else 10)
    # the run at the prompt alone cannot cross it: its pattern would keep growing
    alone, _gen, _flops = unroll(run, new_tokens, batch_size=1)
    assert _peak(alone)[0] > peak


def test_runs_that_disagree_below_the_window_are_refused() -> None:
    run = _recording(4, DECODE_STEPS_PROFILED, WINDOW)
    across = _recording(WINDOW - PROMPT_BEFORE_WINDOW, DECODE_STEPS_ACROSS_WINDOW, WINDOW)
    nbytes = across.events.nbytes.copy()
    nbytes[across.starts[2]] += 10  # its step at W - 3 keys is not the prompt run's
    events = StepEvents(
        nbytes, across.events.module, across.events.phase, across.events.category,
        across.events.op,
    )  # fmt: skip
    changed = Recording(events, across.starts, across.prompt_len, across.flops)
    with pytest.raises(DecodePatternError, match="before the window differs"):
        unroll(run, 50, batch_size=1, across=changed)


def test_a_step_that_breaks_the_pattern_is_refused() -> None:
    run = _recording(8, DECODE_STEPS_PROFILED)
    bad = run.events.nbytes.copy()
    bad[run.starts[2]] += 8  # decode step 2 grows its cache by 8 more than step 3 does
    events = StepEvents(
        bad, run.events.module, run.events.phase, run.events.category, run.events.op
    )
    broken = Recording(events, run.starts, run.prompt_len, run.flops)
    with pytest.raises(DecodePatternError, match="do not grow by the same amount"):
        unroll(broken, 9, batch_size=1)
    out, _gen, _flops = unroll(broken, 5, batch_size=1)  # the recorded steps themselves
    assert int(out.nbytes.sum()) == int(bad[: run.starts[5]].sum())


def test_window_crossing_is_told_apart() -> None:
    # window 24, 5 forwards recorded: below it up to prompt + new tokens = 22, above it from
    # a prompt of 23 (the pattern's first key length, prompt + 2, past the window)
    assert not crosses_window(10, 12, 5, 24)
    assert not crosses_window(23, 500, 5, 24)
    assert not crosses_window(20, 5, 5, 24)  # recorded, not extrapolated
    assert not crosses_window(16, 500, 5, None)
    assert crosses_window(10, 13, 5, 24) and crosses_window(22, 20, 5, 24)


@pytest.mark.parametrize(
    ("generates", "tokens", "message"),
    [
        (True, 0, "needs new_tokens, an int >= 1"),
        (True, 2.0, "needs new_tokens, an int >= 1"),
        (False, 4, "needs a model that generates with a cache .* Net has none"),
        (True, 60, "60 is 76 positions, beyond the model's limit of 64"),
    ],
)
def test_generation_settings_name_the_problem(
    generates: bool, tokens: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_generation("Net", generates, 64, 16, tokens)
    assert check_generation("Net", True, 64, 16, 48) == 48


def test_growth_per_token_past_a_shrinking_step() -> None:
    # a quantized cache's flush: the prefill keeps 100 B, decode steps 1-3 add a 10-byte
    # token each to the residual, step 4 quantizes the 30 residual bytes into 5 (-25). The
    # steps follow no pattern, so one more token adds what the last step that did not
    # shrink the cache added: 10 B, 5 a sequence at batch 2
    events = [(16, TMP), (100, KV), (10, KV), (10, KV), (10, KV), (-25, KV)]
    n = len(events)
    recorded = StepEvents(
        nbytes=np.asarray([b for b, _c in events], np.int64),
        module=np.zeros(n, np.int32),
        phase=np.full(n, PHASE_CODE[Phase.DECODE], np.int8),
        category=np.asarray([c for _b, c in events], np.int8),
        op=np.full(n, -1, np.int32),
    )
    run = Recording(recorded, (1, 2, 3, 4, 5, 6), 8, np.zeros((6, 1), np.int64))
    _out, generation, _flops = unroll(run, 5, batch_size=2)
    assert generation.kv_cache_bytes == 100 + 3 * 10 - 25
    assert generation.kv_cache_bytes_per_token == 10 // 2
    with pytest.raises(DecodePatternError, match="do not grow by the same amount"):
        unroll(run, 6, batch_size=2)
