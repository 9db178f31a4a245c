"""The ``torch.compile`` step against the eager one, measured on the CPU (default Inductor).

For each model, precision and ``activation_memory_budget``, three measured AdamW steps
(``measure``, batch 4):

* eager: the plain step;
* compiled: ``measure(compile=True)``, Inductor's generated code;
* graphs: the same partitioned forward and backward graphs run node by node
  (``_profiling/compiled_graphs.py``: Inductor's passes and partitioner, eager ATen kernels).

and the saved bytes of each: measured (bytes left by the forward less its outputs) and, for
the graphs, the partitioner's saved set read from the graphs, in the measured step and on
fake tensors (``_profiling/compiled_fake.py``: no real memory, no kernel compiled). The
saved set is the partitioner's decision, so ``graph saved`` should equal ``compiled saved``
to the byte; the peak differs by the temporaries inside each compiled region (Inductor
fuses pointwise ops and reuses buffers; eager kernels materialize each intermediate).

    python benchmarks/accuracy_compile.py                        # about 5 minutes on 2 cores
    python benchmarks/accuracy_compile.py --models mlp --budgets 1.0
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
from torch import nn

from vram_widget import zoo
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,transformer_encoder,gpt2,llama")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--budgets", default="1.0,0.5,0.1")
    args = parser.parse_args()
    models = _models()
    budgets = [float(b) for b in args.budgets.split(",")]
    print(
        "| model | precision | budget | eager peak | compiled peak | graphs peak "
        "| eager saved | compiled saved | graph saved (partitioner) | graphs measured saved "
        "| fake graph saved |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        build, batch = models[name]
        torch.manual_seed(0)
        model, inputs = build(), batch()
        for precision in args.precisions.split(","):
            eager = measure(model, inputs, optimizer="adamw", precision=precision)
            for budget in budgets:
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
                fake = fake_saved_set(
                    model, inputs, precision=precision, activation_memory_budget=budget
                )
                print(
                    f"| {name} | {precision} | {budget} | {eager.peak_bytes:,} "
                    f"| {compiled.peak_bytes:,} | {graphs.peak_bytes:,} "
                    f"| {eager.saved_bytes:,} | {compiled.saved_bytes:,} "
                    f"| {capture.saved_bytes():,} | {graphs.saved_bytes:,} "
                    f"| {fake.saved_bytes:,} |  <!-- "
                    f"{len(capture.regions)} regions, {time.perf_counter() - start:.0f} s -->",
                    flush=True,
                )


if __name__ == "__main__":
    main()
