"""Memory levers: resolution of the keywords (names, errors), hand-worked numbers, and every
lever's estimate (from the plain model's profile) against ``measure()`` of the real step with
the lever applied as the libraries apply it (torch's ``checkpoint_wrapper``,
``requires_grad_(False)``, the accumulation loop; Hugging Face's own checkpointing is in
test_third_party.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from models import assert_model_unchanged, snapshot_model
from torch import nn

from vram_widget import profile_model, zoo
from vram_widget._estimating.levers import NO_LEVERS, Levers, repeated_blocks, resolve_levers
from vram_widget._estimating.options import PHASE_CODE, Phase
from vram_widget._profiling.measure import measure

_NAMES = ("", "h", "h.0", "h.0.fc", "h.1", "h.1.fc", "head")
_TYPES = ("Net", "ModuleList", "Block", "Linear", "Block", "Linear", "Linear")
_PARAMS = ("h.0.fc.weight", "h.1.fc.weight", "head.weight", "head.bias")


def _resolve(**kwargs: Any) -> Levers:
    return resolve_levers(
        module_names=_NAMES,
        module_types=_TYPES,
        param_names=_PARAMS,
        auto_blocks=repeated_blocks(_NAMES, _TYPES),
        model_name="Net",
        **kwargs,
    )


def test_checkpoint_forms_resolve_to_outermost_module_names() -> None:
    assert _resolve(checkpoint="auto").checkpoint == ("h.0", "h.1")
    assert _resolve(checkpoint="Block").checkpoint == ("h.0", "h.1")
    # a block and its child: the child is recomputed with the block, so only the block
    assert _resolve(checkpoint=["h.0*"]).checkpoint == ("h.0",)
    assert _resolve(checkpoint=["head", "h.1.fc"]).checkpoint == ("h.1.fc", "head")
    assert _resolve(checkpoint=None) == NO_LEVERS and not NO_LEVERS.active


def test_trainable_and_accumulation_resolve() -> None:
    lv = _resolve(trainable=["head.*"], grad_accumulation=4)
    assert lv.trainable == ("head.weight", "head.bias") and lv.grad_accumulation == 4
    # accumulation of k > 2 is profiled as 2 (the same memory)
    assert lv.for_profiling().grad_accumulation == 2 and lv.profiled_micro_batches == 2
    assert _resolve(trainable="h.*.fc.weight").trainable == ("h.0.fc.weight", "h.1.fc.weight")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"checkpoint": ["nope*"]}, ValueError, "pattern 'nope\\*' matches no module"),
        ({"checkpoint": "Bottleneck"}, ValueError, "no module of that class.*Block"),
        ({"checkpoint": 3}, TypeError, "give None, 'auto', a class name"),
        ({"checkpoint": []}, TypeError, "non-empty list"),
        ({"trainable": "x.*"}, ValueError, "matches no parameter; parameter names look like"),
        ({"trainable": []}, TypeError, "glob patterns"),
        ({"grad_accumulation": 0}, ValueError, "grad_accumulation must be >= 1"),
        ({"grad_accumulation": 1.5}, TypeError, "grad_accumulation must be an integer"),
    ],
)
def test_bad_levers_name_the_problem(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _resolve(**kwargs)


def test_auto_needs_repeated_blocks() -> None:
    profile = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,))
    with pytest.raises(ValueError, match=r"no ModuleList of repeated blocks.*checkpoint="):
        profile.estimate(4, checkpoint="auto")


def _block_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8, bias=False),
        nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 8, bias=False)),
        nn.Linear(8, 2, bias=False),
    )


def test_checkpointed_middle_block_hand_worked() -> None:
    # A 3-layer MLP (4 -> 8 -> [8 -> ReLU -> 8] -> 2, no biases), batch 16, fp32, SGD, CUDA
    # rules (no CPU RNG state in the count). Checkpointing the middle block drops what only
    # its inside saved: the ReLU's output (kept by the ReLU and by the block's second
    # Linear), 16 x 8 x 4 B = 512 B live at the end of the forward. The block's input and
    # output stay saved (by the checkpoint and by the last Linear).
    # The recompute runs the block's forward again in the backward, and non-reentrant
    # checkpoint stops it once every tensor the backward needs is back (torch/utils/
    # checkpoint.py, set_checkpoint_early_stop, on by default): the first Linear and the
    # ReLU, not the second Linear. Backward FLOPs grow by the first Linear's forward:
    # 2 x 16 x 8 x 8 = 2,048.
    profile = profile_model(_block_mlp(), input_size=(4,))
    plain = profile.estimate(16, optimizer="sgd")
    ckpt = profile.estimate(16, optimizer="sgd", checkpoint=["1"])

    def end_of_forward(est: Any) -> int:
        forward = np.flatnonzero(est.event_phase == PHASE_CODE[Phase.FORWARD])
        return int(est.live_bytes[forward[-1]])

    assert end_of_forward(plain) - end_of_forward(ckpt) == 512
    assert ckpt.flops_backward - plain.flops_backward == 2_048
    assert ckpt.flops_forward == plain.flops_forward
    assert ckpt.levers.checkpoint == ("1",) and plain.levers == NO_LEVERS


def test_each_lever_estimate_equals_measure_on_cpu() -> None:
    # From the plain model's profile, each lever and all three together, at batch 1 and 8:
    # the real CPU step with the lever applied to a copy (torch's checkpoint_wrapper, the
    # frozen parameters' requires_grad_(False), the accumulation loop), to the byte. On the
    # CPU the checkpoint keeps the CPU RNG state (5,056 B) at the forward and again around
    # the recompute (torch.random.fork_rng): both are counted.
    model = _block_mlp()
    before = snapshot_model(model)
    profile = profile_model(model, input_size=(4,), device="cpu")
    levers: list[dict[str, Any]] = [
        {},
        {"checkpoint": ["1"]},
        {"trainable": "2.*"},
        {"grad_accumulation": 2},
        {"grad_accumulation": 5},
        {"checkpoint": ["1"], "trainable": ["1.*", "2.*"], "grad_accumulation": 3},
    ]
    for kwargs in levers:
        for batch in (1, 8):
            x = torch.randn(batch, 4, generator=torch.Generator().manual_seed(batch))
            est = profile.estimate(batch, optimizer="adam", **kwargs)
            real = measure(model, x, optimizer="adam", **kwargs)
            assert est.peak_bytes == real.peak_bytes, (kwargs, batch)
    assert_model_unchanged(model, before)


def test_frozen_subset_has_no_gradients_or_state() -> None:
    # Only the head trains: Adam's two moments for the head's 8 x 2 = 16 weights alone,
    # 2 x 16 x 4 B = 128 B (device="cuda": Adam's step counters stay on the CPU).
    profile = profile_model(_block_mlp(), input_size=(4,))
    est = profile.estimate(8, optimizer="adam", trainable="2.*")
    assert est.optimizer_state_bytes == 2 * 16 * 4
    # gradients: the head's alone, 16 x 4 B = 64 B
    assert est.gradient_bytes == 16 * 4
    # all 4 x 8 + 8 x 8 + 8 x 8 + 8 x 2 = 176 weights: 2 x 176 x 4 = 1,408 B of state and
    # 176 x 4 = 704 B of gradients
    full = profile.estimate(8, optimizer="adam")
    assert full.optimizer_state_bytes == 2 * 176 * 4 and full.gradient_bytes == 176 * 4


def test_accumulation_multiplies_flops_not_memory_past_two() -> None:
    profile = profile_model(_block_mlp(), input_size=(4,))
    one = profile.estimate(8, optimizer="sgd")
    two = profile.estimate(8, optimizer="sgd", grad_accumulation=2)
    eight = profile.estimate(8, optimizer="sgd", grad_accumulation=8)
    assert eight.peak_bytes == two.peak_bytes >= one.peak_bytes
    assert eight.flops == 8 * one.flops and two.flops == 2 * one.flops


def test_levers_are_ignored_in_inference_and_cached() -> None:
    profile = profile_model(_block_mlp(), input_size=(4,))
    a = profile.estimate(8, mode="inference", checkpoint=["1"], grad_accumulation=4)
    b = profile.estimate(8, mode="inference")
    assert a.peak_bytes == b.peak_bytes and a.levers == NO_LEVERS
    levers = profile.levers(checkpoint=["1"])
    assert not profile.is_cached("fp32", "train", "sgd", levers=levers)
    profile.estimate(8, optimizer="sgd", checkpoint=["1"])
    assert profile.is_cached("fp32", "train", "sgd", levers=levers)


def test_levers_compose_with_the_sequence_axis() -> None:
    # checkpointing every block of the zoo decoder at another length: the same as profiling
    # an example of that length with the same lever
    model = zoo.causal_decoder(vocab_size=64, d_model=32, n_head=2, n_layer=2, max_len=128)
    profile = profile_model(model, inputs=torch.zeros(2, 16, dtype=torch.long))
    other = profile_model(model, inputs=torch.zeros(2, 40, dtype=torch.long))
    for kwargs in ({"checkpoint": "auto"}, {"trainable": "blocks.1.*"}):
        est = profile.estimate(3, optimizer="sgd", seq_len=40, **kwargs)
        assert est.peak_bytes == other.estimate(3, optimizer="sgd", **kwargs).peak_bytes


peft = pytest.importorskip("peft")


def test_lora_wrapped_linear_hand_worked() -> None:
    # One Linear(16, 16) with LoRA rank 2 by PEFT: lora_A is 2 x 16 and lora_B 16 x 2, 64
    # trainable weights; the base 16 x 16 + 16 = 272 are frozen. AdamW keeps two moments
    # per trainable weight: 2 x 64 x 4 B = 512 B (device="cuda": step counters on the CPU).
    model = nn.Sequential(nn.Linear(16, 16))
    profile = profile_model(model, input_size=(16,))
    est = profile.estimate(4, optimizer="adamw", lora_rank=2, lora_targets=["0"])
    assert est.optimizer_state_bytes == 2 * 64 * 4
    assert est.levers.lora_rank == 2 and est.levers.lora_targets == ("0",)
    assert est.parameter_bytes == (272 + 64) * 4
    # the user's model is untouched: no adapters, every weight still trains
    assert type(model[0]) is nn.Linear and all(p.requires_grad for p in model.parameters())


def test_lora_estimate_equals_peft_on_the_real_model() -> None:
    # PEFT's own get_peft_model on measure()'s copy against the estimate from the plain
    # profile (PEFT on a meta copy), on the CPU, to the byte: each adapter's
    # ``lora_B(...) * scaling`` keeps the wrapped 8-byte scaling from its forward until its
    # MulBackward0 has run (cpu_rules.KEEPS_NUMBER_ARGS), which the estimates once missed
    # (8 B under per adapter).
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256),
        nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)),
        nn.Linear(256, 10),
    )
    before = snapshot_model(model)
    profile = profile_model(model, input_size=(64,), device="cpu")
    for kwargs in (
        {"lora_rank": 2, "lora_targets": ["1.0", "1.2"]},
        {"lora_rank": 4, "lora_targets": "all-linear", "checkpoint": ["1"]},
    ):
        for batch, precision in ((1, "fp32"), (8, "fp32"), (8, "bf16")):
            x = torch.randn(batch, 64, generator=torch.Generator().manual_seed(batch))
            est = profile.estimate(batch, precision, "adamw", **kwargs)
            real = measure(model, x, optimizer="adamw", precision=precision, **kwargs)
            adapters = sum(n.endswith(".lora_A.default") for n in est.layers.name)
            assert adapters >= 2, kwargs
            assert est.peak_bytes == real.peak_bytes, (kwargs, batch, precision)
    assert_model_unchanged(model, before)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lora_rank": 0}, ValueError, "lora_rank must be >= 1"),
        ({"lora_rank": "8"}, TypeError, "lora_rank must be an integer"),
        ({"lora_rank": 2, "trainable": "0.*"}, ValueError, "trainable or lora_rank, not both"),
        ({"lora_targets": ["0"]}, ValueError, "lora_targets needs lora_rank"),
        ({"lora_rank": 2}, ValueError, "with PEFT's defaults: .*target_modules"),
        ({"lora_rank": 2, "lora_targets": ["nope"]}, ValueError, "lora_targets=\\['nope'\\]"),
        ({"lora_rank": 2, "lora_targets": ["1"]}, ValueError, "Linear, Conv or Embedding"),
    ],
)
def test_bad_lora_names_the_problem(kwargs: dict[str, Any], error: type, message: str) -> None:
    profile = profile_model(_block_mlp(), input_size=(4,))
    with pytest.raises(error, match=message):
        profile.estimate(2, **kwargs)
