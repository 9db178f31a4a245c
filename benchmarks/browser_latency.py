"""Browser latency: batch-size slider key press -> redrawn Plotly figure, in a real JupyterLab.

    python benchmarks/browser_latency.py [--moves 20]

Starts JupyterLab on loopback, opens ``notebooks/quickstart.ipynb`` in headless Chromium
(Debian's ``/usr/bin/chromium``), runs every cell, then presses the arrow keys on the widget's
batch-size slider. Each latency is the time from the keydown to the first animation frame in
which the figure's data had changed (the kernel's recompute, the comm round trip and plotly's
redraw, all included). The target is <= 100 ms median. The harness is the browser test's
(``tests/browser/lab.py``). Results go to ``benchmarks/results/browser_latency.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser.lab import (  # noqa: E402
    chromium_page,
    lab_server,
    missing_requirements,
    move_batch_slider,
    open_and_run_all,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moves", type=int, default=20)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "browser_latency.json"
    )
    args = parser.parse_args()
    missing = missing_requirements()
    if missing:
        raise SystemExit("needs " + ", ".join(missing))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        with lab_server(workdir) as server, chromium_page(workdir) as (page, blocked):
            report = open_and_run_all(page, server, "quickstart.ipynb", timeout_s=300)
            if report.errors:
                raise SystemExit("notebook failed:\n" + "\n".join(report.errors))
            page.wait_for_timeout(1000)
            run = move_batch_slider(page, args.moves)
    latencies = sorted(run.latencies_ms)
    result = {
        "notebook": "quickstart.ipynb (ResNet-18 at 3x64x64, device='cuda')",
        "cpus": os.cpu_count(),
        "moves": args.moves,
        "latencies_ms": run.latencies_ms,
        "median_ms": statistics.median(latencies),
        "p90_ms": latencies[int(0.9 * (len(latencies) - 1))],
        "blocked_requests": blocked.urls,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "latencies_ms"}, indent=1))


if __name__ == "__main__":
    main()
