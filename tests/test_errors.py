"""Tests for ``errors.py``: which frames of an exception's traceback are the user's.

The end-to-end checks (a model's forward, backward or loss_fn raising while it is profiled)
are in tests/test_profiler.py."""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from vram_widget._profiling.errors import entry_codes, user_traceback
from vram_widget._profiling.step import compute_loss

_HERE = os.path.abspath(__file__)


def _caught(fn: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def _names(tb: Any) -> list[tuple[str, str]]:
    return [(os.path.abspath(f.filename), f.name) for f in traceback.extract_tb(tb)]


def _outer() -> None:
    _inner()


def _inner() -> None:
    raise KeyError("x")


def test_leading_frames_before_the_entry_are_dropped() -> None:
    exc = _caught(_outer)
    full = _names(exc.__traceback__)
    assert [name for _f, name in full][-2:] == ["_outer", "_inner"]
    # from the entry point on
    trimmed = _names(user_traceback(exc.__traceback__, entry_codes([_inner])))
    assert trimmed == [(_HERE, "_inner")]
    # no entry point given: the first frame that is neither ours nor torch's (pytest's own
    # frames count as the user's here), then everything after it
    assert _names(user_traceback(exc.__traceback__)) == full


def test_torch_plumbing_between_user_frames_is_dropped() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))

    def call() -> None:
        model(torch.zeros(1, 5))

    exc = _caught(call)
    names = [n for _f, n in _names(exc.__traceback__)]
    assert "_call_impl" in names  # nn.Module.__call__ is there before trimming
    trimmed = _names(user_traceback(exc.__traceback__, entry_codes([call])))
    assert [n for _f, n in trimmed] == ["call", "forward", "forward"]


def test_an_error_raised_by_this_package_keeps_every_frame() -> None:
    # compute_loss (vram_widget/_profiling/step.py) raising is ours to report whole
    exc = _caught(lambda: compute_loss(torch.zeros(2, 3), lambda out: out))
    assert isinstance(exc, ValueError)
    tb = exc.__traceback__
    assert user_traceback(tb, entry_codes([_outer])) is tb
    assert user_traceback(None) is None


def test_entry_codes_unwrap_decorators() -> None:
    @functools.wraps(_inner)
    def wrapper() -> None:
        _inner()

    assert entry_codes([wrapper, None, len]) == {_inner.__code__}
