"""The memory waterfall and FLOPs figure of one :class:`MemoryEstimate` (plotly only).

Pure functions: :func:`waterfall_data` turns an estimate into numpy arrays (one entry per bar),
:func:`build_figure` makes the two-panel ``go.Figure`` once, and :func:`update_figure` writes
new data into the same traces (inside ``fig.batch_update()`` on a ``FigureWidget``), so a
widget never rebuilds its figure. The traces are always the same, in the order of
:data:`TRACE_NAMES`; only their data changes.

Layout of the top panel, left to right (x is a bar index):

* the resident floor, one bar per category (parameters, buffers, optimizer state, input),
  each starting where the previous one ends;
* the step's events, grouped into consecutive runs with the same module (at the chosen
  grouping ``depth``) and phase; each run is a floating bar from the live bytes before it to
  the live bytes after it (coloured by phase), with a tick at the most that was live within it;
* the peak as a marker, the device capacity as a line, and the accelerator extras (CUDA
  context, cuBLAS workspace, allocator rounding) as a band below the capacity: the estimate
  fits when the peak stays under the band.

The bottom panel shares the x axis: each module group's forward FLOPs at its first forward run
and its backward FLOPs at its first backward run.

With pipeline parallelism (``pp > 1``) a third panel, right of the top one, holds one bar per
stage's peak against the capacity, the worst stage marked (:mod:`.figure_stages`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .._estimating.estimator import LayerTable, MemoryEstimate
from .._estimating.options import CATEGORY_CODE, PHASE_CODE, PHASES, Category, Mode, Phase
from .._estimating.tradeoff import Frontier
from .figure_stages import (
    STAGE_TRACE_NAMES,
    add_stage_traces,
    ranks_title,
    stage_layout_updates,
    stage_trace_updates,
)

__all__ = [
    "CLIP_RATIO",
    "FLOOR_CATEGORIES",
    "FRONTIER_TRACE_NAMES",
    "MAX_NAMED_GROUPS",
    "TRACE_NAMES",
    "WaterfallData",
    "build_figure",
    "build_frontier_figure",
    "floor_categories",
    "group_rows",
    "output_shape_text",
    "update_figure",
    "update_frontier_figure",
    "waterfall_data",
]

FLOOR_CATEGORIES: tuple[Category, ...] = (
    Category.PARAMETER,
    Category.BUFFER,
    Category.OPTIMIZER_STATE,
    Category.INPUT,
)
"""What is resident before the step starts, in the order the floor is stacked; a
data-parallel rank's communication buffers (``Category.COMMUNICATION``) follow where it has
any (:func:`floor_categories`)."""


def floor_categories(est: MemoryEstimate) -> tuple[Category, ...]:
    """The floor's bars for ``est``: :data:`FLOOR_CATEGORIES`, and the communication buffers
    of a data-parallel rank where there are some."""
    if est.communication_bytes:
        return (*FLOOR_CATEGORIES, Category.COMMUNICATION)
    return FLOOR_CATEGORIES


_PHASE_COLOURS: dict[Phase, str] = {
    Phase.FORWARD: "#4C78A8",
    Phase.BACKWARD: "#F58518",
    Phase.OPTIMIZER: "#54A24B",
    Phase.ZERO_GRAD: "#B279A2",
    Phase.INFERENCE: "#4C78A8",
    Phase.PREFILL: "#4C78A8",
    Phase.DECODE: "#72B7B2",
}
_FLOOR_COLOUR = "#9D9D9D"
_KV = CATEGORY_CODE[Category.KV_CACHE]
# the phases that run the model forward (whose runs carry the forward FLOPs)
_FORWARD_PHASES = np.asarray(
    [PHASE_CODE[p] for p in (Phase.FORWARD, Phase.INFERENCE, Phase.PREFILL, Phase.DECODE)]
)
_BAR_WIDTH = 0.8  # x units; fixed, or plotly widens a trace's bars to its sparsest spacing

TRACE_NAMES: tuple[str, ...] = (
    "resident",
    *(f"{p.value}" for p in PHASES),
    "max within run",
    "reserve (extras)",
    "capacity",
    "peak",
    "forward FLOPs",
    "backward FLOPs",
    "KV cache",
    *STAGE_TRACE_NAMES,
)
"""The figure's traces, in order (the widget relies on this order never changing); the
pipeline stages' panel last (:mod:`.figure_stages`)."""

MAX_NAMED_GROUPS = 40
"""Up to this many module groups on the x axis, every bar is labelled with its group's name
(angled); beyond it the axis marks only where each phase starts, and names are on hover."""

_MAX_TICKS = 70  # angled labels that fit a notebook-wide axis without overlapping
_TICK_CHARS = 24  # longer names keep their tail ("…blocks.11.mlp"): the most specific part
_NAMED_HEIGHT, _NAMED_MARGIN_B, _NAMED_LEGEND_Y = 720, 170, -0.32
_PLAIN_HEIGHT, _PLAIN_MARGIN_B, _PLAIN_LEGEND_Y = 620, 40, -0.08

CLIP_RATIO = 3.0
"""When the capacity exceeds this many times the step's peak, the memory axis stops just
above the peak (the capacity line is off the chart and a note gives its size and the share
the peak uses); otherwise the axis reaches the capacity line."""

_I_FLOOR = 0
_I_PHASE0 = 1
_I_MAX = _I_PHASE0 + len(PHASES)
_I_RESERVE = _I_MAX + 1
_I_CAPACITY = _I_RESERVE + 1
_I_PEAK = _I_CAPACITY + 1
_I_FLOPS_F = _I_PEAK + 1
_I_FLOPS_B = _I_FLOPS_F + 1

_BAR_HOVER = (
    "%{hovertext}<br>"
    "params: %{customdata[0]:,}<br>"
    "saved activations: %{customdata[1]:,} B<br>"
    "change: %{customdata[2]:+,} B<br>"
    "live after: %{customdata[3]:,} B<br>"
    "max within: %{customdata[4]:,} B<br>"
    "FLOPs (this phase): %{customdata[5]:,}"
    "<extra></extra>"
)


def group_rows(depths: np.ndarray, depth: int) -> np.ndarray:
    """For each row, the row it is grouped under at grouping ``depth``.

    Rows are in ``named_modules()`` order (pre-order), so a row deeper than ``depth`` belongs to
    the last row before it whose depth is at most ``depth``: its ancestor at that depth. Rows at
    or above ``depth`` (and the loss and optimizer pseudo-rows, depth 0) are their own group.

    Examples
    --------
    >>> group_rows(np.array([0, 1, 2, 2, 1, 2, 0, 0]), 1).tolist()
    [0, 1, 1, 1, 4, 4, 6, 7]
    """
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    d = np.asarray(depths)
    idx = np.where(d <= depth, np.arange(len(d)), -1)
    out = np.maximum.accumulate(idx) if len(idx) else idx
    # A deeper row before any shallow row cannot occur (row 0 is the root, depth 0).
    return np.where(out < 0, np.arange(len(d)), out)


def output_shape_text(layers: LayerTable, rows: Sequence[int] | np.ndarray) -> list[str]:
    """The output shapes of ``rows`` as text (``""`` where a row returns no tensor).

    Reads the padded shape arrays for these rows only: ``LayerTable.output_shape`` builds every
    row's tuple on each access, which costs milliseconds on a 1,000-module model.

    Examples
    --------
    >>> from vram_widget import profile_model, zoo
    >>> layers = profile_model(zoo.mlp(), input_size=(784,), device="cpu").estimate(8).layers
    >>> output_shape_text(layers, [1, len(layers.name) - 1])
    ['(8, 512)', '']
    """
    idx = np.asarray(rows, dtype=np.int64)
    dims = layers.output_dims[idx]
    ndim = layers.output_ndim[idx]
    return [
        "" if n < 0 else str(tuple(int(d) for d in row[:n]))
        for row, n in zip(dims.tolist(), ndim.tolist(), strict=True)
    ]


@dataclass(frozen=True, eq=False)
class WaterfallData:
    """The figure's numbers for one estimate and one grouping depth (numpy arrays).

    ``run_*`` arrays have one entry per run of consecutive events in the same group and phase;
    the runs sit at x = ``len(floor_categories) + arange(n_runs)``.
    """

    floor_categories: tuple[Category, ...]  # the floor's bars (floor_categories(est))
    floor_bytes: np.ndarray  # per floor_categories entry
    run_x: np.ndarray
    run_group: np.ndarray  # row index of the group
    run_phase: np.ndarray  # phase code
    run_start_bytes: np.ndarray  # live before the run
    run_end_bytes: np.ndarray  # live after the run
    run_max_bytes: np.ndarray  # most live within the run
    run_flops: np.ndarray  # group's FLOPs in the run's phase, at its first run in that phase
    run_kv_cache_bytes: np.ndarray  # a generation's KV cache live after the run (else 0)
    group_param_count: np.ndarray  # per row: parameters of the group the row heads (else 0)
    group_activation_bytes: np.ndarray  # per row, likewise
    peak_x: float
    peak_bytes: int

    @property
    def resident_bytes(self) -> int:
        return int(self.floor_bytes.sum())


def _floor(est: MemoryEstimate) -> np.ndarray:
    optimizer = est.optimizer_state_bytes if est.mode is Mode.TRAIN else 0
    values = [est.parameter_bytes, est.buffer_bytes, optimizer, est.input_bytes]
    if est.communication_bytes:
        values.append(est.communication_bytes)
    return np.array(
        values,
        dtype=np.int64,
    )


def waterfall_data(est: MemoryEstimate, depth: int) -> WaterfallData:
    """Group the estimate's event stream into runs at ``depth`` and measure each run.

    No Python loop over events, rows or runs: everything is numpy.
    """
    floor = _floor(est)
    resident = int(floor.sum())
    layers = est.layers
    groups = group_rows(layers.depth, depth)
    n_rows = len(groups)
    live = np.asarray(est.live_bytes, dtype=np.int64)
    n_floor = len(floor)
    if len(live):
        g = groups[np.asarray(est.event_module, dtype=np.int64)]
        ph = np.asarray(est.event_phase, dtype=np.int64)
        change = np.flatnonzero((g[1:] != g[:-1]) | (ph[1:] != ph[:-1])) + 1
        starts = np.concatenate([[0], change])
        ends = np.concatenate([change, [len(live)]])
        run_group = g[starts]
        run_phase = ph[starts]
        run_end = live[ends - 1]
        run_start = np.concatenate([[resident], run_end[:-1]])
        run_max = np.maximum(np.maximum.reduceat(live, starts), run_start)
        run_kv = np.zeros(len(starts), np.int64)
        if est.event_category is not None and est.event_bytes is not None:
            kv = np.where(est.event_category == _KV, est.event_bytes, 0)
            run_kv = np.cumsum(kv)[ends - 1]
    else:
        run_group = np.zeros(0, np.int64)
        run_phase = np.zeros(0, np.int64)
        run_end = run_start = run_max = run_kv = np.zeros(0, np.int64)
        starts = np.zeros(0, np.int64)
    n_runs = len(run_group)
    run_x = n_floor + np.arange(n_runs)

    flops_f = np.bincount(groups, weights=layers.flops_forward, minlength=n_rows)
    flops_b = np.bincount(groups, weights=layers.flops_backward, minlength=n_rows)
    run_flops = np.zeros(n_runs, np.int64)
    fwd = np.isin(run_phase, _FORWARD_PHASES)
    bwd = run_phase == PHASE_CODE[Phase.BACKWARD]
    for mask, per_group in ((fwd, flops_f), (bwd, flops_b)):
        sel = np.flatnonzero(mask)
        _, first = np.unique(run_group[sel], return_index=True)
        hit = sel[first]
        run_flops[hit] = np.rint(per_group[run_group[hit]]).astype(np.int64)

    params = np.bincount(groups, weights=layers.param_count, minlength=n_rows)
    acts = np.bincount(groups, weights=layers.activation_bytes, minlength=n_rows)

    if n_runs and int(live.max()) > resident:
        at = int(np.argmax(live))
        run_of_peak = int(np.searchsorted(starts, at, side="right")) - 1
        peak_x = float(run_x[run_of_peak])
        peak = int(live[at])
    else:
        peak_x = float(n_floor - 1)
        peak = resident
    return WaterfallData(
        floor_categories=floor_categories(est),
        floor_bytes=floor,
        run_x=run_x,
        run_group=run_group,
        run_phase=run_phase,
        run_start_bytes=run_start,
        run_end_bytes=run_end,
        run_max_bytes=run_max,
        run_flops=run_flops,
        run_kv_cache_bytes=run_kv,
        group_param_count=np.rint(params).astype(np.int64),
        group_activation_bytes=np.rint(acts).astype(np.int64),
        peak_x=peak_x,
        peak_bytes=peak,
    )


def _label(name: str) -> str:
    return name or "(model)"


def _run_hover(est: MemoryEstimate, data: WaterfallData, sel: np.ndarray) -> dict[str, Any]:
    """Hover text (strings) and customdata (numbers) for the runs ``sel``, one row per bar."""
    rows = data.run_group[sel]
    uniq, inverse = np.unique(rows, return_inverse=True)
    layers = est.layers
    # One Python step per distinct group (not per bar or event): names and types are tuples
    # of Python objects.
    shapes = output_shape_text(layers, uniq)
    head = np.array(
        [
            f"<b>{_label(layers.name[i])}</b> ({layers.type[i]})<br>output shape: {shape}"
            for i, shape in zip(uniq.tolist(), shapes, strict=True)
        ],
        dtype=str,
    )
    phases = np.array([f"<br>phase: {p.value}" for p in PHASES], dtype=str)
    text = np.char.add(head[inverse] if len(uniq) else head, phases[data.run_phase[sel]])
    end = data.run_end_bytes[sel]
    custom = np.column_stack(
        [
            data.group_param_count[rows],
            data.group_activation_bytes[rows],
            end - data.run_start_bytes[sel],
            end,
            data.run_max_bytes[sel],
            data.run_flops[sel],
        ]
    ).astype(np.float64)
    return {"hovertext": text, "customdata": custom}


def _trace_updates(
    est: MemoryEstimate, data: WaterfallData, capacity_bytes: int | None
) -> list[dict[str, Any]]:
    """New data for every trace, in :data:`TRACE_NAMES` order."""
    n_floor = len(data.floor_categories)
    floor_top = np.cumsum(data.floor_bytes)
    floor_base = floor_top - data.floor_bytes
    floor_labels = np.array([c.value for c in data.floor_categories], dtype=str)
    updates: list[dict[str, Any]] = [
        {
            "x": np.arange(n_floor),
            "y": data.floor_bytes,
            "base": floor_base,
            "hovertext": floor_labels,
            "customdata": np.column_stack([data.floor_bytes, floor_top]).astype(np.float64),
        }
    ]
    for code in range(len(PHASES)):
        sel = np.flatnonzero(data.run_phase == code)
        start = data.run_start_bytes[sel]
        updates.append(
            {
                "x": data.run_x[sel],
                "y": data.run_end_bytes[sel] - start,
                "base": start,
                **_run_hover(est, data, sel),
            }
        )
    updates.append({"x": data.run_x, "y": data.run_max_bytes})
    x_max = n_floor + len(data.run_x)
    x_edges = np.array([-0.5, x_max - 0.5])
    extras_bytes = est.extras.total_bytes
    if capacity_bytes is None:
        updates.append({"x": [], "y": []})
        updates.append({"x": [], "y": []})
    else:
        low = capacity_bytes - extras_bytes
        updates.append(
            {
                "x": np.array([-0.5, x_max - 0.5, x_max - 0.5, -0.5, -0.5]),
                "y": np.array([low, low, capacity_bytes, capacity_bytes, low]),
            }
        )
        updates.append({"x": x_edges, "y": np.array([capacity_bytes, capacity_bytes])})
    peak_text = f"peak: {est.peak_location}"
    updates.append(
        {"x": [data.peak_x], "y": [data.peak_bytes], "text": [peak_text], "hovertext": [peak_text]}
    )
    for code_mask in (
        np.isin(data.run_phase, _FORWARD_PHASES),
        data.run_phase == PHASE_CODE[Phase.BACKWARD],
    ):
        sel = np.flatnonzero(code_mask & (data.run_flops > 0))
        rows = data.run_group[sel]
        uniq, inverse = np.unique(rows, return_inverse=True)
        names = np.array([_label(est.layers.name[r]) for r in uniq], dtype=str)
        updates.append(
            {
                "x": data.run_x[sel],
                "y": data.run_flops[sel],
                "hovertext": names[inverse] if len(uniq) else names,
            }
        )
    kv = data.run_kv_cache_bytes
    shown = bool(len(kv)) and bool(kv.any())
    updates.append({"x": data.run_x if shown else [], "y": kv if shown else []})
    return updates


def _layout_updates(
    est: MemoryEstimate, data: WaterfallData, capacity_bytes: int | None, gpu_name: str
) -> dict[str, Any]:
    n_floor = len(data.floor_categories)
    shown = np.unique(data.run_group)
    named = 0 < len(shown) <= MAX_NAMED_GROUPS
    if named:
        # The floor by category, then each group's name where its forward starts and where
        # its backward starts (its first run in each phase: backward runs interleave with the
        # autograd engine's own, so one label per run would repeat names). One Python step per
        # distinct group, at most MAX_NAMED_GROUPS.
        names = np.array([_tick(_label(est.layers.name[i])) for i in shown.tolist()], dtype=str)
        _, first = np.unique(data.run_group * len(PHASES) + data.run_phase, return_index=True)
        first = np.sort(first)
        xs = [*range(n_floor), *data.run_x[first].tolist()]
        texts = [c.value for c in data.floor_categories]
        texts += names[np.searchsorted(shown, data.run_group[first])].tolist()
        # Drop a label that would sit on the previous one (at most ~_MAX_TICKS fit the width);
        # one step per label, not per bar.
        gap = max(1.0, (n_floor + len(data.run_x)) / _MAX_TICKS)
        tick_x: list[float] = []
        tick_text: list[str] = []
        for x, text in zip(xs, texts, strict=True):
            if not tick_x or x - tick_x[-1] >= gap:
                tick_x.append(x)
                tick_text.append(text)
    else:
        # Ticks at the start of each phase (a handful of values, not one per bar).
        tick_x = [0.0]
        tick_text = ["resident"]
        if len(data.run_phase):
            change = data.run_phase[1:] != data.run_phase[:-1]
            first = np.flatnonzero(np.concatenate([[True], change]))
            tick_x += (n_floor + first).astype(float).tolist()
            tick_text += [PHASES[int(c)].value for c in data.run_phase[first]]
    where = est.peak_location
    title = (
        f"peak {_gib(est.peak_bytes)}"
        + (f" of {_gib(capacity_bytes)}" if capacity_bytes is not None else "")
        + f" ({where})<br><sup>{est.mode.value}, batch {est.batch_size}, "
        f"{est.precision.value}"
        + (f", {est.optimizer.value}" if est.optimizer is not None else "")
        + ranks_title(est)
        + (f" · {gpu_name}" if capacity_bytes is not None and gpu_name else "")
        + "</sup>"
    )
    # A capacity far above the step would flatten the waterfall to a line: then the axis
    # stops above the step and a note says where the capacity is.
    top = max(data.peak_bytes, data.resident_bytes, 1)
    clip = capacity_bytes is not None and capacity_bytes > CLIP_RATIO * top
    note = (
        f"capacity {_gib(capacity_bytes)} ({gpu_name}) is above the chart: the peak uses "
        f"{data.peak_bytes / capacity_bytes:.1%} of it ↑"
        if clip and capacity_bytes
        else ""
    )
    return {
        "title.text": title,
        "xaxis2.tickvals": tick_x,
        "xaxis2.ticktext": tick_text,
        "xaxis2.tickangle": -60 if named else 0,
        "height": _NAMED_HEIGHT if named else _PLAIN_HEIGHT,
        "margin.b": _NAMED_MARGIN_B if named else _PLAIN_MARGIN_B,
        "legend.y": _NAMED_LEGEND_Y if named else _PLAIN_LEGEND_Y,
        "xaxis.range": [-0.6, n_floor + len(data.run_x) - 0.4],
        "yaxis.autorange": not clip,
        "yaxis.range": [0, 1.2 * top] if clip else None,
        "annotations[0].text": note,
        "annotations[0].visible": clip,
    }


def _tick(name: str) -> str:
    """A tick label: the name, or its last ``_TICK_CHARS`` characters after an ellipsis."""
    return name if len(name) <= _TICK_CHARS else "…" + name[-(_TICK_CHARS - 1) :]


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3g} MiB"


def build_figure(
    est: MemoryEstimate,
    *,
    depth: int = 1,
    capacity_bytes: int | None = None,
    gpu_name: str = "",
) -> go.Figure:
    """The two-panel figure of ``est``: memory waterfall on top, FLOPs per layer below.

    Parameters
    ----------
    est : MemoryEstimate
    depth : int
        Grouping depth: modules deeper than this are aggregated under their ancestor.
    capacity_bytes : int, optional
        Device memory; draws the capacity line and the extras band when given.
    gpu_name : str
        Shown in the title beside the capacity.

    Returns
    -------
    plotly.graph_objects.Figure
        Wrap with ``go.FigureWidget(fig)`` for a widget; refresh with :func:`update_figure`.

    Examples
    --------
    >>> from vram_widget import profile_model, zoo
    >>> est = profile_model(zoo.mlp(), input_size=(784,), device="cpu").estimate(32)
    >>> fig = build_figure(est, capacity_bytes=2**30)
    >>> [t.name for t in fig.data] == list(TRACE_NAMES)
    True
    """
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        row_heights=[0.72, 0.28],
        vertical_spacing=0.04,
    )
    fig.add_trace(
        go.Bar(
            width=_BAR_WIDTH,
            name="resident",
            marker_color=_FLOOR_COLOUR,
            hovertemplate=(
                "<b>%{hovertext}</b> (resident)<br>%{customdata[0]:,} B<br>"
                "floor so far: %{customdata[1]:,} B<extra></extra>"
            ),
        ),
        row=1,
        col=1,
    )
    for phase in PHASES:
        fig.add_trace(
            go.Bar(
                width=_BAR_WIDTH,
                name=phase.value,
                marker_color=_PHASE_COLOURS[phase],
                hovertemplate=_BAR_HOVER,
                legendgroup="phase",
            ),
            row=1,
            col=1,
        )
    fig.add_trace(
        go.Scatter(
            name="max within run",
            mode="markers",
            marker={"symbol": "line-ew-open", "size": 8, "color": "#333333"},
            hovertemplate="max within: %{y:,} B<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            name="reserve (extras)",
            mode="lines",
            fill="toself",
            line={"width": 0},
            fillcolor="rgba(214, 39, 40, 0.15)",
            hovertemplate=(
                f"CUDA context + cuBLAS workspace + allocator rounding: "
                f"{est.extras.total_bytes:,} B<extra></extra>"
            ),
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            name="capacity",
            mode="lines",
            line={"color": "#D62728", "width": 2, "dash": "dash"},
            hovertemplate="capacity: %{y:,} B<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            name="peak",
            mode="markers+text",
            marker={"symbol": "star", "size": 14, "color": "#D62728"},
            textposition="top center",
            hovertemplate="%{hovertext}<br>%{y:,} B<extra></extra>",
        ),
        row=1,
        col=1,
    )
    for name, colour in (("forward FLOPs", "#4C78A8"), ("backward FLOPs", "#F58518")):
        fig.add_trace(
            go.Bar(
                width=_BAR_WIDTH,
                name=name,
                marker_color=colour,
                hovertemplate="<b>%{hovertext}</b><br>%{y:,} FLOPs<extra></extra>",
            ),
            row=2,
            col=1,
        )
    fig.add_trace(
        go.Scatter(
            name="KV cache",
            mode="lines",
            line={"color": "#9467BD", "width": 2, "shape": "hv"},
            hovertemplate="KV cache: %{y:,} B<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.update_layout(
        barmode="overlay",
        bargap=0.15,
        height=_PLAIN_HEIGHT,
        margin={"l": 70, "r": 20, "t": 70, "b": _PLAIN_MARGIN_B},
        title={"font": {"size": 15}, "x": 0.02, "xanchor": "left"},
        hovermode="closest",
        legend={"orientation": "h", "y": _PLAIN_LEGEND_Y},
        # ticklabeloverflow="allow": the default ("hide past div") measures every tick
        # label's box on every redraw, ~40 % of plotly's time per slider move in Chromium.
        xaxis={"ticklabeloverflow": "allow"},
        xaxis2={"tickfont": {"size": 10}, "ticklabeloverflow": "allow"},
        yaxis={
            "title": {"text": "live memory"},
            "tickformat": ".3s",
            "ticksuffix": "B",
            "ticklabeloverflow": "allow",
        },
        yaxis2={"title": {"text": "FLOPs"}, "tickformat": ".2s", "ticklabeloverflow": "allow"},
    )
    fig.add_annotation(
        text="",
        visible=False,
        xref="paper",
        yref="paper",
        x=1,
        y=1,
        xanchor="right",
        yanchor="bottom",
        showarrow=False,
        font={"color": "#D62728", "size": 12},
    )
    add_stage_traces(fig)
    _write(fig, est, depth=depth, capacity_bytes=capacity_bytes, gpu_name=gpu_name)
    return fig


def _write(
    fig: go.Figure,
    est: MemoryEstimate,
    *,
    depth: int,
    capacity_bytes: int | None,
    gpu_name: str,
) -> None:
    data = waterfall_data(est, depth)
    updates = _trace_updates(est, data, capacity_bytes) + stage_trace_updates(est, capacity_bytes)
    if len(fig.data) != len(updates):
        raise ValueError(
            f"figure has {len(fig.data)} traces, expected {len(updates)}: "
            "build it with build_figure()"
        )
    updates[_I_RESERVE]["hovertemplate"] = (
        f"reserve: CUDA context {est.extras.cuda_context_bytes:,} B + cuBLAS workspace "
        f"{est.extras.cublas_workspace_bytes:,} B + allocator rounding "
        f"{est.extras.allocator_rounding_bytes:,} B<extra></extra>"
    )
    layout_updates = {
        **_layout_updates(est, data, capacity_bytes, gpu_name),
        **stage_layout_updates(est, capacity_bytes),
    }
    write = getattr(fig, "write_updates", None)
    if write is not None:  # plotly_widget.FigureWidget: stored as given, one message
        write(updates, layout_updates)
        return
    for trace, update in zip(fig.data, updates, strict=True):
        for key, value in update.items():
            if not _same(trace[key], value):
                trace[key] = value
    layout = fig.layout
    for path, value in layout_updates.items():
        parent, _, key = path.rpartition(".")
        obj = layout[parent] if parent else layout
        if not _same(obj[key], value):
            obj[key] = value


def _same(old: Any, new: Any) -> bool:
    """Whether a property already holds ``new`` (so writing it would only cost time)."""
    if old is None or new is None:
        return old is new
    if isinstance(new, str) or isinstance(old, str):
        return bool(old == new)
    try:
        a = np.asarray(old)
        b = np.asarray(new)
    except (TypeError, ValueError):  # pragma: no cover - ragged or odd values
        return False
    return a.shape == b.shape and a.dtype.kind == b.dtype.kind and bool(np.array_equal(a, b))


def update_figure(
    fig: go.Figure,
    est: MemoryEstimate,
    *,
    depth: int = 1,
    capacity_bytes: int | None = None,
    gpu_name: str = "",
) -> None:
    """Write ``est`` into a figure made by :func:`build_figure`, in place.

    A ``go.FigureWidget`` is updated inside ``fig.batch_update()`` (one message to the
    front end); the traces are the same objects before and after.
    """
    batch = getattr(fig, "batch_update", None)
    if batch is not None:
        with batch():
            _write(fig, est, depth=depth, capacity_bytes=capacity_bytes, gpu_name=gpu_name)
    else:
        _write(fig, est, depth=depth, capacity_bytes=capacity_bytes, gpu_name=gpu_name)


# ------------------------------------------------------------------------------------------
# The batch x sequence-length frontier
# ------------------------------------------------------------------------------------------

FRONTIER_TRACE_NAMES: tuple[str, ...] = (
    "largest batch that fits",
    "this setting",
    "largest batch at this length",
)
"""The frontier figure's traces, in order (the same traces on every update)."""

_FITS_COLOUR = "#2CA02C"
_OVER_COLOUR = "#D62728"


def _frontier_updates(
    frontier: Frontier,
    batch_size: int,
    seq_len: int,
    max_batch_here: int,
    title: str,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    # A log axis has no 0: lengths where not even one sample fits end the line.
    some = frontier.max_batch_sizes > 0
    lengths = frontier.seq_lens[some]
    batches = frontier.max_batch_sizes[some]
    fits = 1 <= batch_size <= max_batch_here
    here_x, here_y = ([seq_len], [max_batch_here]) if max_batch_here > 0 else ([], [])
    traces = [
        {
            "x": lengths,
            "y": batches,
            "customdata": lengths * batches,
        },
        {
            "x": [seq_len],
            "y": [batch_size],
            "marker.color": _FITS_COLOUR if fits else _OVER_COLOUR,
            "customdata": [batch_size * seq_len],
        },
        {"x": here_x, "y": here_y, "customdata": [h * seq_len for h in here_y]},
    ]
    note = "" if frontier.complete else " (lengths profiled so far: not a polynomial in length)"
    layout = {"title.text": title + note}
    return traces, layout


def _write_frontier(fig: go.Figure, *args: Any) -> None:
    traces, layout = _frontier_updates(*args)
    if len(fig.data) != len(traces):
        raise ValueError(
            f"figure has {len(fig.data)} traces, expected {len(traces)}: "
            "build it with build_frontier_figure()"
        )
    write = getattr(fig, "write_updates", None)
    if write is not None:  # plotly_widget.FigureWidget: stored as given, one message
        write(traces, layout)
        return
    for trace, update in zip(fig.data, traces, strict=True):
        for path, value in update.items():
            head, _, key = path.rpartition(".")
            obj = trace[head] if head else trace
            if not _same(obj[key], value):
                obj[key] = value
    for path, value in layout.items():
        head, _, key = path.rpartition(".")
        obj = fig.layout[head] if head else fig.layout
        if not _same(obj[key], value):
            obj[key] = value


def build_frontier_figure(
    frontier: Frontier,
    *,
    batch_size: int,
    seq_len: int,
    max_batch_here: int,
    title: str = "",
) -> go.Figure:
    """The batch x sequence-length frontier as a line on log axes, with the current
    setting marked (green where it fits, red where not) and the largest batch at its length.

    Parameters
    ----------
    frontier : Frontier
        From :meth:`ModelProfile.frontier`.
    batch_size, seq_len : int
        The current setting.
    max_batch_here : int
        The largest batch that fits at ``seq_len`` (``max_batch_size(..., seq_len=...)``).
    title : str
        What the frontier is for (GPU, precision, optimizer, mode).

    Examples
    --------
    >>> import numpy as np
    >>> from vram_widget._estimating.tradeoff import Frontier
    >>> f = Frontier(2**30, np.array([64, 128]), np.array([40, 18]), complete=True)
    >>> fig = build_frontier_figure(f, batch_size=32, seq_len=128, max_batch_here=18)
    >>> fig.data[1].marker.color      # batch 32 at 128 tokens does not fit
    '#D62728'
    """
    fig = go.Figure()
    tokens = "%{customdata:,} tokens per step"
    fig.add_trace(
        go.Scatter(
            name=FRONTIER_TRACE_NAMES[0],
            mode="lines+markers",
            line={"color": "#4C78A8", "shape": "hv"},
            marker={"size": 5},
            hovertemplate=f"%{{x:,}} tokens: batch %{{y:,}}<br>{tokens}<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            name=FRONTIER_TRACE_NAMES[1],
            mode="markers",
            marker={"symbol": "star", "size": 16, "line": {"width": 1, "color": "#333333"}},
            hovertemplate=f"batch %{{y:,}} at %{{x:,}} tokens<br>{tokens}<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            name=FRONTIER_TRACE_NAMES[2],
            mode="markers",
            marker={"symbol": "circle-open", "size": 12, "color": "#333333"},
            hovertemplate=f"largest at %{{x:,}} tokens: batch %{{y:,}}<br>{tokens}<extra></extra>",
        )
    )
    fig.update_layout(
        height=380,
        margin={"l": 70, "r": 20, "t": 50, "b": 50},
        title={"font": {"size": 14}, "x": 0.02, "xanchor": "left"},
        xaxis={"type": "log", "title": {"text": "sequence length (tokens per sample)"}},
        yaxis={"type": "log", "title": {"text": "batch size"}},
        legend={"orientation": "h", "y": -0.2},
        hovermode="closest",
    )
    _write_frontier(fig, frontier, batch_size, seq_len, max_batch_here, title)
    return fig


def update_frontier_figure(
    fig: go.Figure,
    frontier: Frontier,
    *,
    batch_size: int,
    seq_len: int,
    max_batch_here: int,
    title: str = "",
) -> None:
    """Write a frontier and setting into a figure made by :func:`build_frontier_figure`,
    in place (inside ``batch_update()`` on a ``FigureWidget``)."""
    batch = getattr(fig, "batch_update", None)
    with batch() if batch is not None else contextlib.nullcontext():
        _write_frontier(fig, frontier, batch_size, seq_len, max_batch_here, title)
