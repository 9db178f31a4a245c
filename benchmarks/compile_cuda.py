"""``torch.compile``'s step on a real CUDA GPU beside the eager one (Inductor with Triton).

A GPT-2 small (SDPA) and a small grouped-query Llama (the models of ``levers_cuda.py``), bf16,
AdamW, batch 4 x 512 tokens, each measured by ``measure()`` (allocated peak,
``torch.cuda.max_memory_allocated()`` over the second of two steps):

* eager, and its estimate from ``profile_model(device="cuda")`` of the plain model;
* ``compile=True`` and ``compile="blocks"``, the default ``activation_memory_budget`` and 0.5;
* the partitioned graphs of ``compile=True`` run node by node
  (``_profiling/compiled_graphs.py``: Inductor's passes and partitioner, eager kernels), with
  the partitioner's saved set read from them.

The saved set is the partitioner's decision on the CUDA graph (flash or memory-efficient
attention where the CPU runs the math kernel); the gap between the graphs' peak and the
compiled peak is what Triton's fused kernels and Inductor's buffer reuse save on the GPU.

    python3 benchmarks/compile_cuda.py --out benchmarks/results/compile_cuda.json
    python3 benchmarks/compile_cuda.py --estimate   # any machine: each row's estimate

``--estimate`` writes beside each measured row the estimate of its setting from
``profile_model(device="cuda")`` of the plain model built on the meta device, at compute
capability 9.0 (the H200's): the compiled settings' estimates run Inductor's CPU code plan
on the fake tensors, since a CPU cannot generate Triton's.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from levers_cuda import _models, _tokens

from vram_widget import profile_model
from vram_widget._profiling.compiled_graphs import captured_graphs
from vram_widget._profiling.measure import measure

SETTINGS: dict[str, dict[str, Any]] = {
    "eager": {},
    "compile model": {"compile": True},
    "compile model, budget 0.5": {"compile": True, "activation_memory_budget": 0.5},
    "compile blocks": {"compile": "blocks"},
}


def _estimate(out: Path) -> None:
    data = json.loads(out.read_text())
    capability = (9, 0)  # the H200 the rows were measured on
    for name, model in _models().items():
        with torch.device("meta"):
            meta = type(model)(model.config)
        profile = profile_model(meta, inputs=_tokens(2, 128), device="cuda", precisions=())
        for row in data["rows"]:
            if row["model"] != name:
                continue
            row.pop("estimate_error", None)
            try:
                est = profile.estimate(
                    4, "bf16", "adamw", seq_len=512, compute_capability=capability,
                    **SETTINGS[row["setting"]],
                )  # fmt: skip
                row["estimated_bytes"] = est.peak_bytes
                row["estimated_saved_bytes"] = est.saved_bytes
            except Exception as exc:  # not estimated: said in the row
                row["estimate_error"] = f"{type(exc).__name__}: {exc}"[:600]
            print(json.dumps(row), flush=True)
    out.write_text(json.dumps(data, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "compile_cuda.json")
    )
    parser.add_argument(
        "--estimate", action="store_true", help="estimate the measured rows (any machine)"
    )
    args = parser.parse_args()
    if args.estimate:
        _estimate(Path(args.out))
        return
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda", 0)
    capability = torch.cuda.get_device_capability(device)
    info = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    batch = _tokens(4, 512)
    for name, model in _models().items():
        with torch.device("meta"):
            meta = type(model)(model.config)
        profile = profile_model(meta, inputs=_tokens(2, 128), device="cuda", precisions=())
        eager_est = profile.estimate(
            4, "bf16", "adamw", seq_len=512, compute_capability=capability
        ).peak_bytes
        model.to(device)
        inputs = {k: v.to(device) for k, v in batch.items()}
        for setting, kwargs in SETTINGS.items():
            row: dict[str, Any] = {"model": name, "setting": setting}
            try:
                real = measure(model, inputs, optimizer="adamw", precision="bf16", **kwargs)
                row["measured_bytes"] = real.peak_bytes
                if setting == "eager":
                    row["estimated_bytes"] = eager_est
                if setting == "compile model":
                    torch.cuda.empty_cache()
                    with captured_graphs() as capture:
                        graphs = measure(
                            model, inputs, optimizer="adamw", precision="bf16", **kwargs
                        )
                    row["graphs_measured_bytes"] = graphs.peak_bytes
                    row["partitioner_saved_bytes"] = capture.saved_bytes()
            except Exception as exc:  # one setting's failure is recorded, the rest go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:600]
                row["traceback"] = traceback.format_exc()[-1500:]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
            out.write_text(json.dumps({**info, "rows": rows}, indent=1))  # kept as it goes
            torch.cuda.empty_cache()
        model.cpu()


if __name__ == "__main__":
    main()
