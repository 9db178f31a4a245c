"""torchao's weight formats (``weights="int8-torchao" / "int4-torchao"``): the stored layout
against torchao's real tensors, the estimate of the quantized model's inference against
torchao's real ``quantize_`` on the CPU, to the byte, and the refusals."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from models import assert_model_unchanged, hf_gpt2, hf_llama, hf_tokens, mlp_input, snapshot_model

from vram_widget import ModelProfile, Weights, measure, profile_model, zoo
from vram_widget._estimating.quantized import quantized_bytes

pytest.importorskip("torchao")
pytest.importorskip("transformers")

from torchao.quantization import quantize_

from vram_widget._profiling.fake import new_fake_mode
from vram_widget._profiling.torchao_weights import (
    fake_torchao_weight,
    require_torchao,
    torchao_config,
    torchao_copy,
    torchao_inner,
)

INT8 = Weights("int8-torchao")
INT4_32 = Weights("int4-torchao", group_size=32)


def _layout(t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    inner = torchao_inner(t)
    assert inner is not None
    return [(tuple(x.shape), x.dtype, x.untyped_storage().nbytes()) for x in inner]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(48, 256), (32, 128)])
@pytest.mark.parametrize(
    "weights", [INT8, Weights("int4-torchao"), INT4_32], ids=["int8", "int4-128", "int4-32"]
)
def test_fake_layout_is_torchaos_own(
    weights: Weights, shape: tuple[int, int], dtype: torch.dtype
) -> None:
    # the fake weight holds exactly what torchao's quantize_ makes of a real Linear on the
    # CPU: the same inner tensors, shapes, dtypes and bytes; quantized_bytes adds them up
    torch.manual_seed(0)
    real = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=dtype)
    quantize_(real, torchao_config(weights))
    copy_ = torchao_copy(torch.nn.Sequential(torch.nn.Linear(shape[1], shape[0])), weights)
    with new_fake_mode():
        fake_layout = _layout(fake_torchao_weight(copy_[0].weight, dtype))
    assert fake_layout == _layout(real.weight)
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = quantized_bytes(shape, weights, itemsize).total_bytes
    assert sum(b for _s, _d, b in _layout(real.weight)) == total


def test_torchao_bytes_by_hand() -> None:
    # int8: 40 x 96 = 3,840 int8 values + 40 float32 scales (160 B) + 40 int8 zero points
    b = quantized_bytes((40, 96), INT8)
    assert (b.codes_bytes, b.scales_bytes, b.state_bytes) == (3840, 160, 40)
    # int4 in bf16, groups of 128: 32 x 256 / 2 = 4,096 B of packed values; 256 / 128 = 2
    # groups x 32 rows x (scale, zero) x 2 B = 256 B
    b = quantized_bytes((32, 256), Weights("int4-torchao"), itemsize=2)
    assert (b.codes_bytes, b.scales_bytes, b.state_bytes) == (4096, 256, 0)


def test_mlp_parameter_bytes_are_the_stored_layout(
    mlp: tuple[torch.nn.Module, ModelProfile],
) -> None:
    # zoo.mlp is 784 -> 512 -> 512 -> 10; quantize_'s _is_linear takes all three (a plain
    # module keeps none); their biases stay in the precision's dtype: (512 + 512 + 10) x 4 B
    _model, profile = mlp
    est = profile.estimate(1, "fp32", mode="inference", weights=INT8)
    stored = sum(
        quantized_bytes(shape, INT8).total_bytes for shape in [(512, 784), (512, 512), (10, 512)]
    )
    assert est.parameter_bytes == stored + (512 + 512 + 10) * 4
    # int4, groups of 128: 784 is no multiple of 128 (layer 0 stays fp32), layer 6 kept;
    # layer 3 in bf16: 512 x 512 / 2 + 4 groups x 512 x 2 x 2 B
    int4 = Weights("int4-torchao", skip_modules=("6",))
    est = profile.estimate(1, "bf16", mode="inference", weights=int4)
    plain = (512 * 784 + 512 + 512 + 10 * 512 + 10) * 2
    assert est.parameter_bytes == plain + 512 * 512 // 2 + 4 * 512 * 2 * 2


def _check_inference(model: torch.nn.Module, profile: ModelProfile, make, weights: Weights) -> None:
    before = snapshot_model(model)
    for batch in (1, 4):
        for precision in ("bf16", "fp32"):
            est = profile.estimate(batch, precision, mode="inference", weights=weights)
            real = measure(
                model, make(batch), precision=precision, mode="inference", weights=weights
            )
            assert est.peak_bytes == real.peak_bytes, (batch, precision)
            resident = est.parameter_bytes + est.buffer_bytes + est.input_bytes
            assert resident == real.resident_bytes
            assert est.weights == weights.describe()
    assert_model_unchanged(model, before)


@pytest.mark.parametrize(
    "weights", [INT8, Weights("int4-torchao", skip_modules=("6",))], ids=["int8", "int4"]
)
def test_mlp_inference_equals_torchao(
    weights: Weights, mlp: tuple[torch.nn.Module, ModelProfile]
) -> None:
    model, profile = mlp
    _check_inference(model, profile, mlp_input, weights)


# Each tiny Hugging Face model (seeded) and its CPU profile, made once per module on first use
# and shared by the tests that estimate from it: one profile, every weight format.
_HFProfiles = dict[str, tuple[torch.nn.Module, ModelProfile]]


@pytest.fixture(scope="module")
def hf_profiles() -> _HFProfiles:
    return {}


def _hf(
    profiles: _HFProfiles, build: Callable[[], torch.nn.Module]
) -> tuple[torch.nn.Module, ModelProfile]:
    if build.__name__ not in profiles:
        torch.manual_seed(0)
        model = build()
        profiles[build.__name__] = model, profile_model(model, inputs=hf_tokens(2), device="cpu")
    return profiles[build.__name__]


@pytest.mark.parametrize(
    ("build", "weights"),
    [(hf_llama, INT8), (hf_llama, INT4_32), (hf_gpt2, Weights("int8-torchao", skip_modules=()))],
    ids=["llama-int8", "llama-int4", "gpt2-int8-lm-head"],
)
def test_hf_inference_equals_torchao(build, weights: Weights, hf_profiles: _HFProfiles) -> None:
    # Llama's q/k/v/o and MLP Linear layers (the output embeddings kept, as TorchAoConfig
    # keeps them); GPT-2's blocks are Conv1D, so only its lm_head (untied from the input
    # embeddings by quantize_'s new Parameter) with no module kept
    _check_inference(*_hf(hf_profiles, build), hf_tokens, weights)


# (batch, precision) of each generation, prompt 16 and 6 new tokens: batch 1 in fp32 and
# batch 2 in bf16, where each decode step's matmuls are a row or two
_GENERATIONS = ((1, "fp32"), (2, "bf16"))


@pytest.mark.parametrize("weights", [INT8, INT4_32], ids=["int8", "int4"])
def test_llama_generate_equals_torchao(weights: Weights, hf_profiles: _HFProfiles) -> None:
    # Hugging Face's generate on torchao's quantize_ copy (the prefill and each decode step
    # through the quantized Linear layers) to the byte; the KV cache is the plain model's,
    # and the quantized weights are fewer bytes than the plain ones
    model, profile = _hf(hf_profiles, hf_llama)
    before = snapshot_model(model)
    for batch, precision in _GENERATIONS:
        settings = {"mode": "generate", "seq_len": 16, "new_tokens": 6}
        est = profile.estimate(batch, precision, weights=weights, **settings)  # type: ignore[arg-type]
        prompts = {"input_ids": hf_tokens(batch, 16)["input_ids"]}
        real = measure(
            model, prompts, precision=precision, mode="generate", new_tokens=6, weights=weights
        )
        assert est.peak_bytes == real.peak_bytes, (batch, precision)
        plain = profile.estimate(batch, precision, **settings)  # type: ignore[arg-type]
        assert est.kv_cache_bytes == plain.kv_cache_bytes > 0
        assert est.parameter_bytes < plain.parameter_bytes
    assert_model_unchanged(model, before)


def test_training_is_refused(mlp: tuple[torch.nn.Module, ModelProfile]) -> None:
    model, profile = mlp
    for fmt in ("int8-torchao", "int4-torchao"):
        with pytest.raises(ValueError, match=r"is for inference: torchao's weight-only"):
            profile.estimate(1, weights=fmt)
        with pytest.raises(ValueError, match=r"is for inference"):
            measure(model, mlp_input(1), weights=fmt, lora_rank=4, lora_targets=["0"])


def test_int4_on_cuda_is_refused() -> None:
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cuda")
    with pytest.raises(ValueError, match=r"device='cpu' only.*'tile_packed_to_4d'"):
        profile.estimate(1, mode="inference", weights="int4-torchao")


def test_int4_odd_output_size_is_refused(mlp: tuple[torch.nn.Module, ModelProfile]) -> None:
    # torch's CPU packing needs N % 16 == 0; layer 6 has 10 outputs
    model, profile = mlp
    with pytest.raises(ValueError, match=r"multiple of 16; these Linear layers are not: 6 \(10\)"):
        profile.estimate(1, mode="inference", weights="int4-torchao")
    with pytest.raises(ValueError, match=r"multiple of 16"):
        measure(model, mlp_input(1), mode="inference", weights="int4-torchao")


def test_no_quantizable_linear_is_refused(hf_profiles: _HFProfiles) -> None:
    # GPT-2's blocks are Conv1D and TorchAoConfig keeps its output embeddings
    _, profile = _hf(hf_profiles, hf_gpt2)
    with pytest.raises(ValueError, match=r"has none to quantize.*Conv1D"):
        profile.estimate(1, mode="inference", weights="int8-torchao")
    # no input size of the MLP is a multiple of 256
    model = zoo.mlp(784, (200,), 10)
    with pytest.raises(ValueError, match=r"groups of 256 do not divide"):
        measure(
            model, mlp_input(1), mode="inference", weights=Weights("int4-torchao", group_size=256)
        )


def test_missing_torchao_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ImportError, match=r"pip install torchao"):
        require_torchao()


def test_bad_group_size_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"group_size must be one of 32, 64, 128, 256"):
        Weights("int4-torchao", group_size=100)


def test_int4_flops_are_the_plain_matmuls(mlp: tuple[torch.nn.Module, ModelProfile]) -> None:
    # layer 3 runs torch's _weight_int4pack_mm_for_cpu: the same 2 x 4 x 512 x 512
    # multiply-adds as the bf16 matmul it replaces, so the forward's FLOPs are unchanged
    _model, profile = mlp
    plain = profile.estimate(4, "bf16", mode="inference")
    int4 = Weights("int4-torchao", skip_modules=("6",))
    est = profile.estimate(4, "bf16", mode="inference", weights=int4)
    assert est.flops_forward == plain.flops_forward
