"""Each test runs with the on-disk profile cache off, in an empty cache directory of its own
(the root conftest.py already points the whole run away from the user's cache): tests that
patch the profiler and profile a model again must see the patched profiler run.
tests/test_disk_cache.py turns the cache on for its own tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _own_profile_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    directory = tmp_path_factory.mktemp("profile_cache")
    monkeypatch.setenv("VRAM_WIDGET_CACHE_DIR", str(directory))
    monkeypatch.setenv("VRAM_WIDGET_CACHE", "0")
    return directory


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test: forked gloo ranks compute on one (a fork does not
    keep OpenMP's pool), and CPU kernel scratch can depend on the thread count, so the
    profile's CPU probes run on one too."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def mlp() -> tuple[Any, Any]:
    """The zoo's MLP (784 -> 512 -> 512 -> 10) and its CPU profile, made once per module."""
    import torch

    from vram_widget import profile_model, zoo

    torch.manual_seed(0)
    model = zoo.mlp()
    return model, profile_model(model, input_size=(784,), device="cpu")
