"""The ``torch.compile`` step: the estimate against the measured step on the CPU (Inductor).

For each model, compile scope, batch size, precision and ``activation_memory_budget``,
AdamW (scope ``"model"``: ``compile=True``, the whole model; ``"blocks"``:
``compile="blocks"``, each repeated block, for the models that have them):

* compiled: ``measure(compile=True)``, Inductor's generated code, measured;
* graphs: the same partitioned forward and backward graphs run node by node
  (``_profiling/compiled_graphs.py``: Inductor's passes and partitioner, eager ATen kernels);
* estimate: ``profile_model(...).estimate(compile=True, activation_memory_budget=...)``
  (``_profiling/compiled_profile.py``: Inductor's generated code for the graphs, recorded on
  fake tensors; ``estimate_bound`` says where a graph ran node by node instead: an upper
  bound);

and the saved bytes: measured (bytes left by the forward less its outputs), the partitioner's
saved set read from the measured step's graphs, and the estimate's ``saved_bytes`` less the
model's outputs that the partitioner saves (``saved_outputs_bytes``: a causal LM's logits and
KV cache where the budget keeps them; ``measure`` counts them as output). The saved set on
fake tensors alone (``compiled_fake.fake_saved_set``) is checked in tests/test_compile.py.

Models: the zoo's MLP and ``nn.TransformerEncoder`` classifier (32 tokens), the Hugging Face
``BertModel``, GPT-2 and Llama tiny configs of ``_hf.py`` (16 tokens), at batch 1 and 4, fp32
and bf16; the zoo's ResNet-18 (64 x 64 images) at batch 4, fp32 (``SHAPES``); budgets 1.0,
0.5, 0.2 and 0.1. The budget decides what
the partitioner recomputes, and a smaller budget can give a larger peak (recomputation's
temporaries in the backward): for each model, batch and precision the summary says whether
the estimate orders the budgets' peaks as the measured step does, and which rows have a
larger measured peak than a larger budget's.

``--merge`` keeps the recorded rows of the settings not run now, so the grid can be run a
few models at a time.

    python benchmarks/accuracy_compile.py                # the full grid
    python benchmarks/accuracy_compile.py --quick        # the MLP and Llama, batch 4, fp32
    python benchmarks/accuracy_compile.py --models mlp --budgets 1.0
    python benchmarks/accuracy_compile.py --models llama --scopes blocks --merge

Targets: the estimated peak equal to the measured one (Inductor's CPU buffer plan, run on
fake tensors), the saved set to the byte. Writes ``results/accuracy_compile.json``;
``report.py`` renders it into docs/accuracy.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import _hf
import torch
from _results import RESULTS, write_results
from torch import nn

from vram_widget import ModelProfile, profile_model, zoo
from vram_widget._profiling.compiled_graphs import GraphCapture, captured_graphs
from vram_widget._profiling.measure import measure

BATCHES = (1, 4)
PRECISIONS = ("fp32", "bf16")
BUDGETS = (1.0, 0.5, 0.2, 0.1)
# compile=True (the whole model) and compile="blocks" (each repeated block, as torchtitan
# and torchtune compile per layer)
SCOPES = ("model", "blocks")
# Compiled whole only: models with no repeated blocks (the MLP's layers differ; ResNet-18's
# stages change width), and the TransformerEncoder, whose blocks are torch's own
# nn.TransformerEncoderLayer: compiled on its own, dynamo compiles no frame of it and
# compile="blocks" is refused with dynamo's reason (tests/test_compile.py)
SCOPES_OF: dict[str, tuple[str, ...]] = {
    "mlp": ("model",), "resnet18": ("model",), "transformer_encoder": ("model",),
}  # fmt: skip
# ResNet-18's compiled step compiles about 2 minutes of C++ kernels per setting on 2 cores:
# batch 4 in fp32 only
SHAPES: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {"resnet18": ((4,), ("fp32",))}


def _ids(batch: int, tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(batch * 1000 + tokens)
    return torch.randint(0, _hf.VOCAB, (batch, tokens), generator=gen)


def _images(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(batch))


# model -> (build, batch of that size)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any]]] = {
    "mlp": (
        zoo.mlp,
        lambda b: torch.randn(b, 784, generator=torch.Generator().manual_seed(b)),
    ),
    "transformer_encoder": (zoo.transformer_encoder, lambda b: _ids(b, 32)),
    "bert": (_hf.bert_encoder, lambda b: {"input_ids": _ids(b, 16)}),
    "gpt2": (_hf.gpt2, _hf.tokens),
    "llama": (_hf.llama, _hf.tokens),
    "resnet18": (zoo.resnet18, _images),
}


def saved_outputs_bytes(capture: GraphCapture) -> int:
    """The bytes of the model's outputs that the backward keeps, in the measured step:
    saved by the partitioner (a causal LM's logits and KV cache, where the budget keeps
    them rather than recomputing them) or by the eager code between compiled regions
    (with ``compile="blocks"``: BERT's pooler keeps its output, tanh's result, and its
    input, a view of the last hidden state). ``measure``'s saved bytes leave the outputs
    out; the estimate's ``saved_bytes`` count the kept ones."""
    unique: dict[Any, int] = {}
    for call in capture.forward_calls:
        unique.update(call.saved())
    outputs = capture.model_outputs - capture.model_inputs
    kept = sum(nbytes for key, nbytes in unique.items() if key in outputs)
    eager = outputs & capture.eager_saved - set(unique)
    return kept + sum(capture.model_output_bytes[key] for key in eager)


def _row(name: str, model: nn.Module, profile: ModelProfile, inputs: Any, batch: int,
         precision: str, budget: float, scope: str) -> dict[str, Any]:  # fmt: skip
    start = time.perf_counter()
    compile_ = True if scope == "model" else scope
    settings: dict[str, Any] = {
        "optimizer": "adamw", "precision": precision, "compile": compile_,
        "activation_memory_budget": budget,
    }  # fmt: skip
    compiled = measure(model, inputs, **settings)
    with captured_graphs() as capture:
        graphs = measure(model, inputs, **settings)
    est = profile.estimate(
        batch, precision, "adamw", compile=compile_, activation_memory_budget=budget
    )
    saved_outputs = saved_outputs_bytes(capture)
    est_saved = (est.saved_bytes or 0) - saved_outputs
    return {
        "model": name,
        "batch": batch,
        "precision": precision,
        "budget": budget,
        "scope": scope,
        "compiled_peak_bytes": compiled.peak_bytes,
        "graphs_peak_bytes": graphs.peak_bytes,
        "estimated_peak_bytes": est.peak_bytes,
        "peak_ratio": est.peak_bytes / compiled.peak_bytes,
        "peak_exact": est.peak_bytes == compiled.peak_bytes,
        "estimate_bound": est.compile_bound,
        "compile_fallbacks": list(est.compile_fallbacks),
        "compiled_saved_bytes": compiled.saved_bytes,
        "partitioner_saved_bytes": capture.saved_bytes(),
        "saved_outputs_bytes": saved_outputs,
        "estimated_saved_bytes": est_saved,
        "saved_exact": est_saved == compiled.saved_bytes,
        "regions": len(capture.regions),
        "seconds": time.perf_counter() - start,
    }


def _scope(row: dict[str, Any]) -> str:
    """The row's compile scope: ``"model"`` (``compile=True``) or ``"blocks"``."""
    return str(row.get("scope", "model"))


def _key(row: dict[str, Any]) -> tuple[str, str, int, str, float]:
    return (row["model"], _scope(row), row["batch"], row["precision"], row["budget"])


def _sign(x: int) -> int:
    return (x > 0) - (x < 0)


def budget_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, batch and precision: whether the estimate orders the budgets' peaks as the
    measured compiled step does (every pair of budgets: the same one larger, or both equal),
    and the budgets whose measured peak is larger than a larger budget's (the peak not
    monotonic in the budget)."""
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], _scope(r), r["batch"], r["precision"]), []).append(r)
    found = []
    for (model, scope, batch, precision), these in groups.items():
        these = sorted(these, key=lambda r: -r["budget"])
        pairs = [(a, b) for i, a in enumerate(these) for b in these[i + 1 :]]
        same = all(
            _sign(a["estimated_peak_bytes"] - b["estimated_peak_bytes"])
            == _sign(a["compiled_peak_bytes"] - b["compiled_peak_bytes"])
            for a, b in pairs
        )
        rising = [
            b["budget"] for a, b in pairs if b["compiled_peak_bytes"] > a["compiled_peak_bytes"]
        ]
        found.append(
            {
                "model": model, "scope": scope, "batch": batch, "precision": precision,
                "budgets": [r["budget"] for r in these], "same_order": same,
                "non_monotonic_budgets": sorted(set(rising), reverse=True),
            }
        )  # fmt: skip
    return found


def _median_worst(values: list[float]) -> str:
    return f"{statistics.median(values):.4f} % / {max(values):.4f} %" if values else "-"


def summarize(rows: list[dict[str, Any]]) -> str:
    orders = budget_order(rows)
    rising = {
        (o["model"], o["scope"], o["batch"], o["precision"], b)
        for o in orders
        for b in o["non_monotonic_budgets"]
    }
    lines = [
        "| model | compiled | batch | precision | budget | compiled peak | graphs peak | estimate "
        "| estimate / compiled | compiled saved | estimated saved | peak above a larger "
        "budget's |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        bound = " (bound)" if r["estimate_bound"] else ""
        above = _key(r) in rising
        lines.append(
            f"| {r['model']} | {_scope(r)} | {r['batch']} | {r['precision']} | {r['budget']} "
            f"| {r['compiled_peak_bytes']:,} | {r['graphs_peak_bytes']:,} "
            f"| {r['estimated_peak_bytes']:,} | {r['peak_ratio']:.4f}{bound} "
            f"| {r['compiled_saved_bytes']:,} | {r['estimated_saved_bytes']:,} "
            f"| {'yes' if above else ''} |"
        )
    errors = [abs(r["peak_ratio"] - 1) * 100 for r in rows]
    exact = sum(r["peak_exact"] for r in rows)
    saved = sum(r["saved_exact"] for r in rows)
    bound = sum(r["estimate_bound"] for r in rows)
    same = [o for o in orders if o["same_order"]]
    lines += [
        "",
        f"Peak to the byte in {exact} of {len(rows)} configurations; abs(estimate / "
        f"compiled - 1) median / worst {_median_worst(errors)}; saved set to the byte in "
        f"{saved} of {len(rows)}; {bound} estimate(s) an upper bound (a graph run node by "
        "node).",
        "",
        f"Across budgets: the estimate orders the budgets' peaks as the measured step does "
        f"in {len(same)} of {len(orders)} model / compile scope / batch / precision groups.",
    ]
    non_monotonic = [o for o in orders if o["non_monotonic_budgets"]]
    if non_monotonic:
        lines.append(
            "The measured peak is not monotonic in the budget (a smaller budget, a larger "
            "peak) in: "
            + "; ".join(
                f"{o['model']} ({o['scope']}) batch {o['batch']} {o['precision']} (budget "
                f"{', '.join(map(str, o['non_monotonic_budgets']))}, "
                f"{'ordered as measured' if o['same_order'] else 'NOT ordered as measured'})"
                for o in non_monotonic
            )
            + "."
        )
    else:
        lines.append("The measured peak is monotonic in the budget in every group.")
    differ = [o for o in orders if not o["same_order"]]
    if differ:
        lines.append(
            "Ordered otherwise than measured: "
            + "; ".join(
                f"{o['model']} ({o['scope']}) batch {o['batch']} {o['precision']}" for o in differ
            )
            + "."
        )
    return "\n".join(lines)


def _merged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recorded rows of ``results/accuracy_compile.json`` with ``rows`` in place of
    those of the same model, scope, batch, precision and budget, in the grid's order."""
    path = RESULTS / "accuracy_compile.json"
    kept = json.loads(path.read_text())["rows"] if path.exists() else []
    new = {_key(r): r for r in rows}
    merged = [new.pop(_key(r), r) for r in kept] + list(new.values())
    order = {name: i for i, name in enumerate(MODELS)}
    return sorted(
        merged,
        key=lambda r: (order[r["model"]], _scope(r) != "model", r["batch"],
                       PRECISIONS.index(r["precision"]), -r["budget"]),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the MLP and Llama, batch 4, fp32")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--scopes", default=",".join(SCOPES), help="model, blocks")
    parser.add_argument(
        "--merge", action="store_true",
        help="keep the recorded rows of settings not run now (the results file's other rows)",
    )  # fmt: skip
    args = parser.parse_args()
    models = ["mlp", "llama"] if args.quick else args.models.split(",")
    batches = (4,) if args.quick else tuple(int(b) for b in args.batches.split(","))
    precisions = ("fp32",) if args.quick else tuple(args.precisions.split(","))
    budgets = tuple(float(b) for b in args.budgets.split(","))
    scopes = ("model",) if args.quick else tuple(args.scopes.split(","))
    unknown = [m for m in models if m not in MODELS]
    if (
        unknown
        or any(p not in PRECISIONS for p in precisions)
        or any(s not in SCOPES for s in scopes)
    ):
        parser.error(
            f"--models from {', '.join(MODELS)}; --precisions from fp32, bf16; "
            "--scopes from model, blocks"
        )
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in models:
        build, make_inputs = MODELS[name]
        torch.manual_seed(0)
        model = build()
        model_batches, model_precisions = SHAPES.get(name, (batches, precisions))
        for scope in (s for s in scopes if s in SCOPES_OF.get(name, SCOPES)):
            for batch in (b for b in batches if b in model_batches):
                inputs = make_inputs(batch)
                profile = profile_model(model, inputs=inputs, device="cpu", cache=False)
                for precision in (p for p in precisions if p in model_precisions):
                    for budget in budgets:
                        rows.append(
                            _row(name, model, profile, inputs, batch, precision, budget, scope)
                        )
                        r = rows[-1]
                        print(
                            f"{name:20s} {scope:6s} B={batch} {precision:5s} "
                            f"budget={budget:<4} compiled={r['compiled_peak_bytes']:>12,} "
                            f"est={r['estimated_peak_bytes']:>12,} ratio={r['peak_ratio']:.4f} "
                            f"saved={'exact' if r['saved_exact'] else 'DIFFERS'} "
                            f"{r['seconds']:.0f} s",
                            flush=True,
                        )
            # each model's rows written as they are done; the grid named at the end
            out = _merged(rows) if args.merge else rows
            extra = {"grid": "partial", "budget_order": budget_order(out)}
            write_results("accuracy_compile", out, summarize(out), started, extra=extra)
    out = _merged(rows) if args.merge else rows
    grid = "quick" if args.quick else ("merged" if args.merge else "full")
    extra = {"grid": grid, "budget_order": budget_order(out)}
    write_results("accuracy_compile", out, summarize(out), started, extra=extra)


if __name__ == "__main__":
    main()
