"""The optimizer's state and its ``step()`` recorded on fake parameters: the run behind
:meth:`~.step_profiler.Profiler.run_optimizer`, one precision and optimizer at a time.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np
import torch

from .._estimating.options import (
    Category,
    CustomOptimizer,
    Device,
    OptimizerChoice,
    OptimizerImplementation,
    Phase,
    Precision,
)
from .._estimating.sharding import local_shard_shape
from .._estimating.table import (
    OptimizerTrace,
)
from .fake import (
    MetaShortcuts,
    new_fake_mode,
)
from .optimizers import (
    OpWatch,
    check_mixed_dtensors,
    cpu_kernels,
    cuda_default_foreach,
    each_state,
    eager_step,
    is_paged_state,
    named_failure,
    unpaged,
)
from .param_groups import decay_parameter_names, trainer_groups
from .recorder import Recorder
from .step import (
    frozen_by,
    make_optimizer,
    paused_gc,
)
from .tensor_parallel import (
    local_part,
)

if TYPE_CHECKING:
    from .step_profiler import Profiler


class OptimizerStateRuns:
    """The optimizer's run of :class:`~.step_profiler.Profiler` (``self`` is the profiler)."""

    def run_optimizer(  # type: ignore[misc]
        self: Profiler,
        precision: Precision,
        optimizer: OptimizerChoice,
        only: tuple[str, ...] | None = None,
        shard: tuple[int, int] | None = None,
        implementation: OptimizerImplementation | None = OptimizerImplementation.FORLOOP,
    ) -> OptimizerTrace:
        """Two ``step()`` calls on gradients of the parameters' shapes; the second, in steady
        state, is recorded. Its allocations do not depend on the batch size. ``only``: the
        optimizer of these parameters alone, in this order (a ZeRO rank's shard, in the
        order ZeRO hands it to its local optimizer: a single-tensor step keeps one
        parameter's temporary while it makes the next one's, so the order counts).
        ``shard=(world_size, rank)``: each parameter as that rank's FSDP2 shard of it (its
        dim-0 chunk, ``sharding.local_shard_shape``), which its optimizer steps.
        ``implementation``: how torch.optim runs the step (fused, foreach, for-loop); None
        for another library's optimizer or a user's callable, whose own ``step()`` runs
        (``optimizers``: on a ``device="cpu"`` profile with bitsandbytes' CPU kernels; a
        failing step is named with its op; bitsandbytes' paged state is counted apart)."""
        subject = self.subject
        cuda = subject.device is Device.CUDA
        stepped = subject.params_with_grad.get(self.levers)
        frozen = frozen_by(self.levers, [name for name, _p, _r in subject._params])
        if only is not None:
            frozen |= {name for name, _p, _r in subject._params if name not in only}
        if not any(
            p.requires_grad and name not in frozen and (stepped is None or name in stepped)
            for name, p, _r in subject._params
        ):
            # Nothing to optimize: torch.optim refuses an empty list, and the step is a no-op.
            n_rows = len(subject.rows.names)
            empty = np.zeros(0, dtype=np.int64)
            return OptimizerTrace(empty, np.zeros(n_rows, dtype=np.int64), empty)
        # The optimizer needs shapes only, so it runs on meta tensors (even in the fallback):
        # its ops are elementwise and foreach ops whose meta kernels are C++, so the step costs
        # next to nothing, where a FakeTensorMode would hash every tensor of every foreach call.
        # Adam-family ``step`` counters are real 0-dim CPU tensors, as for CUDA parameters.
        # A fused step refuses meta parameters (torch/optim/optimizer.py,
        # ``_device_dtype_check_for_fused``: CUDA, CPU and a few others only), so it runs on
        # fake CPU tensors; its kernels (``_fused_adam_``, ``_fused_sgd_``) are in-place and
        # have fake implementations. The fake mode's device is not the target's: only sizes
        # are read.
        fused = implementation is OptimizerImplementation.FUSED
        fake_mode = new_fake_mode() if fused else contextlib.nullcontext()
        device = "cpu" if fused else "meta"
        with fake_mode:
            params, _buffers = subject.make_state(precision, real=False, device=device)
            if shard is not None:
                params = {
                    name: torch.empty(
                        # a tensor-parallel rank's DTensor: FSDP2 shards its local tensor
                        local_shard_shape(tuple(local_part(p).shape), *shard),
                        dtype=p.dtype,
                        device=device,
                    ).requires_grad_(p.requires_grad)
                    for name, p in params.items()
                }
        rows_of = {name: row for name, _p, row in subject._params}
        # the parameters the traced step gave a gradient (all trainable ones if no training
        # step was traced yet)
        trainable = [
            (name, p)
            for name, p in params.items()
            if p.requires_grad and name not in frozen and (stepped is None or name in stepped)
        ]
        if only is not None:
            position = {name: i for i, name in enumerate(only)}
            trainable.sort(key=lambda item: position[item[0]])
        with fake_mode:
            for _name, p in trainable:
                p.grad = torch.empty_like(p)
            groups = None
            if self.levers.decay_groups:  # Hugging Face Trainer's (param_groups.py)
                groups = trainer_groups(trainable, decay_parameter_names(subject.model))
            opt = make_optimizer(optimizer, [p for _n, p in trainable], implementation, groups)
        unpaged(opt)
        if cuda and isinstance(optimizer, CustomOptimizer):
            cuda_default_foreach(opt)
        shortcuts = fake_mode if fused else MetaShortcuts()
        watch = OpWatch()
        # the CPU kernels of bitsandbytes' ops, where their fake implementations (CUDA's
        # allocation-free kernels) are not what a CPU step does
        kernels = cpu_kernels(opt) if not cuda else contextlib.nullcontext()
        # a foreach or fused step over DTensors and plain tensors fails in torch's own step
        # (optimizers.check_mixed_dtensors); other optimizers' failing steps say so too
        check_mixed_dtensors(optimizer, trainable, implementation and implementation.value)
        with named_failure(optimizer, watch), eager_step(opt), shortcuts, watch, kernels:
            opt.step()  # first step: creates the state
        rec = Recorder(
            subject._row_of,
            subject.loss_row,
            subject.optimizer_row,
            cpu_semantics=not cuda,
        )
        rec.set_phase(Phase.OPTIMIZER)
        rec.register_resident([p for _n, p in trainable], Category.PARAMETER)
        rec.register_resident(
            [p.grad for _n, p in trainable if p.grad is not None], Category.GRADIENT
        )
        state_bytes = np.zeros(len(subject.rows.names), dtype=np.int64)
        blocks: list[int] = []
        seen: set[int] = set()
        paged = 0
        name_of = {id(p): name for name, p in trainable}
        for p, key, value in each_state(opt, [p for _n, p in trainable]):
            name = name_of[id(p)]
            # Without capturable/fused, Adam-family ``step`` counters stay on the CPU
            # even for CUDA parameters (torch/optim/adam.py, _init_group): no GPU memory.
            # Fused, they are float32 0-dim tensors on the parameter's device (the same
            # lines: ``device=p.device if capturable or fused``): 4 bytes each, counted.
            # torchao's low-bit Adam keeps its ``step`` on the CPU too
            # (torchao/optim/adam.py, ``state["step"] = torch.tensor(0.0)``).
            if cuda and not fused and key == "step" and value.dim() == 0:
                continue
            value = local_part(value)  # a tensor-parallel rank's state: its shard
            st = value.untyped_storage()
            if cuda and is_paged_state(opt, p, key):
                # CUDA unified memory, outside the caching allocator (optimizers module)
                if id(st) not in seen:
                    seen.add(id(st))
                    paged += st.nbytes()
                continue
            rec.register_resident([value], Category.OPTIMIZER_STATE)
            if id(st) in seen:
                continue
            seen.add(id(st))
            state_bytes[rows_of[name]] += st.nbytes()
            blocks.append(st.nbytes())
        with named_failure(optimizer, watch), eager_step(opt), paused_gc(), shortcuts, rec:
            with watch, kernels:
                opt.step()
            rec.stop()
        events = rec.events()
        return OptimizerTrace(
            event_bytes=events.delta_bytes,
            state_bytes=state_bytes,
            state_block_bytes=np.asarray(blocks, dtype=np.int64),
            event_storage=np.asarray(events.storage, dtype=np.int64),
            paged_bytes=paged,
        )
