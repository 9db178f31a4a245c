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

import contextlib
import os
import sys
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .fake import tree_flatten, tree_map

aten = torch.ops.aten

# Ops whose CPU kernels were measured to allocate internally (benchmarks/accuracy.py and the
# per-op scan in tests/test_probe.py): oneDNN convolution forward and backward, bf16/fp16
# matrix multiplies (oneDNN packing), the oneDNN LSTM layer, and bf16 reductions that
# accumulate in fp32. ``mkldnn_rnn_layer_backward`` reads the forward's opaque oneDNN
# workspace (run on zeros it crashes the process, seen on torch 2.13), so its probe first
# runs the matching forward to make one (``_PREPARE``).
# Matmuls and reductions allocate scratch only in half precision (bf16 packing); the other
# probed ops allocate in every dtype.
_HALF_ONLY_OPS: frozenset[Any] = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten._addmm_activation.default,
        aten.mean.dim,
        # the out= forms Inductor's generated code calls (``extern_kernels.mm(a, b,
        # out=buf0)``, torch/_inductor/select_algorithm.py: ``extern_kernels`` holds
        # torch.mm / addmm / bmm / baddbmm), which pack bf16 as the plain ops do
        aten.mm.out,
        aten.addmm.out,
        aten.bmm.out,
        aten.baddbmm.out,
        # the CPU grouped mm (a Mixtral's experts in transformers >= 5) runs one mm per
        # group, each packing bf16 as mm does: its scratch is the largest group's
        *([aten._grouped_mm.default] if hasattr(aten, "_grouped_mm") else []),
    }
)
PROBED_OPS: frozenset[Any] = _HALF_ONLY_OPS | {
    aten.convolution.default,
    aten.convolution_backward.default,
    aten.mkldnn_rnn_layer.default,
    aten.mkldnn_rnn_layer_backward.default,  # with a real workspace: see _PREPARE
    # fused attention kernels: the CPU flash kernel's scratch, and the eval fast paths of
    # nn.MultiheadAttention / nn.TransformerEncoderLayer, which build q, k, v and the
    # scores inside one op (tests/test_profiler.py measured -32 % without them)
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._native_multi_head_attention.default,
    aten._transformer_encoder_layer_fwd.default,
}

# The largest real call a probe makes (inputs and outputs): beyond it the workspace is unknown.
PROBE_LIMIT_BYTES = 64 * 2**20
UNKNOWN = -1

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_ANY_DTYPE = PROBED_OPS - _HALF_ONLY_OPS


def _rnn_backward_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The oneDNN LSTM backward reads the opaque workspace its forward returned; zeros crash
    the process. Run the matching forward on the probe's tensors to make a real one.

    Positions follow the schemas: backward (input, weight1..4, hx, cx, output, hy, cy,
    grad_output, grad_hy, grad_cy, reverse, mode, hidden_size, num_layers, has_biases, train,
    bidirectional, batch_sizes, batch_first, workspace); forward (input, weight0..3, hx, cx,
    reverse, batch_sizes, mode, hidden_size, num_layers, has_biases, bidirectional,
    batch_first, train).
    """
    new = list(args)
    reverse, mode, hidden_size, num_layers, has_biases, train, bidirectional = args[13:20]
    batch_sizes, batch_first = args[20:22]
    with torch.enable_grad():  # the forward returns its workspace only with grad enabled
        out, hy, cy, workspace = aten.mkldnn_rnn_layer.default(
            *args[:7], reverse, batch_sizes, mode, hidden_size, num_layers, has_biases,
            bidirectional, batch_first, train,
        )  # fmt: skip
    new[7:10] = [out, hy, cy]
    new[22] = workspace
    return tuple(new), kwargs


def _grouped_mm_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``offs`` split evenly: zeros would make every group empty, and the fake run has no
    token counts. The cumulative ends split the dimension the groups share: the
    contraction for 2D x 2D (the weight gradient), ``mat_a``'s rows for 2D x 3D, ``mat_b``'s
    columns for 3D x 2D (the output shapes of torch/_meta_registrations.py,
    ``_create_grouped_mm_output_tensor``). The scratch of the real step's groups, of
    uneven sizes, can differ from the even split's by a little (4 experts, 2 per token:
    37,120 to 39,424 B per group, measured with torch 2.13)."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    if not isinstance(offs, torch.Tensor) or offs.numel() == 0:
        return args, kwargs
    total = a.shape[1] if a.dim() == b.dim() == 2 else a.shape[0] if a.dim() == 2 else b.shape[1]
    groups = offs.numel()
    ends = torch.arange(1, groups + 1, dtype=torch.int64) * total // groups
    offs.copy_(ends.to(offs.dtype))
    return args, kwargs


# Ops whose real arguments must be rebuilt before a probe can run them.
_PREPARE: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, Any]]] = {
    aten.mkldnn_rnn_layer_backward.default: _rnn_backward_args,
    **({aten._grouped_mm.default: _grouped_mm_args} if hasattr(aten, "_grouped_mm") else {}),
}


def wants_probe(func: Any, args: tuple[Any, ...]) -> bool:
    """Whether this op call may allocate a workspace on the CPU.

    Matrix multiplies and reductions only do so in bf16/fp16; convolutions, the oneDNN LSTM
    and the fused attention kernels in every dtype.
    """
    if func not in PROBED_OPS:
        return False
    if func in _ANY_DTYPE:
        return True
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.dtype in _LOW_PRECISION


def _signature(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], autocast: torch.dtype | None
) -> tuple[Any, ...]:
    def key(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
        if isinstance(x, TensorSpec):  # the same key as the tensor it describes
            return ("T", x.shape, x.stride, x.dtype, x.requires_grad)
        if isinstance(x, (list, tuple)):
            return tuple(key(v) for v in x)
        return repr(x)

    # Grad mode and CPU autocast are part of the call: some kernels return different outputs
    # under no_grad, and fused kernels (the TransformerEncoderLayer fast path) run their
    # inner matmuls in the autocast dtype. The caller says whether autocast is on: inside
    # __torch_dispatch__ the autocast key is already excluded, so torch cannot tell.
    return (
        func,
        key(args),
        key(tuple(sorted(kwargs.items()))),
        autocast,
        torch.is_grad_enabled(),
    )


def call_key(call: tuple[Any, tuple[Any, ...], dict[str, Any]]) -> tuple[Any, ...]:
    """The op, argument and keyword part of a call's signature (grad mode and autocast
    left out), for a call of :class:`TensorSpec`s."""
    return _signature(*call, None)[:3]


# Measurements shared by every profile of the process: a kernel's workspace for one call
# signature does not change while the process runs, unless the CPU thread count or the
# oneDNN switch does (both part of the key). A second profile of the same model, or of a
# model sharing layer shapes, runs no kernel twice. Entries hold shapes and sizes only.
_MEASURED: dict[tuple[Any, ...], tuple[int, tuple[int, ...], int]] = {}


def _environment() -> tuple[Any, ...]:
    return (torch.get_num_threads(), torch.backends.mkldnn.enabled)


class KernelProbe:
    """Collects op calls during a fake run; measures their workspaces afterwards, once per
    signature (the cache lives as long as the process: see ``_MEASURED``)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], int] = {}
        self._outputs: dict[tuple[Any, ...], tuple[int, ...]] = {}
        self._retained: dict[tuple[Any, ...], int] = {}
        self._pending: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}
        # every call noted, as (func, args, kwargs) of TensorSpecs: workspace_grid derives
        # the same call at other batch sizes from them
        self._calls: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}

    def request(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        autocast: torch.dtype | None = None,
    ) -> tuple[Any, ...]:
        """Note a call (its tensors' metadata only) and return its key."""
        sig = _signature(func, args, kwargs, autocast)
        if sig not in self._calls:
            meta = tree_map(
                lambda x: TensorSpec(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
            )
            self._calls[sig] = (func, *meta)
        if sig not in self._cache and sig not in self._pending:
            self._pending[sig] = self._calls[sig]
        return sig

    def call_of(self, sig: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """The call noted under ``sig``: (func, args, kwargs), tensors as :class:`TensorSpec`."""
        return self._calls[sig]

    def request_spec(
        self, call: tuple[Any, tuple[Any, ...], dict[str, Any]], like: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        """Note a call made of :class:`TensorSpec`s (one no fake run made: the same op at
        another batch size), in the grad mode and autocast state of the call ``like`` was
        noted in; return its key for :meth:`workspace_bytes`."""
        func, args, kwargs = call
        autocast, grad = like[-2], like[-1]
        with torch.set_grad_enabled(grad):
            sig = _signature(func, args, kwargs, autocast)
        self._calls.setdefault(sig, call)
        if sig not in self._cache and sig not in self._pending:
            self._pending[sig] = call
        return sig

    def workspace_bytes(self, sig: tuple[Any, ...]) -> int:
        """Bytes the kernel allocates and frees inside the call (UNKNOWN if not run)."""
        self._resolve()
        return self._cache.get(sig, UNKNOWN)

    def retained_bytes(self, sig: tuple[Any, ...]) -> int:
        """Bytes a call under CPU autocast leaves in autocast's cast cache (the bf16 copies
        of the weights a fused kernel casts inside): they live until the autocast region
        ends, not just for the call (UNKNOWN if not run; 0 without autocast)."""
        self._resolve()
        return self._retained.get(sig, UNKNOWN)

    def output_bytes(self, sig: tuple[Any, ...], position: int) -> int:
        """Real storage bytes of the call's ``position``-th flattened output (UNKNOWN if not
        run). Fake kernels return 0-byte placeholders for some outputs (the oneDNN LSTM
        layer's workspace, which autograd keeps for backward)."""
        self._resolve()
        sizes = self._outputs.get(sig)
        return UNKNOWN if sizes is None or position >= len(sizes) else sizes[position]

    def _resolve(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        env = _environment()
        runnable = {}
        for sig, call in pending.items():
            measured = _MEASURED.get((sig, env))
            if measured is not None:
                self._cache[sig], self._outputs[sig], self._retained[sig] = measured
            elif _call_bytes(call) <= PROBE_LIMIT_BYTES:
                runnable[sig] = call
                self._cache[sig] = UNKNOWN
            else:
                self._cache[sig] = UNKNOWN
        if runnable:
            for sig, (workspace, outputs, retained) in _measure_workspaces(runnable).items():
                self._cache[sig] = workspace
                self._outputs[sig] = outputs
                self._retained[sig] = retained
                _MEASURED[(sig, env)] = (workspace, outputs, retained)


class TensorSpec:
    """Shape, strides and dtype of a tensor seen in the fake run (no reference to it)."""

    __slots__ = ("dtype", "numel_bytes", "requires_grad", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape = tuple(int(d) for d in t.shape)
        self.stride = tuple(int(s) for s in t.stride())
        self.dtype = t.dtype
        self.requires_grad = t.requires_grad
        self.numel_bytes = self._span_bytes()

    @classmethod
    def of(cls, shape: tuple[int, ...], stride: tuple[int, ...], like: TensorSpec) -> TensorSpec:
        """A tensor of ``like``'s dtype with this shape and these strides."""
        spec = cls.__new__(cls)
        spec.shape, spec.stride = shape, stride
        spec.dtype, spec.requires_grad = like.dtype, like.requires_grad
        spec.numel_bytes = spec._span_bytes()
        return spec

    def _span_bytes(self) -> int:
        if 0 in self.shape:
            return 0
        span = sum((d - 1) * s for d, s in zip(self.shape, self.stride, strict=True)) + 1
        return span * self.dtype.itemsize

    def make(self, leaf_grad: bool = False) -> torch.Tensor:
        """Zeros, not empty (uninitialised memory can hold denormals that slow kernels
        down). ``leaf_grad``: a tensor that required grad in the step (a parameter) does so
        here too, since autocast caches the casts of such leaves only; set for calls under
        autocast with grad disabled, where no graph is built."""
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype).zero_()
        if leaf_grad and self.requires_grad and self.dtype.is_floating_point:
            t.requires_grad_(True)
        return t


def _call_bytes(call: tuple[Any, ...]) -> int:
    return sum(x.numel_bytes for x in tree_flatten(call[1:])[0] if isinstance(x, TensorSpec))


@contextlib.contextmanager
def quiet_stderr_fd() -> Iterator[None]:
    """Silence file descriptor 2 while the profiler starts and stops: kineto writes
    ``USDT ... profiler_start`` lines from C++ (KINETO_LOG_LEVEL is read only at library
    load), and ipykernel forwards fd-level output into the notebook cell."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (some embedded interpreters)
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _measure_workspaces(
    calls: dict[tuple[Any, ...], tuple[Any, ...]],
) -> dict[tuple[Any, ...], tuple[int, tuple[int, ...], int]]:
    """Run each call once under the profiler: (workspace, output sizes, retained).

    The outputs are dropped inside the call's marked range and autocast is left after it, so
    what the range allocated and did not free is what autocast's cast cache kept (retained,
    under autocast only); workspace = in-call peak - output bytes - retained."""
    from torch.profiler import ProfilerActivity, profile, record_function

    keys = list(calls)
    out_bytes: list[int] = []
    out_sizes: list[tuple[int, ...]] = []
    # Each call runs in the grad mode and CPU autocast state the traced call ran in (the
    # signature's last two items): the oneDNN LSTM layer returns the workspace it keeps for
    # backward only with grad enabled. No probe tensor requires grad, so no graph is built.
    with (
        quiet_stderr_fd(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        for i, sig in enumerate(keys):
            func, args, kwargs = calls[sig]
            grad_mode = torch.set_grad_enabled(sig[-1])
            autocast_dtype = sig[-2]
            autocast = (
                torch.autocast("cpu", dtype=autocast_dtype)
                if autocast_dtype is not None
                else contextlib.nullcontext()
            )
            leaf_grad = autocast_dtype is not None and not sig[-1]
            real_args, real_kwargs = tree_map(
                lambda x, grad=leaf_grad: x.make(grad) if isinstance(x, TensorSpec) else x,
                (args, kwargs),
            )
            prepare = _PREPARE.get(func)
            if prepare is not None:  # outside the marker: its allocations are not the op's
                real_args, real_kwargs = prepare(real_args, real_kwargs)
            # an out= form returns a buffer made before the range: not its output bytes
            given = {
                t.untyped_storage().data_ptr()
                for t in tree_flatten((real_args, real_kwargs))[0]
                if isinstance(t, torch.Tensor)
            }
            with grad_mode, autocast, record_function(f"vram_widget_probe_{i}"):
                out = func(*real_args, **real_kwargs)
                # by position in the op's returned tuple; None (no output) is 0 bytes
                outs = out if isinstance(out, (tuple, list)) else (out,)
                sizes = tuple(
                    t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else 0 for t in outs
                )
                storages = {
                    t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in outs
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given
                }
                out_bytes.append(sum(storages.values()))
                out_sizes.append(sizes)
                del out, outs
            del real_args, real_kwargs
    peaks, nets = _peaks_by_marker(prof, len(keys))
    results = {}
    for i, sig in enumerate(keys):
        retained = max(0, nets[i]) if sig[-2] is not None else 0
        results[sig] = (max(0, peaks[i] - out_bytes[i] - retained), out_sizes[i], retained)
    return results


def _peaks_by_marker(prof: Any, n: int) -> tuple[list[int], list[int]]:
    """The peak and the net sum of allocator events inside each ``vram_widget_probe_i``
    range."""
    ranges: dict[int, tuple[int, int]] = {}
    allocations: list[tuple[int, int]] = []
    # Depth-first in recorded order, then a stable sort by time: ties keep that order
    # (as in cpu_trace._cpu_trace).
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
    nets = [0] * n
    for i, (start, end) in ranges.items():
        running = peak = 0
        for _t, nbytes in allocations[bisect_left(times, start) : bisect_right(times, end)]:
            running += nbytes
            peak = max(peak, running)
        peaks[i] = peak
        nets[i] = running
    return peaks, nets
