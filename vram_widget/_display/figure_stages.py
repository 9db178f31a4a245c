"""The per-stage panel of the memory figure: with pipeline parallelism (``pp > 1``), one bar
per stage's peak (``MemoryEstimate.stage_peak_bytes``) against the card's capacity, the
worst stage marked (plotly only).

The panel sits right of the waterfall, on its own axes (``xaxis3`` / ``yaxis3``). Its traces
are always in the figure, in the order of :data:`STAGE_TRACE_NAMES`, after the waterfall's:
with ``pp = 1`` they are hidden and empty, the panel's axes hidden, and the waterfall takes
the whole width again, so a figure updated in place keeps the same traces whatever the
setting. The waterfall of a ``pp > 1`` estimate is the whole model's one-device step, for
reference (``ModelProfile.estimate``): the title says so and names the worst stage. With
tensor, expert or context parallelism the figure is one rank's, which its title names
(:func:`ranks_title`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from .._estimating.estimator import MemoryEstimate

__all__ = [
    "STAGE_TRACE_NAMES",
    "WATERFALL_DOMAIN",
    "add_stage_traces",
    "pipeline_layout",
    "ranks_title",
    "stage_data_parallel",
    "stage_layout_updates",
    "stage_trace_updates",
    "stage_unit",
]

STAGE_TRACE_NAMES: tuple[str, ...] = ("stage peaks", "stage capacity", "worst stage")
"""The panel's traces, in order (after the waterfall's, in every figure)."""

WATERFALL_DOMAIN: tuple[float, float] = (0.0, 0.74)
"""The waterfall's (and the FLOPs panel's) horizontal share while the stage panel shows."""
_STAGE_DOMAIN = [0.82, 1.0]
_FULL_DOMAIN = [0.0, 1.0]
_STAGE_COLOUR = "#4C78A8"
_WORST_COLOUR = "#D62728"
# a capacity above this many times the worst stage's peak is left off the panel's axis
# (as the waterfall's CLIP_RATIO does): the bars' hover gives their share of the card
_CLIP_RATIO = 3.0


def add_stage_traces(fig: go.Figure) -> None:
    """Add the panel's hidden traces and axes to ``fig`` (a two-row figure of
    :func:`~.figures.build_figure`), beside the top row."""
    common: dict[str, Any] = {"xaxis": "x3", "yaxis": "y3", "visible": False, "showlegend": False}
    fig.add_trace(
        go.Bar(
            name="stage peaks",
            width=0.7,
            textposition="inside",
            insidetextanchor="end",
            hovertemplate="%{hovertext}<extra></extra>",
            **common,
        )
    )
    fig.add_trace(
        go.Scatter(
            name="stage capacity",
            mode="lines",
            line={"color": _WORST_COLOUR, "width": 2, "dash": "dash"},
            hovertemplate="capacity: %{y:,} B<extra></extra>",
            **common,
        )
    )
    fig.add_trace(
        go.Scatter(
            name="worst stage",
            mode="markers+text",
            marker={"symbol": "star", "size": 14, "color": _WORST_COLOUR},
            textposition="top center",
            hovertemplate="%{text}: %{y:,} B<extra></extra>",
            **common,
        )
    )
    top = list(fig.layout.yaxis.domain or _FULL_DOMAIN)
    fig.update_layout(
        xaxis3={"domain": _STAGE_DOMAIN, "anchor": "y3", "visible": False},
        yaxis3={
            "domain": top,
            "anchor": "x3",
            "visible": False,
            "tickformat": ".3s",
            "ticksuffix": "B",
            "title": {"text": "peak per stage"},
        },
    )


def stage_trace_updates(est: MemoryEstimate, capacity_bytes: int | None) -> list[dict[str, Any]]:
    """New data for the panel's traces, in :data:`STAGE_TRACE_NAMES` order: the stages'
    peaks (the worst in red), the capacity across them, a star on the worst stage; hidden
    and empty where ``est`` has no stages.

    Examples
    --------
    >>> import dataclasses
    >>> from vram_widget import profile_model, zoo
    >>> est = profile_model(zoo.mlp(), input_size=(784,), device="cpu").estimate(2)
    >>> bars, capacity, worst = stage_trace_updates(
    ...     dataclasses.replace(est, pp=2, stage_peak_bytes=(300, 100)), 1_000)
    >>> bars["y"].tolist(), capacity["y"].tolist(), worst["text"]
    ([300, 100], [1000, 1000], ['worst: stage 0'])
    >>> stage_trace_updates(est, 1_000)[0]["visible"]
    False
    """
    peaks = np.asarray(est.stage_peak_bytes, dtype=np.int64)
    if len(peaks) < 2:
        hidden: dict[str, Any] = {"visible": False, "x": [], "y": []}
        return [dict(hidden), dict(hidden), {**hidden, "text": []}]
    x = np.arange(len(peaks))
    worst = int(np.argmax(peaks))
    colours = np.where(x == worst, _WORST_COLOUR, _STAGE_COLOUR)
    share = (
        [""] * len(peaks)
        if capacity_bytes is None
        else [f" ({p / capacity_bytes:.3%} of the card)" for p in peaks.tolist()]
    )
    unit = stage_unit(est)
    hover = [
        f"{unit} {i}: peak {p:,} B{s}"
        for i, (p, s) in enumerate(zip(peaks.tolist(), share, strict=True))
    ]
    capacity: dict[str, Any] = {"visible": False, "x": [], "y": []}
    if capacity_bytes is not None:
        capacity = {
            "visible": True,
            "x": np.array([-0.5, len(peaks) - 0.5]),
            "y": np.array([capacity_bytes, capacity_bytes]),
        }
    return [
        {
            "visible": True,
            "x": x,
            "y": peaks,
            "marker.color": colours,
            "text": [_size(p) for p in peaks.tolist()],
            "hovertext": hover,
        },
        capacity,
        {
            "visible": True,
            "x": [worst],
            "y": [int(peaks[worst])],
            "text": [f"worst: {unit} {worst}"],
        },
    ]


def stage_unit(est: MemoryEstimate) -> str:
    """What each of ``est.stage_peak_bytes`` is: a stage, or a rank's several stages
    (``"interleaved-1f1b"``).

    Examples
    --------
    >>> from vram_widget import profile_model, zoo
    >>> stage_unit(profile_model(zoo.mlp(), input_size=(784,), device="cpu").estimate(2))
    'stage'
    """
    return "rank" if est.stages_per_rank > 1 else "stage"


def pipeline_layout(est: MemoryEstimate) -> str:
    """The ranks of a pipeline estimate: ``"pp=k"`` for the pipeline alone, ``"dp=d x pp=k
    (strategy)"`` where ``d`` data-parallel ranks of each stage share it (FSDP2 over the
    stages, ``gpus = dp x pp``), with ``" x tp=t"`` where each stage is sharded over ``t``
    tensor-parallel ranks (``gpus = dp x pp x tp``).

    Examples
    --------
    >>> import dataclasses
    >>> from vram_widget import profile_model, zoo
    >>> est = profile_model(zoo.mlp(), input_size=(784,), device="cpu").estimate(2)
    >>> pipeline_layout(dataclasses.replace(est, gpus=2, pp=2))
    'pp=2'
    >>> pipeline_layout(dataclasses.replace(est, gpus=8, pp=2, strategy="zero3"))
    'dp=4 x pp=2 (zero3)'
    >>> pipeline_layout(dataclasses.replace(est, gpus=8, pp=2, tp=2, strategy="zero3"))
    'dp=2 x pp=2 x tp=2 (zero3)'
    """
    dp, tp = stage_data_parallel(est), est.tp or 1
    parts = [f"dp={dp}"] * (dp > 1) + [f"pp={est.pp}"] + [f"tp={tp}"] * (tp > 1)
    return " x ".join(parts) + (f" ({est.strategy})" if dp > 1 else "")


def stage_data_parallel(est: MemoryEstimate) -> int:
    """The data-parallel ranks of each pipeline stage, ``gpus / (pp x tp)`` (1 where there
    are none, or no stages).

    Examples
    --------
    >>> import dataclasses
    >>> from vram_widget import profile_model, zoo
    >>> est = profile_model(zoo.mlp(), input_size=(784,), device="cpu").estimate(2)
    >>> stage_data_parallel(est), stage_data_parallel(dataclasses.replace(est, gpus=8, pp=2))
    (1, 4)
    """
    return max(1, est.gpus // (est.pp * est.tp))


def stage_layout_updates(est: MemoryEstimate, capacity_bytes: int | None) -> dict[str, Any]:
    """The panel's axes shown (and the waterfall narrowed) where ``est`` has stages, hidden
    (the waterfall at full width) where not; the title naming the worst stage."""
    peaks = est.stage_peak_bytes
    if len(peaks) < 2:
        return {
            "xaxis.domain": _FULL_DOMAIN,
            "xaxis2.domain": _FULL_DOMAIN,
            "xaxis3.visible": False,
            "yaxis3.visible": False,
            "yaxis3.range": None,
        }
    top = max(peaks)
    worst = peaks.index(top)
    clip = capacity_bytes is None or capacity_bytes > _CLIP_RATIO * top
    high = 1.25 * top if clip else 1.1 * max(top, capacity_bytes or 0)
    m = "" if est.microbatches is None else f", {est.microbatches} micro-batches"
    unit = stage_unit(est)
    if est.stages_per_rank > 1:
        m += f", {est.stages_per_rank} stages a rank"
    return {
        "xaxis.domain": list(WATERFALL_DOMAIN),
        "xaxis2.domain": list(WATERFALL_DOMAIN),
        "xaxis3.visible": True,
        "xaxis3.tickvals": list(range(len(peaks))),
        "xaxis3.ticktext": [f"{unit} {i}" for i in range(len(peaks))],
        "xaxis3.title.text": f"{pipeline_layout(est)}, {est.pp_schedule}{m}",
        "xaxis3.range": [-0.6, len(peaks) - 0.4],
        "yaxis3.visible": True,
        "yaxis3.range": [0, high],
        "title.text": (
            f"peak {_size(top)} on {unit} {worst} of {len(peaks)} (worst {unit}"
            + ("" if stage_data_parallel(est) == 1 else f"; {pipeline_layout(est)}")
            + ")<br><sup>"
            f"waterfall: the whole model's one-device step at batch {est.batch_size}, for "
            "reference</sup>"
        ),
    }


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3g} MiB"


def ranks_title(est: MemoryEstimate) -> str:
    """Which rank of a tensor-, expert- or context-parallel layout the figure is, for its
    title ("" for one device and data parallelism, whose ranks the details describe).

    Examples
    --------
    >>> import dataclasses
    >>> from vram_widget import profile_model, zoo
    >>> est = profile_model(zoo.mlp(), input_size=(784,), device="cpu").estimate(2)
    >>> ranks_title(est), ranks_title(dataclasses.replace(est, gpus=2, ep=2))
    ('', ' · rank 0 of ep=2, tokens routed evenly')
    >>> ranks_title(dataclasses.replace(est, gpus=2, cp=2, seq_len=32))
    ' · rank 0 of cp=2, 16 of 32 tokens a sequence (UNCONFIRMED)'
    """
    if est.ep > 1:
        return f" · rank 0 of ep={est.ep}, tokens routed evenly"
    if est.cp > 1:
        seq = est.seq_len or 0
        share = f"{seq // est.cp} of {seq} tokens a sequence"
        return f" · rank 0 of cp={est.cp}, {share} (UNCONFIRMED)"
    return f" · one rank of tp={est.tp}" if est.tp > 1 else ""
