"""How the optimizer is stepped: in the backward (torchtune's ``optimizer_in_bwd``), and
``zero_grad(set_to_none=False)``; each estimate checked against the real CPU step that
``measure`` runs the same way, to the byte."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import hf_gpt2, hf_llama, hf_tokens
from torch import nn

from vram_widget import measure, profile_model, zoo
from vram_widget._estimating.options import Category, OptimizerName
from vram_widget._profiling.stepping import OptimizerInBackward


def _linear(device: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    return model, profile_model(model, input_size=(8,), device=device)


def test_adam_in_backward_on_one_linear_by_hand() -> None:
    _model, profile = _linear("cuda")
    est = profile.estimate(2, optimizer="adam", optimizer_in_backward=True)
    # weight 4 x 8 + bias 4 = 36 floats = 144 B; Adam's exp_avg + exp_avg_sq: 2 x 144 = 288 B
    # (foreach on CUDA keeps the step counters on the host); input 2 x 8 x 4 = 64 B.
    # Resident: 144 + 288 + 64 = 496 B.
    assert est.optimizer_state_bytes == 288
    assert est.optimizer_implementation == "foreach"
    assert est.levers.in_backward == "adam-foreach"
    # Forward: output 2 x 4 x 4 = 32 B, the mean loss 4 B; backward: the loss's gradient
    # 4 B, the output's 32 B, then the weight's 128 B and the bias's 16 B. The bias's hook
    # steps and frees its gradient, then the output's gradient goes; the weight's hook then
    # steps with its 128 B gradient live plus _foreach_sqrt(exp_avg_sq) 128 B:
    # 496 + 32 + 4 + 4 + 128 + 128 = 792 B.
    assert est.peak_bytes == 792
    assert est.peak_phase.value == "optimizer"
    # one optimizer step after the backward holds both gradients (144 B) and the sqrt of
    # both second moments (144 B), the loss's gradient freed: 496 + 32 + 4 + 144 + 144 = 820
    assert profile.estimate(2, optimizer="adam").peak_bytes == 820


def test_set_to_none_false_on_one_linear_by_hand() -> None:
    _model, profile = _linear("cuda")
    est = profile.estimate(2, optimizer="adam", set_to_none=False)
    # resident from the start: 496 B (as above) + the zeroed gradients 144 B = 640 B.
    # Backward: 640 + output 32 + loss 4 + its gradient 4 + the output's gradient 32
    # + the new weight gradient 128 + the new bias gradient 16 = 856 B, before
    # AccumulateGrad adds each into the resident .grad in place and frees it.
    assert est.peak_bytes == 856
    assert est.peak_phase.value == "backward"
    assert est.gradient_bytes == 144
    assert est.peak_breakdown[Category.GRADIENT] == 144


def _mlp() -> tuple[nn.Module, Callable[[int], Any]]:
    return zoo.mlp(), lambda b: torch.randn(b, 784, generator=torch.Generator().manual_seed(b))


def _gpt2() -> tuple[nn.Module, Callable[[int], Any]]:
    return hf_gpt2(), hf_tokens


def _llama() -> tuple[nn.Module, Callable[[int], Any]]:
    return hf_llama(), hf_tokens


STEPPINGS = [{"optimizer_in_backward": True}, {"set_to_none": False}]


@pytest.mark.parametrize("make", [_mlp, _gpt2, _llama], ids=["mlp", "gpt2", "llama"])
@pytest.mark.parametrize("stepping", STEPPINGS, ids=["in_backward", "set_to_none_false"])
def test_estimate_is_the_real_cpu_step(make: Any, stepping: dict[str, bool]) -> None:
    torch.manual_seed(0)
    model, inputs = make()
    profile = profile_model(model, inputs=inputs(2), device="cpu")
    for precision, batch in (("fp32", 1), ("fp32", 4), ("bf16", 1), ("bf16", 4)):
        est = profile.estimate(batch, precision=precision, optimizer="adam", **stepping)
        real = measure(model, inputs(batch), optimizer="adam", precision=precision, **stepping)
        assert est.peak_bytes == real.peak_bytes, (precision, batch)


@pytest.mark.parametrize(
    ("settings", "optimizer"),
    [
        ({"optimizer_in_backward": True, "checkpoint": "auto"}, "adam"),
        ({"optimizer_in_backward": True, "trainable": "transformer.h.1.*"}, "adam"),
        ({"optimizer_in_backward": True}, "adamw-fused"),
        ({"optimizer_in_backward": True}, "sgd-momentum"),
        ({"set_to_none": False, "grad_accumulation": 2}, "adam"),
        ({"set_to_none": False, "lora_rank": 4}, "adamw"),
    ],
    ids=["checkpoint", "trainable", "fused", "sgd-momentum", "accumulation", "lora"],
)
def test_levers_compose(settings: dict[str, Any], optimizer: str) -> None:
    torch.manual_seed(0)
    model = hf_gpt2()
    profile = profile_model(model, inputs=hf_tokens(2), device="cpu")
    est = profile.estimate(4, optimizer=optimizer, **settings)
    real = measure(model, hf_tokens(4), optimizer=optimizer, **settings)
    assert est.peak_bytes == real.peak_bytes


def test_in_backward_frees_each_gradient_in_its_hook() -> None:
    # the mechanism itself, on real tensors: after the backward no gradient is left, and
    # each parameter's optimizer holds its own state
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    stepper = OptimizerInBackward(list(model.parameters()), OptimizerName.ADAM, None)
    with stepper.hooked():
        model(torch.randn(4, 3)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert [len(opt.param_groups[0]["params"]) for opt in stepper.optimizers] == [1, 1, 1, 1]
    # the hooks run as the backward reaches each parameter: the last layer's first
    assert [tuple(p.shape) for p in stepper.stepped][:2] in ([(2,), (2, 5)], [(2, 5), (2,)])
    # and they are gone afterwards: a later backward leaves the gradients in place
    model(torch.randn(4, 3)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_refusals_name_the_problem() -> None:
    _model, profile = _linear("cpu")
    with pytest.raises(ValueError, match="grad_accumulation > 1 cannot go with"):
        profile.estimate(2, optimizer_in_backward=True, grad_accumulation=2)
    with pytest.raises(ValueError, match="needs an optimizer"):
        profile.estimate(2, optimizer=None, optimizer_in_backward=True)
    with pytest.raises(ValueError, match="set_to_none=False with strategy='ddp'"):
        profile.estimate(2, set_to_none=False, gpus=2)
    with pytest.raises(ValueError, match="cannot go with in_backward=True"):
        profile.estimate(2, optimizer_in_backward=True, set_to_none=False)
    model = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="grad_accumulation > 1 cannot go with"):
        measure(model, torch.randn(2, 8), optimizer_in_backward=True, grad_accumulation=2)
    with pytest.raises(TypeError, match="set_to_none must be True or False"):
        measure(model, torch.randn(2, 8), set_to_none="no")  # type: ignore[arg-type]
    assert model.weight.grad is None  # refused before any step


class _WithUnused(nn.Module):
    """A layer the forward never calls: its parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 4)
        self.spare = nn.Linear(100, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("stepping", STEPPINGS, ids=["in_backward", "set_to_none_false"])
def test_a_parameter_without_gradient_keeps_no_gradient_and_no_state(
    stepping: dict[str, bool],
) -> None:
    torch.manual_seed(0)
    model = _WithUnused()
    est = profile_model(model, input_size=(8,), device="cpu").estimate(
        3, optimizer="adam", **stepping
    )
    # only ``used`` (4 x 8 + 4 = 36 floats = 144 B) has a gradient, and Adam state for it:
    # 2 x 144 B + two 4 B step counters = 296 B; ``spare``'s 40,400 B have neither
    assert (est.gradient_bytes, est.optimizer_state_bytes) == (144, 296)
    real = measure(model, torch.randn(3, 8), optimizer="adam", **stepping)
    assert est.peak_bytes == real.peak_bytes
