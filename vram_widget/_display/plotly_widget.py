"""A plotly ``FigureWidget`` whose widget state does not carry plotly.js.

Since plotly 6, ``go.FigureWidget`` is an anywidget whose ``_esm`` trait is plotly's whole
front-end bundle (``plotly/package_data/widgetbundle.js``: plotly.js plus the FigureModel and
FigureView that draw and update the figure, about 5 MB). ``_esm`` is synced state, so every
figure sends the bundle to the browser, and a notebook saved with its widget state stores one
copy per figure (a widget with two figures, shown three times: six copies, 30 MB).

:class:`FigureWidget` keeps everything of plotly's widget (its Python class, its traits, its
``batch_update`` messages, its front-end model and view) but replaces ``_esm`` with a small
loader (:data:`LOADER_ESM`, a few kB). The loader asks the kernel for plotly's bundle with a
custom widget message; the kernel answers with the bundle as a binary buffer, the page
evaluates it once and caches the module on ``globalThis`` (keyed by plotly's version), and
every later figure on the page uses the cached module without asking again. Custom messages
are not widget state, so neither the notebook file nor the state that nbclient or JupyterLab
saves holds the bundle; the bundle comes from the kernel's own plotly package, so no request
leaves the machine (no CDN).

Until the bundle has arrived (while the kernel is still busy, e.g. during "Run All"), plotly's
front-end model does not exist to apply the update messages plotly's Python side sends
(``_py2js_restyle``, ``_py2js_relayout``, ...). The loader notes whether any came; if so, once
plotly's model is listening it asks the kernel to resend the figure whole (``_widget_data`` and
``_widget_layout``, as plotly's own ``_repr_mimebundle_`` does) and draws after that, so a
figure updated from code before it could draw shows its latest data.

Without a kernel (a notebook reopened from its saved state and not run), the figure says so
in place of the plot; the widget's static HTML fallback (``MemoryWidget.static_html``) is for
viewers without widgets.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import plotly
import plotly.graph_objects as go
from plotly.basedatatypes import BaseFigure

__all__ = [
    "LOADER_ESM",
    "REPLY",
    "REQUEST",
    "RESYNC",
    "RESYNCED",
    "FigureWidget",
    "plotly_bundle",
]

#: The custom message the loader sends to ask for plotly's bundle (``{"type": REQUEST}``).
REQUEST = "vram_widget.plotly_bundle.request"
#: The custom message the kernel answers with (``{"type": REPLY}``, the bundle as buffer 0).
REPLY = "vram_widget.plotly_bundle.reply"
#: Asks the kernel to resend the whole figure (after updates the front end could not apply).
RESYNC = "vram_widget.plotly_figure.resync"
#: Sent after the resent figure: the front end draws from then on.
RESYNCED = "vram_widget.plotly_figure.resynced"

# plotly's Python -> JS update messages: the synced traits of plotly/basewidget.py whose names
# start with "_py2js_" (each is set to a message, then straight back to None).
_PY2JS = (
    "_py2js_addTraces",
    "_py2js_restyle",
    "_py2js_relayout",
    "_py2js_update",
    "_py2js_animate",
    "_py2js_deleteTraces",
    "_py2js_moveTraces",
    "_py2js_removeLayoutProps",
    "_py2js_removeTraceProps",
)

# The anywidget module (https://anywidget.dev/en/afm/): a default export returning
# {initialize, render}. plotly's bundle has the same shape (its default export is a factory
# returning {initialize, render}, one per model), so the loader delegates to it.
_LOADER_TEMPLATE = """\
// vram_widget: plotly's FigureWidget front end, fetched once per page from the kernel.
const CACHE = "__vram_widget_plotly_bundle__";
const VERSION = __VERSION__;
const REQUEST = __REQUEST__;
const REPLY = __REPLY__;
const RESYNC = __RESYNC__;
const RESYNCED = __RESYNCED__;
const PY2JS = __PY2JS__;

class Superseded extends Error {}

// One request per page: the first figure asks, the others wait on the same promise. If the
// asking figure is closed before the answer, the waiting figures ask again themselves.
function request(model) {
  const cache = (globalThis[CACHE] ??= {});
  const entry = cache[VERSION];
  if (entry) return entry.promise;
  let settle;
  const promise = new Promise((resolve, reject) => { settle = { resolve, reject }; });
  const fresh = { promise };
  cache[VERSION] = fresh;
  const onMessage = (msg, buffers) => {
    if (!msg || msg.type !== REPLY) return;
    model.off("msg:custom", onMessage);
    const url = URL.createObjectURL(new Blob([buffers[0]], { type: "text/javascript" }));
    import(/* webpackIgnore: true */ url)
      .then(settle.resolve, (error) => {
        if (cache[VERSION] === fresh) delete cache[VERSION];
        settle.reject(error);
      })
      .finally(() => URL.revokeObjectURL(url));
  };
  model.on("msg:custom", onMessage);
  model.on("destroy", () => {
    if (cache[VERSION] === fresh && !fresh.done) {
      delete cache[VERSION];
      settle.reject(new Superseded("the figure that asked for plotly.js was closed"));
    }
  });
  promise.then(() => { fresh.done = true; }, () => {});
  model.send({ type: REQUEST });
  return promise;
}

async function plotlyBundle(model) {
  for (;;) {
    try {
      return await request(model);
    } catch (error) {
      if (!(error instanceof Superseded)) throw error;
    }
  }
}

export default () => {
  let ready = null;
  return {
    initialize(ctx) {
      const { model } = ctx;
      // Did plotly's Python side send an update before plotly's front-end model existed?
      let missed = false;
      const note = (value) => { if (value !== null && value !== undefined) missed = true; };
      const recorders = PY2JS.map((name) => [name, () => note(model.get(name))]);
      for (const [name, record] of recorders) model.on(`change:${name}`, record);
      ready = plotlyBundle(model).then(async (bundle) => {
        const factory = bundle.default;
        const widget = typeof factory === "function" ? await factory() : factory;
        await widget.initialize?.(ctx);
        for (const [name, record] of recorders) model.off(`change:${name}`, record);
        if (missed) {
          // The kernel resends _widget_data and _widget_layout, then RESYNCED (in order, on
          // this comm); updates after that reach plotly's own listeners.
          await new Promise((resolve) => {
            const onMessage = (msg) => {
              if (!msg || msg.type !== RESYNCED) return;
              model.off("msg:custom", onMessage);
              resolve();
            };
            model.on("msg:custom", onMessage);
            model.send({ type: RESYNC });
          });
        }
        return widget;
      });
      ready.catch((error) => console.error("vram_widget: plotly.js not loaded", error));
    },
    async render(ctx) {
      const { el, signal } = ctx;
      const note = document.createElement("div");
      note.className = "vram-widget-plotly-loading";
      note.textContent = "Loading plotly.js from the kernel (it answers once it is idle)...";
      el.replaceChildren(note);
      let widget;
      try {
        widget = await ready;
      } catch (error) {
        note.textContent = `plotly.js could not be loaded from the kernel: ${error}`;
        return undefined;
      }
      if (signal?.aborted) return undefined;
      note.remove();
      return widget.render?.(ctx);
    },
  };
};
"""


#: The ``_esm`` of :class:`FigureWidget`: the loader, with plotly's version as its cache key.
LOADER_ESM = (
    _LOADER_TEMPLATE.replace("__VERSION__", json.dumps(plotly.__version__))
    .replace("__REQUEST__", json.dumps(REQUEST))
    .replace("__REPLY__", json.dumps(REPLY))
    .replace("__RESYNC__", json.dumps(RESYNC))
    .replace("__RESYNCED__", json.dumps(RESYNCED))
    .replace("__PY2JS__", json.dumps(list(_PY2JS)))
)


@functools.cache
def plotly_bundle() -> bytes:
    """plotly's own widget front end (``go.FigureWidget._esm``), as UTF-8 bytes.

    Read once per process from the installed plotly, so the loader gets the front end that
    matches the Python side.

    Examples
    --------
    >>> from vram_widget._display.plotly_widget import plotly_bundle
    >>> len(plotly_bundle()) > 1_000_000  # plotly.js and its widget code
    True
    """
    return str(go.FigureWidget._esm).encode("utf-8")


_UNCHANGED = object()


def _put(props: dict[str, Any], key: str, value: Any) -> bool:
    """Store ``value`` at a dotted path of a trace's or layout's property dict (None
    removes it); whether that changed what was stored. Plain dotted paths are walked here
    (most of a figure's updates; plotly's ``_set_in`` parses every path, ~1 ms a move for
    ResNet-50), indexed ones (``annotations[0].text``) by plotly's ``_set_in``."""
    if "[" in key:
        return bool(BaseFigure._set_in(props, key, value))
    *parents, last = key.split(".")
    parent = props
    for part in parents:
        child = parent.get(part)
        if not isinstance(child, dict):
            if value is None:
                return False
            child = parent[part] = {}
        parent = child
    if value is None:
        return parent.pop(last, None) is not None
    old = parent.get(last)
    if old is not None and _equal(old, value):
        return False
    parent[last] = value
    return True


def _equal(old: Any, new: Any) -> bool:
    """Whether two property values are the same (arrays by shape, kind and elements)."""
    if isinstance(old, np.ndarray) or isinstance(new, np.ndarray):
        a, b = np.asarray(old), np.asarray(new)
        return a.shape == b.shape and a.dtype.kind == b.dtype.kind and np.array_equal(a, b)
    try:
        return bool(old == new)
    except (TypeError, ValueError):  # e.g. a list holding arrays
        return False


def _stored(props: dict[str, Any], key: str) -> Any:
    """The value a trace's or layout's property dict holds at a dotted path (None: none)."""
    value: Any = props
    for part in BaseFigure._str_to_dict_path(key):
        if isinstance(value, dict) and not isinstance(part, int):
            value = value.get(part)
        elif isinstance(value, list) and isinstance(part, int) and part < len(value):
            value = value[part]
        else:
            return None
    return value


class FigureWidget(go.FigureWidget):
    """``go.FigureWidget`` whose synced ``_esm`` is a small loader, not plotly.js.

    The same constructor, traits and methods as ``go.FigureWidget`` (``batch_update``,
    ``update_traces``, ...); only the front end's code travels differently: the browser
    asks the kernel for plotly's bundle once per page (see the module docstring).

    Examples
    --------
    >>> from vram_widget._display.plotly_widget import LOADER_ESM, FigureWidget
    >>> fig = FigureWidget(data=[{"type": "bar", "y": [1, 2]}])
    >>> fig._esm == LOADER_ESM and len(fig._esm) < 10_000
    True
    >>> with fig.batch_update():
    ...     fig.data[0].y = [3, 4]
    >>> fig.data[0].y
    (3, 4)
    """

    _esm = LOADER_ESM

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_msg(self._answer_loader)

    def write_updates(
        self, trace_updates: Sequence[Mapping[str, Any]], layout_updates: Mapping[str, Any]
    ) -> None:
        """Write new property values into every trace (``trace_updates[i]`` for trace ``i``,
        keyed by plotly's dotted paths: ``"marker.color"``) and the layout
        (``"annotations[0].text"``), and send what changed as one ``Plotly.update``.

        What ``batch_update()`` does, without plotly's per-property validation and
        key-path checks (measured: ~4 ms of a ~4.5 ms waterfall update, ResNet-50): the
        values are the figure's own, written by :mod:`.figures` into traces it built, so
        they are stored as given (``BaseFigure._set_in``, plotly's own store for
        ``plotly_update``; a None removes the property) and only the properties whose
        value changed are sent (``BaseFigureWidget._send_update_msg``).

        Examples
        --------
        >>> from vram_widget._display.plotly_widget import FigureWidget
        >>> fig = FigureWidget(data=[{"type": "bar", "y": [1, 2]}])
        >>> fig.write_updates([{"y": [3, 4], "marker.color": "red"}], {"title.text": "t"})
        >>> fig.data[0].y, fig.data[0].marker.color, fig.layout.title.text
        ((3, 4), 'red', 't')
        """
        if len(trace_updates) != len(self._data):
            raise ValueError(
                f"{len(trace_updates)} trace updates for a figure of {len(self._data)} traces"
            )
        restyle: dict[str, list[Any]] = {}
        for i, update in enumerate(trace_updates):
            for key, value in update.items():
                if _put(self._data[i], key, value):
                    changed = restyle.setdefault(key, [_UNCHANGED] * len(self._data))
                    changed[i] = value
        relayout = {
            key: value for key, value in layout_updates.items() if _put(self._layout, key, value)
        }
        if not restyle and not relayout:
            return
        # Plotly.restyle takes one value per trace of the list, and a null resets a trace's
        # property to its default (JSON has no "undefined"), so a trace whose value did not
        # change is sent the value it holds (a null where it holds none: the default it has)
        for key, values in restyle.items():
            for i, value in enumerate(values):
                if value is _UNCHANGED:
                    values[i] = _stored(self._data[i], key)
        self._send_update_msg(restyle, relayout, list(range(len(self._data))))

    def _answer_loader(
        self, _widget: object, content: Any, _buffers: list[bytes] | None = None
    ) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == REQUEST:
            self.send({"type": REPLY}, buffers=[plotly_bundle()])
        elif kind == RESYNC:
            # the whole figure, as plotly's own FigureWidget._repr_mimebundle_ sends it
            self._widget_layout = copy.deepcopy(self._layout_obj._props)
            self._widget_data = copy.deepcopy(self._data)
            self.send({"type": RESYNCED})
