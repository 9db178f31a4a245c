"""Strip notebooks for committing: keep only the outputs nbval compares.

Every code cell loses its outputs and execution count, except cells whose first line is
``# NBVAL_CHECK_OUTPUT`` (nbval compares their stored outputs, so they keep them, less any
widget view). Widget state (``metadata.widgets``), execution timings and other per-run cell
metadata are removed everywhere.

Usage::

    python scripts/strip_notebooks.py [NOTEBOOK ...]     # default: notebooks/*.ipynb
    python scripts/strip_notebooks.py --execute [...]    # run each notebook first (nbclient)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"
WIDGET_MIMETYPES = (
    "application/vnd.jupyter.widget-view+json",
    "application/vnd.jupyter.widget-state+json",
)
RUN_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")
ROOT = Path(__file__).resolve().parent.parent


def is_check_cell(cell: nbformat.NotebookNode) -> bool:
    lines = cell.source.lstrip().splitlines()
    return cell.cell_type == "code" and bool(lines) and lines[0].strip() == CHECK_MARKER


def _strip_output(output: nbformat.NotebookNode) -> nbformat.NotebookNode | None:
    data = output.get("data")
    if data is None:  # a stream or an error
        return output
    for mimetype in WIDGET_MIMETYPES:
        data.pop(mimetype, None)
    return output if data else None


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for key in RUN_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            continue
        if is_check_cell(cell):
            kept = [o for o in map(_strip_output, cell.outputs) if o is not None]
            cell.outputs = kept
        else:
            cell.outputs = []
            cell.execution_count = None
    return nb


def execute(nb: nbformat.NotebookNode, path: Path) -> None:
    from nbclient import NotebookClient

    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--execute", action="store_true", help="run each notebook first")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if args.execute:
            execute(nb, path)
        nbformat.write(strip(nb), path)
        print(f"{path}: {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
