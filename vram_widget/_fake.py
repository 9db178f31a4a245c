"""Every import from a private torch namespace lives here, so that a torch release that moves
one of them breaks one file, and the rest of the package only uses public names.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch._C._autograd import _get_sequence_nr
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "DATA_DEPENDENT_ERRORS",
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "current_autograd_sequence_nr",
    "new_fake_mode",
    "next_sequence_nr",
    "quiet_fake_tensor_log",
    "tree_flatten",
    "tree_map",
]

# Errors a FakeTensor raises when an op's output depends on tensor values (``nonzero``,
# ``.item()``, ...) or when an op has no fake/meta kernel: the profiler falls back to a
# real run at a tiny batch for these.
DATA_DEPENDENT_ERRORS: tuple[type[BaseException], ...] = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)


def new_fake_mode() -> FakeTensorMode:
    """A FakeTensorMode that converts stray real tensors (constants held as plain attributes)
    on the fly instead of raising. Its dispatch cache stays on: it is shared across modes,
    so the second and later runs of a model mostly hit it (3-4x faster here)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs a full traceback at ERROR level before re-raising a failed meta
    kernel; the profiler turns that failure into its own one-line message, so the log would
    only put a traceback wall in the user's notebook."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def next_sequence_nr() -> int:
    """The sequence number autograd will give the next node created on this thread.

    Autograd creates an op's backward node before it redispatches below autograd, so inside
    ``__torch_dispatch__`` every node with a number below this one already exists.
    """
    return int(_get_sequence_nr())


def current_autograd_sequence_nr() -> int | None:
    """The sequence number of the autograd node whose backward is running, or None."""
    node: Any = torch._C._current_autograd_node()
    return None if node is None else int(node._sequence_nr())
