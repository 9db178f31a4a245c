"""The profiler's runs: one training step or inference pass of a :class:`~.subject.Subject`
on fake tensors (or, as a fallback, real CPU tensors at a tiny batch) under the recorder,
one precision, batch size and mode at a time, returned as a raw trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .._estimating.decoding import DECODE_STEPS_PROFILED
from .._estimating.levers import NO_LEVERS, Levers
from .._estimating.offloading import Offload
from .._estimating.options import (
    PHASE_CODE,
    Category,
    Device,
    Mode,
    Phase,
    Precision,
)
from .._estimating.profile_source import ProfilingError
from .carried import CarriedScalars
from .checkpoint_policy import CheckpointPolicyError
from .chunked_loss import chunked_step
from .composites import real_run_composites, rules_hold
from .errors import entry_codes, user_traceback
from .fake import (
    DATA_DEPENDENT_ERRORS,
    checkpoint_recompute_context,
    new_fake_mode,
    quiet_fake_tensor_log,
    quiet_third_party,
    reparametrized,
)
from .float8 import float8_kernels
from .generation import prompt_inputs, recorded_generation
from .offloading import OffloadEmulation, emulated_offloading, offloaded_forward
from .optimizer_state import OptimizerStateRuns
from .probe import KernelProbe
from .quantized import (
    DequantizingKernels,
    fresh_int8_state,
    state_tensors,
)
from .recorder import Recorder, describe_args, module_hooks, tracked_rng_states
from .step import (
    ModelInputs,
    apply_levers,
    autocast_dtype,
    frozen_by,
    inference_pass,
    paused_gc,
    restored_modules,
    training_iteration,
)
from .stepping import OptimizerInBackward, zero_grads_in_place
from .subject import (
    RawTrace,
    Subject,
    _changed_by_run,
    _describe,
)
from .tensor_parallel import (
    is_dtensor,
)
from .torchao_weights import torchao_inner


class Profiler(OptimizerStateRuns):
    """Produces raw traces for a subject, one precision and batch size at a time."""

    def __init__(self, subject: Subject) -> None:
        self.subject = subject
        self.real = subject.fallback_reason is not None
        # CPU kernel workspaces are measured for device="cpu" (see probe); CUDA's are
        # accounted for by the emulation and the accelerator extras instead.
        self.probe = KernelProbe() if subject.device is Device.CPU else None
        # the sequence length of the runs (None: the example's)
        self.seq_len: int | None = None
        # the memory levers of the runs (checkpointing, a frozen subset, accumulation)
        self.levers: Levers = NO_LEVERS
        # decode steps a generation run records (more across a sliding window), and the new
        # tokens it asks generate for (None: just more than it records; a StaticCache is
        # sized by them)
        self.decode_steps = DECODE_STEPS_PROFILED
        self.generation_tokens: int | None = None
        # activation offloading: which saved tensors a step offloads, decided at its first
        # run and held for every batch size (offloading.OffloadEmulation's plan)
        self._offload_plans: dict[tuple[Precision, Levers, int | None], list[bool]] = {}
        # One fake mode, and one set of fake parameters and buffers, per precision, shared by
        # every run of that precision (each batch size, training and inference): building
        # them costs as much as a small model's whole step, and the fake mode's dispatch cache
        # then also sees the same tensors' metadata run after run.
        # (precision, parameter dtype cast, stock mode) -> (fake mode, parameters, buffers, their
        # metadata when made)
        self._fake_state: dict[
            tuple[Precision, str | None, bool],
            tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor], list[tuple[Any, ...]]],
        ] = {}
        # whether each run records the collectives it issues (a parallel rank's step on the
        # fake process group: its recorder reads them, collectives.collective_of), kept in
        # its trace; the profile's own runs issue none
        self.record_collectives = False

    def _state(
        self, precision: Precision
    ) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The fake mode (None for the real fallback), parameters and buffers of a run.

        Shared fake parameters start every run as fresh leaves: no ``.grad`` (a run that
        failed half-way through its backward may have left some), so that the backward
        allocates every gradient as a first step does; they are rebuilt when a run changed
        them otherwise (``_changed_by_run``). Buffers are only updated in place."""
        cast = self.levers.param_dtype
        param_dtype = None if cast is None else getattr(torch, cast)
        if self.real:
            params, buffers = self.subject.make_state(precision, real=True, param_dtype=param_dtype)
            return None, params, buffers
        stock = self.levers.compile is not None  # dynamo traces on them (fake.new_fake_mode)
        key = (precision, cast, stock)
        cached = self._fake_state.get(key)
        if cached is None or _changed_by_run([*cached[1].values(), *cached[2].values()], cached[3]):
            fake_mode = new_fake_mode(stock)
            with fake_mode:
                params, buffers = self.subject.make_state(
                    precision, real=False, param_dtype=param_dtype
                )
            described = [_describe(t) for t in (*params.values(), *buffers.values())]
            cached = self._fake_state[key] = (fake_mode, params, buffers, described)
        fake_mode, params, buffers, _described = cached
        for p in params.values():
            p.grad = None
        return fake_mode, params, buffers

    def _context(
        self, precision: Precision
    ) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
        """The forward context: CUDA's kernel choices emulated on CPU tensors, or None for
        the plain CPU semantics (autocast on the CPU for amp precisions)."""
        if self.subject.device is Device.CPU:
            return None
        from .cuda_rules import CudaEmulation
        from .cuda_sdpa import CudaTarget

        amp = autocast_dtype(precision)
        return lambda: CudaEmulation(CudaTarget(), amp)

    def run(
        self, precision: Precision, batch_size: int, mode: Mode, flops: bool = True
    ) -> RawTrace:
        """One fake (or fallback) run. ``flops=False`` leaves the FLOPs at 0: runs whose
        FLOPs the table does not fit (the check at a third batch size, the workspace grid)
        skip counting them."""
        subject = self.subject
        train = mode is Mode.TRAIN
        fake_mode, params, buffers = self._state(precision)
        with fake_mode or contextlib.nullcontext():
            inputs = subject.make_inputs(batch_size, precision, self.real, self.seq_len)
        if mode is Mode.GENERATE:
            inputs = ModelInputs(inputs.args, prompt_inputs(inputs.kwargs))
        compiled = self.levers.compile if train else None
        recorder: type[Recorder] = Recorder
        if compiled is not None:  # the torch.compile step (compiled_profile.py)
            from .compiled_profile import CompiledRecorder

            recorder = CompiledRecorder
        rec = recorder(
            subject._row_of,
            subject.loss_row,
            subject.optimizer_row,
            self.probe,
            autocast_dtype(precision) if subject.device is Device.CPU else None,
            cpu_semantics=subject.device is Device.CPU,
            count_flops=flops,
        )
        rec.meta_is_shape_only = any(is_dtensor(p) for p in params.values())
        if self.record_collectives:
            rec.collectives = []
        # a torchao weight is a size-only wrapper: its inner tensors are the memory
        inner = {n: torchao_inner(p) for n, p in params.items()}
        plain = [
            (p, row) for (n, _p, row), p in zip(subject._params, params.values(), strict=True)
            if inner[n] is None
        ]  # fmt: skip
        rec.register_resident([p for p, _r in plain], Category.PARAMETER, [r for _p, r in plain])
        quant_states = [  # quantized weights' scales and codes (quantized.py), with them
            (t, row) for (n, _p, row), p in zip(subject._params, params.values(), strict=True)
            for t in (state_tensors(p) if inner[n] is None else inner[n] or [])
        ]  # fmt: skip
        bnb_states = any(state_tensors(p) for p in params.values() if torchao_inner(p) is None)
        if quant_states:
            rec.register_resident(
                [t for t, _r in quant_states], Category.PARAMETER, [r for _t, r in quant_states]
            )
        if bnb_states:
            fresh_int8_state(subject.model, params)
        rec.register_resident(
            buffers.values(), Category.BUFFER, [row for _n, _b, row in subject._buffers]
        )
        rec.register_resident(inputs.tensors(), Category.INPUT)
        state = {**params, **buffers}
        model_fn: Callable[..., Any] = subject.model  # run with ``state`` swapped in (below)
        levers = self.levers if train else NO_LEVERS
        loss_fn = subject.loss_fn
        if levers.loss_chunks is not None:  # torchtune's chunked output and loss
            model_fn, loss_fn = chunked_step(subject.model, levers.loss_chunks)
        offload = None
        if levers.offload_activations is not None:  # the forward's saved tensors to the host
            offload = OffloadEmulation(
                Offload(levers.offload_activations),
                rec.pack_hook,
                rec.paused,
                frozenset(id(p) for p in params.values()),
                self._offload_plan(precision, levers, mode),
            )

        marks: dict[str, int] = {}
        frozen = [params[n] for n in frozen_by(levers, params) if params[n].requires_grad]
        for p in frozen:  # restored after the run: the fake parameters are shared
            p.requires_grad_(False)
        named_trainable = [(n, p) for n, p in params.items() if p.requires_grad]
        trainable = [p for _n, p in named_trainable]
        in_backward = None
        if train:
            in_backward = self._stepping(rec, fake_mode, levers, named_trainable)

        carried = None
        if train and levers.carried_scalars:  # the previous step's, resident (carried.py)
            carried = CarriedScalars(lambda t: rec.register_resident([t], Category.TEMPORARY))

        def between(phase: str) -> None:
            marks.setdefault(phase, rec.event_count())  # the first micro-batch's
            if phase == "forward":  # the next micro-batch of an accumulated step
                rec.set_phase(Phase.FORWARD)
            elif phase == "backward":
                rec.set_phase(Phase.BACKWARD)
            elif phase == "optimizer":
                grads = [rec.storage_id(p.grad) for p in trainable if p.grad is not None]
                rec.set_category([g for g in grads if g is not None], Category.GRADIENT)
                # torch.optim skips parameters whose .grad is None (unused in the forward,
                # or behind a reentrant checkpoint whose input needs no grad): no state
                stepped = {id(p) for p in in_backward.stepped} if in_backward else set()
                subject.params_with_grad[levers] = {
                    n for n, p in named_trainable if p.grad is not None or id(p) in stepped
                }
                rec.set_phase(Phase.ZERO_GRAD)

        # compiled: the partitioned graphs are Inductor's decompositions on CPU fake tensors
        # (dynamo cannot trace the CUDA emulation's function mode: compiled_profile.py)
        context = self._context(precision) if compiled is None else None
        compile_fallbacks: list[str] = []  # compiled_graphs.GraphCapture.fallbacks
        rules_hold()  # before any mode: it probes real tensors
        subject.model.train(train)
        with contextlib.ExitStack() as stack:
            stack.enter_context(paused_gc())
            stack.enter_context(quiet_fake_tensor_log())
            stack.enter_context(quiet_third_party())
            if fake_mode is not None:
                stack.enter_context(fake_mode)
            if compiled is not None:
                # checkpointing applied, then the model compiled, as the libraries compose
                # them (compiled_profile.py): by an unrecorded iteration, before recording
                self._structured(stack, state, levers)
                model_fn = stack.enter_context(
                    self._compiled_step(
                        model_fn, loss_fn, inputs, trainable, rec, precision, compile_fallbacks
                    )
                )
            stack.enter_context(rec)
            if bnb_states:  # bitsandbytes' kernels as their CPU code runs them
                stack.enter_context(DequantizingKernels(cpu=subject.device is Device.CPU))
            # torchao's float8 tensors' ops, their inner tensors recorded (float8.py)
            stack.enter_context(float8_kernels(subject.model))
            if compiled is None:
                stack.enter_context(module_hooks(rec))
            else:
                from .compiled_profile import compiled_module_hooks

                stack.enter_context(compiled_module_hooks(rec, subject.model))
            if compiled is None:  # compiled: Inductor's decompositions decide (compiled_profile)
                stack.enter_context(real_run_composites())
            if compiled is None:
                self._structured(stack, state, levers)
            stack.enter_context(checkpoint_recompute_context(_recompute_context(context, rec)))
            if subject.device is Device.CPU:  # the RNG states checkpoint keeps are CPU memory
                stack.enter_context(tracked_rng_states(rec.track_host_tensor))
            if train:
                saved_hooks: tuple[Callable[[Any], Any], Callable[[Any], Any]]
                if compiled is None:
                    saved_hooks = (rec.pack_hook, rec.unpack_hook)
                else:  # not compiled between graph breaks (compiled_profile.py)
                    from .compiled_profile import uncompiled_saved_tensor_hooks

                    saved_hooks = uncompiled_saved_tensor_hooks(rec)
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*saved_hooks))
                if offload is not None:  # inside the recorder's hooks: these run instead
                    hooks = stack.enter_context(emulated_offloading(subject.model, offload))
                    model_fn = offloaded_forward(model_fn, hooks)
                if in_backward is not None:
                    stack.enter_context(in_backward.hooked())
            else:
                rec.set_phase(Phase.INFERENCE)
            step_starts: tuple[int, ...] = ()
            step_flops = np.zeros((0, 0), np.int64)
            try:
                if train:
                    training_iteration(
                        model_fn,
                        inputs,
                        loss_fn,
                        None,
                        precision,
                        "cpu",
                        params=trainable,
                        between=between,
                        context=context,
                        on_loss=rec.watch_accumulations,
                        micro_batches=levers.profiled_micro_batches,
                        set_to_none=levers.set_to_none,
                        outputs_freed=levers.outputs_freed,
                        loss_scaled=levers.loss_scaled,
                        carried=carried,
                        # any max norm: the clipping's memory does not depend on it
                        clip_grad_norm=1.0 if levers.clip_grad_norm else None,
                        # the real tensors' path (a FakeTensor would take the loop)
                        clip_foreach=True,
                    )
                elif mode is Mode.GENERATE:
                    step_starts, step_flops = recorded_generation(
                        model_fn,
                        inputs,
                        precision,
                        rec,
                        context,
                        self.decode_steps,
                        self.generation_tokens,
                    )
                else:
                    inference_pass(model_fn, inputs, precision, "cpu", context=context)
            except DATA_DEPENDENT_ERRORS:
                raise
            except Exception as exc:
                error = self._explain(exc, rec, precision, batch_size, inputs)
                if error is exc:  # already names the problem (our loss checks)
                    raise
                raise error from exc
            finally:
                rec.stop()
                for p in frozen:
                    p.requires_grad_(True)
        rec.mark_saved_as_activations()
        rec.apply_probes()
        events = rec.events()
        storages = rec.storages
        n_events = len(events.delta_bytes)
        return RawTrace(
            batch_size=batch_size,
            event_storage=events.storage,
            event_bytes=events.delta_bytes,
            event_module=events.module,
            event_phase=events.phase,
            event_op=events.op,
            op_names=tuple(rec.op_names),
            storage_category=np.asarray([s.category for s in storages], dtype=np.int8),
            storage_module=np.asarray([s.module for s in storages], dtype=np.int32),
            storage_resident=np.asarray([s.resident for s in storages], dtype=bool),
            storage_bytes=np.asarray([s.nbytes for s in storages], dtype=np.int64),
            flops_forward=rec.flops_forward,
            flops_backward=rec.flops_backward,
            output_shapes=tuple(rec.output_shapes),
            workspace_storages=np.asarray(rec.workspace_storages(), dtype=np.int64),
            workspace_signatures=tuple(rec.workspace_signatures()),
            backward_start=marks.get("backward", n_events),
            optimizer_at=marks.get("optimizer", n_events),
            uses_matmul=rec.uses_matmul,
            step_starts=step_starts,
            step_flops=step_flops,
            host_peak_bytes=0 if offload is None else offload.host_peak_bytes,
            compile_fallbacks=tuple(compile_fallbacks),
            collectives=None if rec.collectives is None else tuple(rec.collectives),
        )

    def _structured(
        self, stack: contextlib.ExitStack, state: dict[str, torch.Tensor], levers: Levers
    ) -> None:
        """The run's fake parameters swapped into the model, and checkpointing applied as
        the libraries apply it, for the length of ``stack``. The fake parameters stay
        swapped in through the backward, where a checkpointed forward is re-run, and that
        re-run gets the forward's CUDA emulation."""
        model = self.subject.model
        stack.enter_context(reparametrized(model, state))
        if levers.checkpoint:
            # the model as the libraries leave it with checkpointing on, for this run only
            stack.enter_context(restored_modules(model))
            apply_levers(model, dataclasses.replace(levers, trainable=None))

    def _compiled_step(
        self,
        model_fn: Callable[..., Any],
        loss_fn: Callable[[Any], Any] | None,
        inputs: ModelInputs,
        trainable: list[torch.Tensor],
        rec: Recorder,
        precision: Precision,
        fallbacks: list[str],
    ) -> contextlib.AbstractContextManager[Callable[..., Any]]:
        """The model's forward as ``torch.compile`` runs it (``compiled_profile.py``),
        compiled by one unrecorded iteration on the run's fake parameters and inputs (swapped
        in, and checkpointing applied, by ``_structured`` before); ``fallbacks`` gets why a
        graph runs node by node, if one does."""
        from .compiled_profile import compiled_step

        model = self.subject.model
        context = None  # as the recorded run's (``run``)
        levers = self.levers
        assert levers.compile is not None and model_fn is model
        if levers.compile_batch not in (None, inputs.batch_size()):
            raise ProfilingError(
                f"the compiled step is profiled at batch {levers.compile_batch} only, "
                f"not {inputs.batch_size()}"
            )

        def warm_up(forward: Callable[..., Any]) -> None:
            training_iteration(
                forward, inputs, loss_fn, None, precision, "cpu", params=trainable, context=context
            )

        return compiled_step(
            model,
            levers.compile,
            levers.activation_memory_budget,
            warm_up,
            (rec.enter_module, rec.exit_module),
            fallbacks,
        )

    def _offload_plan(self, precision: Precision, levers: Levers, mode: Mode) -> list[bool]:
        """Which saved tensors of this step torchtune offloads, by the order they are
        saved: decided once, by a run at ``OFFLOAD_PLAN_BATCH`` (its trace discarded), and
        held at every batch size, so that each run is the same step and the fit holds.
        torchtune offloads a tensor of at least 1024 bytes: what grows with the batch is
        over that at any batch the decision is for, and at smaller batches a tensor is
        taken as offloaded that would be under 1024 bytes there (module docstring of
        ``offloading.py``). The real fallback decides at its own batch size."""
        key = (precision, levers, self.seq_len)
        if key not in self._offload_plans:
            self._offload_plans[key] = []
            if not self.real:
                self.run(precision, OFFLOAD_PLAN_BATCH, mode, flops=False)
        return self._offload_plans[key]

    def check_runs(self) -> bool:
        """Whether one unrecorded training step (forward, loss, backward) and one inference
        forward of the model run on fake tensors (fp32, batch ``CHECK_BATCH_SIZE``, the
        profile's kernel choices): the check ``profile_model`` makes before it defers its
        runs. Nothing is recorded or hooked, so it costs about one recorded run. False
        where anything raises (a real error, or an op fake tensors cannot run, which the
        real fallback may): the caller then profiles fp32 at once, and its errors and
        warnings come as that run raises them. (Meta tensors cost more here: their
        elementwise kernels are Python references, run afresh for every op, where the fake
        mode caches each op's output by its arguments' metadata.)"""
        subject = self.subject
        if self.real:
            return False
        fake_mode = new_fake_mode()
        with fake_mode:
            params, buffers = subject.make_state(Precision.FP32, real=False)
            inputs = subject.make_inputs(CHECK_BATCH_SIZE, Precision.FP32, real=False)
        trainable = [p for p in params.values() if p.requires_grad]
        # the kernels the runs pick (CUDA's fused attention takes one op where the CPU's
        # math path takes a dozen)
        context = self._context(Precision.FP32)
        rules_hold()  # before any mode: it probes real tensors
        with (
            warnings.catch_warnings(),
            paused_gc(),
            quiet_fake_tensor_log(),
            quiet_third_party(),
            fake_mode,
            reparametrized(subject.model, {**params, **buffers}),
        ):
            warnings.simplefilter("ignore")  # the profiling runs say what is worth saying
            subject.model.train(True)
            try:
                training_iteration(
                    subject.model,
                    inputs,
                    subject.loss_fn,
                    None,
                    Precision.FP32,
                    "cpu",
                    params=trainable,
                    context=context,
                )
                subject.model.eval()  # a forward may fail in inference alone
                inference_pass(subject.model, inputs, Precision.FP32, "cpu", context=context)
            except Exception:
                return False
            finally:
                for p in trainable:
                    p.grad = None
        return True

    def _stepping(
        self,
        rec: Recorder,
        fake_mode: Any,
        levers: Levers,
        named_trainable: list[tuple[str, torch.Tensor]],
    ) -> OptimizerInBackward | None:
        """Prepare a training run for how its optimizer is stepped, as in a steady-state
        step. ``set_to_none=False``: the gradients exist, zeroed, when the step starts
        (resident; the backward adds into them). In the backward: one optimizer per
        parameter, its state made by a first step (resident), stepped in its parameter's
        hook, which the run registers; returned (None otherwise)."""
        subject = self.subject
        row_of = {name: row for name, _p, row in subject._params}
        context = fake_mode or contextlib.nullcontext()
        # the parameters a step gives a gradient (all trainable ones if not known yet): the
        # others keep no gradient and get no optimizer state (torch.optim skips them)
        known = subject.params_with_grad.get(_plain_stepping(levers))
        named = [(n, p) for n, p in named_trainable if known is None or n in known]
        if not levers.set_to_none:
            with context:
                grads = zero_grads_in_place([p for _n, p in named])
            rec.register_resident(grads, Category.GRADIENT, [row_of[n] for n, _p in named])
        if levers.in_backward is None:
            return None
        with context:
            stepper = OptimizerInBackward.from_choice([p for _n, p in named], levers.in_backward)
            stepper.warm_up()
        fused = any(opt.defaults.get("fused") for opt in stepper.optimizers)
        name_of = {id(p): n for n, p in named_trainable}
        for p, key, value in stepper.state_tensors():
            # as in ``run_optimizer``: a non-fused Adam-family ``step`` counter stays on the
            # CPU for CUDA parameters (torch/optim/adam.py, _init_group): no GPU memory
            if subject.device is Device.CUDA and not fused and key == "step" and value.dim() == 0:
                continue
            rec.register_resident([value], Category.OPTIMIZER_STATE, [row_of[name_of[id(p)]]])

        def before_step(p: torch.Tensor) -> None:
            sid = rec.storage_id(p.grad) if p.grad is not None else None
            if sid is not None:
                rec.set_category([sid], Category.GRADIENT)
            rec.phase = PHASE_CODE[Phase.OPTIMIZER]

        def after_step(_p: torch.Tensor) -> None:
            rec.phase = PHASE_CODE[Phase.BACKWARD]

        stepper.before_step, stepper.after_step = before_step, after_step
        return stepper

    def _explain(
        self,
        exc: Exception,
        rec: Recorder,
        precision: Precision,
        batch_size: int,
        inputs: ModelInputs,
    ) -> Exception:
        """One clear line: which module failed on which input shapes, in which phase of which
        run, or the loss, or the backward. The user's exception becomes its cause, with its
        traceback trimmed to the user's frames."""
        if isinstance(exc, (TypeError, ValueError)) and "loss_fn" in str(exc):
            return exc
        if isinstance(exc, CheckpointPolicyError):  # names the block and the policy
            return exc
        subject = self.subject
        entries = entry_codes((type(subject.model).forward, subject.loss_fn))
        exc.with_traceback(user_traceback(exc.__traceback__, entries))
        run = f"{precision.value}, batch {batch_size}"
        what = f"{type(exc).__name__}: {exc}"
        if rec.phase == PHASE_CODE[Phase.BACKWARD]:
            return ProfilingError(f"the backward pass of a training step ({run}) raised {what}")
        if rec.model_returned:
            loss = "loss_fn" if subject.loss_fn is not None else "the default loss"
            return ProfilingError(f"{loss} raised {what} (training step, {run})")
        phase = (
            "the forward of a training step"
            if rec.phase == PHASE_CODE[Phase.FORWARD]
            else "an inference forward"
        )
        call = rec.failed_call(exc)
        names = subject.rows.names
        if call is None or call[0] >= subject.loss_row:
            return ProfilingError(f"the model's forward raised {what} (in {phase}, {run})")
        row, shapes = call
        if row == 0 and inputs.kwargs:
            # module hooks see positional arguments only; the root's keyword tensors (a
            # Hugging Face batch) are the example inputs themselves
            shapes = f"{shapes} and keywords {describe_args(inputs.kwargs)}"
        name = names[row] or "(root)"
        kind = subject.rows.types[row]
        op = rec.op_that_raised(exc)
        return ProfilingError(
            f"module {name!r} ({kind}) failed on inputs {shapes} in {phase} ({run})"
            f"{' at ' + op if op else ''}: {what}{self._input_size_hint()}"
        )

    def _input_size_hint(self) -> str:
        """The commonest input mistake: a batch dimension inside ``input_size``."""
        size = self.subject.input_size
        if size is None or len(size) < 2:
            return ""
        return (
            f" (input_size={size} is the shape of one sample, without the batch dimension: "
            f"if {size[0]} is a batch size, pass input_size={size[1:]})"
        )


# Batch sizes of the fake runs: the fit uses the first two; batch 1 (run anyway) checks it
# where it is the same step, else the third does. Not 1 in the fit: there BatchNorm and
# squeeze-happy code behave unlike any larger batch.
FIT_BATCH_SIZES = (2, 3, 5)
# profile_model's check that a model runs (Profiler.check_runs) runs at a batch size no
# profiling run uses: a run then never meets a fake dispatch cache entry the check made for
# its shapes (an LSTM's backward on CUDA emulation records other frees from a cache hit than
# from a fresh kernel call).
CHECK_BATCH_SIZE = 4
# Where memory is quadratic in the batch, the three fit it and this one checks it.
QUADRATIC_CHECK_BATCH = 8
# Activation offloading: the batch size at which torchtune's 1024-byte threshold picks the
# saved tensors offloaded at every batch size (Profiler._offload_plan)
OFFLOAD_PLAN_BATCH = 256
# CPU kernel workspaces are not affine in the batch (oneDNN picks its algorithm per shape):
# they are measured on this grid too and interpolated (device="cpu" only).
WORKSPACE_BATCH_SIZES = (1, 8, 32)


def _plain_stepping(levers: Levers) -> Levers:
    """``levers`` with one optimizer step after the backward, gradients set to None, the
    outputs kept, no clipping and the model's own loss (none of which changes which
    parameters get a gradient)."""
    return dataclasses.replace(
        levers,
        loss_chunks=None,
        set_to_none=True,
        in_backward=None,
        outputs_freed=False,
        loss_scaled=False,
        carried_scalars=False,
        clip_grad_norm=False,
        decay_groups=False,
    )


def _recompute_context(
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None, rec: Recorder
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What a checkpointed forward re-runs inside in the backward: the forward's CUDA
    emulation (where emulated) and the recorder's note that a re-run is under way."""

    @contextlib.contextmanager
    def both() -> Iterator[None]:
        with (
            context() if context is not None else contextlib.nullcontext(),
            rec.recompute_region(),
        ):
            yield

    return both
