"""One process's real step for ``measure``: the copies of the model, inputs and optimizer one
call works on (:class:`_Session`), one iteration of the protocol, and its runs on the CPU
(under the profiler) and on CUDA (the caching allocator's peak).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from .._estimating.compiled import CompileScope
from .._estimating.levers import NO_LEVERS, Levers
from .._estimating.offloading import Offload, resolve_offload
from .._estimating.options import (
    Mode,
    OptimizerChoice,
    OptimizerImplementation,
    Precision,
    Strategy,
    parse_optimizer_choice,
    parse_option,
)
from .._estimating.recipe.float8 import Float8
from .._estimating.recipe.weights import WeightFormat, Weights
from .._estimating.sharding import (
    Parallel,
)
from .fake import recorded_cuda_memory

if TYPE_CHECKING:
    from .distributed import RankSetup
from .carried import CarriedScalars
from .chunked_loss import checked_loss_chunks, chunked_step
from .compiled import WatchedForward, compiled_forward, compiled_run
from .cpu_trace import _MARKER, _cpu_trace, _CpuTrace, _storage_bytes
from .float8 import converted
from .float8_fsdp import fsdp_held_tensors
from .measurement import Measurement
from .nf4_torchao import real_nf4
from .offloading import offloaded_forward, real_offloading
from .optimizers import state_tensors
from .param_groups import decay_parameter_names, trainer_groups
from .quantized import (
    module_state_tensors,
    qlora_wrapped,
    real_quantized,
)
from .step import (
    PEFT_PREFIX,
    ModelInputs,
    apply_levers,
    cast_floating,
    check_forward_accepts,
    check_model,
    generate_pass,
    inference_pass,
    lora_wrapped,
    make_optimizer,
    model_levers,
    paused_gc,
    storage_dtype,
    training_iteration,
)
from .stepping import OptimizerInBackward
from .torchao_weights import real_torchao, torchao_inner


def _measure(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], Any] | None,
    optimizer: Any,
    precision: Any,
    mode: Any,
    grad_accumulation: int = 1,
    checkpoint: object = None,
    trainable: object = None,
    lora_rank: object = None,
    lora_targets: object = "auto",
    lora_dtype: str | None = None,
    snapshot: bool = False,
    checkpoint_policy: object = None,
    setup: RankSetup | None = None,
    parallel: Parallel | None = None,
    new_tokens: int | None = None,
    stepping: tuple[bool, bool] = (False, True),
    protocol: tuple[bool, bool, float | None] = (False, False, None),
    decay_split: bool = False,
    carried_scalars: bool = False,
    loss_chunks: int | None = None,
    offload_activations: object = None,
    compiled: tuple[CompileScope | None, float | None] = (None, None),
    weights: Weights | None = None,
    float8: Float8 | None = None,
) -> tuple[Measurement, _CpuTrace | None]:
    """``measure``, also returning the CPU allocator trace (None on CUDA) for the tests.
    ``setup`` wraps the model copy as a data-parallel library does (a rank of
    ``_measure_ranks``); the resident bytes then count the wrapper's own buffers, as the
    library reports them (``distributed.wrapper_bytes``). Not from the allocator's events
    before the step: gloo's worker threads may drop a buffer last (the parameters' flat
    broadcast copy, DDP's first buckets), and the profiler does not see frees there."""
    prec = parse_option(Precision, precision, "precision")
    opt_name, implementation = parse_optimizer_choice(optimizer)
    run_mode = parse_option(Mode, mode, "mode")
    check_model(model)
    levers = model_levers(
        model, checkpoint, trainable, grad_accumulation, lora_rank, lora_targets, checkpoint_policy
    )
    if run_mode is not Mode.TRAIN:
        levers = NO_LEVERS
    device = _model_device(model)
    user_inputs = ModelInputs.from_user(inputs)
    batch_size = user_inputs.batch_size()
    check_forward_accepts(model, user_inputs)
    chunks = checked_loss_chunks(model, user_inputs, loss_fn, loss_chunks)
    offload = resolve_offload(offload_activations)
    if offload is not None and run_mode is not Mode.TRAIN:
        raise ValueError(
            f"offload_activations={offload.value!r} with mode={run_mode.value!r}: offloading "
            "moves the tensors autograd saves for the backward, and a step without a "
            "backward saves none; use mode='train', or leave offload_activations=None"
        )

    output_bytes: list[int] = []  # each forward call's outputs (compiled.WatchedForward)

    def session() -> _Session:
        return _Session(
            model, user_inputs, loss_fn, opt_name, prec, run_mode, device, levers, setup,
            parallel, new_tokens, implementation, stepping, protocol, decay_split,
            carried_scalars, lora_dtype, chunks if run_mode is Mode.TRAIN else None, offload,
            compiled[0], output_bytes, weights, float8,
        )  # fmt: skip

    if snapshot and device.type != "cuda":
        raise ValueError(
            "snapshot=True records the CUDA caching allocator's history "
            f"(torch.cuda.memory._record_memory_history); the model is on {device.type!r}"
        )
    recorded: dict[str, Any] | None = None
    saved: int | None = None
    with (
        _preserved_global_state(device),
        paused_gc(),
        _grad_mode(run_mode),
        compiled_run(*compiled),
    ):
        if device.type == "cuda":
            resident, peak, reserved, recorded = _run_cuda(session, device, snapshot)
            trace = None
        else:
            # DistributedDataParallel rebuilds its gradient buckets in the order the first
            # backward made them ready, in the second iteration's forward (new buckets
            # allocated, the old ones freed: reducer.cpp, Reducer::rebuild_buckets), so a
            # wrapped rank is steady from its third iteration.
            repeats = 1 if setup is None else 3
            resident, trace = _run_cpu(session, warmups=1 if setup is None else 2, repeats=repeats)
            peak = resident + trace.peak_above_start()
            reserved = None
            if run_mode is Mode.TRAIN and setup is None:
                saved = sum(e.nbytes for e in trace.forward) - output_bytes[-1]
    trains = _has_trainable(model) if levers.trainable is None else bool(levers.trainable)
    trains = trains or levers.lora_rank is not None
    has_optimizer = run_mode is Mode.TRAIN and opt_name is not None and trains
    result = Measurement(
        peak_bytes=int(peak),
        resident_bytes=int(resident),
        device=device.type,
        precision=prec,
        optimizer=opt_name if has_optimizer else None,
        mode=run_mode,
        batch_size=batch_size,
        max_reserved_bytes=reserved,
        snapshot=recorded,
        new_tokens=new_tokens if run_mode is Mode.GENERATE else None,
        compile=compiled[0],
        activation_memory_budget=compiled[1],
        saved_bytes=saved,
    )
    return result, trace


class _Session:
    """The copies one ``measure`` call works on, and one iteration of the protocol."""

    def __init__(
        self,
        model: torch.nn.Module,
        inputs: ModelInputs,
        loss_fn: Callable[[Any], Any] | None,
        optimizer: OptimizerChoice | None,
        precision: Precision,
        mode: Mode,
        device: torch.device,
        levers: Levers = NO_LEVERS,
        setup: RankSetup | None = None,
        parallel: Parallel | None = None,
        new_tokens: int | None = None,
        implementation: OptimizerImplementation | None = None,
        stepping: tuple[bool, bool] = (False, True),
        protocol: tuple[bool, bool, float | None] = (False, False, None),
        decay_split: bool = False,
        carried_scalars: bool = False,
        lora_dtype: str | None = None,
        loss_chunks: int | None = None,
        offload: Offload | None = None,
        compile_scope: CompileScope | None = None,
        output_bytes: list[int] | None = None,
        weights: Weights | None = None,
        float8: Float8 | None = None,
    ) -> None:
        dtype = storage_dtype(precision)
        self.new_tokens = new_tokens
        self.model = _copy_model(model, dtype, mode)
        if float8 is not None and float8.enabled:  # torchao converts the copy (float8.py)
            self.model = converted(self.model, float8, emulate=device.type == "cpu")
        qlora = torchtune_qlora = False
        # a tensor-parallel rank's PEFT wraps the sharded copy (tensor_parallel.rank_setup)
        lora_here = setup is None or not setup.applies_lora
        if weights is not None and weights.format is WeightFormat.NF4_TORCHAO:
            # torchtune's LoRALinear / FrozenNF4Linear on torchao's NF4Tensor (nf4_torchao.py)
            self.model = real_nf4(
                self.model, weights, levers.lora_rank, levers.lora_targets, lora_dtype
            )
            torchtune_qlora = True
        elif weights is not None and weights.torchao:  # torchao's quantize_ on the copy
            self.model = real_torchao(self.model, weights)
        elif weights is not None and weights.quantized:  # bitsandbytes quantizes the copy
            self.model = real_quantized(self.model, weights)
            self.model.train(mode is Mode.TRAIN)
            qlora = levers.lora_rank is not None
        if qlora:  # QLoRA: PEFT's prepare_model_for_kbit_training, then get_peft_model
            assert levers.lora_rank is not None
            self.model = qlora_wrapped(
                self.model, levers.lora_rank, levers.lora_targets, lora_dtype
            )
            names = tuple(PEFT_PREFIX + n for n in levers.checkpoint)
            levers = dataclasses.replace(levers, checkpoint=names)
        elif levers.lora_rank is not None and not torchtune_qlora and lora_here:
            # PEFT wraps the copy
            self.model = lora_wrapped(self.model, levers.lora_rank, levers.lora_targets, lora_dtype)
            names = tuple(PEFT_PREFIX + n for n in levers.checkpoint)
            levers = dataclasses.replace(levers, checkpoint=names)
        if compile_scope is not None:  # checkpointing inside compiled regions (compiled.py)
            levers = dataclasses.replace(levers, compile=compile_scope.value)
        apply_levers(self.model, levers)  # the copy, as the libraries apply them, then compiled
        # the copy compiled (compiled.py) before any wrapper, as torchtitan's
        # parallelize_llama calls apply_compile (each block's Module.compile) before
        # apply_fsdp_to_decoder (fully_shard per block and on the root); FSDP2's hooks on a
        # compiled block are not traced (torch/distributed/fsdp/_fully_shard/
        # _fsdp_common.py, _dynamo_disable), so dynamo skips the block's _call_impl frame
        # and compiles its forward, the hooks running eagerly around it
        # (compiled.fsdp_blocks_refusal)
        compiled = None if compile_scope is None else compiled_forward(self.model, compile_scope)
        if setup is not None:  # a data-parallel rank: DistributedDataParallel(copy), ...
            self.model = setup.wrap_model(
                self.model, parallel or Parallel(2, Strategy.DDP), precision
            )
        # per block, the blocks were compiled in place: the (wrapped) model is the forward
        self.forward: Callable[..., Any] = (
            compiled if compile_scope is CompileScope.MODEL and compiled is not None else self.model
        )
        self.micro_batches = levers.grad_accumulation
        self.inputs = inputs.map(lambda t: _copy_input(t, dtype, device))
        self.params: list[torch.Tensor] = [p for p in self.model.parameters() if p.requires_grad]
        # ... and its optimizer as the strategy builds it (ZeroRedundancyOptimizer)
        build: Callable[[OptimizerChoice, list[torch.Tensor]], torch.optim.Optimizer] = (
            functools.partial(make_optimizer, implementation=implementation)
        )
        if decay_split:  # Hugging Face Trainer's two groups (param_groups.py)
            decay = decay_parameter_names(self.model)
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            build = functools.partial(
                make_optimizer, implementation=implementation, groups=trainer_groups(named, decay)
            )
        if setup is not None and setup.make_optimizer is not None:
            make = setup.make_optimizer

            def build(name: OptimizerChoice, params: list[torch.Tensor]) -> torch.optim.Optimizer:
                return make(name, params, implementation)

        in_backward, self.set_to_none = stepping
        self.outputs_freed, self.loss_scaled, self.clip_grad_norm = protocol
        # the loop's scalars, carried from the first (warm-up) iteration into the measured one
        self.carried = CarriedScalars() if carried_scalars and mode is Mode.TRAIN else None
        steps = mode is Mode.TRAIN and optimizer is not None and bool(self.params)
        self.in_backward = (
            OptimizerInBackward(self.params, optimizer, implementation)
            if steps and in_backward and optimizer is not None
            else None
        )
        self.optimizer = (
            build(optimizer, self.params)
            if steps and optimizer is not None and self.in_backward is None
            else None
        )
        self.loss_fn = loss_fn
        if loss_chunks is not None:  # torchtune's chunked output and loss
            self.forward, self.loss_fn = chunked_step(self.model, loss_chunks)
        if offload is not None:  # the forward inside the real hooks (offloading.py)
            hooks, self._no_op_hooks = real_offloading(self.model, offload)
            self.forward = offloaded_forward(self.forward, hooks)
        if output_bytes is not None:  # the forward's range, for the saved bytes
            self.forward = WatchedForward(self.forward, output_bytes)
        self.precision = precision
        self.mode = mode
        self.device_type = device.type

    def iterate(self) -> None:
        if self.mode is Mode.TRAIN:
            hooks = self.in_backward.hooked() if self.in_backward else contextlib.nullcontext()
            with hooks:
                training_iteration(
                    self.forward,
                    self.inputs,
                    self.loss_fn,
                    self.optimizer,
                    self.precision,
                    self.device_type,
                    params=self.params,
                    micro_batches=self.micro_batches,
                    set_to_none=self.set_to_none,
                    outputs_freed=self.outputs_freed,
                    loss_scaled=self.loss_scaled,
                    carried=self.carried,
                    clip_grad_norm=self.clip_grad_norm,
                )
        elif self.mode is Mode.GENERATE:
            assert self.new_tokens is not None  # checked by measure
            generate_pass(
                self.model, self.inputs, self.precision, self.device_type, self.new_tokens
            )
        else:
            inference_pass(self.forward, self.inputs, self.precision, self.device_type)

    def wrapper_bytes(self) -> int:
        """What a data-parallel wrapper of the copy holds beside the tensors below (0 for a
        model no wrapper holds buffers for)."""
        from .distributed import wrapper_bytes

        return wrapper_bytes(self.model)

    def resident_tensors(self) -> Iterator[torch.Tensor]:
        """Parameters, buffers, optimizer state and inputs (repeats and views included)."""
        for p in self.model.parameters():  # a torchao weight: its inner tensors
            # under FSDP2 a DTensor around its shard, which may be torchao's too (float8
            # all-gather: WeightWithDynamicFloat8CastTensor, torchao/float8/fsdp_utils.py)
            shard = p.to_local() if hasattr(p, "to_local") else p
            yield from torchao_inner(shard) or [p]
        yield from self.model.buffers()
        # FSDP2's unsharded parameters: with torchao's float8 all-gather each keeps the
        # last gathered weight's scale between steps (float8_fsdp.fsdp_held_tensors)
        yield from fsdp_held_tensors(self.model)
        yield from module_state_tensors(self.model)  # bitsandbytes' quant state
        if self.optimizer is not None:
            # a ZeroRedundancyOptimizer keeps its shard's state in its local optimizer
            local = getattr(self.optimizer, "optim", self.optimizer)
            for state in local.state.values():
                # a tensor subclass's inner tensors (torchao's low-bit state)
                for value in state.values():
                    yield from state_tensors(value)
        if self.in_backward is not None:
            yield from (value for _p, _key, value in self.in_backward.state_tensors())
        if self.carried is not None:  # the previous step's loss and gradient norm
            yield from self.carried.tensors()
        if not self.set_to_none:  # zeroed in place by the previous step's zero_grad
            yield from (p.grad for p in self.params if p.grad is not None)
        yield from self.inputs.tensors()


def _run_cpu(
    session: Callable[[], _Session], warmups: int = 1, repeats: int = 1
) -> tuple[int, _CpuTrace]:
    """Run ``warmups`` iterations and ``repeats`` measured ones under the profiler; return
    the resident bytes and the trace. A distributed rank measures three steady iterations
    and keeps the median peak. Its collectives free their buffers on this thread, where
    the profiler sees them (``distributed._collectives_release_on_caller``), so the three
    agree; the median keeps one stray step from deciding."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if torch.autograd.profiler._is_profiler_enabled:
        raise RuntimeError(
            "measure uses the PyTorch profiler on CPU and cannot run while another profiler "
            "is active; call it outside the profiler's context"
        )
    from .probe import quiet_stderr_fd

    with quiet_stderr_fd(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run = session()
        for _ in range(warmups):
            run.iterate()
        gc.collect(0)
        resident = _storage_bytes(run.resident_tensors(), torch.device("cpu"))
        resident += run.wrapper_bytes()
        for _ in range(repeats):
            with record_function(_MARKER):
                run.iterate()
        # Destroy the copies while the profiler still runs, so that the allocator forgets
        # every block it was told about (otherwise it keeps their sizes in a table).
        del run
        gc.collect(0)
    return resident, _cpu_trace(prof)


def _run_cuda(
    session: Callable[[], _Session], device: torch.device, snapshot: bool = False
) -> tuple[int, int, int, dict[str, Any] | None]:
    """Run both iterations; return resident, peak and max reserved bytes (and, with
    ``snapshot``, the allocator's snapshot recorded over the second)."""
    with torch.cuda.device(device):
        # the cached segments with nothing in use go back to the driver first (empty_cache
        # also drops the cuBLAS workspaces, which the warm-up then makes again)
        torch.cuda.empty_cache()
        _warm_up_cublas(device)
    torch.cuda.synchronize(device)
    with _cache_plugged(device):
        return _run_cuda_plugged(session, device, snapshot)


def _run_cuda_plugged(
    session: Callable[[], _Session], device: torch.device, snapshot: bool
) -> tuple[int, int, int, dict[str, Any] | None]:
    baseline = torch.cuda.memory_allocated(device)
    run = session()
    run.iterate()
    gc.collect(0)
    torch.cuda.synchronize(device)
    resident = torch.cuda.memory_allocated(device) - baseline
    torch.cuda.reset_peak_memory_stats(device)
    recorded = None
    with contextlib.ExitStack() as stack:
        snapshots = stack.enter_context(recorded_cuda_memory(device)) if snapshot else None
        run.iterate()
        torch.cuda.synchronize(device)
    if snapshots:
        recorded = snapshots[0]
    peak = torch.cuda.max_memory_allocated(device) - baseline
    reserved = torch.cuda.max_memory_reserved(device)
    del run
    gc.collect(0)
    return resident, peak, reserved, recorded


@contextlib.contextmanager
def _cache_plugged(device: torch.device) -> Iterator[None]:
    """Hold every free block the caching allocator keeps in a segment while the block runs,
    so that the copy and its step take new segments of their own: the allocator state the
    estimate replays, in which the model is alone.

    Called after ``empty_cache``, so what is left free lies in segments the caller's
    tensors share (the model measured, loaded before); a copy made in them would be
    charged differently, since the caching allocator does not split a block whose
    remainder would be 1 MiB or less (``kSmallSize``, c10/cuda/CUDACachingAllocator.cpp)
    and charges such a block in full to ``memory_allocated``. Each free block is taken by
    a request of its own size, the smallest first, which the allocator's best fit serves
    from a block of that size; the plugs are taken before the baseline and released
    after, so no figure counts them.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    one_mib = 1 << 20  # kSmallSize: requests up to it go to the small pool
    sizes = sorted(
        int(block["size"])
        for segment in torch.cuda.memory_snapshot()
        if segment["device"] == index
        for block in segment["blocks"]
        if block["state"] == "inactive"
        and (segment["segment_type"] == "small") == (block["size"] <= one_mib)
    )
    plugs = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
    try:
        yield
    finally:
        del plugs


def _warm_up_cublas(device: torch.device) -> None:
    """Make cuBLAS / cuBLASLt create their workspaces before the baseline is taken.

    PyTorch allocates each (handle, stream) workspace through the caching allocator on the
    first matmul and keeps it; without this, a process's first ``measure`` would count it
    (tens of MiB) and later ones would not. The estimate shows workspaces as a separate line.
    The handles are per thread (CublasHandlePool.cpp), and autograd runs a CUDA backward on
    a device thread of its own, so a backward through a matmul makes that thread's too.
    """
    dtypes = [torch.float32, torch.float16]
    if torch.cuda.is_bf16_supported():
        dtypes.append(torch.bfloat16)
    with torch.no_grad():
        for dtype in dtypes:
            a = torch.ones(16, 16, device=device, dtype=dtype)
            torch.mm(a, a)
            torch.addmm(a[0], a, a)  # the bias form takes the cuBLASLt path where it can
    with torch.enable_grad():
        for dtype in dtypes:
            w = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
            torch.addmm(w[0], w, w).sum().backward()
    torch.cuda.synchronize(device)


def _model_device(model: torch.nn.Module) -> torch.device:
    """The first parameter's device (CPU if there is none); only CPU and CUDA are measured."""
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:  # pragma: no cover - defensive
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"measure runs the real step on the model's device, which must be 'cpu' or "
            f"'cuda'; this model is on {str(device)!r}"
        )
    return device


def _has_trainable(model: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())


def _copy_model(model: torch.nn.Module, dtype: torch.dtype, mode: Mode) -> torch.nn.Module:
    try:
        clone = copy.deepcopy(model, _cast_copies(model, dtype))
    except Exception as exc:
        raise TypeError(
            f"measure runs the step on a copy of the model, and copy.deepcopy(model) failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    for p in clone.parameters():
        p.grad = None
    # floating parameters and buffers only, as the profile casts them: Module.to(dtype) would
    # cast complex ones too, and to a real dtype that drops their imaginary part (torchtitan's
    # RoPE keeps complex64 frequencies in a buffer, freqs_cis)
    clone._apply(functools.partial(cast_floating, dtype=dtype))
    clone.train(mode is Mode.TRAIN)
    return clone


def _cast_copies(model: torch.nn.Module, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """``copy.deepcopy``'s memo for ``model``: each plain parameter, then each plain buffer,
    in ``named_parameters`` / ``named_buffers`` order, copied straight into its dtype (the
    floating ones ``dtype``).

    The copies are made one after the other with nothing freed between them, as a model
    loaded in its dtype holds them (``from_pretrained(torch_dtype=...)``, ``model.to``): on
    CUDA each one takes a block of the caching allocator the way the estimate's residents
    do. A deepcopy in float32 cast afterwards would carve the cast tensors out of the freed
    float32 blocks instead, and the caching allocator does not split a block whose remainder
    would be under 1 MiB (``kSmallSize``, c10/cuda/CUDACachingAllocator.cpp): that left up
    to 13 MiB of unsplit blocks in the copy of GPT-2 small, an amount that depended on what
    the process had freed before. Tensor subclasses (quantized, DTensor) are left to
    ``deepcopy``.
    """
    memo: dict[int, torch.Tensor] = {}
    plain = (torch.Tensor, torch.nn.Parameter)
    for p in model.parameters():
        if type(p) in plain and not p.is_meta and id(p) not in memo:
            copied = torch.nn.Parameter(_cast_copy(p.detach(), dtype), p.requires_grad)
            copied.__dict__.update(p.__dict__)  # flags set on the parameter, as deepcopy does
            memo[id(p)] = copied
    for b in model.buffers():
        if type(b) in plain and not b.is_meta and id(b) not in memo:
            memo[id(b)] = _cast_copy(b.detach(), dtype)
    return memo


def _cast_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor with ``t``'s values, floating ones in ``dtype`` (one allocation)."""
    if t.is_floating_point():
        return t.to(dtype=dtype, copy=True)
    return t.clone()


def _copy_input(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A copy of one input tensor on ``device``, floating ones cast to ``dtype``."""
    source = t.detach()
    out = cast_floating(source, dtype).to(device)
    if out is source:
        out = source.clone()
    if t.requires_grad and out.is_floating_point():
        out.requires_grad_(True)
    return out


@contextlib.contextmanager
def _preserved_global_state(device: torch.device) -> Iterator[None]:
    """Restore the CPU (and, where CUDA is in use, every CUDA device's) RNG state."""
    cpu_state = torch.random.get_rng_state()
    cuda_states = None
    if device.type == "cuda" or (torch.cuda.is_available() and torch.cuda.is_initialized()):
        cuda_states = torch.cuda.get_rng_state_all()
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@contextlib.contextmanager
def _grad_mode(mode: Mode) -> Iterator[None]:
    """Outside any ``torch.no_grad()`` / ``torch.inference_mode()`` of the caller."""
    with torch.inference_mode(False):
        if mode is Mode.TRAIN:
            with torch.enable_grad():
                yield
        else:
            yield
