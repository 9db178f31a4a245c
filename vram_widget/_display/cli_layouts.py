"""``vram-widget ... --plan-layouts N``: every layout of N GPUs the estimate answers, best
first, as a table (or JSON), and the layouts it refuses, grouped by their reason."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from .cli import _bytes

if TYPE_CHECKING:
    from torch import nn

    from .._estimating.layouts import Layout, LayoutPlan

# what the table's columns are, in the words of the JSON too
TRAFFIC_MEANS = (
    "data-parallel collectives per rank and step, in copies of the parameters, as the ZeRO "
    "paper counts them (ddp and zero2 2, zero1 and zero3 3); '-' for tensor and pipeline "
    "layouts (their bytes are in 'sent/step')"
)
SENT_MEANS = (
    "bytes a rank sends per step, each collective counted as a ring moves it (all-reduce "
    "2(k-1)/k of the tensor, all-gather and reduce-scatter (k-1)/k of the whole tensor, a "
    "send all of it): recorded from the rank's step for tensor and pipeline layouts (the "
    "stage that sends most), the strategy's collectives over the parameters and gradients "
    "for data-parallel ones"
)
BUFFERS_MEANS = (
    "communication buffers the rank keeps resident (DDP's gradient buckets); '-' where "
    "the estimate counts none apart (tensor and pipeline layouts)"
)


def print_plan(
    args: argparse.Namespace, model: nn.Module, inputs: dict[str, Any], keywords: dict[str, Any]
) -> int:
    """Profile ``model`` at the first precision, plan ``args.plan_layouts`` GPUs of
    ``args.gpu`` and print the plan; 0 (errors propagate to ``cli.main``)."""
    from .. import profile_model

    precision = args.precisions[0]
    profile = profile_model(model, device=args.device.value, precisions=(precision,), **inputs)
    settings = {k: v for k, v in keywords.items() if k not in ("gpus", "strategy", "rank")}
    plan = profile.plan_layouts(
        args.gpu,
        gpus=args.plan_layouts,
        batch_size=args.batch_size,
        precision=precision,
        **settings,
    )
    if args.json:
        print(json.dumps(plan_json(plan, args.gpu.name), indent=2))
    else:
        print(profile)
        print("\n".join(plan_lines(plan, args.gpu.name, precision.value)))
    return 0


def plan_lines(plan: LayoutPlan, gpu_name: str, precision: str) -> list[str]:
    """The plan as text lines: a heading, the table best first, the refused layouts.

    Examples
    --------
    >>> from vram_widget import profile_model, zoo
    >>> profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    >>> plan = profile.plan_layouts("64 MiB", gpus=2, batch_size=8, strategies=["ddp"])
    >>> lines = plan_lines(plan, "64 MiB", "fp32")
    >>> lines[3].split()[:4]
    ['1', 'dp=2', 'ddp', '4']
    """
    lines = [
        f"layouts of {plan.gpus} GPUs of {gpu_name} ({_bytes(plan.capacity_bytes)} each), "
        f"{precision}, batch {plan.batch_size:,} a step; best first: those that fit, then "
        "the fewest bytes sent per rank and step, then the least memory; each figure is "
        "the worst "
        f"rank's (or pipeline stage's); 'compared' is the figure held against the capacity "
        f"on the {plan.basis.value} basis (device bytes on CUDA; allocated plus extras on "
        "the CPU)",
    ]
    header = ["#", "layout", "batch/rank", "allocated", "compared", "fits"]
    header += ["comm buffers", "DP traffic", "sent/step"]
    rows = [_row(i, layout) for i, layout in enumerate(plan.layouts, 1)]
    if rows:
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        lines.append("")
        for row in (header, *rows):
            cells = [
                c.ljust(w) if i in (1, 5) else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  ".join(cells).rstrip())
    else:
        lines.append("no layout of these GPUs is estimated")
    lines.append(f"comm buffers: {BUFFERS_MEANS}")
    lines.append(f"DP traffic: {TRAFFIC_MEANS}")
    lines.append(f"sent/step: {SENT_MEANS}")
    best = plan.best
    lines.append(f"best: {best.label}" if best is not None else "none fits: more GPUs, or levers")
    warned = dict.fromkeys(w for layout in plan.layouts for w in layout.warnings)
    lines += [f"warning: {w}" for w in warned]
    by_reason: dict[str, list[str]] = {}
    for refused in plan.refused:
        by_reason.setdefault(refused.reason, []).append(refused.label)
    if by_reason:
        lines.append("not estimated:")
    for reason, labels in by_reason.items():
        lines.append(f"  {', '.join(labels)}: {reason}")
    return lines


def _row(i: int, layout: Layout) -> list[str]:
    buffers = layout.communication_bytes
    traffic = layout.traffic_params
    sent = layout.communication_sent_bytes
    return [
        str(i),
        layout.label,
        f"{layout.rank_batch_size:,}",
        _bytes(layout.peak_bytes),
        _bytes(layout.fit_bytes),
        "yes" if layout.fits else "no",
        "-" if buffers is None else _bytes(buffers),
        "-" if traffic is None else f"{traffic:g}",
        "-" if sent is None else _bytes(sent),
    ]


def plan_json(plan: LayoutPlan, gpu_name: str) -> dict[str, Any]:
    """The plan as one JSON object."""
    return {
        "gpus": plan.gpus,
        "gpu": {"name": gpu_name, "memory_bytes": plan.capacity_bytes},
        "batch_size": plan.batch_size,
        "basis": plan.basis.value,
        "communication_bytes_means": BUFFERS_MEANS,
        "traffic_params_means": TRAFFIC_MEANS,
        "communication_sent_bytes_means": SENT_MEANS,
        "best": None if plan.best is None else plan.best.label,
        "layouts": [
            {
                "layout": layout.label,
                "dp": layout.dp,
                "strategy": None if layout.strategy is None else layout.strategy.value,
                "tp": layout.tp,
                "pp": layout.pp,
                "pp_schedule": None if layout.pp_schedule is None else layout.pp_schedule.value,
                "microbatches": layout.microbatches,
                "rank_batch_size": layout.rank_batch_size,
                "peak_bytes": layout.peak_bytes,
                "fit_bytes": layout.fit_bytes,
                "fits": layout.fits,
                "communication_bytes": layout.communication_bytes,
                "traffic_params": layout.traffic_params,
                "communication_sent_bytes": layout.communication_sent_bytes,
                "communication_sent_bytes_by_kind": {
                    str(kind): sent
                    for kind, sent in layout.communication_sent_bytes_by_kind.items()
                },
                "warnings": list(layout.warnings),
            }
            for layout in plan.layouts
        ],
        "refused": [{"layout": r.label, "reason": r.reason} for r in plan.refused],
    }
