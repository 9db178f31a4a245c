"""CPU kernel workspaces: which ops are probed, and what a probe measures."""

from __future__ import annotations

import torch

from vram_widget import profile_model
from vram_widget._profiling.measure import measure
from vram_widget._profiling.probe import PROBE_LIMIT_BYTES, UNKNOWN, KernelProbe, wants_probe

aten = torch.ops.aten


def test_registry_selects_ops_whose_cpu_kernels_allocate() -> None:
    x32 = torch.zeros(4, 4)
    x16 = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert wants_probe(aten.convolution.default, (x32,))  # oneDNN reorders, every dtype
    assert wants_probe(aten.mm.default, (x16, x16))  # bf16 packing
    assert not wants_probe(aten.mm.default, (x32, x32))  # fp32 mm allocates nothing inside
    assert not wants_probe(aten.add.Tensor, (x32, x32))


def test_probe_measures_a_convolution_workspace() -> None:
    # A 3x3 conv, 64 -> 64 channels, on (2, 64, 32, 32) fp32 input: oneDNN copies input and
    # weight into blocked layouts while it runs, so the workspace is at least the weight
    # (64*64*9*4 = 147,456 bytes); the measured figure is stable on one machine, not a constant.
    probe = KernelProbe()
    x = torch.zeros(2, 64, 32, 32)
    w = torch.zeros(64, 64, 3, 3)
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    sig = probe.request(aten.convolution.default, args, {})
    assert probe.workspace_bytes(sig) >= 64 * 64 * 9 * 4
    # Cached: the same signature is not run again.
    assert probe.request(aten.convolution.default, args, {}) == sig


def test_probe_skips_calls_too_large_to_run() -> None:
    probe = KernelProbe()
    side = int((PROBE_LIMIT_BYTES / 4) ** 0.5) + 8  # one fp32 square matrix beyond the limit
    big = torch.empty(side, side, dtype=torch.bfloat16, device="meta")
    sig = probe.request(aten.mm.default, (big, big), {})
    # 2 * side**2 * 2 bytes of inputs > the limit only if side is large enough: make sure.
    assert 2 * side * side * 2 > PROBE_LIMIT_BYTES
    assert probe.workspace_bytes(sig) == UNKNOWN


def test_cnn_inference_on_cpu_matches_measure_with_workspaces() -> None:
    # CNN inference is where kernel workspaces set the peak (fake kernels alone miss them).
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, padding=1),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    )
    profile = profile_model(model, input_size=(3, 32, 32), device="cpu")
    for batch in (1, 4, 8):
        est = profile.estimate(batch, mode="inference")
        real = measure(model, torch.zeros(batch, 3, 32, 32), mode="inference")
        assert est.peak_bytes == real.peak_bytes, (batch, est.peak_bytes, real.peak_bytes)


def test_batchnorm_on_a_1x1_map_skips_the_batch_1_grid_point() -> None:
    # BatchNorm in training rejects batch 1 when each channel has one value (a 1x1 map): the
    # workspace grid leaves batch 1 out instead of failing the profile.
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2),  # 4x4 -> 1x1
        torch.nn.BatchNorm2d(8),
        torch.nn.Flatten(),
    )
    profile = profile_model(model, input_size=(3, 4, 4), device="cpu")
    for batch in (2, 6):
        assert (
            profile.estimate(batch).peak_bytes
            == measure(model, torch.zeros(batch, 3, 4, 4)).peak_bytes
        )


def test_grouped_mm_probe_splits_the_groups_evenly() -> None:
    # offs are cumulative ends; zeros (what a probe's zero-filled tensors hold) would make
    # every group empty. Four groups over 40: 10, 20, 30, 40, along the shared dimension.
    from vram_widget._profiling.probe import _grouped_mm_args

    bf16 = torch.bfloat16
    cases = {
        "2D x 2D: the contraction (40)": (torch.zeros(64, 40, dtype=bf16), torch.zeros(40, 32)),
        "2D x 3D: mat_a's rows (40)": (torch.zeros(40, 64, dtype=bf16), torch.zeros(4, 64, 32)),
        "3D x 2D: mat_b's columns (40)": (torch.zeros(4, 8, 64, dtype=bf16), torch.zeros(64, 40)),
    }
    for label, (a, b) in cases.items():
        offs = torch.zeros(4, dtype=torch.int32)
        _grouped_mm_args((a, b, offs), {})
        assert offs.tolist() == [10, 20, 30, 40], label


class _Experts(torch.nn.Module):
    """Four experts of 64 -> 128 run by one grouped mm, each on a quarter of the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 64, 128) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.flatten(0, 1)
        offs = torch.arange(1, 5, dtype=torch.int32, device=x.device) * (rows.shape[0] // 4)
        return torch._grouped_mm(rows, self.weight, offs)


def test_bf16_grouped_mm_training_matches_measure() -> None:
    # The CPU grouped mm runs an mm per group, each with bf16 packing scratch; without
    # probing it the estimate was 25,728 B under the measured peak at every batch size.
    torch.manual_seed(0)
    model = _Experts()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the scratch depends on the thread count: one, as measured
    try:
        profile = profile_model(model, inputs=torch.zeros(2, 8, 64), device="cpu")
        for batch in (2, 4, 6):
            est = profile.estimate(batch, precision="bf16", optimizer="sgd")
            real = measure(model, torch.zeros(batch, 8, 64), precision="bf16", optimizer="sgd")
            assert est.peak_bytes == real.peak_bytes, (batch, est.peak_bytes, real.peak_bytes)
    finally:
        torch.set_num_threads(threads)
