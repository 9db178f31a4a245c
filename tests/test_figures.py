"""The waterfall / FLOPs figure: numbers equal the estimate's, updates happen in place."""

from __future__ import annotations

import itertools

import numpy as np
import plotly.graph_objects as go
import pytest
import torch
from torch import nn

from vram_widget import Category, profile_model, zoo
from vram_widget._display.figure_stages import STAGE_TRACE_NAMES
from vram_widget._display.figures import (
    CLIP_RATIO,
    FLOOR_CATEGORIES,
    MAX_NAMED_GROUPS,
    TRACE_NAMES,
    build_figure,
    group_rows,
    update_figure,
    waterfall_data,
)
from vram_widget._estimating.options import PHASES
from vram_widget._estimating.profile import ModelProfile

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


def test_bars_named_on_the_axis_when_few_groups(mlp_profile: ModelProfile) -> None:
    est = mlp_profile.estimate(32, optimizer="sgd")
    data = waterfall_data(est, 1)
    fig = build_figure(est, depth=1, capacity_bytes=GIB)
    axis = fig.layout.xaxis2
    n_floor = len(FLOOR_CATEGORIES)
    assert list(axis.tickvals[:n_floor]) == list(range(n_floor))
    assert list(axis.ticktext[:n_floor]) == [c.value for c in FLOOR_CATEGORIES]
    # Each other tick names the group of the bar it sits under, where that group's run in
    # that phase starts (so a name appears where its forward and its backward begin).
    seen = set()
    for x, text in zip(axis.tickvals[n_floor:], axis.ticktext[n_floor:], strict=True):
        run = int(x) - n_floor
        group, phase = int(data.run_group[run]), int(data.run_phase[run])
        assert text == (est.layers.name[group] or "(model)")
        earlier = (data.run_group[:run] == group) & (data.run_phase[:run] == phase)
        assert not earlier.any()
        seen.add((text, phase))
    names = {est.layers.name[g] or "(model)" for g in data.run_group}
    assert {t for t, _ in seen} == names  # few bars: nothing thinned out
    assert ("0", 0) in seen and ("0", 1) in seen  # first Linear: forward and backward
    assert axis.tickangle == -60
    # Depth 0 folds everything into the root: still named.
    update_figure(fig, est, depth=0, capacity_bytes=GIB)
    assert "(model)" in fig.layout.xaxis2.ticktext


def test_many_groups_mark_phases_only() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(60)])
    est = profile_model(model, input_size=(8,), device="cpu").estimate(16, optimizer="sgd")
    fig = build_figure(est, depth=0, capacity_bytes=GIB)
    assert len(np.unique(waterfall_data(est, 0).run_group)) <= MAX_NAMED_GROUPS
    assert "(model)" in fig.layout.xaxis2.ticktext
    # Depth 1: 60 Linear groups -> one tick per phase start, horizontal, names on hover only.
    update_figure(fig, est, depth=1, capacity_bytes=GIB)
    data = waterfall_data(est, 1)
    assert len(np.unique(data.run_group)) > MAX_NAMED_GROUPS
    axis = fig.layout.xaxis2
    assert axis.ticktext[0] == "resident"
    assert set(axis.ticktext[1:]) <= {"forward", "backward", "optimizer", "zero_grad"}
    assert len(axis.ticktext) <= 6
    assert axis.tickangle == 0
    forward = fig.data[TRACE_NAMES.index("forward")]
    assert any("<b>59</b> (Linear)" in t for t in forward.hovertext)
    # And back: a move that groups again names the bars again.
    update_figure(fig, est, depth=0, capacity_bytes=GIB)
    assert fig.layout.xaxis2.tickangle == -60


def test_long_names_keep_their_tail() -> None:
    from vram_widget._display.figures import _tick

    assert _tick("layer4.2.conv3") == "layer4.2.conv3"
    long = "transformer.encoder.layers.11.self_attn.out_proj"
    assert _tick(long).startswith("…") and _tick(long).endswith("self_attn.out_proj")
    assert len(_tick(long)) == 24


def test_axis_stops_above_the_step_when_capacity_is_far(mlp_profile: ModelProfile) -> None:
    est = mlp_profile.estimate(32)
    fig = build_figure(est, depth=1, capacity_bytes=80 * GIB, gpu_name="H100")
    note = fig.layout.annotations[0]
    assert est.peak_bytes * CLIP_RATIO < 80 * GIB
    assert fig.layout.yaxis.autorange is False
    assert fig.layout.yaxis.range[1] >= est.peak_bytes  # the peak stays on the chart
    assert fig.layout.yaxis.range[1] < 80 * GIB
    assert note.visible and "80 GiB (H100)" in note.text
    assert f"{est.peak_bytes / (80 * GIB):.1%}" in note.text
    # The capacity line itself is still drawn (hover, zoom out), just off the clipped axis.
    assert list(fig.data[TRACE_NAMES.index("capacity")].y) == [80 * GIB, 80 * GIB]
    # Near the capacity: the axis reaches the line again and the note goes.
    update_figure(fig, est, depth=1, capacity_bytes=est.peak_bytes * 2, gpu_name="small")
    assert fig.layout.yaxis.autorange is True
    assert fig.layout.yaxis.range is None
    assert not fig.layout.annotations[0].visible


def test_bars_have_a_fixed_width(mlp_profile: ModelProfile) -> None:
    """Sparse traces (FLOPs at a few runs) would otherwise get bars several runs wide."""
    fig = build_figure(mlp_profile.estimate(32), depth=1)
    # the waterfall's and the FLOPs panel's bars (the pipeline stages' panel has its own
    # x axis, "x3", with one bar a stage)
    bars = [t for t in fig.data if t.type == "bar" and t.xaxis != "x3"]
    assert len(bars) == 1 + len(PHASES) + 2  # the floor, one trace per phase, FLOPs
    assert all(t.width == 0.8 for t in bars)
    assert [t.name for t in fig.data if t.type == "bar" and t.xaxis == "x3"] == ["stage peaks"]


def test_crowded_labels_are_thinned() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(38)])
    est = profile_model(model, input_size=(8,), device="cpu").estimate(4, optimizer="sgd")
    data = waterfall_data(est, 1)
    n_bars = len(FLOOR_CATEGORIES) + len(data.run_x)
    assert len(np.unique(data.run_group)) <= MAX_NAMED_GROUPS
    fig = build_figure(est, depth=1)
    ticks = np.asarray(fig.layout.xaxis2.tickvals)
    assert fig.layout.xaxis2.tickangle == -60
    assert n_bars > 70  # more bars than labels fit
    assert np.diff(ticks).min() >= n_bars / 70
    assert 20 <= len(ticks) <= 70


def test_hover_names_type_shape_params_bytes_flops(mlp_profile: ModelProfile) -> None:
    est = mlp_profile.estimate(32, optimizer="adam")
    fig = build_figure(est, depth=1)
    layers = est.layers
    i = layers.name.index("0")  # Linear 784 -> 512
    template = fig.data[TRACE_NAMES.index("forward")].hovertemplate
    for field in ("params", "saved activations", "live after", "FLOPs"):
        assert field in template
    for phase, flops in (
        ("forward", layers.flops_forward[i]),
        ("backward", layers.flops_backward[i]),
    ):
        trace = fig.data[TRACE_NAMES.index(phase)]
        hits = [k for k, t in enumerate(trace.hovertext) if t.startswith("<b>0</b> (Linear)")]
        assert hits, phase
        k = hits[0]  # the group's first run in this phase carries its FLOPs
        assert "output shape: (32, 512)" in trace.hovertext[k]
        assert f"phase: {phase}" in trace.hovertext[k]
        params, acts, change, live_after, _max, run_flops = trace.customdata[k]
        assert params == layers.param_count[i] == 784 * 512 + 512
        assert acts == layers.activation_bytes[i]
        assert run_flops == flops > 0
        assert live_after == trace.base[k] + trace.y[k]
        assert change == trace.y[k]


def test_a_generation_draws_its_kv_cache() -> None:
    # the KV cache is its own line over the waterfall: live after each run of the prefill and
    # the decode steps, ending at the cache after the last step; empty for other modes
    pytest.importorskip("transformers")
    from tests.models import hf_gpt2

    ids = torch.zeros(2, 16, dtype=torch.long)
    profile = profile_model(hf_gpt2(), inputs={"input_ids": ids}, device="cpu")
    est = profile.estimate(2, mode="generate", new_tokens=30)
    data = waterfall_data(est, 1)
    kv = build_figure(est).data[TRACE_NAMES.index("KV cache")]
    assert list(kv.x) == data.run_x.tolist()
    assert kv.y[-1] == est.kv_cache_bytes == 2 * (16 + 29) * 1024  # 2 layers x k, v x 64 x 4 B
    assert all(b >= a for a, b in itertools.pairwise(kv.y[:-1]))  # it grows, step by step
    assert list(build_figure(profile.estimate(2)).data[TRACE_NAMES.index("KV cache")].x) == []


def test_stage_panel_shows_each_stage_and_hides_without_stages(mlp_profile: ModelProfile) -> None:
    import dataclasses

    from vram_widget._display.figure_stages import WATERFALL_DOMAIN
    from vram_widget._display.plotly_widget import FigureWidget

    plain = mlp_profile.estimate(2)
    # three stages' peaks, hand-set: the worst is stage 1 (300 B)
    staged = dataclasses.replace(
        plain, pp=3, pp_schedule="gpipe", microbatches=3, stage_peak_bytes=(100, 300, 200)
    )
    fig = FigureWidget(build_figure(plain, capacity_bytes=1_000))
    bars, capacity, worst = (fig.data[TRACE_NAMES.index(n)] for n in STAGE_TRACE_NAMES)
    assert not bars.visible and list(bars.y) == [] and not fig.layout.xaxis3.visible
    update_figure(fig, staged, capacity_bytes=1_000)
    assert len(fig.data) == len(TRACE_NAMES)  # the same traces, written in place
    assert list(bars.y) == [100, 300, 200] and list(bars.x) == [0, 1, 2]
    assert list(bars.marker.color) == ["#4C78A8", "#D62728", "#4C78A8"]  # the worst red
    assert (list(worst.x), list(worst.y)) == ([1], [300])
    assert list(capacity.y) == [1_000, 1_000]
    # 1,000 B is 3.3 x the worst 300 B, above the clip ratio 3: the axis stops at
    # 1.25 x 300 = 375 B and the hover gives each stage's share, 300 / 1,000 = 30.000 %
    assert list(fig.layout.yaxis3.range) == [0, 375]
    assert "stage 1: peak 300 B (30.000% of the card)" in bars.hovertext
    assert fig.layout.xaxis.domain == WATERFALL_DOMAIN and fig.layout.xaxis3.visible
    assert "on stage 1 of 3 (worst stage)" in fig.layout.title.text
    update_figure(fig, plain, capacity_bytes=1_000)
    assert not bars.visible and list(bars.y) == [] and not worst.visible
    assert fig.layout.xaxis.domain == (0.0, 1.0) and not fig.layout.xaxis3.visible
