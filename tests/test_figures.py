"""The waterfall / FLOPs figure: numbers equal the estimate's, updates happen in place."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import pytest
from torch import nn

from vram_widget import Category, profile_model, zoo
from vram_widget._figures import (
    FLOOR_CATEGORIES,
    TRACE_NAMES,
    build_figure,
    group_rows,
    update_figure,
    waterfall_data,
)
from vram_widget._profile import ModelProfile

GIB = 2**30


@pytest.fixture(scope="module")
def mlp_profile() -> ModelProfile:
    return profile_model(zoo.mlp(), input_size=(784,), device="cpu")


@pytest.fixture(scope="module")
def wide_profile() -> ModelProfile:
    """1,001 modules: the root, one Linear and 999 Identity layers."""
    model = nn.Sequential(nn.Linear(8, 8), *[nn.Identity() for _ in range(999)])
    return profile_model(model, input_size=(8,), device="cpu")


def test_group_rows() -> None:
    depths = np.array([0, 1, 2, 3, 2, 1, 2, 0, 0])
    assert group_rows(depths, 0).tolist() == [0, 0, 0, 0, 0, 0, 0, 7, 8]
    assert group_rows(depths, 1).tolist() == [0, 1, 1, 1, 1, 5, 5, 7, 8]
    assert group_rows(depths, 2).tolist() == [0, 1, 2, 2, 4, 5, 6, 7, 8]
    assert group_rows(depths, 9).tolist() == list(range(9))
    with pytest.raises(ValueError):
        group_rows(depths, -1)


@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_waterfall_matches_estimate(mlp_profile: ModelProfile, mode: str, depth: int) -> None:
    est = mlp_profile.estimate(48, optimizer="adam", mode=mode)
    data = waterfall_data(est, depth)
    live = est.live_bytes
    assert data.floor_bytes[FLOOR_CATEGORIES.index(Category.PARAMETER)] == est.parameter_bytes
    # Runs are contiguous: each starts where the previous ended, the last ends where the
    # step ends, and the most live in any run is the estimate's peak.
    assert data.run_start_bytes[0] == data.resident_bytes
    assert np.array_equal(data.run_start_bytes[1:], data.run_end_bytes[:-1])
    assert data.run_end_bytes[-1] == live[-1]
    assert data.run_max_bytes.max() == est.peak_bytes == data.peak_bytes
    # Every FLOP of the step is drawn exactly once.
    assert data.run_flops.sum() == est.flops
    assert np.all(np.diff(data.run_x) == 1)


def test_resident_floor_equals_live_before_first_event(mlp_profile: ModelProfile) -> None:
    est = mlp_profile.estimate(8)
    data = waterfall_data(est, 1)
    # Re-derive the resident bytes from the estimate's own breakdown at batch 8.
    expected = est.parameter_bytes + est.buffer_bytes + est.optimizer_state_bytes + est.input_bytes
    assert data.resident_bytes == expected


def test_figure_numbers(mlp_profile: ModelProfile) -> None:
    est = mlp_profile.estimate(32, optimizer="sgd")
    fig = build_figure(est, depth=1, capacity_bytes=GIB, gpu_name="test")
    assert [t.name for t in fig.data] == list(TRACE_NAMES)
    peak = fig.data[TRACE_NAMES.index("peak")]
    assert peak.y[0] == est.peak_bytes
    assert est.peak_phase.value in peak.text[0]
    capacity = fig.data[TRACE_NAMES.index("capacity")]
    assert list(capacity.y) == [GIB, GIB]
    reserve = fig.data[TRACE_NAMES.index("reserve (extras)")]
    assert min(reserve.y) == GIB - est.extras.total_bytes
    fwd = fig.data[TRACE_NAMES.index("forward FLOPs")]
    bwd = fig.data[TRACE_NAMES.index("backward FLOPs")]
    assert sum(fwd.y) == est.flops_forward
    assert sum(bwd.y) == est.flops_backward
    resident = fig.data[0]
    assert list(resident.y) == [
        est.parameter_bytes,
        est.buffer_bytes,
        est.optimizer_state_bytes,
        est.input_bytes,
    ]
    assert "peak" in fig.layout.title.text


def test_update_in_place(mlp_profile: ModelProfile) -> None:
    est = mlp_profile.estimate(32)
    fw = go.FigureWidget(build_figure(est, depth=1, capacity_bytes=GIB))
    traces = list(fw.data)
    for batch, depth, mode in ((1, 0, "train"), (4096, 2, "inference"), (7, 1, "train")):
        new = mlp_profile.estimate(batch, mode=mode)
        update_figure(fw, new, depth=depth, capacity_bytes=2 * GIB)
        assert all(a is b for a, b in zip(fw.data, traces, strict=True))
        assert [t.name for t in fw.data] == list(TRACE_NAMES)
        assert fw.data[TRACE_NAMES.index("peak")].y[0] == new.peak_bytes
        assert list(fw.data[TRACE_NAMES.index("capacity")].y) == [2 * GIB, 2 * GIB]
    # A plain go.Figure can be updated too.
    fig = build_figure(est)
    update_figure(fig, mlp_profile.estimate(2))
    assert fig.data[TRACE_NAMES.index("peak")].y[0] == mlp_profile.estimate(2).peak_bytes


def test_update_refuses_foreign_figure(mlp_profile: ModelProfile) -> None:
    with pytest.raises(ValueError, match="build_figure"):
        update_figure(go.Figure(), mlp_profile.estimate(2))


def test_thousand_modules_grouped(wide_profile: ModelProfile) -> None:
    est = wide_profile.estimate(16, optimizer="sgd")
    assert len(est.layers.name) == 1001 + 2
    shallow = waterfall_data(est, 0)
    deep = waterfall_data(est, 1)
    # Depth 0 folds every module into the root: a handful of runs, not one per layer.
    assert len(shallow.run_x) <= 10
    assert len(deep.run_x) >= len(shallow.run_x)
    for data in (shallow, deep):
        assert data.run_max_bytes.max() == est.peak_bytes
        assert data.run_flops.sum() == est.flops
    fig = build_figure(est, depth=1, capacity_bytes=GIB)
    update_figure(fig, est, depth=0, capacity_bytes=GIB)
    assert len(fig.data) == len(TRACE_NAMES)
