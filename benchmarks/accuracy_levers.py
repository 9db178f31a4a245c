"""Accuracy of the memory levers: each estimated from the *plain* model's profile
(``device="cpu"``) and measured on a real CPU step with the lever applied by the real library.

Truth, per lever:

* activation checkpointing: Hugging Face's own ``activation_checkpointing_enable``
  (``use_reentrant=False``) on GPT-2, Llama and BERT (``checkpoint="auto"``); torch's
  ``checkpoint_wrapper`` (``CheckpointImpl.NO_REENTRANT``, as torchtitan wraps blocks) around
  each stage of the zoo ResNet-50 (``checkpoint=["layer1", ..., "layer4"]``);
* a frozen backbone: ``requires_grad_(False)`` on every parameter but the head's
  (``trainable=<head patterns>``);
* selective activation checkpointing (``checkpoint_policy``) around the same blocks:
  torchtitan's op-level policy (``"op"``), every 2nd block (``2``) and a callable that saves
  every matmul's output, each by ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
  (non-reentrant) on the measured copy, as ``_profiling/checkpoint_policy.py`` applies it;
* gradient accumulation of 4: four forward and backward passes, then one AdamW step;
* LoRA: PEFT's own ``get_peft_model(model, LoraConfig(r=8, target_modules=...))`` on the
  measured copy (PEFT's default targets for the Hugging Face models; every ``conv1``,
  ``conv2``, ``conv3`` of ResNet-50, the case of PEFT issue 2196), against the estimate from
  the plain profile, where PEFT wraps a meta copy;
* the chunked output and loss (``loss_chunks=k``): the real model's body, its output
  projection on k chunks of the sequence and torchtune's own ``CEWithChunkedOutputLoss``
  (loaded from its file) on GPT-2, Llama and Qwen2, k = 4 and 8, at the profile's 16 tokens
  and at 64 (reached through the sequence axis).

Each at batch 1 and 8, in fp32 and bf16, AdamW. Small Hugging Face configs (no download),
16 tokens; ResNet-50 at 3 x 64 x 64.

    python benchmarks/accuracy_levers.py                  # about 2 minutes on 2 cores
    python benchmarks/accuracy_levers.py --chunked-only   # the chunked-loss rows alone
    python benchmarks/accuracy_levers.py --policies       # the checkpoint policies only

Targets: train median <= 0.1 %, worst <= 2 %. Writes results/accuracy_levers.json
(``--policies``: results/accuracy_levers_policies.json) and prints a markdown summary
(benchmarks/report.py writes it into docs/).
"""

from __future__ import annotations

import argparse
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
from torch.utils.checkpoint import CheckpointPolicy

from vram_widget import profile_model, zoo
from vram_widget._profiling.measure import measure

BATCHES = (1, 8)
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A callable checkpoint policy: keep every matmul's output, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


POLICIES: dict[str, object] = {"op": "op", "every 2nd": 2, "callable": save_matmuls}
PRECISIONS = ("fp32", "bf16")


def _images(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(batch))


# name -> (build, batch maker, checkpoint lever, trainable head patterns, LoRA targets)
CASES: dict[
    str, tuple[Callable[[], nn.Module], Callable[[int], Any], object, list[str], object]
] = {
    "gpt2": (_hf.gpt2, _hf.tokens, "auto", ["transformer.ln_f.*"], "auto"),
    "llama": (_hf.llama, _hf.tokens, "auto", ["lm_head.*", "model.norm.*"], "auto"),
    "bert": (_hf.bert, _hf.classify, "auto", ["classifier.*", "bert.pooler.*"], "auto"),
    "resnet50": (
        zoo.resnet50,
        _images,
        ["layer1", "layer2", "layer3", "layer4"],
        ["fc.*"],
        ["conv1", "conv2", "conv3"],
    ),
}


# the chunked output and loss: causal LMs, chunk counts and sequence lengths (16: the
# profile's example; 64: through the sequence axis)
CHUNKED_MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": _hf.gpt2,
    "llama": _hf.llama,
    "qwen2": _hf.qwen2,
}
CHUNKS = (4, 8)
CHUNKED_LENGTHS = (16, 64)


def _tokens(batch: int, seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch * 1000 + seq)
    ids = torch.randint(0, _hf.VOCAB, (batch, seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _row(name: str, lever: str, precision: str, batch: int, est: Any, real: Any,
         estimate_s: float) -> dict[str, Any]:  # fmt: skip
    err = (est.peak_bytes - real.peak_bytes) / real.peak_bytes * 100
    print(
        f"{name:9s} {lever:16s} {precision:5s} B={batch} "
        f"est={est.peak_bytes:>12,} meas={real.peak_bytes:>12,} err={err:+7.3f}%",
        flush=True,
    )
    return {
        "model": name,
        "lever": lever,
        "precision": precision,
        "batch": batch,
        "estimated": est.peak_bytes,
        "measured": real.peak_bytes,
        "error_pct": err,
        "flops": est.flops,
        "first_estimate_s": estimate_s,
    }


def run_chunked() -> list[dict[str, Any]]:
    """The chunked output and loss, estimated from each plain profile (16 tokens) and
    measured on the real step with torchtune's loss."""
    rows: list[dict[str, Any]] = []
    for name, build in CHUNKED_MODELS.items():
        torch.manual_seed(0)
        model = build()
        profile = profile_model(model, inputs=_tokens(2, 16), device="cpu")
        for k in CHUNKS:
            for seq in CHUNKED_LENGTHS:
                for precision in PRECISIONS:
                    for batch in BATCHES:
                        t0 = time.perf_counter()
                        est = profile.estimate(batch, precision, "adamw", seq_len=seq,
                                               loss_chunks=k)  # fmt: skip
                        estimate_s = time.perf_counter() - t0
                        real = measure(model, _tokens(batch, seq), optimizer="adamw",
                                       precision=precision, loss_chunks=k)  # fmt: skip
                        lever = f"loss chunks {k}, T={seq}"
                        rows.append(_row(name, lever, precision, batch, est, real, estimate_s))
    return rows


def run(policies_only: bool = False) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, (build, make, checkpoint, head, lora_targets) in CASES.items():
        torch.manual_seed(0)
        model = build()
        profile = profile_model(model, inputs=make(2), device="cpu")
        levers: dict[str, dict[str, Any]] = {
            "checkpoint": {"checkpoint": checkpoint},
            "frozen backbone": {"trainable": head},
            "accumulation x4": {"grad_accumulation": 4},
            "LoRA r=8": {"lora_rank": 8, "lora_targets": lora_targets},
        }
        if policies_only:
            levers = {}
        for label, policy in POLICIES.items():
            levers[f"policy {label}"] = {"checkpoint": checkpoint, "checkpoint_policy": policy}
        for lever, kwargs in levers.items():
            for precision in PRECISIONS:
                for batch in BATCHES:
                    t0 = time.perf_counter()
                    est = profile.estimate(batch, precision, "adamw", **kwargs)
                    estimate_s = time.perf_counter() - t0
                    real = measure(model, make(batch), optimizer="adamw", precision=precision,
                                   **kwargs)  # fmt: skip
                    rows.append(_row(name, lever, precision, batch, est, real, estimate_s))
    return rows


def summarize(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | lever | median | worst |", "|---|---|---:|---:|"]
    for name in dict.fromkeys(r["model"] for r in rows):
        for lever in dict.fromkeys(r["lever"] for r in rows):
            errs = [abs(r["error_pct"]) for r in rows if r["model"] == name and r["lever"] == lever]
            if errs:
                lines.append(
                    f"| {name} | {lever} | {statistics.median(errs):.3f} % | {max(errs):.3f} % |"
                )
    errs = [abs(r["error_pct"]) for r in rows]
    lines.append(
        f"| **all** ({len(rows)} configurations) | | {statistics.median(errs):.3f} % | "
        f"{max(errs):.3f} % |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--chunked-only",
        action="store_true",
        help="run the chunked-loss configurations alone (printed; results/ is left as it is)",
    )
    parser.add_argument(
        "--policies",
        action="store_true",
        help="run the checkpoint policies alone (results/accuracy_levers_policies.json)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    if args.chunked_only:
        rows = run_chunked()
        print()
        print(summarize(rows))
        print(f"\n{len(rows)} configurations in {time.perf_counter() - started:.0f} s")
        return
    if args.policies:
        rows = run(policies_only=True)
        write_results("accuracy_levers_policies", rows, summarize(rows), started)
        return
    rows = run() + run_chunked()
    write_results("accuracy_levers", rows, summarize(rows), started)


if __name__ == "__main__":
    main()
