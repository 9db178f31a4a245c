"""The profiler: runs one training step and one inference pass of a model on fake tensors
(or, as a fallback, on real CPU tensors at a tiny batch) under the recorder, and returns raw
traces. Everything torch-specific about profiling is here; the table, the estimator and the
widget only see numpy arrays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.func import functional_call

from .._estimating.decoding import DECODE_STEPS_PROFILED
from .._estimating.estimator import module_label
from .._estimating.levers import NO_LEVERS, Levers
from .._estimating.loading import LoadLayout
from .._estimating.offloading import Offload
from .._estimating.options import (
    PHASE_CODE,
    Category,
    CustomOptimizer,
    Device,
    Mode,
    OptimizerChoice,
    OptimizerImplementation,
    OptimizerName,
    Phase,
    Precision,
    parse_option,
)
from .._estimating.profile import ModelProfile, ProfilingError
from .._estimating.recipe.float8 import Float8
from .._estimating.recipe.weights import WeightFormat, Weights
from .._estimating.sharding import local_shard_shape
from .._estimating.table import (
    PADDED_TERMS,
    ModuleRows,
    NotAffineError,
    OptimizerTrace,
    Timeline,
    across_lengths,
    fit_timeline,
    padded_fit_lengths,
    same_step,
)
from .carried import CarriedScalars
from .checkpoint_policy import CheckpointPolicyError
from .chunked_loss import chunked_loss_refusal, chunked_step
from .composites import real_run_composites, rules_hold
from .data_dependent import example_mask_values, graph_randomness, worst_case_graph
from .disk_cache import cached_source
from .errors import entry_codes, user_traceback
from .fake import (
    DATA_DEPENDENT_ERRORS,
    MetaShortcuts,
    checkpoint_recompute_context,
    new_fake_mode,
    quiet_fake_tensor_log,
    quiet_third_party,
    reparametrized,
)
from .float8 import float8_copy, float8_kernels
from .generation import generation_limit, prompt_inputs, recorded_generation
from .hub import model_or_name
from .loading import load_layout
from .nf4_torchao import fake_nf4_weight, is_nf4_weight, nf4_copy
from .offloading import OffloadEmulation, emulated_offloading, offloaded_forward
from .optimizers import (
    OpWatch,
    cpu_kernels,
    cuda_default_foreach,
    each_state,
    eager_step,
    is_paged_state,
    named_failure,
    unpaged,
)
from .param_groups import decay_parameter_names, trainer_groups
from .probe import KernelProbe
from .quantized import (
    DequantizingKernels,
    fake_quantized,
    fresh_int8_state,
    is_quantized_param,
    kept_dtypes,
    qlora_wrapped,
    quantized_copy,
    quantized_modules,
    state_tensors,
)
from .recorder import Recorder, describe_args, module_hooks, tracked_rng_states
from .repeated import (
    FEW_BLOCKS,
    BlockStack,
    NotRepeated,
    derive,
    find_stack,
    full_param_names,
    layout,
    reduced_copy,
    reduced_levers,
)
from .step import (
    PEFT_PREFIX,
    ModelInputs,
    apply_levers,
    autocast_dtype,
    check_forward_accepts,
    check_model,
    checkpoint_auto,
    frozen_by,
    inference_pass,
    lora_wrapped,
    make_optimizer,
    meta_copy,
    paused_gc,
    restored_modules,
    storage_dtype,
    training_iteration,
)
from .stepping import OptimizerInBackward, zero_grads_in_place
from .tensor_parallel import (
    fake_process_group,
    is_dtensor,
    local_part,
    local_shard_like,
    parallelized,
    resolve_plan,
)
from .torchao_weights import fake_torchao_weight, is_torchao_weight, torchao_copy, torchao_inner

LOSS_ROW_NAME = "(loss)"
OPTIMIZER_ROW_NAME = "(optimizer)"


class InputShapeWarning(UserWarning):
    """``input_size`` may hold a batch dimension: the profile is for the shape as given.

    Silence it with ``warnings.filterwarnings("ignore", category=InputShapeWarning)`` where
    the leading dimension is meant (a sequence of 32 frames, say)."""


# Leading dimensions of an ``input_size`` that look like a batch size (1 and powers of two)
_COMMON_BATCH_SIZES = frozenset({1, *(2**k for k in range(1, 13))})


@dataclass(frozen=True)
class RawTrace:
    """What the recorder saw in one run at one batch size."""

    batch_size: int
    event_storage: np.ndarray  # int64
    event_bytes: np.ndarray  # int64, signed
    event_module: np.ndarray  # int32
    event_phase: np.ndarray  # int8
    event_op: np.ndarray  # int32 index into op_names (-1: none)
    op_names: tuple[str, ...]  # "aten.addmm", or the autograd node in backward
    storage_category: np.ndarray  # int8, per storage id
    storage_module: np.ndarray  # int32, per storage id (row that allocated it; -1 resident)
    storage_resident: np.ndarray  # bool
    storage_bytes: np.ndarray  # int64 (size at allocation or registration)
    flops_forward: np.ndarray  # int64 per row
    flops_backward: np.ndarray  # int64 per row
    output_shapes: tuple[tuple[int, ...] | None, ...]
    workspace_storages: np.ndarray  # int64 storage ids of measured kernel workspaces
    backward_start: int  # index of the first backward event (train), else len
    optimizer_at: int  # index where the optimizer step's events are spliced in (train)
    uses_matmul: bool
    # generation: where each forward starts (prefill, decode steps), then the end
    step_starts: tuple[int, ...] = ()
    # generation: the FLOPs per row counted before each of those points (steps x rows)
    step_flops: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    # activation offloading: the host bytes its copies took at their peak (0: none)
    host_peak_bytes: int = 0
    # torch.compile: why a compiled graph ran node by node instead of as Inductor's
    # generated code (compiled_inductor.py), one line each; () where none did
    compile_fallbacks: tuple[str, ...] = ()


@dataclass
class Subject:
    """The model and example inputs being profiled, and how to rebuild them at any batch."""

    model: torch.nn.Module
    inputs: ModelInputs | None
    input_size: tuple[int, ...] | None
    loss_fn: Callable[[Any], Any] | None
    device: Device
    rows: ModuleRows = field(init=False)
    _row_of: dict[int, int] = field(init=False)
    _params: list[tuple[str, torch.nn.Parameter, int]] = field(init=False)
    _buffers: list[tuple[str, torch.Tensor, int]] = field(init=False)
    fallback_reason: str | None = None
    # names of the parameters a traced training step gave a gradient, per levers (set by
    # that step; the optimizer state is made for these only)
    params_with_grad: dict[Levers, set[str]] = field(default_factory=dict)
    # input name ("[0]" positional, or the keyword) -> its dim that is the sequence
    seq_axes: dict[str, int] = field(default_factory=dict)
    # parameters that keep their own dtype whatever the precision (PEFT's adapters, which it
    # keeps in fp32 on an fp16 / bf16 base)
    fixed_dtypes: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        names, types, depths, mods = [], [], [], []
        for name, mod in self.model.named_modules():  # dedups shared modules: first name wins
            names.append(name)
            types.append(type(mod).__name__)
            depths.append(0 if name == "" else name.count(".") + 1)
            mods.append(mod)
        self._row_of = {id(m): i for i, m in enumerate(mods)}
        n = len(mods) + 2
        param_count = np.zeros(n, np.int64)
        trainable = np.zeros(n, np.int64)
        buffer_count = np.zeros(n, np.int64)
        self._params = []
        seen: set[int] = set()
        for row, mod in enumerate(mods):
            prefix = names[row] + "." if names[row] else ""
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen:
                    continue  # tied weight: counted once, at its first owner
                seen.add(id(p))
                self._params.append((prefix + pname, p, row))
                param_count[row] += p.numel()
                if p.requires_grad:
                    trainable[row] += p.numel()
        self._buffers = []
        seen_buffers: set[int] = set()
        for row, mod in enumerate(mods):
            prefix = names[row] + "." if names[row] else ""
            for bname, b in mod.named_buffers(recurse=False):
                if b is None or id(b) in seen_buffers:
                    continue
                seen_buffers.add(id(b))
                self._buffers.append((prefix + bname, b, row))
                buffer_count[row] += b.numel()
        self.rows = ModuleRows(
            names=(*names, LOSS_ROW_NAME, OPTIMIZER_ROW_NAME),
            types=(*types, "loss", "optimizer"),
            depths=np.asarray([*depths, 0, 0], dtype=np.int32),
            param_count=param_count,
            trainable_param_count=trainable,
            buffer_count=buffer_count,
        )

    @property
    def loss_row(self) -> int:
        return len(self.rows.names) - 2

    @property
    def optimizer_row(self) -> int:
        return len(self.rows.names) - 1

    # -- building the fake (or real fallback) state ----------------------------------------
    def _dtype(self, t: torch.Tensor, precision: Precision) -> torch.dtype:
        return storage_dtype(precision) if t.is_floating_point() else t.dtype

    def make_state(
        self,
        precision: Precision,
        real: bool,
        device: str = "cpu",
        param_dtype: torch.dtype | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Parameters and buffers as new leaf tensors in the precision's dtype (floating
        parameters in ``param_dtype`` where given: a wrapper's cast, FSDP2's
        MixedPrecisionPolicy): fake tensors (call inside the fake mode), meta tensors
        (``device="meta"``), or real CPU copies for the fallback."""
        params: dict[str, torch.Tensor] = {}
        for name, p, _row in self._params:
            dtype = p.dtype if name in self.fixed_dtypes else self._dtype(p, precision)
            if param_dtype is not None and name not in self.fixed_dtypes and p.is_floating_point():
                dtype = param_dtype
            if is_quantized_param(p):  # bitsandbytes' stored form (quantized.py)
                params[name] = fake_quantized(p, dtype)
                continue
            if is_torchao_weight(p):  # torchao's tensor subclass (torchao_weights.py)
                params[name] = fake_torchao_weight(p, dtype)
                continue
            if is_nf4_weight(p):  # torchao's NF4Tensor, as torchtune's QLoRA (nf4_torchao.py)
                params[name] = fake_nf4_weight(p, dtype)
                continue
            if is_dtensor(p):  # a tensor-parallel rank's shard (tensor_parallel.py)
                params[name] = local_shard_like(p, dtype, real, device)
                continue
            if real:
                t = p.detach().to(device="cpu", dtype=dtype, copy=True)
            else:
                t = torch.empty_strided(tuple(p.shape), p.stride(), dtype=dtype, device=device)
            params[name] = t.requires_grad_(p.requires_grad)
        buffers: dict[str, torch.Tensor] = {}
        for name, b, _row in self._buffers:
            dtype = self._dtype(b, precision)
            if real:
                buffers[name] = b.detach().to(device="cpu", dtype=dtype, copy=True)
            else:
                buffers[name] = torch.empty_strided(
                    tuple(b.shape), b.stride(), dtype=dtype, device=device
                )
        return params, buffers

    def describe_inputs(self) -> str:
        """The inputs' shapes as a person reads them, with the batch and sequence dimensions
        named: ``"batch × 3 × 224 × 224"``, or ``"input_ids: batch × seq int64, labels:
        batch × seq int64 (seq = 128)"``."""
        seq = f" (seq = {self.seq_len})" if self.seq_axes else ""
        if self.inputs is None:
            assert self.input_size is not None
            dims: list[Any] = ["batch", *self.input_size]
            for dim in self.seq_axes.values():
                dims[dim] = "seq"
            return _shape_text(tuple(dims)) + seq
        n = self.inputs.batch_size()

        def one(name: str, t: torch.Tensor) -> str:
            dims: list[Any] = list(t.shape)
            if dims and dims[0] == n:
                dims[0] = "batch"
            if name in self.seq_axes:
                dims[self.seq_axes[name]] = "seq"
            text = _shape_text(tuple(dims)) if dims else "scalar"
            dtype = str(t.dtype).removeprefix("torch.")
            return text if t.is_floating_point() else f"{text} {dtype}"

        tensors = self.inputs.named_tensors()
        if len(tensors) == 1 and not self.inputs.kwargs:
            return one(*tensors[0]) + seq
        return ", ".join(f"{k}: {one(k, v)}" for k, v in tensors) + seq

    @property
    def seq_len(self) -> int | None:
        """The example's sequence length (None without a sequence axis)."""
        if not self.seq_axes:
            return None
        name, dim = next(iter(self.seq_axes.items()))
        return _dim_size(self.inputs, self.input_size, name, dim)

    def make_inputs(
        self, batch_size: int, precision: Precision, real: bool, seq_len: int | None = None
    ) -> ModelInputs:
        """The example batch resized to ``batch_size`` along dim 0 (and to ``seq_len`` along
        the sequence axes), floats in the storage dtype (fake tensors inside the fake mode, or
        real CPU tensors: the example's values tiled)."""
        half = storage_dtype(precision)
        if self.inputs is None:
            assert self.input_size is not None
            shape = [batch_size, *self.input_size]
            if seq_len is not None:
                for dim in self.seq_axes.values():
                    shape[dim] = seq_len
            if real:
                gen = torch.Generator().manual_seed(0)
                return ModelInputs((torch.randn(shape, generator=gen).to(half),), {})
            return ModelInputs((torch.empty(shape, dtype=half),), {})
        n = self.inputs.batch_size()

        def resize(name: str, t: torch.Tensor) -> torch.Tensor:
            dtype = half if t.is_floating_point() else t.dtype
            sizes = list(t.shape)
            if t.dim() > 0 and t.shape[0] == n:
                sizes[0] = batch_size
            seq_dim = self.seq_axes.get(name)
            if seq_len is not None and seq_dim is not None:
                sizes[seq_dim] = seq_len
            if not real:
                return torch.empty(sizes, dtype=dtype)
            src = t.detach().to("cpu")
            for dim, size in enumerate(sizes):  # tile the example's values to the new sizes
                if size != src.shape[dim]:
                    reps = [1] * src.dim()
                    reps[dim] = -(-size // src.shape[dim])
                    src = src.repeat(*reps).narrow(dim, 0, size)
            return src.to(dtype).clone()

        return self.inputs.map_named(resize)


def _shape_text(dims: tuple[Any, ...]) -> str:
    return " × ".join(str(d) for d in dims)


def _describe(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.stride(), t.dtype, t.requires_grad)


def _changed_by_run(tensors: list[torch.Tensor], before: list[tuple[Any, ...]]) -> bool:
    """Whether a run left shared fake tensors otherwise than it found them: tensor hooks a
    forward registered (``self.w.register_hook(...)``), which would pile up run after run,
    or metadata it changed (``.data =``, ``requires_grad_``)."""
    for t, described in zip(tensors, before, strict=True):
        if getattr(t, "_backward_hooks", None) or getattr(t, "_post_accumulate_grad_hooks", None):
            return True
        if _describe(t) != described:
            return True
    return False


@contextlib.contextmanager
def _preserved_model_state(model: torch.nn.Module) -> Iterator[None]:
    """Restore every module's training flag and the global RNG state, whatever happens."""
    flags = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


class Profiler:
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
        from .cuda_rules import CudaEmulation, CudaTarget

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
                stack.enter_context(tracked_rng_states(rec))
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
            backward_start=marks.get("backward", n_events),
            optimizer_at=marks.get("optimizer", n_events),
            uses_matmul=rec.uses_matmul,
            step_starts=step_starts,
            step_flops=step_flops,
            host_peak_bytes=0 if offload is None else offload.host_peak_bytes,
            compile_fallbacks=tuple(compile_fallbacks),
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

    def run_optimizer(
        self,
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
                        local_shard_shape(tuple(p.shape), *shard), dtype=p.dtype, device=device
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


class _Source:
    """Profiles one precision and mode (or one optimizer) when the table first asks."""

    # Whether a stack of identical blocks is recorded with 3 and 4 of them and the run
    # with all of them derived, where exact (repeated.py); False runs every step in full.
    use_repeated = True

    def __init__(self, profiler: Profiler, cache: object = True) -> None:
        self.profiler = profiler
        self.cache = cache  # profile_model's cache=, which a LoRA profile inherits
        self._stack: BlockStack | bool | None = False  # False: not looked for yet
        self._reduced: dict[int, _Source] = {}
        # (precision, mode, levers, length) whose runs the few-block copies do not give
        self._not_repeated: set[tuple[Any, ...]] = set()
        # (tp, the plan's id, the single-rank Recipe) -> (the plan, one rank's estimate)
        self._tensor_parallel: dict[tuple[Any, ...], tuple[object, Any]] = {}
        # the arguments of pipeline_stage_peaks -> each stage's StagePeak
        self._pipeline: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def timeline(
        self,
        precision: Precision,
        mode: Mode,
        seq_len: int | None = None,
        levers: Levers = NO_LEVERS,
    ) -> Timeline:
        self.profiler.seq_len = seq_len
        try:
            if mode is Mode.TRAIN and _plain_stepping(levers) != levers:
                # which parameters a step gives a gradient (those set_to_none=False keeps
                # between steps, those an optimizer in backward has state for) is read from
                # the plain step; one run of it, where not known yet
                freeing = _plain_stepping(levers)
                if freeing not in self.profiler.subject.params_with_grad:
                    self.profiler.levers = freeing
                    self._run(precision, FIT_BATCH_SIZES[0], mode, flops=False)
            self.profiler.levers = levers
            if levers.compile_batch is not None:
                # the compiled step at the asked batch, as it is there (no slope): the
                # partition may change with the batch (compiled.decided_at)
                trace = self._run(precision, levers.compile_batch, mode)
                return fit_timeline((trace,), trace)
            return self._timeline(precision, mode)
        finally:
            self.profiler.seq_len = None
            self.profiler.levers = NO_LEVERS

    def _timeline(self, precision: Precision, mode: Mode) -> Timeline:
        # FLOPs are fitted from the first two runs (batch 1 does not count them)
        fit = tuple(self._run(precision, b, mode) for b in FIT_BATCH_SIZES[:2])
        grid: list[RawTrace] = []
        if self.profiler.probe is not None and len(fit[0].workspace_storages):
            grid = self._grid_runs(precision, mode)
        # Batch 1 is run anyway (it may take paths of its own). Where it is the fit's step at
        # 1, to the byte, it is the check too, and the step costs three runs; where not, a
        # third batch size checks the fit and batch 1 is kept as it is. Where CPU kernel
        # workspaces are measured, the third batch size is a point of their interpolation
        # grid too, so it always runs.
        one = self._batch_one(precision, mode, grid)
        if not grid and one is not None and same_step(fit[0], one):
            timeline = fit_timeline(fit, one, tuple(grid))
            if timeline.exact:
                return timeline
        third = self._run(precision, FIT_BATCH_SIZES[2], mode)  # FLOPs for a quadratic
        try:
            timeline = fit_timeline(fit, third, tuple(grid))
            if not timeline.exact and same_step(fit[0], third):
                # The same step, but not a line in the batch: memory quadratic in it (a
                # loss over every pair of samples, CLIP's B x B logits). Three runs give
                # the quadratic, checked exactly at a fourth batch size.
                quadratic = self._quadratic(precision, mode, [*fit, third], grid)
                if quadratic.exact:
                    timeline = quadratic
        except NotAffineError as exc:
            raise ProfilingError(
                f"cannot fit memory to the batch size: {exc}; first difference "
                f"{self._where(exc.row)}. Randomness that changes which layers run "
                "(a random skip, early exit) or shapes that depend on values do this"
            ) from None
        if not timeline.exact and not self.profiler.real:  # the fallback already warned
            off = ""
            if timeline.check_peaks is not None:
                batch, fitted, profiled = timeline.check_peaks
                off = (
                    f": at batch {batch} the fitted peak is {fitted - profiled:+,} bytes "
                    f"({(fitted - profiled) / max(profiled, 1):+.1%}) off the profiled one, "
                    "and the error grows with the distance (memory quadratic in the batch, "
                    "a B x B similarity matrix, grows faster than any line through two points)"
                )
            warnings.warn(
                "memory is not affine in the batch size (first seen "
                f"{self._where(timeline.nonaffine_row)}); estimates away from batch "
                f"{FIT_BATCH_SIZES[0]}-{FIT_BATCH_SIZES[1]} are extrapolated{off}",
                UserWarning,
                stacklevel=4,
            )
        return self._with_batch_one(timeline, fit[0], one, grid)

    def _batch_one(self, precision: Precision, mode: Mode, grid: list[RawTrace]) -> RawTrace | None:
        """The step at batch 1 (from the CPU workspace grid where it ran there); None where
        the model refuses a batch of one (BatchNorm in training on a 1x1 map)."""
        one = next((t for t in grid if t.batch_size == 1), None)
        if one is not None:
            return one
        try:
            return self._run(precision, 1, mode, flops=False)
        except ProfilingError:
            return None

    def _with_batch_one(
        self,
        timeline: Timeline,
        fitted_trace: RawTrace,
        one: RawTrace | None,
        grid: list[RawTrace],
    ) -> Timeline:
        """``timeline`` with the step at batch 1 where that step is not the fit's at 1.

        The fit runs at batch 2 and up, because at 1 code takes other paths: size-1
        dimensions broadcast, squeeze and fold (GPT-2's eager attention trains at batch 1
        with one more copy of its scores than the line through 2 and 3 says: -65,536 bytes
        at 64 tokens). So batch 1 is kept as it is where it differs."""
        if one is None:
            return timeline
        if same_step(fitted_trace, one):
            measured = np.isin(one.event_storage, one.workspace_storages)  # interpolated
            fitted = np.where(measured, 0, timeline.events_at(1))
            if np.array_equal(fitted, np.where(measured, 0, one.event_bytes)):
                return timeline
        at_one = fit_timeline((one,), one, tuple(grid))
        # FLOPs are the fit's (the same ops count the same at batch 1)
        at_one = dataclasses.replace(
            at_one,
            flops_forward=timeline.flops_forward,
            flops_backward=timeline.flops_backward,
            step_flops=timeline.step_flops,
        )
        return dataclasses.replace(timeline, batch_one=at_one)

    def _where(self, row: int | None) -> str:
        """A module row as a person reads it: ``in module 'encoder.layers.3' (Wav2Vec2Layer)``."""
        rows = self.profiler.subject.rows
        if row is None or not 0 <= row < len(rows.names):
            return "at the end of the step"
        return f"in module {module_label(rows, row)!r} ({rows.types[row]})"

    def generation(
        self,
        precision: Precision,
        seq_len: int | None,
        *,
        decode_steps: int = DECODE_STEPS_PROFILED,
        new_tokens: int | None = None,
    ) -> Timeline:
        """A generation recorded at the prompt ``seq_len`` (None: the example's) through
        ``decode_steps`` decode steps (more across a sliding window, ``decoding._plan``), with
        generate asked for ``new_tokens`` (a ``StaticCache`` is allocated for the prompt and
        all of them before the first step; None: just more than are recorded), fitted in the
        batch."""
        self.profiler.seq_len = seq_len
        self.profiler.decode_steps = decode_steps
        self.profiler.generation_tokens = new_tokens
        try:
            return self._timeline(precision, Mode.GENERATE)
        finally:
            self.profiler.seq_len = None
            self.profiler.decode_steps = DECODE_STEPS_PROFILED
            self.profiler.generation_tokens = None

    def timeline_across_lengths(
        self, precision: Precision, mode: Mode, base: Timeline, levers: Levers = NO_LEVERS
    ) -> Timeline | None:
        """The timeline as a polynomial in (batch, seq), from ``base`` (the example's
        length) and runs at two more lengths, checked exactly at a fourth length and another
        batch size. Where that check fails, three more lengths fit it in the length and the
        padding kernels add to a multiple (``PADDED_TERMS``), checked at another length.
        None where memory is neither (windows, kernel choices that switch with the length),
        where the batch fit is quadratic or extrapolated, or where CPU kernel workspaces are
        measured."""
        s0 = self.profiler.subject.seq_len
        if s0 is None or not base.exact or base.event_bytes.degree > 1:
            return None
        if len(base.workspace_alloc_at):
            return None
        # Where batch 1 takes its own path, it is run at each length too and fitted apart.
        lines: dict[int, Timeline] = {s0: base}
        ones: dict[int, Timeline] | None = None
        if base.batch_one is not None:
            ones = {s0: base.batch_one}

        def profile_lengths(lengths: Sequence[int]) -> None:
            for length in lengths:
                if length in lines:
                    continue
                self.profiler.seq_len = length
                t2, t3 = (self._run(precision, b, mode) for b in FIT_BATCH_SIZES[:2])
                lines[length] = fit_timeline((t2, t3), t3)
                if ones is not None:
                    one = self._run(precision, 1, mode, flops=False)
                    ones[length] = fit_timeline((one,), one)

        def fitted(
            lengths: tuple[int, ...], check_len: int, terms: tuple[tuple[int, int], ...] | None
        ) -> Timeline | None:
            profile_lengths(lengths)
            self.profiler.seq_len = check_len
            check = self._run(precision, FIT_BATCH_SIZES[2], mode, flops=False)
            combined = across_lengths(
                lengths, tuple(lines[n] for n in lengths), check, check_len, terms
            )
            if combined is None or ones is None:
                return combined
            check_one = self._run(precision, 1, mode, flops=False)
            combined_one = across_lengths(
                lengths, tuple(ones[n] for n in lengths), check_one, check_len, terms, flops=False
            )
            if combined_one is None:
                return None
            combined_one = dataclasses.replace(
                combined_one,
                flops_forward=combined.flops_forward,
                step_flops=combined.step_flops,
                flops_backward=combined.flops_backward,
            )
            return dataclasses.replace(combined, batch_one=combined_one)

        self.profiler.levers = levers
        try:
            # Lengths far from the example and from multiples of 8, so that padding or a
            # window the example does not reach shows at the check rather than in an answer.
            plain = fitted((s0, 2 * s0 + 1, 3 * s0 + 2), 4 * s0 + 3, None)
            if plain is not None:
                return plain
            lengths, check_len = padded_fit_lengths(s0, PADDED_TERMS)
            return fitted(lengths, check_len, PADDED_TERMS)
        except (NotAffineError, ProfilingError):
            return None
        finally:
            self.profiler.seq_len = None
            self.profiler.levers = NO_LEVERS

    def _quadratic(
        self, precision: Precision, mode: Mode, traces: list[RawTrace], grid: list[RawTrace]
    ) -> Timeline:
        check = next((t for t in grid if t.batch_size == QUADRATIC_CHECK_BATCH), None)
        if check is None:
            check = self._run(precision, QUADRATIC_CHECK_BATCH, mode, flops=False)
        return fit_timeline(tuple(traces[:3]), check, tuple(grid))

    def _grid_runs(self, precision: Precision, mode: Mode) -> list[RawTrace]:
        """Runs at the extra workspace batch sizes; one the model cannot run (BatchNorm in
        training rejects batch 1 on a 1x1 map) is left out of the grid, not an error."""
        traces = []
        for batch in WORKSPACE_BATCH_SIZES:
            try:
                traces.append(self._run(precision, batch, mode, flops=False))
            except ProfilingError:
                continue
        return traces

    def _example(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The example batch as the user gave it (positional, keyword): its values decide
        what fake tensors cannot (``data_dependent``)."""
        inputs = self.profiler.subject.inputs
        return ((), {}) if inputs is None else (inputs.args, inputs.kwargs)

    @contextlib.contextmanager
    def _as_every_run(self) -> Iterator[None]:
        """What wraps every run, the lazy ones a later estimate() asks for and the check
        included: the model's training flags and the RNG left as they were, the worst-case
        graph, the example's mask values, and a backward recorded even when the caller sits
        inside torch.no_grad() or torch.inference_mode()."""
        model = self.profiler.subject.model
        with (
            _preserved_model_state(model),
            worst_case_graph(graph_randomness(model)),
            example_mask_values(model, *self._example()),
            torch.inference_mode(False),
            torch.enable_grad(),
        ):
            yield

    def _run(
        self, precision: Precision, batch_size: int, mode: Mode, flops: bool = True
    ) -> RawTrace:
        derived = self._derived_run(precision, batch_size, mode, flops)
        if derived is not None:
            return derived
        with self._as_every_run():
            return self._run_once(precision, batch_size, mode, flops)

    def _derived_run(
        self, precision: Precision, batch_size: int, mode: Mode, flops: bool
    ) -> RawTrace | None:
        """The run from copies of the model with 3 and 4 of its repeated blocks
        (``repeated.py``), where that is exact; None where not (the full run is made)."""
        profiler = self.profiler
        subject = profiler.subject
        if not self.use_repeated or profiler.real or profiler.probe is not None:
            return None
        if mode not in (Mode.TRAIN, Mode.INFERENCE) or subject.fixed_dtypes:
            return None
        if self._stack is False:
            self._stack = find_stack(subject.model)
        stack = self._stack
        if not isinstance(stack, BlockStack):
            return None
        levers = profiler.levers if mode is Mode.TRAIN else NO_LEVERS
        key = (precision, mode, levers, profiler.seq_len)
        if key in self._not_repeated:
            return None
        traces, reduced = [], []
        for n in FEW_BLOCKS:
            few = reduced_levers(levers, stack, n)
            if few is None:
                self._not_repeated.add(key)
                return None
            source = self._reduced_source(stack, n)
            source.profiler.seq_len, source.profiler.levers = profiler.seq_len, few
            try:
                traces.append(source._run(precision, batch_size, mode, flops))
            except Exception:
                self._not_repeated.add(key)
                return None
            finally:
                source.profiler.seq_len, source.profiler.levers = None, NO_LEVERS
            reduced.append((source.profiler.subject, few))
        (sub3, few3), (sub4, _few4) = reduced
        try:
            trace = derive(
                traces[0],
                traces[1],
                layout(sub3.rows.names, stack, FEW_BLOCKS[0]),
                layout(sub4.rows.names, stack, FEW_BLOCKS[1]),
                layout(subject.rows.names, stack, stack.count),
                len(subject.rows.names),
            )
        except NotRepeated:
            self._not_repeated.add(key)
            return None
        if few3 in sub3.params_with_grad:
            subject.params_with_grad[levers] = full_param_names(
                sub3.params_with_grad[few3], stack, [n for n, _p, _r in subject._params]
            )
        assert isinstance(trace, RawTrace)
        return trace

    def _reduced_source(self, stack: BlockStack, n: int) -> _Source:
        """The source of a meta copy of the model with ``n`` blocks of its stack."""
        if n not in self._reduced:
            subject = self.profiler.subject
            few = Subject(
                reduced_copy(subject.model, stack, n),
                subject.inputs,
                subject.input_size,
                subject.loss_fn,
                subject.device,
            )
            few.seq_axes = dict(subject.seq_axes)
            source = _Source(Profiler(few), cache=False)
            source.use_repeated = False
            self._reduced[n] = source
        return self._reduced[n]

    def check_runs(self) -> bool:
        """:meth:`Profiler.check_runs` inside the wrappers of every run."""
        with self._as_every_run():
            return self.profiler.check_runs()

    def _run_once(self, precision: Precision, batch_size: int, mode: Mode, flops: bool) -> RawTrace:
        try:
            return self.profiler.run(precision, batch_size, mode, flops)
        except DATA_DEPENDENT_ERRORS as exc:
            subject = self.profiler.subject
            if self.profiler.real:
                raise
            if any(p.device.type == "meta" for _n, p, _r in subject._params):
                raise ProfilingError(
                    "fake tensors cannot run this model (an op's output depends on tensor "
                    f"values: {type(exc).__name__}), and a model on the meta device has no "
                    "values for a real run"
                ) from None
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            subject.fallback_reason = reason
            self.profiler.real = True
            warn_fallback(reason)
            return self.profiler.run(precision, batch_size, mode, flops)

    def lora_profile(
        self, rank: int, targets: tuple[str, ...] | None, dtype: str | None = None
    ) -> ModelProfile:
        """The profile of a meta copy of the model with PEFT's LoRA adapters (the model
        itself untouched), with the same inputs, loss, device and sequence axis; the
        adapters in ``dtype`` (``levers.parse_lora_dtype``: None is PEFT's fp32)."""
        subject = self.profiler.subject
        # PEFT builds each adapter as a CPU nn.Linear (initialized from the global RNG)
        # before moving it to the base layer's (meta) device: the user's RNG is left as it was
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # the plain profile already said what these say; PEFT's and transformers' notes
            # on a wrapping the user did not do themselves are not theirs to act on
            warnings.simplefilter("ignore", InputShapeWarning)
            warnings.filterwarnings("ignore", module=r"(peft|transformers)(\.|$)")
            base = meta_copy(subject.model)
            base_ids = {id(p) for p in base.parameters()}
            wrapped = lora_wrapped(base, rank, targets, dtype)
            # the adapters' dtypes are set below, before any run (and any cache entry)
            sub = self._sub_profile(wrapped, self.cache)
        sub.name_prefix = PEFT_PREFIX
        # PEFT keeps the adapters in fp32 on an fp16 / bf16 base (get_peft_model's
        # autocast_adapter_dtype=True, peft/tuners/tuners_utils.py, _cast_adapter_dtype):
        # the base is cast to the precision, the adapters are not. (fp32 profiles alike.)
        # An explicit dtype is kept the same way; "base" adapters follow the precision.
        if dtype == "base":
            return sub
        adapters = {
            n: str(p.dtype).removeprefix("torch.")
            for n, p in wrapped.named_parameters()
            if id(p) not in base_ids
        }
        return _with_fixed_dtypes(sub, adapters)

    def quantized_profile(
        self,
        weights: Weights,
        rank: int | None = None,
        targets: tuple[str, ...] | None = None,
        dtype: str | None = None,
    ) -> ModelProfile:
        """The profile of a meta copy of the model with its Linear layers quantized by
        bitsandbytes (``quantized.quantized_copy``; the model itself untouched) or torchao
        (``torchao_weights.torchao_copy``) and, with ``rank``, QLoRA's PEFT wrapping
        (``quantized.qlora_wrapped``); or torchtune's QLoRA modules on torchao's NF4Tensor
        (``nf4_torchao.nf4_copy``)."""
        subject = self.profiler.subject
        if weights.format is WeightFormat.NF4_TORCHAO:
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.simplefilter("ignore", InputShapeWarning)
                copy_ = nf4_copy(subject.model, weights, rank, targets, dtype)
                # every parameter takes the precision's dtype, as torchtune builds them
                return self._sub_profile(copy_, cache=False)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", InputShapeWarning)
            warnings.filterwarnings(
                "ignore", module=r"(peft|transformers|bitsandbytes|torchao)(\.|$)"
            )
            if weights.torchao:  # torchao's quantize_ (torchao_weights.py)
                copy_ = torchao_copy(subject.model, weights)
            else:
                copy_ = quantized_copy(subject.model, weights)
            base_ids = {id(p) for p in copy_.parameters()}
            if rank is not None:
                copy_ = qlora_wrapped(copy_, rank, targets, dtype)
            # not cached: the profile key does not read the weights' quantization settings
            sub = self._sub_profile(copy_, cache=False)
        if rank is not None:
            sub.name_prefix = PEFT_PREFIX
        if weights.torchao:  # quantize_ keeps every other parameter's dtype
            return sub
        return _with_fixed_dtypes(sub, kept_dtypes(copy_, base_ids, rank is not None, dtype))

    def float8_profile(self, float8: Float8) -> ModelProfile:
        """The profile of a meta copy of the model converted to float8 training by torchao
        (``float8.float8_copy``; the model itself untouched): ``emulate=True`` on
        ``device="cpu"``, torchao's ``_scaled_mm`` path on ``device="cuda"``."""
        subject = self.profiler.subject
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", InputShapeWarning)
            warnings.filterwarnings("ignore", module=r"torchao(\.|$)")
            copy_ = float8_copy(subject.model, float8, emulate=subject.device is Device.CPU)
            # not cached: the profile key does not read the float8 setting
            return self._sub_profile(copy_, cache=False)

    def load_layout(self, dtype: str, weights: Weights) -> LoadLayout:
        """The tensors the model holds once loaded in ``dtype`` with ``weights``
        (``loading.load_layout``; the model itself untouched), the quantized modules
        checked first (a ValueError where there are none)."""
        model = self.profiler.subject.model
        if weights.quantized:
            quantized_modules(model, weights)
        return load_layout(model, dtype, weights)

    def tensor_parallel_estimate(self, tp: int, tp_plan: object, recipe: Any) -> Any:
        """One of ``tp`` tensor-parallel ranks' estimate of ``recipe``: a meta copy of the
        model sharded by its plan (``tensor_parallel.resolve_plan``, checked first) with
        DTensor on a fake process group, profiled as a sub-profile while the group is up;
        the group is destroyed after, whatever happens. Kept per (tp, plan, recipe)."""
        try:  # the same question again (a widget's redraw): the same answer
            key: Any = (tp, id(tp_plan), recipe)
            cached = self._tensor_parallel.get(key)
        except TypeError:  # a setting that cannot be hashed (a callable's closure...)
            key, cached = None, None
        if cached is not None:
            return cached[1]
        estimate = self._tensor_parallel_estimate(tp, tp_plan, recipe)
        if key is not None:  # the plan is held with it: its id is not reused meanwhile
            self._tensor_parallel[key] = (tp_plan, estimate)
        return estimate

    def tensor_parallel_cached(self, tp: int, tp_plan: object, recipe: Any) -> bool:
        """Whether :meth:`tensor_parallel_estimate` has this answer kept."""
        try:
            return (tp, id(tp_plan), recipe) in self._tensor_parallel
        except TypeError:  # a setting that cannot be hashed: never kept
            return False

    def tensor_parallel_refusal(self, tp: int) -> str | None:
        """Why the model's own plan cannot shard it over ``tp`` ranks, or None."""
        try:
            resolve_plan(self.profiler.subject.model, tp)
        except (ValueError, TypeError) as exc:
            return str(exc)
        return None

    def _tensor_parallel_estimate(self, tp: int, tp_plan: object, recipe: Any) -> Any:
        subject = self.profiler.subject
        plan = resolve_plan(subject.model, tp, tp_plan)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", InputShapeWarning)
            warnings.filterwarnings("ignore", module=r"(transformers|torch\.distributed)(\.|$)")
            with fake_process_group(tp) as mesh:
                copy_ = parallelized(meta_copy(subject.model), plan, mesh)
                # not cached: the profile key does not read the mesh
                sub = self._sub_profile(copy_, cache=False)
                return sub._estimate(recipe)

    def pipeline_stage_peaks(
        self,
        pp: int,
        schedule: Any,
        microbatches: int,
        batch_size: int,
        seq_len: int | None,
        precision: Precision,
        optimizer: OptimizerChoice | None,
        implementation: OptimizerImplementation | None,
        split: tuple[str, ...] | None = None,
    ) -> tuple[Any, ...]:
        """Each of ``pp`` pipeline stages' step at ``batch_size`` (the whole step's batch),
        as ``torch.distributed.pipelining`` runs ``schedule`` over ``microbatches``, on fake
        tensors (``pipeline_parallel.stage_peak``); the model and inputs checked first
        (``pipeline_parallel.check_pipeline_model``). Kept per question."""
        kwargs = self._pipeline_inputs(pp, split)
        key = (
            pp,
            schedule,
            microbatches,
            batch_size,
            seq_len,
            precision,
            optimizer,
            implementation,
            split,
        )
        if key not in self._pipeline:
            length = seq_len or kwargs["input_ids"].shape[1]
            shaped = {
                k: torch.empty((batch_size, length), dtype=v.dtype, device="meta")
                for k, v in kwargs.items()
            }
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.filterwarnings("ignore", module=r"(transformers|torch\.distributed)(\.|$)")
                self._pipeline[key] = tuple(
                    self._stage_peak(shaped, stage, key) for stage in range(pp)
                )
        return self._pipeline[key]

    def pipeline_parallel_refusal(self, pp: int) -> str | None:
        """Why the model or its inputs cannot be split into ``pp`` stages, or None."""
        try:
            self._pipeline_inputs(pp, None)
        except ValueError as exc:
            return str(exc)
        return None

    def _pipeline_inputs(self, pp: int, split: tuple[str, ...] | None) -> dict[str, Any]:
        """The example's keyword inputs, where the profile's device, the model and the
        inputs can be split into ``pp`` stages (else a ValueError saying why)."""
        from .pipeline_parallel import check_pipeline_model

        subject = self.profiler.subject
        if subject.device is not Device.CPU:
            raise ValueError(
                "pp > 1 is estimated for a profile made with device='cpu' only for now (the "
                "stages' steps run on CPU fake tensors, checked against gloo ranks); profile "
                "with device='cpu'"
            )
        given = subject.inputs
        kwargs = given.kwargs if given is not None and not given.args else None
        check_pipeline_model(subject.model, kwargs, pp, split)
        assert kwargs is not None
        return dict(kwargs)

    def _stage_peak(self, inputs: dict[str, torch.Tensor], stage: int, key: tuple[Any, ...]) -> Any:
        from .pipeline_parallel import stage_peak

        pp, schedule, microbatches, _batch, _length, precision, optimizer, implementation, split = (
            key
        )
        return stage_peak(
            self.profiler.subject.model, inputs, stage, pp, schedule, microbatches, precision,
            optimizer, implementation, split,
        )  # fmt: skip

    def _sub_profile(self, model: torch.nn.Module, cache: object) -> ModelProfile:
        """A deferred profile of a meta copy of the model (LoRA's, the quantized one) with
        the same inputs, loss, device and sequence axis; the parent profile ran the model
        already, so no run is made here."""
        subject = self.profiler.subject
        return profile_model(
            model,
            input_size=subject.input_size,
            inputs=subject.inputs,
            loss_fn=subject.loss_fn,
            device=subject.device.value,
            seq_axis=dict(subject.seq_axes) or False,
            precisions=(),
            cache=cache,
        )

    def optimizer_trace(
        self,
        precision: Precision,
        optimizer: OptimizerChoice,
        levers: Levers = NO_LEVERS,
        only: tuple[str, ...] | None = None,
        shard: tuple[int, int] | None = None,
        implementation: OptimizerImplementation | None = OptimizerImplementation.FORLOOP,
    ) -> OptimizerTrace:
        self.profiler.levers = levers
        try:
            with torch.inference_mode(False), torch.enable_grad(), quiet_third_party():
                return self.profiler.run_optimizer(
                    precision, optimizer, only, shard, implementation
                )
        finally:
            self.profiler.levers = NO_LEVERS


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


def _check_input_size(input_size: Any) -> tuple[int, ...]:
    try:
        dims = tuple(input_size)
    except TypeError:
        dims = (input_size,)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ValueError(
            f"input_size must be the shape of one sample, a tuple of positive ints such as "
            f"(3, 224, 224); got {input_size!r}"
        )
    return dims


# Hugging Face's token inputs: dim 1 of each is the sequence where they share one length
# (tokenizer outputs, and the labels of a causal LM).
_TOKEN_INPUTS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "labels",
    "decoder_input_ids",
)


def find_seq_axes(
    inputs: ModelInputs | None, input_size: tuple[int, ...] | None, seq_axis: Any
) -> tuple[dict[str, int], str]:
    """The sequence dimension of each input (``{}``: none), and why there is none where
    the automatic search found token inputs of different lengths.

    ``seq_axis``: None (find Hugging Face token inputs: dim 1 of the 2-D integer tensors named
    in ``_TOKEN_INPUTS``, or of 2-D integer positional tensors, where they share one length),
    False (none), an int (that dim of every batched input that has it) or a dict of input
    names (``"[0]"`` for the first positional) to dims.
    """
    if seq_axis is False:
        return {}, "seq_axis=False"
    # batched input name -> its ndim (input_size: the one float input)
    if inputs is None:
        assert input_size is not None
        ndims = {"[0]": 1 + len(input_size)}
        tensors: dict[str, torch.Tensor] = {}
    else:
        n = inputs.batch_size()
        tensors = {k: t for k, t in inputs.named_tensors() if t.dim() > 0 and t.shape[0] == n}
        ndims = {k: t.dim() for k, t in tensors.items()}
    shapes = _shapes_text(inputs, input_size)
    if seq_axis is None:
        if inputs is None:
            return {}, "input_size= has no automatic sequence axis (give seq_axis=)"
        found = {
            k: 1
            for k, t in tensors.items()
            if t.dim() == 2
            and not t.is_floating_point()
            and (k in _TOKEN_INPUTS or k.startswith("["))
        }
        if len({int(tensors[k].shape[1]) for k in found}) > 1:
            return {}, (
                f"the token inputs have different lengths ({shapes}): one sequence axis is "
                "supported; pass seq_axis={name: dim, ...} for the inputs that share it"
            )
        return found, "no token inputs (input_ids, ...) found; pass seq_axis= to name one"
    if isinstance(seq_axis, bool) or not isinstance(seq_axis, (int, dict)):
        raise TypeError(
            f"seq_axis must be None (find token inputs), False (none), a dim (int) or a dict "
            f"of input names to dims; got {seq_axis!r}"
        )
    if isinstance(seq_axis, int):
        if seq_axis < 1:
            raise ValueError(
                f"seq_axis={seq_axis}: dim 0 is the batch; the sequence is a later dim of the "
                f"inputs ({shapes})"
            )
        axes = {k: seq_axis for k, ndim in ndims.items() if ndim > seq_axis}
        if not axes:
            raise ValueError(f"seq_axis={seq_axis}: no batched input has dim {seq_axis} ({shapes})")
    else:
        axes = {}
        for k, dim in seq_axis.items():
            if k not in ndims:
                raise ValueError(
                    f"seq_axis names input {k!r}, which is not a batched input; the inputs "
                    f"are {shapes}"
                )
            ndim = ndims[k]
            if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim < ndim:
                raise ValueError(
                    f"seq_axis[{k!r}] = {dim!r}: give a dim from 1 to {ndim - 1} of {k} "
                    f"(dim 0 is the batch); the inputs are {shapes}"
                )
            axes[k] = dim
    lengths = {k: _dim_size(inputs, input_size, k, d) for k, d in axes.items()}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in lengths.items())
        raise ValueError(
            f"the sequence axes have different lengths ({listed}): one sequence axis is "
            "supported; name only the inputs that share it"
        )
    return axes, ""


def _dim_size(
    inputs: ModelInputs | None, input_size: tuple[int, ...] | None, name: str, dim: int
) -> int:
    if inputs is None:
        assert input_size is not None
        return input_size[dim - 1]
    return int(dict(inputs.named_tensors())[name].shape[dim])


def _shapes_text(inputs: ModelInputs | None, input_size: tuple[int, ...] | None) -> str:
    if inputs is None:
        return f"input_size={input_size}"
    return ", ".join(f"{k}: {tuple(t.shape)}" for k, t in inputs.named_tensors())


def position_limit(model: torch.nn.Module) -> int | None:
    """The longest sequence a model with learned absolute positions can take: its config's
    ``max_position_embeddings`` where an ``nn.Embedding`` of that many rows holds them
    (GPT-2's ``wpe``, BERT's ``position_embeddings``; a real step past it indexes out of
    range, which fake tensors do not check). Rotary or relative positions (Llama, T5) have no
    such table, and no limit here."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    tables = (m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return limit if any(t.num_embeddings == limit for t in tables) else None


def _check_position_table(subject: Subject, limit: int | None) -> None:
    """An example longer than the model's learned position table is refused before any run:
    a real step would index past the table (fake tensors do not check the index), and the
    estimate would be for a step that cannot run. The same limit ``estimate(seq_len=...)``
    enforces."""
    length = subject.seq_len
    if limit is None or length is None or length <= limit:
        return
    name, dim = next(iter(subject.seq_axes.items()))
    raise ValueError(
        f"the inputs' sequence length {length:,} ({name}, dim {dim}) is beyond the model's "
        f"{limit:,} learned positions (config.max_position_embeddings; GPT-2's n_positions): "
        f"a real step would index past its position table. Give inputs of at most {limit:,} "
        "tokens (estimate(seq_len=...) then varies the length up to the limit)"
    )


# Config fields of a length at which attention changes form: Mistral's and Qwen2's sliding
# window, Llama 4's chunked attention (transformers' configs). Hugging Face materializes the
# mask once the key length reaches it (masking_utils._ignore_causal_mask_sdpa: "if
# local_attention_size is not None and kv_length >= local_attention_size: return False").
_WINDOW_FIELDS = ("sliding_window", "attention_chunk_size")


def attention_window(model: torch.nn.Module) -> int | None:
    """The smallest length at which the model's attention changes form, if it has one."""
    config = getattr(model, "config", None)
    sizes = [getattr(config, name, None) for name in _WINDOW_FIELDS]
    windows = [v for v in sizes if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(windows, default=None)


def _check_devices(model: torch.nn.Module, inputs: ModelInputs) -> None:
    """The example inputs must be where the model's parameters and buffers are, as the user's
    real step needs them: a CPU model fed CUDA tensors (or ``cuda:1`` tensors to a ``cuda:0``
    model) would fail there, so say so now rather than profile a step that cannot run.

    The profile itself runs on fake CPU tensors of the same shapes, so the meta device (no
    data: shapes only) matches anything, a model spread over several devices (pipeline
    stages, CPU offload) is not checked, and 0-dim CPU tensors may go with any device, as in
    PyTorch's own ops (``TensorIteratorConfig::allow_cpu_scalars``, on for binary ops: "a
    scalar CPU argument, such as from ``cuda_tensor + 5``", aten/src/ATen/native/cuda/Loops.cuh)."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) != 1:
        return
    (model_device,) = devices
    if model_device.type == "meta":
        return
    named = [(f"inputs[{i}]", v) for i, v in enumerate(inputs.args)]
    named += [(f"inputs[{k!r}]", v) for k, v in inputs.kwargs.items()]
    for name, t in named:
        if not isinstance(t, torch.Tensor) or t.device == model_device:
            continue
        if t.device.type == "meta" or (t.dim() == 0 and t.device.type == "cpu"):
            continue
        raise ValueError(
            f"{name} is on device {str(t.device)!r}, but the model's parameters and buffers "
            f"are on {str(model_device)!r}: a real step would fail there. Move the inputs "
            f"with .to({str(model_device)!r}) (or the model to {str(t.device)!r})"
        )


def profile_model(
    model: torch.nn.Module | str | os.PathLike[str],
    input_size: Any = None,
    inputs: Any = None,
    loss_fn: Callable[[Any], Any] | None = None,
    device: str = "cuda",
    seq_axis: Any = None,
    *,
    precisions: Any = None,
    cache: Any = True,
    seq_len: int | None = None,
    trust_remote_code: bool = False,
) -> ModelProfile:
    """Profile one training step and one inference pass of ``model`` on fake tensors.

    The model is run on fake tensors (no real memory, so any model size profiles), at a few
    small batch sizes; every allocation and free is recorded with the module and phase it
    happened in, and fitted to ``a + b * batch``. The model itself is left exactly as it was:
    parameters, gradients, device, dtype, training flags, hooks and the global RNG state.

    Parameters
    ----------
    model : torch.nn.Module or str
        Any module, on any device, including the meta device; nothing is moved or allocated
        there (parameters and buffers are profiled as fake CPU tensors of their shapes). Or a
        Hugging Face Hub id (``"org/name"``) or a local directory holding a ``config.json``:
        only the config is read, and the model is built from it on the meta device, with the
        class ``config.architectures`` names (else ``AutoModelForCausalLM``, else
        ``AutoModel``), fed ``input_ids`` (and ``labels``, for a language-model head) of
        ``seq_len`` tokens; ``input_size`` and ``inputs`` are then refused. The profile's
        ``model_name`` says which class was built (``vram_widget._profiling.hub``).
    input_size : tuple of int, optional
        The shape of one sample, without the batch dimension; the input is one float tensor.
    inputs : Tensor, tuple of Tensors or dict of keyword Tensors, optional
        An example batch (dim 0 is the batch). Give this or ``input_size``. Only shapes and
        dtypes are read: on the model's device, or on the meta device; a batch on another
        real device than the model's (which its real step would reject) is a ValueError.
    loss_fn : callable, optional
        Maps the model's output to a scalar loss. Default: ``output.loss`` when present, else
        the first floating tensor of the output, ``.float().mean()``.
    device : {"cuda", "cpu"}
        Whose kernels and defaults the estimate is for. ``"cuda"`` emulates CUDA's kernel
        choices (fused dropout masks, flash / memory-efficient attention, foreach optimizers,
        CUDA autocast lists, 512-byte allocator blocks); ``"cpu"`` reproduces a CPU step.
    seq_axis : None, False, int or dict, optional
        The sequence dimension, which ``estimate(seq_len=...)`` varies. None finds Hugging
        Face token inputs (dim 1 of ``input_ids``, ``attention_mask``, ``token_type_ids``,
        ``position_ids``, ``labels``, ``decoder_input_ids`` as 2-D integer tensors, or of
        2-D integer positional tensors) where they share one length; an int is that dim of
        every batched input that has it; a dict maps input names (``"[0]"`` for the first
        positional) to dims; False means none.
    precisions : sequence of str, optional
        The precisions whose training step, inference pass and Adam step are profiled now
        (each other setting is profiled on its first estimate). The default, None,
        profiles nothing up front: one unrecorded fake training step and inference forward
        (fp32, nothing recorded) check that the model runs, so that a model or input that
        cannot run is refused here, and each setting is profiled on its first estimate (an
        estimate in bf16 runs no fp32 profile). Where that check fails, fp32 is profiled
        now, as ``("fp32",)`` does, and raises the error (or falls back to a real run) as
        it did. ``()`` defers every run without the check; ``("bf16",)`` runs bf16 alone.
    cache : bool or path, optional
        Whether profiles are read from and written to the on-disk cache: True (the user
        cache directory, ``$VRAM_WIDGET_CACHE_DIR`` where set, off where
        ``$VRAM_WIDGET_CACHE`` is ``0``), False, or a cache directory. A second process
        that profiles the same model, inputs, loss and device with the same library
        versions runs nothing; what is in the key is listed in
        ``vram_widget._profiling.disk_cache``. A ``loss_fn`` whose state cannot be hashed (a
        bound method, a closure over a tensor) is not cached.
    seq_len : int, optional
        For a model named by a string: tokens per sample of the example batch (default 128,
        or the config's ``max_position_embeddings`` where that is less); ``estimate(seq_len=)``
        varies it afterwards.
    trust_remote_code : bool, optional
        For a model named by a string whose architecture is the repository's own code
        (``config.auto_map``), not transformers': True downloads and runs that code.

    Returns
    -------
    ModelProfile
        Call ``.estimate(batch_size, precision, optimizer, mode)`` on it.

    Examples
    --------
    >>> from vram_widget import profile_model, zoo
    >>> profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    >>> profile.param_count
    669706
    >>> est = profile.estimate(batch_size=32, optimizer="adam")
    >>> # exp_avg and exp_avg_sq per parameter, plus a 4-byte step per tensor (6 tensors)
    >>> est.optimizer_state_bytes == 2 * 4 * profile.param_count + 6 * 4
    True
    """
    model, inputs, model_name = model_or_name(model, input_size, inputs, seq_len, trust_remote_code)
    check_model(model)
    target = parse_option(Device, device, "device")
    eager = () if precisions is None else _parse_precisions(precisions)
    if inputs is None and input_size is None:
        raise ValueError(
            "give the example input: input_size=(...) for one sample's shape, "
            "or inputs=<an example batch>"
        )
    if inputs is not None and input_size is not None:
        raise ValueError("give input_size or inputs, not both")
    model_inputs = None
    size = None
    if inputs is not None:
        model_inputs = ModelInputs.from_user(inputs)
        model_inputs.batch_size()  # raises a clear error when no tensor has a batch dim
        _check_devices(model, model_inputs)
    else:
        size = _check_input_size(input_size)
    check_forward_accepts(model, model_inputs or ModelInputs((None,), {}))
    seq_axes, no_seq_reason = find_seq_axes(model_inputs, size, seq_axis)
    subject = Subject(model, model_inputs, size, loss_fn, target, seq_axes=seq_axes)
    seq_len_limit = position_limit(model) if seq_axes else None
    _check_position_table(subject, seq_len_limit)
    profiler = Profiler(subject)
    inner = _Source(profiler, cache)
    source = cached_source(
        inner,
        cache,
        model,
        _named_values(model_inputs),
        size,
        loss_fn,
        target.value,
        seq_axes,
    )
    auto_blocks, hf_auto = checkpoint_auto(model, subject.rows.names[:-2], subject.rows.types[:-2])
    generates, limit, cache_implementation = generation_limit(model)
    profile = ModelProfile(
        subject.rows,
        target,
        source,
        model_name=model_name,
        input_shape=subject.describe_inputs(),
        seq_len=subject.seq_len,
        no_seq_reason=no_seq_reason,
        seq_len_limit=seq_len_limit,
        seq_window=attention_window(model) if seq_axes else None,
        generates=generates,
        generation_limit=limit,
        cache_implementation=cache_implementation,
        param_names=tuple(name for name, _p, _row in subject._params),
        param_shapes=tuple(tuple(p.shape) for _name, p, _row in subject._params),
        param_trainable=tuple(p.requires_grad for _name, p, _row in subject._params),
        checkpoint_blocks=auto_blocks,
        hf_checkpointing=hf_auto,
        loss_chunks_refusal=chunked_loss_refusal(model, model_inputs, loss_fn),
    )
    if precisions is None and not _made_before(source) and not inner.check_runs():
        # the check cannot tell: the fp32 profile says whether (and how) the model runs
        eager = (Precision.FP32,)
    # Training and inference, and Adam, in the precisions the first estimate asks for.
    try:
        for precision in eager:
            profile.timeline(precision, Mode.TRAIN)
            profile.timeline(precision, Mode.INFERENCE)
            profile.optimizer_trace(precision, OptimizerName.ADAM)
    except ProfilingError:
        # A kernel that runs in some dtypes only (the CUDA grouped GEMM of mixture-of-experts
        # layers: bf16) fails fp32 alone. The profile serves the precisions that run, and
        # an estimate in fp32 raises that error; where none runs, the model cannot be run.
        if not _another_precision_runs(profile):
            raise
    profile.fallback_reason = subject.fallback_reason
    knobs = graph_randomness(model)
    if knobs:
        where = ", ".join(f"{type(o).__name__}.{n}={v:g}" for o, n, v, _off in knobs[:3])
        warnings.warn(
            f"{type(model).__name__} drops random layers in training ({where}): the training "
            "estimate is for the step in which no layer is dropped, the worst case",
            UserWarning,
            stacklevel=2,
        )
    if size is not None:
        _warn_if_batch_in_input_size(subject)
    return profile


def _named_values(inputs: ModelInputs | None) -> list[tuple[str, Any]]:
    """Every example input by name (``"[i]"`` positional), tensors or not."""
    if inputs is None:
        return []
    return [*((f"[{i}]", v) for i, v in enumerate(inputs.args)), *inputs.kwargs.items()]


def _parse_precisions(precisions: Any) -> tuple[Precision, ...]:
    """``profile_model``'s ``precisions=``: one precision or a sequence of them."""
    if isinstance(precisions, str | Precision):
        precisions = (precisions,)
    try:
        items = tuple(precisions)
    except TypeError:
        raise TypeError(
            "precisions must be a sequence of precisions such as ('fp32',) or ('bf16',), "
            f"or () to profile on the first estimate; got {precisions!r}"
        ) from None
    return tuple(dict.fromkeys(parse_option(Precision, p, "precision") for p in items))


def _made_before(source: object) -> bool:
    """Whether the on-disk cache holds runs of this profile: a process profiled the same
    model, inputs, loss and device before, so it runs (``DiskCachedSource.made_before``)."""
    made_before = getattr(source, "made_before", None)
    return made_before is not None and bool(made_before())


def _another_precision_runs(profile: ModelProfile) -> bool:
    for precision in (Precision.BF16, Precision.FP16):
        try:
            profile.timeline(precision, Mode.TRAIN)
            profile.timeline(precision, Mode.INFERENCE)
        except ProfilingError:
            continue
        return True
    return False


def _warn_if_batch_in_input_size(subject: Subject) -> None:
    """Warn where ``input_size`` starts with a common batch size and the model would also run
    on one sample without that dimension: then the user more likely gave a batch's shape."""
    size = subject.input_size
    if size is None or len(size) < 2 or size[0] not in _COMMON_BATCH_SIZES:
        return
    if not _forward_runs(subject, size[1:]):
        return
    warnings.warn(
        f"input_size={size} is read as the shape of ONE sample (inputs: batch × "
        f"{_shape_text(size)}), but it starts with {size[0]}, a common batch size, and the "
        f"model also runs on samples of shape {size[1:]}. If {size[0]} is the batch, pass "
        f"input_size={size[1:]}. (Silence with warnings.filterwarnings('ignore', "
        "category=vram_widget.InputShapeWarning).)",
        InputShapeWarning,
        stacklevel=3,
    )


def _forward_runs(subject: Subject, sample_shape: tuple[int, ...]) -> bool:
    """Whether one fake inference forward of the model runs on samples of this shape."""
    probe = Subject(subject.model, None, sample_shape, None, subject.device)
    fake_mode = new_fake_mode()
    with (
        _preserved_model_state(subject.model),
        paused_gc(),
        quiet_fake_tensor_log(),
        quiet_third_party(),
        fake_mode,
        torch.no_grad(),
    ):
        params, buffers = probe.make_state(Precision.FP32, real=False)
        (x,) = probe.make_inputs(2, Precision.FP32, real=False).args
        subject.model.eval()
        try:
            functional_call(subject.model, {**params, **buffers}, (x,), tie_weights=True)
        except Exception:
            return False
    return True


def warn_fallback(reason: str) -> None:
    warnings.warn(
        "fake tensors cannot run this model "
        f"({reason}); profiled with a real run on the CPU at tiny batch sizes instead. "
        "Memory that depends on tensor values (data-dependent shapes) is what those batches "
        "gave, and may differ for other data.",
        UserWarning,
        stacklevel=3,
    )


__all__ = [
    "InputShapeWarning",
    "ModuleRows",
    "OptimizerTrace",
    "Profiler",
    "ProfilingError",
    "RawTrace",
    "Subject",
    "profile_model",
]


def _with_fixed_dtypes(sub: ModelProfile, fixed: dict[str, str]) -> ModelProfile:
    """``sub`` with the parameters whose dtype no precision changes (adapters kept in fp32,
    bitsandbytes' packed storage): in its runs, and for their gradients (DDP buckets them
    apart)."""
    source = getattr(sub._source, "inner", sub._source)  # under a DiskCachedSource
    assert isinstance(source, _Source)
    source.profiler.subject.fixed_dtypes = frozenset(fixed)
    sub.fixed_param_dtypes = fixed
    return sub
