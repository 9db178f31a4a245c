"""Tests for ``profile_model`` and ``ModelProfile.estimate``: hand-worked numbers, the model
left untouched, per-layer sums, agreement with ``measure()`` on the CPU, behaviours of
particular layers, and clear errors for bad input.

The CPU numbers follow the derivations in tests/test_measure.py: with ``device="cpu"`` the
estimate must reproduce a real CPU step's peak (``measure``) to the byte.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import time
import traceback
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from models import (
    CASES,
    OUTPUT_KINDS,
    ReusedLinear,
    assert_model_unchanged,
    output_case_name,
    snapshot_model,
    unique_param_count,
)
from torch import nn

import vram_widget
from vram_widget import (
    Category,
    Mode,
    ModelProfile,
    Phase,
    ProfilingError,
    profile_model,
    show_memory,
    zoo,
)
from vram_widget._estimating.options import PHASE_CODE, Precision
from vram_widget._profiling.measure import measure

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _rel_err(estimated: int, measured: int) -> float:
    return (estimated - measured) / measured


@cache
def _case_profile(name: str) -> ModelProfile:
    """One CPU profile per test model (the profile caches every later precision)."""
    case = CASES[name]
    return profile_model(case.build(), inputs=case.make_inputs(2), device="cpu")


def _linear() -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Linear(10, 20, bias=False)


def _x4() -> torch.Tensor:
    return torch.randn(4, 10, generator=torch.Generator().manual_seed(0))


@cache
def _linear_profile() -> ModelProfile:
    return profile_model(_linear(), input_size=(10,), device="cpu")


# --------------------------------------------------------------------------------------------
# Hand-worked exact numbers: nn.Linear(10, 20, bias=False), batch 4, fp32, device="cpu"
# --------------------------------------------------------------------------------------------
#
# Resident: weight 20 x 10 x 4 B = 800, input 4 x 10 x 4 B = 160 -> 960 B, plus the state:
#   sgd: none; sgd-momentum: momentum_buffer 800; adam / adamw: exp_avg 800 + exp_avg_sq 800 +
#   a 0-dim float32 ``step`` 4 = 1604; adagrad: ``sum`` 800 + step 4 = 804; rmsprop:
#   ``square_avg`` 800 + step 4 = 804 (single-tensor loops: the CPU default).
# Backward peak (MmBackward allocating the weight gradient): output 320 + loss 4 + ones_like 4
#   + grad of output 320 + weight grad 800 = 1448 above resident.
# Optimizer peaks (output 320 + loss 4 + weight grad 800 = 1124 live through the step):
#   adam / adamw: denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt): sqrt 800, the Python
#     float wrapped as a 0-dim float64 (8) and its float32 copy (4), the quotient 800
#     -> 1124 + 1612 = 2736 above resident 2564 = 5300.
#   adagrad: std = state_sum.sqrt().add_(eps): sqrt 800, eps wrapped 8 + 4
#     -> 1124 + 812 = 1936 above resident 1764 = 3700.
#   rmsprop: avg = square_avg.sqrt().add_(eps): the same 1936 above 1764 = 3700.
# Inference: resident 960 + output 320 = 1280.
RESIDENT = 800 + 160
STATE = {
    "sgd": 0,
    "sgd-momentum": 800,
    "adam": 800 + 800 + 4,
    "adamw": 800 + 800 + 4,
    "adagrad": 800 + 4,
    "rmsprop": 800 + 4,
}
LINEAR_PEAK = {
    "sgd": RESIDENT + 320 + 4 + 4 + 320 + 800,  # 2408
    "sgd-momentum": RESIDENT + 800 + 1448,  # 3208
    "adam": RESIDENT + 1604 + 320 + 4 + 800 + 800 + 8 + 4 + 800,  # 5300
    "adamw": RESIDENT + 1604 + 320 + 4 + 800 + 800 + 8 + 4 + 800,  # 5300
    "adagrad": RESIDENT + 804 + 320 + 4 + 800 + 800 + 8 + 4,  # 3700
    "rmsprop": RESIDENT + 804 + 320 + 4 + 800 + 800 + 8 + 4,  # 3700
}
assert (LINEAR_PEAK["sgd"], LINEAR_PEAK["sgd-momentum"], LINEAR_PEAK["adam"]) == (2408, 3208, 5300)
assert LINEAR_PEAK["adagrad"] == LINEAR_PEAK["rmsprop"] == 3700


@pytest.mark.parametrize("optimizer", list(LINEAR_PEAK))
def test_linear_measured_peak_by_hand(optimizer: str) -> None:
    m = measure(_linear(), _x4(), optimizer=optimizer)
    assert m.resident_bytes == RESIDENT + STATE[optimizer]
    assert m.peak_bytes == LINEAR_PEAK[optimizer]


@pytest.mark.parametrize(
    "optimizer",
    [
        "sgd",
        "sgd-momentum",
        "adam",
        "adamw",
        "adagrad",
        "rmsprop",
    ],
)
def test_linear_estimated_peak_by_hand(optimizer: str) -> None:
    measured = measure(_linear(), _x4(), optimizer=optimizer).peak_bytes
    assert measured == LINEAR_PEAK[optimizer]
    est = _linear_profile().estimate(4, "fp32", optimizer)
    assert est.peak_bytes == measured == LINEAR_PEAK[optimizer]


@pytest.mark.parametrize("optimizer", list(LINEAR_PEAK))
def test_linear_categories_by_hand(optimizer: str) -> None:
    est = _linear_profile().estimate(4, "fp32", optimizer)
    assert est.parameter_bytes == 800
    assert est.gradient_bytes == 800
    assert est.buffer_bytes == 0
    assert est.optimizer_state_bytes == STATE[optimizer]
    assert est.input_bytes == 160
    # Saved for backward: mm saves its input (resident Input) and the weight (Parameter); the
    # output is not saved (mean's backward needs only the shape): no Activation bytes.
    assert est.activation_bytes == 0
    # FLOPs: forward 2 * 4 * 10 * 20; backward only the weight gradient (the input does not
    # require grad, so no grad-input mm).
    assert est.flops_forward == 2 * 4 * 10 * 20 == 1600
    assert est.flops_backward == 1600
    assert est.flops == 3200
    assert est.macs == (1600 + 1600) // 2
    # What is live at the peak adds up to the peak.
    assert sum(est.peak_breakdown.values()) == est.peak_bytes
    assert est.peak_breakdown[Category.PARAMETER] == 800
    assert est.peak_breakdown[Category.INPUT] == 160
    assert est.peak_breakdown[Category.GRADIENT] == 800
    assert est.peak_breakdown[Category.OPTIMIZER_STATE] == STATE[optimizer]
    expected_phase = Phase.BACKWARD if optimizer.startswith("sgd") else Phase.OPTIMIZER
    assert est.peak_phase is expected_phase
    assert est.batch_size == 4 and est.mode is Mode.TRAIN
    assert est.optimizer == optimizer
    assert est.extras.total_bytes == 0  # device="cpu": no accelerator extras
    assert est.total_bytes == est.peak_bytes
    assert est.exact


def test_linear_inference_by_hand() -> None:
    measured = measure(_linear(), _x4(), mode="inference").peak_bytes
    est = _linear_profile().estimate(4, "fp32", "adam", "inference")
    assert est.peak_bytes == measured == RESIDENT + 320 == 1280
    assert est.peak_phase is Phase.INFERENCE
    assert est.optimizer is None
    assert est.gradient_bytes == est.optimizer_state_bytes == est.activation_bytes == 0
    assert est.flops_forward == 1600 and est.flops_backward == 0


def test_linear_layer_table() -> None:
    df = _linear_profile().estimate(4, optimizer="adam").to_dataframe()
    assert list(df["name"]) == ["", "(loss)", "(optimizer)"]
    assert list(df["type"]) == ["Linear", "loss", "optimizer"]
    root = df.iloc[0]
    assert root["output_shape"] == (4, 20) and root["output_numel"] == 80
    assert root["param_count"] == 200 and root["param_bytes"] == 800
    assert root["optimizer_state_bytes"] == 1604


# --------------------------------------------------------------------------------------------
# The model is left exactly as it was
# --------------------------------------------------------------------------------------------


def _run_profile(model: nn.Module, inputs: Any, **kwargs: Any) -> ModelProfile:
    profile = profile_model(model, inputs=inputs, device="cpu", **kwargs)
    # cached settings: no further profiling
    profile.estimate(3, "fp32", "adam")
    profile.estimate(3, "fp32", "adam", "inference")
    return profile


def test_unchanged_tied_with_existing_grad_and_user_hook() -> None:
    case = CASES["tied"]
    model = case.build()
    model.first.weight.grad = torch.full_like(model.first.weight, 0.5)
    calls: list[int] = []
    model.second.register_forward_hook(lambda m, a, out: calls.append(1))
    before = snapshot_model(model)
    _run_profile(model, case.make_inputs(2))
    assert_model_unchanged(model, before)
    assert model.second.weight is model.first.weight  # still tied


def test_unchanged_eval_mode_with_batchnorm() -> None:
    case = CASES["batchnorm"]
    model = case.build().eval()
    before = snapshot_model(model)
    _run_profile(model, case.make_inputs(2))
    assert_model_unchanged(model, before)
    assert not any(m.training for m in model.modules())


def test_unchanged_dropout_and_rng() -> None:
    case = CASES["dropout"]
    model = case.build().train()
    torch.manual_seed(1234)
    before = snapshot_model(model)
    _run_profile(model, case.make_inputs(2))
    assert_model_unchanged(model, before)
    # the next random draw is the one it would have been
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(1234)))


def test_unchanged_mixed_training_flags_and_inputs() -> None:
    case = CASES["dict_input"]
    model = case.build().train()
    model.proj.eval()  # one submodule in eval mode: each flag must come back as it was
    inputs = case.make_inputs(2)
    inputs_before = {k: v.clone() for k, v in inputs.items()}
    before = snapshot_model(model)
    _run_profile(model, inputs)
    assert_model_unchanged(model, before)
    assert model.training and not model.proj.training
    for k, v in inputs.items():
        assert torch.equal(v, inputs_before[k]) and v.grad is None


@pytest.mark.parametrize("training", [True, False])
def test_unchanged_after_lazy_estimates(training: bool) -> None:
    case = CASES["dropout"]
    model = case.build().train(training)
    profile = profile_model(model, inputs=case.make_inputs(2), device="cpu")
    before = snapshot_model(model)
    profile.estimate(3, "bf16", "sgd-momentum")  # new precision: profiled now
    profile.estimate(3, "amp-bf16", "adamw", "inference" if training else "train")
    assert_model_unchanged(model, before)


def test_unchanged_under_no_grad() -> None:
    case = CASES["frozen"]
    model = case.build()
    with torch.no_grad():
        before = snapshot_model(model)
        _run_profile(model, case.make_inputs(2))
        assert_model_unchanged(model, before)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_profile_ignores_callers_grad_mode(context: Callable[[], Any]) -> None:
    model = CASES["frozen"].build()
    expected = profile_model(model, input_size=(12,), device="cpu").estimate(4)
    with context():
        got = profile_model(model, input_size=(12,), device="cpu").estimate(4)
    assert got.peak_bytes == expected.peak_bytes
    assert got.gradient_bytes == expected.gradient_bytes > 0
    assert got.flops_backward == expected.flops_backward > 0


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"input_size": (7,)}, ProfilingError),  # the first Linear takes 12 features
        ({"input_size": (12,), "loss_fn": lambda out: out}, ValueError),  # not a scalar
        ({"input_size": (12,), "loss_fn": lambda out: 1 / 0}, ProfilingError),
    ],
)
def test_unchanged_after_failing_call(kwargs: dict[str, Any], error: type[Exception]) -> None:
    model = CASES["frozen"].build()
    model[2].weight.grad = torch.ones_like(model[2].weight)
    torch.manual_seed(7)
    before = snapshot_model(model)
    with pytest.raises(error):
        profile_model(model, device="cpu", **kwargs)
    assert_model_unchanged(model, before)


def test_snapshot_helper_detects_changes() -> None:
    """The helper itself: each kind of change it promises to catch is caught."""
    changes: list[Callable[[nn.Module], Any]] = [
        lambda m: m[0].weight.data.add_(1.0),
        lambda m: setattr(m[0].weight, "grad", torch.zeros_like(m[0].weight)),
        lambda m: m[1].eval(),
        lambda m: m[0].register_forward_pre_hook(lambda *a: None),
        lambda m: torch.rand(1),
        lambda m: m[0].weight.requires_grad_(False),
    ]
    for change in changes:
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        before = snapshot_model(model)
        change(model)
        with pytest.raises(AssertionError):
            assert_model_unchanged(model, before)


# --------------------------------------------------------------------------------------------
# Per-layer rows sum to the totals
# --------------------------------------------------------------------------------------------

_REQUIRED_COLUMNS = {
    "name",
    "type",
    "depth",
    "output_shape",
    "output_numel",
    "param_count",
    "param_bytes",
    "activation_bytes",
    "flops_forward",
    "flops_backward",
}
_SETTINGS = [
    {"batch_size": 4},
    {"batch_size": 9, "optimizer": "sgd-momentum"},
    {"batch_size": 3, "mode": "inference"},
    {"batch_size": 5, "precision": "bf16", "optimizer": "adamw"},
    {"batch_size": 2, "precision": "amp-bf16", "optimizer": "rmsprop"},
]


@pytest.mark.parametrize(
    ("name", "device"),
    [
        ("mlp", "cpu"),
        ("tied_autoencoder", "cpu"),
        ("mlp", "cuda"),
        ("tied_autoencoder", "cuda"),
        ("lstm", "cuda"),
        ("dict_input", "cuda"),
        ("transformer_encoder", "cuda"),
        ("causal_decoder", "cuda"),
    ],
)
def test_rows_sum_to_totals(name: str, device: str) -> None:
    entry = zoo.ZOO[name]
    model = entry.build()
    profile = profile_model(model, inputs=entry.make_inputs(2), device=device)
    unique = unique_param_count(model)
    assert profile.param_count == unique  # tied weights counted once
    for setting in _SETTINGS:
        est = profile.estimate(**setting)
        df = est.to_dataframe()
        assert set(df.columns) >= _REQUIRED_COLUMNS
        assert df["param_bytes"].sum() == est.parameter_bytes, setting
        assert df["buffer_bytes"].sum() == est.buffer_bytes, setting
        assert df["gradient_bytes"].sum() == est.gradient_bytes, setting
        assert df["optimizer_state_bytes"].sum() == est.optimizer_state_bytes, setting
        assert df["activation_bytes"].sum() == est.activation_bytes, setting
        assert df["flops_forward"].sum() + df["flops_backward"].sum() == est.flops, setting
        assert df["param_count"].sum() == profile.param_count == unique, setting
        assert sum(est.peak_breakdown.values()) == est.peak_bytes, setting
        assert len(df) == len(list(model.named_modules())) + 2
        # a module's qualified name; the root (named "") by its class
        assert est.peak_module in set(df["name"]) - {""} | {type(model).__name__}
        if est.mode is Mode.INFERENCE:
            assert est.gradient_bytes == est.optimizer_state_bytes == est.flops_backward == 0


# --------------------------------------------------------------------------------------------
# Estimates against measure() on the CPU
# --------------------------------------------------------------------------------------------


def _xfail(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=reason)


_LSTM = (
    "limitation: the oneDNN LSTM kernels' workspaces are measured at batch 1, 2, 3, 5, 8 and 32 "
    "and interpolated in between; the backward scratch is not linear between 5 and 8"
)
# Measured on torch 2.13.0 CPU, 2 threads: (estimate, measured) peak bytes.
_EXPECTED_MISSES: dict[tuple[str, int, str | None, str], str] = {
    ("lstm", 7, "sgd", "train"): f"{_LSTM}: 116964 vs 119952 (-2.5 %)",
    ("lstm", 7, "adam", "train"): f"{_LSTM}: 130844 vs 133832 (-2.2 %)",
}


def _comparison_params() -> list[Any]:
    params = []
    for name in CASES:
        for batch in (3, 7):
            for optimizer, mode in (("sgd", "train"), ("adam", "train"), (None, "inference")):
                marks: list[Any] = []
                if (name, batch, optimizer, mode) in _EXPECTED_MISSES:
                    marks.append(_xfail(_EXPECTED_MISSES[(name, batch, optimizer, mode)]))
                params.append(
                    pytest.param(
                        name,
                        batch,
                        optimizer,
                        mode,
                        marks=marks,
                        id=f"{name}-b{batch}-{optimizer or 'none'}-{mode}",
                    )
                )
    return params


@pytest.mark.parametrize(("name", "batch", "optimizer", "mode"), _comparison_params())
def test_estimate_matches_measure_on_cpu(
    name: str, batch: int, optimizer: str | None, mode: str
) -> None:
    case = CASES[name]
    profile = _case_profile(name)
    est = profile.estimate(batch, "fp32", optimizer, mode)
    model = case.build()
    measured = measure(model, case.make_inputs(batch), optimizer=optimizer, mode=mode)
    tolerance = 0.01 if mode == "train" else 0.05
    err = _rel_err(est.peak_bytes, measured.peak_bytes)
    assert abs(err) <= tolerance, (
        f"{name} b={batch} {optimizer} {mode}: estimate {est.peak_bytes} vs measured "
        f"{measured.peak_bytes} ({err:+.2%})"
    )


# --------------------------------------------------------------------------------------------
# Behaviours of particular layers
# --------------------------------------------------------------------------------------------


class _HookInForward(nn.Module):
    """Registers a gradient hook on its own weight at every call (the hook allocates)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden.weight.register_hook(lambda g: g * 2)
        return self.out(torch.relu(self.hidden(x)))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_forward_registering_parameter_hooks(device: str, recwarn: pytest.WarningsRecorder) -> None:
    # The fake runs of one precision share their fake parameters; hooks a forward puts on
    # them must not pile up from one run (batch size) to the next, or the runs stop matching.
    profile = profile_model(_HookInForward(), input_size=(64,), device=device)
    assert not [w for w in recwarn if "affine" in str(w.message)]
    assert profile.estimate(7, optimizer="adam").peak_bytes > 0


def _inplace_mlp(inplace: bool) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 256), nn.ReLU(inplace=inplace), nn.Linear(256, 4))


def test_inplace_relu() -> None:
    # Autograd saves a ReLU's *result* (threshold_backward(grad, result, 0)), in place or
    # not, and a Linear saves its input, which is that same result: 4 x 256 x 4 B = 4096 B of
    # Activation either way. In place, that storage is the first Linear's output (its row);
    # out of place, the ReLU allocates it (its row), and the Linear's output dies.
    # What in-place saves is the transient copy: in inference the out-of-place peak holds the
    # Linear's output and the ReLU's (4096 + 4096 B), the in-place one peaks at the last
    # Linear (4096 + 4 x 4 x 4 = 64 B).
    x = torch.randn(4, 16)
    ests = {}
    for inplace in (True, False):
        model = _inplace_mlp(inplace)
        profile = profile_model(model, input_size=(16,), device="cpu")
        train = profile.estimate(4, optimizer="sgd")
        infer = profile.estimate(4, mode="inference")
        assert train.peak_bytes == measure(model, x, optimizer="sgd").peak_bytes
        assert infer.peak_bytes == measure(model, x, mode="inference").peak_bytes
        ests[inplace] = (train, infer)
    (train_in, infer_in), (train_out, infer_out) = ests[True], ests[False]
    assert train_in.activation_bytes == train_out.activation_bytes == 4 * 256 * 4
    rows_in = dict(zip(train_in.layers.name, train_in.layers.activation_bytes, strict=True))
    rows_out = dict(zip(train_out.layers.name, train_out.layers.activation_bytes, strict=True))
    assert (rows_in["0"], rows_in["1"]) == (4096, 0)
    assert (rows_out["0"], rows_out["1"]) == (0, 4096)
    assert infer_out.peak_bytes - infer_in.peak_bytes == 4096 - 64
    assert train_in.peak_bytes <= train_out.peak_bytes


def test_maxpool_saves_int64_indices() -> None:
    # MaxPool2d(2) on a (B, 4, 8, 8) conv output: output (B, 4, 4, 4). It allocates the output
    # (float32, saved by the next Linear as its input) and the int64 indices (saved for
    # max_pool2d_with_indices_backward): 4 + 8 bytes per output element.
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 2)
    )
    profile = profile_model(model, input_size=(3, 8, 8), device="cpu")
    est = profile.estimate(4, optimizer="sgd")
    df = est.to_dataframe().set_index("name")
    numel = int(df.loc["1", "output_numel"])
    assert numel == 4 * 4 * 4 * 4
    assert df.loc["1", "activation_bytes"] == (8 + 4) * numel
    # the conv output is what max-pool's backward reads: saved, 4 B per element
    assert df.loc["0", "activation_bytes"] == 4 * int(df.loc["0", "output_numel"])


def test_dropout_mask_cpu_vs_cuda() -> None:
    # CPU dropout saves a float32 noise tensor (4 B/element), CUDA's fused dropout a bool
    # mask (1 B/element): 3 B per element apart in fp32.
    model = nn.Sequential(nn.Linear(10, 32), nn.Dropout(0.5))
    cpu = profile_model(model, input_size=(10,), device="cpu").estimate(4, optimizer="sgd")
    cuda = profile_model(model, input_size=(10,), device="cuda").estimate(4, optimizer="sgd")
    elements = 4 * 32
    assert cpu.activation_bytes - cuda.activation_bytes == 3 * elements
    drop_cpu = dict(zip(cpu.layers.name, cpu.layers.activation_bytes, strict=True))["1"]
    drop_cuda = dict(zip(cuda.layers.name, cuda.layers.activation_bytes, strict=True))["1"]
    assert (drop_cpu, drop_cuda) == (4 * elements, elements)


def test_reused_linear_counts_activations_per_call_and_weights_once() -> None:
    # x * 2.0 (not saved by its own backward) feeds the Linear, which saves its input at each
    # call: one call saves 1 (B, 16) tensor, five calls save 5.
    class Scaled(nn.Module):
        def __init__(self, times: int) -> None:
            super().__init__()
            self.inner = ReusedLinear(16, times)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x * 2.0)

    one = profile_model(Scaled(1), input_size=(16,), device="cpu").estimate(4, optimizer="sgd")
    five = profile_model(Scaled(5), input_size=(16,), device="cpu").estimate(4, optimizer="sgd")
    assert one.activation_bytes == 4 * 16 * 4
    assert five.activation_bytes == 5 * one.activation_bytes
    assert five.parameter_bytes == one.parameter_bytes == 16 * 16 * 4
    assert five.gradient_bytes == one.gradient_bytes == 16 * 16 * 4
    assert five.flops_forward == 5 * one.flops_forward
    # a hundred calls: a hundred saved inputs, one weight, and the peak a real step measures
    model = Scaled(100)
    profile = profile_model(model, input_size=(16,), device="cpu")
    hundred = profile.estimate(4, optimizer="sgd")
    assert hundred.activation_bytes == 100 * one.activation_bytes
    assert hundred.parameter_bytes == hundred.gradient_bytes == 16 * 16 * 4
    assert hundred.flops_forward == 100 * one.flops_forward
    for optimizer, mode in (("sgd", "train"), ("adam", "train"), (None, "inference")):
        est = profile.estimate(4, optimizer=optimizer, mode=mode).peak_bytes
        real = measure(model, torch.randn(4, 16), optimizer=optimizer, mode=mode).peak_bytes
        assert est == real, (optimizer, mode, est, real)
    df = five.to_dataframe().set_index("name")
    assert df.loc["inner.layer", "param_count"] == 256
    assert df["param_count"].sum() == 256


def test_frozen_first_layer_has_no_gradient_or_state() -> None:
    profile = _case_profile("frozen")
    est = profile.estimate(4, optimizer="adam")
    df = est.to_dataframe().set_index("name")
    first, last = (12 * 24 + 24) * 4, (24 * 6 + 6) * 4
    assert df.loc["0", "param_bytes"] == first
    assert df.loc["0", "gradient_bytes"] == 0
    assert df.loc["0", "optimizer_state_bytes"] == 0
    assert df.loc["2", "gradient_bytes"] == last
    # Adam: exp_avg + exp_avg_sq, and one 4-byte step per trainable tensor (weight, bias)
    assert df.loc["2", "optimizer_state_bytes"] == 2 * last + 2 * 4
    assert est.parameter_bytes == first + last
    assert est.gradient_bytes == last
    assert profile.param_count == 12 * 24 + 24 + 24 * 6 + 6
    assert profile.trainable_param_count == 24 * 6 + 6


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_half_precision_and_batch_monotone(device: str) -> None:
    entry = zoo.ZOO["mlp"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device=device)
    for mode in ("train", "inference"):
        fp32 = profile.estimate(16, "fp32", "adam", mode)
        bf16 = profile.estimate(16, "bf16", "adam", mode)
        assert bf16.peak_bytes < fp32.peak_bytes
        assert bf16.parameter_bytes * 2 == fp32.parameter_bytes
        assert profile.estimate(8, mode=mode).peak_bytes > profile.estimate(1, mode=mode).peak_bytes


@pytest.mark.slow
def test_meta_llama_7b_profiles_without_memory() -> None:
    # Llama-2-7B on the meta device: 6.74 B parameters, 27 GB of fp32 weights that never exist.
    start = time.perf_counter()
    with torch.device("meta"):
        model = zoo.llama_decoder(zoo.LLAMA_7B)
    profile = profile_model(model, inputs=torch.zeros(1, 16, dtype=torch.long), device="cuda")
    n = zoo.llama_param_count(zoo.LLAMA_7B)
    fp32 = profile.estimate(1, "fp32", "adam")
    bf16 = profile.estimate(1, "bf16", "adam")
    elapsed = time.perf_counter() - start
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(f"llama-7b on meta: {elapsed:.1f} s, peak RSS {rss_mib:.0f} MiB")
    assert profile.param_count == n == 6_738_415_616
    assert fp32.parameter_bytes == 4 * n
    assert bf16.parameter_bytes == 2 * n
    assert fp32.gradient_bytes == 4 * n
    assert fp32.peak_bytes > 4 * 4 * n  # weights, gradients, exp_avg, exp_avg_sq
    assert all(p.device.type == "meta" for p in model.parameters())
    assert rss_mib < 4096  # nothing near 27 GB was ever allocated
    assert elapsed < 120


_LLAMA_70B_SCRIPT = """
import json, resource, torch
from vram_widget import profile_model, zoo
def peak_rss_bytes():
    # VmHWM: this process's own peak RSS. ru_maxrss is not: Linux carries it over exec
    # from the parent, so a child of a large process reports the parent's peak.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with torch.device("meta"):
    model = zoo.llama_decoder(zoo.LLAMA_70B)
profile = profile_model(model, inputs=torch.zeros(1, 16, dtype=torch.long))
est = profile.estimate(1, "bf16", "adamw")
print(json.dumps({
    "param_count": profile.param_count,
    "parameter_bytes": est.parameter_bytes,
    "max_rss_bytes": peak_rss_bytes(),
}))
"""


@pytest.mark.slow
def test_meta_llama_70b_profiles_in_under_2_gb() -> None:
    # A 70B-shaped decoder (Llama-2-70B: 80 layers, d_model 8192, grouped-query attention)
    # built on the meta device: 69 B parameters, 138 GB of bf16 weights that never exist.
    # A fresh process, so that its peak RSS is the profile's own (measured: 0.35 GiB).
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _LLAMA_70B_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    n = zoo.llama_param_count(zoo.LLAMA_70B)
    assert result["param_count"] == n == 68_976_648_192
    assert result["parameter_bytes"] == 2 * n
    assert result["max_rss_bytes"] < 2 * 10**9


# --------------------------------------------------------------------------------------------
# Batch sizes: fit and extrapolation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [5, 64])
@pytest.mark.parametrize(
    ("optimizer", "mode"),
    [
        ("sgd", "train"),
        ("sgd-momentum", "train"),
        (None, "inference"),
        ("adam", "train"),
    ],
)
def test_estimate_equals_measure_at_any_batch(batch: int, optimizer: str | None, mode: str) -> None:
    # Profiled at batch 2, 3 (fit) and 5 (check): batch 5 is in the fit's check, 64 is far
    # beyond it. The MLP has dropout: CPU noise tensors, exact too.
    entry = zoo.ZOO["mlp"]
    model = entry.build()
    profile = _mlp_profile()
    est = profile.estimate(batch, "fp32", optimizer, mode)
    measured = measure(model, entry.make_inputs(batch), optimizer=optimizer, mode=mode)
    assert est.peak_bytes == measured.peak_bytes


@cache
def _mlp_profile() -> ModelProfile:
    entry = zoo.ZOO["mlp"]
    return profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")


# --------------------------------------------------------------------------------------------
# Bad input: clear errors, model unchanged
# --------------------------------------------------------------------------------------------


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Module.*function"):
        profile_model(lambda x: x, input_size=(3,))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({}, "input_size=.*inputs="),
        ({"input_size": (10,), "inputs": torch.zeros(2, 10)}, "not both"),
        ({"input_size": (0, 3)}, r"positive ints.*\(0, 3\)"),
        ({"input_size": "abc"}, "input_size.*'abc'"),
        ({"input_size": (2.5,)}, "input_size"),
        ({"input_size": (True,)}, "input_size"),
        ({"inputs": torch.tensor(1.0)}, "batch dimension"),
        ({"input_size": (10,), "device": "tpu"}, "'cuda', 'cpu'"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], pattern: str) -> None:
    model = nn.Linear(10, 5)
    before = snapshot_model(model)
    with pytest.raises(ValueError, match=pattern):
        profile_model(model, **kwargs)
    assert_model_unchanged(model, before)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_shape_mismatch_names_the_module_and_shapes(device: str) -> None:
    model = nn.Sequential(nn.Linear(10, 5))
    before = snapshot_model(model)
    with pytest.raises(ProfilingError) as info:
        profile_model(model, input_size=(7,), device=device)
    message = str(info.value)
    assert "'0'" in message and "Linear" in message
    assert "Tensor(2, 7)" in message  # the input it got (batch 2: the first fit size)
    assert isinstance(info.value, vram_widget.ProfilingError)
    assert_model_unchanged(model, before)


def test_shape_mismatch_at_the_root() -> None:
    with pytest.raises(ProfilingError, match=r"'\(root\)' \(Linear\).*Tensor\(2, 7\)"):
        profile_model(nn.Linear(10, 5), input_size=(7,), device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "valid"),
    [
        ({"precision": "fp8"}, "'fp32', 'bf16', 'fp16', 'amp-bf16', 'amp-fp16'"),
        (
            {"optimizer": "lion"},
            "'sgd', 'sgd-momentum', 'adam', 'adamw', 'adagrad', 'rmsprop', 'sgd-fused'",
        ),
        ({"mode": "eval"}, "'train', 'inference'"),
    ],
)
def test_unknown_options_list_valid_values(kwargs: dict[str, str], valid: str) -> None:
    with pytest.raises(ValueError, match="valid values") as info:
        _linear_profile().estimate(4, **kwargs)
    assert valid in str(info.value)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


@pytest.mark.parametrize(
    ("batch", "error"), [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)]
)
def test_bad_batch_sizes(batch: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="batch_size"):
        _linear_profile().estimate(batch)


def test_huge_batch_is_a_python_int() -> None:
    profile = _linear_profile()
    big = profile.estimate(10**9, optimizer="sgd")
    small = profile.estimate(10**6, optimizer="sgd")
    assert isinstance(big.peak_bytes, int) and isinstance(small.peak_bytes, int)
    assert big.peak_bytes > small.peak_bytes
    # per sample: input 40 + output 80 + grad of output 80 (live at the backward peak)
    assert big.peak_bytes - small.peak_bytes == (10**9 - 10**6) * (40 + 80 + 80)
    assert isinstance(profile.estimate(np.int64(7)).peak_bytes, int)


def test_astronomical_batch_does_not_overflow() -> None:
    # 400 forward FLOPs per sample pass int64 at batch 2.3e16: Python ints, exact
    for device in ("cpu", "cuda"):
        profile = _linear_profile() if device == "cpu" else _linear_profile_cuda()
        est = profile.estimate(10**17, optimizer="sgd")
        assert est.flops_forward == 400 * 10**17
        assert est.flops_backward == 400 * 10**17
        assert isinstance(est.peak_bytes, int) and isinstance(est.total_bytes, int)
        assert est.peak_bytes == LINEAR_PEAK["sgd"] + (10**17 - 4) * (40 + 80 + 80)


@cache
def _linear_profile_cuda() -> ModelProfile:
    return profile_model(_linear(), input_size=(10,), device="cuda")


def test_loss_fn_not_scalar() -> None:
    model = nn.Linear(10, 5)
    before = snapshot_model(model)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor.*\(2, 5\)"):
        profile_model(model, input_size=(10,), loss_fn=lambda out: out, device="cpu")
    with pytest.raises(TypeError, match="loss_fn must return a scalar tensor, got float"):
        profile_model(model, input_size=(10,), loss_fn=lambda out: 1.0, device="cpu")
    assert_model_unchanged(model, before)


def _exploding_loss(output: Any) -> Any:
    raise RuntimeError("kaboom")


def test_loss_fn_that_raises() -> None:
    model = nn.Linear(10, 5)
    before = snapshot_model(model)
    with pytest.raises(ProfilingError, match="RuntimeError: kaboom"):
        profile_model(model, input_size=(10,), loss_fn=_exploding_loss, device="cpu")
    assert_model_unchanged(model, before)


def test_loss_fn_error_names_the_loss() -> None:
    with pytest.raises(ProfilingError, match="loss_fn raised RuntimeError: kaboom"):
        profile_model(nn.Linear(10, 5), input_size=(10,), loss_fn=_exploding_loss, device="cpu")


class _IntegerOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).argmax(dim=-1)


def test_default_loss_needs_a_float_output() -> None:
    model = _IntegerOutput()
    before = snapshot_model(model)
    with pytest.raises(TypeError, match=r"no floating-point tensor.*loss_fn"):
        profile_model(model, input_size=(4,), device="cpu")
    assert_model_unchanged(model, before)


# --------------------------------------------------------------------------------------------
# max_batch_size
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [10**7, 3 * 10**7, 10**9])
def test_max_batch_size_is_the_largest_that_fits(capacity: int) -> None:
    profile = _mlp_profile()
    b = profile.max_batch_size(capacity, optimizer="sgd")
    assert b >= 1
    assert profile.estimate(b, optimizer="sgd").total_bytes <= capacity
    assert profile.estimate(b + 1, optimizer="sgd").total_bytes > capacity


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("capacity", [2**30, 10**9 + 7, 2**33])
def test_max_batch_size_searches_from_the_affine_guess(
    device: str, mode: str, capacity: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The answer is the boundary (b fits, b + 1 does not, on the device basis: the replayed
    # allocator on CUDA) whatever the path; starting from the affine guess it takes a handful
    # of estimates, where doubling and bisecting from batch 1 takes about 2 * log2(b) (here b
    # is in the hundreds to hundred-thousands: 20-40).
    entry = zoo.ZOO["mlp"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device=device)
    estimate = profile.estimate
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        # the searches ask with a Recipe (estimate(recipe=...)); a call by keywords counts too
        recipe = kwargs.get("recipe")
        calls.append(recipe.step.batch_size if recipe is not None else args[0])
        return estimate(*args, **kwargs)

    monkeypatch.setattr(profile, "estimate", counted)
    b = profile.max_batch_size(capacity, "fp32", "adam", mode, basis="allocated")
    allocated_calls = len(calls)
    calls.clear()
    on_device = profile.max_batch_size(capacity, "fp32", "adam", mode)
    monkeypatch.undo()
    assert b > 100
    assert estimate(b, "fp32", "adam", mode).total_bytes <= capacity
    assert estimate(b + 1, "fp32", "adam", mode).total_bytes > capacity
    assert allocated_calls <= 8, allocated_calls
    # the device basis: the allocated answer, then a walk from a line through the replayed
    # reserved memory (a step function of segments): at most one doubling-and-bisection
    # walk, 2 * log2(b) estimates, more (on the CPU it is the allocated basis)
    assert estimate(on_device, "fp32", "adam", mode).fits(capacity)
    assert not estimate(on_device + 1, "fp32", "adam", mode).fits(capacity)
    assert len(calls) <= allocated_calls + 2 * math.log2(b) + 3, calls


def test_max_batch_size_zero_when_nothing_fits() -> None:
    profile = _mlp_profile()
    one = profile.estimate(1, optimizer="adam").total_bytes
    assert profile.max_batch_size(one - 1, optimizer="adam") == 0
    assert profile.max_batch_size(one, optimizer="adam") >= 1


@pytest.mark.parametrize("capacity", [0, -5, 80, 2**20 - 1, "80", "80 XB", 80.0, True, None])
def test_max_batch_size_refuses_capacities_that_are_not_bytes(capacity: object) -> None:
    # max_batch_size(80) meaning 80 GiB used to return 0 in silence
    with pytest.raises(ValueError, match="capacit") as err:
        _mlp_profile().max_batch_size(capacity)  # type: ignore[arg-type]
    assert "'80GiB'" in str(err.value) and "A100 80GB" in str(err.value)


def test_max_batch_size_takes_units_and_gpu_names() -> None:
    profile = _mlp_profile()
    in_bytes = profile.max_batch_size(80 * 2**30, optimizer="sgd")
    assert profile.max_batch_size("80GiB", optimizer="sgd") == in_bytes
    assert profile.max_batch_size("80 gib", optimizer="sgd") == in_bytes
    assert profile.max_batch_size("A100 80GB", optimizer="sgd") == in_bytes  # 80 GiB entry
    # GB is SI: 24 GB = 24 * 10**9 bytes, less than 24 GiB
    assert profile.max_batch_size("24 GB", optimizer="sgd") == profile.max_batch_size(
        24 * 10**9, optimizer="sgd"
    )


def test_max_batch_size_counts_cuda_extras() -> None:
    entry = zoo.ZOO["mlp"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cuda")
    est = profile.estimate(1, optimizer="adam")
    assert est.extras.cuda_context_bytes > 0 and est.total_bytes > est.peak_bytes
    # a capacity the tensors and the context would fit, but not with the cuBLAS workspace
    # and the allocator's blocks (below the context alone it is refused: test_tradeoff)
    cap = est.extras.cuda_context_bytes + est.peak_bytes
    for basis in ("device", "allocated"):
        assert profile.max_batch_size(cap, optimizer="adam", basis=basis) == 0
    cap = 2**30
    b = profile.max_batch_size(cap, optimizer="adam", basis="allocated")
    assert profile.estimate(b, optimizer="adam").total_bytes <= cap
    assert profile.estimate(b + 1, optimizer="adam").total_bytes > cap
    # the device basis also counts segments and fragmentation: never a larger batch here
    on_device = profile.max_batch_size(cap, optimizer="adam")
    assert on_device <= b and profile.estimate(on_device, optimizer="adam").fits(cap)


def test_batch_dimension_in_input_size_is_named() -> None:
    # A conv net given (1, 3, 16, 16): the conv sees a 5-D batch and fails; the message says
    # that input_size excludes the batch dimension and what to pass instead.
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())
    before = snapshot_model(model)
    with pytest.raises(ProfilingError, match=r"input_size=\(3, 16, 16\)"):
        profile_model(model, input_size=(1, 3, 16, 16), device="cpu")
    assert_model_unchanged(model, before)


class _CheckpointedNet(torch.nn.Module):
    """Four MLP blocks, optionally under torch.utils.checkpoint, plus an unused Linear."""

    def __init__(self, checkpointed: bool, reentrant: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
            for _ in range(4)
        )
        self.unused = torch.nn.Linear(100, 100)  # no gradient, so no optimizer state
        self.checkpointed = checkpointed
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = (
                checkpoint(block, x, use_reentrant=self.reentrant)
                if self.checkpointed
                else block(x)
            )
        return x


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize(
    ("checkpointed", "reentrant"),
    [
        (False, False),
        # The recompute runs in the backward with the profile's parameters swapped in (it ran
        # with the model's own until the swap held through the backward: +0.9 % at batch 3,
        # +5.7 % at 7 on a Hugging Face model) and checkpoint's saved CPU RNG state counted
        # (5,056 B per region; inference missed it).
        (True, False),
        # A reentrant checkpoint whose input needs no grad gives its parameters no gradient,
        # so Adam keeps no state for them.
        (True, True),
    ],
)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpointing_and_unused_parameters(
    checkpointed: bool, reentrant: bool, precision: str
) -> None:
    model = _CheckpointedNet(checkpointed, reentrant)
    profile = profile_model(model, input_size=(64,), device="cpu")
    # batch sizes where the CPU's bf16 matmul scratch is measured, not interpolated
    for batch in (8, 32):
        for optimizer, mode in (("sgd", "train"), ("adam", "train"), (None, "inference")):
            est = profile.estimate(batch, precision, optimizer, mode).peak_bytes
            real = measure(
                model, torch.zeros(batch, 64), optimizer=optimizer, precision=precision, mode=mode
            ).peak_bytes
            assert est == real, (batch, optimizer, mode)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16", "amp-fp16"])
def test_checkpointed_model_profiles_for_cuda(precision: str) -> None:
    # device="cuda" (the default) emulates CUDA's kernels in the forward; the recompute in
    # the backward must see the same emulation, or autograd finds other tensors saved
    # ("a different number of tensors was saved") and the profile failed. Checkpointing
    # keeps only the blocks' inputs: at batch 4096 the four blocks' saved activations
    # (4 x (256 + 256 + 64) x 4 B per sample in fp32) shrink to the inputs (64 x 4 B each).
    plain = profile_model(_CheckpointedNet(False, False), input_size=(64,))
    checkpointed = profile_model(_CheckpointedNet(True, False), input_size=(64,))
    est = checkpointed.estimate(4096, precision, "adam")
    assert est.peak_bytes < plain.estimate(4096, precision, "adam").peak_bytes
    assert est.flops > plain.estimate(4096, precision, "adam").flops  # the recompute


# --------------------------------------------------------------------------------------------
# Outputs of every shape (each case is also checked against measure() above)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [k for k in OUTPUT_KINDS if k != "tuple"])
def test_output_containers_give_the_tuples_estimate(kind: str) -> None:
    # The same net returns (logits, hidden) as a tuple, a list, a dict, a dataclass or a
    # ModelOutput look-alike: the same two tensors live as long, and the default loss reads the
    # logits from each, so every estimate is the tuple's (a loss read from the hidden features
    # would differ). Returning the logits alone frees the hidden features earlier.
    tuple_profile = _case_profile("tuple_output")
    profile = _case_profile(output_case_name(kind))
    for batch in (3, 7):
        for optimizer, mode in (("sgd", "train"), ("adam", "train"), (None, "inference")):
            est = profile.estimate(batch, "fp32", optimizer, mode)
            ref = tuple_profile.estimate(batch, "fp32", optimizer, mode)
            if kind == "tensor" and mode == "train":
                assert est.peak_bytes < ref.peak_bytes
            else:
                assert est.peak_bytes == ref.peak_bytes, (batch, optimizer, mode)
            assert est.flops == ref.flops


# --------------------------------------------------------------------------------------------
# The estimate's mode decides dropout and BatchNorm, whatever the model's own flag
# --------------------------------------------------------------------------------------------


def _bn_dropout_net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Flatten(),
            nn.Linear(4 * 6 * 6, 3),
        )


def test_estimate_mode_decides_dropout_and_batchnorm() -> None:
    # A model left in eval() and the same model in train() give the same estimates: train
    # runs dropout (its noise tensor saved) and BatchNorm on batch statistics, inference runs
    # neither, as measure() does on a copy whose flag it sets from the mode. Both flags are
    # restored.
    x = torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(0))
    profiles = {}
    for training in (True, False):
        model = _bn_dropout_net().train(training)
        before = snapshot_model(model)
        profiles[training] = profile_model(model, input_size=(3, 6, 6), device="cpu")
        assert_model_unchanged(model, before)
        for optimizer, mode in (("sgd", "train"), ("adam", "train"), (None, "inference")):
            est = profiles[training].estimate(5, optimizer=optimizer, mode=mode)
            real = measure(model, x, optimizer=optimizer, mode=mode)
            assert est.peak_bytes == real.peak_bytes, (training, optimizer, mode)
        assert model.training is training and model[3].training is training
    for mode in ("train", "inference"):
        on, off = profiles[True].estimate(5, mode=mode), profiles[False].estimate(5, mode=mode)
        assert on.peak_bytes == off.peak_bytes and on.activation_bytes == off.activation_bytes
    # the eval() model's train estimate has dropout's activations: on the CPU a float32 noise
    # tensor of its input's shape (5 x 144), and its output, which the Linear saves
    rows = profiles[False].estimate(5, optimizer="sgd").to_dataframe().set_index("name")
    assert rows.loc["3", "activation_bytes"] == 2 * (5 * 4 * 6 * 6 * 4)


# --------------------------------------------------------------------------------------------
# Devices: inputs elsewhere than the model, the meta device, models already on a GPU
# --------------------------------------------------------------------------------------------


def test_inputs_on_another_device_than_the_model() -> None:
    # A real step of a CPU model on CUDA inputs fails, so profiling one is refused, naming
    # both devices. Without a GPU, a fake tensor stands in for the CUDA batch (the check only
    # reads .device).
    from vram_widget._profiling.fake import FakeTensorMode

    with FakeTensorMode():
        cuda_x = torch.empty(2, 4, device="cuda")
    model = nn.Sequential(nn.Linear(4, 3))
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = snapshot_model(model)
    for inputs, name in ((cuda_x, r"inputs\[0\]"), ({"input": cuda_x}, r"inputs\['input'\]")):
        with pytest.raises(
            ValueError,
            match=rf"{name} is on device 'cuda:0', but the model's parameters and buffers are "
            r"on 'cpu': a real step would fail there\. Move the inputs with \.to\('cpu'\)",
        ):
            profile_model(model, inputs=inputs, device="cpu")
    assert_model_unchanged(model, before)


def test_meta_device_on_either_side_means_shapes_only() -> None:
    # The profile runs on fake tensors of the inputs' shapes: a model on the meta device with
    # CPU inputs, a CPU model with a meta batch, and both on meta give the CPU pair's estimate.
    case = CASES["batchnorm"]
    reference = _case_profile("batchnorm")
    with torch.device("meta"):
        meta_model = case.factory()
    x = case.make_inputs(2)
    pairs = [(meta_model, x), (case.build(), x.to("meta")), (meta_model, x.to("meta"))]
    for model, inputs in pairs:
        profile = profile_model(model, inputs=inputs, device="cpu")
        for optimizer, mode in (("adam", "train"), (None, "inference")):
            est = profile.estimate(7, optimizer=optimizer, mode=mode)
            ref = reference.estimate(7, optimizer=optimizer, mode=mode)
            assert est.peak_bytes == ref.peak_bytes
            assert est.parameter_bytes == ref.parameter_bytes > 0
            assert est.buffer_bytes == ref.buffer_bytes > 0
    assert all(t.device.type == "meta" for t in (*meta_model.parameters(), *meta_model.buffers()))


_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@_no_cuda
def test_model_on_gpu_is_profiled_without_allocating_there() -> None:
    # Parameters and buffers become fake CPU tensors of their shapes: nothing is moved,
    # copied or allocated on the GPU, not even briefly, and the estimate is the one of the
    # same model on the CPU.
    case = CASES["batchnorm"]
    model = case.build().cuda()
    inputs = case.make_inputs(2).cuda()
    before = snapshot_model(model)  # its clones live on the GPU from here on
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    profile = profile_model(model, inputs=inputs, device="cuda")
    settings = [
        (7, "fp32", "adam", "train"),
        (7, "bf16", "sgd", "train"),
        (7, "fp32", None, "inference"),
    ]
    ests = [profile.estimate(*s) for s in settings]  # bf16: profiled lazily, here
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.max_memory_allocated() == allocated
    assert all(t.is_cuda for t in (*model.parameters(), *model.buffers()))
    assert_model_unchanged(model, before)
    reference = profile_model(case.build(), inputs=case.make_inputs(2), device="cuda")
    for est, setting in zip(ests, settings, strict=True):
        assert est.peak_bytes == reference.estimate(*setting).peak_bytes, setting


@pytest.mark.gpu
@_no_cuda
def test_cuda_inputs_for_a_cpu_model_and_back_are_refused() -> None:
    with pytest.raises(ValueError, match=r"inputs\[0\] is on device 'cuda:0'.*on 'cpu'"):
        profile_model(nn.Linear(4, 3), inputs=torch.zeros(2, 4, device="cuda:0"))
    with pytest.raises(ValueError, match=r"inputs\[0\] is on device 'cpu'.*on 'cuda:0'"):
        profile_model(nn.Linear(4, 3).to("cuda:0"), inputs=torch.zeros(2, 4))


# --------------------------------------------------------------------------------------------
# The user's own code raises: our one-line context, their exception and frames
# --------------------------------------------------------------------------------------------


def _user_helper(x: torch.Tensor) -> torch.Tensor:
    raise ValueError("my bug")


class _BuggyInner(nn.Module):
    def __init__(self, only_in_inference: bool) -> None:
        super().__init__()
        self.only_in_inference = only_in_inference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.only_in_inference:
            return x
        return _user_helper(x)


class _BuggyNet(nn.Module):
    def __init__(self, only_in_inference: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = _BuggyInner(only_in_inference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.relu(self.fc(x)))


def _frames(exc: BaseException | None) -> list[tuple[str, str]]:
    assert exc is not None
    return [(os.path.abspath(f.filename), f.name) for f in traceback.extract_tb(exc.__traceback__)]


_HERE = os.path.abspath(__file__)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    ("only_in_inference", "phase"),
    [(False, "the forward of a training step"), (True, "an inference forward")],
)
def test_forward_that_raises_keeps_the_users_exception(
    device: str, only_in_inference: bool, phase: str
) -> None:
    model = _BuggyNet(only_in_inference)
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    torch.manual_seed(5)
    before = snapshot_model(model)
    with pytest.raises(ProfilingError) as info:
        profile_model(model, input_size=(4,), device=device)
    assert str(info.value) == (
        f"module 'inner' (_BuggyInner) failed on inputs (Tensor(2, 4) float32) in {phase} "
        "(fp32, batch 2): ValueError: my bug"
    )
    cause = info.value.__cause__
    assert type(cause) is ValueError and str(cause) == "my bug"
    # the user's frames only: no profiler, functional_call or nn.Module.__call__ frames
    assert _frames(cause) == [(_HERE, "forward"), (_HERE, "forward"), (_HERE, "_user_helper")]
    assert_model_unchanged(model, before)


class _KeywordOnly(nn.Module):
    """Takes its batch as keywords, Hugging Face style, and rejects the mask's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(
        self, input_ids: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert input_ids is not None and mask is not None
        if mask.dtype is torch.bool:
            raise ValueError("mask must be float")
        return self.fc(input_ids) * mask


def test_root_failure_names_the_keyword_inputs() -> None:
    # Module hooks see positional arguments only; the root's keyword tensors are named too.
    inputs = {"input_ids": torch.zeros(2, 4), "mask": torch.ones(2, 4, dtype=torch.bool)}
    with pytest.raises(ProfilingError) as info:
        profile_model(_KeywordOnly(), inputs=inputs, device="cpu")
    assert str(info.value) == (
        "module '(root)' (_KeywordOnly) failed on inputs () and keywords "
        "{input_ids: Tensor(2, 4) float32, mask: Tensor(2, 4) bool} in the forward of a "
        "training step (fp32, batch 2): ValueError: mask must be float"
    )


class _BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("bad gradient")


class _BadBackwardNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        return _BadBackward.apply(self.fc(x))


def test_backward_that_raises_is_not_blamed_on_the_loss() -> None:
    model = _BadBackwardNet()
    before = snapshot_model(model)
    with pytest.raises(ProfilingError) as info:
        profile_model(model, input_size=(4,), device="cpu")
    assert str(info.value) == (
        "the backward pass of a training step (fp32, batch 2) raised ArithmeticError: bad gradient"
    )
    assert type(info.value.__cause__) is ArithmeticError
    assert _frames(info.value.__cause__) == [(_HERE, "backward")]
    assert_model_unchanged(model, before)


def test_loss_fn_that_raises_keeps_its_frames() -> None:
    with pytest.raises(ProfilingError) as info:
        profile_model(nn.Linear(10, 5), input_size=(10,), loss_fn=_exploding_loss, device="cpu")
    assert str(info.value) == "loss_fn raised RuntimeError: kaboom (training step, fp32, batch 2)"
    assert _frames(info.value.__cause__) == [(_HERE, "_exploding_loss")]


def test_shape_mismatch_traceback_ends_at_the_failing_op() -> None:
    # A torch op rejecting its input: the cause's frames are the model's forwards down to the
    # call of the op, not the recorder's dispatch mode or the fake tensor kernels below it.
    with pytest.raises(ProfilingError) as info:
        profile_model(nn.Sequential(nn.Linear(10, 5)), input_size=(7,), device="cpu")
    frames = _frames(info.value.__cause__)
    assert [name for _file, name in frames] == ["forward", "forward"]
    assert frames[0][0].endswith(os.path.join("torch", "nn", "modules", "container.py"))
    assert frames[1][0].endswith(os.path.join("torch", "nn", "modules", "linear.py"))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_backward_events_belong_to_the_node_that_ran(device: str) -> None:
    # The autograd engine frees a node's saved tensors and consumed gradients between ops,
    # and runs AccumulateGrad right after the node producing the gradient: those events
    # belong to the module whose backward just ran, not to the loss. So, grouped by top-level
    # block, backward visits each block once, in reverse order of the forward.
    model = zoo.resnet18()
    est = profile_model(model, input_size=(3, 32, 32), device=device).estimate(4)
    names = est.layers.name
    loss_row = names.index("(loss)")
    phase = np.asarray(est.event_phase)
    module = np.asarray(est.event_module)
    backward = np.flatnonzero(phase == PHASE_CODE[Phase.BACKWARD])
    first_module_op = backward[np.argmax(module[backward] != loss_row)]
    assert not np.any(module[backward][backward > first_module_op] == loss_row)
    top = [n.split(".")[0] for n in np.asarray(names, dtype=object)[module[backward]]]
    runs = [t for i, t in enumerate(top) if i == 0 or t != top[i - 1]]
    assert runs[0] == "(loss)"
    assert len(runs) == len(set(runs))  # each block's backward is one run
    children = [n for n, _ in model.named_children()]
    order = [r for r in runs if r in children]
    assert order == sorted(order, key=children.index, reverse=True)


def test_stock_fake_mode_gives_the_same_estimates(monkeypatch: pytest.MonkeyPatch) -> None:
    # The cheaper cache keys (fake._ProfilingFakeTensorMode) are used only on a torch whose
    # private hook matches; any other torch gets the stock FakeTensorMode. Both must agree.
    import vram_widget._profiling.fake as fake

    model = zoo.resnet18()
    fast = profile_model(model, input_size=(3, 32, 32))
    monkeypatch.setattr(fake, "_CHEAP_KEYS_FIT", False)
    stock = profile_model(model, input_size=(3, 32, 32))
    for batch, precision, optimizer in ((1, "fp32", "adam"), (7, "bf16", "sgd")):
        a = fast.estimate(batch, precision, optimizer)
        b = stock.estimate(batch, precision, optimizer)
        assert (a.peak_bytes, a.flops, a.activation_bytes) == (
            b.peak_bytes,
            b.flops,
            b.activation_bytes,
        )


def test_rnn_reads_its_own_weights_again_after_a_profile() -> None:
    # nn.LSTM's forward reads its _flat_weights list, not its parameters: a run points it at
    # the fake weights swapped in, and afterwards at the module's own parameters again
    entry = zoo.ZOO["lstm"]
    model = entry.build()
    lstm = next(m for m in model.modules() if isinstance(m, nn.LSTM))
    profile_model(model, inputs=entry.make_inputs(2), device="cuda", precisions=("fp32",))
    own = [getattr(lstm, name) for name in lstm._flat_weights_names]
    assert all(a is b for a, b in zip(lstm._flat_weights, own, strict=True))
    assert all(isinstance(w, nn.Parameter) for w in lstm._flat_weights)


def test_is_cached_knows_precision_mode_and_optimizer() -> None:
    # precisions=("fp32",) runs fp32 training, fp32 inference and Adam; anything else is lazy.
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu", precisions=("fp32",))
    assert profile.is_cached("fp32", "train", "adam")
    assert profile.is_cached("fp32", "train", None)
    assert profile.is_cached("fp32", "inference", "sgd")  # inference runs no optimizer
    assert not profile.is_cached("fp32", "train", "sgd")
    assert not profile.is_cached("bf16", "train", None)
    profile.estimate(4, "fp32", "sgd")
    assert profile.is_cached("fp32", "train", "sgd")
    # The default profiles nothing up front: the first estimate runs what it needs alone.
    lazy = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    assert not lazy.is_cached("fp32", "train", None)
    assert not lazy.is_cached("fp32", "inference")
    lazy.estimate(4, "bf16", "adam")
    assert lazy.is_cached("bf16", "train", "adam")
    assert not lazy.is_cached("bf16", "inference")
    assert not lazy.is_cached("fp32", "train", None)


class _NoShortcuts(contextlib.nullcontext):  # type: ignore[type-arg]
    """Stands in for fake.MetaShortcuts: every meta kernel runs in full."""


# slow: meta tensors only (no CPU kernel runs), so the narrowed-ISA pass would repeat it as is
@pytest.mark.slow
@pytest.mark.parametrize("device", ["cuda", "cpu"])  # foreach and single-tensor optimizers
def test_meta_shortcuts_leave_the_optimizer_trace_unchanged(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The optimizer trace skips in-place pointwise meta kernels and reuses the outputs of
    # repeated out-of-place ones; every event and every state byte must be what the full
    # meta kernels give, for every optimizer and a half precision.
    import vram_widget._profiling.optimizer_state as optimizer_state_module
    from vram_widget._estimating.options import OptimizerName, Precision

    # ResNet-18: many parameters of repeated shapes, so the reused outputs are exercised
    profile = profile_model(zoo.resnet18(), input_size=(3, 32, 32), device=device)
    profiler = profile._source.profiler  # type: ignore[attr-defined]
    configs = [(p, o) for p in (Precision.FP32, Precision.BF16) for o in OptimizerName]
    fast = [profiler.run_optimizer(p, o) for p, o in configs]
    # Adam's step allocates temporaries (sqrt of the second moment, ...): not a vacuous check
    assert len(fast[configs.index((Precision.FP32, OptimizerName.ADAM))].event_bytes) > 0
    monkeypatch.setattr(optimizer_state_module, "MetaShortcuts", _NoShortcuts)
    for (precision, optimizer), a in zip(configs, fast, strict=True):
        b = profiler.run_optimizer(precision, optimizer)
        assert np.array_equal(a.event_bytes, b.event_bytes), (precision, optimizer)
        assert np.array_equal(a.state_bytes, b.state_bytes), (precision, optimizer)
        assert np.array_equal(a.state_block_bytes, b.state_block_bytes), (precision, optimizer)


# --------------------------------------------------------------------------------------------
# What a dispatch mode changes in a step, undone: in-place gradient sums, F.linear's add_
# --------------------------------------------------------------------------------------------


class _Diamond(nn.Module):
    """One activation read by two branches: its gradient is summed from both in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.left = nn.Linear(64, 64)
        self.right = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.left(h).sin() + self.right(h).cos()


class _PermutedLinear(nn.Module):
    """``F.linear`` on non-contiguous 3-D and 4-D inputs, with a bias: the path where the
    real kernel adds its bias in place (matmul, then ``add_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(8, 24)
        self.head = nn.Linear(24, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 8, 5, 7)
        y = self.mix(x.permute(0, 3, 2, 1))  # 4-D, non-contiguous: (B, 7, 5, 24)
        z = y.flatten(1, 2).transpose(0, 1)  # 3-D, non-contiguous: (35, B, 24)
        return self.head(torch.tanh(z))


class _MixedDtypes(nn.Module):
    """bf16 activations meeting fp32 tensors in pointwise ops (as under CPU amp-bf16)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = torch.tanh(self.fc(x)).bfloat16()
        gate = (x > 0).float()
        mixed = half * gate  # bf16 * fp32: the CPU copies `half` to fp32 first
        picked = torch.where(x > 0, half, x)  # the bool condition is not copied
        return (mixed + picked).sum(-1)


def _dispatch_mode_case(name: str) -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name == "diamond":
            return _Diamond(), lambda b: torch.randn(b, 32, generator=gen)
        if name == "mixed_dtypes":
            return _MixedDtypes(), lambda b: torch.randn(b, 64, generator=gen)
        return _PermutedLinear(), lambda b: torch.randn(b, 8, 5, 7, generator=gen)


@pytest.mark.parametrize("name", ["diamond", "permuted_linear", "mixed_dtypes"])
@pytest.mark.parametrize(
    ("optimizer", "mode"), [("sgd", "train"), ("adam", "train"), (None, "inference")]
)
def test_dispatch_mode_differences_are_undone(name: str, optimizer: str | None, mode: str) -> None:
    # Under any dispatch mode, the autograd engine sums gradients out of place and F.linear
    # adds its bias out of place (isTensorSubclassLike); a real step does both in place.
    # And the CPU copies mixed-dtype inputs of pointwise ops, which fake kernels do not.
    # Estimated from the profile, the step's peak equals the measured one to the byte.
    model, make = _dispatch_mode_case(name)
    profile = profile_model(model, inputs=make(2), device="cpu")
    for batch in (3, 7):
        est = profile.estimate(batch, "fp32", optimizer, mode)
        measured = measure(model, make(batch), optimizer=optimizer, mode=mode)
        assert est.peak_bytes == measured.peak_bytes, (batch, est.peak_bytes, measured)


def test_gradient_sums_in_place_allocate_one_tensor_fewer() -> None:
    # The diamond's two gradients of h, (B, 64) float32 each, are summed once in backward:
    # in place, as a real step does, the step allocates one (B, 64) tensor fewer than the
    # same profile with the sum left out of place: B * 64 * 4 bytes (768 at batch 3).
    import vram_widget._profiling.recorder as recorder_module

    def allocated(profile: ModelProfile, batch: int) -> int:
        live = profile.estimate(batch, "fp32", "sgd").live_bytes
        return int(np.clip(np.diff(live), 0, None).sum())

    model, make = _dispatch_mode_case("diamond")
    in_place = profile_model(model, inputs=make(2), device="cpu", precisions=("fp32",))
    original = recorder_module.Recorder._is_buffer_sum
    try:
        recorder_module.Recorder._is_buffer_sum = lambda *_a, **_k: False  # type: ignore[method-assign]
        out_of_place = profile_model(model, inputs=make(2), device="cpu", precisions=("fp32",))
    finally:
        recorder_module.Recorder._is_buffer_sum = original  # type: ignore[method-assign]
    for batch in (3, 7):
        assert allocated(out_of_place, batch) - allocated(in_place, batch) == batch * 64 * 4


def test_mixed_dtype_copies_are_counted_on_the_cpu_only() -> None:
    # `half * gate` at batch 7: the CPU copies the (7, 64) bf16 operand to fp32 for the
    # call, 7 * 64 * 4 = 1792 bytes beside the output; CUDA kernels cast as they load.
    import vram_widget._profiling.recorder as recorder_module

    model, make = _dispatch_mode_case("mixed_dtypes")
    with_copies = profile_model(model, inputs=make(2), device="cpu", precisions=("fp32",))
    original = recorder_module.promotion_copy_bytes
    try:
        recorder_module.promotion_copy_bytes = lambda *_a: 0  # type: ignore[assignment]
        without = profile_model(model, inputs=make(2), device="cpu", precisions=("fp32",))
    finally:
        recorder_module.promotion_copy_bytes = original  # type: ignore[assignment]
    a = with_copies.estimate(7, "fp32", None, "inference")
    b = without.estimate(7, "fp32", None, "inference")
    copies = (
        np.clip(np.diff(a.live_bytes), 0, None).sum()
        - np.clip(np.diff(b.live_bytes), 0, None).sum()
    )
    # half * gate (7*64*4), where(x > 0, half, x) (the same), mixed + picked (fp32 + fp32: 0)
    assert copies == 2 * 7 * 64 * 4
    cuda = profile_model(model, inputs=make(2)).estimate(7, "fp32", None, "inference")
    cuda_allocated = np.clip(np.diff(cuda.live_bytes), 0, None).sum()
    assert cuda_allocated == np.clip(np.diff(b.live_bytes), 0, None).sum()


def test_fused_transformer_layers_under_cpu_autocast() -> None:
    # In eval, nn.TransformerEncoderLayer runs one fused CPU kernel whose inner matmuls
    # autocast casts: it returns bf16 where its meta kernel says fp32, and the bf16 copies of
    # its weights stay in autocast's cast cache until the forward ends. Both are modelled:
    # the amp-bf16 inference peak equals the measured one to the byte (was -9.5 % at batch 1,
    # +6.5 % at 32, when the cache was counted as a transient and the next layer saw fp32).
    entry = zoo.ZOO["transformer_encoder"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")
    for batch in (1, 8):
        est = profile.estimate(batch, "amp-bf16", None, "inference")
        measured = measure(
            entry.build(), entry.make_inputs(batch), optimizer=None, precision="amp-bf16",
            mode="inference",
        )  # fmt: skip
        assert est.peak_bytes == measured.peak_bytes, (batch, est.peak_bytes, measured)


# --------------------------------------------------------------------------------------------
# The input shape, stated
# --------------------------------------------------------------------------------------------


def test_profile_states_the_input_shape() -> None:
    assert "inputs: batch × 784," in repr(profile_model(zoo.mlp(), input_size=(784,)))
    entry = zoo.ZOO["dict_input"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2))
    assert profile.input_shape == (  # the token inputs' dim 1 is the sequence
        "input_ids: batch × seq int64, attention_mask: batch × seq int64, labels: batch int64 "
        "(seq = 32)"
    )
    positional = profile_model(_Scaled(), inputs=(torch.randn(2, 4), torch.randn(6)))
    assert positional.input_shape == "[0]: batch × 4, [1]: 6"  # the second has no batch dim


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * scale


class _NeedsThreeDims(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError("expected (batch, time, features)")
        return self.fc(x)


def test_batch_size_looking_input_size_warns_when_the_model_also_takes_less() -> None:
    # (32, 784) for an MLP: a batch of 32 given as one sample's shape. It profiles (Linear
    # takes any leading dims) and answered for 32x the memory and FLOPs, silently.
    with pytest.warns(vram_widget.InputShapeWarning, match=r"input_size=\(784,\)") as record:
        profile = profile_model(zoo.mlp(), input_size=(32, 784), device="cpu")
    assert "batch × 32 × 784" in str(record[0].message)
    assert profile.input_shape == "batch × 32 × 784"  # the shape as given is what is profiled
    one = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    # 32 samples per sample: the forward FLOPs are exactly 32x
    assert profile.estimate(2).flops_forward == 32 * one.estimate(2).flops_forward


@pytest.mark.parametrize(
    ("model", "size"),
    [
        (zoo.mlp(hidden=(8,)), (784,)),  # one dimension: nothing to drop
        (nn.Conv2d(3, 4, 3), (3, 16, 16)),  # 3 is not a common batch size
        (_NeedsThreeDims(), (16, 8)),  # the model needs the leading dim: a real axis
    ],
)
def test_no_input_shape_warning_where_the_shape_is_plausible(
    model: nn.Module, size: tuple[int, ...]
) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", vram_widget.InputShapeWarning)
        profile_model(model, input_size=size, device="cpu")


# --------------------------------------------------------------------------------------------
# Errors that say what to do
# --------------------------------------------------------------------------------------------


class _TwoTensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + y


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        (nn.Linear, {"input_size": (4,)}, r"class Linear, not a module: instantiate it"),
        (
            nn.Linear(4, 4).state_dict(),
            {"input_size": (4,)},
            r"state dict: it holds weights but no architecture.*load_state_dict",
        ),
        (_TwoTensors(), {"input_size": (4,)}, r"forward\(x, y\).*'y'.*inputs=\(x, y\)"),
        (_TwoTensors(), {"inputs": torch.randn(2, 4)}, r"inputs=\(x, y\).*inputs=\{'name'"),
        (_TwoTensors(), {"inputs": {"x": torch.randn(2, 4), "z": torch.randn(2, 4)}}, r"'z'"),
    ],
)
def test_errors_say_what_to_do(model: Any, kwargs: dict[str, Any], message: str) -> None:
    inputs = kwargs.get("inputs", torch.randn(2, 4))
    before = snapshot_model(model) if isinstance(model, nn.Module) else None
    with pytest.raises(TypeError, match=message):
        profile_model(model, **kwargs)
    with pytest.raises(TypeError, match=message):
        measure(model, inputs)
    if before is not None:
        assert_model_unchanged(model, before)


# --------------------------------------------------------------------------------------------
# Memory quadratic in the batch
# --------------------------------------------------------------------------------------------


def _clip_loss(z: torch.Tensor) -> torch.Tensor:
    """CLIP's contrastive loss on one tower: B x B cosine logits, the diagonal the target."""
    z = torch.nn.functional.normalize(z, dim=-1)
    logits = z @ z.t() / 0.07
    return torch.nn.functional.cross_entropy(logits, torch.arange(z.shape[0]))


def test_contrastive_loss_quadratic_in_the_batch_is_fitted_exactly() -> None:
    # The B x B logits, their softmax and its gradient grow as B^2: a line through batch 2
    # and 3 put batch 1024 at 8 % of the measured peak (1.07 MB vs 13.1 MB) and warned
    # "extrapolated". Three runs give the quadratic, checked exactly at batch 8.
    import warnings

    model = nn.Linear(64, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile = profile_model(model, input_size=(64,), loss_fn=_clip_loss, device="cpu")
    for batch in (8, 256, 1024):
        est = profile.estimate(batch, optimizer="sgd")
        real = measure(model, torch.randn(batch, 64), loss_fn=_clip_loss, optimizer="sgd")
        assert est.exact
        assert est.peak_bytes == real.peak_bytes, batch
    # the logits' matmul: 2 * B * B * 32 FLOPs forward, quadratic too
    flops = [profile.estimate(b, optimizer="sgd").flops_forward for b in (100, 200, 300)]
    assert flops[2] - 2 * flops[1] + flops[0] == 2 * 32 * 2 * 100**2  # 2nd difference


def test_memory_no_polynomial_fits_warns_how_far_off() -> None:
    # A step whose bytes at the fourth batch are neither a line nor a quadratic: 2^B bytes
    class Exponential(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum() * torch.ones(2 ** x.shape[0]).sum()

    # profiled (and so warned) on the first estimate
    with pytest.warns(UserWarning, match=r"at batch 5 the fitted peak is -?[\d,]+ bytes"):
        profile_model(Exponential(), input_size=(4,), device="cpu").estimate(2)


class _HalfOnly(nn.Module):
    """A layer whose kernel runs in bf16 only (as CUDA's grouped GEMM did)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            raise RuntimeError("Expected inputs of BF16 type")
        return self.fc(x)


def test_a_precision_that_cannot_run_fails_alone() -> None:
    # profile_model used to profile fp32 first and fail the whole model; now the profile
    # serves the precisions that run and the others raise naming the module and the op
    model = nn.Sequential(nn.Linear(8, 8), _HalfOnly())
    profile = profile_model(model, input_size=(8,))
    assert profile.estimate(4, "bf16").peak_bytes > 0
    with pytest.raises(ProfilingError, match=r"train in fp32 cannot run for device='cuda' "
                       r"\(bf16 can\): module '1' \(_HalfOnly\)") as err:  # fmt: skip
        profile.estimate(4, "fp32")
    assert "Expected inputs of BF16 type" in str(err.value)
    with pytest.raises(ProfilingError, match="fp32 cannot run"):  # cached: no second run
        profile.estimate(8, "fp32", None, "inference")
    w = show_memory(model, input_size=(8,))
    assert w.precision == "bf16"  # the widget starts where the model runs


def test_a_model_that_runs_in_no_precision_raises() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("broken model")

    with pytest.raises(ProfilingError, match="broken model"):
        profile_model(Broken(), input_size=(8,))


# --------------------------------------------------------------------------------------------
# The sequence axis
# --------------------------------------------------------------------------------------------


def test_token_inputs_give_the_sequence_axis() -> None:
    entry = zoo.ZOO["dict_input"]  # input_ids, attention_mask (B, 32) int64; labels (B,)
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")
    assert profile.has_seq_axis and profile.seq_len == 32
    assert profile.input_shape == (
        "input_ids: batch × seq int64, attention_mask: batch × seq int64, labels: batch int64 "
        "(seq = 32)"
    )
    est = profile.estimate(4, optimizer="sgd", seq_len=50)
    assert est.seq_len == 50 and profile.estimate(4).seq_len == 32
    # exact: the same as profiling an example of that length
    other = profile_model(entry.build(), inputs=_dict_inputs(entry, 2, 50), device="cpu")
    assert est.peak_bytes == other.estimate(4, optimizer="sgd").peak_bytes
    assert est.flops == other.estimate(4, optimizer="sgd").flops


def _dict_inputs(entry: Any, batch: int, seq: int) -> dict[str, torch.Tensor]:
    inputs = entry.make_inputs(batch)
    return {k: v[:, :1].repeat(1, seq) if v.dim() == 2 else v for k, v in inputs.items()}


def test_explicit_seq_axis_on_a_float_input() -> None:
    # input_size=(12, 16): 12 frames of 16 features; seq_axis=1 is dim 1 of the batch
    model = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    profile = profile_model(model, input_size=(12, 16), seq_axis=1, device="cpu")
    assert profile.seq_len == 12 and profile.input_shape == "batch × seq × 16 (seq = 12)"
    longer = profile_model(model, input_size=(30, 16), device="cpu")
    assert profile.estimate(3, seq_len=30).peak_bytes == longer.estimate(3).peak_bytes
    assert not profile_model(model, input_size=(12, 16), device="cpu").has_seq_axis


def test_max_seq_len_is_the_boundary() -> None:
    emb = nn.Embedding(100, 64)
    profile = profile_model(emb, inputs=torch.zeros(2, 8, dtype=torch.long), device="cpu")
    n = profile.max_seq_len(2**21, batch_size=4, optimizer="sgd")
    assert n > 8
    assert profile.estimate(4, optimizer="sgd", seq_len=n).total_bytes <= 2**21
    assert profile.estimate(4, optimizer="sgd", seq_len=n + 1).total_bytes > 2**21
    assert profile.max_batch_size(2**21, optimizer="sgd", seq_len=n) >= 4


@pytest.mark.parametrize(
    ("seq_axis", "error", "message"),
    [
        ({"tokens": 1}, ValueError, r"names input 'tokens'.*input_ids: \(2, 32\)"),
        ({"input_ids": 2}, ValueError, r"give a dim from 1 to 1 of input_ids"),
        (0, ValueError, r"dim 0 is the batch"),
        (3, ValueError, r"no batched input has dim 3"),
        ({"input_ids": 1, "labels": 0}, ValueError, r"dim 0 is the batch"),
        ("seq", TypeError, r"seq_axis must be None .*False .*int.*dict"),
    ],
)
def test_bad_seq_axis_names_the_inputs(seq_axis: Any, error: type[Exception], message: str) -> None:
    entry = zoo.ZOO["dict_input"]
    model = entry.build()
    inputs = entry.make_inputs(2)
    before = snapshot_model(model)
    with pytest.raises(error, match=message):
        profile_model(model, inputs=inputs, seq_axis=seq_axis)
    assert_model_unchanged(model, before)


def test_seq_axes_of_different_lengths_are_refused() -> None:
    ids, short = torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)

    class TwoTowers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.emb(a).sum() + self.emb(b).sum()

    with pytest.raises(ValueError, match=r"different lengths \(\[0\]: 16, \[1\]: 8\)"):
        profile_model(TwoTowers(), inputs=(ids, short), seq_axis=1)
    # found automatically: no axis, and an estimate at a length says why
    profile = profile_model(TwoTowers(), inputs=(ids, short))
    assert not profile.has_seq_axis
    with pytest.raises(ValueError, match=r"no sequence axis .*different lengths"):
        profile.estimate(2, seq_len=20)


@pytest.mark.parametrize(
    ("seq_len", "error"), [(0, ValueError), (-3, ValueError), (2.5, TypeError)]
)
def test_bad_seq_len(seq_len: Any, error: type[Exception]) -> None:
    entry = zoo.ZOO["dict_input"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")
    with pytest.raises(error, match="seq_len"):
        profile.estimate(2, seq_len=seq_len)


def test_a_model_without_a_sequence_refuses_seq_len() -> None:
    profile = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu")
    assert not profile.has_seq_axis and profile.seq_len is None
    with pytest.raises(ValueError, match=r"no sequence axis \(inputs: batch × 784"):
        profile.estimate(2, seq_len=16)
    with pytest.raises(ValueError, match="no sequence axis"):
        profile.max_seq_len("1 GiB")


def test_other_lengths_are_numpy_once_the_length_is_fitted(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first other length fits the profile as a polynomial in (batch, seq), checked at a
    # fourth length; every later length is numpy: no more runs.
    entry = zoo.ZOO["dict_input"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2))  # device="cuda"
    first = profile.estimate(4, optimizer="sgd", seq_len=50)
    assert profile.timeline(Precision.FP32, Mode.TRAIN, 50).seq_degree == 2
    monkeypatch.setattr(profile, "_source", None)  # any further profiling would fail
    for seq in (7, 300, 4096):
        est = profile.estimate(4, optimizer="sgd", seq_len=seq)
        assert est.seq_len == seq and est.peak_bytes > 0
    assert profile.estimate(4, optimizer="sgd", seq_len=50).peak_bytes == first.peak_bytes
    # exact where measured: the same as profiling an example of that length
    other = profile_model(entry.build(), inputs=_dict_inputs(entry, 2, 300))
    assert profile.estimate(4, optimizer="sgd", seq_len=300).peak_bytes == (
        other.estimate(4, optimizer="sgd").peak_bytes
    )


class _PadsToMultiple(nn.Module):
    """Pads the sequence to a multiple of ``multiple`` (as tensor-core friendly code does):
    memory is a step function of the length."""

    def __init__(self, multiple: int) -> None:
        super().__init__()
        self.multiple = multiple
        self.emb = nn.Embedding(50, 16)
        self.fc = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = -ids.shape[1] % self.multiple
        return self.fc(torch.nn.functional.pad(self.emb(ids), (0, 0, 0, pad)))


def test_padding_to_eight_is_fitted_in_the_padding() -> None:
    # Padding to a multiple of 8 is one of the kernels' paddings (PADDED_TERMS): the fit in
    # the length and that padding reproduces a profile at each length exactly.
    model = _PadsToMultiple(8)
    profile = profile_model(model, inputs=torch.zeros(2, 16, dtype=torch.long))
    for seq in (17, 23, 24, 40, 1001):
        est = profile.estimate(3, optimizer="sgd", seq_len=seq)
        at_length = profile_model(model, inputs=torch.zeros(2, seq, dtype=torch.long))
        assert est.peak_bytes == at_length.estimate(3, optimizer="sgd").peak_bytes, seq
    fitted = profile.timeline(Precision.FP32, Mode.TRAIN, 17).event_bytes
    assert any(e[2:] == (8,) for e in fitted.monomials)


def test_length_that_is_no_polynomial_is_profiled_at_the_length() -> None:
    # Padding to 48 is in no fit's terms: each length is profiled as it is asked.
    model = _PadsToMultiple(48)
    profile = profile_model(model, inputs=torch.zeros(2, 16, dtype=torch.long))
    for seq in (17, 23, 48, 49):
        est = profile.estimate(3, optimizer="sgd", seq_len=seq)
        at_length = profile_model(model, inputs=torch.zeros(2, seq, dtype=torch.long))
        assert est.peak_bytes == at_length.estimate(3, optimizer="sgd").peak_bytes, seq
    assert profile.timeline(Precision.FP32, Mode.TRAIN, 17).seq_degree == 0  # per length


def test_memory_efficient_attention_padding_is_fitted() -> None:
    # device="cuda" in fp32 emulates the memory-efficient SDPA kernel, whose logsumexp is
    # (B, H, ceil(S / 32) * 32) fp32: no polynomial in S alone, one in S and its padding.
    # The fit reproduces a profile made at each length, to the byte.
    model = zoo.causal_decoder(vocab_size=64, d_model=32, n_head=2, n_layer=1, max_len=128)
    profile = profile_model(model, inputs=torch.zeros(2, 20, dtype=torch.long))
    for seq in (1, 31, 32, 33, 100, 128):
        for mode in ("train", "inference"):
            est = profile.estimate(3, mode=mode, seq_len=seq)
            other = profile_model(model, inputs=torch.zeros(2, seq, dtype=torch.long))
            assert est.peak_bytes == other.estimate(3, mode=mode).peak_bytes, (seq, mode)
            assert est.flops == other.estimate(3, mode=mode).flops, (seq, mode)
    fitted = profile.timeline(Precision.FP32, Mode.TRAIN, 33).event_bytes
    assert any(e[2:] == (32,) for e in fitted.monomials)


def test_batch_one_checks_the_fit_where_it_is_the_same_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # device="cuda" (no measured workspaces): batch 1 is run anyway, and where it is the
    # line's step at 1 to the byte it is the check too: three runs per mode (2, 3, 1).
    # Where it is not (here a model that takes another path at batch 1), batch 5 checks
    # the line and batch 1 is kept as profiled: four runs, exact at both.
    from vram_widget._profiling.step_profiler import Profiler

    batches: list[int] = []
    original = Profiler.run

    def counting(self: Profiler, precision: Precision, batch_size: int, *args: Any) -> Any:
        batches.append(batch_size)
        return original(self, precision, batch_size, *args)

    monkeypatch.setattr(Profiler, "run", counting)
    profile_model(zoo.mlp(hidden=(16,)), input_size=(784,), precisions=("fp32",))
    assert batches == [2, 3, 1, 2, 3, 1]  # training, then inference

    class OtherPathAtOne(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            return y * 2 if x.size(0) == 1 else y  # one more tensor at batch 1

    batches.clear()
    profile = profile_model(OtherPathAtOne(), input_size=(8,), precisions=("fp32",))
    assert batches[:4] == [2, 3, 1, 5]
    for batch in (1, 2, 5, 9):
        est = profile.estimate(batch, optimizer="sgd")
        assert est.batch_size == batch and est.exact


def test_max_batch_size_on_the_device_basis() -> None:
    # basis="device": the largest batch whose step the caching allocator, replayed under the
    # capacity less the CUDA context, runs without an out-of-memory error; one more does not.
    profile = profile_model(zoo.resnet18(), input_size=(3, 64, 64))
    capacity = 4 * 2**30
    b = profile.max_batch_size(capacity, "fp32", "adamw", basis="device")
    assert profile.estimate(b, "fp32", "adamw").fits_device(capacity) is True
    assert profile.estimate(b + 1, "fp32", "adamw").fits_device(capacity) is False
    # the CPU has no caching allocator: both bases are the allocated one
    cpu = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu")
    assert cpu.max_batch_size(2**30, basis="device") == cpu.max_batch_size(2**30)
    with pytest.raises(ValueError, match=r"basis.*allocated.*device"):
        profile.max_batch_size(capacity, basis="reserved")
