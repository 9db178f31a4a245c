"""Float8 training (``float8=True | "tensorwise" | "rowwise"``): the estimate from the plain
model's profile against torchao's real converted model (``convert_to_float8_training``,
``emulate=True``) stepped on the CPU, to the byte; and the settings refused before any
profiling."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from models import assert_model_unchanged, hf_llama, hf_tokens, mlp_input, snapshot_model

from vram_widget import Float8, Recipe, measure, profile_model, zoo

pytest.importorskip("torchao")
pytest.importorskip("transformers")

RECIPES = ("tensorwise", "rowwise")
PRECISIONS = ("fp32", "bf16")


def _mlp() -> torch.nn.Module:
    """The zoo MLP with every Linear dim a multiple of 16 (64 -> 128 -> 128 -> 32)."""
    torch.manual_seed(0)
    return zoo.mlp(in_features=64, hidden=(128, 128), num_classes=32)


def _gpt2() -> torch.nn.Module:
    """GPT-2 of 2 layers of 64 with a vocabulary of 1,024 (its one nn.Linear, the output
    layer, is 1024 x 64; the others are transformers' Conv1D, which torchao leaves)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=1024, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _gpt2_tokens(batch: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1024, (batch, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_one_linear_by_hand() -> None:
    # nn.Linear(64, 32, bias=False), fp32, SGD (no state), batch 4, tensorwise on the CPU.
    # Resident: the weight 32 x 64 x 4 B = 8,192 and the input 4 x 64 x 4 B = 1,024.
    # Float8Linear keeps the weight as the parameter, so its gradient is 8,192 B as for a
    # plain Linear, and autograd saves the input and a view of the weight (no new bytes).
    # The peak is in the backward's grad_input matmul (torchao's emulated float8 mm,
    # float8_ops.py: torch.mm(a._data.float() / a._scale, b._data.float() / b._scale)):
    #   the weight cast to e4m3 again                      32 x 64 x 1 =  2,048
    #   its column-major copy (preprocess_addmm)           32 x 64 x 1 =  2,048
    #   the weight's float32 copy and that divided by its scale  2 x 8,192 = 16,384
    #   the output gradient (float32) and its e5m2 cast     512 + 128   =    640
    #   the output gradient divided by its scale            4 x 32 x 4  =    512
    #   the model's output, kept                            4 x 32 x 4  =    512
    #   four float32 scalars (the loss, its gradient, the two scales)   =     16
    # = 22,160 above the resident 9,216: 31,376. A plain Linear's step peaks at 18,440.
    model = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(4, 64)
    profile = profile_model(model, input_size=(64,), device="cpu")
    plain = profile.estimate(4, optimizer="sgd")
    est = profile.estimate(4, optimizer="sgd", float8=True)
    assert (est.parameter_bytes, est.gradient_bytes, est.activation_bytes) == (8192, 8192, 0)
    assert est.peak_bytes == 9216 + 22160 == 31376
    assert plain.peak_bytes == 18440
    assert measure(model, x, optimizer="sgd", float8=True).peak_bytes == est.peak_bytes
    assert est.float8 == "float8 tensorwise (torchao Float8Linear)"


@pytest.fixture(scope="module")
def mlp_profile() -> tuple[torch.nn.Module, Any]:
    """``_mlp()`` and its CPU profile, shared by the tests that estimate float8 steps: one
    profile serves every recipe and precision (its float8 sub-profile is made once per
    recipe, as for a user who moves between them)."""
    model = _mlp()
    return model, profile_model(model, input_size=(64,), device="cpu")


@pytest.fixture(scope="module")
def plain_mlp_profile() -> Any:
    """A CPU profile of ``_mlp()`` that no test estimates a float8 step from: the refusals
    share it, and each checks that it still holds no float8 sub-profile."""
    return profile_model(_mlp(), input_size=(64,), device="cpu")


@pytest.fixture(scope="module")
def hf_profiles() -> dict[str, tuple[torch.nn.Module, Any]]:
    """Each Hugging Face model of ``test_hf_matches_torchao`` and its CPU profile, made on
    first use and shared by that model's (precision, recipe) cases and the refusals."""
    return {}


def _hf_profile(
    profiles: dict[str, tuple[torch.nn.Module, Any]], name: str
) -> tuple[torch.nn.Module, Any]:
    if name not in profiles:
        torch.manual_seed(0)
        model, tokens = (hf_llama(), hf_tokens) if name == "llama" else (_gpt2(), _gpt2_tokens)
        profiles[name] = model, profile_model(model, inputs=tokens(2), device="cpu")
    return profiles[name]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_mlp_matches_torchao(
    recipe: str, precision: str, mlp_profile: tuple[torch.nn.Module, Any]
) -> None:
    model, profile = mlp_profile
    before = snapshot_model(model)
    for batch in (1, 4):
        est = profile.estimate(batch, precision=precision, optimizer="adamw", float8=recipe)
        real = measure(
            model, mlp_input(batch, 64), optimizer="adamw", precision=precision, float8=recipe
        )
        assert est.peak_bytes == real.peak_bytes, (batch, est.peak_bytes, real.peak_bytes)
    assert_model_unchanged(model, before)


# each model with both recipes and both precisions, each (precision, recipe) pair on one
# model: four of the eight combinations, for the suite's time (each takes 20-50 s)
@pytest.mark.parametrize(
    ("name", "precision", "recipe"),
    [
        ("llama", "bf16", "tensorwise"),
        ("llama", "fp32", "rowwise"),
        ("gpt2", "bf16", "rowwise"),
        ("gpt2", "fp32", "tensorwise"),
    ],
)
def test_hf_matches_torchao(
    name: str,
    precision: str,
    recipe: str,
    hf_profiles: dict[str, tuple[torch.nn.Module, Any]],
) -> None:
    if name == "llama":  # a vocabulary of 1,000: its output layer kept, as torchtitan does
        tokens, float8 = hf_tokens, Float8(recipe, filter_fqns="lm_head")
    else:
        tokens, float8 = _gpt2_tokens, Float8(recipe)
    model, profile = _hf_profile(hf_profiles, name)
    recipe_ = Recipe().with_(precision=precision, optimizer="adamw", float8=float8)
    for batch in (1, 4):
        est = profile.estimate(recipe=recipe_.with_(batch_size=batch))
        real = measure(model, tokens(batch), recipe=recipe_)
        assert est.peak_bytes == real.peak_bytes, (batch, est.peak_bytes, real.peak_bytes)
        plain = profile.estimate(recipe=recipe_.with_(batch_size=batch, float8=None))
        # the parameters, gradients and optimizer state are the precision's either way
        assert est.parameter_bytes == plain.parameter_bytes
        assert est.gradient_bytes == plain.gradient_bytes
        assert est.optimizer_state_bytes == plain.optimizer_state_bytes


def test_float8_costs_memory_at_batch_4(mlp_profile: tuple[torch.nn.Module, Any]) -> None:
    # torchao issues #1102 / #2262: the casts come on top of what a plain step keeps
    _, profile = mlp_profile
    plain = profile.estimate(4, precision="bf16", optimizer="adamw")
    assert profile.estimate(4, precision="bf16", optimizer="adamw", float8=True).peak_bytes > (
        plain.peak_bytes
    )


def test_cuda_profile_takes_scaled_mm_path() -> None:
    # device="cuda": torchao's _scaled_mm writes the output in its dtype, without the
    # emulation's float32 copies; it runs on fake tensors and gives its own number
    profile = profile_model(_mlp(), input_size=(64,), device="cuda")
    est = profile.estimate(4, precision="bf16", optimizer="adamw", float8="rowwise")
    assert est.peak_bytes > profile.estimate(4, precision="bf16", optimizer="adamw").peak_bytes
    assert est.float8.startswith("float8 rowwise")


def test_indivisible_layers_are_named_before_profiling() -> None:
    model = zoo.mlp()  # 784 -> 512 -> 512 -> 10: the last layer's 10 is no multiple of 16
    profile = profile_model(model, input_size=(784,), device="cpu")
    with pytest.raises(ValueError, match=r"6 \(10 x 512\).*filter_fqns=\('6',\)"):
        profile.estimate(4, float8=True)
    assert not profile._float8_profiles  # nothing profiled
    with pytest.raises(ValueError, match=r"6 \(10 x 512\)"):
        measure(model, torch.randn(2, 784), float8=True)
    kept = profile.estimate(4, float8=Float8(True, filter_fqns="6"))
    assert kept.peak_bytes > 0


def test_llama_output_layer_is_refused_by_name(
    hf_profiles: dict[str, tuple[torch.nn.Module, Any]],
) -> None:
    _, profile = _hf_profile(hf_profiles, "llama")
    with pytest.raises(ValueError, match=r"lm_head \(1000 x 64\)"):
        profile.estimate(1, float8="rowwise")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mode": "inference"}, "Float8DynamicActivationFloat8WeightConfig"),
        ({"mode": "generate"}, "has no backward"),
        ({"weights": "nf4"}, "choose one of the two"),
        ({"precision": "amp-bf16"}, "autocast"),
        ({"lora_rank": 8, "lora_targets": ["0"]}, "LoRA"),
        ({"float8_all_gather": True}, "gpus=1 gathers nothing"),
        (
            {
                "gpus": 2,
                "strategy": "zero3",
                "float8_all_gather": True,
                "checkpoint": "auto",
                "checkpoint_policy": "op",
            },
            r"float8_all_gather=True with checkpoint_policy: not estimated yet.*'zero2', 'zero3'",
        ),
        (
            {"gpus": 2, "strategy": "zero3", "float8_all_gather": True, "clip_grad_norm": 1.0},
            "with clip_grad_norm: not estimated yet",
        ),
        ({"gpus": 2, "strategy": "zero1", "float8_all_gather": True}, "all-gather is FSDP2's"),
        ({"gpus": 2, "strategy": "ddp", "pp": 2}, "without tp, pp, ep or cp"),
    ],
)
def test_refused_steps(settings: dict[str, object], message: str, plain_mlp_profile: Any) -> None:
    profile = plain_mlp_profile
    with pytest.raises(ValueError, match=message):
        profile.estimate(1, float8=True, **settings)
    assert not profile._float8_profiles


def test_measure_refuses_inference() -> None:
    with pytest.raises(ValueError, match="float8 training"):
        measure(_mlp(), mlp_input(2, 64), mode="inference", float8=True)


def test_unknown_recipe() -> None:
    with pytest.raises(ValueError, match=r"'tensorwise'.*'rowwise'"):
        Recipe().with_(float8="blockwise")


def test_torchao_missing(monkeypatch: pytest.MonkeyPatch, plain_mlp_profile: Any) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match="pip install torchao"):
        plain_mlp_profile.estimate(1, float8=True)
    assert not plain_mlp_profile._float8_profiles


def test_recipe_conflict_names_both(plain_mlp_profile: Any) -> None:
    recipe = Recipe().with_(float8="rowwise")
    with pytest.raises(ValueError, match=r"float8='tensorwise' conflicts.*'rowwise'"):
        plain_mlp_profile.estimate(recipe=recipe, float8="tensorwise")
    assert not plain_mlp_profile._float8_profiles


def test_float8_all_gather_settings() -> None:
    # torchao all-gathers float8 with the tensorwise recipe only (config.py's assert), and
    # the setting means nothing with float8 off
    assert Recipe().with_(float8=True, float8_all_gather=True).float8 == Float8(
        "tensorwise", all_gather=True
    )
    with pytest.raises(ValueError, match="tensorwise' recipe only"):
        Float8("rowwise", all_gather=True)
    with pytest.raises(ValueError, match="float8 is off"):
        Recipe().with_(float8_all_gather=True)
    with pytest.raises(TypeError, match="True or False"):
        Float8(True, all_gather="yes")  # type: ignore[arg-type]


def test_measure_refuses_float8_all_gather_outside_fsdp2() -> None:
    # refused before any rank starts: DDP has no all-gather of the weights
    with pytest.raises(ValueError, match="all-gather is FSDP2's"):
        measure(_mlp(), mlp_input(2, 64), gpus=2, strategy="ddp", float8=True,
                float8_all_gather=True)  # fmt: skip


def _blocks() -> torch.nn.Module:
    """Three bias-free Linear layers (64 -> 96 -> 96 -> 64), each its own FSDP2 unit
    (``fsdp_units=UNITS``): a unit's only all-gather input is then a float8 weight."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96, bias=False), torch.nn.ReLU(),
        torch.nn.Linear(96, 96, bias=False), torch.nn.ReLU(),
        torch.nn.Linear(96, 64, bias=False),
    )  # fmt: skip


UNITS = ["0", "2", "4"]


@pytest.mark.timeout(300)
def test_fsdp2_ranks_against_their_estimate(one_thread: None) -> None:
    # float8 under FSDP2 (zero3, fp32 AdamW) on two real gloo ranks: torchao converts each
    # rank's copy, then fully_shard wraps it; the estimate is the float8 profile under
    # FSDP2's rule, and every rank's measured step is it
    model = _blocks()
    x = mlp_input(4, 64)
    before = snapshot_model(model)
    profile = profile_model(model, inputs=x, device="cpu")
    asked = {"optimizer": "adamw", "gpus": 2, "strategy": "zero3", "fsdp_units": UNITS}
    real = measure(model, x, float8=True, **asked)
    est = profile.estimate(4, float8=True, **asked)
    for peak in real.rank_peak_bytes:
        assert est.peak_bytes == peak, (est.peak_bytes, peak)
    # float8 costs memory on each rank, as on one device (the casts; test above)
    assert est.peak_bytes > profile.estimate(4, **asked).peak_bytes
    # DDP, ZeRO-1 and HSDP wrap the converted model too (ZeRO-1's ranks differ: the worst;
    # HSDP on 2 nodes of 2 ranks, sharded within a node)
    others = [
        {**asked, "strategy": "ddp", "fsdp_units": None},
        {**asked, "strategy": "zero1", "fsdp_units": None},
        {**asked, "strategy": "hsdp", "gpus": 4, "gpus_per_node": 2},
    ]
    for other in others:
        peak = measure(model, x, float8=True, **other).peak_bytes
        assert profile.estimate(4, float8=True, **other).peak_bytes == peak, other

    assert_model_unchanged(model, before)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("strategy", "precision"), [("zero3", "fp32"), ("zero3", "bf16"), ("zero2", "bf16")]
)
def test_float8_all_gather_ranks_against_their_estimate(
    strategy: str, precision: str, one_thread: None
) -> None:
    # float8_all_gather under FSDP2 (zero3 or zero2, AdamW, 2 gloo ranks): each unit's only
    # all-gather input is float8, which gloo moves as uint8 views. The estimate runs the
    # rank's own step (torchao + fully_shard on the fake process group); every real rank
    # peaks at it to the byte
    model = _blocks()
    x = mlp_input(4, 64)
    before = snapshot_model(model)
    profile = profile_model(model, inputs=x, device="cpu")
    asked = {"optimizer": "adamw", "gpus": 2, "strategy": strategy, "fsdp_units": UNITS,
             "precision": precision}  # fmt: skip
    gathered = measure(model, x, float8=True, float8_all_gather=True, **asked)
    est = profile.estimate(4, float8=True, float8_all_gather=True, **asked)
    assert gathered.rank_peak_bytes == (est.peak_bytes, est.peak_bytes)
    # the gathered weights take 1 B a value instead of the precision's and are not cast
    # again: below the high-precision gather's estimate (which its real ranks match)
    high = profile.estimate(4, float8=True, **asked)
    assert est.peak_bytes < high.peak_bytes
    # resident, by hand: the 21,504 weights' shards in the precision's dtype (half each),
    # AdamW's two states like them, its 3 float32 step counters, the 4 x 64 input, and
    # FSDP2's unsharded float8 weight of each of the 3 layers keeping its last float32
    # scale: fp32 43,008 + 86,016 + 12 + 1,024 + 12 = 130,072;
    #        bf16 21,504 + 43,008 + 12 + 512 + 12 = 65,048
    size = {"fp32": 4, "bf16": 2}[precision]
    shard = 21_504 * size // 2
    assert gathered.resident_bytes == shard + 2 * shard + 12 + 4 * 64 * size + 3 * 4
    # bytes sent, by hand (2 ranks: an all-gather or reduce-scatter sends half its full
    # payload, an all-reduce 2 x 1/2 of it). The 21,504 weights are gathered at 1 B each
    # once in the forward, and under zero3 again for the backward: zero3 2 x 21,504 / 2 =
    # 21,504, zero2 10,752. Gradients are reduce-scattered once in the precision's dtype:
    # 21,504 x 4 / 2 = 43,008 in fp32, 21,504 in bf16. Before each of the 3 layers' gathers
    # its amax (one value in the precision's dtype) is all-reduced: zero3 fp32 6 x 4 = 24 B,
    # bf16 6 x 2 = 12 B; zero2 bf16 3 x 2 = 6 B.
    gathers = 2 if strategy == "zero3" else 1
    by_kind = {str(k): v for k, v in est.communication_sent_bytes_by_kind.items()}
    assert by_kind == {"all_gather": gathers * 21_504 // 2,
                       "reduce_scatter": 21_504 * size // 2,
                       "all_reduce": 3 * gathers * size}  # fmt: skip
    assert est.float8 == Float8(True, all_gather=True).describe()
    assert_model_unchanged(model, before)


class _Stack(torch.nn.Module):
    """Two blocks of two bias-free Linear layers (64 -> 96 -> 64) in a ModuleList: the
    blocks are what ``checkpoint="auto"`` checkpoints and FSDP2's units by default."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(64, 96, bias=False),
                torch.nn.ReLU(),
                torch.nn.Linear(96, 64, bias=False),
            )
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.timeout(300)
def test_float8_all_gather_with_checkpoint_and_accumulation(one_thread: None) -> None:
    # checkpoint="auto" (both blocks) and 2 accumulated micro-batches under zero3 with the
    # float8 all-gather (fp32 AdamW, 2 gloo ranks): measure checkpoints the converted copy
    # and accumulates as the rank's fake run does; the real ranks peak at it to the byte
    model = _Stack()
    x = mlp_input(4, 64)
    profile = profile_model(model, inputs=x, device="cpu")
    asked = {"optimizer": "adamw", "gpus": 2, "strategy": "zero3", "checkpoint": "auto",
             "grad_accumulation": 2, "float8": True, "float8_all_gather": True}  # fmt: skip
    real = measure(model, x, **asked)
    est = profile.estimate(4, **asked)
    assert real.rank_peak_bytes == (est.peak_bytes, est.peak_bytes)
    # the levers are in the run: the plain step peaks elsewhere
    plain = {k: v for k, v in asked.items() if k not in ("checkpoint", "grad_accumulation")}
    assert est.peak_bytes != profile.estimate(4, **plain).peak_bytes


def test_float8_all_gather_on_cuda_profile() -> None:
    # device="cuda" (UNCONFIRMED on a GPU): the rank runs torchao's _scaled_mm path with
    # CUDA's kernel choices, without gloo's staging copies or the CPU's float32 copies of
    # each float8 operand, and counts 512-byte allocator blocks. zero3 over 2 ranks, fp32
    # AdamW, the three Linear layers of _blocks() (21,504 weights) each a unit.
    asked = {"optimizer": "adamw", "gpus": 2, "strategy": "zero3", "fsdp_units": UNITS}
    cuda = profile_model(_blocks(), input_size=(64,), device="cuda")
    est = cuda.estimate(4, float8=True, float8_all_gather=True, **asked)
    cpu = profile_model(_blocks(), input_size=(64,), device="cpu")
    on_cpu = cpu.estimate(4, float8=True, float8_all_gather=True, **asked)
    # NCCL and gloo send the same bytes; the CUDA step has none of the CPU's extra copies
    assert est.communication_sent_bytes_by_kind == on_cpu.communication_sent_bytes_by_kind
    assert est.peak_bytes < on_cpu.peak_bytes
    # the allocated basis is the rank's peak of 512-byte blocks: a multiple of 512
    assert est.extras.allocator_rounding_bytes > 0
    assert (est.peak_bytes + est.extras.allocator_rounding_bytes) % 512 == 0
    # no allocation stream of the rank's to replay: no reserved figure, and a capacity is
    # compared on the allocated basis
    assert est.reserved_bytes is None and est.device_bytes is None
    assert est.fits(est.total_bytes) and not est.fits(est.total_bytes - 1)
    assert "UNCONFIRMED" in est.float8 and est.float8.startswith(
        Float8(True, all_gather=True).describe()
    )
    # resident, by hand (as the CPU rank's test): shards 43,008 + AdamW's states 86,016 +
    # 3 step counters of 4 B + the 4 x 64 fp32 input 1,024 + 3 float32 scales of 4 B =
    # 130,072 B; as blocks, each step counter and scale takes 512 B (the shards, states
    # and input are multiples of 512): 43,008 + 86,016 + 1,536 + 1,024 + 1,536 = 133,120
    recipe = Recipe.from_keywords(batch_size=4, float8=True, float8_all_gather=True, **asked)
    _, question = cuda._float8_all_gather_question(recipe)
    assert cuda._source.float8_fsdp_cached(*question)  # the estimate's own run, kept
    ran = cuda._source.float8_fsdp_step(*question)
    assert (ran.resident_bytes, ran.block_resident_bytes) == (130_072, 133_120)
