"""Test-wide settings that must hold before anything is collected: the on-disk profile cache
(``vram_widget._profiling.disk_cache``) points at a temporary directory for the whole run,
so neither the tests, the doctests nor the notebooks nbval runs (their kernels inherit this
process's environment) read or write the user's cache. tests/conftest.py gives each test a
directory of its own on top."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_SESSION_CACHE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    directory = tempfile.mkdtemp(prefix="vram_widget_cache_")
    _SESSION_CACHE.append(directory)
    os.environ["VRAM_WIDGET_CACHE_DIR"] = directory


def pytest_unconfigure(config: pytest.Config) -> None:
    for directory in _SESSION_CACHE:
        shutil.rmtree(directory, ignore_errors=True)
    _SESSION_CACHE.clear()
