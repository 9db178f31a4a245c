"""How the step holds its outputs, its loss and its gradients' norm, and how its optimizer
groups the parameters (the Hugging Face Trainer's and torchtune's step): each estimate
checked by hand or against the real CPU step that ``measure`` runs the same way, to the
byte."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import hf_gpt2, hf_llama, hf_tokens
from torch import nn

from vram_widget import Recipe, measure, profile_model, zoo
from vram_widget._profiling.param_groups import decay_parameter_names, trainer_groups


def _linear_relu() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 10, bias=False), nn.ReLU())


def test_freed_outputs_leave_the_backward_by_hand() -> None:
    model, x = _linear_relu(), torch.randn(2, 4)
    profile = profile_model(model, inputs=x, device="cpu")
    kept = profile.estimate(2, optimizer="sgd")
    freed = profile.estimate(2, optimizer="sgd", outputs="freed")
    # Resident: weight 10 x 4 x 4 B = 160, input 2 x 4 x 4 B = 32: 192 B. Forward: the
    # Linear's output 2 x 10 x 4 = 80 B (freed once ReLU is done: only ReLU's output is
    # saved), ReLU's output y 80 B, the mean loss 4 B. Backward: the seed 4 B (held by
    # backward() to its end), the mean's gradient 80 B, ReLU's gradient 80 B (the mean's
    # freed after), then the weight's gradient 160 B:
    # kept: 192 + y 80 + loss 4 + seed 4 + 80 + 160 = 520 B.
    assert (kept.peak_bytes, kept.peak_phase.value) == (520, "backward")
    # freed: the step drops y after the loss; ReLU's saved y goes once ReLU's backward ran,
    # before the weight's gradient exists: 520 - 80 = 440 B.
    assert (freed.peak_bytes, freed.peak_phase.value) == (440, "backward")
    assert freed.levers.outputs_freed and not kept.levers.outputs_freed
    for outputs, est in (("kept", kept), ("freed", freed)):
        real = measure(model, x, optimizer="sgd", outputs=outputs)
        assert real.peak_bytes == est.peak_bytes


def test_scaled_loss_is_one_more_scalar_through_the_backward_by_hand() -> None:
    model, x = _linear_relu(), torch.randn(2, 4)
    profile = profile_model(model, inputs=x, device="cpu")
    scaled = profile.estimate(2, optimizer="sgd", loss_scaled=True)
    # as above (520 B), with loss / 1 (4 B) held through the backward beside the loss
    assert (scaled.peak_bytes, scaled.peak_phase.value) == (524, "backward")
    assert measure(model, x, optimizer="sgd", loss_scaled=True).peak_bytes == 524


def test_carried_scalars_start_the_step_by_hand() -> None:
    model, x = _linear_relu(), torch.randn(2, 4)
    profile = profile_model(model, inputs=x, device="cpu")
    est = profile.estimate(2, optimizer="sgd", carried_scalars=True)
    # as in the first test (520 B), with the previous step's loss (4 B) alive until this
    # step's backward has run: 524 B
    assert (est.peak_bytes, est.peak_phase.value) == (524, "backward")
    real = measure(model, x, optimizer="sgd", carried_scalars=True)
    # the measured step starts with the first step's loss: 192 + 4 B resident
    assert (real.peak_bytes, real.resident_bytes) == (524, 196)


def _mlp() -> tuple[nn.Module, Callable[[int], Any]]:
    return zoo.mlp(), lambda b: torch.randn(b, 784, generator=torch.Generator().manual_seed(b))


def _gpt2() -> tuple[nn.Module, Callable[[int], Any]]:
    return hf_gpt2(), hf_tokens


PROTOCOLS = [
    {"outputs": "freed"},
    {"outputs": "freed", "loss_scaled": True, "clip_grad_norm": 1.0,
     "param_groups": "decay-split", "carried_scalars": True},
]  # fmt: skip


@pytest.mark.parametrize("make", [_mlp, _gpt2], ids=["mlp", "gpt2"])
@pytest.mark.parametrize("settings", PROTOCOLS, ids=["freed", "trainer"])
def test_estimate_is_the_real_cpu_step(make: Any, settings: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model, inputs = make()
    profile = profile_model(model, inputs=inputs(2), device="cpu")
    for precision, batch, optimizer in (("fp32", 1, "adamw"), ("fp32", 4, "adamw-fused"),
                                        ("bf16", 4, "adamw")):  # fmt: skip
        est = profile.estimate(batch, precision=precision, optimizer=optimizer, **settings)
        real = measure(model, inputs(batch), optimizer=optimizer, precision=precision, **settings)
        assert est.peak_bytes == real.peak_bytes, (precision, batch, optimizer)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-foreach", "sgd"])
def test_clipping_composes_with_accumulation_and_checkpointing(optimizer: str) -> None:
    torch.manual_seed(0)
    model = hf_gpt2()
    profile = profile_model(model, inputs=hf_tokens(2), device="cpu")
    settings = {"clip_grad_norm": 0.5, "grad_accumulation": 2, "checkpoint": "auto"}
    est = profile.estimate(2, optimizer=optimizer, **settings)
    assert est.levers.clip_grad_norm
    real = measure(model, hf_tokens(2), optimizer=optimizer, **settings)
    assert est.peak_bytes == real.peak_bytes


def test_decay_groups_are_the_trainers() -> None:
    transformers = pytest.importorskip("transformers")
    for model in (hf_llama(), hf_gpt2()):
        theirs = set(transformers.Trainer.get_decay_parameter_names(None, model))
        assert decay_parameter_names(model) == theirs
    model = hf_llama()
    named = list(model.named_parameters())
    decayed, others = trainer_groups(named, decay_parameter_names(model))
    # 2 layers x (4 attention + 3 MLP weights) + the embedding and lm_head: 16 decayed;
    # 2 layers x 2 RMSNorm weights + the final norm: 5 not
    assert (len(decayed), len(others)) == (16, 5)


def test_refusals_name_the_problem() -> None:
    with pytest.raises(ValueError, match="clip_grad_norm must be a positive number"):
        Recipe().with_(clip_grad_norm=0)
    with pytest.raises(ValueError, match="clip_grad_norm cannot go with in_backward=True"):
        Recipe().with_(clip_grad_norm=1.0, optimizer_in_backward=True)
    with pytest.raises(ValueError, match="unknown outputs 'dropped'; valid values are"):
        Recipe().with_(outputs="dropped")
    with pytest.raises(ValueError, match="unknown param_groups 'two'"):
        Recipe().with_(param_groups="two")
    with pytest.raises(TypeError, match="loss_scaled must be True or False"):
        Recipe().with_(loss_scaled="yes")
    profile = profile_model(nn.Linear(8, 4), input_size=(8,), device="cpu")
    with pytest.raises(ValueError, match=r"outputs='freed' with strategy='ddp' on 2 GPUs"):
        profile.estimate(2, outputs="freed", gpus=2)
    model = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="measured on one process"):
        measure(model, torch.randn(2, 8), outputs="freed", gpus=2)
    with pytest.raises(ValueError, match="clip_grad_norm must be a positive number"):
        measure(model, torch.randn(2, 8), clip_grad_norm=-1.0)
    assert model.weight.grad is None  # refused before any step


def test_readers_set_the_libraries_step() -> None:
    r = Recipe.from_training_arguments({"optim": "adamw_torch"})
    assert (r.step.outputs.value, r.step.loss_scaled, r.step.carried_scalars) == (
        "freed", True, True
    )  # fmt: skip
    # max_grad_norm's default 1.0; 0 still reads the norm (Trainer._get_grad_norm)
    assert (r.optimizer.clip_grad_norm, r.optimizer.param_groups.value) == (1.0, "decay-split")
    off = Recipe.from_training_arguments({"optim": "adamw_torch", "max_grad_norm": 0})
    assert off.optimizer.clip_grad_norm == float("inf")
    tune = Recipe.from_torchtune(
        {"optimizer": {"_component_": "torch.optim.AdamW"}, "clip_grad_norm": 1.0}
    )
    assert (tune.step.outputs.value, tune.step.loss_scaled, tune.step.carried_scalars) == (
        "freed", False, False
    )  # fmt: skip
    assert (tune.optimizer.clip_grad_norm, tune.optimizer.param_groups.value) == (1.0, "one")
    assert tune.ignored == ()
