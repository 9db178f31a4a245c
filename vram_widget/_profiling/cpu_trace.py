"""The CPU allocator's events of a measured step, as ``torch.profiler.profile(profile_memory=True)``
records them: the marked iteration's events in execution order, their largest prefix sum,
and the bytes of the storages resident before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from .compiled import FORWARD_MARKER

# The name of the record_function range around the measured iteration (CPU only).
_MARKER = "vram_widget.measure:iteration"


@dataclasses.dataclass(frozen=True)
class _AllocEvent:
    """One CPU allocator event as the profiler recorded it."""

    time_ns: int
    nbytes: int  # signed: > 0 an allocation, < 0 a free
    total_allocated: int  # the allocator's running total right after this event


@dataclasses.dataclass(frozen=True)
class _CpuTrace:
    """The CPU allocator's events during a measure call, split at the measured iteration."""

    before: tuple[_AllocEvent, ...]  # from the start of measure until iteration 2
    during: tuple[_AllocEvent, ...]  # iteration 2, in execution order
    after: tuple[_AllocEvent, ...]  # the teardown of the copies
    # every measured iteration's events (``during`` is the first), where several ran
    repeats: tuple[tuple[_AllocEvent, ...], ...] = ()
    # the first model forward's events within the measured iteration
    forward: tuple[_AllocEvent, ...] = ()

    def peak_above_start(self, least: bool = False) -> int:
        """The largest prefix sum of the iteration's events (0 if it never rises); where
        several iterations were measured, the median of theirs (``_run_cpu``), or with
        ``least`` the least."""
        peaks = sorted(
            _max_prefix_sum(e.nbytes for e in it) for it in self.repeats or (self.during,)
        )
        return peaks[0] if least else peaks[len(peaks) // 2]


def _cpu_trace(prof: Any) -> _CpuTrace:
    """The CPU allocator's events from a finished profile, in execution order.

    The event tree (``kineto_results.experimental_event_tree()``) holds every event the
    profiler collected, each allocation a node tagged ``Allocation`` with ``alloc_size``
    (signed) and ``total_allocated`` (the allocator's running total, kept under its lock).
    The profiler stable-sorts each thread's events by their start time (nanoseconds) and keeps
    insertion order for ties; a depth-first walk followed by a stable sort on the time keeps
    that order. The measured iteration is the time range of the ``_MARKER`` node.
    """
    roots = prof.profiler.kineto_results.experimental_event_tree()
    allocations: list[_AllocEvent] = []
    markers: list[Any] = []
    forwards: list[tuple[int, int]] = []
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        tag = node.tag.name
        if tag == "Allocation":
            fields = node.extra_fields
            if fields.device.type == "cpu":
                allocations.append(
                    _AllocEvent(
                        int(node.start_time_ns), int(fields.alloc_size), int(fields.total_allocated)
                    )
                )
        elif tag == "TorchOp" and node.name == _MARKER:
            markers.append(node)
        elif tag == "TorchOp" and node.name == FORWARD_MARKER:
            forwards.append((int(node.start_time_ns), int(node.end_time_ns)))
        stack.extend(reversed(node.children))
    if not markers:  # pragma: no cover - the profiler always records record_function
        raise RuntimeError("the profiler recorded no measured iteration")
    allocations.sort(key=lambda e: e.time_ns)  # stable: ties keep the walk's order
    spans = sorted((int(m.start_time_ns), int(m.end_time_ns)) for m in markers)
    repeats = tuple(
        tuple(e for e in allocations if start <= e.time_ns <= end) for start, end in spans
    )
    first, last = spans[0][0], spans[-1][1]
    inside = sorted(f for f in forwards if spans[0][0] <= f[0] and f[1] <= spans[0][1])
    forward = (
        tuple(e for e in allocations if inside[0][0] <= e.time_ns <= inside[0][1]) if inside else ()
    )
    return _CpuTrace(
        before=tuple(e for e in allocations if e.time_ns < first),
        during=repeats[0],
        after=tuple(e for e in allocations if e.time_ns > last),
        repeats=repeats if len(repeats) > 1 else (),
        forward=forward,
    )


def _max_prefix_sum(values: Iterable[int]) -> int:
    running = peak = 0
    for v in values:
        running += v
        peak = max(peak, running)
    return peak


def _storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the unique storages (by data pointer) of the tensors on ``device``."""
    sizes: dict[int, int] = {}
    for t in tensors:
        if t.device != device or t.layout != torch.strided:
            continue
        if hasattr(t, "to_local"):  # a DTensor (FSDP2): this rank's shard, padding included
            t = t.to_local()
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        sizes[ptr] = max(sizes.get(ptr, 0), storage.nbytes())
    return sum(sizes.values())
