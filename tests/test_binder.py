"""The Binder set-up (binder/) and the README's badge: what repo2docker needs is there, it
installs this package with a CPU torch, and the badge opens a notebook that exists."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
BADGE = re.compile(
    r"\[!\[Binder\]\(https://mybinder\.org/badge_logo\.svg\)\]"
    r"\((?P<url>https://mybinder\.org/v2/gh/(?P<repo>[\w.-]+/[\w.-]+)/(?P<ref>[\w.-]+)"
    r"\?labpath=(?P<labpath>[^)\s]+))\)"
)


def _pyproject() -> str:
    # Read as text: tomllib is Python 3.11+, and the package supports 3.10.
    return (ROOT / "pyproject.toml").read_text()


def _requirements() -> list[str]:
    lines = (ROOT / "binder" / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def test_requirements_ask_for_a_cpu_torch() -> None:
    reqs = _requirements()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in reqs
    torch_lines = [r for r in reqs if re.match(r"torch\b", r)]
    # A range, like the package's own requirement (a pin could fall off the CPU index).
    assert torch_lines == ["torch>=2.4"]


def test_post_build_installs_this_package() -> None:
    post_build = ROOT / "binder" / "postBuild"
    text = post_build.read_text()
    assert text.startswith("#!")
    assert post_build.stat().st_mode & 0o111, "postBuild must be executable for repo2docker"
    assert re.search(r"pip install\b.*(-e|--editable)? \.$", text, re.M)
    # what `pip install .` from the root installs
    assert re.search(r'^name = "vram_widget"$', _pyproject(), re.M)


def test_badge_opens_the_quickstart_of_this_repository() -> None:
    readme = (ROOT / "README.md").read_text()
    badges = list(BADGE.finditer(readme))
    assert len(badges) == 1, "exactly one Binder badge in README.md"
    badge = badges[0]
    labpath = unquote(badge["labpath"])
    assert labpath == "notebooks/quickstart.ipynb"
    assert (ROOT / labpath).is_file()
    repository = re.search(r'^Repository = "([^"]+)"$', _pyproject(), re.M)
    assert repository is not None, "pyproject.toml names the repository in [project.urls]"
    assert repository[1] == f"https://github.com/{badge['repo']}"
