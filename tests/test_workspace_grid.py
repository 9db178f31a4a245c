"""CPU kernel workspaces between the grid's batch sizes: derived calls, probed, not a line."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from vram_widget import profile_model
from vram_widget._estimating.table import interpolate_columns
from vram_widget._profiling.measure import measure
from vram_widget._profiling.probe import TensorSpec
from vram_widget._profiling.workspace_grid import derive_call, refined_workspaces

aten = torch.ops.aten
GRID = (1, 2, 3, 5, 8, 32)  # WORKSPACE_BATCH_SIZES with the fit's 2, 3 and 5


def _weight_grad_mm(rows: int) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The weight-gradient mm of a Linear(32, 32) on ``rows`` rows: (32 x rows) @ (rows x 32),
    the first operand a transposed view."""
    grad_out = TensorSpec(torch.empty(rows, 32, dtype=torch.bfloat16).t())
    inputs = TensorSpec(torch.empty(rows, 32, dtype=torch.bfloat16))
    return (aten.mm.default, (grad_out, inputs), {})


def test_derive_call_continues_shapes_and_strides_on_the_line_through_the_runs() -> None:
    # 8 rows per sample: at batch 4, 32 rows; the transposed operand (32, rows) has strides
    # (1, 32) at every batch, the other (rows, 32) strides (32, 1)
    calls = {b: _weight_grad_mm(8 * b) for b in (1, 2, 3, 5, 8)}
    func, (grad_out, inputs), kwargs = derive_call(calls, 4)  # type: ignore[misc]
    assert func is aten.mm.default and kwargs == {}
    assert (grad_out.shape, grad_out.stride) == ((32, 32), (1, 32))
    assert (inputs.shape, inputs.stride) == ((32, 32), (32, 1))
    assert inputs.numel_bytes == 32 * 32 * 2  # bf16
    # the line through 2 and 3 must hold at every other size of 2 and up: 41 rows at 5 is
    # off it (40 on the line), so no call is derived
    assert derive_call({**calls, 5: _weight_grad_mm(41)}, 4) is None
    # batch 1 is not checked (size-1 dimensions take other paths)
    assert derive_call({**calls, 1: _weight_grad_mm(9)}, 4) is not None


class _StepProbe:
    """A probe whose mm scratch steps with the rows, as oneDNN's bf16 weight-gradient mm on
    one thread does (11,392 B for 8 to 32 rows, 17,536 B for 40 and 64, measured with torch
    2.13): here 11,392 B up to 32 rows, 17,536 B up to 48, 20,000 B above."""

    def __init__(self) -> None:
        self.asked_rows: list[int] = []

    @staticmethod
    def scratch(rows: int) -> int:
        return 11_392 if rows <= 32 else 17_536 if rows <= 48 else 20_000

    def call_of(self, sig: tuple[Any, ...]) -> Any:
        return _weight_grad_mm(sig[1])

    def request_spec(self, call: Any, like: tuple[Any, ...]) -> tuple[Any, ...]:
        rows = call[1][1].shape[0]
        self.asked_rows.append(rows)
        return ("rows", rows)

    def workspace_bytes(self, sig: tuple[Any, ...]) -> int:
        return self.scratch(sig[1])


@dataclasses.dataclass(frozen=True)
class _Grid:
    workspace_grid: np.ndarray
    workspace_bytes: np.ndarray


def test_a_step_between_grid_points_is_found_by_bisection() -> None:
    probe = _StepProbe()
    traces = [SimpleNamespace(batch_size=b, workspace_signatures=(("rows", 8 * b),)) for b in GRID]
    grid = _Grid(
        np.asarray(GRID, np.int64),
        np.asarray([[probe.scratch(8 * b) for b in GRID]], np.int64),
    )
    # Before: at batch 4 (32 rows) the line through 3 (11,392) and 5 (17,536) says
    # 11,392 + 6,144 * 1 // 2 = 14,464, 3,072 B over the kernel's 11,392.
    before = interpolate_columns(grid.workspace_grid, grid.workspace_bytes, 4)
    assert int(before[0]) == 14_464
    refined = refined_workspaces(grid, traces, probe)  # type: ignore[arg-type]
    # Round 1 probes the midpoints of 3-5 and 5-8: 4 (32 rows: 11,392, off the line) and
    # 6 (48 rows: 17,536; the line through 5 and 8 says 17,536 + 2,464 // 3 = 18,357, off
    # it). Round 2: 3-4 and 4-5 have no midpoint, 5-6 neither, 6-8 has 7 (56 rows: 20,000;
    # the line 17,536 + 2,464 // 2 = 18,768, off it). 8-32 is the last segment: not refined.
    assert probe.asked_rows == [32, 48, 56]
    assert refined.workspace_grid.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 32]
    for batch in range(1, 9):
        at = interpolate_columns(refined.workspace_grid, refined.workspace_bytes, batch)
        assert int(at[0]) == probe.scratch(8 * batch), batch


def test_a_workspace_on_the_line_adds_no_grid_point() -> None:
    # 1,024 B per sample (the bf16 addmm forward's scratch of a Linear(32, 32): 6,144 B at
    # 8 rows, 7,168 at 16, 8,192 at 24, 10,240 at 40): the midpoints are on the line
    class Linear(_StepProbe):
        @staticmethod
        def scratch(rows: int) -> int:
            return 5_120 + 128 * rows

    probe = Linear()
    traces = [SimpleNamespace(batch_size=b, workspace_signatures=(("rows", 8 * b),)) for b in GRID]
    values = np.asarray([[probe.scratch(8 * b) for b in GRID]], np.int64)
    grid = _Grid(np.asarray(GRID, np.int64), values)
    assert refined_workspaces(grid, traces, probe) is grid  # type: ignore[arg-type]
    assert probe.asked_rows == [32, 48]


def test_bf16_linear_training_matches_measure_between_grid_points() -> None:
    # A Linear(32, 32) on 8 tokens in bf16: at batch 4 its weight-gradient mm runs on 32
    # rows, between the grid's 24 (batch 3) and 40 (batch 5), where oneDNN's scratch steps;
    # the line through them was 3,072 B over the measured peak.
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the scratch depends on the thread count: one, as measured
    try:
        profile = profile_model(model, inputs=torch.zeros(2, 8, 32), device="cpu")
        for batch in (4, 6, 7):
            est = profile.estimate(batch, precision="bf16", optimizer="adamw")
            real = measure(model, torch.zeros(batch, 8, 32), precision="bf16", optimizer="adamw")
            assert est.peak_bytes == real.peak_bytes, (batch, est.peak_bytes, real.peak_bytes)
    finally:
        torch.set_num_threads(threads)
