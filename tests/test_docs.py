"""The README and the documentation site agree: every page the README links to exists, every
page of mkdocs.yml's navigation exists, and each benchmark table benchmarks/report.py writes has
its markers in the page it writes to. (``mkdocs build --strict`` in scripts/test.sh checks the
links inside docs/ and the API reference's docstrings.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# [text](target) links, with the target's #anchor left off; web links are not files.
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def _local_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+://", t)]


def test_readme_links_resolve_to_files() -> None:
    links = _local_links(README)
    # the badge and the screenshot, the getting-started page and the API reference at least
    assert "docs/assets/widget.png" in links
    assert {"docs/getting-started.md", "docs/api.md"} <= set(links)
    missing = [t for t in links if not (ROOT / t).is_file()]
    assert missing == [], f"README.md links to files that do not exist: {missing}"


def test_readme_fits_on_a_screen() -> None:
    # a short README: what, install, quickstart, examples, links; the rest is in docs/
    assert len(README.splitlines()) <= 200


def test_every_navigation_page_exists_and_every_page_is_in_it() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?(\S+\.md)$", config, re.M))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert nav == pages


def test_report_markers_are_in_the_pages_it_writes() -> None:
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    for name, page in report.PAGES.items():
        text = (ROOT / page).read_text()
        assert text.count(f"<!-- {name} -->") == 1, (page, name)
        assert text.count(f"<!-- /{name} -->") == 1, (page, name)
        assert text.index(f"<!-- {name} -->") < text.index(f"<!-- /{name} -->")
        assert f"<!-- {name} -->" not in README, f"README.md still holds the {name} table"


def test_every_public_name_is_in_the_api_reference() -> None:
    import vram_widget

    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: vram_widget\.(\w+)$", api, re.M))
    assert documented == set(vram_widget.__all__)
