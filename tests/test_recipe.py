"""The Recipe (one value per setup) and the optimizer implementations (fused, foreach,
for-loop), checked against torch.optim's real step on the CPU."""

from __future__ import annotations

import pytest
import torch
from models import assert_optimizers_match_cpu_step
from torch import nn

from vram_widget import Recipe, measure, profile_model
from vram_widget._estimating.options import parse_optimizer_choice


def _linear_profile(device: str):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    return model, profile_model(model, input_size=(8,), device=device)


def test_fused_adamw_on_one_linear_by_hand() -> None:
    model, profile = _linear_profile("cpu")
    est = profile.estimate(2, optimizer="adamw-fused")
    # weight 4 x 8 + bias 4 = 36 floats = 144 B; gradients the same 144 B;
    # exp_avg + exp_avg_sq = 2 x 144 = 288 B; fused keeps each parameter's ``step`` as a
    # float32 0-dim tensor on the parameter's device (torch/optim/adam.py, _init_group):
    # 2 x 4 = 8 B. State: 288 + 8 = 296 B.
    assert est.parameter_bytes == 144
    assert est.gradient_bytes == 144
    assert est.optimizer_state_bytes == 296
    assert est.optimizer_implementation == "fused"
    # _fused_adamw_ updates in place: the step allocates no temporaries, so the optimizer
    # phase never rises above what is resident: 144 + 144 + 296 + the 2 x 8 x 4 = 64 B input
    assert est.peak_bytes == measure(model, torch.randn(2, 8), optimizer="adamw-fused").peak_bytes


def test_step_counters_on_cuda_only_when_fused() -> None:
    _model, profile = _linear_profile("cuda")
    # foreach (CUDA's default): the counters stay on the host (adam.py, _init_group), so the
    # device holds exp_avg + exp_avg_sq only: 2 x 144 = 288 B; fused adds 2 x 4 B on the device
    assert profile.estimate(2, optimizer="adamw").optimizer_state_bytes == 288
    assert profile.estimate(2, optimizer="adamw").optimizer_implementation == "foreach"
    assert profile.estimate(2, optimizer="adamw-fused").optimizer_state_bytes == 296


def test_plain_name_is_torch_default_on_the_device() -> None:
    _model, cpu = _linear_profile("cpu")
    assert cpu.estimate(2, optimizer="adamw").optimizer_implementation == "forloop"
    assert cpu.estimate(2, optimizer=None).optimizer_implementation is None
    assert cpu.estimate(2, mode="inference").optimizer_implementation is None


# fused and for-loop runs are exact to the byte against torch's real CPU step; SGD's
# foreach step too (Adam's CPU foreach step is left out: its host scalars, such as the
# ``torch.tensor(1.0)`` that adam.py's _multi_tensor_adam adds to CPU step counters, are
# not in the meta trace)
IMPLEMENTATIONS = [
    "adamw-fused", "adamw-forloop", "adam-fused", "adam-forloop",
    "sgd-fused", "sgd-forloop", "sgd-foreach",
    "sgd-momentum-fused", "sgd-momentum-forloop", "sgd-momentum-foreach",
]  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ["mlp", "gpt2"])
def test_implementations_match_a_real_cpu_step(case: str, precision: str) -> None:
    assert_optimizers_match_cpu_step(case, precision, IMPLEMENTATIONS)


def test_unknown_optimizer_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"'sgd-momentum-forloop'.*'adamw-fused'"):
        parse_optimizer_choice("adamw-turbo")
    _model, profile = _linear_profile("cpu")
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop-fused'"):
        profile.estimate(2, optimizer="rmsprop-fused")


def test_recipe_and_keywords_give_the_same_estimate() -> None:
    _model, profile = _linear_profile("cpu")
    recipe = Recipe.from_keywords(batch_size=3, precision="bf16", optimizer="sgd-fused")
    by_recipe = profile.estimate(recipe=recipe)
    by_keywords = profile.estimate(3, "bf16", "sgd-fused")
    assert by_recipe.peak_bytes == by_keywords.peak_bytes
    assert by_recipe.batch_size == 3 and by_recipe.optimizer_implementation == "fused"
    # a keyword that agrees with the recipe is fine; one that conflicts names both
    assert profile.estimate(recipe=recipe, precision="bf16").peak_bytes == by_recipe.peak_bytes
    with pytest.raises(ValueError, match=r"precision='fp16'.*step.precision='bf16'"):
        Recipe.from_keywords(recipe, precision="fp16")
    with pytest.raises(ValueError, match=r"optimizer='sgd'.*optimizer='sgd-fused'"):
        profile.estimate(recipe=recipe, optimizer="sgd")


def test_searches_take_a_recipe() -> None:
    _model, profile = _linear_profile("cpu")
    recipe = Recipe.from_keywords(optimizer="adamw-fused", batch_size=7)
    best = profile.max_batch_size("2 MiB", recipe=recipe)
    assert best == profile.max_batch_size("2 MiB", optimizer="adamw-fused")
    assert profile.estimate(recipe=recipe.with_(batch_size=best)).fits(2 * 2**20)
    assert not profile.estimate(recipe=recipe.with_(batch_size=best + 1)).fits(2 * 2**20)


def test_recipe_is_frozen_and_hashable() -> None:
    recipe = Recipe.from_keywords(checkpoint=["a", "b"], gpus=4, strategy="zero3")
    assert recipe.levers.checkpoint == ("a", "b")
    assert hash(recipe) == hash(
        Recipe.from_keywords(checkpoint=("a", "b"), gpus=4, strategy="zero3")
    )
    with pytest.raises(AttributeError):
        recipe.step = recipe.step  # type: ignore[misc]
    with pytest.raises(TypeError, match="unknown recipe setting 'batch'"):
        recipe.with_(batch=2)
