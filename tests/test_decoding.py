"""Decode steps unrolled from a recorded generation (``_decoding``), on hand-made events."""

from __future__ import annotations

import numpy as np
import pytest

from vram_widget._decoding import (
    DecodePatternError,
    StepEvents,
    check_generation,
    check_window,
    generation_flops,
    step_of,
    unroll,
)
from vram_widget._options import CATEGORY_CODE, PHASE_CODE, Category, Phase

KV = CATEGORY_CODE[Category.KV_CACHE]
TMP = CATEGORY_CODE[Category.TEMPORARY]


def _decode_step(k: int) -> list[tuple[int, int]]:
    """Decode step k of a toy model at batch 1 whose cache holds 7 + k tokens of 10 bytes
    before the step (8 after the prefill): the cache concatenated with one more token (a new
    cache of 10 * (8 + k) bytes, then the old one freed), a score row of 4 bytes per key, a
    logits copy of 40."""
    old, new = 10 * (7 + k), 10 * (8 + k)
    return [(new, KV), (-old, KV), (4 * (8 + k), TMP), (-4 * (8 + k), TMP), (40, TMP), (-40, TMP)]


def _recorded(steps: int = 4) -> tuple[StepEvents, tuple[int, ...]]:
    """Set-up (a 16-byte mask), a prefill that leaves a cache of 80 bytes behind a 200-byte
    activation, then decode steps 1..steps."""
    events: list[tuple[int, int]] = [(16, TMP)]
    starts = [len(events)]
    events += [(200, TMP), (80, KV), (-200, TMP)]
    for k in range(1, steps + 1):
        starts.append(len(events))
        events += _decode_step(k)
    starts.append(len(events))
    n = len(events)
    recorded = StepEvents(
        nbytes=np.asarray([b for b, _c in events], np.int64),
        module=np.zeros(n, np.int32),
        phase=np.full(n, PHASE_CODE[Phase.DECODE], np.int8),
        category=np.asarray([c for _b, c in events], np.int8),
        op=np.full(n, -1, np.int32),
        step_at=np.zeros(0, np.int64),
        step_number=np.zeros(0, np.int64),
    )
    return recorded, tuple(starts)


def _brute_peak(new_tokens: int) -> tuple[int, int]:
    """Peak live bytes and the step it falls in, every step written out."""
    events: list[int] = [16, 200, 80, -200]
    step: list[int] = [0, 0, 0, 0]
    for k in range(1, new_tokens):
        part = [b for b, _c in _decode_step(k)]
        events += part
        step += [k] * len(part)
    live = np.cumsum(events)
    at = int(np.argmax(live))
    return int(live[at]), step[at]


@pytest.mark.parametrize("new_tokens", [1, 2, 5, 6, 7, 40, 1000])
def test_unrolled_peak_is_every_step_written_out(new_tokens: int) -> None:
    recorded, starts = _recorded()
    out, gen = unroll(recorded, starts, new_tokens, batch_size=1)
    live = np.cumsum(out.nbytes)
    at = int(np.argmax(live))
    assert (int(live[at]), step_of(out, at)) == _brute_peak(new_tokens)
    # the cache after the last step: 80 bytes after the prefill, 10 per decode step
    assert gen.kv_cache_bytes == 80 + 10 * (new_tokens - 1)
    assert gen.kv_cache_bytes_per_token == 10
    # the unrolled events add up to where the last step ends
    assert int(live[-1]) == 16 + 80 + 10 * (new_tokens - 1)


def test_a_long_generation_peaks_at_its_last_step() -> None:
    # the peak of decode step k is the mask, the cache and its concatenated copy:
    # 16 + 10 (7 + k) + 10 (8 + k) = 166 + 20 k, above the prefill's 16 + 200 + 80 = 296
    # from k = 7 on
    recorded, starts = _recorded()
    out, _gen = unroll(recorded, starts, 1000, batch_size=1)
    live = np.cumsum(out.nbytes)
    assert int(live.max()) == 166 + 20 * 999
    assert step_of(out, int(np.argmax(live))) == 999
    assert len(out.nbytes) < 60  # 1000 steps without 6000 events


def test_a_step_that_breaks_the_pattern_is_refused() -> None:
    recorded, starts = _recorded()
    bad = recorded.nbytes.copy()
    bad[starts[2]] += 8  # decode step 2 grows its cache by 8 more than step 3 does
    broken = StepEvents(
        bad, recorded.module, recorded.phase, recorded.category, recorded.op,
        recorded.step_at, recorded.step_number,
    )  # fmt: skip
    with pytest.raises(DecodePatternError, match="do not grow by the same amount"):
        unroll(broken, starts, 9, batch_size=1)
    out, _gen = unroll(broken, starts, 5, batch_size=1)  # the recorded steps themselves
    assert int(out.nbytes.sum()) == int(bad[: starts[5]].sum())


def test_generation_flops_sum_the_decode_steps() -> None:
    # set-up 0; prefill 100 FLOPs; decode step k: 10 + 2 k (attention over one more key)
    per_step = [100, 12, 14, 16, 18]
    counted = np.cumsum([[0], *[[f] for f in per_step]], axis=0)
    assert generation_flops(counted, 3)[0] == 100 + 12 + 14
    # 9 tokens: the prefill and decode steps 1..8 = 100 + sum(10 + 2k) = 100 + 80 + 72
    assert generation_flops(counted, 9)[0] == 252
    with pytest.raises(DecodePatternError):
        generation_flops(np.cumsum([[0], [100], [12], [14], [17], [18]], axis=0), 9)


def test_window_crossing_is_refused_where_extrapolated() -> None:
    # window 24, 5 forwards recorded: below it up to prompt + new tokens = 22, above it from
    # a prompt of 23 (the pattern's first key length, prompt + 1, at the window)
    check_window(10, 12, 5, 24)
    check_window(23, 500, 5, 24)
    check_window(20, 5, 5, 24)  # recorded, not extrapolated
    check_window(16, 500, 5, None)
    for prompt, tokens in ((10, 13), (22, 20)):
        with pytest.raises(ValueError, match="crosses the model's sliding window of 24"):
            check_window(prompt, tokens, 5, 24)


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
