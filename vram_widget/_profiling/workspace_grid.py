"""CPU kernel workspaces between the batch sizes the fake runs measured them at.

A CPU kernel's scratch is not a line in the batch: oneDNN picks its blocking per shape, so
the bytes step with the rows of a matrix multiply (the bf16 weight-gradient ``mm`` of a
Linear(32, 32) scratches 11,392 B for 8 to 32 rows and 17,536 B for 40 and 64, measured by
:mod:`.probe` with torch 2.13 on one thread). The fake runs measure every workspace at the
batch sizes of their grid (``WORKSPACE_BATCH_SIZES`` and the fit's), and the table
interpolates between them; across a step, the line through its two sides is wrong in
between (there: +3,072 B at 32 rows, between the runs at 24 and 40).

So each workspace's call is derived at the batch sizes between two grid points, without a
fake run: its tensors' shapes and strides are affine in the batch (fitted from the runs at 2
and 3, checked to the element at every other grid batch size of 2 and up), and the kernel is
probed at the derived shapes, as :mod:`.probe` measures any call. A segment whose midpoint
is off the line through its ends is bisected until its ends are neighbours; one on the line
is left to the interpolation. The last segment is not refined: beyond the grid the table
continues its slope (``table.interpolate_columns``). With the grid 1, 2, 3, 5, 8, 32 that is
batch 4, then 6 and 7 where 5-8 is not a line: one or two more probe rounds of the kernels
alone, no fake step.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._estimating.table import Timeline, interpolate_columns
from .probe import UNKNOWN, KernelProbe, TensorSpec, call_key
from .subject import RawTrace

__all__ = ["derive_call", "refined_workspaces"]

Call = tuple[Any, tuple[Any, ...], dict[str, Any]]


class _NotAffine(Exception):
    """A call whose arguments are not affine in the batch size."""


def _line(v0: int, v1: int, b0: int, b1: int, b: int) -> int:
    slope, rest = divmod(v1 - v0, b1 - b0)
    value = v0 + slope * (b - b0)
    if rest or value < 0:
        raise _NotAffine
    return value


def _derive(x0: Any, x1: Any, b0: int, b1: int, b: int) -> Any:
    if isinstance(x0, TensorSpec):
        if (
            not isinstance(x1, TensorSpec)
            or x0.dtype != x1.dtype
            or x0.requires_grad != x1.requires_grad
            or len(x0.shape) != len(x1.shape)
        ):
            raise _NotAffine
        shape = tuple(_line(u, v, b0, b1, b) for u, v in zip(x0.shape, x1.shape, strict=True))
        stride = tuple(_line(u, v, b0, b1, b) for u, v in zip(x0.stride, x1.stride, strict=True))
        return TensorSpec.of(shape, stride, x0)
    if isinstance(x0, (list, tuple)):
        if type(x0) is not type(x1) or len(x0) != len(x1):
            raise _NotAffine
        return type(x0)(_derive(u, v, b0, b1, b) for u, v in zip(x0, x1, strict=True))
    if isinstance(x0, dict):
        if not isinstance(x1, dict) or x0.keys() != x1.keys():
            raise _NotAffine
        return {k: _derive(x0[k], x1[k], b0, b1, b) for k in x0}
    if type(x0) is int and type(x1) is int:  # a size argument (a view's, a split's)
        return _line(x0, x1, b0, b1, b)
    if type(x0) is not type(x1) or repr(x0) != repr(x1):
        raise _NotAffine
    return x0


def derive_call(calls: dict[int, Call], batch_size: int) -> Call | None:
    """The call at ``batch_size`` from the same op's calls at other batch sizes (batch ->
    (func, args, kwargs)): every tensor's shape and strides, and every integer, on the line
    through the calls at the two smallest batch sizes of 2 and up, and every other batch size
    of 2 and up on that line too (None where any is not: the call is not affine in the
    batch).

    Examples
    --------
    >>> import torch
    >>> from vram_widget._profiling.probe import TensorSpec
    >>> def rows(n):  # the weight-gradient mm of a Linear(32, 32) on n rows
    ...     a, b = TensorSpec(torch.empty(n, 32).t()), TensorSpec(torch.empty(n, 32))
    ...     return (torch.ops.aten.mm.default, (a, b), {})
    >>> _func, (a, b), _ = derive_call({2: rows(16), 3: rows(24), 5: rows(40)}, 4)
    >>> a.shape, a.stride, b.shape
    ((32, 32), (1, 32), (32, 32))
    """
    usable = sorted(b for b in calls if b >= 2)
    if len(usable) < 2:
        return None
    b0, b1 = usable[:2]
    try:
        for b in usable[2:]:
            if call_key(_derive(calls[b0], calls[b1], b0, b1, b)) != call_key(calls[b]):
                return None
        derived: Call = _derive(calls[b0], calls[b1], b0, b1, batch_size)
    except _NotAffine:
        return None
    return derived


def refined_workspaces(
    timeline: Timeline, traces: Sequence[RawTrace], probe: KernelProbe
) -> Timeline:
    """``timeline`` with its workspace grid refined between its points (all but the last
    segment) where a workspace is not a line there; ``traces`` are the runs at the grid's
    batch sizes (others are ignored)."""
    grid = [int(b) for b in timeline.workspace_grid]
    by_batch = {t.batch_size: t for t in traces}
    n_ws = timeline.workspace_bytes.shape[0]
    # all but the last segment: beyond the grid the table continues that one's slope
    segments = [(lo, hi) for lo, hi in itertools.pairwise(grid[:-1]) if hi - lo > 1]
    if not n_ws or not segments or any(b not in by_batch for b in grid):
        return timeline
    if any(len(by_batch[b].workspace_signatures) != n_ws for b in grid):
        return timeline
    calls: dict[int, dict[int, Call]] = {}  # workspace -> batch -> call
    likes: dict[int, tuple[Any, ...]] = {}
    for w in range(n_ws):
        sigs = {b: by_batch[b].workspace_signatures[w] for b in grid}
        if all(sig is not None for sig in sigs.values()):
            calls[w] = {b: probe.call_of(sig) for b, sig in sigs.items()}
            likes[w] = sigs[grid[-1]]
    values = {b: timeline.workspace_bytes[:, j].astype(np.int64) for j, b in enumerate(grid)}
    while segments:
        mids = {(lo + hi) // 2: (lo, hi) for lo, hi in segments}
        columns = {m: _column(values, lo, hi, m) for m, (lo, hi) in mids.items()}
        asked: list[tuple[int, int, tuple[Any, ...]]] = []
        for w, by in calls.items():
            for m in mids:
                call = derive_call(by, m)
                if call is not None:
                    asked.append((w, m, probe.request_spec(call, likes[w])))
        off_line: set[int] = set()
        for w, m, sig in asked:
            nbytes = probe.workspace_bytes(sig)
            if nbytes != UNKNOWN and nbytes != columns[m][w]:
                columns[m][w] = nbytes
                off_line.add(m)
        values.update((m, columns[m]) for m in off_line)  # a point on the line adds nothing
        segments = [
            part
            for m in off_line
            for part in ((mids[m][0], m), (m, mids[m][1]))
            if part[1] - part[0] > 1
        ]
    if len(values) == len(grid):
        return timeline
    new_grid = sorted(values)
    return dataclasses.replace(
        timeline,
        workspace_grid=np.asarray(new_grid, dtype=np.int64),
        workspace_bytes=np.stack([values[b] for b in new_grid], axis=1),
    )


def _column(values: dict[int, np.ndarray], lo: int, hi: int, at: int) -> np.ndarray:
    """Every workspace at ``at`` on the line through its values at ``lo`` and ``hi``."""
    both = np.stack([values[lo], values[hi]], axis=1)
    return interpolate_columns(np.asarray([lo, hi], dtype=np.int64), both, at).astype(np.int64)
