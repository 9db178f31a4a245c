"""The quickstart notebook in a real JupyterLab, in headless Chromium: Run All, the widget
renders, a batch-size slider move redraws the figure and the summary.

Run alone with ``python -m pytest -m browser``. Needs ``/usr/bin/chromium`` (Debian's package,
installed by ``scripts/install.sh``), ``playwright`` and ``jupyterlab``. Where they are absent
the test is skipped, except under CI (``CI=true``), where that is a failure: a green CI must not
hide a browser test that never ran. Artifacts (screenshot, latencies, server log) go to
``$VRAM_WIDGET_ARTIFACTS`` or ``build/browser-artifacts``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .lab import (
    JS_PLOTS,
    JS_WIDGET_STATE,
    REPO,
    BlockedRequests,
    CellReport,
    SliderRun,
    chromium_page,
    lab_server,
    move_batch_slider,
    open_and_run_all,
    require,
    screenshot_widget,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

NOTEBOOK = "quickstart.ipynb"
SLIDER_MOVES = 8
ARTIFACTS = Path(os.environ.get("VRAM_WIDGET_ARTIFACTS", REPO / "build" / "browser-artifacts"))


@dataclass
class Session:
    report: CellReport
    blocked: BlockedRequests
    plots: list[dict[str, Any]]
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    slider: SliderRun | None
    slider_error: str | None


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    require()
    workdir = tmp_path_factory.mktemp("lab")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with lab_server(workdir) as server, chromium_page(workdir) as (page, blocked):
        try:
            report = open_and_run_all(page, server, NOTEBOOK, timeout_s=300)
            plots = page.evaluate(JS_PLOTS)
            before = page.evaluate(JS_WIDGET_STATE)
            slider, slider_error = None, None
            try:
                slider = move_batch_slider(page, SLIDER_MOVES)
                # One more move right, so the final state differs from the first.
                slider.latencies_ms.extend(move_batch_slider(page, 1).latencies_ms)
            except Exception as exc:  # reported by the slider test, not here
                slider_error = f"{type(exc).__name__}: {exc}"
            page.wait_for_timeout(500)
            after = page.evaluate(JS_WIDGET_STATE)
        finally:
            screenshot_widget(page, ARTIFACTS / "quickstart.png")
            (ARTIFACTS / "jupyterlab.log").write_text(server.log_tail(200_000))
        (ARTIFACTS / "slider_latency.json").write_text(
            json.dumps(
                {
                    "notebook": NOTEBOOK,
                    "latencies_ms": slider.latencies_ms if slider else [],
                    "median_ms": slider.median_ms if slider else None,
                },
                indent=1,
            )
        )
        yield Session(report, blocked, plots, before, after, slider, slider_error)


def test_no_request_left_loopback(session: Session) -> None:
    # The widget, plotly.js and JupyterLab all come from the local server and kernel.
    assert session.blocked.urls == []


def test_every_cell_ran_without_error(session: Session) -> None:
    assert session.report.errors == [], "\n\n".join(session.report.errors)


def test_every_widget_rendered(session: Session) -> None:
    report = session.report
    # The quickstart shows one MemoryWidget (more when torchvision/transformers are present).
    assert report.widget_outputs >= 1
    assert report.display_errors == 0, "'Error displaying widget' on the page"
    assert report.stuck_loading == 0, "a widget output still says 'Loading widget...'"


def test_plotly_figure_drawn_with_traces(session: Session) -> None:
    drawn = [p for p in session.plots if p["visible"] and p["traces"] > 0 and p["points"] > 0]
    assert drawn, f"no visible plotly figure with data: {session.plots}"
    assert session.before is not None, "the MemoryWidget's figure was not found"
    assert session.before["traces"] >= 2  # waterfall and FLOPs panels at least


def test_slider_move_redraws_figure_and_summary(session: Session) -> None:
    assert session.slider_error is None, session.slider_error
    assert session.slider is not None and session.before and session.after
    assert len(session.slider.latencies_ms) == SLIDER_MOVES + 1
    assert session.after["fingerprint"] != session.before["fingerprint"]
    assert session.after["summary"] != session.before["summary"]
    assert session.after["slider"] != session.before["slider"]
