"""Drive a notebook in a real JupyterLab, in headless Chromium, as a person would.

Used by ``tests/browser/test_jupyterlab.py`` and ``benchmarks/browser_latency.py``. Nothing
here touches the network: the server listens on 127.0.0.1, the browser is Debian's
``/usr/bin/chromium`` (never ``playwright install``, which downloads a browser), and every
request that is not to loopback is blocked and recorded, so a widget that needed a CDN fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

CHROMIUM = os.environ.get("VRAM_WIDGET_CHROMIUM", "/usr/bin/chromium")
# Flags: no sandbox (root), no GPU, and nothing that phones home.
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}

# JupyterLab user settings for the run (a temporary settings directory): every cell stays in
# the DOM (windowing off, so cells below the fold are rendered and queryable), and no news or
# update check, which would fetch from the internet.
_LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}


def missing_requirements(front_end: str = "lab") -> list[str]:
    """What this machine lacks to run the browser test (empty when it can run)."""
    missing = []
    if not Path(CHROMIUM).exists():
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    for module in ("playwright", "jupyterlab" if front_end == "lab" else "notebook"):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"the {module} Python package")
    return missing


def require(front_end: str = "lab") -> None:
    """Skip the calling test where the machine cannot run it, except under CI (``CI`` set),
    where that fails: a green CI must not hide a browser test that never ran."""
    import pytest

    missing = missing_requirements(front_end)
    if missing:
        message = f"browser test ({front_end}) needs " + ", ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must run it: see scripts/install.sh)")
        pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LabServer:
    """A JupyterLab process serving a copy of ``notebooks/`` from a temporary directory."""

    url: str
    token: str
    root: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    front_end: str = "lab"

    def notebook_url(self, name: str) -> str:
        path = "lab/tree" if self.front_end == "lab" else "notebooks"
        return f"{self.url}/{path}/{name}?token={self.token}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


@contextlib.contextmanager
def lab_server(
    workdir: Path, timeout_s: float = 120.0, front_end: str = "lab"
) -> Iterator[LabServer]:
    """Start JupyterLab (``front_end="lab"``) or Notebook 7 (``"notebook"``) on a free
    loopback port; always stop it by its PID at the end."""
    root = workdir / "notebooks"
    shutil.copytree(NOTEBOOKS, root)  # Lab autosaves: never let it write into the repo
    settings = workdir / "lab-settings"
    for rel, value in _LAB_SETTINGS.items():
        path = settings / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    env = dict(os.environ)
    env.update(
        JUPYTERLAB_SETTINGS_DIR=str(settings),
        JUPYTERLAB_WORKSPACES_DIR=str(workdir / "lab-workspaces"),
        JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),
        JUPYTER_CONFIG_DIR=str(workdir / "config"),
        IPYTHONDIR=str(workdir / "ipython"),
    )
    # In a virtual environment made with --system-site-packages, the front-end extensions
    # (widget manager, plotly, anywidget) live under the base prefix, which Jupyter does not
    # search by itself: without them Lab renders each widget's static HTML fallback instead.
    data_dirs = dict.fromkeys(
        str(Path(prefix) / "share" / "jupyter") for prefix in (sys.prefix, sys.base_prefix)
    )
    env["JUPYTER_PATH"] = os.pathsep.join(
        [*data_dirs, *filter(None, [os.environ.get("JUPYTER_PATH")])]
    )
    # The kernel imports this checkout's vram_widget (the one under test), whatever an
    # installed copy (editable or not) points at: the kernel runs in the temporary notebook
    # directory, where the current directory is not the repository.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    port, token = _free_port(), secrets.token_hex(16)
    log_path = workdir / "jupyterlab.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab" if front_end == "lab" else "notebook",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--port={port}",
            "--port-retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            *(
                [
                    "--LabApp.expose_app_in_browser=True",
                    "--LabApp.news_url=None",
                    "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                ]
                if front_end == "lab"
                else ["--JupyterNotebookApp.expose_app_in_browser=True"]
            ),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=root,
    )
    url = f"http://127.0.0.1:{port}"
    server = LabServer(url, token, root, process, log_path, front_end)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"JupyterLab exited with {process.returncode}:\n{server.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"JupyterLab did not answer in {timeout_s:.0f} s:\n{server.log_tail()}"
                    ) from None
                time.sleep(0.25)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
        log.close()


@dataclass
class BlockedRequests:
    """Every request the page tried to send outside loopback (all were aborted)."""

    urls: list[str] = field(default_factory=list)

    def route(self, route: Any) -> None:
        host = urlsplit(route.request.url).hostname or ""
        if route.request.url.startswith(("data:", "blob:")) or host in LOOPBACK_HOSTS:
            route.continue_()
        else:
            self.urls.append(route.request.url)
            route.abort()


@contextlib.contextmanager
def chromium_page(workdir: Path) -> Iterator[tuple[Any, BlockedRequests]]:
    """A fresh headless Chromium page whose non-loopback requests are blocked and recorded."""
    from playwright.sync_api import sync_playwright

    blocked = BlockedRequests()
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            user_data_dir=str(workdir / "chromium-profile"),
            executable_path=CHROMIUM,
            headless=True,
            args=list(CHROMIUM_ARGS),
            viewport={"width": 1400, "height": 1000},
        )
        try:
            context.route("**/*", blocked.route)
            page = context.pages[0] if context.pages else context.new_page()
            yield page, blocked
        finally:
            context.close()


# --------------------------------------------------------------------------- in-page helpers
# JupyterLab's app is exposed as window.jupyterapp (--LabApp.expose_app_in_browser); the
# notebook model tells which outputs are widgets, since widget outputs carry no mime attribute.

_JS_PANEL = (
    "(() => { const w = window.jupyterapp?.shell?.currentWidget;"
    " return w && w.content && w.sessionContext ? w : null; })()"
)

JS_KERNEL_IDLE = f"""() => {{
  const p = {_JS_PANEL};
  return !!(p && p.sessionContext.session?.kernel
            && p.sessionContext.kernelDisplayStatus === 'idle');
}}"""

JS_OUTPUTS = f"""() => {{
  const p = {_JS_PANEL};
  return p.content.widgets.filter(c => c.model.type === 'code').map(c => ({{
    source: c.model.sharedModel.getSource().slice(0, 80),
    executed: c.model.executionCount !== null,
    outputs: c.model.outputs.toJSON(),
  }}));
}}"""


@dataclass(frozen=True)
class CellReport:
    """What the notebook showed after Run All."""

    errors: list[str]
    widget_outputs: int
    stuck_loading: int
    display_errors: int


def open_and_run_all(
    page: Any, server: LabServer, notebook: str, timeout_s: float, collapse_left: bool = False
) -> CellReport:
    """Open ``notebook`` in Lab, wait for its kernel, Run All, wait for every cell. With
    ``collapse_left``, Lab's left sidebar (the file browser) is collapsed before the run, so
    the outputs are drawn at the page's width."""
    page.goto(server.notebook_url(notebook), wait_until="domcontentloaded")
    page.wait_for_function(JS_KERNEL_IDLE, timeout=timeout_s * 1000)
    if collapse_left:
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
    # The command's promise settles when the run ends: every cell done, or the first error.
    page.evaluate(
        "() => { window.__vramRunAll = undefined; window.jupyterapp.commands"
        ".execute('runmenu:run-all').then(ok => { window.__vramRunAll = String(ok); },"
        " err => { window.__vramRunAll = 'error: ' + err; }); }"
    )
    page.wait_for_function(
        "() => window.__vramRunAll !== undefined", timeout=timeout_s * 1000, polling=250
    )
    page.wait_for_function(JS_KERNEL_IDLE, timeout=timeout_s * 1000)
    cells = page.evaluate(JS_OUTPUTS)
    errors = []
    widget_outputs = 0
    for cell in cells:
        if not cell["executed"] and not errors:
            errors.append(f"{cell['source']!r}: not executed by Run All")
        for out in cell["outputs"]:
            if out.get("output_type") == "error":
                trace = "\n".join(out.get("traceback", []))
                what = f"{out.get('ename')}: {out.get('evalue')}"
                errors.append(f"{cell['source']!r}: {what}\n{trace}")
            if "application/vnd.jupyter.widget-view+json" in (out.get("data") or {}):
                widget_outputs += 1
    # Widget views render asynchronously after the kernel is idle: wait for the placeholders
    # ("Loading widget...") to go, then count what is left and any "Error displaying widget".
    with contextlib.suppress(Exception):
        page.wait_for_function(
            "() => !document.body.innerText.includes('Loading widget...')", timeout=30_000
        )
    # Each figure draws once plotly.js has come from the kernel (plotly_widget.py: asked for
    # once per page, answered when the kernel is idle, a 5 MB message): wait for every
    # figure's loading note to go before anything reads the plots.
    with contextlib.suppress(Exception):
        page.wait_for_function(
            "() => document.querySelectorAll('.js-plotly-plot').length > 0"
            " && !document.querySelector('.vram-widget-plotly-loading')",
            timeout=60_000,
            polling=250,
        )
    text = page.evaluate("() => document.body.innerText")
    return CellReport(
        errors=errors,
        widget_outputs=widget_outputs,
        stuck_loading=text.count("Loading widget..."),
        display_errors=text.count("Error displaying widget"),
    )


JS_PLOTS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => ({
  traces: (gd.data || []).length,
  points: (gd.data || []).reduce(
    (n, t) => n + ((t.y && t.y.length) || (t.x && t.x.length) || 0), 0),
  visible: gd.getBoundingClientRect().width > 0 && gd.getBoundingClientRect().height > 0,
}))"""

# What changes when the figure is redrawn with new data.
_JS_FINGERPRINT = "JSON.stringify(gd.data.map(t => [t.y, t.x, t.base]))"


def _js_widget(label: str) -> str:
    """JS that finds the first MemoryWidget with a visible slider labelled ``label``: that
    slider's handle, the widget's (first) figure and its summary. Each is found from the
    slider's description label, so other widgets on the page do not confuse it."""
    return f"""
const labels = Array.from(document.querySelectorAll('.widget-slider .widget-label'))
  .filter(l => l.textContent.trim() === {json.dumps(label)});
// The first widget that shows this slider: no box between it and the output hides it with
// display: none (a row a widget leaves out, e.g. a model without a sequence axis). A tab
// not selected now, or a collapsed section, hides it too, by Lumino's lm-mod-hidden class:
// those count as shown, so selecting another tab of a widget never makes these helpers
// read the next widget on the page.
const shown = l => {{
  for (let e = l; e && !e.classList.contains('jp-OutputArea-output'); e = e.parentElement) {{
    if (e.style && e.style.display === 'none') return false;
  }}
  return true;
}};
const label = labels.find(shown) || labels[0];
const root = label && label.closest('.jp-OutputArea-output');
const gd = root && root.querySelector('.js-plotly-plot');
// everything the widget says in words: the headline, the bar and the (collapsed) details
const summary = root && Array.from(root.querySelectorAll('.widget-html-content'))
  .map(e => e.textContent).join(' | ');
const deviceRow = root && Array.from(root.querySelectorAll('.vw-details tr'))
  .find(r => r.querySelector('th') && r.querySelector('th').textContent === 'On the device');
const device = deviceRow && ('On the device: ' + deviceRow.querySelector('td').textContent);
const headline = root && root.querySelector('.vw-headline');
const details = root && root.querySelector('.vw-details');
// the Details section's title says "(updating…)" until the controls' rest fills it
const detailsTitle = root && Array.from(root.querySelectorAll('.jupyter-widget-Collapse-header'))
  .map(h => h.textContent.trim()).find(t => t.startsWith('Details'));
const tabs = root ? Array.from(root.querySelectorAll('.lm-TabBar-tabLabel'))
  .map(t => t.textContent.trim()) : [];
const current = root && root.querySelector('.lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel');
const handle = label && label.closest('.widget-slider').querySelector('.noUi-handle');
"""


def js_widget_state(label: str = "batch size") -> str:
    """JS returning the figure fingerprint, summary, headline, device row, tab titles and
    the selected tab, trace count, figure title and slider position of the first widget
    that shows a ``label`` slider (null where there is none)."""
    return f"""() => {{
  {_js_widget(label)}
  if (!gd) return null;
  return {{
    fingerprint: {_JS_FINGERPRINT},
    summary: summary || '',
    device: device || '',
    headline: headline ? headline.textContent : '',
    details: details ? details.textContent : '',
    details_title: detailsTitle || '',
    tabs: tabs,
    tab: current ? current.textContent.trim() : '',
    traces: gd.data.length,
    title: (gd.layout && gd.layout.title && gd.layout.title.text) || '',
    slider: handle ? handle.getAttribute('aria-valuenow') : null,
  }};
}}"""


JS_WIDGET_STATE = js_widget_state("batch size")


def _js_arm(label: str) -> str:
    """Arm a watcher before a key press: it timestamps the keydown on the slider handle, then
    checks on every animation frame whether the figure's data changed, and stamps that
    frame."""
    return f"""() => {{
  {_js_widget(label)}
  const before = {_JS_FINGERPRINT};
  const probe = window.__vramProbe = {{ t0: null, t1: null }};
  handle.addEventListener('keydown', () => {{ probe.t0 = performance.now(); }},
                          {{ once: true, capture: true }});
  const tick = () => {{
    if ({_JS_FINGERPRINT} !== before) {{
      probe.t1 = performance.now();
    }} else if (performance.now() - (probe.t0 ?? performance.now()) < 30000) {{
      requestAnimationFrame(tick);
    }}
  }};
  requestAnimationFrame(tick);
}}"""


def press_slider_key(
    page: Any, key: str, timeout_s: float = 30.0, label: str = "batch size"
) -> float:
    """Press ``key`` on the handle of the slider labelled ``label`` of the first widget that
    shows one (its tab must be selected); the ms from the keydown to the frame in which that
    widget's figure's data had changed."""
    # the handle the watcher watches, marked so the key goes to that same handle
    found = page.evaluate(
        f"""() => {{
  {_js_widget(label)}
  for (const e of document.querySelectorAll('[data-vram-handle]'))
    e.removeAttribute('data-vram-handle');
  if (!handle) return false;
  handle.setAttribute('data-vram-handle', '1');
  return true;
}}"""
    )
    if not found:
        raise LookupError(f"no widget shows a slider labelled {label!r}")
    handle = page.locator("[data-vram-handle='1']")
    handle.scroll_into_view_if_needed()
    handle.focus()
    page.evaluate(_js_arm(label))
    handle.press(key)
    page.wait_for_function(
        "() => window.__vramProbe && window.__vramProbe.t1 !== null",
        timeout=timeout_s * 1000,
        polling=10,
    )
    probe = page.evaluate("() => window.__vramProbe")
    return float(probe["t1"] - probe["t0"])


@dataclass(frozen=True)
class SliderRun:
    latencies_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.latencies_ms)


def move_slider(
    page: Any, moves: int, label: str = "batch size", timeout_s: float = 30.0
) -> SliderRun:
    """Alternate right/left arrow presses on a slider, waiting for each redraw."""
    latencies = []
    for i in range(moves):
        key = "ArrowRight" if i % 2 == 0 else "ArrowLeft"
        latencies.append(press_slider_key(page, key, timeout_s, label))
        page.wait_for_timeout(200)  # let the summary and any trailing update settle
    return SliderRun(latencies)


def move_batch_slider(page: Any, moves: int) -> SliderRun:
    """Alternate right/left arrow presses on the batch slider, waiting for each redraw."""
    return move_slider(page, moves, "batch size")


def open_tab(page: Any, title: str, timeout_s: float = 10.0) -> None:
    """Select the first widget's control tab titled ``title`` (a click on its tab) and wait
    until it is the selected one. A tab's controls are hidden (Lumino's ``lm-mod-hidden``)
    until it is selected: a test selects it before it reads or moves them."""
    tab = page.locator(".lm-TabBar-tab:has(.lm-TabBar-tabLabel:text-is('" + title + "'))")
    tab.first.scroll_into_view_if_needed()
    tab.first.click()
    page.wait_for_function(
        f"(title) => {{ const s = ({JS_WIDGET_STATE})(); return s && s.tab === title; }}",
        arg=title,
        timeout=timeout_s * 1000,
        polling=100,
    )


def open_display(page: Any) -> None:
    """Open the first widget's "Display" section (a collapsed accordion under the tabs)."""
    header = page.locator(".jupyter-widget-Collapse-header:has-text('Display')").first
    header.scroll_into_view_if_needed()
    header.click()
    page.locator(".widget-slider:has(.widget-label:text-is('group depth')):visible").first.wait_for(
        timeout=10_000
    )


def set_optimizer(page: Any, name: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Choose ``name`` in the first widget's optimizer dropdown (its "Optimizer" tab) and wait
    until its figure and its summary changed (a first use profiles the optimizer once)."""
    open_tab(page, "Optimizer")
    before = page.evaluate(JS_WIDGET_STATE)
    select = page.locator(
        ".widget-dropdown:has(.widget-label:text-is('optimizer')) select:visible"
    ).first
    select.scroll_into_view_if_needed()
    select.select_option(name)
    return _wait_changed(page, before, JS_WIDGET_STATE, timeout_s)


def set_micro_batches(page: Any, value: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Type ``value`` into the first widget's "micro-batches" box (its "Memory levers" tab)
    and wait until its figure and its summary changed; returns :data:`JS_WIDGET_STATE` after."""
    open_tab(page, "Memory levers")
    box = ".widget-inline-hbox:has(.widget-label:text-is('micro-batches')) input:visible"
    return _set_box(page, box, value, timeout_s)


def set_gpus(page: Any, value: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Type ``value`` into the first widget's GPUs box (its "GPUs" tab, beside the "GPUs"
    slider) and wait until its figure and its summary changed."""
    open_tab(page, "GPUs")
    box = (
        ".widget-hbox:has(.widget-slider .widget-label:text-is('GPUs')) .widget-text input:visible"
    )
    return _set_box(page, box, value, timeout_s)


def set_new_tokens(page: Any, value: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Type ``value`` into the new-tokens box of the first widget in generate mode (the
    generation row, beside the "new tokens" slider) and wait until that widget's figure and
    summary changed; returns its state after."""
    # every widget has the row; only one in generate mode shows it
    box = (
        ".widget-hbox:has(.widget-slider .widget-label:text-is('new tokens')) "
        ".widget-text input:visible"
    )
    return _set_box(page, box, value, timeout_s, js_widget_state("new tokens"))


def _set_box(
    page: Any, css: str, value: int, timeout_s: float, state: str = JS_WIDGET_STATE
) -> dict[str, Any]:
    before = page.evaluate(state)
    box = page.locator(css).first
    box.scroll_into_view_if_needed()
    box.fill(str(value))
    box.press("Enter")
    return _wait_changed(page, before, state, timeout_s)


def _wait_changed(
    page: Any, before: dict[str, Any], state: str, timeout_s: float
) -> dict[str, Any]:
    """Wait until the widget's figure and its details differ from ``before`` and the
    controls' rest has landed; returns the state after.

    The figure, the bar, the headline and the details are separate messages from the kernel,
    and the details are filled last, once the controls rest: a state whose figure changed but
    whose details are still the last setting's is not the answer."""
    changed = (
        f"(before) => {{ const s = ({state})(); "
        f"return s && s.fingerprint !== before[0] && s.details !== before[1] && {_JS_AT_REST}; }}"
    )
    page.wait_for_function(
        changed,
        arg=[before["fingerprint"], before["details"]],
        timeout=timeout_s * 1000,
        polling=100,
    )
    return dict(page.evaluate(state))


# The controls' rest has landed: no number of the headline pending ("…") and the details
# section no longer "(updating…)" (``s`` is a :func:`js_widget_state` result).
_JS_AT_REST = "!s.headline.includes('…') && !s.details_title.includes('…')"


def wait_at_rest(
    page: Any, state: str = JS_WIDGET_STATE, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Wait for the controls' rest: the searches landed in the headline (no pending "…"),
    the details filled; returns the widget's state then."""
    page.wait_for_function(
        f"() => {{ const s = ({state})(); return s && {_JS_AT_REST}; }}",
        timeout=timeout_s * 1000,
        polling=100,
    )
    return dict(page.evaluate(state))


# The frontier panel of the first widget with a visible sequence slider: open it (a click on
# its title) and read its figure, the second plotly figure in that widget's output.
FRONTIER_TITLE = "Batch x sequence length: what fits the GPU"

JS_FRONTIER_STATE = f"""() => {{
  {_js_widget("sequence length")}
  if (!root) return null;
  const plots = Array.from(root.querySelectorAll('.js-plotly-plot'));
  const fr = plots.find(p => p !== gd);
  if (!fr || !fr.data) return null;
  return {{
    points: (fr.data[0].x || []).length,
    marker: fr.data[1].x ? Array.from(fr.data[1].x) : [],
    visible: fr.getBoundingClientRect().width > 0,
    title: (fr.layout.title && fr.layout.title.text) || '',
  }};
}}"""


def open_frontier(page: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Open the frontier panel of the first widget with a sequence axis and wait until its
    figure has a line; returns :data:`JS_FRONTIER_STATE`."""
    page.get_by_text(FRONTIER_TITLE, exact=True).first.click()
    page.wait_for_function(
        f"() => {{ const s = ({JS_FRONTIER_STATE})(); return s && s.visible && s.points > 0; }}",
        timeout=timeout_s * 1000,
        polling=100,
    )
    return dict(page.evaluate(JS_FRONTIER_STATE))


def screenshot_widget(page: Any, path: Path) -> None:
    """A screenshot with the first MemoryWidget's output scrolled to the top of the panel."""
    page.set_viewport_size({"width": 1400, "height": 1800})
    page.evaluate(
        "() => { const l = Array.from(document.querySelectorAll('.widget-slider .widget-label'))"
        ".find(e => e.textContent.trim() === 'batch size');"
        " if (l) l.closest('.jp-OutputArea-output').scrollIntoView({block: 'start'}); }"
    )
    page.wait_for_timeout(300)
    page.screenshot(path=str(path))
