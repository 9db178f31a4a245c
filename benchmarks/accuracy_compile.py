"""The ``torch.compile`` step: the estimate against the measured step on the CPU (Inductor).

For each model, precision and ``activation_memory_budget``, AdamW, batch 4:

* eager: the plain step, measured;
* compiled: ``measure(compile=True)``, Inductor's generated code;
* graphs: the same partitioned forward and backward graphs run node by node
  (``_profiling/compiled_graphs.py``: Inductor's passes and partitioner, eager ATen kernels);
* estimate: ``profile_model(...).estimate(compile=True, activation_memory_budget=...)``
  (``_profiling/compiled_profile.py``: Inductor's generated code for the graphs, recorded on
  fake tensors).

and the saved bytes: measured (bytes left by the forward less its outputs), the partitioner's
saved set read from the graphs (in the measured step and on fake tensors), and the
estimate's ``saved_bytes`` less the saved outputs (a causal LM's logits, which its loss
saves and ``measure`` counts as output). The saved set is the partitioner's decision, so
they should agree to the byte; the estimated peak is Inductor's buffer plan run on fake
tensors (``estimate_bound`` says where a graph ran node by node instead: an upper bound).

    python benchmarks/accuracy_compile.py                        # about 10 minutes on 2 cores
    python benchmarks/accuracy_compile.py --models mlp --budgets 1.0

Writes ``results/accuracy_compile.json``; ``report.py`` renders it into docs/accuracy.md.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import _hf
import torch
from _results import write_results
from torch import nn

from vram_widget import profile_model, zoo
from vram_widget._profiling.compiled_fake import fake_saved_set
from vram_widget._profiling.compiled_graphs import captured_graphs
from vram_widget._profiling.measure import measure

BATCH = 4


def _models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], Any]]]:
    gen = torch.Generator().manual_seed(0)
    return {
        "mlp": (lambda: zoo.mlp(), lambda: torch.randn(BATCH, 784, generator=gen)),
        "transformer_encoder": (
            lambda: zoo.transformer_encoder(),
            lambda: torch.randint(0, 1000, (BATCH, 32), generator=gen),
        ),
        "gpt2": (_hf.gpt2, lambda: _hf.tokens(BATCH)),
        "llama": (_hf.llama, lambda: _hf.tokens(BATCH)),
    }


def _saved_outputs(name: str, inputs: Any, precision: str) -> int:
    """The bytes of the model's outputs that its loss saves: a causal LM's logits (batch x
    tokens x vocabulary, fp32 logits in fp32, bf16 in bf16; 0 for the zoo models)."""
    if name not in ("gpt2", "llama"):
        return 0
    batch, tokens = inputs["input_ids"].shape
    return batch * tokens * _hf.VOCAB * (4 if precision == "fp32" else 2)


def _row(name: str, model: nn.Module, inputs: Any, precision: str, budget: float) -> dict[str, Any]:
    start = time.perf_counter()
    compiled = measure(
        model, inputs, optimizer="adamw", precision=precision, compile=True,
        activation_memory_budget=budget,
    )  # fmt: skip
    with captured_graphs() as capture:
        graphs = measure(
            model, inputs, optimizer="adamw", precision=precision, compile=True,
            activation_memory_budget=budget,
        )  # fmt: skip
    fake = fake_saved_set(model, inputs, precision=precision, activation_memory_budget=budget)
    profile = profile_model(model, inputs=inputs, device="cpu", cache=False)
    est = profile.estimate(BATCH, precision, "adamw", compile=True, activation_memory_budget=budget)
    est_saved = (est.saved_bytes or 0) - _saved_outputs(name, inputs, precision)
    return {
        "model": name,
        "precision": precision,
        "budget": budget,
        "compiled_peak_bytes": compiled.peak_bytes,
        "graphs_peak_bytes": graphs.peak_bytes,
        "estimated_peak_bytes": est.peak_bytes,
        "peak_ratio": est.peak_bytes / compiled.peak_bytes,
        "estimate_bound": est.compile_bound,
        "compiled_saved_bytes": compiled.saved_bytes,
        "partitioner_saved_bytes": capture.saved_bytes(),
        "fake_saved_bytes": fake.saved_bytes,
        "estimated_saved_bytes": est_saved,
        "saved_exact": est_saved == compiled.saved_bytes,
        "regions": len(capture.regions),
        "seconds": time.perf_counter() - start,
    }


def _summary(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | precision | budget | compiled peak | graphs peak | estimate | estimate / "
        "compiled | compiled saved | estimated saved |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['budget']} "
            f"| {r['compiled_peak_bytes']:,} | {r['graphs_peak_bytes']:,} "
            f"| {r['estimated_peak_bytes']:,} | {r['peak_ratio']:.3f} "
            f"| {r['compiled_saved_bytes']:,} | {r['estimated_saved_bytes']:,} |"
        )
    exact = sum(r["saved_exact"] for r in rows)
    lines.append("")
    lines.append(f"Saved set to the byte in {exact} of {len(rows)} configurations.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,transformer_encoder,gpt2,llama")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--budgets", default="1.0,0.5,0.1")
    args = parser.parse_args()
    started = time.perf_counter()
    models = _models()
    rows = []
    for name in args.models.split(","):
        build, batch = models[name]
        torch.manual_seed(0)
        model, inputs = build(), batch()
        for precision in args.precisions.split(","):
            for budget in (float(b) for b in args.budgets.split(",")):
                rows.append(_row(name, model, inputs, precision, budget))
                print({k: v for k, v in rows[-1].items()}, flush=True)
    write_results("accuracy_compile", rows, _summary(rows), started)


if __name__ == "__main__":
    main()
