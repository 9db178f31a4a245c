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
(measured; with a directory of its own, the same tests pass).

Inductor's vector-ISA check is skipped (``TORCHINDUCTOR_VEC_ISA_OK=1``). Unset, Inductor
dry-compiles and loads a test program for each ISA the CPU lists (AVX-512 VNNI, AVX-512,
AVX2: ``torch/_inductor/cpu_vec_isa.py``, ``valid_vec_isa_list`` and ``VecISA.check_build``,
each load in a child Python, ``VecISA._probe_load``) into the Inductor cache, which is empty
at the start of each run (above): 10 to 15 s of compiling in every run that compiles, both
passes of ``scripts/test.sh`` included. The variable is Inductor's own switch
(``torch/_inductor/config.py``, ``cpp.vec_isa_ok``: "force usage as specified, without
testing"); it skips the compiler's dry run only. The ISA is still picked as before, from
the CPU's flags (``x86_isa_checker``) and ``ATEN_CPU_CAPABILITY``
(``get_isa_from_cpu_capability``), so each pass compiles for the same ISA as with the check
(AVX-512 VNNI natively, AVX2 under the narrowed pass), and a compiler that could not build it
fails the compile tests loudly instead of falling back. A value set outside is kept."""

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
    # read when torch._inductor.config is imported, which ``import torch`` does not do
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


def pytest_unconfigure(config: pytest.Config) -> None:
    for directory in _SESSION_CACHE:
        shutil.rmtree(directory, ignore_errors=True)
    _SESSION_CACHE.clear()
