"""torchao's NF4Tensor as torchtune's QLoRA applies it (``weights="nf4-torchao"``): the stored
layout against torchao's real ``to_nf4``, the estimate of inference and LoRA training against
the real step with torchtune's own ``LoRALinear`` / ``FrozenNF4Linear`` on the CPU, to the
byte, torchtune's loader, and the refusals."""

from __future__ import annotations

import sys

import pytest
import torch
from models import assert_model_unchanged, hf_llama, hf_tokens, mlp_input, snapshot_model

from vram_widget import ModelProfile, Weights, measure, profile_model, zoo
from vram_widget._estimating.quantized import quantized_bytes

pytest.importorskip("torchao")
pytest.importorskip("transformers")

from vram_widget._profiling import nf4_torchao
from vram_widget._profiling.fake import new_fake_mode
from vram_widget._profiling.nf4_torchao import fake_nf4_weight, nf4_copy, torchtune_nf4
from vram_widget._profiling.torchao_weights import torchao_inner

try:
    torchtune_nf4()
except ImportError:
    pytest.skip("torchtune's files are not installed", allow_module_level=True)

# zoo.mlp is 784 -> 512 -> 512 -> 10: only layer 3's 512 x 512 = 262,144 = 16 x 16,384
# weights are a multiple of to_nf4's 64 x 256; layers 0 and 6 are kept unquantized
MLP = Weights("nf4-torchao", skip_modules=("0", "6"))
MLP_LORA = {"lora_rank": 4, "lora_targets": ["0", "3", "6"], "optimizer": "adamw"}
# the small Llama's k_proj is 32 x 64 = 2,048 weights: 32 blocks of 64, one block of 32
# scalers (to_nf4's scaler_block_size, given to LoRALinear as torchtune's quantization_kwargs)
LLAMA = Weights("nf4-torchao", scaler_blocksize=32)


def _layout(t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    inner = torchao_inner(t)
    assert inner is not None
    return [(tuple(x.shape), x.dtype, x.untyped_storage().nbytes()) for x in inner]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("shape", "weights"),
    [
        ((64, 256), Weights("nf4-torchao")),
        ((128, 256), Weights("nf4-torchao")),
        ((256, 192), Weights("nf4-torchao")),
        ((32, 64), LLAMA),
        ((96, 64), Weights("nf4-torchao", blocksize=32, scaler_blocksize=64)),
    ],
)
def test_fake_layout_is_to_nf4s_own(
    shape: tuple[int, int], weights: Weights, dtype: torch.dtype
) -> None:
    # the fake NF4Tensor holds exactly what torchao's to_nf4 makes of a real weight: the same
    # inner tensors, shapes, dtypes and storage bytes; quantized_bytes adds them up
    tt = torchtune_nf4()
    real = tt.to_nf4(
        torch.randn(shape, dtype=dtype),
        block_size=weights.blocksize,
        scaler_block_size=weights.scaler_blocksize,
    )
    copy_ = nf4_copy(torch.nn.Sequential(torch.nn.Linear(*shape[::-1])), weights, None, None, None)
    with new_fake_mode():
        fake = fake_nf4_weight(copy_[0].weight, dtype)
    assert type(fake) is tt.NF4Tensor
    assert _layout(fake) == _layout(real)
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = quantized_bytes(shape, weights, itemsize).total_bytes
    assert sum(b for _s, _d, b in _layout(real)) == total


def test_nf4_bytes_by_hand() -> None:
    # 128 x 256 in fp32: 32,768 weights -> 16,384 B of codes; 512 blocks of 64 -> 512 int8
    # scalers; 2 blocks of 256 scalers -> 2 float32 factors (8 B) + the mean (4 B) + the
    # 16-value table (64 B)
    b = quantized_bytes((128, 256), Weights("nf4-torchao"), itemsize=4)
    assert (b.codes_bytes, b.scales_bytes, b.state_bytes) == (16384, 512, 8 + 4 + 64)
    # 64 x 256 in bf16: 8,192 B of codes, 256 scalers, one block of them: its factor is a
    # view of the (1, 256) tensor it is cut from, which keeps all 256 x 2 B; mean 2 B,
    # table 32 B
    b = quantized_bytes((64, 256), Weights("nf4-torchao"), itemsize=2)
    assert (b.codes_bytes, b.scales_bytes, b.state_bytes) == (8192, 256, 512 + 2 + 32)


def test_mlp_parameter_bytes_are_the_stored_layout(
    mlp: tuple[torch.nn.Module, ModelProfile],
) -> None:
    _model, profile = mlp
    # inference: layer 3 is a FrozenNF4Linear, bf16: 131,072 B of codes + 4,096 scalers +
    # 16 factors x 2 B + 2 B mean + 32 B table = 135,234 B; the rest in bf16: layer 0's
    # 784 x 512 weight, layer 6's 10 x 512, the three biases 512 + 512 + 10
    est = profile.estimate(1, "bf16", mode="inference", weights=MLP)
    plain = (784 * 512 + 10 * 512 + 512 + 512 + 10) * 2
    assert est.parameter_bytes == plain + 135234
    assert est.weights == MLP.describe()
    # training: LoRALinear of rank 4 on all three (0 and 6 unquantized): lora_a r x in,
    # lora_b out x r: 4 x 784 + 512 x 4 + 4 x 512 + 512 x 4 + 4 x 512 + 10 x 4 = 11,368
    # adapter weights in bf16, the only ones with gradients
    est = profile.estimate(1, "bf16", mode="train", weights=MLP, **MLP_LORA)
    adapters = 4 * 784 + 512 * 4 + 4 * 512 + 512 * 4 + 4 * 512 + 10 * 4
    assert est.parameter_bytes == plain + 135234 + adapters * 2
    assert est.gradient_bytes == adapters * 2


def _check(
    model: torch.nn.Module,
    profile: ModelProfile,
    make,
    weights: Weights,
    precisions: tuple[str, ...],
    **settings: object,
) -> None:
    before = snapshot_model(model)
    for batch in (1, 4):
        for precision in precisions:
            est = profile.estimate(batch, precision, weights=weights, **settings)
            real = measure(model, make(batch), precision=precision, weights=weights, **settings)
            assert est.peak_bytes == real.peak_bytes, (batch, precision)
            resident = (
                est.parameter_bytes + est.buffer_bytes + est.input_bytes + est.optimizer_state_bytes
            )
            if settings.get("mode") == "inference":
                assert resident == real.resident_bytes, (batch, precision)
    assert_model_unchanged(model, before)


def test_mlp_inference_equals_torchtune(mlp: tuple[torch.nn.Module, ModelProfile]) -> None:
    model, profile = mlp
    _check(model, profile, mlp_input, MLP, ("bf16", "fp32"), mode="inference")


def test_mlp_qlora_training_equals_torchtune(mlp: tuple[torch.nn.Module, ModelProfile]) -> None:
    model, profile = mlp
    _check(model, profile, mlp_input, MLP, ("bf16", "fp32"), mode="train", **MLP_LORA)


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, ModelProfile]:
    torch.manual_seed(0)
    model = hf_llama()
    return model, profile_model(model, inputs=hf_tokens(2), device="cpu")


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_llama_equals_torchtune(mode: str, llama: tuple[torch.nn.Module, ModelProfile]) -> None:
    # every q/k/v/o and MLP projection NF4 (lm_head kept, as torchtune keeps its output
    # projection); training: LoRALinear on PEFT's default Llama targets, q_proj and v_proj
    model, profile = llama
    settings: dict[str, object] = {"mode": mode}
    if mode == "train":
        settings.update(lora_rank=4, optimizer="adamw")
    _check(model, profile, hf_tokens, LLAMA, ("bf16", "fp32"), **settings)


def test_llama_generate_equals_torchtune(llama: tuple[torch.nn.Module, ModelProfile]) -> None:
    # Hugging Face's generate on the copy with torchtune's FrozenNF4Linear layers: the
    # prefill and 6 decode steps after a prompt of 16, to the byte, at batch 1 in fp32 and
    # batch 2 in bf16; the KV cache is the plain model's
    model, profile = llama
    before = snapshot_model(model)
    for batch, precision in ((1, "fp32"), (2, "bf16")):
        est = profile.estimate(
            batch, precision, mode="generate", seq_len=16, new_tokens=6, weights=LLAMA
        )
        prompts = {"input_ids": hf_tokens(batch, 16)["input_ids"]}
        real = measure(
            model, prompts, precision=precision, mode="generate", new_tokens=6, weights=LLAMA
        )
        assert est.peak_bytes == real.peak_bytes, (batch, precision)
        plain = profile.estimate(batch, precision, mode="generate", seq_len=16, new_tokens=6)
        assert est.kv_cache_bytes == plain.kv_cache_bytes > 0
        assert est.parameter_bytes < plain.parameter_bytes
    assert_model_unchanged(model, before)


def test_llama_modules_are_torchtunes(llama: tuple[torch.nn.Module, ModelProfile]) -> None:
    model, _profile = llama
    copy_ = nf4_copy(model, LLAMA, 4, None, None)
    tt = torchtune_nf4()
    kinds = {n: type(m).__name__ for n, m in copy_.named_modules()}
    assert kinds["model.layers.0.self_attn.q_proj"] == "LoRALinear"
    assert kinds["model.layers.1.self_attn.v_proj"] == "LoRALinear"
    assert kinds["model.layers.0.self_attn.k_proj"] == "FrozenNF4Linear"
    assert kinds["model.layers.0.mlp.down_proj"] == "FrozenNF4Linear"
    assert kinds["lm_head"] == "Linear"
    trainable = sorted(n for n, p in copy_.named_parameters() if p.requires_grad)
    assert trainable == sorted(
        f"model.layers.{i}.self_attn.{proj}.{ab}.weight"
        for i in (0, 1)
        for proj in ("q_proj", "v_proj")
        for ab in ("lora_a", "lora_b")
    )
    assert isinstance(copy_.get_submodule("model.layers.0.self_attn.q_proj"), tt.LoRALinear)


def test_loader_leaves_no_package_behind() -> None:
    # torchtune's files are run from its directory without its package, and torchao's moved
    # module is under its old name only while they run
    tt = torchtune_nf4()
    source = tt.LoRALinear.forward.__code__.co_filename
    assert source.endswith("torchtune/modules/peft/lora.py")
    source = tt.FrozenNF4Linear.forward.__code__.co_filename
    assert source.endswith("torchtune/modules/low_precision/nf4_linear.py")
    assert "torchtune" not in sys.modules
    assert not any(name.startswith("torchtune.") for name in sys.modules)
    assert tt.to_nf4.__module__ == "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
    assert "torchao.dtypes.nf4tensor" not in sys.modules


def test_odd_sizes_are_refused_by_name(mlp: tuple[torch.nn.Module, ModelProfile]) -> None:
    model, profile = mlp
    rule = (
        r"multiple of block_size x scaler_block_size = 64 x 256 = 16384.*0 \(401408\), 6 \(5120\)"
    )
    with pytest.raises(ValueError, match=rule):
        profile.estimate(1, mode="inference", weights="nf4-torchao")
    with pytest.raises(ValueError, match=rule):
        measure(model, mlp_input(1), mode="inference", weights="nf4-torchao")


def test_training_without_adapters_is_refused(mlp: tuple[torch.nn.Module, ModelProfile]) -> None:
    model, profile = mlp
    with pytest.raises(ValueError, match=r"'nf4-torchao' in training needs lora_rank"):
        profile.estimate(1, weights=MLP)
    with pytest.raises(ValueError, match=r"'nf4-torchao' in training needs lora_rank"):
        measure(model, mlp_input(1), weights=MLP)


def test_targets_that_are_not_linear_are_refused(
    mlp: tuple[torch.nn.Module, ModelProfile],
) -> None:
    model, profile = mlp
    with pytest.raises(ValueError, match=r"lora_targets=\['1'\] names 1, not nn.Linear"):
        profile.estimate(1, weights=MLP, lora_rank=4, lora_targets=["1"])
    with pytest.raises(ValueError, match=r"has no default targets.*name them"):
        measure(model, mlp_input(1), weights=MLP, lora_rank=4)
    # torchtune's adapters are in the model's dtype; its forward casts nothing
    fp32 = {**MLP_LORA, "lora_dtype": "fp32"}
    with pytest.raises(ValueError, match=r"lora_dtype='float32'.*None or 'base'"):
        profile.estimate(1, "bf16", weights=MLP, **fp32)
    with pytest.raises(ValueError, match=r"lora_dtype='float32'.*None or 'base'"):
        measure(model, mlp_input(1), precision="bf16", weights=MLP, **fp32)


def test_missing_torchao_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ImportError, match=r"pip install torchao"):
        nf4_torchao.nf4_module()


def test_missing_torchtune_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchtune", None)  # find_spec then finds none
    with pytest.raises(ImportError, match=r"pip install torchtune"):
        nf4_torchao.nf4_layers(zoo.mlp(), MLP, None, None)
