"""What the fake step of a pipeline rank counts, and what it holds as a real rank does.

:class:`LiveBytes` counts the live storages of every op's outputs on fake tensors (with the
bytes an op makes and frees within its call beside them); :func:`sends_held` keeps each
``isend``'s tensor alive until the schedule drops its work, as gloo's does. Both serve
``pipeline_parallel.stage_peak``, the pipeline alone or its stages sharded by FSDP2
(``pipeline_fsdp``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._estimating.allocator import round_size
from .tensor_parallel import local_part
from .torchao_weights import torchao_inner

__all__ = ["HeldSend", "LiveBytes", "sends_held"]


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages live now, and their peak: each op's output storages
    counted once from their first sight until their Python object dies (fake tensors keep
    one storage object per storage, as ``torch.distributed._tools.mem_tracker`` relies on),
    at their size of the moment: FSDP2 frees and remakes its unsharded parameters by
    resizing their storages (``free_storage`` / ``alloc_storage``,
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py), which no dispatch mode sees, so
    ``UntypedStorage.resize_`` is followed while the mode is on (as ``mem_tracker``'s
    ``_track_resize`` does). A DTensor counts as its local shard, a torchao tensor subclass
    (float8's ``WeightWithDynamicFloat8CastTensor``, ``Float8TrainingTensor``) as the
    tensors it holds.

    ``cuda``: CUDA semantics. The bytes a CPU op spends within its call (wrapped Python
    numbers, dtype-promotion copies: ``cpu_rules.wrapped_scalar_bytes``,
    ``cpu_rules.promotion_copy_bytes``) are not counted, as the profile's recorder leaves
    them out of a ``device="cuda"`` step, and each storage is also counted as the caching
    allocator's block (``live_blocks`` / ``peak_blocks``: its bytes rounded up to a
    multiple of 512, none for an empty storage: ``allocator.round_size``), the basis of
    ``torch.cuda.memory_allocated``."""

    def __init__(self, probe: Any = None, cuda: bool = False) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.cuda = cuda
        self.live_blocks = 0  # with ``cuda``: the live storages' allocator blocks
        self.peak_blocks = 0
        # storage -> [its bytes, its block's bytes (0 without ``cuda``)]
        self._seen: Any = torch.utils.weak.WeakIdKeyDictionary()
        self.probe = probe  # a probe.KernelProbe: CPU kernels' workspaces (device="cpu")
        self._probed: list[tuple[int, Any]] = []  # (live bytes after the call, signature)
        self._resize: list[Any] = []  # UntypedStorage.resize_ as it was, while on
        # gloo's staging copies of each collective of FSDP2's (pipeline_fsdp.GLOO_STAGING)
        self.staging: dict[Any, Callable[[Any, Any], int]] = {}

    def __enter__(self) -> LiveBytes:
        original = torch.UntypedStorage.resize_
        self._resize.append(original)

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize.pop()  # type: ignore[method-assign]
        super().__exit__(*args)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        cell = self._seen.get(storage)
        if cell is None:
            return
        self._count(cell, storage.nbytes())

    def _block(self, nbytes: int) -> int:
        """The caching allocator's block for ``nbytes`` (with ``cuda``; else 0): resizing a
        storage to nothing frees its block (FSDP2's ``free_storage``)."""
        return round_size(nbytes) if self.cuda and nbytes > 0 else 0

    def _count(self, cell: list[int], nbytes: int) -> None:
        """Set a storage's ``cell`` to ``nbytes`` (and its block), the peaks with it."""
        block = self._block(nbytes)
        self.live_bytes += nbytes - cell[0]
        self.live_blocks += block - cell[1]
        cell[0], cell[1] = nbytes, block
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.peak_blocks = max(self.peak_blocks, self.live_blocks)

    def reset_peak(self) -> None:
        """Count the peak from now on."""
        self.peak_bytes = self.live_bytes
        self.peak_blocks = self.live_blocks
        self._probed.clear()

    def peak_with_workspaces(self) -> int:
        """The peak, where a CPU kernel's workspace (measured once per call signature by the
        probe on real zero tensors, ``probe.py``) lives beside what was live at its call;
        the peak alone without a probe (CUDA's kernels are not probed on the CPU)."""
        peak = self.peak_bytes
        if self.probe is None:
            return peak
        for live, sig in self._probed:
            peak = max(peak, live + max(self.probe.workspace_bytes(sig), 0))
        return peak

    def track(self, t: object) -> None:
        if not isinstance(t, torch.Tensor):
            return
        t = local_part(t)
        inner = torchao_inner(t)
        if inner is not None:  # a torchao tensor subclass: the tensors it holds
            for x in inner:
                self.track(x)
            return
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        cell = [0, 0]
        self._seen[storage] = cell
        self._count(cell, storage.nbytes())
        weakref.finalize(storage, self._free, cell)

    def _free(self, cell: list[int]) -> None:
        self.live_bytes -= cell[0]
        self.live_blocks -= cell[1]

    def rng_states(self) -> contextlib.AbstractContextManager[None]:
        """Count the CPU generator states ``torch.get_rng_state()`` hands out in the block
        (``torch.utils.checkpoint`` keeps one a checkpointed region to its recompute, made in
        C++ outside the dispatcher, which a CPU step's allocator sees)."""
        from .recorder import tracked_rng_states

        return tracked_rng_states(self.track)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from .cpu_rules import promotion_copy_bytes, wrapped_scalar_bytes
        from .meta_dtypes import ANY_DTYPE_OPS
        from .probe import wants_probe

        kwargs = kwargs or {}
        # ops whose meta kernels refuse dtypes their kernels run (a Mixtral's fp32
        # ``_grouped_mm``), run as the profile's recorder runs them
        any_dtype = ANY_DTYPE_OPS.get(func)
        out = func(*args, **kwargs) if any_dtype is None else any_dtype(func, args, kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            self.track(t)
        # the Python numbers the op wraps and the copies it casts live through the call,
        # beside its outputs (as the profile's recorder counts them, CPU semantics): 12 B
        # at AdamW's ``denom`` on the first stage's peak; and gloo's staging copies of a
        # collective of FSDP2's, freed within the call (``staging``); neither on CUDA
        within = 0
        if not self.cuda:
            within = wrapped_scalar_bytes(func, args) + promotion_copy_bytes(func, args, out)
        staged = self.staging.get(func)
        if staged is not None:
            within += staged(args, kwargs)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + within)
        if self.probe is not None and wants_probe(func, args):
            self._probed.append((self.live_bytes, self.probe.request(func, args, kwargs)))
        return out


class HeldSend:
    """A send's ``Work`` that holds the sent tensor as gloo's does (its ``SendWork`` keeps
    the tensor, ``ProcessGroupGloo::send`` in torch/csrc/distributed/c10d/ProcessGroupGloo.cpp),
    where the fake process group's work holds nothing."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work = work
        self.tensor = tensor

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


@contextlib.contextmanager
def sends_held() -> Iterator[None]:
    """While active, each ``isend``'s work holds its tensor until the schedule drops the
    work: a micro-batch's activations (or input gradient) stay alive after the stage lets go
    of them, to the wait the schedule makes at the end of its step
    (torch/distributed/pipelining/schedules.py, ``ScheduleGPipe._step_microbatches``:
    ``fwd_sends_to_wait`` / ``bwd_sends_to_wait``), as on real gloo ranks. Both names are
    patched: ``P2POp`` and ``batch_isend_irecv`` look ``isend`` up in distributed_c10d, the
    stage in ``torch.distributed``."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.isend

    def isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = original(tensor, *args, **kwargs)
        return None if work is None else HeldSend(work, tensor)

    dist.isend = distributed_c10d.isend = isend
    try:
        yield
    finally:
        dist.isend = distributed_c10d.isend = original
