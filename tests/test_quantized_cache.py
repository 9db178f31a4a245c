"""transformers' quantized KV cache (``QuantizedCache``, quanto backend) in generation:
optimum-quanto's packing on fake tensors against its real tensors, the estimate against the
real generate on the CPU to the byte (within the residual), and the refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from models import assert_model_unchanged, hf_llama, hf_tokens, snapshot_model

from vram_widget import ModelProfile, Recipe, measure, profile_model
from vram_widget._estimating.recipe.generation import Generation

pytest.importorskip("transformers")
pytest.importorskip("optimum.quanto")

from optimum.quanto import MaxOptimizer, qint2, qint4, quantize_weight

from vram_widget._profiling.fake import new_fake_mode
from vram_widget._profiling.quantized_cache import _unpack_as_cpp, quanto_on_fake


def _quantized(t: torch.Tensor, bits: int) -> torch.Tensor:
    # what QuantoQuantizedLayer._quantize does (transformers/cache_utils.py): axis 0,
    # groups of 64 (QuantizedLayer's defaults)
    qtype = qint4 if bits == 4 else qint2
    scale, shift = MaxOptimizer()(t, qtype, 0, 64)
    return quantize_weight(t, qtype, 0, scale, shift, 64)


def _layout(q: torch.Tensor) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    out = []
    for name in q.__tensor_flatten__()[0]:
        inner = getattr(q, name)
        inner = getattr(inner, "_data", inner)  # a PackedTensor holds its bytes in _data
        out.append((name, tuple(inner.shape), inner.dtype, inner.untyped_storage().nbytes()))
    return out


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("shape", [(1, 2, 16, 32), (2, 2, 17, 32), (1, 4, 21, 16)])
def test_fake_packing_is_quantos_own(bits: int, shape: tuple[int, ...]) -> None:
    # a key cache of B x heads x tokens x head_dim quantized as QuantizedCache does: the fake
    # tensor's packed codes, scales and shifts are the real ones' shapes, dtypes and bytes.
    # 4 bits, (1, 2, 16, 32): 1,024 codes in 16 groups of 64 -> 8 x 64 packed bytes (two a
    # byte), 16 float32 scales and 16 shifts: 512 + 64 + 64
    real = _quantized(torch.randn(shape), bits)
    with quanto_on_fake(), new_fake_mode():
        fake = _quantized(torch.randn(shape), bits)
    assert _layout(fake) == _layout(real)
    if shape == (1, 2, 16, 32):
        codes = 1024 // (8 // bits)
        assert [n for *_, n in _layout(real)] == [codes, 64, 64]
    # without the packing, optimum-quanto keeps a fake tensor's codes one a byte
    with new_fake_mode():
        unpacked = _quantized(torch.randn(shape), bits)
    assert _layout(unpacked)[0][3] == math.prod(shape)


@pytest.mark.parametrize("bits", [4, 2])
def test_unpack_order_gives_quantos_values(bits: int) -> None:
    # the fake unpacking follows the C++ kernel's order; on real bytes it gives the kernel's
    # values (every 2- or 4-bit code back in its own byte)
    packed = torch.randint(0, 256, (8, 64), dtype=torch.uint8)
    assert torch.equal(_unpack_as_cpp(packed, bits), torch.ops.quanto.unpack(packed, bits))


def _kv_recipe(
    batch: int, precision: str, tokens: int, bits: int, residual: int, prompt: int = 16
) -> Recipe:
    recipe = Recipe.from_keywords(
        batch_size=batch, precision=precision, mode="generate", seq_len=prompt
    )
    generation = Generation(
        new_tokens=tokens, kv_cache="quantized", kv_bits=bits, residual_length=residual
    )
    return dataclasses.replace(recipe, generation=generation)


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, ModelProfile]:
    torch.manual_seed(0)
    model = hf_llama()
    return model, profile_model(model, inputs=hf_tokens(2), device="cpu")


# (batch, precision, new tokens, bits, residual_length): 4 bits at transformers' default
# residual (2 bits: test_models_own_generation_config; a residual filled to its last token
# and flushed: test_llama_generate_across_flushes)
_SETTINGS = [(1, "fp32", 6, 4, 128), (2, "bf16", 12, 4, 128)]


def test_llama_generate_equals_quantized_cache(llama: tuple[torch.nn.Module, ModelProfile]) -> None:
    # Hugging Face's generate with QuantizedCache (quanto), prompt 16: the prefill quantizes
    # the prompt's keys and values, each decode step dequantizes them beside the residual;
    # the estimate is the real CPU generation's peak to the byte
    model, profile = llama
    before = snapshot_model(model)
    config_before = model.generation_config.to_dict()
    for batch, precision, tokens, bits, residual in _SETTINGS:
        recipe = _kv_recipe(batch, precision, tokens, bits, residual)
        est = profile.estimate(recipe=recipe)
        prompts = {"input_ids": hf_tokens(batch, 16)["input_ids"]}
        # measure takes the prompt's length from the prompt itself
        real = measure(model, prompts, recipe=recipe.with_(seq_len=None))
        assert est.peak_bytes == real.peak_bytes, (batch, precision, tokens, bits)
        assert est.new_tokens == tokens
        if (batch, bits, tokens) == (1, 4, 6):
            # tiny Llama: 2 layers x keys and values x 2 heads x 16 dims. The prompt's 16
            # tokens quantized: 512 values in 8 groups of 64, packed 2 a byte (4 x 64 =
            # 256 B) with 8 float32 scales and 8 shifts: 320 B x 4 tensors = 1,280; the
            # residual of the 5 decode steps' tokens in fp32: 5 x 4 x 2 x 16 x 4 B = 2,560
            assert est.kv_cache_bytes == 1280 + 2560
            assert est.kv_cache_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert_model_unchanged(model, before)
    assert model.generation_config.to_dict() == config_before


# (prompt, bits, KV cache after the last step): residual_length 4 and 10 new tokens, so the
# decode steps 4 and 8 flush (quantize the whole cache again); batch 1 in fp32. Short prompts,
# so that the peak is in the decode steps, not in the prefill
_ACROSS = [(4, 4, 1472), (8, 2, 1280)]


def test_llama_generate_across_flushes(llama: tuple[torch.nn.Module, ModelProfile]) -> None:
    # a generation across two flushes, recorded step by step on fake tensors, is the real
    # CPU generation's peak to the byte
    model, profile = llama
    for prompt, bits, kv in _ACROSS:
        recipe = _kv_recipe(1, "fp32", 10, bits, 4, prompt=prompt)
        if bits == 4:
            est = profile.estimate(recipe=recipe)
        else:
            # 2 bits: after the flush at step 4, 12 tokens x 32 values per sequence are
            # 6 x B groups, packed four a row of 64 bytes: ceil(1.5 x B) rows (pack_weights,
            # optimum/quanto/tensor/packed.py), 2 at batch 1, 3 at 2, 5 at 3, 8 at 5: no line
            # in the batch, said so. Batch 1 is recorded at batch 1 (exact)
            with pytest.warns(UserWarning, match="not affine in the batch size"):
                est = profile.estimate(recipe=recipe)
        prompts = {"input_ids": hf_tokens(1, prompt)["input_ids"]}
        if bits == 4:  # measure's flat keywords ask for the same cache as the recipe
            real = measure(
                model, prompts, precision="fp32", mode="generate", new_tokens=10,
                kv_cache="quantized", kv_bits=4, residual_length=4,
            )  # fmt: skip
        else:
            real = measure(model, prompts, recipe=recipe.with_(seq_len=None))
        assert est.peak_bytes == real.peak_bytes, (prompt, bits)
        assert est.peak_step > 4  # past the first flush: its bytes are in the peak
        # after step 9: prompt + 8 tokens quantized (the flush at step 8), one in the
        # residual. Per layer and keys or values, 2 heads x 16 dims: 4 bits, 12 tokens: 384
        # values in 6 groups of 64, 3 x 64 packed bytes (two a byte) + 6 float32 scales + 6
        # shifts = 240 B; 2 bits, 16 tokens: 8 groups, 2 x 64 B (four a byte) + 32 + 32 =
        # 192 B; x 4 tensors (2 layers, keys and values), and the residual's token: 4 x 32 x
        # 4 B = 512. 4 x 240 + 512 = 1,472; 4 x 192 + 512 = 1,280
        assert est.kv_cache_bytes == kv
        # one more token: one more unquantized residual token, 2 x 2 x 2 x 16 x 4 B
        assert est.kv_cache_bytes_per_token == 512
        # the recording is of these 9 decode steps: 11 new tokens would need another
        sub = profile._kv_cache(recipe)[0]
        assert sub.is_cached("fp32", "generate", seq_len=prompt, new_tokens=10)
        assert not sub.is_cached("fp32", "generate", seq_len=prompt, new_tokens=11)


def test_flat_keywords(llama: tuple[torch.nn.Module, ModelProfile]) -> None:
    # estimate's flat keywords are the Recipe's Generation: tiny Llama (2 layers x keys and
    # values x 2 heads x 16 dims), prompt 16, fp32, 2 bits, residual 8, 8 new tokens. The
    # prompt's 512 values per tensor in 8 groups of 64, packed 4 a byte (128 B) with 8
    # float32 scales and 8 shifts (32 + 32 B): 192 B x 4 tensors = 768; the residual of the
    # 7 decode steps' tokens: 7 x 4 x 2 x 16 x 4 B = 3,584
    _model, profile = llama
    flat = dict(mode="generate", seq_len=16, new_tokens=8, kv_cache="quantized", kv_bits=2)
    est = profile.estimate(1, "fp32", residual_length=8, **flat)
    assert est.kv_cache_bytes == 768 + 3584
    assert est.peak_bytes == profile.estimate(recipe=_kv_recipe(1, "fp32", 8, 2, 8)).peak_bytes
    # groups of 32: 16 scales and 16 shifts a tensor, 64 B more each: 4 x 64 = 256 B more
    grouped = profile.estimate(1, "fp32", residual_length=8, q_group_size=32, **flat)
    assert grouped.kv_cache_bytes == est.kv_cache_bytes + 256
    # the recipe's setting, given again flat, agrees; another value conflicts by name
    recipe = _kv_recipe(1, "fp32", 8, 2, 8)
    assert profile.estimate(recipe=recipe, kv_bits=2).peak_bytes == est.peak_bytes
    with pytest.raises(ValueError, match=r"kv_bits=4 conflicts with the recipe's generation"):
        profile.estimate(recipe=recipe, kv_bits=4)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"kv_bits": 3}, r"kv_bits=3: the quantized KV cache \(quanto backend\) takes 2 or 4"),
        ({"kv_bits": True}, r"kv_bits=True: .* takes 2 or 4"),
        ({"kv_cache": "int8"}, r"unknown kv_cache 'int8'; valid: None .* or 'quantized'"),
        ({"residual_length": 0}, r"residual_length=0: a positive int"),
        ({"q_group_size": "64"}, r"q_group_size='64': a positive int"),
        ({"kv_cache": None, "kv_bits": 2}, r"kv_bits=2: settings of the quantized KV cache"),
        ({"kv_cache": None, "residual_length": 64}, r"residual_length=64: settings of the"),
        ({"new_tokens": 129}, r"new_tokens=129 crosses that flush.*<= 128"),
        ({"mode": "inference"}, r"KV cache of mode='generate'; got mode='inference'"),
    ],
)
def test_flat_keyword_refusals(
    llama: tuple[torch.nn.Module, ModelProfile], keywords: dict[str, object], message: str
) -> None:
    # each bad value is a ValueError naming it and the valid forms, before any profiling
    _model, profile = llama
    asked: dict[str, object] = {"mode": "generate", "new_tokens": 4, "kv_cache": "quantized"}
    asked.update(keywords)
    profiled = dict(profile._kv_cache_profiles)
    with pytest.raises(ValueError, match=message):
        profile.estimate(1, "fp32", **asked)  # type: ignore[arg-type]
    assert profile._kv_cache_profiles == profiled


def test_models_own_generation_config_is_estimated() -> None:
    # a model whose generation_config asks for the quantized cache is estimated as the
    # recipe's setting is, and measured with its own config
    torch.manual_seed(0)
    model = hf_llama()
    model.generation_config.cache_implementation = "quantized"
    model.generation_config.cache_config = {"backend": "quanto", "nbits": 2}
    profile = profile_model(model, inputs=hf_tokens(2), device="cpu")
    est = profile.estimate(1, "fp32", mode="generate", seq_len=16, new_tokens=6)
    prompts = {"input_ids": hf_tokens(1, 16)["input_ids"]}
    real = measure(model, prompts, precision="fp32", mode="generate", new_tokens=6)
    assert est.peak_bytes == real.peak_bytes
    # refused: a generation across the flush, another backend
    with pytest.raises(ValueError, match="new_tokens=129 crosses that flush"):
        profile.estimate(1, "fp32", mode="generate", seq_len=16, new_tokens=129)
    model.generation_config.cache_config = {"backend": "hqq", "nbits": 2}
    hqq = profile_model(model, inputs=hf_tokens(2), device="cpu")
    with pytest.raises(ValueError, match="backend='hqq' is not estimated"):
        hqq.estimate(1, "fp32", mode="generate", seq_len=16, new_tokens=6)


def test_refusals_name_the_setting(llama: tuple[torch.nn.Module, ModelProfile]) -> None:
    _model, profile = llama
    # a generation across a flush is recorded step by step: up to 33 new tokens
    with pytest.raises(ValueError, match=r"new_tokens=40 crosses that flush.*<= 33"):
        profile.estimate(recipe=_kv_recipe(1, "fp32", 40, 4, 8))
    inference = dataclasses.replace(
        Recipe.from_keywords(mode="inference"), generation=Generation(kv_cache="quantized")
    )
    with pytest.raises(ValueError, match="KV cache of mode='generate'"):
        profile.estimate(recipe=inference)
    with pytest.raises(ValueError, match=r"kv_bits=8: .* takes 2 or 4 bits"):
        Generation(kv_cache="quantized", kv_bits=8)
    with pytest.raises(ValueError, match=r"unknown kv_cache 'int8'; valid: None .* 'quantized'"):
        Generation(kv_cache="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="residual_length=0: a positive int"):
        Generation(residual_length=0)


def test_sliding_window_layers_are_refused_by_name() -> None:
    # transformers' QuantizedCache takes full-attention layers only; Mistral's sliding window
    # makes its layers "sliding_attention": refused by name, not a profiling failure
    from models import hf_mistral

    profile = profile_model(hf_mistral(), inputs=hf_tokens(2), device="cpu")
    with pytest.raises(ValueError, match="MistralForCausalLM has sliding_attention layers"):
        profile.estimate(1, mode="generate", new_tokens=4, kv_cache="quantized")
    assert profile._kv_cache_profiles == {}


def test_with_quantized_weights(llama: tuple[torch.nn.Module, ModelProfile]) -> None:
    # both rungs at once: torchao's int8 weights and the 4-bit cache, to the byte
    pytest.importorskip("torchao")
    model, profile = llama
    recipe = _kv_recipe(1, "fp32", 6, 4, 128).with_(weights="int8-torchao")
    est = profile.estimate(recipe=recipe)
    real = measure(
        model, {"input_ids": hf_tokens(1, 16)["input_ids"]}, recipe=recipe.with_(seq_len=None)
    )
    assert est.peak_bytes == real.peak_bytes
    plain = profile.estimate(recipe=_kv_recipe(1, "fp32", 6, 4, 128))
    assert est.kv_cache_bytes == plain.kv_cache_bytes
    assert est.parameter_bytes < plain.parameter_bytes


def test_measure_refuses_a_kv_cache_it_cannot_run(
    llama: tuple[torch.nn.Module, ModelProfile],
) -> None:
    # each refused by name before the model is copied or run
    model, _ = llama
    prompts = {"input_ids": hf_tokens(1, 4)["input_ids"]}
    with pytest.raises(ValueError, match="kv_bits=2: settings of the quantized KV cache"):
        measure(model, prompts, mode="generate", new_tokens=2, kv_bits=2)
    with pytest.raises(ValueError, match="give mode='generate'"):
        measure(model, prompts, kv_cache="quantized")
    with pytest.raises(ValueError, match="takes 2 or 4 bits"):
        measure(model, prompts, mode="generate", new_tokens=2, kv_cache="quantized", kv_bits=8)
    recipe = _kv_recipe(1, "fp32", 2, 4, 128, prompt=4).with_(seq_len=None)
    with pytest.raises(ValueError, match="kv_bits=2 conflicts with the recipe"):
        measure(model, prompts, recipe=recipe, kv_bits=2)
