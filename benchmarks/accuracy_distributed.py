"""Accuracy of one data-parallel rank's estimate against real torch.distributed runs.

The estimate comes from the single-device profile (``device="cpu"``):
``profile.estimate(batch, precision, "adamw", gpus=N, strategy=...)``. The truth is
``measure(..., gpus=N, strategy=...)``: N processes forked on this machine, one gloo process
group on 127.0.0.1, each wrapping its copy of the model as the strategy's library does
(``DistributedDataParallel`` with its defaults for
``"ddp"``; ``ZeroRedundancyOptimizer`` around AdamW for ``"zero1"``; FSDP2's ``fully_shard`` on each
repeated block and the root for ``"zero2"`` / ``"zero3"``, and on a 2-D mesh of 2 nodes x
2 GPUs for ``"hsdp"``) and measuring its own steady
steps from the CPU allocator's events (the median of three). Every rank is compared with
its own estimate (``estimate(..., rank=r)``: ZeRO's ranks hold different shards), and the
default estimate (the worst rank) with the worst measured rank.

Models: the zoo's MLP, ResNet-18 (3 x 64 x 64), TransformerEncoder, causal decoder, tiny Llama
and LSTM, and small Hugging Face GPT-2, Llama, BERT and T5 configs (no download, 16 tokens);
2 and 4 ranks x fp32 and bf16 (and amp-bf16 under FSDP2, with its MixedPrecisionPolicy;
not on ResNet-18, whose BatchNorm torch cannot run with bf16 weights and fp32 statistics),
batch 3 per rank, AdamW. Then the memory levers under each
strategy (Hugging Face's checkpointing, a frozen backbone, accumulation of 2, PEFT's LoRA
rank 4) on GPT-2 and Llama
at 2 ranks. Profiles and ranks compute on one
thread (the forked ranks must, and CPU kernel scratch can depend on the thread count).

    python benchmarks/accuracy_distributed.py      # about 5 minutes on 2 cores

Targets: per-rank median <= 0.5 %, worst <= 3 %. Writes
results/accuracy_distributed.json and prints a markdown
summary (benchmarks/report.py writes it into docs/).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import _hf
import torch
from _results import write_results
from torch import nn

from vram_widget import measure, profile_model, zoo

BATCH = 3
WORLDS = (2, 4)
PRECISIONS = ("fp32", "bf16")
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def _zoo(name: str) -> tuple[Callable[[], nn.Module], Callable[[int], Any]]:
    entry = zoo.ZOO[name]
    return entry.build, entry.make_inputs


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any]]] = {
    **{name: _zoo(name) for name in ("mlp", "resnet18", "transformer_encoder",
                                     "causal_decoder", "llama_tiny", "lstm")},
    "hf_gpt2": (_hf.gpt2, _hf.tokens),
    "hf_llama": (_hf.llama, _hf.tokens),
    "hf_bert": (_hf.bert, _hf.classify),
    "hf_t5": (_hf.t5, _hf.tokens),
}  # fmt: skip


# the memory levers under each strategy, on the Hugging Face decoders (2 ranks); the head
# patterns as in accuracy_levers.py (GPT-2's lm_head is tied to its embedding)
HEADS = {"hf_gpt2": ["transformer.ln_f.*"], "hf_llama": ["lm_head.*", "model.norm.*"]}


def _levers(name: str) -> dict[str, dict[str, Any]]:
    return {
        "checkpoint auto": {"checkpoint": "auto"},
        "frozen backbone": {"trainable": HEADS[name]},
        "accumulation x2": {"grad_accumulation": 2},
        "LoRA r=4": {"lora_rank": 4},
    }


def _precisions(name: str, strategy: str) -> tuple[str, ...]:
    """fp32 and bf16; for FSDP2 also amp-bf16, its MixedPrecisionPolicy (bf16 parameters,
    fp32 reduction), but not on BatchNorm models: torch's batch_norm refuses bf16 weights
    with fp32 running statistics, so that run cannot be measured."""
    if strategy in ("zero2", "zero3", "hsdp") and name not in NO_MIXED_POLICY:
        return (*PRECISIONS, "amp-bf16")
    return PRECISIONS


NO_MIXED_POLICY = {"resnet18"}


def compare_ranks(
    label: str,
    profile: Any,
    model: nn.Module,
    make: Callable[[int], Any],
    strategy: str,
    precision: str,
    world: int,
    levers: dict[str, Any],
) -> list[dict[str, Any]]:
    """One real run of ``world`` ranks; a row per rank, against that rank's estimate."""
    settings = {"gpus": world, "strategy": strategy, **levers}
    worst_est = profile.estimate(BATCH, precision, "adamw", **settings)
    t0 = time.perf_counter()
    real = measure(model, make(BATCH), optimizer="adamw", precision=precision, timeout_s=300,
                   **settings)  # fmt: skip
    seconds = time.perf_counter() - t0
    rows = []
    for rank, peak in enumerate(real.rank_peak_bytes):
        est = profile.estimate(BATCH, precision, "adamw", rank=rank, **settings)
        rows.append(
            {
                "model": label,
                "strategy": strategy,
                "precision": precision,
                "gpus": world,
                "rank": rank,
                "estimated": est.peak_bytes,
                "measured": peak,
                "error_pct": (est.peak_bytes - peak) / peak * 100,
                "worst_estimated": worst_est.peak_bytes,
                "worst_measured": real.peak_bytes,
                "communication_bytes": est.communication_bytes,
                "optimizer_state_bytes": est.optimizer_state_bytes,
                "measure_s": seconds,
            }
        )
    worst = max(abs(r["error_pct"]) for r in rows)
    print(
        f"{label:28s} {strategy:5s} {precision:5s} N={world} worst est="
        f"{worst_est.peak_bytes:>12,} ranks={list(real.rank_peak_bytes)} worst rank "
        f"{worst:.4f}% ({seconds:.1f} s)",
        flush=True,
    )
    return rows


def run() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, (build, make) in CASES.items():
        torch.manual_seed(0)
        model = build()
        profile = profile_model(model, inputs=make(2), device="cpu")
        for strategy in STRATEGIES:
            for precision in _precisions(name, strategy):
                for world in WORLDS:
                    rows += compare_ranks(name, profile, model, make, strategy, precision,
                                          world, {})  # fmt: skip
        for precision in _precisions(name, "hsdp"):  # HSDP: 2 nodes of 2 GPUs
            rows += compare_ranks(name, profile, model, make, "hsdp", precision, 4,
                                  {"gpus_per_node": 2})  # fmt: skip
    for name in HEADS:
        build, make = CASES[name]
        torch.manual_seed(0)
        model = build()
        profile = profile_model(model, inputs=make(2), device="cpu")
        for lever, levers in _levers(name).items():
            for strategy in STRATEGIES:
                for precision in PRECISIONS:
                    rows += compare_ranks(f"{name} + {lever}", profile, model, make, strategy,
                                          precision, 2, levers)  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]]) -> str:
    def worst_rank_error(sel: list[dict[str, Any]]) -> float:
        """The largest |error| of the default estimate (the worst rank) against the worst
        measured rank, over the runs in ``sel``."""
        return max(
            abs(r["worst_estimated"] - r["worst_measured"]) / r["worst_measured"] * 100 for r in sel
        )

    lines = [
        "| model | strategy | ranks compared | median | worst | default estimate (worst "
        "rank) vs worst measured rank, worst |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name in dict.fromkeys(r["model"] for r in rows):
        for strategy in dict.fromkeys(r["strategy"] for r in rows):
            sel = [r for r in rows if r["model"] == name and r["strategy"] == strategy]
            if not sel:  # FSDP2 with a lever it does not model: not run
                continue
            errs = [abs(r["error_pct"]) for r in sel]
            lines.append(
                f"| {name} | {strategy} | {len(sel)} | {statistics.median(errs):.4f} % | "
                f"{max(errs):.4f} % | {worst_rank_error(sel):.4f} % |"
            )
    errs = [abs(r["error_pct"]) for r in rows]
    lines.append(
        f"| **all** | | {len(rows)} | {statistics.median(errs):.4f} % | {max(errs):.4f} % | "
        f"{worst_rank_error(rows):.4f} % |"
    )
    return "\n".join(lines)


def main() -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = run()
    write_results("accuracy_distributed", rows, summarize(rows), started)


if __name__ == "__main__":
    main()
