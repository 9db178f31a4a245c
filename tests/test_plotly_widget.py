"""The plotly figure widget without plotly.js in its state: a small loader as ``_esm``, the
bundle sent once per request as a custom message, plotly's updates unchanged."""

from __future__ import annotations

import json
import re
from typing import Any

import plotly.graph_objects as go
import pytest

from vram_widget import zoo
from vram_widget._display.plotly_widget import (
    LOADER_ESM,
    REPLY,
    REQUEST,
    RESYNC,
    RESYNCED,
    FigureWidget,
    plotly_bundle,
)
from vram_widget._display.widget import MemoryWidget
from vram_widget._profiling.profiler import profile_model

# plotly.js alone is megabytes (plotly/package_data/plotly.min.js); the loader is a few kB.
LOADER_MAX_BYTES = 10_000


def _sent(fig: FigureWidget, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, list[bytes]]]:
    """Record what ``fig.send`` would send to the front end."""
    sent: list[tuple[Any, list[bytes]]] = []

    def send(content: Any, buffers: list[bytes] | None = None) -> None:
        sent.append((content, list(buffers or [])))

    monkeypatch.setattr(fig, "send", send)
    return sent


def test_state_holds_the_loader_not_plotly_js() -> None:
    fig = FigureWidget(data=[{"type": "bar", "y": [1, 2, 3]}])
    state = fig.get_state()
    assert state["_esm"] == LOADER_ESM
    assert len(LOADER_ESM.encode()) < LOADER_MAX_BYTES
    # the whole synced state: the loader plus the figure's JSON, no copy of the bundle
    assert len(json.dumps(state, default=str)) < LOADER_MAX_BYTES + 5_000
    assert len(go.FigureWidget()._esm) > 100 * LOADER_MAX_BYTES  # what plotly's own carries


def test_bundle_request_is_answered_with_plotly_s_own_front_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fig = FigureWidget()
    sent = _sent(fig, monkeypatch)
    fig._handle_custom_msg({"type": REQUEST}, [])
    assert len(sent) == 1
    content, buffers = sent[0]
    assert content == {"type": REPLY}
    assert buffers == [str(go.FigureWidget._esm).encode("utf-8")]
    assert buffers[0] is plotly_bundle()  # read once per process


def test_other_custom_messages_get_no_bundle(monkeypatch: pytest.MonkeyPatch) -> None:
    fig = FigureWidget()
    sent = _sent(fig, monkeypatch)
    for content in ({"type": "something else"}, {"method": "anywidget-command"}, "text", None):
        fig._handle_custom_msg(content, [])
    assert sent == []


def test_resync_resends_the_whole_figure_then_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # A figure updated before its front end could apply updates: on RESYNC the kernel sets
    # _widget_data / _widget_layout to the figure as it is now, then sends RESYNCED.
    fig = FigureWidget(data=[{"type": "bar", "y": [1, 2, 3]}])
    with fig.batch_update():
        fig.data[0].y = [7, 8, 9]
        fig.layout.title.text = "after"
    assert list(fig._widget_data[0]["y"]) == [1, 2, 3]  # as constructed, until resent
    events: list[str] = []
    fig.observe(lambda change: events.append(change["name"]), names=["_widget_data"])
    monkeypatch.setattr(
        fig, "send", lambda content, buffers=None: events.append(f"{content['type']} {buffers}")
    )
    fig._handle_custom_msg({"type": RESYNC}, [])
    assert events == ["_widget_data", f"{RESYNCED} None"]  # the data, then the signal
    assert list(fig._widget_data[0]["y"]) == [7, 8, 9]
    assert fig._widget_layout["title"] == {"text": "after"}


def test_loader_watches_every_plotly_update_message() -> None:
    # The loader watches each of plotly's Python -> JS message traits for one that arrives
    # before plotly's front end (then asks for a resync): the list must be plotly's whole set.
    plotly_messages = {n for n in go.FigureWidget().trait_names() if n.startswith("_py2js_")}
    listed = re.search(r"const PY2JS = (\[.*?\]);", LOADER_ESM)
    assert listed is not None
    assert set(json.loads(listed.group(1))) == plotly_messages
    for name in (REQUEST, REPLY, RESYNC, RESYNCED, "export default"):
        assert name in LOADER_ESM


def test_batch_update_sends_one_update_message() -> None:
    # What the loader relays to plotly's front end: the _py2js_* traits set to a message, then
    # back to None; a batch_update is one _py2js_update message.
    fig = FigureWidget(data=[{"type": "bar", "y": [1, 2, 3]}, {"type": "bar", "y": [4, 5, 6]}])
    messages: list[tuple[str, Any]] = []
    names = [n for n in fig.trait_names() if n.startswith("_py2js_")]
    fig.observe(lambda change: messages.append((change["name"], change["new"])), names=names)
    with fig.batch_update():
        fig.data[0].y = [7, 8, 9]
        fig.data[1].y = [0, 1, 2]
        fig.layout.title.text = "after"
    sent = [(name, msg) for name, msg in messages if msg is not None]
    assert [name for name, _ in sent] == ["_py2js_update"]
    assert messages[-1] == ("_py2js_update", None)
    msg = sent[0][1]
    assert msg["style_traces"] == [0, 1]
    assert msg["layout_data"] == {"title.text": "after"}
    assert fig.data[0].y == (7, 8, 9) and fig.data[1].y == (0, 1, 2)


def test_memory_widget_figures_carry_no_plotly_js() -> None:
    profile = profile_model(zoo.mlp(hidden=(32,)), input_size=(784,), device="cpu")
    w = MemoryWidget(profile, show_frontier=False)
    for fig in (w.figure, w._frontier_figure):
        assert isinstance(fig, FigureWidget)
        assert fig.get_state()["_esm"] == LOADER_ESM
    figure, before = w.figure, w.figure.to_json()
    w.batch_size = 512
    assert w.figure is figure  # updated in place, never replaced
    assert figure.to_json() != before
