"""The quickstart notebook in a real JupyterLab, in headless Chromium: Run All, the widget
renders, a batch-size slider move redraws the figure and the summary; on the widget of a
model with a sequence axis (the quickstart's BERT), a sequence-length move does too, and the
batch x sequence-length panel opens onto its frontier, whose marker follows the length. Each
control tab is selected in turn (its controls are hidden until then) and a control in it moved:
the optimizer (Optimizer), the micro-batches (Memory levers) and the GPUs (GPUs) each redraw the
figure and change the summary; the Display section's group depth redraws the figure; and on
the GPT-2 widget in generate mode, the new tokens redraw that widget.

Run alone with ``python -m pytest -m browser``. Needs ``/usr/bin/chromium`` (Debian's package,
installed by ``scripts/install.sh``), ``playwright`` and ``jupyterlab``. Where they are absent
the test is skipped, except under CI (``CI=true``), where that is a failure: a green CI must not
hide a browser test that never ran. Artifacts (screenshot, latencies, server log) go to
``$VRAM_WIDGET_ARTIFACTS`` or ``build/browser-artifacts``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .lab import (
    JS_FRONTIER_STATE,
    JS_PLOTS,
    JS_WIDGET_STATE,
    REPO,
    BlockedRequests,
    CellReport,
    SliderRun,
    chromium_page,
    js_widget_state,
    lab_server,
    move_batch_slider,
    move_slider,
    open_and_run_all,
    open_display,
    open_frontier,
    press_slider_key,
    require,
    screenshot_widget,
    set_gpus,
    set_micro_batches,
    set_new_tokens,
    set_optimizer,
    wait_at_rest,
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
    seq_before: dict[str, Any] | None
    seq_after: dict[str, Any] | None
    seq_slider: SliderRun | None
    frontier: dict[str, Any] | None
    frontier_after_move: dict[str, Any] | None
    seq_error: str | None
    optimizer_before: dict[str, Any] | None
    optimizer_after: dict[str, Any] | None
    optimizer_error: str | None
    levers_after: dict[str, Any] | None
    levers_error: str | None
    gpus_after: dict[str, Any] | None
    gpus_error: str | None
    display_before: dict[str, Any] | None
    display_after: dict[str, Any] | None
    display_error: str | None
    generation_before: dict[str, Any] | None
    generation_after: dict[str, Any] | None
    generation_error: str | None


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    require()
    workdir = tmp_path_factory.mktemp("lab")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with lab_server(workdir) as server, chromium_page(workdir) as (page, blocked):
        try:
            report = open_and_run_all(page, server, NOTEBOOK, timeout_s=300)
            plots = page.evaluate(JS_PLOTS)
            with contextlib.suppress(Exception):  # a missing widget: the tests say so
                wait_at_rest(page)
            before = page.evaluate(JS_WIDGET_STATE)
            slider, slider_error = None, None
            try:
                slider = move_batch_slider(page, SLIDER_MOVES)
                # One more move right, so the final state differs from the first.
                slider.latencies_ms.extend(move_batch_slider(page, 1).latencies_ms)
            except Exception as exc:  # reported by the slider test, not here
                slider_error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):  # the slider test says why
                wait_at_rest(page)
            after = page.evaluate(JS_WIDGET_STATE)
            seq_state = js_widget_state("sequence length")
            seq_before = page.evaluate(seq_state)
            seq_slider = frontier = frontier_after_move = seq_after = None
            seq_error = None
            try:
                # The first other length fits the profile in the length (a few fake runs):
                # a longer wait than a batch move.
                frontier = open_frontier(page)
                seq_slider = move_slider(page, 1, "sequence length", timeout_s=120)
                seq_after = wait_at_rest(page, seq_state, timeout_s=120)
                frontier_after_move = page.evaluate(JS_FRONTIER_STATE)
            except Exception as exc:  # reported by the sequence test, not here
                seq_error = f"{type(exc).__name__}: {exc}"
            # Each tab of the first widget in turn (a tab's controls are hidden until it is
            # selected): the Optimizer tab, SGD in place of Adam (one more profiling run)
            optimizer_before = page.evaluate(JS_WIDGET_STATE)
            optimizer_after, optimizer_error = None, None
            try:
                optimizer_after = set_optimizer(page, "sgd")
            except Exception as exc:  # reported by the optimizer test, not here
                optimizer_error = f"{type(exc).__name__}: {exc}"
            levers_after, levers_error = None, None
            try:  # the memory levers tab: 4 micro-batches (one more profiling run)
                levers_after = set_micro_batches(page, 4)
            except Exception as exc:  # reported by the levers test, not here
                levers_error = f"{type(exc).__name__}: {exc}"
            gpus_after, gpus_error = None, None
            try:  # the data-parallel row: 8 GPUs (DDP, each rank's step)
                gpus_after = set_gpus(page, 8)
            except Exception as exc:  # reported by the data-parallel test, not here
                gpus_error = f"{type(exc).__name__}: {exc}"
            # the Display section: one step deeper module grouping (no profiling)
            display_before = page.evaluate(JS_WIDGET_STATE)
            display_after, display_error = None, None
            try:
                open_display(page)
                press_slider_key(page, "ArrowRight", label="group depth")
                display_after = wait_at_rest(page)
            except Exception as exc:  # reported by the display test, not here
                display_error = f"{type(exc).__name__}: {exc}"
            # the generation row of the GPT-2 widget (mode "generate"): 64 new tokens
            generation_before = page.evaluate(js_widget_state("new tokens"))
            generation_after, generation_error = None, None
            try:
                generation_after = set_new_tokens(page, 64)
            except Exception as exc:  # reported by the generation test, not here
                generation_error = f"{type(exc).__name__}: {exc}"
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
        yield Session(
            report,
            blocked,
            plots,
            before,
            after,
            slider,
            slider_error,
            seq_before,
            seq_after,
            seq_slider,
            frontier,
            frontier_after_move,
            seq_error,
            optimizer_before,
            optimizer_after,
            optimizer_error,
            levers_after,
            levers_error,
            gpus_after,
            gpus_error,
            display_before,
            display_after,
            display_error,
            generation_before,
            generation_after,
            generation_error,
        )


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
    # The quickstart's cell 3 sets batch 64 and bf16 from code while Run All keeps the kernel
    # busy, before the page has plotly's bundle: the figure drawn afterwards shows them.
    assert "batch 64, bf16" in session.before["title"], session.before["title"]


def test_slider_move_redraws_figure_and_summary(session: Session) -> None:
    assert session.slider_error is None, session.slider_error
    assert session.slider is not None and session.before and session.after
    assert len(session.slider.latencies_ms) == SLIDER_MOVES + 1
    assert session.after["fingerprint"] != session.before["fingerprint"]
    assert session.after["summary"] != session.before["summary"]
    assert session.after["slider"] != session.before["slider"]


def test_answer_first_and_controls_in_groups(session: Session) -> None:
    # the headline strip (a verdict on the card, the largest batch) and the control tabs
    assert session.before is not None and session.after is not None
    assert session.before["tabs"] == ["Step", "Optimizer", "Memory levers", "GPUs"]
    assert session.before["tab"] == "Step"  # what a step is: shown first
    headline = session.after["headline"]
    assert "fit" in headline and "largest batch" in headline, headline
    assert "…" not in headline  # at rest: every number landed


def test_device_line_filled_once_the_slider_rests(session: Session) -> None:
    # The third number (est.device_bytes, allocator replays under caps) is computed by the
    # kernel's event loop once the controls rest: after the moves it is there, not pending.
    assert session.before is not None and session.after is not None
    for state in (session.before, session.after):
        assert state["device"].startswith("On the device"), state["device"]
        assert "replaying" not in state["device"]
        assert "+ the CUDA context" in state["device"]


def test_sequence_slider_and_frontier_panel(session: Session) -> None:
    # The BERT widget (transformers is a test dependency): its sequence slider is shown.
    assert session.seq_error is None, session.seq_error
    assert session.seq_before is not None, "no widget with a visible sequence-length slider"
    assert session.frontier is not None and session.frontier["points"] > 1
    assert "Largest batch per length on" in session.frontier["title"]
    assert session.seq_after is not None and session.seq_slider is not None
    assert session.seq_after["slider"] != session.seq_before["slider"]
    assert session.seq_after["fingerprint"] != session.seq_before["fingerprint"]
    assert "Tokens per step" in session.seq_after["summary"]
    assert session.seq_after["summary"] != session.seq_before["summary"]
    # the frontier's marker moved to the new length
    assert session.frontier_after_move is not None
    assert session.frontier_after_move["marker"] != session.frontier["marker"]


def test_optimizer_tab_redraws(session: Session) -> None:
    # SGD chosen in the Optimizer tab (selected first: its controls are hidden until then): a
    # profiling run of the new optimizer, then a figure without Adam's two moments and a
    # summary that names SGD, on the same widget
    assert session.optimizer_error is None, session.optimizer_error
    before, after = session.optimizer_before, session.optimizer_after
    assert before is not None and after is not None
    assert after["tab"] == "Optimizer" and before["tab"] == "Step"
    assert "optimizer adam" in before["summary"], before["summary"]
    assert "optimizer sgd" in after["summary"], after["summary"]
    assert after["fingerprint"] != before["fingerprint"]


def test_memory_levers_tab_redraws(session: Session) -> None:
    # 4 micro-batches typed into the Memory levers tab: a new profiling run, then the figure
    # and the summary show the accumulated step ("effective batch 4 x ...")
    assert session.levers_error is None, session.levers_error
    assert session.levers_after is not None and session.optimizer_after is not None
    assert session.levers_after["tab"] == "Memory levers"
    assert session.levers_after["fingerprint"] != session.optimizer_after["fingerprint"]
    assert "effective batch 4 x" in session.levers_after["summary"]


def test_gpus_tab_redraws(session: Session) -> None:
    # Typing 8 in the GPUs box of the GPUs tab redraws the figure (one rank's step, with
    # DDP's buckets) and the summary gives the global batch.
    assert session.gpus_error is None, session.gpus_error
    assert session.gpus_after is not None and session.levers_after is not None
    assert session.gpus_after["tab"] == "GPUs"
    assert session.gpus_after["fingerprint"] != session.levers_after["fingerprint"]
    assert "Data parallel" in session.gpus_after["summary"]
    assert "global batch 8 x" in session.gpus_after["summary"]


def test_display_section_regroups_the_figure(session: Session) -> None:
    # The Display section's group depth, one step deeper: more, smaller module groups in the
    # same step (no profiling), so the figure's data changes and the headline does not
    assert session.display_error is None, session.display_error
    before, after = session.display_before, session.display_after
    assert before is not None and after is not None
    assert after["fingerprint"] != before["fingerprint"]
    assert after["headline"] == before["headline"]


def test_generation_row_redraws(session: Session) -> None:
    # The GPT-2 widget in generate mode: typing 64 new tokens (from 256) redraws its figure and
    # its summary, whose KV cache follows (numpy over the cached generation profile).
    assert session.generation_error is None, session.generation_error
    before, after = session.generation_before, session.generation_after
    assert before is not None, "no widget with a visible new-tokens slider"
    assert after is not None
    assert "KV cache" in before["summary"] and "256 new" in before["summary"]
    assert "64 new" in after["summary"]
    assert after["fingerprint"] != before["fingerprint"]
