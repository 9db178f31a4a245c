"""The recorder: a TorchDispatchMode that sees every aten op of a step and writes down each
storage's allocation and death, the module and phase it happened in, what autograd saved,
and the FLOPs of each op.

It works the same on fake and on real tensors (the real path is the fallback for models
whose ops fake tensors cannot run).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._estimating.options import CATEGORY_CODE, PHASE_CODE, Category, Phase
from .collectives import collective_of
from .compiled_graphs import graph_running
from .cpu_rules import (
    batch_norm_scratch_bytes,
    gloo_staging_bytes,
    kept_scalar_bytes,
    promotion_copy_bytes,
    unallocated_outputs,
    wrapped_scalar_bytes,
)
from .fake import (
    TorchDispatchMode,
    current_autograd_node_name,
    current_autograd_sequence_nr,
    next_sequence_nr,
    tree_flatten,
)
from .flops import op_flops
from .meta_dtypes import ANY_DTYPE_OPS, AUTOCAST_FUSED_OPS, in_dtype
from .probe import KernelProbe, wants_probe
from .tensor_parallel import DTENSOR_TYPES, WAITS_RETURN_INPUT, local_part

_TEMPORARY = CATEGORY_CODE[Category.TEMPORARY]
_ACTIVATION = CATEGORY_CODE[Category.ACTIVATION]
_BACKWARD = PHASE_CODE[Phase.BACKWARD]
_OPTIMIZER = PHASE_CODE[Phase.OPTIMIZER]
_ZERO_GRAD = PHASE_CODE[Phase.ZERO_GRAD]

# Matrix-multiply ops: the first one a CUDA stream runs allocates the cuBLAS workspace.
_MATMUL_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "addbmm", "dot"}
)


@dataclass
class StorageRecord:
    """One storage seen by the recorder."""

    nbytes: int
    module: int
    phase: int
    category: int
    resident: bool  # allocated before recording began (parameters, buffers, inputs, ...)
    saved: bool = False  # packed by autograd for backward
    placeholder: bool = False  # an output of a probed op: the probe measures its real size


@dataclass(frozen=True)
class Events:
    """Allocation (+) and free (-) events in execution order."""

    storage: np.ndarray  # int64 storage id (index into the recorder's storages)
    delta_bytes: np.ndarray  # int64, signed
    module: np.ndarray  # int32 row of the module running
    phase: np.ndarray  # int8 phase code
    op: np.ndarray  # int32 index into Recorder.op_names of the op running (-1: none)


# The autograd node of a compiled region's backward (AOTAutograd's ``CompiledFunction``,
# torch/_functorch/_aot_autograd/runtime_wrappers.py).
_COMPILED_NODE = "CompiledFunctionBackward"


class Recorder(TorchDispatchMode):
    """Records allocations, frees, saved tensors and FLOPs.

    ``rows`` maps ``id(module)`` to the module's row in the profile table; ``loss_row`` is the
    pseudo-row for work done outside the model (the loss) and ``optimizer_row`` for the
    optimizer step.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode.__init_subclass__ wraps a subclass's __torch_dispatch__ in
        # torch._disable_dynamo where this says True (torch/utils/_python_dispatch.py), a
        # wrapper paid on every op of every run (its own frame plus dynamo's eval-frame
        # switch). No torch.compile frame is traced inside a profiling run, so the recorder
        # goes without it, as the profiler's FakeTensorMode does (fake.py): the two
        # wrappers cost about 5 % of a recorded GPT-2 small step (median of 7 A/B pairs
        # in one process).
        return False

    def __init__(
        self,
        rows: dict[int, int],
        loss_row: int,
        optimizer_row: int,
        probe: KernelProbe | None = None,
        autocast_dtype: torch.dtype | None = None,
        cpu_semantics: bool = False,
        count_flops: bool = True,
    ) -> None:
        super().__init__()
        self.count_flops = count_flops
        # CPU semantics: a Python number passed where an op takes a Tensor costs a 0-dim
        # tensor and a cast copy inside the op (wrapped_scalar_bytes), and a pointwise op
        # on mixed dtypes copies its inputs to the computation dtype (promotion_copy_bytes)
        self.cpu_semantics = cpu_semantics
        self.probe = probe
        # CPU autocast of amp precisions covers the forward (and inference) pass only
        self.autocast_dtype = autocast_dtype
        self._autocast_phases = tuple(
            PHASE_CODE[p] for p in (Phase.FORWARD, Phase.INFERENCE, Phase.PREFILL, Phase.DECODE)
        )
        # (storage id, probe signature, output position, or -1 for the workspace, or
        # _RETAINED for what the call leaves in autocast's cast cache)
        self._probe_slots: list[tuple[int, tuple[Any, ...], int]] = []
        # storages of cast-cache bytes still held: freed when the autocast region ends
        self._retained_open: list[int] = []
        self.rows = rows
        self.loss_row = loss_row
        self.optimizer_row = optimizer_row
        n_rows = optimizer_row + 1
        self.flops_forward = np.zeros(n_rows, dtype=np.int64)
        self.flops_backward = np.zeros(n_rows, dtype=np.int64)
        self.output_shapes: list[tuple[int, ...] | None] = [None] * n_rows
        self.storages: list[StorageRecord] = []
        self.uses_matmul = False
        self.phase = PHASE_CODE[Phase.FORWARD]
        self._module_stack: list[int] = [loss_row]
        # The row of the last op dispatched in backward: the autograd engine frees a node's
        # saved tensors and consumed gradient buffers right after the node runs, outside any
        # op, so those frees belong to that node's module (not to the loss, where the module
        # stack stands during backward).
        self._backward_row = loss_row
        self._input_stack: list[tuple[int, Any]] = []
        self._live: dict[int, int] = {}  # id(storage object) -> storage id
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._ev_storage: list[int] = []
        self._ev_delta: list[int] = []
        self._ev_module: list[int] = []
        self._ev_phase: list[int] = []
        # The op (forward) or autograd node (backward) running at each event, as an index
        # into op_names: where the peak falls inside a module's own code (a root's loss, a
        # block's attention math), this names what runs there.
        self._ev_op: list[int] = []
        self.op_names: list[str] = []
        self._op_code: dict[Any, int] = {}
        self._op = -1
        self._seq_module: dict[int, int] = {}
        self._seq_seen = next_sequence_nr()
        self._recording = True
        # Gradient accumulation in the autograd engine (see watch_accumulations): the
        # sequence number of the node whose outputs are being added into input buffers, and
        # an out-of-place sum waiting to learn whether the real run would have summed in place
        self._accumulating_after: int | None = None
        self._pending_sum: _PendingSum | None = None
        # CPU: a Python number autograd keeps for backward (``x * 0.5``), by the sequence
        # number of the node that keeps it -> its storage id (see kept_scalar_bytes)
        self._kept_scalars: dict[int, int] = {}
        # CPU: gloo's staging copy of a reduce-scatter's input, by the storage of the
        # collective's output -> its storage id, freed at that output's wait_tensor
        self._gloo_staged: dict[int, int] = {}
        self._recompute_depth = 0  # inside a checkpointed forward's re-run (recompute_region)
        self.model_returned = False  # the root module's forward has returned
        # (exception key, row, input shapes) of the innermost module a forward raised from
        self.failure: tuple[tuple[int, str, str], int, str] | None = None
        # (exception key, op) of the op whose kernel raised, if one did
        self.failed_op: tuple[tuple[int, str, str], str] | None = None
        # a tensor-parallel run (tensor_parallel.py): outputs on the meta device are shapes
        # only (DTensor takes a global stride from a meta tensor), not memory
        self.meta_is_shape_only = False
        # a parallel rank's run: the collectives its ops issue, in order (None: not recorded)
        self.collectives: list[Any] | None = None

    # -- storages -------------------------------------------------------------------------
    def register_resident(
        self, tensors: Iterable[torch.Tensor], category: Category, rows: Iterable[int] = ()
    ) -> list[int]:
        """Mark storages that exist before recording (no allocation event), owned by ``rows``.
        Returns their ids (a storage already registered keeps its first category and row:
        tied weights count once)."""
        ids = []
        row_iter = iter(rows)
        for t in tensors:
            row = next(row_iter, -1)
            st = local_part(t).untyped_storage()
            key = id(st)
            if key in self._live:
                ids.append(self._live[key])
                continue
            sid = self._new_storage(
                st, StorageRecord(st.nbytes(), row, -1, CATEGORY_CODE[category], resident=True)
            )
            ids.append(sid)
        return ids

    def storage_id(self, t: torch.Tensor) -> int | None:
        # a DTensor (a tensor-parallel rank's gradient) holds no storage: its local shard does
        return self._live.get(id(local_part(t).untyped_storage()))

    def _new_storage(self, st: Any, record: StorageRecord) -> int:
        sid = len(self.storages)
        self.storages.append(record)
        key = id(st)
        self._live[key] = sid
        self._refs[key] = weakref.ref(st, functools.partial(self._on_free_ref, key))
        return sid

    def _on_free_ref(self, key: int, _ref: object) -> None:
        self._on_free(key)

    def _on_free(self, key: int) -> None:
        sid = self._live.pop(key, None)
        self._refs.pop(key, None)
        if sid is None or not self._recording:
            return
        pending = self._pending_sum
        if pending is not None and pending.old_key == key:
            # The buffer held the last reference to the old gradient: a real run would have
            # summed into it, so its storage lives on as the sum's and is not freed here.
            self._pending_sum = None
            out_st = pending.out_storage()
            if out_st is not None:
                out_key = id(out_st)
                self._live[out_key] = sid
                self._refs[out_key] = weakref.ref(
                    out_st, functools.partial(self._on_free_ref, out_key)
                )
                return
        record = self.storages[sid]
        if record.nbytes or record.placeholder:
            self._emit(sid, -record.nbytes, self._free_row())

    def track_host_tensor(self, t: torch.Tensor) -> None:
        """Record a tensor made outside the dispatcher (C++ code that allocates directly, as
        ``torch.get_rng_state()`` does): allocated now, freed when its storage dies."""
        st = t.untyped_storage()
        if not self._recording or id(st) in self._live:
            return
        row = self._free_row()
        record = StorageRecord(st.nbytes(), row, self.phase, _TEMPORARY, False)
        self._emit(self._new_storage(st, record), record.nbytes, row)

    def _free_row(self) -> int:
        """Whose a free is: the backward node that just ran, the optimizer (its step and its
        ``zero_grad``), or the module running."""
        if self.phase == _BACKWARD:
            return self._backward_row
        if self.phase == _OPTIMIZER or self.phase == _ZERO_GRAD:
            return self.optimizer_row
        return self._module_stack[-1]

    def _emit(self, sid: int, delta: int, module: int) -> None:
        self._ev_storage.append(sid)
        self._ev_delta.append(delta)
        self._ev_module.append(module)
        self._ev_phase.append(self.phase)
        self._ev_op.append(self._op)

    def op_that_raised(self, exc: BaseException) -> str:
        """The op whose kernel raised ``exc`` ("aten._grouped_mm.default"), or "" where the
        exception came from the model's own code."""
        if self.failed_op is not None and self.failed_op[0] == _exception_key(exc):
            return self.failed_op[1]
        return ""

    def _set_op(self, func: Any) -> None:
        """Note the op being dispatched: in backward, the autograd node running it."""
        key: Any = func
        if self.phase == _BACKWARD:
            key = current_autograd_node_name() or func
        code = self._op_code.get(key)
        if code is None:
            name = (
                key if isinstance(key, str) else f"{func.namespace}.{func.overloadpacket.__name__}"
            )
            code = self._op_code[key] = len(self.op_names)
            self.op_names.append(name)
        self._op = code

    # -- modules --------------------------------------------------------------------------
    def enter_module(self, module: torch.nn.Module, args: Any) -> None:
        row = self.rows.get(id(module), self._module_stack[-1])
        self._module_stack.append(row)
        self._input_stack.append((row, args))

    def exit_module(self, module: torch.nn.Module, output: Any) -> None:
        """Called when a forward returns, and also when it raises (``always_call``): the
        stack is popped either way, so that no reference to a call's inputs outlives the call
        (non-reentrant checkpointing stops its recompute by raising through the forwards)."""
        if len(self._module_stack) > 1:
            row = self._module_stack.pop()
            _row, args = self._input_stack.pop()
            exc = sys.exc_info()[1]
            if exc is not None:
                # The innermost module sees the exception first: describe its call (shapes
                # only); outer modules see the same exception. Neither the tensors nor the
                # exception are kept: its traceback holds the frames, and their tensors.
                key = _exception_key(exc)
                if self.failure is None or self.failure[0] != key:
                    self.failure = (key, row, describe_args(args))
                return
            if row == 0:
                self.model_returned = True
            if self.output_shapes[row] is None:
                # The first tensor of the output, or rather its first non-scalar one: a
                # Hugging Face ModelOutput puts the 0-dim loss before the logits.
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
                shown = next((t for t in tensors if t.dim() > 0), tensors[0] if tensors else None)
                if shown is not None:
                    self.output_shapes[row] = tuple(int(d) for d in shown.shape)

    def failed_call(self, exc: BaseException) -> tuple[int, str] | None:
        """The row and input shapes of the innermost module that ``exc`` came out of."""
        if self.failure is not None and self.failure[0] == _exception_key(exc):
            return self.failure[1], self.failure[2]
        return None

    def set_phase(self, phase: Phase) -> None:
        self._settle_pending_sum()
        self._accumulating_after = None
        if self.phase in self._autocast_phases and PHASE_CODE[phase] not in self._autocast_phases:
            self._close_retained()  # the forward's autocast region has ended
        self.phase = PHASE_CODE[phase]

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside: tensors made here are no device memory (the host copies
        of activation offloading), and their storages are never tracked."""
        recording, self._recording = self._recording, False
        try:
            yield
        finally:
            self._recording = recording

    def stop(self) -> None:
        self._settle_pending_sum()
        if self._recording:
            self._close_retained()
            # numbers kept by nodes the backward never ran (outputs outside the loss) die
            # with the graph, when the step lets go of its outputs
            for seq in list(self._kept_scalars):
                self._release_kept_scalar(seq)
        self._recording = False

    def _close_retained(self) -> None:
        """Autocast clears its cast cache when its region ends: the weight casts fused
        kernels made inside their calls are freed here (sized by ``apply_probes``)."""
        row = self._free_row()
        for sid in self._retained_open:
            self._emit(sid, 0, row)
        self._retained_open.clear()

    # -- gradient accumulation ------------------------------------------------------------
    def watch_accumulations(self, root: torch.Tensor) -> None:
        """Let the recorder see where the autograd engine sums gradients.

        When a tensor feeds several ops, the engine sums the gradients it receives into the
        consumer's input buffer (``InputBuffer::accumulate``, torch/csrc/autograd/
        input_buffer.cpp). A real step sums in place, ``old += new``, when the buffer holds
        the last reference to a dense ``old`` (``can_accumulate_inplace``); that test also
        requires ``!isTensorSubclassLike(old)``, which is false for every tensor while a
        dispatch mode is active, so a profiled step always sums out of place: one extra
        gradient-sized allocation each time (+2.4 % at the peak of an
        ``nn.MultiheadAttention`` step). The engine runs those sums right after a node's
        post-hooks, with that node still current: a post-hook on every node of the graph
        marks them, and ``__torch_dispatch__`` undoes the extra allocation (see
        ``_PendingSum``)."""
        grad_fn = root.grad_fn
        if grad_fn is None:
            return
        seen = {id(grad_fn)}
        stack = [grad_fn]
        while stack:
            node = stack.pop()
            # A leaf's AccumulateGrad has no outputs (nothing is summed after it), and it
            # can outlive the graph on a parameter shared by later runs: no hook there.
            name = type(node).__name__
            if name == _COMPILED_NODE:
                # a post-hook makes the engine keep the node's incoming gradients until the
                # hook has run (Engine call_function, torch/csrc/autograd/engine.cpp: with
                # post-hooks it calls ``fn(inputs_copy)``), where the compiled backward frees
                # its tangents as it goes (``del tangents_1`` in Inductor's code): marked
                # before it runs instead, its own sums told apart by ``graph_running``
                seq = int(node._sequence_nr())
                node.register_prehook(functools.partial(self._compiled_node_runs, seq))
            elif name != "AccumulateGrad":
                seq = int(node._sequence_nr())
                node.register_hook(functools.partial(self._node_ran, seq))
            for next_node, _input_nr in node.next_functions:
                if next_node is not None and id(next_node) not in seen:
                    seen.add(id(next_node))
                    stack.append(next_node)

    def _compiled_node_runs(self, seq: int, _grad_outputs: Any) -> None:
        self._node_ran(seq, None, _grad_outputs)

    def _node_ran(self, seq: int, _grad_inputs: Any, _grad_outputs: Any) -> None:
        self._settle_pending_sum()
        self._accumulating_after = seq
        # the engine releases a node's saved variables right after its post-hooks
        # (Engine::evaluate_function, torch/csrc/autograd/engine.cpp: release_variables)
        self._release_kept_scalar(seq)

    @contextmanager
    def recompute_region(self) -> Iterator[None]:
        """A checkpointed forward re-run in the backward. The nodes it makes never run (the
        re-run keeps what it recomputes detached: torch/utils/checkpoint.py,
        ``_recomputation_hook``), so the numbers they keep die with that graph, when the
        re-run ends."""
        before = set(self._kept_scalars)
        self._recompute_depth += 1
        try:
            yield
        finally:
            self._recompute_depth -= 1
            for seq in [s for s in self._kept_scalars if s not in before]:
                self._release_kept_scalar(seq)

    def _release_kept_scalar(self, seq: int) -> None:
        sid = self._kept_scalars.pop(seq, None)
        if sid is not None and self._recording:
            self._emit(sid, -self.storages[sid].nbytes, self._free_row())

    def _is_buffer_sum(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """An out-of-place ``old + new`` the engine runs to accumulate gradients, where ``old``
        is dense and not a view (a real step may then sum in place)."""
        if func is not _ADD or kwargs or self._accumulating_after is None:
            return False
        if current_autograd_sequence_nr() != self._accumulating_after:
            return False
        if graph_running():  # a sum inside a compiled backward, not the engine's
            return False
        old, new = args
        return (
            isinstance(old, torch.Tensor)
            and isinstance(new, torch.Tensor)
            and old.shape == new.shape
            and old.dtype == new.dtype
            # a view keeps its base's TensorImpl alive: two references to the storage
            and not old._is_view()
            and _non_overlapping_and_dense(old)
        )

    def _settle_pending_sum(self) -> None:
        """The old gradient of a pending sum outlived it (something else holds it): a real
        step sums out of place too, so the sum is an allocation after all, at its place."""
        pending = self._pending_sum
        if pending is None:
            return
        self._pending_sum = None
        out_st = pending.out_storage()
        if out_st is None or id(out_st) in self._live:
            return
        sid = self._new_storage(
            out_st, StorageRecord(pending.nbytes, pending.row, self.phase, _TEMPORARY, False)
        )
        at = pending.event_index
        self._ev_storage.insert(at, sid)
        self._ev_delta.insert(at, pending.nbytes)
        self._ev_module.insert(at, pending.row)
        self._ev_phase.insert(at, _BACKWARD)
        self._ev_op.insert(at, pending.op)

    # -- autograd -------------------------------------------------------------------------
    def pack_hook(self, t: torch.Tensor) -> torch.Tensor:
        sid = self._live.get(id(local_part(t).untyped_storage()))
        if sid is not None:
            self.storages[sid].saved = True
        return t

    @staticmethod
    def unpack_hook(t: torch.Tensor) -> torch.Tensor:
        return t

    # -- dispatch -------------------------------------------------------------------------
    def _current_row(self) -> int:
        if self.phase == _BACKWARD:
            seq = current_autograd_sequence_nr()
            if seq is None:
                self._backward_row = self.loss_row  # the engine seeding the loss gradient
            else:
                # AccumulateGrad and other nodes created outside our ops have no row of their
                # own; the engine runs AccumulateGrad (highest priority) right after the node
                # that produced its gradient, so it stays with that node's module.
                self._backward_row = self._seq_module.get(seq, self._backward_row)
            return self._backward_row
        if self.phase == _OPTIMIZER:
            return self.optimizer_row
        row = self._module_stack[-1]
        # Every autograd node created since the last op belongs to the module running now.
        seq = next_sequence_nr()
        for s in range(self._seq_seen, seq):
            self._seq_module[s] = row
        self._seq_seen = seq
        return row

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t in DTENSOR_TYPES for t in types):
            # A tensor-parallel rank's op (tensor_parallel.py): DTensor runs it on the local
            # shards, which come back through this mode and are recorded there; the
            # DTensor's own storage stands for the global tensor, not for memory.
            return NotImplemented
        kwargs = kwargs or {}
        if self.collectives is not None:
            collective = collective_of(func, args, kwargs)
            if collective is not None:
                self.collectives.append(collective)
        if self._pending_sum is not None:
            self._settle_pending_sum()
        row = self._current_row()
        if self._recording:
            self._set_op(func)
        try:
            if func in ANY_DTYPE_OPS:
                out = ANY_DTYPE_OPS[func](func, args, kwargs)
            else:
                out = func(*args, **kwargs)
            if func in WAITS_RETURN_INPUT:
                # eager wait_tensor returns the tensor it waited on; its fake kernel, a new
                # one of the same shape
                out = args[0]
        except Exception as exc:
            self.failed_op = (_exception_key(exc), str(func))
            raise
        if not self._recording:
            return out
        if (
            func in AUTOCAST_FUSED_OPS
            and self.autocast_dtype is not None
            and self.phase in self._autocast_phases
        ):
            out = in_dtype(out, self.autocast_dtype)
        if self.phase == _BACKWARD and self._is_buffer_sum(func, args, kwargs):
            st = out.untyped_storage()
            if id(st) not in self._live:
                # Hold the allocation until the old gradient's fate is known (_on_free).
                self._pending_sum = _PendingSum(
                    old_key=id(args[0].untyped_storage()),
                    out_storage=weakref.ref(st),
                    nbytes=st.nbytes(),
                    row=row,
                    event_index=len(self._ev_delta),
                    op=self._op,
                )
                return out
        input_storages: set[int] | None = None
        probed = self.probe is not None and wants_probe(func, args)
        placeholders: list[tuple[int, int]] = []  # (output position, storage id)
        # CPU semantics: outputs the CPU kernel leaves undefined cost nothing (cpu_rules)
        unallocated = unallocated_outputs(func, args) if self.cpu_semantics else frozenset()
        for position, t in enumerate(_leaves(out)):
            if not isinstance(t, torch.Tensor) or (
                self.meta_is_shape_only and t.device.type == "meta"
            ):
                continue
            st = t.untyped_storage()
            key = id(st)
            sid = self._live.get(key)
            if sid is not None:
                record = self.storages[sid]
                nbytes = st.nbytes()
                if nbytes != record.nbytes:  # resize_ / out= ops grow a storage in place
                    self._emit(sid, nbytes - record.nbytes, row)
                    record.nbytes = nbytes
                continue
            if input_storages is None:
                input_storages = _arg_storages(args, kwargs)
            if key in input_storages:
                continue  # a view of memory that existed before recording: not an allocation
            nbytes = 0 if position in unallocated else st.nbytes()
            record = StorageRecord(nbytes, row, self.phase, _TEMPORARY, False)
            sid = self._new_storage(st, record)
            if probed:
                # The probe gives each output's real size: fake kernels return empty
                # placeholders for some (the oneDNN LSTM workspace).
                record.placeholder = True
                self._emit(sid, nbytes, row)
                placeholders.append((position, sid))
            elif nbytes:
                self._emit(sid, nbytes, row)
        if probed:
            self._reserve_workspace(func, args, kwargs, row, placeholders)
        if self.cpu_semantics:
            scratch = batch_norm_scratch_bytes(func, args)
            if scratch:  # allocated and freed inside the call, beside its outputs
                self._emit(self._allocated_untracked(scratch, row), -scratch, row)
            self._count_host_scalars(func, args, out, row)
            self._gloo_staging(func, args, out, row)
        flops = op_flops(func, args, kwargs, out) if self.count_flops else 0
        if flops:
            if self.phase == _BACKWARD:
                self.flops_backward[row] += flops
            else:
                self.flops_forward[row] += flops
        if not self.uses_matmul and _is_matmul(func):
            self.uses_matmul = True
        return out

    def _gloo_staging(self, func: Any, args: tuple[Any, ...], out: Any, row: int) -> None:
        """CPU: the staging copy gloo makes for a reduce-scatter (``cpu_rules.
        gloo_staging_bytes``), allocated after its output and freed at its wait."""
        staged = gloo_staging_bytes(func, args)
        if staged:
            first = out[0] if isinstance(out, (list, tuple)) else out
            key = id(local_part(first).untyped_storage())
            self._gloo_staged[key] = self._allocated_untracked(staged, row)
        elif func in WAITS_RETURN_INPUT and self._gloo_staged:
            sid = self._gloo_staged.pop(id(local_part(args[0]).untyped_storage()), None)
            if sid is not None:
                self._emit(sid, -self.storages[sid].nbytes, row)

    def _allocated_untracked(self, nbytes: int, row: int) -> int:
        """A storage no tensor of the run stands for (a wrapped number, a kernel's scratch),
        allocated now; returns its id (its free is the caller's to emit)."""
        sid = len(self.storages)
        self.storages.append(StorageRecord(nbytes, row, self.phase, _TEMPORARY, False))
        self._emit(sid, nbytes, row)
        return sid

    def _count_host_scalars(self, func: Any, args: tuple[Any, ...], out: Any, row: int) -> None:
        """CPU semantics: the Python numbers an op wraps and the copies it casts live for the
        call (wrapped_scalar_bytes, promotion_copy_bytes), but a number the op's backward
        node keeps (kept_scalar_bytes) lives until that node has run."""
        scalar_bytes = wrapped_scalar_bytes(func, args) + promotion_copy_bytes(func, args, out)
        # in the backward, nodes are made only by a checkpointed forward's re-run
        keeps = self.phase != _BACKWARD or self._recompute_depth > 0
        kept = kept_scalar_bytes(func, args) if keeps else 0
        if kept:
            # autograd made this op's node before redispatching here: the last number
            # handed out is its sequence number
            self._kept_scalars[next_sequence_nr() - 1] = self._allocated_untracked(kept, row)
        if scalar_bytes > kept:
            sid = self._allocated_untracked(scalar_bytes - kept, row)
            self._emit(sid, kept - scalar_bytes, row)

    def _reserve_workspace(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        row: int,
        placeholders: list[tuple[int, int]],
    ) -> None:
        """Placeholder +W/-W events for a kernel's workspace (and 0-byte events for outputs a
        fake kernel left empty), filled in by ``apply_probes``."""
        assert self.probe is not None
        autocast = self.autocast_dtype if self.phase in self._autocast_phases else None
        sig = self.probe.request(func, args, kwargs, autocast)
        if autocast is not None:
            # the casts are made as the call starts and outlive it: live beside its scratch
            rid = self._allocated_untracked(0, row)  # freed when the autocast region ends
            self._retained_open.append(rid)
            self._probe_slots.append((rid, sig, _RETAINED))
        sid = self._allocated_untracked(0, row)
        self._emit(sid, 0, row)
        self._probe_slots.append((sid, sig, -1))
        self._probe_slots.extend((out_sid, sig, position) for position, out_sid in placeholders)

    def workspace_storages(self) -> list[int]:
        """Storages whose sizes the probe measured: not affine in the batch, so the table
        interpolates them over a grid of batch sizes."""
        return [sid for sid, _sig, _pos in self._probe_slots]

    def workspace_signatures(self) -> list[tuple[Any, ...] | None]:
        """The probe signature of each of :meth:`workspace_storages` that is a kernel's
        scratch (None for a placeholder output or autocast's retained casts)."""
        return [sig if pos == -1 else None for _sid, sig, pos in self._probe_slots]

    def apply_probes(self) -> None:
        """Measure the workspaces and placeholder outputs requested during the run and write
        their sizes into the events (each storage: + at its allocation, - at its free)."""
        if self.probe is None or not self._probe_slots:
            return
        events_of: dict[int, list[int]] = {}
        for i, sid in enumerate(self._ev_storage):
            events_of.setdefault(sid, []).append(i)
        for sid, sig, position in self._probe_slots:
            record = self.storages[sid]
            if position == _RETAINED:
                nbytes = max(self.probe.retained_bytes(sig), 0)  # unknown: none
            elif position < 0:
                nbytes = self.probe.workspace_bytes(sig)  # -1: too large to run, unknown
            else:
                nbytes = self.probe.output_bytes(sig, position)
                if nbytes < 0 and record.nbytes > 0:
                    nbytes = record.nbytes  # not run: the fake kernel's size stands
            record.nbytes = nbytes
            for k, i in enumerate(events_of.get(sid, [])):
                self._ev_delta[i] = max(nbytes, 0) if k == 0 else -max(nbytes, 0)

    # -- results --------------------------------------------------------------------------
    def mark_saved_as_activations(self) -> None:
        """Saved storages that are not resident (parameters, inputs) are Activations."""
        for record in self.storages:
            if record.saved and not record.resident and record.category == _TEMPORARY:
                record.category = _ACTIVATION

    def set_category(self, sids: Iterable[int], category: Category) -> None:
        code = CATEGORY_CODE[category]
        for sid in sids:
            self.storages[sid].category = code

    def events(self) -> Events:
        """The events, with each run of consecutive frees sorted by storage id.

        Frees with no allocation between them happen at one point of the step (a cache
        cleared, a tuple of tensors dropped), so their order cannot move the peak; it can
        follow hash order, though, which differs between runs, and runs at different batch
        sizes must match event for event.
        """
        storage = np.asarray(self._ev_storage, dtype=np.int64)
        delta = np.asarray(self._ev_delta, dtype=np.int64)
        module = np.asarray(self._ev_module, dtype=np.int32)
        phase = np.asarray(self._ev_phase, dtype=np.int8)
        op = np.asarray(self._ev_op, dtype=np.int32)
        # a workspace's free is its second event (it may be 0 bytes until measured)
        is_free = delta < 0
        seen_storage: set[int] = set()
        for i, sid in enumerate(self._ev_storage):
            if sid in seen_storage:
                is_free[i] |= delta[i] == 0
            else:
                seen_storage.add(sid)
        # Label runs of frees (same phase); sort within each run by storage id.
        starts = np.flatnonzero(
            is_free & ~np.concatenate([[False], is_free[:-1] & (phase[1:] == phase[:-1])])
        )
        if len(starts) and len(starts) < is_free.sum():
            run_id = np.cumsum(np.isin(np.arange(len(delta)), starts) | ~is_free)
            order = np.lexsort((np.where(is_free, storage, 0), run_id))
            storage, delta, module, phase, op = (
                storage[order],
                delta[order],
                module[order],
                phase[order],
                op[order],
            )
        return Events(storage=storage, delta_bytes=delta, module=module, phase=phase, op=op)

    def event_count(self) -> int:
        return len(self._ev_delta)


_ADD = torch.ops.aten.add.Tensor


# Probe slot position of the bytes a call leaves in autocast's cast cache.
_RETAINED = -2


@dataclass
class _PendingSum:
    """An out-of-place gradient sum whose allocation is held back: if the old gradient's
    storage dies right after (the engine dropping the buffer's reference), the real step
    summed in place and the sum takes over the old storage; otherwise it is an allocation,
    inserted at ``event_index``."""

    old_key: int
    out_storage: weakref.ref[Any]
    nbytes: int
    row: int
    event_index: int
    op: int


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Some permutation of ``t``'s dimensions is contiguous (c10's
    ``compute_non_overlapping_and_dense``): sizes of 1 aside, the strides sorted ascending
    are 1, size, size * size, ..."""
    if t.layout is not torch.strided:
        return False
    expected = 1
    for size, stride in sorted(
        ((size, stride) for size, stride in zip(t.shape, t.stride(), strict=True) if size != 1),
        key=lambda ss: ss[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _leaves(out: Any) -> Sequence[Any]:
    """``tree_flatten(out)[0]`` for an op's return value, without pytree's per-leaf cost in
    the common cases: one tensor, or a flat tuple / list (of tensors, None, numbers)."""
    if isinstance(out, torch.Tensor):
        return (out,)
    kind = type(out)
    if (kind is tuple or kind is list) and not any(type(x) in (tuple, list, dict) for x in out):
        return out
    return tree_flatten(out)[0]


def _arg_storages(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """``id`` of the storage of every tensor in an op's arguments (aten arguments hold
    tensors directly or in one level of lists)."""
    out = set()
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.add(id(a.untyped_storage()))
        elif isinstance(a, (tuple, list)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    out.add(id(x.untyped_storage()))
    return out


@functools.cache
def _is_matmul(func: Any) -> bool:
    return func.__name__.split(".")[0] in _MATMUL_OPS


def _exception_key(exc: BaseException) -> tuple[int, str, str]:
    """Identifies an exception without keeping it alive (exceptions take no weak refs)."""
    return (id(exc), type(exc).__name__, str(exc))


def describe_args(obj: Any) -> str:
    """Shapes and dtypes of the tensors in a module call's arguments, for error messages."""
    if isinstance(obj, torch.Tensor):
        return f"Tensor{tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')}"
    if isinstance(obj, (tuple, list)):
        return "(" + ", ".join(describe_args(o) for o in obj) + ")"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k}: {describe_args(v)}" for k, v in obj.items()) + "}"
    return type(obj).__name__


@contextmanager
def tracked_rng_states(track: Callable[[torch.Tensor], object]) -> Iterator[None]:
    """Count the CPU generator states that ``torch.get_rng_state()`` hands out while a run is
    recorded (CPU semantics).

    ``torch.utils.checkpoint`` keeps one per checkpointed region for its recompute
    (``preserve_rng_state=True``, the default: ``fwd_cpu_state = torch.get_rng_state()`` in
    torch/utils/checkpoint.py), and ``torch.random.fork_rng`` holds one while it runs: 5,056
    bytes each for the CPU's Mersenne Twister state (CPUGeneratorImpl::get_state). C++ makes
    them outside the dispatcher, so no dispatch mode sees them, but a CPU step's allocator
    does. On CUDA they are host memory (CUDA's generator states too), so the CUDA emulation
    leaves them out. Both callers look ``torch.get_rng_state`` up at call time."""
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        track(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


@contextmanager
def module_hooks(recorder: Recorder) -> Iterator[None]:
    """Global forward hooks that tell the recorder which module runs.

    Global hooks leave the user's modules' own hook dictionaries untouched.
    """
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    pre = register_module_forward_pre_hook(lambda m, args: recorder.enter_module(m, args))
    post = register_module_forward_hook(
        lambda m, args, out: recorder.exit_module(m, out), always_call=True
    )
    try:
        yield
    finally:
        pre.remove()
        post.remove()
