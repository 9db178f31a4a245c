"""Regenerate docs/assets/widget.png: the quickstart's first widget, as JupyterLab draws it.

    python3 scripts/screenshot.py [--out docs/assets/widget.png]

Runs notebooks/quickstart.ipynb in a real JupyterLab on 127.0.0.1, driven in Debian's headless
Chromium through Playwright, with the same harness as the browser test
(tests/browser/lab.py: no request leaves loopback, the server is stopped by its PID), then
saves a screenshot of the first MemoryWidget's output (ResNet-18 at 3 x 64 x 64, batch 64,
bf16, as the notebook leaves it), with Lab's left sidebar collapsed so the widget has the
page's width. It refuses to save a layout whose figure is narrower than the widget's tabs
(a figure that did not follow the width). Needs the test extras and the ``chromium`` package.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from browser.lab import (  # noqa: E402
    chromium_page,
    lab_server,
    missing_requirements,
    open_and_run_all,
)

# The first widget's output area: found from its batch-size slider's label, as the browser
# test finds it (tests/browser/lab.py, screenshot_widget).
_JS_MARK_WIDGET = """() => {
  const l = Array.from(document.querySelectorAll('.widget-slider .widget-label'))
    .find(e => e.textContent.trim() === 'batch size');
  if (!l) return false;
  const out = l.closest('.jp-OutputArea-output');
  out.setAttribute('data-vram-screenshot', '1');
  out.scrollIntoView({block: 'start'});
  return true;
}"""

# The widths of the marked widget's control tabs and its first figure (CSS pixels).
_JS_WIDTHS = """() => {
  const out = document.querySelector("[data-vram-screenshot='1']");
  const tabs = out.querySelector('.jupyter-widget-Tab, .widget-tab');
  const svg = out.querySelector('.js-plotly-plot .main-svg');
  return {tabs: tabs ? tabs.getBoundingClientRect().width : 0,
          figure: svg ? svg.getBoundingClientRect().width : 0};
}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "assets" / "widget.png")
    parser.add_argument("--width", type=int, default=1200, help="browser width in pixels")
    args = parser.parse_args()
    missing = missing_requirements()
    if missing:
        raise SystemExit("cannot run JupyterLab in Chromium: " + "; ".join(missing))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        with lab_server(workdir) as server, chromium_page(workdir) as (page, blocked):
            page.set_viewport_size({"width": args.width, "height": 1800})
            # the file browser closed before the cells run: the widget and its figure are
            # drawn at the page's width
            report = open_and_run_all(
                page, server, "quickstart.ipynb", timeout_s=600, collapse_left=True
            )
            if report.errors or report.display_errors or report.stuck_loading:
                raise SystemExit(f"the quickstart did not run cleanly: {report}")
            if blocked.urls:
                raise SystemExit(f"requests left loopback: {blocked.urls}")
            if not page.evaluate(_JS_MARK_WIDGET):
                raise SystemExit("no widget with a 'batch size' slider on the page")
            page.wait_for_timeout(500)
            widths = page.evaluate(_JS_WIDTHS)
            # the figure spans the output as the tabs do (a few pixels of margin either way)
            if widths["figure"] < widths["tabs"] - 40:
                raise SystemExit(f"the figure is narrower than the widget's tabs: {widths}")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.locator("[data-vram-screenshot='1']").screenshot(path=str(args.out))
    print(f"{args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
