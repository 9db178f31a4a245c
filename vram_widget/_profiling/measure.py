"""Measure the memory of one real training step (or inference pass), to check the estimate.

``measure`` runs the step twice on a copy of the model, by the protocol in ``step.py``, and
reports the peak of the second iteration (steady state: the optimizer state already exists),
as docs/how-it-works.md defines it: the maximum of live tensor bytes during the iteration,
including the parameters, buffers, optimizer state and input batch resident at its start.

How it is measured:

* CUDA: ``torch.cuda.max_memory_allocated()`` after ``torch.cuda.reset_peak_memory_stats()``
  at the start of iteration 2, less the bytes allocated before ``measure`` made its copies.
  These are the caching allocator's bytes (each block rounded up to 512 bytes). cuBLAS
  workspaces are created (by a small warm-up matmul) before that baseline, so they are not
  counted: the estimate shows them as a separate line (``extras``).
* CPU: the CPU allocator's own allocation and free events, as
  ``torch.profiler.profile(profile_memory=True)`` records them (the allocator reports every
  block it hands out and takes back, with its exact byte count, and the running total of what
  it has handed out). The profiler runs from before the copies are made until they are
  destroyed, so that every block ``measure`` creates is known to it, and iteration 2 is marked
  with ``torch.profiler.record_function``. The events of iteration 2, in execution order, are
  summed; the peak is the resident bytes plus the largest prefix sum.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from .._estimating.compiled import CompileScope, parse_activation_memory_budget, parse_compile
from .._estimating.levers import NO_LEVERS, Levers, parse_lora_dtype, resolve_lora
from .._estimating.offloading import Offload, resolve_offload
from .._estimating.options import (
    Mode,
    OptimizerChoice,
    OptimizerImplementation,
    OptimizerName,
    ParamGroups,
    Precision,
    StepOutputs,
    Strategy,
    parse_optimizer_choice,
    parse_option,
)
from .._estimating.quantized import check_quantized, check_weights_device
from .._estimating.recipe import Optimizer, Recipe, Step
from .._estimating.recipe.float8 import Float8
from .._estimating.recipe.recipe import default, given
from .._estimating.recipe.weights import WeightFormat, Weights, parse_weights
from .._estimating.sharding import (
    DEFAULT_GPUS_PER_NODE,
    Parallel,
    resolve_fsdp_units,
    resolve_parallel,
)
from .._estimating.stepping import IN_BACKWARD_ACCUMULATION
from .fake import recorded_cuda_memory
from .measure_settings import measure_settings

if TYPE_CHECKING:
    from .distributed import RankSetup
from .._estimating.decoding import check_generation
from .carried import CarriedScalars
from .chunked_loss import checked_loss_chunks, chunked_step
from .compiled import FORWARD_MARKER, WatchedForward, compiled_forward, compiled_run
from .float8 import checked_float8, converted
from .generation import generation_limit, prompt_inputs
from .nf4_torchao import nf4_layers, real_nf4
from .offloading import offloaded_forward, real_offloading
from .optimizers import state_tensors
from .param_groups import decay_parameter_names, trainer_groups
from .quantized import (
    module_state_tensors,
    qlora_wrapped,
    quantized_modules,
    real_quantized,
    require_bitsandbytes,
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
from .torchao_weights import real_torchao, torchao_inner, torchao_modules

__all__ = ["Measurement", "measure"]

# The name of the record_function range around the measured iteration (CPU only).
_MARKER = "vram_widget.measure:iteration"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """The measured memory of one steady-state training step or inference pass.

    Attributes
    ----------
    peak_bytes
        The peak of live tensor bytes during the measured (second) iteration, including what
        was resident at its start.
    resident_bytes
        What was live at the start of the measured iteration. CPU: the unique storages of the
        model copy's parameters and buffers, the optimizer state and the input batch. CUDA:
        ``torch.cuda.memory_allocated()`` then, less its value before ``measure`` made copies
        (so allocator rounding and anything else ``measure`` left alive is included).
    device
        ``"cpu"`` or ``"cuda"``.
    precision, optimizer, mode
        The settings measured (``optimizer`` is None for inference, or when the model has no
        trainable parameter).
    batch_size
        Dim 0 of the input batch.
    max_reserved_bytes
        CUDA only (None on CPU): ``torch.cuda.max_memory_reserved()`` during the measured
        iteration. This is process-wide (it includes what the caching allocator held
        before ``measure``), since cached blocks cannot be attributed to one caller.
    """

    peak_bytes: int
    resident_bytes: int
    device: str
    precision: Precision
    optimizer: OptimizerChoice | None
    mode: Mode
    batch_size: int
    max_reserved_bytes: int | None = None
    # with gpus > 1: the ranks, their strategy, and each rank's peak (this is the highest)
    gpus: int = 1
    strategy: Strategy | None = None
    rank_peak_bytes: tuple[int, ...] = ()
    # mode="generate": the new tokens generated after the prompt
    new_tokens: int | None = None
    # with snapshot=True on CUDA: torch.cuda.memory._snapshot() recorded over the measured
    # iteration (compare with MemoryEstimate.compare_snapshot)
    snapshot: dict[str, Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    # the step as torch.compile runs it (None: eager), and the partitioner's budget
    compile: CompileScope | None = None
    activation_memory_budget: float | None = None
    # mode="train", one process, CPU: the bytes alive when the model's (first) forward of the
    # measured iteration returns less those alive when it was called, less its outputs'
    # storages: what the forward leaves for the backward (autograd's saved tensors; under
    # torch.compile the forward graph's saved values)
    saved_bytes: int | None = None

    @property
    def transient_bytes(self) -> int:
        """``peak_bytes - resident_bytes``: what the step itself adds at its peak."""
        return self.peak_bytes - self.resident_bytes


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

    def peak_above_start(self) -> int:
        """The largest prefix sum of the iteration's events (0 if it never rises); where
        several iterations were measured, the median of theirs (``_run_cpu``)."""
        peaks = sorted(
            _max_prefix_sum(e.nbytes for e in it) for it in self.repeats or (self.during,)
        )
        return peaks[len(peaks) // 2]


def measure(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], Any] | None = None,
    optimizer: str | OptimizerName | Callable[..., Any] | None = default("adam"),
    precision: str | Precision = default("fp32"),
    mode: str | Mode = default("train"),
    *,
    checkpoint: object = default(None),
    checkpoint_policy: object = default(None),
    trainable: object = default(None),
    grad_accumulation: int = default(1),
    lora_rank: int | None = default(None),
    lora_targets: object = default("auto"),
    lora_dtype: str | None = default(None),
    weights: object = default(None),
    float8: object = default(None),
    snapshot: bool = False,
    gpus: int = default(1),
    strategy: str | Strategy = default("ddp"),
    gpus_per_node: int = default(DEFAULT_GPUS_PER_NODE),
    fsdp_units: object = default(None),
    timeout_s: float = 600.0,
    new_tokens: int | None = default(None),
    optimizer_in_backward: bool = default(False),
    set_to_none: bool = default(True),
    outputs: str | StepOutputs = default("kept"),
    loss_scaled: bool = default(False),
    clip_grad_norm: float | None = default(None),
    param_groups: str | ParamGroups = default("one"),
    carried_scalars: bool = default(False),
    loss_chunks: int | None = default(None),
    offload_activations: object = default(None),
    recipe: Recipe | None = None,
    compile: object = False,
    activation_memory_budget: float | None = None,
) -> Measurement:
    """Measure the peak memory of one real training step (or inference pass) of ``model``.

    The step runs twice, by the same protocol the estimate follows (forward, loss,
    ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``), and
    the second iteration is measured, when the optimizer state already exists. It runs on a
    ``copy.deepcopy`` of the model and a copy of the inputs, on the model's device: the model
    passed in is never changed (parameters, gradients, training flag, device, dtype), and the
    global random number generator state is restored afterwards.

    Parameters
    ----------
    model : torch.nn.Module
        The model. Its device (that of its first parameter; CPU if it has none) is where the
        step runs: ``"cpu"`` or ``"cuda"``.
    inputs : Tensor, tuple of Tensors, or dict of keyword Tensors
        One batch; dim 0 is the batch. Tensors elsewhere than the model's device are moved
        there; floating tensors are cast to the precision's storage dtype.
    loss_fn : callable, optional
        ``loss_fn(output) -> scalar tensor``. By default ``output.loss`` if the output has one,
        else the mean of the first floating tensor in the output, in float32.
    optimizer : str, callable or None
        ``"sgd"``, ``"sgd-momentum"``, ``"adam"``, ``"adamw"``, ``"adagrad"``, ``"rmsprop"``
        (with a ``-fused`` / ``-foreach`` / ``-forloop`` suffix for SGD and Adam / AdamW),
        another library's ``"adamw8bit"``, ``"paged-adamw8bit"``, ``"adamw8bit-torchao"``,
        ``"adamw4bit-torchao"``, ``"adafactor"``, a callable ``params ->
        torch.optim.Optimizer`` (called on the copy's parameters), or None. Skipped
        (gradients are computed and dropped) when the model has no trainable parameter.
    precision : str
        ``"fp32"``, ``"bf16"``, ``"fp16"`` (the model copy and floating inputs stored in that
        dtype), ``"amp-bf16"`` or ``"amp-fp16"`` (float32 weights, forward under
        ``torch.autocast``).
    mode : str
        ``"train"`` (one training step) or ``"inference"`` (one forward under
        ``torch.no_grad()``, the model copy in eval mode).
    checkpoint, trainable, grad_accumulation, lora_rank, lora_targets, lora_dtype
        The memory levers, as ``ModelProfile.estimate`` takes them, applied to the model copy
        the way the libraries apply them: PEFT's ``get_peft_model`` for LoRA (the adapters
        upcast to fp32 by default; ``lora_dtype="base"``: ``autocast_adapter_dtype=False``,
        the base's dtype; ``"bf16"`` etc.: that, then the adapters cast), Hugging Face's
        ``activation_checkpointing_enable`` (non-reentrant) for its models' ``"auto"``,
        torch's ``checkpoint_wrapper`` (``CheckpointImpl.NO_REENTRANT``) around each other
        module named, ``requires_grad_(False)`` on the parameters ``trainable`` leaves out,
        and ``grad_accumulation`` forward and backward passes before the optimizer step.
    weights : None, str ("nf4", "int8-torchao", "nf4-torchao", ...) or Weights
        The copy's Linear layers quantized by bitsandbytes as ``from_pretrained(...,
        quantization_config=BitsAndBytesConfig(...))`` quantizes them (``quantized.py``:
        transformers' ``replace_with_bnb_linear``, each weight loaded into a ``Params4bit`` /
        ``Int8Params`` moved to the CPU); with ``lora_rank``, QLoRA (PEFT's
        ``prepare_model_for_kbit_training``, then ``get_peft_model``). The quant state
        (scales, codes) counts as resident. ``"int8-torchao"`` / ``"int4-torchao"``:
        torchao's own ``quantize_`` on the copy (``torchao_weights.py``), its tensor
        subclasses' inner tensors resident. ``"nf4-torchao"``: torchtune's ``LoRALinear(...,
        quantize_base=True)`` on the LoRA targets and ``FrozenNF4Linear`` on the other
        Linear layers of the copy, each weight torchao's ``to_nf4`` of the copy's
        (``nf4_torchao.py``). As ``ModelProfile.estimate`` takes it.
    float8 : None, True, "tensorwise", "rowwise" or Float8
        The copy's Linear layers swapped for torchao's ``Float8Linear`` by
        ``convert_to_float8_training`` (``float8.py``), with ``emulate=True`` on a CPU (its
        float8 matmul in float32 ops) and torchao's ``torch._scaled_mm`` on CUDA. Training
        only. As ``ModelProfile.estimate`` takes it.
    checkpoint_policy : None, "full", "op", int or callable
        How each checkpointed block is checkpointed, as ``ModelProfile.estimate`` takes it:
        ``"op"`` is torchtitan's op-level policy around each block
        (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, non-reentrant),
        k every k-th block as torchtitan picks them, a callable the user's policy
        (``_profiling/checkpoint_policy.py``).
    snapshot : bool
        CUDA only: record the caching allocator's history over the measured iteration and
        return its ``torch.cuda.memory._snapshot()`` as ``Measurement.snapshot`` (for
        ``MemoryEstimate.compare_snapshot`` and PyTorch's memory viewer).
    gpus, strategy : int, str
        Training on ``gpus`` data-parallel ranks, as ``ModelProfile.estimate`` takes them:
        ``gpus`` processes are forked, joined in a gloo process group on 127.0.0.1 (a free
        port), and each wraps its copy as the strategy's library does
        (``DistributedDataParallel`` with its defaults for ``"ddp"``) and measures its own
        step at the batch given (per rank), as above. The result is the rank with the
        highest peak, with every rank's in ``rank_peak_bytes``; each rank's resident bytes
        are what its CPU allocator held before the measured step (the strategy's buffers
        included). CPU models only for now (gloo); inference is not wrapped. ``"zero2"`` /
        ``"zero3"`` / ``"hsdp"`` are FSDP2's ``fully_shard`` on each unit and the root
        (``"hsdp"``: a 2-D mesh of nodes x ``gpus_per_node``, sharded within a node).
    gpus_per_node, fsdp_units : int, str or list of str
        As ``ModelProfile.estimate`` takes them (FSDP2's mesh and units).
    new_tokens : int, optional
        With ``mode="generate"``: Hugging Face's ``model.generate(do_sample=False,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens)`` on the prompt ``inputs``
        (its prefill, then one decode step per new token with the model's own KV cache).
        The peak is that of the whole generation; resident are the weights and the prompt.
    optimizer_in_backward : bool
        Step each parameter in its post-accumulate-grad hook during the backward, with an
        optimizer of its own, and free its gradient there (torchtune's ``optimizer_in_bwd``:
        ``stepping.OptimizerInBackward``), instead of one ``optimizer.step()`` after it.
        Not with ``grad_accumulation > 1`` nor ``gpus > 1``.
    set_to_none : bool
        ``optimizer.zero_grad(set_to_none=...)``: False zeroes the gradients in place, so
        they stay allocated between steps and are resident when the measured step starts.
    outputs : str
        ``"kept"``: the model's output held to the end of the step; ``"freed"``: dropped
        once the loss is computed, before the backward (Hugging Face's ``Trainer``,
        torchtune's recipes).
    loss_scaled : bool
        The backward on ``loss / grad_accumulation`` (a new scalar), the loss kept
        (accelerate's ``Accelerator.backward``, which Hugging Face's ``Trainer`` calls).
    clip_grad_norm : float, optional
        ``torch.nn.utils.clip_grad_norm_`` of the gradients to this max norm between the
        backward and the optimizer step (torch's default implementation for the device),
        its total norm held to the end of the step.
    carried_scalars : bool
        Each micro-batch's loss held until the next micro-batch's backward has run, and the
        gradient norm until the next step's clipping (Hugging Face ``Trainer``'s loop): the
        measured step starts with the first step's, counted as resident.
    param_groups : str
        ``"one"``: the optimizer over one group of every trainable parameter;
        ``"decay-split"``: over Hugging Face ``Trainer.create_optimizer``'s two groups
        (decayed parameters, then norms and biases).
    loss_chunks : int, optional
        A Hugging Face causal LM's output projection and loss on this many chunks of the
        sequence: its body's hidden states chunked, the output projection on each, the
        labels shifted as torchtune's recipes shift them and torchtune's own
        ``CEWithChunkedOutputLoss`` (``chunked_loss.py``). Needs labels in ``inputs`` and
        no ``loss_fn``; one process only.
    offload_activations : None, bool or str
        The forward run inside the real offloading hooks: True or ``"torchtune"``,
        torchtune's own ``OffloadActivations()`` (one for the loop, its defaults) with its
        ``NoOpManager`` on the output projection (needs CUDA); ``"save_on_cpu"``,
        ``torch.autograd.graph.save_on_cpu()``. On a CPU model ``save_on_cpu`` is the plain
        step (a CPU tensor's ``.cpu()`` is itself). Training, one process only.
    timeout_s : float
        With ``gpus > 1``: how long the ranks may take; past it, or when one fails (its own
        error is raised, as a ``DistributedError``), every rank is killed by its PID.
    compile : bool or str
        The step as ``torch.compile`` (default Inductor backend) runs it, on the copy:
        True or ``"model"``, ``torch.compile(copy)``; ``"blocks"``, each repeated block
        compiled on its own with ``fullgraph=True`` (torchtitan's and torchtune's per-block
        compile). Compiled in the warm-up iteration, dynamo's caches reset before and after.
        A model dynamo or Inductor cannot compile is a ValueError giving their reason.
        Training and inference, one process, without ``loss_chunks`` or offloading.
    activation_memory_budget : float, optional
        With ``compile``: ``torch._functorch.config.activation_memory_budget`` (in [0, 1])
        for the run, the fraction of the default partition's saved activations the
        partitioner may keep (``_estimating/compiled.py``).
    recipe : Recipe, optional
        The setup as one value (``vram_widget.Recipe``): its optimizer (and
        implementation), precision, mode, levers, data parallelism and new tokens drive the
        step; a keyword given explicitly must agree with it (a ValueError names both).
        Settings a measured step cannot follow are refused by name
        (``measure_settings.measure_settings``); the target GPU's are not read.

    Returns
    -------
    Measurement
        ``peak_bytes`` (resident bytes included), ``resident_bytes`` and the settings.

    Raises
    ------
    ValueError
        An unknown precision, optimizer or mode (the message lists the valid values), a model
        on a device other than CPU or CUDA, or inputs without a batch dimension.
    TypeError
        ``copy.deepcopy(model)`` failed, or the loss is not a scalar tensor.

    Notes
    -----
    On CPU the peak comes from the CPU allocator's events, which the PyTorch profiler records;
    they include blocks a kernel allocates and frees internally. A profiler already running
    in the same process cannot be nested, so ``measure`` refuses to run inside one. On CUDA
    the caching allocator's peak statistics are reset (``reset_peak_memory_stats``), and a
    small matmul first makes cuBLAS create its workspaces, which are then not counted. Automatic
    garbage collection is paused while ``measure`` runs, so that the measured iteration is
    deterministic.

    Examples
    --------
    >>> import torch
    >>> from vram_widget._profiling.measure import measure
    >>> model = torch.nn.Linear(10, 20, bias=False)
    >>> m = measure(model, torch.randn(4, 10), optimizer="sgd")
    >>> m.device, m.batch_size
    ('cpu', 4)
    >>> m.resident_bytes  # weight 20 x 10 x 4 B + input 4 x 10 x 4 B
    960
    >>> m.peak_bytes >= m.resident_bytes + 800  # the weight's gradient is live at the peak
    True
    >>> model.weight.grad is None  # the model passed in is untouched
    True
    """
    scope = parse_compile(compile)
    budget = parse_activation_memory_budget(activation_memory_budget, scope)
    batch = ModelInputs.from_user(inputs).batch_size() if recipe is not None else 1
    settings = measure_settings(
        recipe, batch, {
            "optimizer": optimizer, "precision": precision, "mode": mode,
            "checkpoint": checkpoint, "checkpoint_policy": checkpoint_policy,
            "trainable": trainable,
            "grad_accumulation": grad_accumulation, "lora_rank": lora_rank,
            "lora_targets": lora_targets, "lora_dtype": lora_dtype, "weights": weights,
            "float8": float8,
            "gpus": gpus,
            "strategy": strategy, "gpus_per_node": gpus_per_node, "fsdp_units": fsdp_units,
            "new_tokens": new_tokens, "optimizer_in_backward": optimizer_in_backward,
            "set_to_none": set_to_none, "outputs": outputs, "loss_scaled": loss_scaled,
            "clip_grad_norm": clip_grad_norm, "param_groups": param_groups,
            "carried_scalars": carried_scalars, "loss_chunks": loss_chunks,
            "offload_activations": offload_activations,
        },
    )  # fmt: skip
    optimizer_in_backward, set_to_none = settings["optimizer_in_backward"], settings["set_to_none"]
    outputs, loss_scaled, clip_grad_norm = (
        settings["outputs"], settings["loss_scaled"], settings["clip_grad_norm"]
    )  # fmt: skip
    param_groups, carried_scalars = settings["param_groups"], settings["carried_scalars"]
    optimizer, precision, mode = settings["optimizer"], settings["precision"], settings["mode"]
    grad_accumulation, gpus, strategy = (
        settings["grad_accumulation"], settings["gpus"], settings["strategy"]
    )  # fmt: skip
    gpus_per_node, fsdp_units = settings["gpus_per_node"], settings["fsdp_units"]
    new_tokens = settings["new_tokens"]
    _check_compiled(scope, settings)
    quantized = parse_weights(settings["weights"])
    if quantized.quantized:  # refused before the copy is made, as the estimate refuses
        run_mode = parse_option(Mode, mode, "mode")
        check_quantized(quantized, run_mode, settings["lora_rank"], gpus, estimating=False)
        if quantized.format is WeightFormat.NF4_TORCHAO:  # torchtune's QLoRA (nf4_torchao.py)
            rank, targets = resolve_lora(settings["lora_rank"], settings["lora_targets"])
            nf4_layers(model, quantized, rank, targets, parse_lora_dtype(settings["lora_dtype"]))
        elif quantized.torchao:  # torchao's quantize_ (torchao_weights.py)
            check_weights_device(quantized, _model_device(model).type)
            torchao_modules(model, quantized)
        else:
            require_bitsandbytes()
            quantized_modules(model, quantized)
    float8_setting = checked_float8(model, settings, quantized, scope)
    levers: dict[str, Any] = {
        "checkpoint": settings["checkpoint"],
        "checkpoint_policy": settings["checkpoint_policy"],
        "trainable": settings["trainable"],
        "lora_rank": settings["lora_rank"],
        "lora_targets": settings["lora_targets"],
        "lora_dtype": parse_lora_dtype(settings["lora_dtype"]),
    }
    if levers["lora_dtype"] is not None and levers["lora_rank"] is None:
        raise ValueError(
            f"lora_dtype={settings['lora_dtype']!r} is the LoRA adapters' dtype, but no "
            "adapters are asked for: give lora_rank=... too, or leave lora_dtype at None"
        )
    if parse_option(Mode, mode, "mode") is Mode.GENERATE or new_tokens is not None:
        _check_generate(model, inputs, mode, new_tokens, gpus)
        inputs = prompt_inputs(inputs)
    parallel = resolve_parallel(gpus, strategy, gpus_per_node=gpus_per_node, modelled=False)
    if fsdp_units is not None:
        names, types = zip(*((n, type(m).__name__) for n, m in model.named_modules()), strict=True)
        resolve_fsdp_units(names, types, fsdp_units)  # a clear error before any rank starts
        units = (fsdp_units,) if isinstance(fsdp_units, str) else tuple(fsdp_units)  # type: ignore[arg-type]
        parallel = dataclasses.replace(parallel, fsdp_units=units)
    stepping = _check_stepping(optimizer_in_backward, set_to_none, grad_accumulation)
    protocol = _check_protocol(outputs, loss_scaled, clip_grad_norm, optimizer_in_backward)
    carry = Step(carried_scalars=carried_scalars).carried_scalars  # checked as the Recipe does
    decay_split = parse_option(ParamGroups, param_groups, "param_groups") is ParamGroups.DECAY_SPLIT
    if parallel.distributed and parse_option(Mode, mode, "mode") is Mode.TRAIN:
        if (
            stepping != (False, True)
            or protocol != (False, False, None)
            or decay_split
            or carry
            or settings["loss_chunks"] is not None
            or resolve_offload(settings["offload_activations"]) is not None
        ):
            raise ValueError(
                "optimizer_in_backward, set_to_none=False, outputs='freed', loss_scaled, "
                "carried_scalars, clip_grad_norm, param_groups='decay-split' and "
                "loss_chunks and offload_activations are measured "
                "on one process "
                "(gpus=1) only for now"
            )
        return _measure_ranks(
            parallel, timeout_s, model, inputs, loss_fn, optimizer, precision, grad_accumulation,
            levers,
        )  # fmt: skip
    return _measure(
        model,
        inputs,
        loss_fn,
        optimizer,
        precision,
        mode,
        grad_accumulation,
        snapshot=snapshot,
        new_tokens=new_tokens,
        stepping=stepping,
        protocol=protocol,
        decay_split=decay_split,
        carried_scalars=carry,
        loss_chunks=settings["loss_chunks"],
        offload_activations=settings["offload_activations"],
        compiled=(scope, budget),
        weights=quantized,
        float8=float8_setting,
        **levers,
    )[0]


def _check_compiled(scope: CompileScope | None, settings: dict[str, Any]) -> None:
    """``compile`` with the settings it is measured with (one process, no generation, no
    chunked loss, no offloading), a ValueError naming the conflict."""
    if scope is None:
        return
    conflicts = {
        "gpus > 1": settings["gpus"] != 1,
        "mode='generate'": str(given(settings["mode"])) == "generate",
        "loss_chunks": settings["loss_chunks"] is not None,
        "offload_activations": resolve_offload(settings["offload_activations"]) is not None,
    }
    asked = [name for name, on in conflicts.items() if on]
    if asked:
        raise ValueError(
            f"compile={scope.value!r} with {', '.join(asked)}: a compiled step is measured "
            "for one process's training step or inference pass only; leave compile=False"
        )


def _check_protocol(
    outputs: object, loss_scaled: object, clip_grad_norm: object, in_backward: object
) -> tuple[bool, bool, float | None]:
    """``outputs``, ``loss_scaled`` and ``clip_grad_norm`` checked as the Recipe checks
    them: (outputs freed, loss scaled, max norm or None)."""
    step = Step(outputs=outputs, loss_scaled=loss_scaled)  # type: ignore[arg-type]
    freed = step.outputs is StepOutputs.FREED
    checked = Optimizer(
        name=None,
        in_backward=bool(in_backward),
        clip_grad_norm=clip_grad_norm,  # type: ignore[arg-type]
    )
    return freed, step.loss_scaled, checked.clip_grad_norm


def _check_stepping(
    in_backward: object, set_to_none: object, grad_accumulation: int
) -> tuple[bool, bool]:
    """``optimizer_in_backward`` and ``set_to_none`` checked (booleans, compatible)."""
    for name, value in (("optimizer_in_backward", in_backward), ("set_to_none", set_to_none)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if in_backward and not set_to_none:
        raise ValueError(
            "set_to_none=False cannot go with optimizer_in_backward=True: stepping in the "
            "backward frees each gradient right after its parameter's step"
        )
    if in_backward and grad_accumulation != 1:
        raise ValueError(IN_BACKWARD_ACCUMULATION)
    return bool(in_backward), bool(set_to_none)


def _measure_ranks(
    parallel: Parallel,
    timeout_s: float,
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], Any] | None,
    optimizer: Any,
    precision: Any,
    grad_accumulation: int,
    levers: dict[str, Any],
) -> Measurement:
    """``measure`` on ``parallel.gpus`` gloo ranks (``distributed.run_ranks``)."""
    from .distributed import SETUPS, run_ranks

    if _model_device(model).type != "cpu":
        raise ValueError(
            f"measure(gpus={parallel.gpus}) runs its ranks on the CPU with gloo; this model "
            "is on CUDA, whose ranks (NCCL, one GPU each) are not supported yet"
        )
    check_model(model)
    # the settings' own errors here, before any rank starts
    parse_optimizer_choice(optimizer)
    parse_option(Precision, precision, "precision")
    setup = SETUPS.get(parallel.strategy)
    if setup is None:
        raise ValueError(
            f"measure cannot set up strategy {parallel.strategy.value!r} yet; it runs "
            + ", ".join(repr(s.value) for s in SETUPS)
        )

    def rank_step(_rank: int, _world: int) -> Measurement:
        return _measure(
            model, inputs, loss_fn, optimizer, precision, Mode.TRAIN, grad_accumulation,
            setup=setup, parallel=parallel, **levers,
        )[0]  # fmt: skip

    ranks = run_ranks(rank_step, parallel.gpus, timeout_s)
    worst = max(ranks, key=lambda m: m.peak_bytes)
    return dataclasses.replace(
        worst,
        gpus=parallel.gpus,
        strategy=parallel.strategy,
        rank_peak_bytes=tuple(m.peak_bytes for m in ranks),
    )


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
            resident, trace = _run_cpu(
                session, warmups=1 if setup is None else 2, repeats=1 if setup is None else 3
            )
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
        elif levers.lora_rank is not None and not torchtune_qlora:  # PEFT wraps the copy
            self.model = lora_wrapped(self.model, levers.lora_rank, levers.lora_targets, lora_dtype)
            names = tuple(PEFT_PREFIX + n for n in levers.checkpoint)
            levers = dataclasses.replace(levers, checkpoint=names)
        if compile_scope is not None:  # checkpointing inside compiled regions (compiled.py)
            levers = dataclasses.replace(levers, compile=compile_scope.value)
        apply_levers(self.model, levers)  # the copy, as the libraries apply them, then compiled
        if setup is not None:  # a data-parallel rank: DistributedDataParallel(copy), ...
            self.model = setup.wrap_model(
                self.model, parallel or Parallel(2, Strategy.DDP), precision
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
        self.forward: Callable[..., Any] = self.model
        if compile_scope is not None:  # the copy compiled (compiled.py)
            self.forward = compiled_forward(self.model, compile_scope)
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
            yield from torchao_inner(p) or [p]
        yield from self.model.buffers()
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
    and keeps the median peak: gloo's worker threads drop some collective buffers (a flat
    all-gather output, a reduce-scatter input) where the profiler does not see it, so one
    iteration in a few reads a buffer more, or a free of the previous one, at random."""
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


def _check_generate(
    model: Any, inputs: Any, mode: object, new_tokens: object, gpus: object
) -> None:
    """``mode="generate"`` and ``new_tokens`` checked: a ValueError naming the problem."""
    if parse_option(Mode, mode, "mode") is not Mode.GENERATE:
        raise ValueError(f"new_tokens is for mode='generate'; got mode={mode!r}")
    if gpus != 1:
        raise ValueError("mode='generate' is measured on one device (gpus=1)")
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
    if isinstance(ids, (tuple, list)) and ids:
        ids = ids[0]
    prompt = int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
    generates, limit, _cache = generation_limit(model)  # measure runs any cache
    check_generation(type(model).__name__, generates, limit, prompt, new_tokens)


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
