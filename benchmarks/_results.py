"""What the accuracy sweeps share: writing their rows and summary to results/ and saying so."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import transformers

RESULTS = Path(__file__).parent / "results"


def write_results(
    name: str,
    rows: list[dict[str, Any]],
    summary: str,
    started: float,
    extra: dict[str, Any] | None = None,
) -> Path:
    """``results/<name>.json`` with the versions, the CPU count, the seconds since
    ``started`` (``time.perf_counter()``), ``extra``'s fields (other versions, the grid
    that ran), the rows and the markdown summary; prints the summary and where the rows
    went."""
    out = RESULTS / f"{name}.json"
    seconds = time.perf_counter() - started
    out.write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "cpus": os.cpu_count(),
                "seconds": seconds,
                **(extra or {}),
                "rows": rows,
                "summary": summary,
            },
            indent=1,
        )
    )
    print()
    print(summary)
    print(f"\n{len(rows)} configurations in {seconds:.0f} s; rows in {out}")
    return out
