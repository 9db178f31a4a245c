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

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .._estimating.compiled import (
    CompileScope,
    check_compile_parallel,
    parse_activation_memory_budget,
    parse_compile,
)
from .._estimating.decoding import check_generation
from .._estimating.levers import parse_lora_dtype, resolve_lora
from .._estimating.offloading import resolve_offload
from .._estimating.options import (
    Mode,
    OptimizerName,
    ParamGroups,
    Precision,
    StepOutputs,
    Strategy,
    parse_option,
)
from .._estimating.quantized import check_quantized, check_weights_device
from .._estimating.recipe import Generation, Optimizer, Recipe, Step
from .._estimating.recipe.generation import (
    KV_BITS_DEFAULT,
    Q_GROUP_SIZE_DEFAULT,
    RESIDUAL_LENGTH_DEFAULT,
)
from .._estimating.recipe.recipe import default, given
from .._estimating.recipe.weights import WeightFormat, parse_weights
from .._estimating.sharding import (
    DEFAULT_GPUS_PER_NODE,
    Parallel,
    resolve_fsdp_units,
    resolve_parallel,
)
from .._estimating.stepping import IN_BACKWARD_ACCUMULATION
from .compiled import fsdp_blocks_refusal
from .float8 import checked_float8
from .generation import generation_limit, prompt_inputs
from .measure_ranks import (
    _expert_parallel_setup,
    _measure_pipeline,
    _measure_ranks,
    _tensor_parallel_setup,
)
from .measure_session import (
    _measure,
    _model_device,
)
from .measure_settings import measure_settings
from .measurement import Measurement
from .nf4_torchao import nf4_layers
from .quantized import (
    quantized_modules,
    require_bitsandbytes,
)
from .quantized_cache import asking_kv_cache
from .step import (
    ModelInputs,
)
from .torchao_weights import torchao_modules

__all__ = ["measure"]

# measure's own arguments that are not passed on when it calls itself with the KV cache asked
# for in the model's generation config (the cache's keywords, the recipe's, and its locals)
_KV_CACHE_CALL = (
    "model", "recipe", "cache", "kv_cache", "kv_bits", "residual_length", "q_group_size",
)  # fmt: skip


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
    float8_all_gather: bool = default(False),
    snapshot: bool = False,
    gpus: int = default(1),
    strategy: str | Strategy = default("ddp"),
    gpus_per_node: int = default(DEFAULT_GPUS_PER_NODE),
    fsdp_units: object = default(None),
    tp: int = default(1),
    tp_plan: object = default(None),
    pp: int = default(1),
    pp_schedule: str = default("gpipe"),
    microbatches: int | None = default(None),
    pp_split: object = default(None),
    ep: int = default(1),
    stages_per_rank: int | None = default(None),
    timeout_s: float = 600.0,
    new_tokens: int | None = default(None),
    kv_cache: str | None = default(None),
    kv_bits: int = default(KV_BITS_DEFAULT),
    residual_length: int = default(RESIDUAL_LENGTH_DEFAULT),
    q_group_size: int = default(Q_GROUP_SIZE_DEFAULT),
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
        the base's dtype; ``"bf16"`` etc.: that, then the adapters cast; on tensor-parallel
        ranks, after the plan sharded the copy: ``tensor_parallel.tensor_parallel_lora``),
        Hugging Face's ``activation_checkpointing_enable`` (non-reentrant) for its models'
        ``"auto"``,
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
        only. As ``ModelProfile.estimate`` takes it; with ``gpus=N`` the copy is converted
        in each rank before the strategy wraps it.
    float8_all_gather : bool
        True: torchao's ``enable_fsdp_float8_all_gather``, FSDP2 (``strategy="zero2"``,
        ``"zero3"``, ``"hsdp"``) all-gathering each float8 weight in float8
        (``Float8(True, all_gather=True)``); gloo moves the float8 bytes as ``uint8``
        views (``distributed._bytes_of_float8``). Estimated by running one rank's step
        on fake tensors (``float8_fsdp.py``).
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
    tp, tp_plan : int, dict
        Tensor parallelism on ``gpus = tp`` gloo ranks, training or inference: each rank
        shards a meta copy of the model by the model's own plan (a Hugging Face model's
        ``base_model_tp_plan``, applied by transformers) or ``tp_plan`` (module patterns ->
        ``torch.distributed.tensor.parallel`` styles, by ``parallelize_module``) on a 1-D
        CPU mesh, and measures its own step; ``rank_peak_bytes`` holds
        each rank's. The layout and the plan are checked before any rank starts
        (``tensor_parallel.resolve_plan``).
    ep : int
        Expert parallelism on ``gpus = ep`` gloo ranks that share the batch, training or
        inference: each rank shards a meta copy of a mixture-of-experts model by its
        ``base_model_ep_plan`` (transformers' ``apply_expert_parallelism``), takes the
        model's own values (its slice of the experts), and measures its own step, the
        tokens routed by the model's router as they fall (``expert_parallel.rank_setup``).
    pp, pp_schedule, microbatches, stages_per_rank : int, str, int, int
        Pipeline parallelism on ``gpus = pp`` gloo ranks (fp32 / bf16 training of a Hugging
        Face decoder, ``inputs={"input_ids": ..., "labels": ...}``): each rank holds one
        stage (``pipeline_parallel.stage_copy``), or ``stages_per_rank`` stages (default 2)
        with ``"interleaved-1f1b"`` (rank r: stages r, r + pp, ...), and steps them by
        ``torch.distributed.pipelining``'s ``ScheduleGPipe`` (``"gpipe"``),
        ``Schedule1F1B`` (``"1f1b"``) or ``ScheduleInterleaved1F1B``
        (``"interleaved-1f1b"``) over ``microbatches`` (default ``pp``) micro-batches
        of the inputs' batch, then the optimizers (``pp_split``: where stages begin, as
        ``estimate`` takes it); ``rank_peak_bytes`` holds each rank's
        peak (the least of five steps). With ``tp`` > 1 too (``gpus = pp x tp``), each
        stage is sharded by the model's own plan over ``tp`` ranks of a ``("pp", "tp")``
        mesh (``pipeline_tensor_parallel``). Checked as the estimate checks them, before
        any rank.
    new_tokens : int, optional
        With ``mode="generate"``: Hugging Face's ``model.generate(do_sample=False,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens)`` on the prompt ``inputs``
        (its prefill, then one decode step per new token with the model's own KV cache).
        The peak is that of the whole generation; resident are the weights and the prompt.
    kv_cache, kv_bits, residual_length, q_group_size : str, int, int, int
        ``kv_cache="quantized"`` (with ``mode="generate"``): transformers' ``QuantizedCache``
        (quanto backend) in place of the model's own cache, asked for in the generation
        config of the copy that generates (``cache_implementation="quantized"`` with
        ``cache_config={"nbits": kv_bits, "residual_length": ..., "q_group_size": ...}``;
        defaults 4, 128 and 64, transformers' own), as ``estimate`` takes them. The last
        three without ``kv_cache="quantized"`` are a ValueError.
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
        no ``loss_fn``; one process, or tensor-parallel ranks alone (``gpus=tp``).
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
    cache = Recipe.from_keywords(
        recipe, kv_cache=kv_cache, kv_bits=kv_bits, residual_length=residual_length,
        q_group_size=q_group_size,
    ).generation  # fmt: skip
    if cache.kv_cache is not None:
        # the KV cache asked for (by the recipe or the keywords, which must agree) as
        # generate reads it: the model's generation config (on the copy measure makes; the
        # model's own restored after)
        asked = {k: v for k, v in locals().items() if k not in _KV_CACHE_CALL}
        asked_mode = recipe.step.mode if recipe is not None else None
        if asked_mode is not Mode.GENERATE and str(given(mode)) != "generate":
            raise ValueError(
                "kv_cache='quantized' is the KV cache of generate(): give mode='generate' "
                "(and new_tokens=...) too"
            )
        plain = None if recipe is None else dataclasses.replace(
            recipe, generation=Generation(new_tokens=recipe.generation.new_tokens)
        )  # fmt: skip
        with asking_kv_cache(model, cache.cache_config()):
            return measure(model, recipe=plain, **asked)
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
            "float8": float8, "float8_all_gather": float8_all_gather,
            "gpus": gpus,
            "strategy": strategy, "gpus_per_node": gpus_per_node, "fsdp_units": fsdp_units,
            "tp": tp, "tp_plan": tp_plan,
            "pp": pp, "pp_schedule": pp_schedule, "microbatches": microbatches,
            "pp_split": pp_split, "ep": ep, "stages_per_rank": stages_per_rank,
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
    distributed = parallel.distributed and parse_option(Mode, mode, "mode") is Mode.TRAIN
    if scope is not None and distributed:
        _check_compiled_ranks(model, scope, parallel, precision, settings)
    stepping = _check_stepping(optimizer_in_backward, set_to_none, grad_accumulation)
    protocol = _check_protocol(outputs, loss_scaled, clip_grad_norm, optimizer_in_backward)
    carry = Step(carried_scalars=carried_scalars).carried_scalars  # checked as the Recipe does
    decay_split = parse_option(ParamGroups, param_groups, "param_groups") is ParamGroups.DECAY_SPLIT
    pipeline = ("microbatches", "pp_split", "stages_per_rank")
    if settings["pp"] != 1 or any(settings[k] is not None for k in pipeline):
        return _measure_pipeline(model, inputs, settings, timeout_s)
    tp_setup = _tensor_parallel_setup(model, settings, gpus, strategy, mode)
    if settings.get("ep", 1) not in (None, 1):
        tp_setup = _expert_parallel_setup(model, settings, gpus, strategy)
    if tp_setup is not None or distributed:
        # torchtune's chunked loss is measured on tensor-parallel ranks (tp alone) too
        tp_alone = tp_setup is not None and not tp_setup.expert_parallel and tp_setup.tp == gpus
        if (
            stepping != (False, True)
            or protocol != (False, False, None)
            or decay_split
            or carry
            or (settings["loss_chunks"] is not None and not tp_alone)
            or resolve_offload(settings["offload_activations"]) is not None
        ):
            raise ValueError(
                "optimizer_in_backward, set_to_none=False, outputs='freed', loss_scaled, "
                "carried_scalars, clip_grad_norm, param_groups='decay-split' and "
                "offload_activations are measured on one process (gpus=1) only for now, "
                "loss_chunks on one process or on tensor-parallel ranks (gpus=tp)"
            )
        return _measure_ranks(
            parallel, timeout_s, model, inputs, loss_fn, optimizer, precision, grad_accumulation,
            levers, tp_setup, parse_option(Mode, mode, "mode"), (scope, budget),
            settings["loss_chunks"],
            float8_setting,
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
    """``compile`` with the settings it is measured with (one process or FSDP2's data
    parallelism, no generation, no chunked loss, no offloading), a ValueError naming the
    conflict (the data-parallel layout: ``_check_compiled_ranks``)."""
    if scope is None:
        return
    conflicts = {
        "tp > 1": settings["tp"] not in (None, 1),
        "pp > 1": settings["pp"] not in (None, 1),
        "ep > 1": settings.get("ep", 1) not in (None, 1),
        "mode='generate'": str(given(settings["mode"])) == "generate",
        "loss_chunks": settings["loss_chunks"] is not None,
        "offload_activations": resolve_offload(settings["offload_activations"]) is not None,
    }
    asked = [name for name, on in conflicts.items() if on]
    if asked:
        raise ValueError(
            f"compile={scope.value!r} with {', '.join(asked)}: a compiled step is measured "
            "for one process's training step or inference pass, or per block on FSDP2's "
            "ranks (gpus > 1, strategy='zero2', 'zero3' or 'hsdp'); leave compile=False"
        )


def _check_compiled_ranks(
    model: torch.nn.Module,
    scope: CompileScope,
    parallel: Parallel,
    precision: object,
    settings: dict[str, Any],
) -> None:
    """``compile`` across data-parallel ranks, refused as the estimate refuses it
    (``compiled.check_compile_parallel``), and where the blocks cannot compile under
    FSDP2 (``fsdp_blocks_refusal``), before any rank starts."""
    check_compile_parallel(
        scope,
        parallel,
        precision=parse_option(Precision, precision, "precision"),
        levers={
            "checkpoint": settings["checkpoint"] not in (None, False, ()),
            "lora_rank": settings["lora_rank"] is not None,
            "trainable": settings["trainable"] is not None,
            "grad_accumulation": settings["grad_accumulation"] != 1,
        },
    )
    refusal = fsdp_blocks_refusal(model)
    if refusal:
        raise ValueError(
            f"compile={scope.value!r} with strategy={parallel.strategy.value!r}: {refusal}; "
            "leave compile=False for this model, or run it on one process (gpus=1)"
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
