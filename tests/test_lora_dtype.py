"""The LoRA adapters' dtype (``lora_dtype``): PEFT's fp32 default, the base's own dtype
(``"base"``, as torchtune keeps them) or one named, against PEFT's real CPU step."""

from __future__ import annotations

import pytest
import torch
from models import assert_model_unchanged, hf_gpt2, hf_llama, hf_tokens, snapshot_model

from vram_widget import ModelProfile, Recipe, measure, profile_model

pytest.importorskip("peft")
pytest.importorskip("transformers")

BUILDS = {"llama": hf_llama, "gpt2": hf_gpt2}


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, ModelProfile]:
    torch.manual_seed(0)
    model = hf_llama()
    return model, profile_model(model, inputs=hf_tokens(2), device="cpu")


def test_adapter_bytes_by_hand(llama: tuple[torch.nn.Module, ModelProfile]) -> None:
    # PEFT's default Llama targets are q_proj and v_proj. Rank 4, hidden 64, 4 heads of 16
    # over 2 key/value heads: q_proj 64 -> 64 has A 4 x 64 + B 64 x 4 = 512 parameters,
    # v_proj 64 -> 32 has A 4 x 64 + B 32 x 4 = 384; 2 layers: 2 x 896 = 1,792 adapter
    # parameters. On a bf16 base PEFT keeps them in fp32 (4 B), "base" in bf16 (2 B):
    # 1,792 x 2 = 3,584 B less for the parameters, as much for their gradients, and
    # AdamW's two moments (in the parameters' dtype) 2 x 3,584 = 7,168 B less.
    _model, profile = llama
    peft = profile.estimate(2, "bf16", "adamw", lora_rank=4)
    base = profile.estimate(2, "bf16", "adamw", lora_rank=4, lora_dtype="base")
    fp32 = profile.estimate(2, "bf16", "adamw", lora_rank=4, lora_dtype="fp32")
    assert peft.parameter_bytes - base.parameter_bytes == 1792 * 2 == 3584
    assert peft.gradient_bytes - base.gradient_bytes == 3584
    # the step counts stay fp32 0-dim tensors whatever the dtype (torch/optim/adamw.py)
    assert peft.optimizer_state_bytes - base.optimizer_state_bytes == 2 * 3584
    assert fp32.peak_bytes == peft.peak_bytes  # None is PEFT's fp32
    # "bf16" named on a bf16 base is the base's dtype
    bf16 = profile.estimate(2, "bf16", "adamw", lora_rank=4, lora_dtype="bf16")
    assert bf16.peak_bytes == base.peak_bytes


@pytest.fixture(scope="module")
def profiles(
    llama: tuple[torch.nn.Module, ModelProfile],
) -> dict[str, tuple[torch.nn.Module, ModelProfile]]:
    """Each of ``BUILDS`` (seeded) and its CPU profile, made once per module on first use:
    one profile serves every adapter dtype."""
    return {"llama": llama}


@pytest.mark.parametrize("name", sorted(BUILDS))
@pytest.mark.parametrize("dtype", [None, "base", "fp16"])
def test_lora_dtype_estimate_equals_peft_step(
    name: str, dtype: str | None, profiles: dict[str, tuple[torch.nn.Module, ModelProfile]]
) -> None:
    # PEFT's get_peft_model on measure()'s bf16 copy: its default (fp32 adapters),
    # autocast_adapter_dtype=False (bf16 adapters), or that and the adapters cast to fp16;
    # the CPU step's peak to the byte, at two batches
    if name not in profiles:
        torch.manual_seed(0)
        model = BUILDS[name]()
        profiles[name] = model, profile_model(model, inputs=hf_tokens(2), device="cpu")
    model, profile = profiles[name]
    before = snapshot_model(model)
    for batch in (1, 4):
        est = profile.estimate(batch, "bf16", "adamw", lora_rank=4, lora_dtype=dtype)
        real = measure(
            model, hf_tokens(batch), optimizer="adamw", precision="bf16", lora_rank=4,
            lora_dtype=dtype,
        )  # fmt: skip
        assert est.peak_bytes == real.peak_bytes, (name, dtype, batch)
    assert_model_unchanged(model, before)


def test_lora_dtype_by_recipe_is_the_same(llama: tuple[torch.nn.Module, ModelProfile]) -> None:
    model, profile = llama
    recipe = Recipe.from_keywords(
        batch_size=2, precision="bf16", optimizer="adamw", lora_rank=4, lora_dtype="base"
    )
    by_recipe = profile.estimate(recipe=recipe)
    assert (
        by_recipe.peak_bytes
        == profile.estimate(2, "bf16", "adamw", lora_rank=4, lora_dtype="base").peak_bytes
    )
    assert measure(model, hf_tokens(2), recipe=recipe).peak_bytes == by_recipe.peak_bytes


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lora_rank": 4, "lora_dtype": "int8"}, "lora_dtype must be None"),
        ({"lora_dtype": "bf16"}, "no adapters are asked for"),
    ],
)
def test_bad_lora_dtype_is_named(
    llama: tuple[torch.nn.Module, ModelProfile], settings: dict[str, object], message: str
) -> None:
    model, profile = llama
    with pytest.raises(ValueError, match=message):
        profile.estimate(2, "bf16", "adamw", **settings)
    with pytest.raises(ValueError, match=message):
        measure(model, hf_tokens(2), optimizer="adamw", precision="bf16", **settings)  # type: ignore[arg-type]
