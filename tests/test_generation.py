"""The generation pass (``generation``) and ``estimate(mode="generate")``, checked against
Hugging Face's own ``model.generate`` run for real by ``measure``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.models import (
    HF_VOCAB,
    assert_model_unchanged,
    hf_gpt2,
    hf_llama,
    hf_mistral,
    hf_mixtral,
    hf_t5,
    snapshot_model,
)
from vram_widget import ModelProfile, measure, profile_model, zoo
from vram_widget._estimating.options import Phase

pytest.importorskip("transformers")


def _prompts(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, HF_VOCAB, (batch, length), generator=gen)}


def _model(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make()


@pytest.fixture(scope="module")
def gpt2() -> tuple[nn.Module, ModelProfile]:
    """GPT-2 (seeded) and its CPU profile at 2 x 16 prompt tokens, shared by the tests that
    only estimate from it (and measure its copy): one profile, many generation settings."""
    model = _model(hf_gpt2)
    return model, profile_model(model, inputs=_prompts(2, 16), device="cpu")


@pytest.fixture(scope="module")
def mistral() -> tuple[nn.Module, ModelProfile]:
    """Mistral with a window of 24 (seeded) and its CPU profile at 2 x 16 prompt tokens,
    shared by the two sliding-window tests: one profile, its generation runs kept."""
    model = _model(hf_mistral)
    return model, profile_model(model, inputs=_prompts(2, 16), device="cpu")


# (batch, prompt, new tokens): within the 5 recorded forwards, and past them (extrapolated)
SETTINGS = [(2, 16, 3), (1, 9, 20), (3, 30, 12), (4, 7, 40)]


# slow: T5 (an encoder-decoder, the longest), left to the first CI pass
@pytest.mark.parametrize(
    "make",
    [hf_gpt2, hf_llama, pytest.param(hf_t5, marks=pytest.mark.slow), hf_mixtral],
    ids=lambda f: f.__name__,
)
def test_generate_estimate_is_the_real_generate_to_the_byte(make: Callable[[], nn.Module]) -> None:
    # GPT-2 (learned positions), Llama (grouped-query attention), T5 (encoder-decoder, a
    # cache of self- and cross-attention) and Mixtral (a mixture of experts): every peak
    # of a generation estimated from one profile at 16 tokens, at other prompt lengths,
    # batches and new tokens, is the peak measured in Hugging Face's model.generate
    model = _model(make)
    example = {**_prompts(2, 16), "labels": _prompts(2, 16, seed=1)["input_ids"]}
    profile = profile_model(model, inputs=example, device="cpu")
    for batch, prompt, tokens in SETTINGS:
        est = profile.estimate(batch, mode="generate", seq_len=prompt, new_tokens=tokens)
        real = measure(model, _prompts(batch, prompt), mode="generate", new_tokens=tokens)
        assert est.peak_bytes == real.peak_bytes, (batch, prompt, tokens)
        assert est.new_tokens == tokens


def test_kv_cache_by_hand(gpt2: tuple[nn.Module, ModelProfile]) -> None:
    # GPT-2 of 2 layers of 64 in fp32: keys and values are 2 x 2 x 64 x 4 B = 1,024 B per
    # token; after 8 new tokens on a prompt of 16 the cache holds 16 + 7 tokens (the last
    # token generated is never fed back), x 2 sequences = 47,104 B
    _, profile = gpt2
    est = profile.estimate(2, mode="generate", new_tokens=8)
    assert (est.kv_cache_bytes, est.kv_cache_bytes_per_token) == (2 * 23 * 1024, 1024)
    assert est.peak_breakdown["KV cache"] <= est.kv_cache_bytes
    # Llama's grouped-query attention caches 2 key/value heads of 16, not 4: 512 B per token
    llama = profile_model(_model(hf_llama), inputs=_prompts(2, 16), device="cpu")
    assert llama.estimate(2, mode="generate", new_tokens=8).kv_cache_bytes_per_token == 512
    # bf16 halves it
    assert llama.estimate(2, "bf16", mode="generate", new_tokens=8).kv_cache_bytes_per_token == 256
    # the other modes have no cache
    assert profile.estimate(2, mode="inference").kv_cache_bytes is None
    # cached: a generation at another batch and token count runs nothing more, whatever
    # the optimizer (there is none in generation)
    assert profile.is_cached("fp32", "generate", "sgd")  # no SGD step was ever traced
    assert profile.is_cached("fp32", "generate", new_tokens=40)  # GPT-2 has no window


def test_the_peak_says_which_step(gpt2: tuple[nn.Module, ModelProfile]) -> None:
    # a long prompt and few tokens peak in the prefill; a short prompt and many tokens at the
    # last decode step, where the cache is longest
    _, profile = gpt2
    prefill = profile.estimate(4, mode="generate", seq_len=40, new_tokens=2)
    assert (prefill.peak_phase, prefill.peak_step) == (Phase.PREFILL, 0)
    assert prefill.peak_location.endswith("prefill")
    late = profile.estimate(1, mode="generate", seq_len=4, new_tokens=50)
    assert (late.peak_phase, late.peak_step) == (Phase.DECODE, 49)
    assert late.peak_location.endswith("decode step 49")


@pytest.mark.parametrize(("batch", "prompt", "tokens"), [(2, 16, 3), (2, 16, 12), (1, 9, 20)])
def test_flops_are_torch_s_count_of_the_real_generate(
    batch: int, prompt: int, tokens: int, gpt2: tuple[nn.Module, ModelProfile]
) -> None:
    # the prefill's and every decode step's FLOPs, the later steps extrapolated, against
    # torch's own FlopCounterMode around Hugging Face's generate (GPT-2: matmuls only)
    from torch.utils.flop_counter import FlopCounterMode

    model, profile = gpt2
    est = profile.estimate(batch, mode="generate", seq_len=prompt, new_tokens=tokens)
    ids = _prompts(batch, prompt)["input_ids"]
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.generate(ids, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)
    assert (est.flops_forward, est.flops_backward) == (counter.get_total_flops(), 0)


def test_a_sliding_window_is_estimated_on_either_side_and_across(
    mistral: tuple[nn.Module, ModelProfile],
) -> None:
    # Mistral with a window of 24: steps that end before the window, steps past it (the cache
    # stops growing) and generations across it (one more run, at a prompt of 19 with 9
    # decode steps, joined to the prompt's own run) are each the real generate's peak
    model, profile = mistral
    for batch, prompt, tokens in [(2, 10, 12), (2, 23, 20), (1, 30, 40), (1, 4, 50), (3, 2, 60)]:
        est = profile.estimate(batch, mode="generate", seq_len=prompt, new_tokens=tokens)
        real = measure(model, _prompts(batch, prompt), mode="generate", new_tokens=tokens)
        assert est.peak_bytes == real.peak_bytes, (batch, prompt, tokens)
    across = profile.estimate(1, mode="generate", seq_len=4, new_tokens=50)
    assert across.peak_step == 49  # the last decode step, with the full window of keys
    # the window is full: it slides; the cache holds 24 tokens of 2 layers x k, v x 32 x 4 B,
    # and each layer its window as an int64 tensor (DynamicSlidingWindowLayer's
    # _sliding_window_tensor, transformers/cache_utils.py)
    assert (across.kv_cache_bytes_per_token, across.kv_cache_bytes) == (0, 24 * 512 + 2 * 8)


def test_flops_across_a_window_are_its_attention(mistral: tuple[nn.Module, ModelProfile]) -> None:
    # torch's FlopCounterMode counts the matmuls of the real generate, not its CPU attention
    # kernel; ours counts both. The difference is attention by hand: 2 layers x (QK and PV)
    # x 2 FLOPs x 4 heads x 16 dims = 512 per query and key: the prefill's 16 x 16, then
    # decode step k over min(16 + k, 24) keys (the window): 17..24 for k = 1..8, then 24
    from torch.utils.flop_counter import FlopCounterMode

    model, profile = mistral
    est = profile.estimate(1, mode="generate", seq_len=16, new_tokens=30)
    ids = _prompts(1, 16)["input_ids"]
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.generate(ids, do_sample=False, max_new_tokens=30, min_new_tokens=30)
    keys = 16 * 16 + sum(min(16 + k, 24) for k in range(1, 30))
    assert est.flops_forward - counter.get_total_flops() == 512 * keys


def test_max_batch_size_counts_concurrent_sequences(gpt2: tuple[nn.Module, ModelProfile]) -> None:
    _, profile = gpt2
    settings = {"mode": "generate", "seq_len": 30, "new_tokens": 30}
    capacity = 3 * 2**20
    n = profile.max_batch_size(capacity, **settings)  # type: ignore[arg-type]
    assert n > 1
    assert profile.estimate(n, **settings).fits(capacity)  # type: ignore[arg-type]
    assert not profile.estimate(n + 1, **settings).fits(capacity)  # type: ignore[arg-type]
    # the longest prompt that 30 more tokens fit after: at n sequences, the 30 they were
    # sized at (or a little more); for one sequence, GPT-2's 64 positions less the 30
    longest = profile.max_seq_len(capacity, n, mode="generate", new_tokens=30)
    assert 30 <= longest < 34
    assert profile.estimate(n, mode="generate", seq_len=longest, new_tokens=30).fits(capacity)
    beyond = profile.estimate(n, mode="generate", seq_len=longest + 1, new_tokens=30)
    assert not beyond.fits(capacity)
    assert profile.max_seq_len(capacity, 1, mode="generate", new_tokens=30) == 64 - 30


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "generate"}, r"needs new_tokens, an int >= 1 .* got None"),
        ({"mode": "generate", "new_tokens": 0}, r"needs new_tokens, an int >= 1"),
        ({"mode": "inference", "new_tokens": 4}, "new_tokens is for mode='generate'"),
        ({"mode": "generate", "new_tokens": 49}, r"16 tokens plus .* 65 positions, beyond .* 64"),
    ],
)
def test_generate_bad_settings_name_the_problem(
    kwargs: dict[str, object], message: str, gpt2: tuple[nn.Module, ModelProfile]
) -> None:
    _, profile = gpt2
    with pytest.raises(ValueError, match=message):
        profile.estimate(2, **kwargs)  # type: ignore[arg-type]


def test_a_model_without_a_cache_or_with_another_one_is_refused() -> None:
    mlp = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu")
    no_cache = r"needs a model that generates with a cache .* Sequential has none"
    with pytest.raises(ValueError, match=no_cache):
        mlp.estimate(2, mode="generate", new_tokens=4)
    model = _model(hf_gpt2)
    model.generation_config.cache_implementation = "offloaded"
    profile = profile_model(model, inputs=_prompts(2, 16), device="cpu")
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not estimated"):
        profile.estimate(2, mode="generate", new_tokens=4)
    # transformers' QuantizedCache, as generate reads it from the generation config: a
    # generation across its flush (residual_length 8) past 33 new tokens is not estimated
    # (the ones within it, and shorter ones across it, are: test_quantized_cache.py)
    model.generation_config.cache_implementation = "quantized"
    model.generation_config.cache_config = {"backend": "quanto", "nbits": 4, "residual_length": 8}
    profile = profile_model(model, inputs=_prompts(2, 16), device="cpu")
    with pytest.raises(ValueError, match=r"new_tokens=34 crosses that flush.*<= 33"):
        profile.estimate(2, mode="generate", new_tokens=34)
    assert not profile.is_cached("fp32", "inference")  # refused before any profiling


@pytest.mark.parametrize("make", [hf_gpt2, hf_llama], ids=lambda f: f.__name__)
def test_a_static_cache_is_the_real_generate_to_the_byte(make: Callable[[], nn.Module]) -> None:
    # generation_config.cache_implementation = "static": generate allocates the cache for
    # the prompt and every new token before the first step, so the generation is recorded
    # at 8, 16 and 24 new tokens (a line in them, checked) and any other count is numpy
    model = _model(make)
    model.generation_config.cache_implementation = "static"
    before = snapshot_model(model)
    profile = profile_model(model, inputs=_prompts(2, 16), device="cpu")
    for batch, prompt, tokens in [(2, 16, 3), (2, 16, 6), (3, 16, 40), (1, 16, 47)]:
        est = profile.estimate(batch, mode="generate", seq_len=prompt, new_tokens=tokens)
        real = measure(model, _prompts(batch, prompt), mode="generate", new_tokens=tokens)
        assert est.peak_bytes == real.peak_bytes, (batch, prompt, tokens)
    # the whole cache from the start: 2 layers x k, v x (16 + 40 - 1) positions x 3
    # sequences, and each layer's int64 position counter; it never grows
    per_token = {"hf_gpt2": 1024, "hf_llama": 512}[make.__name__]
    est = profile.estimate(3, mode="generate", new_tokens=40)
    assert (est.kv_cache_bytes, est.kv_cache_bytes_per_token) == (3 * 55 * per_token + 16, 0)
    # generate remembers its largest static cache on the model: the profile leaves none
    assert_model_unchanged(model, before)
    assert "_previous_max_cache_length" not in model.__dict__


def test_profiling_a_generation_leaves_the_model_as_it_was() -> None:
    model = _model(hf_llama)
    before = snapshot_model(model)
    profile = profile_model(model, inputs=_prompts(2, 16), device="cpu")
    profile.estimate(3, mode="generate", seq_len=20, new_tokens=9)
    assert_model_unchanged(model, before)
    assert not model._forward_pre_hooks  # the pass's step marker is gone


def test_a_static_cache_for_a_gpu_says_its_compiled_step_is_not_modelled() -> None:
    model = _model(hf_gpt2)
    model.generation_config.cache_implementation = "static"
    profile = profile_model(model, inputs=_prompts(2, 16))  # device="cuda"
    with pytest.warns(UserWarning, match="compiles the decode step of a StaticCache"):
        profile.estimate(2, mode="generate", new_tokens=8)
