"""The quickstart in Jupyter Notebook 7 (headless Chromium): Run All, no cell error, every
widget renders and the Plotly figure has its traces, no request leaves loopback; the widget
answers first (the headline, landed at rest), shows its control tabs with "Step" selected, and
a control chosen by a click in another tab (the optimizer, in "Optimizer") redraws the figure
and the summary.

Slider key presses are tested in JupyterLab (test_jupyterlab.py) only: in Notebook 7.6 under
playwright, a key press or drag on any ipywidgets slider (a bare ``FloatLogSlider`` too) after
Run All leaves its value unchanged, because focus returns to the active cell. That is a harness
limit to work out, not this widget's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from .lab import (
    JS_PLOTS,
    JS_WIDGET_STATE,
    BlockedRequests,
    CellReport,
    chromium_page,
    lab_server,
    open_and_run_all,
    require,
    screenshot_widget,
    set_optimizer,
    wait_at_rest,
)
from .test_jupyterlab import ARTIFACTS, NOTEBOOK

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]


@dataclass
class Session:
    report: CellReport
    blocked: BlockedRequests
    plots: list[dict[str, Any]]
    widget: dict[str, Any] | None
    optimizer_after: dict[str, Any] | None
    optimizer_error: str | None


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    require("notebook")
    workdir = tmp_path_factory.mktemp("notebook7")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with (
        lab_server(workdir, front_end="notebook") as server,
        chromium_page(workdir) as (page, blocked),
    ):
        try:
            report = open_and_run_all(page, server, NOTEBOOK, timeout_s=300)
            plots = page.evaluate(JS_PLOTS)
            with contextlib.suppress(Exception):  # a missing widget: the tests say so
                wait_at_rest(page)
            widget = page.evaluate(JS_WIDGET_STATE)
            optimizer_after, optimizer_error = None, None
            try:  # a click on the "Optimizer" tab, then SGD chosen in its dropdown
                optimizer_after = set_optimizer(page, "sgd")
            except Exception as exc:  # reported by the optimizer test, not here
                optimizer_error = f"{type(exc).__name__}: {exc}"
        finally:
            screenshot_widget(page, ARTIFACTS / "quickstart_notebook7.png")
        yield Session(report, blocked, plots, widget, optimizer_after, optimizer_error)


def test_no_request_left_loopback(session: Session) -> None:
    assert session.blocked.urls == []


def test_every_cell_ran_and_every_widget_rendered(session: Session) -> None:
    report = session.report
    assert report.errors == [], "\n\n".join(report.errors)
    assert report.widget_outputs >= 1
    assert report.display_errors == 0
    assert report.stuck_loading == 0


def test_plotly_figure_drawn_with_traces(session: Session) -> None:
    assert any(p["visible"] and p["traces"] > 0 and p["points"] > 0 for p in session.plots)
    assert session.widget is not None, "the MemoryWidget's figure was not found"
    assert session.widget["traces"] >= 2
    assert "peak" in session.widget["summary"].lower()


def test_answer_first_and_control_tabs(session: Session) -> None:
    assert session.widget is not None
    assert session.widget["tabs"] == ["Step", "Optimizer", "Memory levers", "GPUs"]
    assert session.widget["tab"] == "Step"
    headline = session.widget["headline"]
    assert "fit" in headline and "largest batch" in headline, headline
    assert "…" not in headline  # at rest: every number landed


def test_a_control_in_another_tab_redraws(session: Session) -> None:
    assert session.optimizer_error is None, session.optimizer_error
    before, after = session.widget, session.optimizer_after
    assert before is not None and after is not None
    assert after["tab"] == "Optimizer"
    assert "optimizer adam" in before["summary"] and "optimizer sgd" in after["summary"]
    assert after["fingerprint"] != before["fingerprint"]
