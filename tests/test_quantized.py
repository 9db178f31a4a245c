"""Quantized base weights (``weights="nf4" / "fp4" / "int8"``): bitsandbytes' stored layout,
and the estimate of the quantized model's inference, generation and QLoRA step against
bitsandbytes' (and PEFT's) real step on the CPU, to the byte."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from models import assert_model_unchanged, hf_gpt2, hf_llama, hf_tokens, mlp_input, snapshot_model

from vram_widget import ModelProfile, Recipe, Weights, measure, profile_model, zoo
from vram_widget._estimating.quantized import quantized_bytes

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from vram_widget._profiling.fake import new_fake_mode  # noqa: E402
from vram_widget._profiling.quantized import fake_quantized, state_tensors  # noqa: E402

# QLoRA's settings (the QLoRA paper's and PEFT's examples): nf4, double quantization, bf16
QLORA = Weights("nf4", double_quant=True, compute_dtype="bf16")
FORMATS = {
    "nf4-dq-bf16": QLORA,
    "nf4-bf16": Weights("nf4", compute_dtype="bf16"),
    "fp4": Weights("fp4"),  # BitsAndBytesConfig's defaults: fp32 compute, no double quant
}


def _real_4bit(shape: tuple[int, int], weights: Weights) -> torch.Tensor:
    """A weight quantized by bitsandbytes itself on the CPU (``Params4bit.to("cpu")``)."""
    torch.manual_seed(0)
    return bnb.nn.Params4bit(
        torch.randn(shape, dtype=torch.bfloat16),
        requires_grad=False,
        blocksize=weights.blocksize,
        compress_statistics=weights.double_quant,
        quant_type=weights.format.value,
        quant_storage=getattr(torch, weights.quant_storage),
    ).to("cpu")


def _layout(t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    """The codes and every quant-state tensor: shape, dtype, bytes."""
    return [(tuple(x.shape), x.dtype, x.untyped_storage().nbytes()) for x in (t, *state_tensors(t))]


@pytest.mark.parametrize("shape", [(40, 96), (512, 784), (10, 7)])
@pytest.mark.parametrize(
    "weights",
    [QLORA, Weights("nf4"), Weights("fp4", blocksize=128), Weights("nf4", quant_storage="bf16")],
    ids=["nf4-dq", "nf4", "fp4-128", "nf4-bf16-storage"],
)
def test_fake_layout_is_bitsandbytes_own(shape: tuple[int, int], weights: Weights) -> None:
    # the fake copy's weight holds exactly what a real Params4bit quantized on the CPU
    # holds: the same tensors, shapes, dtypes and bytes; and quantized_bytes adds them up
    if weights.quant_storage != "uint8" and shape[0] * shape[1] % 4:
        # bitsandbytes cannot view an odd count of packed bytes as a 2-byte storage
        # (backends/default/ops.py, quantize_4bit: packed.view(quant_storage))
        pytest.skip("bitsandbytes refuses this shape in a 2-byte storage")
    real = _real_4bit(shape, weights)
    meta = bnb.nn.Params4bit(
        torch.empty(shape, device="meta"),
        requires_grad=False,
        blocksize=weights.blocksize,
        compress_statistics=weights.double_quant,
        quant_type=weights.format.value,
        quant_storage=getattr(torch, weights.quant_storage),
    )
    with new_fake_mode():
        fake = fake_quantized(meta, torch.bfloat16)
        fake_layout = _layout(fake)
    assert fake_layout == _layout(real)
    expected = quantized_bytes(shape, weights)
    assert sum(b for _s, _d, b in _layout(real)) == expected.total_bytes


def test_quantized_bytes_by_hand() -> None:
    # 40 x 96 = 3,840 weights: 1,920 B of packed codes; 60 blocks of 64. Plain: 60 float32
    # maxima (240 B) + the 16-value float32 code (64 B). Double quantization: 60 uint8
    # maxima, one nested float32 maximum (ceil(60 / 256) = 1), the 256-value float32 map
    # (1,024 B), the float32 offset and the 16-value code: 4 x (1 + 256 + 1 + 16) = 1,096 B
    plain = quantized_bytes((40, 96), Weights("nf4"))
    assert (plain.codes_bytes, plain.scales_bytes, plain.state_bytes) == (1920, 240, 64)
    dq = quantized_bytes((40, 96), QLORA)
    assert (dq.codes_bytes, dq.scales_bytes, dq.state_bytes) == (1920, 60, 1096)
    # int8: 3,840 int8 codes + 40 float32 row scales = 3,840 + 160
    assert quantized_bytes((40, 96), Weights("int8")).total_bytes == 4000


def test_mlp_parameter_bytes_are_the_stored_layout(
    mlp: tuple[torch.nn.Module, ModelProfile],
) -> None:
    # zoo.mlp is 784 -> 512 -> 512 -> 10; transformers keeps the module of the last
    # parameter ("6.bias": no module of that name, so all three Linear layers are quantized,
    # as get_keys_to_not_convert's rule gives). Their biases stay, in the compute dtype
    # (Linear4bit casts them in place): (512 + 512 + 10) x 2 B in bf16
    _model, profile = mlp
    est = profile.estimate(1, "bf16", mode="inference", weights=QLORA)
    stored = sum(
        quantized_bytes(shape, QLORA).total_bytes for shape in [(512, 784), (512, 512), (10, 512)]
    )
    assert est.parameter_bytes == stored + (512 + 512 + 10) * 2


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
    assert_model_unchanged(model, before)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_mlp_inference_equals_bitsandbytes(
    name: str, mlp: tuple[torch.nn.Module, ModelProfile]
) -> None:
    model, profile = mlp
    _check_inference(model, profile, mlp_input, FORMATS[name])


@pytest.mark.parametrize("build", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_hf_inference_equals_bitsandbytes(build, name: str, hf_profiles: _HFProfiles) -> None:
    model, profile = _hf(hf_profiles, build)
    _check_inference(model, profile, hf_tokens, FORMATS[name])


def _ids(batch: int) -> dict[str, torch.Tensor]:
    return {"input_ids": hf_tokens(batch)["input_ids"]}


# Each tiny Hugging Face model (seeded) and its CPU profile, made once per module on first use
# and shared by the tests that estimate from it (profile once, many estimates, as a user
# does): keyed by the builder's name and whether the example batch has labels (a loss).
_HFProfiles = dict[tuple[str, bool], tuple[torch.nn.Module, ModelProfile]]


@pytest.fixture(scope="module")
def hf_profiles() -> _HFProfiles:
    return {}


def _hf(
    profiles: _HFProfiles, build: Callable[[], torch.nn.Module], labels: bool = True
) -> tuple[torch.nn.Module, ModelProfile]:
    key = (build.__name__, labels)
    if key not in profiles:
        torch.manual_seed(0)
        model = build()
        inputs = hf_tokens(2) if labels else _ids(2)
        profiles[key] = model, profile_model(model, inputs=inputs, device="cpu")
    return profiles[key]


def test_few_rows_keep_the_bf16_matmul_scratch(hf_profiles: _HFProfiles) -> None:
    # Llama without labels (no loss) peaks in a layer's down projection at batch 1: its
    # dequantized weight and, inside gemm_4bit's F.linear, one bf16 mm of 16 rows
    # (16 x 128 @ 128 x 64), whose oneDNN packing scratch on the CPU is 42,624 B at 16 to
    # 32 rows (not a line in the batch). In bf16 the real peak, 377,760 B, is the resident
    # 299,168 + 33,920 live before the projection + its 2,048 B output + 42,624 B of
    # scratch; the estimate without that scratch was 363,552. (Where oneDNN has no bf16
    # packing, under AVX2 alone, the scratch is not made and the peak is the lm_head's.)
    model, profile = _hf(hf_profiles, hf_llama, labels=False)
    weights = Weights("nf4", compute_dtype="bf16")
    for precision in ("bf16", "fp32"):
        est = profile.estimate(1, precision, mode="inference", weights=weights)
        real = measure(model, _ids(1), precision=precision, mode="inference", weights=weights)
        assert est.peak_bytes == real.peak_bytes, precision


@pytest.mark.parametrize("build", [hf_gpt2, hf_llama, None], ids=["gpt2", "llama", "mlp"])
@pytest.mark.parametrize(
    "weights", [QLORA, Weights("nf4", compute_dtype="bf16")], ids=["dq", "plain"]
)
def test_qlora_step_equals_peft_on_bitsandbytes(
    build,
    weights: Weights,
    hf_profiles: _HFProfiles,
    mlp: tuple[torch.nn.Module, ModelProfile],
) -> None:
    # PEFT's prepare_model_for_kbit_training and get_peft_model on bitsandbytes' nf4 copy,
    # AdamW over the adapters; the CPU step's peak to the byte at two batches and both
    # precisions
    if build is None:
        (model, profile), make, targets = mlp, mlp_input, ["0", "3"]
    else:
        (model, profile), make, targets = _hf(hf_profiles, build), hf_tokens, "auto"
    before = snapshot_model(model)
    for batch in (1, 4):
        for precision in ("bf16", "fp32"):
            est = profile.estimate(
                batch, precision, "adamw", weights=weights, lora_rank=4, lora_targets=targets
            )
            real = measure(
                model, make(batch), optimizer="adamw", precision=precision, weights=weights,
                lora_rank=4, lora_targets=targets,
            )  # fmt: skip
            assert est.peak_bytes == real.peak_bytes, (batch, precision)
    assert_model_unchanged(model, before)


INT8 = Weights("int8", int8_threshold=0.0)  # LLM.int8 without its outlier split


@pytest.mark.parametrize("build", [hf_gpt2, hf_llama, None], ids=["gpt2", "llama", "mlp"])
def test_int8_inference_equals_bitsandbytes(
    build, hf_profiles: _HFProfiles, mlp: tuple[torch.nn.Module, ModelProfile]
) -> None:
    # Linear8bitLt at threshold 0: the input quantized row-wise to int8, torch._int_mm,
    # the int32 result dequantized; the CPU step to the byte at two batches, two precisions
    if build is None:
        _check_inference(*mlp, mlp_input, INT8)
    else:
        _check_inference(*_hf(hf_profiles, build), hf_tokens, INT8)


# (batch, prompt, new tokens, precision): batch 1 in fp32 (fp32 activations around the
# compute dtype) and batch 3 in bf16, whose decode steps of 3 rows are few rows too
_GENERATIONS = {"1-fp32": (1, 12, 6, "fp32"), "3-bf16": (3, 20, 9, "bf16")}


@pytest.mark.parametrize(
    ("build", "weights", "settings"),
    [
        (hf_llama, Weights("nf4", compute_dtype="bf16"), ("1-fp32", "3-bf16")),
        (hf_gpt2, QLORA, ("3-bf16",)),
        (hf_llama, INT8, ("1-fp32",)),
    ],
    ids=["llama-nf4-bf16", "gpt2-qlora", "llama-int8"],
)
def test_generate_on_quantized_weights_equals_bitsandbytes(
    build, weights: Weights, settings: tuple[str, ...], hf_profiles: _HFProfiles
) -> None:
    # Hugging Face's generate on bitsandbytes' copy: the prefill and every decode step (a
    # few rows each, where the bf16 mm's CPU scratch is not a line in the batch) to the
    # byte; the weights change nothing of the KV cache
    model, profile = _hf(hf_profiles, build, labels=False)
    before = snapshot_model(model)
    for batch, prompt, tokens, precision in (_GENERATIONS[s] for s in settings):
        est = profile.estimate(
            batch, precision, mode="generate", seq_len=prompt, new_tokens=tokens, weights=weights
        )
        prompts = {"input_ids": hf_tokens(batch, prompt)["input_ids"]}
        real = measure(
            model, prompts, precision=precision, mode="generate", new_tokens=tokens,
            weights=weights,
        )  # fmt: skip
        assert est.peak_bytes == real.peak_bytes, (batch, prompt, tokens, precision)
        plain = profile.estimate(
            batch, precision, mode="generate", seq_len=prompt, new_tokens=tokens
        )
        assert est.kv_cache_bytes == plain.kv_cache_bytes
        assert est.parameter_bytes < plain.parameter_bytes
    assert_model_unchanged(model, before)


def test_int8_measured_storage_is_bitsandbytes_own() -> None:
    # measure(weights="int8") quantizes its copy with Int8Params: each Linear weight becomes
    # out x in int8 codes and out float32 row scales (SCB), counted as resident. zoo.mlp's
    # three layers, biases in bf16, and a bf16 input of 784 values
    torch.manual_seed(0)
    model = zoo.mlp()
    real = measure(model, torch.randn(1, 784), precision="bf16", mode="inference", weights="int8")
    stored = sum(
        quantized_bytes(s, Weights("int8")).total_bytes for s in [(512, 784), (512, 512), (10, 512)]
    )
    assert real.resident_bytes == stored + (512 + 512 + 10) * 2 + 784 * 2


def test_recipe_field_and_keyword_agree(mlp: tuple[torch.nn.Module, ModelProfile]) -> None:
    _model, profile = mlp
    by_keyword = profile.estimate(2, "bf16", mode="inference", weights=QLORA)
    recipe = Recipe.from_keywords(batch_size=2, precision="bf16", mode="inference", weights=QLORA)
    assert profile.estimate(recipe=recipe).peak_bytes == by_keyword.peak_bytes
    # a BitsAndBytesConfig reads as the same Weights
    import transformers

    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )  # fmt: skip
    assert Recipe().with_(weights=config).weights == QLORA
    # quantizing saves memory against the bf16 weights: 4.5 bits against 16 per weight
    plain = profile.estimate(2, "bf16", mode="inference")
    assert by_keyword.parameter_bytes < plain.parameter_bytes / 3


def _refused(profile: ModelProfile, match: str, **settings: object) -> None:
    with pytest.raises((ValueError, TypeError, ImportError), match=match):
        profile.estimate(**settings)
    assert not profile._quantized_profiles  # refused before any profiling


def test_bad_input_is_refused_before_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    _refused(
        profile,
        "unknown weights format 'int4'; valid values are 'nf4', 'fp4', 'int8'",
        weights="int4",
    )
    _refused(profile, "weights='int8' is for inference", weights="int8", mode="train")
    _refused(profile, "needs lora_rank", weights="nf4", mode="train")
    _refused(profile, "base_quantization was replaced by weights", base_quantization="nf4")
    with pytest.raises(ValueError, match="blocksize must be one of 32, 64, 128"):
        Weights("nf4", blocksize=100)
    with pytest.raises(ValueError, match="unknown compute_dtype 'int8'; valid values are"):
        Weights("nf4", compute_dtype="int8")
    convs = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    conv_profile = profile_model(convs, input_size=(3, 8, 8), device="cpu")
    _refused(conv_profile, "has none to quantize", weights="nf4", mode="inference")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    _refused(profile, "pip install bitsandbytes", weights="nf4", mode="inference")
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        measure(zoo.mlp(), torch.randn(1, 784), mode="inference", weights="nf4")


def test_widget_weights_dropdown_is_the_estimate(mlp: tuple[torch.nn.Module, ModelProfile]) -> None:
    # the Step tab's weights control: nf4-dq in bf16 is QLoRA's Weights (bf16 compute)
    from vram_widget._display.widget import MemoryWidget

    _model, profile = mlp
    widget = MemoryWidget(profile, precision="bf16", mode="inference", batch_size=4)
    widget.weights = "nf4-dq"
    expected = profile.estimate(4, "bf16", mode="inference", weights=QLORA)
    assert widget._estimate.peak_bytes == expected.peak_bytes
    widget.weights = "int8"
    expected = profile.estimate(4, "bf16", mode="inference", weights=INT8)
    assert widget._estimate.peak_bytes == expected.peak_bytes
    widget.weights = "off"
    assert widget._estimate.peak_bytes == profile.estimate(4, "bf16", mode="inference").peak_bytes


@pytest.mark.parametrize(
    "levers",
    [{"checkpoint": "auto"}, {"grad_accumulation": 2}, {"lora_targets": "all-linear"}],
    ids=["checkpoint", "accumulation", "all-linear"],
)
def test_qlora_composes_with_the_levers(levers: dict[str, object]) -> None:
    # Hugging Face's checkpointing of the decoder layers inside PEFT's wrapper, two
    # micro-batches, and adapters on every quantized Linear: the real step to the byte
    torch.manual_seed(0)
    model = hf_llama()
    profile = profile_model(model, inputs=hf_tokens(2), device="cpu")
    est = profile.estimate(4, "bf16", "adamw", weights=QLORA, lora_rank=4, **levers)
    real = measure(
        model, hf_tokens(4), optimizer="adamw", precision="bf16", weights=QLORA, lora_rank=4,
        **levers,
    )  # fmt: skip
    assert est.peak_bytes == real.peak_bytes


def test_searches_follow_the_quantized_weights() -> None:
    # max_batch_size and the batch x length frontier search the quantized model's step:
    # each answer fits, and one more sample does not
    torch.manual_seed(0)
    profile = profile_model(hf_llama(), inputs=hf_tokens(2), device="cpu")
    capacity = 8 * 2**20
    best = profile.max_batch_size(capacity, "bf16", mode="inference", weights=QLORA)
    at = lambda b, **kw: profile.estimate(b, "bf16", mode="inference", weights=QLORA, **kw)  # noqa: E731
    assert at(best).fits(capacity) and not at(best + 1).fits(capacity)
    plain = profile.max_batch_size(capacity, "bf16", mode="inference")
    assert best > plain  # the 4-bit weights leave room for more samples
    frontier = profile.frontier(
        capacity, "bf16", mode="inference", seq_lens=[16, 32], weights=QLORA
    )
    for length, batch in zip(frontier.seq_lens, frontier.max_batch_sizes, strict=True):
        assert at(int(batch), seq_len=int(length)).fits(capacity)
        assert not at(int(batch) + 1, seq_len=int(length)).fits(capacity)


# bitsandbytes registers its CPU int8_linear_matmul (torch._int_mm) only where
# torch.backends.cpu.get_cpu_capability() == "AVX512" (bitsandbytes/backends/cpu/ops.py);
# elsewhere its default kernel runs an fp32 matmul: counted either way (the matmul it calls
# is split into the mm the FLOP count sees)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_quantized_matmuls_count_the_same_flops(device: str) -> None:
    # the dequantized weight's matmul (4-bit) and torch._int_mm / bitsandbytes'
    # int8_linear_matmul (int8) multiply the same shapes as the Linear layers do:
    # zoo.mlp at batch 32, 2 x 32 x (784 x 512 + 512 x 512 + 512 x 10) = 42,795,008 FLOPs
    torch.manual_seed(0)
    profile = profile_model(zoo.mlp(), input_size=(784,), device=device)
    plain = profile.estimate(32, "bf16", mode="inference")
    assert plain.flops == 2 * 32 * (784 * 512 + 512 * 512 + 512 * 10) == 42_795_008
    for weights in (QLORA, INT8):
        assert profile.estimate(32, "bf16", mode="inference", weights=weights).flops == plain.flops


def test_int8_outlier_threshold_without_outliers_equals_bitsandbytes() -> None:
    # BitsAndBytesConfig's default llm_int8_threshold=6.0: the threshold's mask is held
    # through the input's quantization, no column is split out where no value reaches 6;
    # the CPU step to the byte at two batches and precisions (the inputs and the zoo MLP's
    # activations stay under 6), the assumption named in a warning and on the estimate
    from vram_widget import RecipeSettingIgnored

    torch.manual_seed(0)
    model = zoo.mlp()
    profile = profile_model(model, input_size=(784,), device="cpu")
    default = Weights("int8")
    for batch in (1, 4):
        x = mlp_input(batch).clamp(-5, 5)
        for precision in ("bf16", "fp32"):
            with pytest.warns(RecipeSettingIgnored, match="llm_int8_threshold=6.0"):
                est = profile.estimate(batch, precision, mode="inference", weights=default)
            assert any("no outlier column" in i for i in est.ignored)
            real = measure(model, x, precision=precision, mode="inference", weights=default)
            assert est.peak_bytes == real.peak_bytes, (batch, precision)


@pytest.mark.parametrize("columns", [7, 1], ids=["every-7th-column", "every-column"])
def test_int8_planted_outliers_are_within_the_stated_bound(columns: int) -> None:
    # inputs of 50 (>= 6) in every 7th column, or in all: bitsandbytes splits those columns
    # out in fp16, so the real step takes more than the no-outlier estimate, and no more
    # than it plus int8_outlier_bound_bytes summed over the three Linear8bitLt layers
    # (784 -> 512 -> 512 -> 10) at rows = batch
    import warnings

    from vram_widget._estimating.quantized import int8_outlier_bound_bytes

    torch.manual_seed(0)
    model = zoo.mlp()
    profile = profile_model(model, input_size=(784,), device="cpu")
    for batch in (1, 4):
        x = mlp_input(batch).clamp(-5, 5)
        x[:, ::columns] = 50.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the assumption's warning, tested above
            est = profile.estimate(batch, "bf16", mode="inference", weights="int8")
        real = measure(model, x, precision="bf16", mode="inference", weights="int8")
        bound = sum(
            int8_outlier_bound_bytes(batch, i, o) for i, o in [(784, 512), (512, 512), (512, 10)]
        )
        assert est.peak_bytes < real.peak_bytes <= est.peak_bytes + bound, batch
