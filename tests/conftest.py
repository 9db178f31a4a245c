"""Each test profiles into an empty cache directory of its own (the root conftest.py points
the whole run away from the user's cache), so no test answers from another's profile."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _own_profile_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    directory = tmp_path_factory.mktemp("profile_cache")
    monkeypatch.setenv("VRAM_WIDGET_CACHE_DIR", str(directory))
    monkeypatch.delenv("VRAM_WIDGET_CACHE", raising=False)
    return directory
