"""Kernel workspaces on the CPU: memory a real kernel allocates and frees *inside* one op.

Fake tensors run meta kernels, which allocate the op's outputs and nothing else. Some CPU
kernels allocate more while they run: oneDNN reorders the input and weight of a convolution
into blocked layouts (about input + weight bytes), bf16 matrix multiplies pack their operands,
the oneDNN LSTM layer keeps a workspace. That memory is live together with the op's inputs and
outputs, so it can set the peak (CNN inference most of all).

For ``device="cpu"`` each distinct call signature of a registered op is run once for real, on
zero-filled CPU tensors of the same shapes, strides and dtypes, under the PyTorch profiler;
its workspace is the peak of the allocator's events inside the call less the bytes of its
outputs. Signatures whose tensors exceed :data:`PROBE_LIMIT_BYTES` are not run: their
workspace is reported unknown (-1), and the table extrapolates it from the batch sizes that
were measured; so a meta-device giant profiles without real memory.
"""

from __future__ import annotations

import os
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import Any

import torch

from ._fake import tree_flatten, tree_map

aten = torch.ops.aten

# Ops whose CPU kernels were measured to allocate internally (benchmarks/accuracy.py and the
# per-op scan in tests/test_probe.py): oneDNN convolution forward and backward, bf16/fp16
# matrix multiplies (oneDNN packing), the oneDNN LSTM layer, and bf16 reductions that
# accumulate in fp32. Not ``mkldnn_rnn_layer_backward``: it reads the forward's opaque oneDNN
# workspace, and run on zeros it crashes the process (seen here on torch 2.13).
PROBED_OPS: frozenset[Any] = frozenset(
    {
        aten.convolution.default,
        aten.convolution_backward.default,
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten._addmm_activation.default,
        aten.mean.dim,
        aten.mkldnn_rnn_layer.default,
    }
)

# The largest real call a probe makes (inputs and outputs): beyond it the workspace is unknown.
PROBE_LIMIT_BYTES = 64 * 2**20
UNKNOWN = -1

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def wants_probe(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether this op call may allocate a workspace on the CPU.

    Matrix multiplies and reductions only do so in bf16/fp16; convolutions and the oneDNN
    LSTM in every dtype.
    """
    if func not in PROBED_OPS:
        return False
    if func in (
        aten.convolution.default,
        aten.convolution_backward.default,
        aten.mkldnn_rnn_layer.default,
    ):
        return True
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.dtype in _LOW_PRECISION


def _signature(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    def key(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
        if isinstance(x, (list, tuple)):
            return tuple(key(v) for v in x)
        return repr(x)

    return (func, key(args), key(tuple(sorted(kwargs.items()))))


class KernelProbe:
    """Collects op calls during a fake run; measures their workspaces afterwards, once per
    signature (the cache lives as long as the profile)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], int] = {}
        self._pending: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}

    def request(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Note a call (its tensors' metadata only) and return its key."""
        sig = _signature(func, args, kwargs)
        if sig not in self._cache and sig not in self._pending:
            meta = tree_map(
                lambda x: _TensorSpec(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
            )
            self._pending[sig] = (func, *meta)
        return sig

    def workspace_bytes(self, sig: tuple[Any, ...]) -> int:
        self._resolve()
        return self._cache.get(sig, 0)

    def _resolve(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        runnable = {
            s: call for s, call in pending.items() if _call_bytes(call) <= PROBE_LIMIT_BYTES
        }
        for sig in pending:
            self._cache[sig] = UNKNOWN
        if runnable:
            self._cache.update(_measure_workspaces(runnable))


class _TensorSpec:
    """Shape, strides and dtype of a tensor seen in the fake run (no reference to it)."""

    __slots__ = ("dtype", "numel_bytes", "requires_grad", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape = tuple(int(d) for d in t.shape)
        self.stride = tuple(int(s) for s in t.stride())
        self.dtype = t.dtype
        self.requires_grad = False
        span = sum((d - 1) * s for d, s in zip(self.shape, self.stride, strict=True)) + 1
        self.numel_bytes = 0 if 0 in self.shape else span * t.element_size()

    def make(self) -> torch.Tensor:
        # zeros, not empty: uninitialised memory can hold denormals that slow kernels down
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype).zero_()


def _call_bytes(call: tuple[Any, ...]) -> int:
    return sum(x.numel_bytes for x in tree_flatten(call[1:])[0] if isinstance(x, _TensorSpec))


def _measure_workspaces(
    calls: dict[tuple[Any, ...], tuple[Any, ...]],
) -> dict[tuple[Any, ...], int]:
    """Run each call once under the profiler; workspace = in-call peak - output bytes."""
    from torch.profiler import ProfilerActivity, profile, record_function

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop chatter
    keys = list(calls)
    out_bytes: list[int] = []
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, sig in enumerate(keys):
            func, args, kwargs = calls[sig]
            real_args, real_kwargs = tree_map(
                lambda x: x.make() if isinstance(x, _TensorSpec) else x, (args, kwargs)
            )
            with record_function(f"vram_widget_probe_{i}"):
                out = func(*real_args, **real_kwargs)
                storages = {
                    t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tree_flatten(out)[0]
                    if isinstance(t, torch.Tensor)
                }
                out_bytes.append(sum(storages.values()))
                del out
            del real_args, real_kwargs
    peaks = _peaks_by_marker(prof, len(keys))
    return {sig: max(0, peaks[i] - out_bytes[i]) for i, sig in enumerate(keys)}


def _peaks_by_marker(prof: Any, n: int) -> list[int]:
    """The peak of allocator events inside each ``vram_widget_probe_i`` range."""
    ranges: dict[int, tuple[int, int]] = {}
    allocations: list[tuple[int, int]] = []
    # Depth-first in recorded order, then a stable sort by time: ties keep that order
    # (as in _measure._cpu_trace).
    stack: list[Any] = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:
        node = stack.pop()
        tag = node.tag.name
        if tag == "Allocation" and node.extra_fields.device.type == "cpu":
            allocations.append((int(node.start_time_ns), int(node.extra_fields.alloc_size)))
        elif tag == "TorchOp" and node.name.startswith("vram_widget_probe_"):
            i = int(node.name.rsplit("_", 1)[1])
            ranges[i] = (int(node.start_time_ns), int(node.end_time_ns))
        stack.extend(reversed(node.children))
    allocations.sort(key=lambda e: e[0])
    times = [t for t, _ in allocations]
    peaks = [0] * n
    for i, (start, end) in ranges.items():
        running = peak = 0
        for _t, nbytes in allocations[bisect_left(times, start) : bisect_right(times, end)]:
            running += nbytes
            peak = max(peak, running)
        peaks[i] = peak
    return peaks


ProbeFactory = Callable[[], KernelProbe]
