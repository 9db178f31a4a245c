"""On a real CUDA GPU: where a step's allocations differ from the prediction, module by module.

For the settings of ``benchmarks/accuracy_cuda.py`` (or those named with ``--only``), the
step is measured with ``measure(..., snapshot=True)`` (the caching allocator's history over
the measured iteration) and compared with the estimate's predicted snapshot by
``MemoryEstimate.compare_snapshot``: the allocations paired in order and summed per module
and phase, largest differences first. ResNet-50 is also run with cuDNN off
(``torch.backends.cudnn.enabled = False``), which tells the convolution workspaces cuDNN
allocates through the caching allocator apart from the rest.

    python benchmarks/compare_cuda_snapshots.py --out-dir benchmarks/results/snapshots

Writes one CSV per setting (the comparison table) and ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy_cuda import SETTINGS, _clear, _to, real_loop

from vram_widget import profile_model
from vram_widget._profiling.measure import measure

ROWS = 25  # the largest differences kept per setting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results" / "snapshots"))
    parser.add_argument("--only", default="", help="comma-separated indices into SETTINGS")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda", 0)
    capability = torch.cuda.get_device_capability(device)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    picked = {int(i) for i in args.only.split(",") if i} or set(range(len(SETTINGS)))
    summary: list[dict[str, Any]] = []
    for index, setting in enumerate(SETTINGS):
        if index not in picked:
            continue
        name, build, example, make, batch_size, precision, optimizer, mode, _ = setting
        row: dict[str, Any] = {"index": index, "model": name, "batch_size": batch_size}
        row.update(precision=precision, optimizer=optimizer, mode=mode)
        try:
            batch = make(batch_size)
            seq_len = batch["input_ids"].shape[1] if isinstance(batch, dict) else None
            with torch.device("meta"):
                meta_model = build()
            profile = profile_model(meta_model, inputs=example, device="cuda", precisions=())
            est = profile.estimate(
                batch_size,
                precision=precision,
                optimizer=optimizer,
                mode=mode,
                seq_len=seq_len,
                compute_capability=capability,
            )
            torch.manual_seed(0)
            model = build().to(device)
            _clear(device)
            measured = measure(
                model,
                _to(batch, device, None),
                optimizer=optimizer,
                precision=precision,
                mode=mode,
                snapshot=True,
            )
            assert measured.snapshot is not None
            table = est.compare_snapshot(measured.snapshot)
            stem = f"{index}_{name}_{mode}_{precision}_b{batch_size}"
            table.head(ROWS).to_csv(out / f"{stem}.csv", index=False)
            row["note"] = table.attrs.get("note", "")
            row["estimated_peak_bytes"] = est.peak_bytes
            row["measured_peak_bytes"] = measured.peak_bytes
            row["top"] = table.head(8).to_dict("records")
            del model
            _clear(device)
            if name == "resnet50":  # the same loop with cuDNN off
                cpu_model = build()
                storage = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
                if storage is not None:
                    cpu_model.to(storage)
                torch.backends.cudnn.enabled = False
                try:
                    plain = real_loop(cpu_model, batch, precision, optimizer, mode, device)
                finally:
                    torch.backends.cudnn.enabled = True
                row["cudnn_off_real"] = plain
                row["cudnn_off_ratio_allocated"] = (
                    est.peak_bytes + est.extras.cublas_workspace_bytes
                ) / plain["allocated_peak_bytes"]
        except Exception as exc:  # one setting's failure is recorded, the rest go on
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc()[-3000:]
        summary.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}, default=str))
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
