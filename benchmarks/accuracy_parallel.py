"""Accuracy of one tensor-parallel or pipeline-parallel rank's estimate against real
torch.distributed ranks.

The estimate comes from the single-device profile (``device="cpu"``, batch 2):
``profile.estimate(4, precision, optimizer, mode, gpus=k, tp=k[, tp_plan=...])`` is one
tensor-parallel rank (every rank holds the same shards, so one estimate serves them all), and
``profile.estimate(4, ..., gpus=2, pp=2, pp_schedule=..., microbatches=m)`` each pipeline
rank (``est.stage_peak_bytes[r]``). The truth is ``measure(...)`` with the same keywords:
k processes forked on this machine in one gloo process group on 127.0.0.1, each sharding
its copy by the plan's own library (transformers' ``apply_tensor_parallelism`` for a Hugging
Face model's plan, ``parallelize_module`` for a plan of ``torch.distributed.tensor.parallel``
styles) or holding its pipeline stage and stepping it by ``ScheduleGPipe`` /
``Schedule1F1B`` (or its two stages r and r + 2, by ``ScheduleInterleaved1F1B``). Each
rank's peak is the CPU allocator's allocated bytes, as the profiler's memory events record
them on the rank's own thread (resident bytes included); measure kills its ranks by PID
when they overrun ``timeout_s``.

Grid: a Hugging Face Llama of 2 layers, hidden 64, 4 heads and 2 key/value heads; the same
with 4 key/value heads (so 4 ranks divide them); a Mixtral of that shape with 4 experts, 2
per token; and a LayerNorm + Linear + ReLU + Linear block on 8 tokens of 32 features under a
plan of ``ColwiseParallel`` / ``RowwiseParallel`` without and with sequence parallelism
(``SequenceParallel`` on the norm, the first Linear reading ``Shard(1)``, the last
reduce-scattering to ``Shard(1)``); and torchtitan 0.3.0's own Llama (``tests/models.py``,
built as its configs build it, 32 tokens) under a plan of styles that splits its MLPs as
Megatron does (torchtitan's own tensor parallelism is a ``sharding_config`` per module that
``Module.parallelize`` applies, which ``tp_plan`` does not take). Tensor parallelism on 2
ranks (and 4 where the heads divide) x fp32 and bf16 x AdamW training and inference;
pipeline parallelism on 2 ranks x GPipe, 1F1B and interleaved 1F1B (2 stages a rank, the
layers split as torchtitan counts them) x 2 and 4 micro-batches x fp32 and bf16, AdamW
training. FSDP2 over tensor-parallel ranks (``gpus=4, tp=2, strategy="zero3"``: a 2-D mesh,
dp_shard=2 x tp=2, the plan on the tp sub-mesh, then ``fully_shard`` per decoder layer and
on the root over dp_shard, as torchtitan composes them) on the Hugging Face Llama and
torchtitan's Llama x fp32 and bf16, AdamW training, each rank against its own estimate
(``rank=r``); and HSDP over them (``gpus=8, tp=2, strategy="hsdp", gpus_per_node=4``: a 3-D
mesh, dp_replicate=2 x dp_shard=2 x tp=2, ``fully_shard`` on the 2-D (dp_replicate,
dp_shard) sub-mesh, and ``gpus=4, gpus_per_node=2``: dp_replicate=2 x dp_shard=1 x tp=2,
one tensor-parallel group a node) on the same two models. FSDP2 over pipeline stages
(``gpus=4, pp=2,
strategy="zero2"|"zero3"``: a 2-D mesh, pp=2 x dp_shard=2, pp outer, each stage's decoder
layers then the stage wrapped by ``fully_shard`` over its dp_shard ranks, as torchtitan
composes them) on the Hugging Face Llama x the three schedules with 2 micro-batches x fp32
and bf16, AdamW training, each rank against its own estimate. Tensor parallelism inside
pipeline stages (``gpus=4, pp=2, tp=2``: a 2-D mesh, pp=2 x tp=2, pp outer, each stage
sharded by the model's own plan on its tp ranks) on the Hugging Face Llama x the three
schedules with 2 micro-batches x fp32 and bf16, AdamW training, rank r against stage
r // tp's estimate. FSDP2 over those tensor-parallel stages (``gpus=8, pp=2, tp=2,
strategy="zero2"|"zero3"``: a 3-D mesh, pp=2 x dp_shard=2 x tp=2, each stage sharded by the
plan on its tp ranks, then ``fully_shard`` per decoder layer and on the stage over its
dp_shard ranks) x the three schedules x fp32 and bf16, each rank against its own
estimate; and HSDP over the stages (``gpus=8, pp=2, strategy="hsdp", gpus_per_node=2``: a
3-D mesh, pp=2 x dp_replicate=2 x dp_shard=2) x GPipe and 1F1B x fp32 and bf16. Expert
parallelism on 2 ranks
(``ep=2``, transformers' own ep plan) x fp32 and bf16 x training and inference, on the
Mixtral with each router's rows set to ``[w, -w, u, -u]`` (every token picks one expert of
each rank: balanced routing, the case the estimate is for; its ``ep_worst_case_bytes`` is
kept in the rows). A batch of 4 (16 tokens); every rank computes on one thread (the forked
ranks must, and CPU kernel scratch can depend on the thread count). A layout the estimate
refuses is a row with its reason.

    python benchmarks/accuracy_parallel.py           # about 6 minutes on 2 cores
    python benchmarks/accuracy_parallel.py --quick   # a handful of rows, under a minute
    python benchmarks/accuracy_parallel.py --models hf_mixtral_balanced   # ep rows, ~1 minute
    python benchmarks/accuracy_parallel.py --models hf_llama --layouts interleaved   # 4 runs
    python benchmarks/accuracy_parallel.py --layouts dp_shard   # FSDP2 or HSDP x tp, FSDP2 x pp
    python benchmarks/accuracy_parallel.py --layouts hsdp   # HSDP x tp rows (8 ranks), ~3 min
    python benchmarks/accuracy_parallel.py --models hf_llama --layouts "x pp=2"  # FSDP2 x pp
    python benchmarks/accuracy_parallel.py --models hf_llama --layouts "m=2 x tp"  # (dp x) pp x tp

Targets: per-rank median |ratio - 1| <= 0.5 %, worst <= 3 %. Writes
results/accuracy_parallel.json (``--quick``: results/accuracy_parallel_quick.json) and prints
a markdown summary (benchmarks/report.py writes it into docs/).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import _hf
import torch
from _results import write_results
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.nn import functional as F

from vram_widget import measure, profile_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import models  # tests/models.py: torchtitan's Llama as its own configs build it

BATCH = 4
PROFILE_BATCH = 2
PRECISIONS = ("fp32", "bf16")
MODES = ("train", "inference")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
MICROBATCHES = (2, 4)
# FSDP2 over pipeline stages: reshard_after_forward False / True
STAGE_STRATEGIES = ("zero2", "zero3")
TARGET_MEDIAN_PCT = 0.5
TARGET_WORST_PCT = 3.0
BASIS = "CPU allocator's allocated bytes (torch.profiler memory events), per rank"


def block() -> nn.Module:
    """A pre-norm MLP block: LayerNorm(32), Linear(32, 64), ReLU, Linear(64, 32)."""
    return nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def block_inputs(batch: int) -> torch.Tensor:
    """``batch`` x 8 tokens x 32 features."""
    return torch.randn(batch, 8, 32, generator=torch.Generator().manual_seed(batch))


def tp_plan() -> dict[str, Any]:
    """Megatron's pair: the first Linear column-parallel, the second row-parallel (its output
    all-reduced), the norm replicated."""
    return {"1": ColwiseParallel(), "3": RowwiseParallel()}


def sp_plan() -> dict[str, Any]:
    """The same pair with sequence parallelism, as torchtitan's Llama plan lays out a block:
    the norm on the rank's tokens (``SequenceParallel``), all-gathered into the first Linear,
    the second Linear's output reduce-scattered back to the rank's tokens."""
    return {
        "0": SequenceParallel(),
        "1": ColwiseParallel(input_layouts=Shard(1)),
        "3": RowwiseParallel(output_layouts=Shard(1)),
    }


def titan_ffn_plan() -> dict[str, Any]:
    """Megatron's MLP split on torchtitan's Llama: ``w1`` and ``w3`` column-parallel, ``w2``
    row-parallel, attention and norms replicated (torchtitan 0.3.0 declares its own tensor
    parallelism per module, as ``sharding_config`` applied by ``Module.parallelize``, not as
    a plan of ``torch.distributed.tensor.parallel`` styles)."""
    return {
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
    }


def titan_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of torchtitan's logits in fp32 (its ``cross_entropy_loss``,
    torchtitan/components/loss.py) against token 0 everywhere."""
    targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclasses.dataclass(frozen=True)
class Case:
    """A model, its batches, its loss (None: the model's own), and the layouts it runs."""

    build: Callable[[], nn.Module]
    make: Callable[[int], Any]
    tp: tuple[int, ...]
    plans: dict[str, Callable[[], dict[str, Any]] | None]  # label -> tp_plan (None: own)
    pp: bool
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    ep: tuple[int, ...] = ()  # expert-parallel degrees (gpus = ep)
    dp_tp: bool = False  # FSDP2 (zero3, hsdp) over groups of tp=2 ranks, training
    dp_pp: bool = False  # FSDP2 (zero2, zero3) over dp_shard=2 ranks of each of 2 stages
    tp_pp: bool = False  # tp=2 ranks inside each of 2 stages (the model's own plan)


CASES: dict[str, Case] = {
    "hf_llama": Case(_hf.llama, _hf.tokens, (2, 4), {"own plan": None}, True, dp_tp=True,
                     dp_pp=True, tp_pp=True),
    "hf_llama_mha": Case(_hf.llama_mha, _hf.tokens, (2, 4), {"own plan": None}, True),
    "hf_mixtral": Case(_hf.mixtral, _hf.tokens, (2, 4), {"own plan": None}, True),
    "hf_mixtral_balanced": Case(_hf.mixtral_balanced, _hf.tokens, (), {}, False, ep=(2,)),
    "mlp_block": Case(block, block_inputs, (2, 4), {"colwise/rowwise": tp_plan,
                                                    "sequence parallel": sp_plan}, False),
    "torchtitan_llama3": Case(models.torchtitan_llama3, models.titan_tokens, (2,),
                              {"FFN colwise/rowwise": titan_ffn_plan}, True, titan_loss,
                              dp_tp=True),
}  # fmt: skip


def _row(label: str, layout: str, precision: str, mode: str, **fields: Any) -> dict[str, Any]:
    return {"model": label, "layout": layout, "precision": precision, "mode": mode, **fields}


def _refused(label: str, layout: str, precision: str, mode: str, exc: Exception) -> dict:
    print(f"{label:14s} {layout:28s} {precision:5s} {mode:9s} refused: {exc}", flush=True)
    return _row(label, layout, precision, mode, refused=f"{type(exc).__name__}: {exc}")


def compare(
    label: str,
    layout: str,
    profile: Any,
    model: nn.Module,
    make: Callable[[int], Any],
    precision: str,
    mode: str,
    settings: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """One real run of the layout's ranks; a row per rank against that rank's estimate."""
    optimizer = "adamw" if mode == "train" else None
    kwargs = {"precision": precision, "mode": mode, "optimizer": optimizer, **settings}
    try:
        est = profile.estimate(BATCH, **kwargs)
    except ValueError as exc:  # a layout the estimate refuses, by name
        return [_refused(label, layout, precision, mode, exc)]
    estimates = list(est.stage_peak_bytes) or [est.peak_bytes] * settings["gpus"]
    if settings.get("tp", 1) > 1 and settings.get("pp", 1) > 1:  # stage r // (dp x tp)
        per_stage = settings["gpus"] // settings["pp"]
        estimates = [est.stage_peak_bytes[r // per_stage] for r in range(settings["gpus"])]
    if settings.get("strategy") is not None:  # FSDP2 over tp groups or stages: each rank's own
        estimates = [
            profile.estimate(BATCH, rank=rank, **kwargs).peak_bytes
            for rank in range(settings["gpus"])
        ]
    t0 = time.perf_counter()
    real = measure(model, make(BATCH), loss_fn, timeout_s=180, **kwargs)
    seconds = time.perf_counter() - t0
    rows = [
        _row(
            label,
            layout,
            precision,
            mode,
            rank=rank,
            gpus=settings["gpus"],
            estimated=estimated,
            measured=peak,
            ratio=estimated / peak,
            error_pct=(estimated - peak) / peak * 100,
            measure_s=seconds,
            **(
                {}
                if est.ep_worst_case_bytes is None
                else {"ep_worst_case": est.ep_worst_case_bytes}
            ),
        )
        for rank, (estimated, peak) in enumerate(zip(estimates, real.rank_peak_bytes, strict=True))
    ]
    worst = max(abs(r["error_pct"]) for r in rows)
    print(
        f"{label:14s} {layout:28s} {precision:5s} {mode:9s} est={estimates} "
        f"measured={list(real.rank_peak_bytes)} worst {worst:.4f}% ({seconds:.1f} s)",
        flush=True,
    )
    return rows


def _layouts(case: Case, quick: bool) -> list[tuple[str, str, dict[str, Any]]]:
    """(layout label, mode, settings) of every run of ``case``."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for tp in case.tp[:1] if quick else case.tp:
        for plan_label, plan in case.plans.items():
            settings: dict[str, Any] = {"gpus": tp, "tp": tp}
            if plan is not None:
                settings["tp_plan"] = plan()
            for mode in MODES:
                out.append((f"tp={tp} {plan_label}", mode, settings))
    if case.dp_tp:  # the ranks as a 2-D mesh (dp_shard, tp), as torchtitan lays them out
        for plan_label, plan in case.plans.items():
            settings = {"gpus": 4, "tp": 2, "strategy": "zero3"}
            if plan is not None:
                settings["tp_plan"] = plan()
            out.append((f"dp_shard=2 zero3 x tp=2 {plan_label}", "train", settings))
            # with checkpointing: the root's post-backward redistributes a replicated
            # gradient of a tensor-parallel weight before it reshards
            out.append((f"dp_shard=2 zero3 x tp=2 {plan_label} checkpoint", "train",
                        {**settings, "checkpoint": "auto"}))  # fmt: skip
            # hsdp: a 3-D mesh (dp_replicate, dp_shard, tp) of 2 nodes of 4 GPUs
            settings = {"gpus": 8, "tp": 2, "strategy": "hsdp", "gpus_per_node": 4}
            if plan is not None:
                settings["tp_plan"] = plan()
            out.append((f"dp_replicate=2 x dp_shard=2 hsdp x tp=2 {plan_label}", "train",
                        settings))  # fmt: skip
            # one tp group a node: dp_shard=1, torchtitan 0.3.0's replicate degree alone
            settings = {"gpus": 4, "tp": 2, "strategy": "hsdp", "gpus_per_node": 2}
            if plan is not None:
                settings["tp_plan"] = plan()
            out.append((f"dp_replicate=2 x dp_shard=1 hsdp x tp=2 {plan_label}", "train",
                        settings))  # fmt: skip
    for ep in case.ep:
        for mode in MODES:
            out.append((f"ep={ep} balanced router", mode, {"gpus": ep, "ep": ep}))
    if case.pp:
        for schedule in SCHEDULES[:1] if quick else SCHEDULES:
            for m in MICROBATCHES[:1] if quick else MICROBATCHES:
                settings = {"gpus": 2, "pp": 2, "pp_schedule": schedule, "microbatches": m}
                out.append((f"pp=2 {schedule} m={m}", "train", settings))
    if case.dp_pp:  # the ranks as a 2-D mesh (pp, dp_shard), pp outer, as torchtitan's
        for strategy in STAGE_STRATEGIES:
            for schedule in SCHEDULES:
                settings = {"gpus": 4, "pp": 2, "strategy": strategy, "pp_schedule": schedule,
                            "microbatches": 2}  # fmt: skip
                out.append((f"dp_shard=2 {strategy} x pp=2 {schedule} m=2", "train", settings))
        # hsdp: a 3-D mesh (pp, dp_replicate, dp_shard), nodes of 2 GPUs
        for schedule in SCHEDULES[:2]:
            settings = {"gpus": 8, "pp": 2, "strategy": "hsdp", "gpus_per_node": 2,
                        "pp_schedule": schedule, "microbatches": 2}  # fmt: skip
            out.append((f"dp_replicate=2 x dp_shard=2 hsdp x pp=2 {schedule} m=2", "train",
                        settings))  # fmt: skip
    if case.tp_pp:  # the ranks as a 2-D mesh (pp, tp), pp outer, as torchtitan's
        for schedule in SCHEDULES[:1] if quick else SCHEDULES:
            settings = {"gpus": 4, "pp": 2, "tp": 2, "pp_schedule": schedule, "microbatches": 2}
            out.append((f"pp=2 {schedule} m=2 x tp=2 own plan", "train", settings))
    if case.dp_pp and case.tp_pp:  # a 3-D mesh (pp, dp_shard, tp), as torchtitan's
        for strategy in STAGE_STRATEGIES:
            for schedule in SCHEDULES:
                settings = {"gpus": 8, "pp": 2, "tp": 2, "strategy": strategy,
                            "pp_schedule": schedule, "microbatches": 2}  # fmt: skip
                out.append((f"dp_shard=2 {strategy} x pp=2 {schedule} m=2 x tp=2 own plan",
                            "train", settings))  # fmt: skip
    return out


QUICK_CASES = ("hf_llama", "mlp_block")


def run(
    quick: bool, only: list[str] | None = None, layouts: list[str] | None = None
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for label, case in CASES.items():
        if (quick and label not in QUICK_CASES) or (only and label not in only):
            continue
        torch.manual_seed(0)
        model = case.build()
        profile = profile_model(
            model, inputs=case.make(PROFILE_BATCH), loss_fn=case.loss_fn, device="cpu"
        )
        for layout, mode, settings in _layouts(case, quick):
            if layouts and not any(part in layout for part in layouts):
                continue
            for precision in PRECISIONS[:1] if quick else PRECISIONS:
                rows += compare(label, layout, profile, model, case.make, precision, mode,
                                settings, case.loss_fn)  # fmt: skip
    return rows


def _bytes(values: list[int]) -> str:
    """One number where the ranks agree, else each rank's."""
    return f"{values[0]:,}" if len(set(values)) == 1 else " / ".join(f"{v:,}" for v in values)


def summarize(rows: list[dict[str, Any]]) -> str:
    measured = [r for r in rows if "refused" not in r]
    lines = [
        "| model | layout | precision | step | estimate per rank (B) | measured per rank (B) "
        "| ratio per rank |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    runs = dict.fromkeys((r["model"], r["layout"], r["precision"], r["mode"]) for r in measured)
    for run_key in runs:
        sel = [
            r for r in measured if (r["model"], r["layout"], r["precision"], r["mode"]) == run_key
        ]
        ratios = [f"{r['ratio']:.4f}" for r in sel]
        lines.append(
            "| " + " | ".join(run_key) + f" | {_bytes([r['estimated'] for r in sel])} | "
            f"{_bytes([r['measured'] for r in sel])} | "
            f"{ratios[0] if len(set(ratios)) == 1 else ', '.join(ratios)} |"
        )
    errs = [abs(r["error_pct"]) for r in measured]
    median, worst = statistics.median(errs), max(errs)
    verdict = "met" if median <= TARGET_MEDIAN_PCT and worst <= TARGET_WORST_PCT else "NOT met"
    lines += [
        "",
        f"{len(measured)} ranks compared: median |ratio - 1| {median:.4f} %, worst "
        f"{worst:.4f} % (targets: median <= {TARGET_MEDIAN_PCT} %, worst <= "
        f"{TARGET_WORST_PCT} %: {verdict}). Measured basis: the {BASIS}.",
    ]
    refused: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if "refused" in r:
            layouts = refused.setdefault((r["model"], r["refused"]), [])
            layouts += [] if r["layout"] in layouts else [r["layout"]]
    if refused:
        lines += ["", "Refused by the estimate, each with its reason, before any profiling:", ""]
        lines += [f"- {m}, {', '.join(ls)}: {reason}" for (m, reason), ls in refused.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a handful of rows (fp32, tp=2, "
                        "GPipe with 2 micro-batches; Llama and the MLP block)")  # fmt: skip
    parser.add_argument("--models", nargs="+", choices=list(CASES), help="these models' rows "
                        "only (written to results/accuracy_parallel_selected.json)")  # fmt: skip
    parser.add_argument("--layouts", nargs="+", metavar="TEXT", help="the layouts whose "
                        "label holds one of these only, e.g. interleaved (written to "
                        "results/accuracy_parallel_selected.json)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = run(args.quick, args.models, args.layouts)
    name = "accuracy_parallel_quick" if args.quick else "accuracy_parallel"
    if args.models or args.layouts:
        name = "accuracy_parallel_selected"
    extra = {"basis": BASIS, "batch_size": BATCH, "profile_batch_size": PROFILE_BATCH}
    write_results(name, rows, summarize(rows), started, extra)


if __name__ == "__main__":
    main()
