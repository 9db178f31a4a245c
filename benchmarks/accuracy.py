"""Accuracy: estimated peak (``device="cpu"``) vs the measured peak of a real CPU step.

For each zoo model: one ``profile_model`` call, then every configuration (batch x mode x
optimizer x precision) is estimated from that one cached profile and measured with
``measure()`` (the CPU allocator's events, as the PyTorch profiler records them).

    python benchmarks/accuracy.py                 # the full table (about 15 minutes, 2 cores)
    python benchmarks/accuracy.py --quick         # a smaller matrix
    python benchmarks/accuracy.py --models mlp,resnet18 --out results/x.json

The CPU's instruction set decides which kernels run (oneDNN's bf16 paths need avx512_bf16 or
AMX; ATen's vectorized kernels follow its CPU capability), and the estimate probes the real
kernels, so it must be exact under any of them. To check one narrower than the machine's:

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/accuracy.py --quick \
        --out benchmarks/results/accuracy_quick_avx2.json

The JSON records the ISA it ran under (``isa``).

Writes a JSON file of every row and prints a markdown summary (benchmarks/report.py writes it
into docs/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop chatter

import numpy as np
import torch

from vram_widget import profile_model, zoo
from vram_widget._profiling.measure import measure

MODELS = (
    "vgg16",
    "alexnet",
    "resnet18",
    "resnet50",
    "mobilenet_v2",
    "mlp",
    "transformer_encoder",
    "causal_decoder",
    "lstm",
    "embedding_heavy",
    "tied_autoencoder",
    "dict_input",
)
BATCHES = (1, 8, 32)
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adagrad", "rmsprop", None)
PRECISIONS = ("fp32", "bf16", "amp-bf16")


def cpu_isa() -> dict[str, object]:
    """The instruction set the step's kernels ran with: ATen's CPU capability, the cap on
    oneDNN's ISA if one was set, and the CPU's own bf16 / AMX flags (Linux)."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "(native)"),
        "cpu_flags": sorted(f for f in flags if f in _ISA_FLAGS),
    }


_ISA_FLAGS = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"})


def run(
    models: list[str],
    batches: tuple[int, ...],
    optimizers: tuple[str | None, ...],
    precisions: tuple[str, ...],
    device: str = "cpu",
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name in models:
        entry = zoo.ZOO[name]
        model = entry.build().to(device)
        t0 = time.perf_counter()
        profile = profile_model(model, inputs=entry.make_inputs(2), device=device)
        profile_s = time.perf_counter() - t0
        for batch in batches:
            inputs = entry.make_inputs(batch)
            for mode in ("train", "inference"):
                for opt in optimizers if mode == "train" else (None,):
                    for precision in precisions:
                        t1 = time.perf_counter()
                        est = profile.estimate(batch, precision, opt, mode)
                        estimate_ms = (time.perf_counter() - t1) * 1e3
                        try:
                            real = measure(
                                model, inputs, optimizer=opt, precision=precision, mode=mode
                            )
                        except Exception as exc:  # a kernel the CPU lacks for this dtype
                            print(
                                f"skip {name} {batch} {mode} {opt} {precision}: {exc}",
                                file=sys.stderr,
                            )
                            continue
                        # On CUDA, max_memory_allocated counts 512-byte blocks: compare the
                        # estimate with its rounding extra (measure() excludes the cuBLAS
                        # workspace by warming it up before its baseline).
                        estimated = est.peak_bytes + est.extras.allocator_rounding_bytes
                        err = (estimated - real.peak_bytes) / real.peak_bytes * 100
                        rows.append(
                            {
                                "model": name,
                                "batch": batch,
                                "mode": mode,
                                "optimizer": opt,
                                "precision": precision,
                                "estimated": estimated,
                                "measured": real.peak_bytes,
                                "error_pct": err,
                                "peak_phase": str(est.peak_phase),
                                "peak_module": est.peak_module,
                                "profile_s": profile_s,
                                "estimate_ms": estimate_ms,
                            }
                        )
                        print(
                            f"{name:20s} B={batch:<3d} {mode:9s} {opt!s:12s} {precision:8s} "
                            f"est={estimated:>14,} meas={real.peak_bytes:>14,} "
                            f"err={err:+7.3f}%",
                            flush=True,
                        )
    return rows


def summarize(rows: list[dict[str, object]]) -> str:
    lines = [
        "| mode | configurations | median abs error | 90th percentile | worst |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode in ("train", "inference"):
        errs = [abs(float(r["error_pct"])) for r in rows if r["mode"] == mode]  # type: ignore[arg-type]
        if not errs:
            continue
        lines.append(
            f"| {mode} | {len(errs)} | {statistics.median(errs):.3f} % | "
            f"{float(np.percentile(errs, 90)):.3f} % | {max(errs):.3f} % |"
        )
    lines += [
        "",
        "| model | train median | train worst | inference median | inference worst | profile (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in dict.fromkeys(str(r["model"]) for r in rows):
        cells = []
        for mode in ("train", "inference"):
            errs = [
                abs(float(r["error_pct"]))  # type: ignore[arg-type]
                for r in rows
                if r["model"] == name and r["mode"] == mode
            ]
            cells += (
                [f"{statistics.median(errs):.3f} %", f"{max(errs):.3f} %"] if errs else ["-", "-"]
            )
        profile_s = next(float(r["profile_s"]) for r in rows if r["model"] == name)  # type: ignore[arg-type]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {profile_s:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="batches 1 and 8, optimizers sgd and adam, fp32 and bf16",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: estimate with device='cuda' and measure torch.cuda.max_memory_allocated()",
    )
    parser.add_argument("--out", default=None, help="default: results/accuracy_<device>.json")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    if args.out is None:
        args.out = str(Path(__file__).parent / "results" / f"accuracy_{args.device}.json")
    torch.manual_seed(0)
    batches: tuple[int, ...] = BATCHES
    optimizers: tuple[str | None, ...] = OPTIMIZERS
    precisions: tuple[str, ...] = PRECISIONS
    if args.quick:
        batches, optimizers, precisions = (1, 8), ("sgd", "adam", None), ("fp32", "bf16")
    t0 = time.perf_counter()
    rows = run(args.models.split(","), batches, optimizers, precisions, args.device)
    summary = summarize(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "isa": cpu_isa(),
                "seconds": time.perf_counter() - t0,
                "rows": rows,
                "summary": summary,
            },
            indent=1,
        )
    )
    print()
    print(summary)
    print(f"\n{len(rows)} configurations in {time.perf_counter() - t0:.0f} s; rows in {out}")


if __name__ == "__main__":
    main()
