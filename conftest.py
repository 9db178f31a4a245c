"""Test-wide settings that must hold before anything is collected: the on-disk profile cache
(``vram_widget._profiling.disk_cache``) points at a temporary directory for the whole run,
so neither the tests, the doctests nor the notebooks nbval runs (their kernels inherit this
process's environment) read or write the user's cache. tests/conftest.py gives each test a
directory of its own on top.

Inductor's caches (the kernels ``torch.compile`` builds for ``measure(compile=...)`` and the
compiled estimates) point at a temporary directory of the run too. Inductor keys its CPU
kernels by the machine, not by ``ATEN_CPU_CAPABILITY``: a run under a narrowed ISA
(``scripts/test.sh``'s AVX2 pass) that found the native run's kernels in the shared default
directory loaded them and crashed with a segmentation fault in a compiled GPT-2 forward
(measured; with a directory of its own, the same tests pass)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_SESSION_CACHE: list[str] = []

# The quickstart runs once in the suite, in tests/test_notebooks.py
# (test_executed_quickstart_with_widget_state_is_small: every cell in a kernel, any cell's
# error a failure, its widget state kept), not under nbval too: it has no cell whose output
# nbval compares (no "# NBVAL_CHECK_OUTPUT"), so nbval's run of it would only repeat that run.
collect_ignore = ["notebooks/quickstart.ipynb"]


def pytest_configure(config: pytest.Config) -> None:
    directory = tempfile.mkdtemp(prefix="vram_widget_cache_")
    _SESSION_CACHE.append(directory)
    os.environ["VRAM_WIDGET_CACHE_DIR"] = directory
    inductor = tempfile.mkdtemp(prefix="vram_widget_inductor_")
    _SESSION_CACHE.append(inductor)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor


def pytest_unconfigure(config: pytest.Config) -> None:
    for directory in _SESSION_CACHE:
        shutil.rmtree(directory, ignore_errors=True)
    _SESSION_CACHE.clear()
