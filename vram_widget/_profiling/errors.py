"""Tracebacks of the user's exceptions, trimmed to the user's code.

When a model's forward (or a ``loss_fn``) raises while it is profiled, the profiler raises a
``ProfilingError`` with a one-line context *from* the user's exception. That exception's
traceback would start with a dozen frames of the profiler, ``functional_call`` and
``nn.Module.__call__``, and end in the recorder's dispatch mode and the fake tensor
implementation of the failing op: none of them the user's code. ``user_traceback`` keeps the
frames from the model's ``forward`` (or the first frame that is neither this package's nor
torch's) up to the point where an op entered this package's dispatch mode or hooks, without
torch's call plumbing (``nn.Module.__call__``, dynamo's "disable" wrappers) in between. An
exception raised by this package's own code is left whole: that is a bug of ours, and its
frames are what a report needs.
"""

from __future__ import annotations

import inspect
import os
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# Call plumbing, never the user's code: nn.Module's _wrapped_call_impl / _call_impl / inner
# (between a module call and its forward), and the torch._dynamo "disable" wrappers
# (torch/_compile.py, torch/_dynamo/eval_frame.py) that an op passes through on its way into
# a dispatch mode.
_PLUMBING_FILES = (
    os.path.join(_TORCH_DIR, "nn", "modules", "module.py"),
    os.path.join(_TORCH_DIR, "_compile.py"),
)
_PLUMBING_DIR = os.path.join(_TORCH_DIR, "_dynamo") + os.sep


def _filename(tb: types.TracebackType) -> str:
    return os.path.abspath(tb.tb_frame.f_code.co_filename)


def _is_ours(tb: types.TracebackType) -> bool:
    return _filename(tb).startswith(_PACKAGE_DIR)


def _is_torch(tb: types.TracebackType) -> bool:
    return _filename(tb).startswith(_TORCH_DIR)


def _is_plumbing(tb: types.TracebackType) -> bool:
    name = _filename(tb)
    return name in _PLUMBING_FILES or name.startswith(_PLUMBING_DIR)


def entry_codes(functions: Iterable[Callable[..., Any] | None]) -> frozenset[types.CodeType]:
    """The code objects of the user's entry points (a forward, a loss_fn), unwrapped."""
    codes = set()
    for fn in functions:
        if fn is None:
            continue
        code = getattr(inspect.unwrap(fn), "__code__", None)
        if isinstance(code, types.CodeType):
            codes.add(code)
    return frozenset(codes)


def user_traceback(
    tb: types.TracebackType | None, entries: frozenset[types.CodeType] = frozenset()
) -> types.TracebackType | None:
    """``tb`` trimmed to the user's frames (see the module docstring); ``tb`` itself where it
    ends in this package's code or no frame would be left."""
    frames: list[types.TracebackType] = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    if not frames:
        return None
    if _is_ours(frames[-1]):
        return frames[0]  # raised by this package itself: a bug of ours, keep every frame
    start = next((i for i, f in enumerate(frames) if f.tb_frame.f_code in entries), None)
    if start is None:
        start = next(
            (i for i, f in enumerate(frames) if not _is_ours(f) and not _is_torch(f)), None
        )
    if start is None:
        return frames[0]
    end = next((i for i in range(start, len(frames)) if _is_ours(frames[i])), len(frames))
    kept = [f for f in frames[start:end] if not _is_plumbing(f)]
    if not kept:
        return frames[0]
    trimmed: types.TracebackType | None = None
    for f in reversed(kept):
        trimmed = types.TracebackType(trimmed, f.tb_frame, f.tb_lasti, f.tb_lineno)
    return trimmed


__all__ = ["entry_codes", "user_traceback"]
