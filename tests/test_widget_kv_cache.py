"""The widget's KV-cache control (``widget_kv_cache``): one dropdown over the ``kv_cache`` and
``kv_bits`` traits, shown in mode "generate"; every number shown is the profile's estimate at
the traits, and a setting the estimate refuses keeps the last one, saying why."""

from __future__ import annotations

import pytest
import torch

from vram_widget import Recipe, show_memory
from vram_widget._display import widget as widget_module
from vram_widget._display.figures import TRACE_NAMES

pytest.importorskip("transformers")
pytest.importorskip("optimum.quanto")

PEAK = TRACE_NAMES.index("peak")


def test_kv_cache_dropdown_drives_the_estimate() -> None:
    from tests.models import hf_gpt2

    torch.manual_seed(0)
    prompt = {"input_ids": torch.zeros(1, 16, dtype=torch.long)}
    # a Recipe's quantized cache starts the control; its residual_length is held fixed
    recipe = Recipe.from_keywords(
        mode="generate", new_tokens=8, kv_cache="quantized", kv_bits=2, residual_length=8
    )
    w = show_memory(hf_gpt2(), inputs=prompt, device="cpu", recipe=recipe, batch_size=1)
    profile = w.profile
    dropdown = w._kv_cache_dropdown
    assert dropdown in w._generation_row.children and w._generation_row.layout.display is None
    assert (w.kv_cache, w.kv_bits, dropdown.value) == ("quantized", 2, "quantized-2")
    # tiny GPT-2 (2 layers x keys and values x 4 heads x 16 dims), prompt 16, fp32, 2 bits:
    # each of the 4 tensors' 1,024 values in 16 groups of 64, packed 4 a byte (256 B) with
    # 16 float32 scales and 16 shifts (64 + 64 B): 384 x 4 = 1,536; the residual of the 7
    # decode steps' tokens: 7 x 4 x 64 x 4 B = 7,168
    assert w.estimate.kv_cache_bytes == 1536 + 7168
    asked = dict(mode="generate", new_tokens=8, kv_cache="quantized", residual_length=8)
    assert w.figure.data[PEAK].y[0] == profile.estimate(1, kv_bits=2, **asked).peak_bytes
    # a generation across the flush past what is recorded step by step (40 new tokens,
    # residual 8; kv_cache.DECODE_STEPS_ACROSS_FLUSH_MAX) is refused by name: kept
    w.new_tokens = 40
    assert w.new_tokens == 8
    assert "new_tokens=40 crosses that flush" in w._status.value
    # the model's own cache: the recipe's residual_length waits with the quantized cache
    dropdown.value = "own"
    assert (w.kv_cache, w.estimate.kv_cache_bytes) == (None, (16 + 7) * 4 * 64 * 4)
    assert "profiled fp32 / generate / 16 tokens + 8 new in" in w._status.value
    w.new_tokens = 40
    dropdown.value = "quantized-4"  # 40 new tokens cross the flush: refused, kept
    assert (w.kv_cache, dropdown.value, w.new_tokens) == (None, "own", 40)
    assert "new_tokens=40 crosses that flush" in w._status.value
    w.new_tokens = 8
    dropdown.value = "quantized-4"  # profiles the 4-bit copy once, behind the label
    assert (w.kv_cache, w.kv_bits) == ("quantized", 4)
    shown = "profiled fp32 / generate / 16 tokens + 8 new / KV cache quantized 4-bit"
    assert shown in w._status.value
    # 4 bits: 512 + 64 + 64 B a tensor, x 4 = 2,560, and the same residual
    assert w.estimate.kv_cache_bytes == 2560 + 7168
    assert w.figure.data[PEAK].y[0] == profile.estimate(1, kv_bits=4, **asked).peak_bytes
    # outside mode generate the row is hidden and the cache waits
    w.mode = "inference"
    assert w._generation_row.layout.display == "none"
    assert w.estimate.kv_cache_bytes is None and w._status.value == ""


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"kv_bits": 3}, r"kv_bits=3: the quantized KV cache \(quanto backend\) takes 2 or 4"),
        ({"kv_cache": "int8"}, r"kv_cache='int8': valid values are None .* or 'quantized'"),
    ],
)
def test_bad_kv_cache_settings_refused_before_profiling(
    monkeypatch: pytest.MonkeyPatch, setting: dict[str, object], message: str
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled before refusing")

    monkeypatch.setattr("vram_widget._profiling.profiler.profile_model", refuse)
    with pytest.raises(ValueError, match=message):
        show_memory(torch.nn.Linear(2, 2), input_size=(2,), device="cpu", **setting)
    assert widget_module.MemoryWidget.class_traits()["kv_bits"].default_value == 4
