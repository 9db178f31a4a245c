"""The notebooks as files: small, no widget state, a title, stored outputs where nbval checks;
and the quickstart executed and saved with its widget state stays small (plotly.js is not in
the state of each figure).

The notebooks themselves run under nbval (``--nbval-lax`` in pytest's addopts, ``notebooks``
in its testpaths), except the quickstart, which has no output nbval compares and runs here
(conftest.py leaves it out of nbval's collection). After editing one, re-run
``python scripts/strip_notebooks.py --execute``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vram_widget._display.plotly_widget import LOADER_ESM

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
MAX_BYTES = 200 * 1024
# An executed notebook saved with its widget state (one plotly.js bundle is about 5 MB).
EXECUTED_MAX_BYTES = 2 * 1024 * 1024
CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_expected_notebooks_exist() -> None:
    names = {p.name for p in NOTEBOOKS}
    assert {
        "quickstart.ipynb",
        "cs231n_vgg16.ipynb",
        "batch_size_tradeoffs.ipynb",
        "validate_on_your_gpu.ipynb",
        "llm_finetuning.ipynb",
    } <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_small(path: Path) -> None:
    assert path.stat().st_size < MAX_BYTES


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_no_widget_state(path: Path) -> None:
    nb = _load(path)
    assert "widgets" not in nb.get("metadata", {})
    text = path.read_text(encoding="utf-8")
    assert WIDGET_STATE not in text
    assert WIDGET_VIEW not in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_a_title_cell(path: Path) -> None:
    first = _load(path)["cells"][0]
    assert first["cell_type"] == "markdown"
    assert _source(first).lstrip().startswith("# ")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_check_output_cells_have_stored_outputs(path: Path) -> None:
    cells = [c for c in _load(path)["cells"] if c["cell_type"] == "code"]
    checked = [c for c in cells if _source(c).lstrip().startswith(CHECK_MARKER)]
    for cell in checked:
        outputs = cell.get("outputs", [])
        assert outputs, f"no stored output for:\n{_source(cell)[:200]}"
        assert all(o.get("output_type") != "error" for o in outputs)
        assert not any(o.get("name") == "stderr" for o in outputs)
    for cell in cells:
        if cell not in checked:
            assert not cell.get("outputs"), "outputs outside NBVAL_CHECK_OUTPUT cells"


def test_cs231n_notebook_checks_its_table() -> None:
    nb = _load(NOTEBOOK_DIR / "cs231n_vgg16.ipynb")
    printed = "".join(
        "".join(o.get("text", ""))
        for c in nb["cells"]
        if c["cell_type"] == "code" and _source(c).lstrip().startswith(CHECK_MARKER)
        for o in c.get("outputs", [])
    )
    for expected in ("102,760,448", "15,237,608", "138,357,544", "3,211,264", "25,088"):
        assert expected in printed


@pytest.mark.slow
def test_executed_quickstart_with_widget_state_is_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As JupyterLab or nbconvert would save it after a run: every widget's state stored. Each
    # plotly FigureWidget's state used to hold plotly's 5 MB front-end bundle (31 MB in all);
    # now it holds a small loader and the bundle is sent apart, on request. This is the suite's
    # run of the quickstart (nbval leaves it out): a cell's error fails it (allow_errors).
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK_DIR / "quickstart.ipynb", as_version=4)
    # the kernel imports this checkout's package, whatever is installed
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        store_widget_state=True,
        allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute()
    saved = tmp_path / "quickstart.ipynb"
    nbformat.write(nb, saved)

    states = nb.metadata.widgets[WIDGET_STATE]["state"]
    figures = [s["state"] for s in states.values() if "_esm" in s["state"]]
    # two figures for each widget: the zoo's ResNet-18, BERT and GPT-2 (transformers is a test
    # dependency), and torchvision's ResNet-18 where torchvision is installed
    assert len(figures) >= 6
    assert all(state["_esm"] == LOADER_ESM for state in figures)
    assert saved.stat().st_size < EXECUTED_MAX_BYTES
