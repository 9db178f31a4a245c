"""Optimizers outside torch.optim (bitsandbytes, torchao, transformers' Adafactor) and a
user's own optimizer class, each stepped by its library: the estimate against the real
library's step on the CPU, to the byte."""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch
from models import assert_optimizers_match_cpu_step, hf_gpt2, hf_tokens
from torch import nn

from vram_widget import Recipe, RecipeSettingIgnored, measure, profile_model, zoo
from vram_widget._estimating.options import CustomOptimizer, parse_optimizer_choice
from vram_widget._estimating.profile_source import ProfilingError
from vram_widget._estimating.recipe import Optimizer

pytest.importorskip("bitsandbytes")


class MomentumSGD(torch.optim.Optimizer):
    """SGD with momentum, one buffer per parameter (``buf = m * buf + grad``,
    ``p -= lr * buf``), as a user would write it."""

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                buf = state["buf"]
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf * -group["lr"])  # a temporary of the parameter's size


class ItemSGD(MomentumSGD):
    """Reads a value out of the gradient: impossible on tensors without data."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.abs().max().item() > 0:
                    p.add_(p.grad, alpha=-group["lr"])


def test_adamw8bit_on_one_linear_by_hand() -> None:
    profile = profile_model(nn.Linear(128, 64), input_size=(128,), device="cpu")
    est = profile.estimate(2, optimizer="adamw8bit")
    # bitsandbytes 0.50, Optimizer2State.init_state:
    # weight 64 x 128 = 8192 elements >= min_8bit_size 4096: state1 + state2 are uint8,
    #   2 x 8192 B = 16384 B; absmax1 + absmax2, one float32 per block of 256:
    #   8192 / 256 = 32 blocks, 2 x 32 x 4 B = 256 B
    # bias 64 elements < 4096: float32 state1 + state2, 2 x 64 x 4 B = 512 B
    # qmap1 + qmap2: 256 float32 each, shared by every parameter: 2 x 1024 B = 2048 B
    # (``step`` is a Python int; no unorm_vec with the default max_unorm=0)
    # 16384 + 256 + 512 + 2048 = 19200 B
    assert est.optimizer_state_bytes == 19200
    assert est.paged_bytes == 0
    real = measure(nn.Linear(128, 64), torch.randn(2, 128), optimizer="adamw8bit")
    assert est.peak_bytes == real.peak_bytes


def test_paged_state_is_counted_apart_on_cuda() -> None:
    model = nn.Linear(512, 256)
    cuda = profile_model(model, input_size=(512,), device="cuda").estimate(
        2, optimizer="paged-adamw8bit"
    )
    # weight 256 x 512 = 131072 elements >= 1e5: state1 + state2 in CUDA unified memory
    # (Optimizer8bit.get_state_buffer -> F.get_paged), 2 x 131072 B = 262144 B, apart
    assert cuda.paged_bytes == 262144
    # in the allocator: absmax 2 x 512 blocks x 4 B = 4096 B; qmaps 2048 B; the bias (256
    # elements < 4096) float32 state 2 x 256 x 4 B = 2048 B: 8192 B
    assert cuda.optimizer_state_bytes == 8192
    # on the CPU bitsandbytes allocates the paged state as ordinary tensors
    cpu = profile_model(model, input_size=(512,), device="cpu").estimate(
        2, optimizer="paged-adamw8bit"
    )
    assert (cpu.paged_bytes, cpu.optimizer_state_bytes) == (0, 8192 + 262144)


LIBRARY_OPTIMIZERS = [
    "adamw8bit",
    "paged-adamw8bit",
    "adafactor",
    MomentumSGD,
    functools.partial(MomentumSGD, lr=0.1, momentum=0.5),
]


# measure's real CPU step of the paged optimizer: bitsandbytes' own warning that it
# allocates ordinary tensors there (Optimizer8bit.get_state_buffer)
@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", ["mlp", "gpt2"])
def test_library_optimizers_match_their_real_cpu_step(case: str, precision: str) -> None:
    assert_optimizers_match_cpu_step(case, precision, LIBRARY_OPTIMIZERS)


def test_batch_one_matches_too() -> None:
    torch.manual_seed(0)
    model = zoo.mlp()
    profile = profile_model(model, input_size=(784,), device="cpu")
    for name in ("adamw8bit", MomentumSGD):
        est = profile.estimate(1, optimizer=name)
        assert est.peak_bytes == measure(model, torch.randn(1, 784), optimizer=name).peak_bytes


@pytest.mark.slow
@pytest.mark.skipif(
    "ATEN_CPU_CAPABILITY" in os.environ,
    # torchao's real step is compiled by Inductor, whose generated CPU kernels abort the
    # process when ATen's dispatch is capped below the CPU's own ISA (scripts/test.sh's second
    # pass); the state this test checks does not depend on the ISA
    reason="torchao's compiled step aborts under a capped ATEN_CPU_CAPABILITY",
)
@pytest.mark.parametrize("name", ["adamw8bit-torchao", "adamw4bit-torchao"])
def test_torchao_state_is_what_the_library_allocates(name: str) -> None:
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model, inputs = zoo.mlp(), torch.randn(4, 784)
    profile = profile_model(model, inputs=inputs, device="cpu")
    # torchao compiles its step, which the estimate traces uncompiled: said, not silent
    with pytest.warns(RecipeSettingIgnored, match="compiled by torch.compile"):
        est = profile.estimate(4, optimizer=name)
    assert len(est.ignored) == 1 and name in est.ignored[0]
    real = measure(model, inputs, optimizer=name)
    resident = est.parameter_bytes + est.buffer_bytes + est.optimizer_state_bytes
    assert resident + est.input_bytes == real.resident_bytes


def test_custom_optimizer_record_is_frozen_and_hashable() -> None:
    record = Optimizer.parse(MomentumSGD)
    assert record == Optimizer.parse(MomentumSGD)
    assert hash(record) == hash(Optimizer.parse(MomentumSGD))
    assert isinstance(record.name, CustomOptimizer)
    assert record.name.value == "MomentumSGD"
    assert record.resolved_implementation("cuda") is None
    assert Recipe().with_(optimizer=MomentumSGD).optimizer == record
    partial = functools.partial(MomentumSGD, lr=0.1)
    assert parse_optimizer_choice(partial)[0] == CustomOptimizer(partial)
    assert CustomOptimizer(partial).value == "partial(MomentumSGD)"


def test_custom_optimizer_failing_on_fake_tensors_is_named() -> None:
    profile = profile_model(nn.Linear(4, 2), input_size=(4,), device="cpu")
    with pytest.raises(ProfilingError, match=r"'ItemSGD'.*aten\._local_scalar_dense"):
        profile.estimate(2, optimizer=ItemSGD)


def test_custom_optimizer_must_return_an_optimizer() -> None:
    profile = profile_model(nn.Linear(4, 2), input_size=(4,), device="cpu")

    def not_an_optimizer(params):  # type: ignore[no-untyped-def]
        return list(params)

    with pytest.raises(TypeError, match=r"'.*not_an_optimizer' must return a torch\.optim"):
        profile.estimate(2, optimizer=not_an_optimizer)


def test_missing_library_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None if name == "bitsandbytes" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    profile = profile_model(nn.Linear(4, 2), input_size=(4,), device="cpu")
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        profile.estimate(2, optimizer="paged-adamw8bit")
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        measure(nn.Linear(4, 2), torch.randn(2, 4), optimizer="adamw8bit")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_torch_optim_class_given_as_callable_runs_as_its_name(device: str) -> None:
    # torch.optim.Adam at foreach=None is what optimizer="adam" is: the loop on CPU,
    # foreach on CUDA (_default_to_fused_or_foreach), which the fake parameters of a CUDA
    # trace would not choose by themselves; the two differ here by Adam's step temporaries
    profile = profile_model(zoo.mlp(), input_size=(784,), device=device)
    by_name = profile.estimate(1, optimizer="adam")
    by_class = profile.estimate(1, optimizer=torch.optim.Adam)
    assert by_class.peak_bytes == by_name.peak_bytes
    other = "adam-forloop" if device == "cuda" else "adam-foreach"
    assert profile.estimate(1, optimizer=other).peak_bytes != by_name.peak_bytes


def test_lora_adapters_under_adamw8bit_match_the_real_step() -> None:
    # PEFT's adapters are small (rank 8: under min_8bit_size, so float32 state), the frozen
    # base keeps no state: the 8-bit optimizer over LoRA, as it is trained
    torch.manual_seed(0)
    model, inputs = hf_gpt2(), hf_tokens(2)
    est = profile_model(model, inputs=inputs, device="cpu").estimate(
        2, optimizer="adamw8bit", lora_rank=8
    )
    real = measure(model, inputs, optimizer="adamw8bit", lora_rank=8)
    assert est.peak_bytes == real.peak_bytes
