"""``ModelProfile.load_bytes``: the memory of a loaded model, against the real loaders on the
CPU (a build at the dtype quantized by bitsandbytes, measured by the CPU allocator's events;
Hugging Face's ``from_pretrained`` itself), and a Linear stack worked by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from models import assert_model_unchanged, hf_gpt2, hf_llama, hf_t5, hf_tokens, snapshot_model

from vram_widget import Recipe, Weights, profile_model

bnb = pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")

from vram_widget._profiling.loading import loaded_cpu_bytes  # noqa: E402
from vram_widget._profiling.quantized import (  # noqa: E402
    bnb_config,
    module_state_tensors,
    real_quantized,
)

QLORA = Weights("nf4", double_quant=True, compute_dtype="bf16")
WEIGHTS = {"none": None, "nf4-dq": QLORA, "fp4": Weights("fp4"), "int8": Weights("int8")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _stack() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )  # fmt: skip


def test_linear_stack_by_hand() -> None:
    profile = profile_model(_stack(), input_size=(256,), device="cpu")
    # bf16: (256 x 128 + 128 + 128 x 64 + 64 + 64 x 10 + 10) = 41,802 values x 2 B
    plain = profile.load_bytes(precision="bf16")
    assert plain.allocated_bytes == plain.parameter_bytes == 83_604
    # amp keeps float32 weights: 41,802 x 4 B
    assert profile.load_bytes(precision="amp-bf16").allocated_bytes == 167_208
    # nf4 with double quantization, blocks of 64 (the module of the last parameter is
    # "4.bias", no module: all three layers quantized). Per layer: codes n / 2; n / 64
    # uint8 maxima; the 16-value float32 code (64 B); the float32 offset (4 B);
    # ceil(blocks / 256) float32 nested maxima; the 256-value float32 map (1,024 B):
    #   256 x 128 = 32,768: 16,384 + 512 + 64 + 4 + 2 x 4 + 1,024 = 17,996
    #   128 x 64 = 8,192:    4,096 + 128 + 64 + 4 + 4 + 1,024     =  5,320
    #   64 x 10 = 640:         320 +  10 + 64 + 4 + 4 + 1,024     =  1,426
    # and the biases in bf16: (128 + 64 + 10) x 2 = 404
    q = profile.load_bytes(precision="bf16", weights=QLORA)
    assert q.quantized_bytes == 16_384 + 4_096 + 320 == 20_800
    assert q.quant_state_bytes == (512 + 128 + 10) + 3 * (64 + 4 + 1_024) + (8 + 4 + 4) == 3_942
    assert q.parameter_bytes == 404
    assert q.allocated_bytes == 17_996 + 5_320 + 1_426 + 404 == 25_146
    assert dict(q.dtype_bytes) == {"nf4": 24_742, "bfloat16": 404}
    # int8: n int8 codes + one float32 scale per row, biases in bf16:
    # 41,600 + (128 + 64 + 10) x 4 + 404 = 42,812
    assert profile.load_bytes(precision="bf16", weights="int8").allocated_bytes == 42_812


def test_linear_stack_on_cuda_by_hand() -> None:
    # each tensor one 512-byte-rounded block of the caching allocator. nf4-dq: per layer the
    # codes, maxima, code, offset, nested maxima and map:
    #   16,384 + 512 + 512 + 512 + 512 + 1,024 = 19,456
    #   4,096 + 4 x 512 + 1,024                =  7,168
    #   5 x 512 + 1,024                        =  3,584
    # and 3 biases of 512: 31,744 allocated, all under 1 MiB: one 2 MiB small segment
    profile = profile_model(_stack(), input_size=(256,), device="cuda")
    q = profile.load_bytes(precision="bf16", weights=QLORA)
    assert q.allocated_bytes == 19_456 + 7_168 + 3_584 + 3 * 512 == 31_744
    assert q.rounding_bytes == 31_744 - 25_146
    assert q.reserved_bytes == 2 * 2**20
    assert q.device == "cuda"


def _built_and_quantized(model: torch.nn.Module, dtype: torch.dtype, weights: Weights | None):
    """The real load on the CPU: the model built at the dtype (a Hugging Face model from its
    config, as from_pretrained builds it; any other copied and cast by .to), its weights
    loaded, its Linear layers quantized by bitsandbytes as from_pretrained quantizes them."""

    def load() -> torch.nn.Module:
        if isinstance(model, transformers.PreTrainedModel):
            built = type(model)._from_config(copy.deepcopy(model.config), dtype=dtype)
            built.load_state_dict(model.state_dict())
        else:
            built = copy.deepcopy(model).to(dtype)
        return built if weights is None else real_quantized(built, weights)

    load()  # bitsandbytes' and torch's first-use caches made outside the measured load
    return loaded_cpu_bytes(load)


@pytest.mark.parametrize("weights", sorted(WEIGHTS))
@pytest.mark.parametrize("build", [hf_llama, hf_gpt2, _stack], ids=["llama", "gpt2", "stack"])
def test_load_equals_the_cpu_allocator(build, weights: str) -> None:
    torch.manual_seed(0)
    model = build()
    inputs = {"input_size": (256,)} if build is _stack else {"inputs": hf_tokens(2)}
    profile = profile_model(model, device="cpu", **inputs)
    before = snapshot_model(model)
    estimates = {p: profile.load_bytes(precision=p, weights=WEIGHTS[weights]) for p in DTYPES}
    assert_model_unchanged(model, before)  # nor the RNG: the estimate builds on meta
    for precision, est in estimates.items():
        with torch.random.fork_rng(devices=[]):
            _loaded, real = _built_and_quantized(model, DTYPES[precision], WEIGHTS[weights])
        assert est.allocated_bytes == real, precision


def _resident(model: torch.nn.Module) -> int:
    sizes = {}
    for t in (*model.parameters(), *model.buffers(), *module_state_tensors(model)):
        sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(sizes.values())


@pytest.mark.parametrize("build", [hf_llama, hf_gpt2, hf_t5], ids=["llama", "gpt2", "t5"])
def test_load_equals_from_pretrained(build, tmp_path) -> None:
    # Hugging Face's own loader from a saved checkpoint: its parameters, buffers (Llama's
    # rotary inv_freq stays float32 under bf16) and quant state, to the byte. T5's
    # _keep_in_fp32_modules (["wo"]) stay float32 under fp16, and are not quantized; GPT-2's
    # tied lm_head is counted once and kept unquantized
    torch.manual_seed(0)
    model = build()
    model.save_pretrained(tmp_path)
    ids = hf_tokens(2)["input_ids"]
    profile = profile_model(model, inputs={"input_ids": ids, "labels": ids}, device="cpu")
    for precision in ("fp16", "bf16"):
        for weights in (None, QLORA, Weights("int8")):
            loaded = type(model).from_pretrained(
                tmp_path, dtype=DTYPES[precision], device_map="cpu",
                quantization_config=None if weights is None else bnb_config(weights),
            )  # fmt: skip
            est = profile.load_bytes(precision=precision, weights=weights)
            assert est.allocated_bytes == _resident(loaded), (precision, weights)
            assert est.loader == "from_pretrained"


def test_from_pretrained_on_the_cpu_allocator(tmp_path) -> None:
    # on-the-fly quantization loads synchronously (no thread pool: core_model_loading.py),
    # so every allocation of the load is on this thread, where the profiler records it
    torch.manual_seed(0)
    model = hf_llama()
    model.save_pretrained(tmp_path)
    profile = profile_model(model, inputs=hf_tokens(2), device="cpu")
    for weights in (QLORA, Weights("fp4"), Weights("int8")):
        _loaded, real = loaded_cpu_bytes(
            lambda w=weights: type(model).from_pretrained(
                tmp_path, dtype=torch.bfloat16, device_map="cpu", quantization_config=bnb_config(w)
            )
        )
        assert profile.load_bytes(precision="bf16", weights=weights).allocated_bytes == real


def test_recipe_and_config_are_read_and_left_alone() -> None:
    torch.manual_seed(0)
    model = hf_llama()
    config = model.config.to_dict()
    profile = profile_model(model, inputs=hf_tokens(2), device="cpu")
    recipe = Recipe.from_keywords(precision="bf16", weights=QLORA)
    by_recipe = profile.load_bytes(recipe)
    assert by_recipe == profile.load_bytes(precision="bf16", weights=QLORA)
    assert model.config.to_dict() == config  # the build from a copy of the config
    # the 4-bit layers take less than in bf16; the embeddings, norms and lm_head are the same
    plain = profile.load_bytes(precision="bf16")
    assert by_recipe.allocated_bytes < plain.allocated_bytes
    assert by_recipe.parameter_bytes + by_recipe.buffer_bytes < plain.allocated_bytes
    with pytest.raises(ValueError, match=r"conflicts with the recipe.s step\.precision"):
        profile.load_bytes(recipe, precision="fp32")


def test_bad_input_is_refused() -> None:
    convs = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    profile = profile_model(convs, input_size=(3, 8, 8), device="cpu")
    with pytest.raises(ValueError, match="has none to quantize"):
        profile.load_bytes(weights="nf4")
    with pytest.raises(ValueError, match="unknown weights format 'int4'"):
        profile.load_bytes(weights="int4")
    with pytest.raises(ValueError, match="precision"):
        profile.load_bytes(precision="fp8")
    # torchao's to_nf4 takes weights of whole blocks x scaler blocks (64 x 256) only
    stack = profile_model(_stack(), input_size=(256,), device="cpu")
    with pytest.raises(ValueError, match=r"'nf4-torchao'.*multiple of block_size x scaler"):
        stack.load_bytes(weights="nf4-torchao")
    # int4-torchao is torchao's CPU packing
    on_cuda = profile_model(_stack(), input_size=(256,), device="cuda")
    with pytest.raises(ValueError, match="'int4-torchao' is estimated on device='cpu' only"):
        on_cuda.load_bytes(weights="int4-torchao")


TORCHAO = {"int8": Weights("int8-torchao"), "int4": Weights("int4-torchao", group_size=32)}


def _torchao_loaded(model: torch.nn.Module, dtype: torch.dtype, weights: Weights) -> int:
    """The real load with torchao: the model built at the dtype (as _built_and_quantized),
    its Linear layers quantized by torchao's own quantize_, the CPU allocator's bytes."""
    from vram_widget._profiling.torchao_weights import real_torchao

    def load() -> torch.nn.Module:
        if isinstance(model, transformers.PreTrainedModel):
            built = type(model)._from_config(copy.deepcopy(model.config), dtype=dtype)
            built.load_state_dict(model.state_dict())
        else:
            built = copy.deepcopy(model).to(dtype)
        return real_torchao(built, weights)

    load()  # torchao's and torch's first-use caches made outside the measured load
    return int(loaded_cpu_bytes(load)[1])  # type: ignore[call-overload]


def test_torchao_load_by_hand_and_on_the_cpu_allocator() -> None:
    pytest.importorskip("torchao")
    profile = profile_model(_stack(), input_size=(256,), device="cpu")
    # int8-torchao in bf16: per layer n int8 codes, one float32 scale and one int8 zero
    # point a row: 32,768 + 128 x 5 = 33,408; 8,192 + 64 x 5 = 8,512; 640 + 10 x 5 = 690;
    # the biases in bf16: (128 + 64 + 10) x 2 = 404
    est = profile.load_bytes(precision="bf16", weights="int8-torchao")
    assert est.quantized_bytes == 32_768 + 8_192 + 640
    assert est.allocated_bytes == 33_408 + 8_512 + 690 + 404 == 43_014
    assert dict(est.dtype_bytes) == {"int8-torchao": 42_610, "bfloat16": 404}
    # against torchao's real quantize_ of a loaded copy, to the byte; int4 keeps the last
    # layer (10 outputs: torch's CPU int4 packing needs a multiple of 16)
    stack_int4 = Weights("int4-torchao", group_size=32, skip_modules=("4",))
    torch.manual_seed(0)
    llama = hf_llama()
    llama_profile = profile_model(llama, inputs=hf_tokens(2), device="cpu")
    cases = [(_stack(), profile, TORCHAO["int8"]), (_stack(), profile, stack_int4)]
    cases += [(llama, llama_profile, w) for w in TORCHAO.values()]
    for model, prof, weights in cases:
        for precision in ("fp32", "bf16"):
            est = prof.load_bytes(precision=precision, weights=weights)
            real = _torchao_loaded(model, DTYPES[precision], weights)
            assert est.allocated_bytes == real, (type(model).__name__, weights, precision)
            assert est.quantized_bytes > 0


def _nf4_loaded(model: torch.nn.Module, dtype: torch.dtype, weights: Weights) -> int:
    """The real load with torchtune's FrozenNF4Linear: the model built at the dtype (as
    _torchao_loaded), each quantized Linear replaced by torchtune's own module with torchao's
    to_nf4 of its weight, the CPU allocator's bytes."""
    from vram_widget._profiling.nf4_torchao import real_nf4

    def load() -> torch.nn.Module:
        if isinstance(model, transformers.PreTrainedModel):
            built = type(model)._from_config(copy.deepcopy(model.config), dtype=dtype)
            built.load_state_dict(model.state_dict())
        else:
            built = copy.deepcopy(model).to(dtype)
        return real_nf4(built, weights, None, None, None)

    load()  # torchao's and torch's first-use caches made outside the measured load
    return int(loaded_cpu_bytes(load)[1])  # type: ignore[call-overload]


def test_nf4_torchao_load_by_hand_and_on_the_cpu_allocator() -> None:
    pytest.importorskip("torchao")
    profile = profile_model(_stack(), input_size=(256,), device="cpu")
    # blocks of 64, scaler blocks of 128, the last layer kept (640 values: no whole block).
    # In fp32, 0 (128 x 256 = 32,768 values): 16,384 B of codes (two a byte), 512 int8
    # scalers (one a block), 4 float32 factors (one a scaler block: 16 B), the float32
    # scaler mean (4) and the 16-value float32 table (64) = 16,980. 2 (64 x 128 = 8,192):
    # 4,096 + 128 scalers + one factor, held in a 128-value float32 storage as to_nf4 leaves
    # it (512: the real tensor's storage, which the fake run gives) + 4 + 64 = 4,804. The
    # biases and the kept layer in fp32: (128 + 64 + 640 + 10) x 4 = 3,368
    weights = Weights("nf4-torchao", scaler_blocksize=128, skip_modules=("4",))
    est = profile.load_bytes(precision="fp32", weights=weights)
    assert est.quantized_bytes == 16_384 + 4_096
    assert est.allocated_bytes == 16_980 + 4_804 + 3_368 == 25_152
    assert dict(est.dtype_bytes) == {"nf4-torchao": 21_784, "float32": 3_368}
    # against torchtune's FrozenNF4Linear on a loaded copy (torchao's to_nf4), to the byte
    torch.manual_seed(0)
    llama = hf_llama()
    llama_profile = profile_model(llama, inputs=hf_tokens(2), device="cpu")
    small_blocks = Weights("nf4-torchao", blocksize=32, scaler_blocksize=64)
    cases = [(_stack(), profile, weights, p) for p in ("fp32", "bf16")]
    cases.append((llama, llama_profile, small_blocks, "bf16"))
    for model, prof, w, precision in cases:
        est = prof.load_bytes(precision=precision, weights=w)
        real = _nf4_loaded(model, DTYPES[precision], w)
        assert est.allocated_bytes == real, (type(model).__name__, precision)
        assert est.quantized_bytes > 0


def test_shown_in_the_cli_and_the_widget(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from vram_widget._display.cli import main
    from vram_widget._display.widget import MemoryWidget

    # the command line: a line of text, and load_bytes in the JSON; zoo.mlp on the CPU in
    # bf16: (784 x 512 + 512 + 512 x 512 + 512 + 512 x 10 + 10) = 669,706 values x 2 B
    assert main(["mlp", "--device", "cpu", "--precision", "bf16", "--json"]) == 0
    setting = json.loads(capsys.readouterr().out)["settings"][0]
    assert setting["load_bytes"] == setting["load_reserved_bytes"] == 1_339_412
    assert main(["mlp", "--device", "cpu", "--precision", "bf16"]) == 0
    assert "loaded (bf16 weights, model.to): 1.3 MiB allocated" in capsys.readouterr().out
    # the widget's details: the same estimate as load_bytes for its precision and weights
    torch.manual_seed(0)
    profile = profile_model(_stack(), input_size=(256,), device="cpu")
    widget = MemoryWidget(profile, precision="bf16", mode="inference", batch_size=4)
    rows = dict(widget._detail_rows(widget._estimate))  # the opening setting's, made at once
    assert rows["Loaded"] == profile.load_bytes(precision="bf16").summary()
    # new weights are a profiling run (the busy label): their loaded layout is made in it
    assert not profile.load_is_cached(precision="bf16", weights=QLORA)
    widget.weights = "nf4-dq"
    assert profile.load_is_cached(precision="bf16", weights=QLORA)
    rows = dict(widget._detail_rows(widget._estimate))
    assert rows["Loaded"] == profile.load_bytes(precision="bf16", weights=QLORA).summary()
    # another move does not make it (a new precision profiles its step, not the loaded
    # layout): the row names what gives it
    widget.precision = "fp16"
    assert not profile.load_is_cached(precision="fp16", weights=QLORA)
    rows = dict(widget._detail_rows(widget._estimate))
    assert rows["Loaded"].startswith("profile.load_bytes(")
