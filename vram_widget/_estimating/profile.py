"""ModelProfile: the cached per-layer profile of one model, and the door to estimates.

No torch here. A precision (or an optimizer) seen for the first time asks its source, the
profiler, for one more fake run; every later estimate is numpy arithmetic over the cache.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from .accelerator import CudaContext, cuda_context, given_cuda_context
from .chunked_loss import CHUNKING_UNKNOWN, chunked_loss_levers
from .compiled import compile_levers, decided_at
from .decoding import (
    DECODE_STEPS_ACROSS_WINDOW,
    PROMPT_BEFORE_WINDOW,
    STATIC_CACHE_TOKENS,
    at_new_tokens,
    check_generation,
    crosses_window,
)
from .estimator import DEFAULT_COMPUTE_CAPABILITY, MemoryEstimate, estimate
from .float8 import check_float8
from .gpus import Gpu, resolve_gpu
from .levers import NO_LEVERS, Levers, parse_lora_dtype, repeated_blocks, resolve_levers
from .loading import LOAD_DTYPES, LoadEstimate, LoadLayout, load_estimate
from .offloading import offload_levers
from .options import (
    CATEGORY_CODE,
    PHASE_CODE,
    Category,
    Device,
    FitBasis,
    Mode,
    OptimizerChoice,
    OptimizerImplementation,
    OptimizerName,
    Phase,
    PipelineSchedule,
    Precision,
    Strategy,
    default_implementation,
    parse_optimizer_choice,
    parse_option,
)
from .quantized import check_quantized, check_weights_device, int8_outlier_note
from .recipe import Accelerator, LeverSettings, Recipe
from .recipe.float8 import Float8
from .recipe.ignored import warn_ignored
from .recipe.parallel import (
    check_pipeline_parallel,
    check_pipeline_parallel_settings,
    check_tensor_parallel,
    check_tensor_parallel_settings,
    pipeline_microbatches,
)
from .recipe.recipe import default
from .recipe.weights import Weights
from .sharding import (
    DEFAULT_GPUS_PER_NODE,
    ITEMSIZE,
    SINGLE_DEVICE,
    FsdpParam,
    Parallel,
    StepEdits,
    TrainableParam,
    check_rank,
    fsdp_step_edits,
    resolve_fsdp_units,
    resolve_parallel,
)
from .stepping import protocol_levers, stepping_levers
from .table import ModuleRows, OptimizerTrace, Poly, Timeline
from .tradeoff import Frontier, batch_seq_frontier, length_grid

# The frontier's longest length where the model has no learned position table: 128k tokens
DEFAULT_MAX_SEQ_LEN = 2**17


class ProfilingError(RuntimeError):
    """The model could not be run on the example inputs (the message says where and why)."""


class ProfileSource(Protocol):
    """What the profile asks its profiler for, once per key."""

    def timeline(
        self, precision: Precision, mode: Mode, seq_len: int | None = None, levers: Levers = ...
    ) -> Timeline: ...

    def timeline_across_lengths(
        self, precision: Precision, mode: Mode, base: Timeline, levers: Levers = ...
    ) -> Timeline | None: ...

    def optimizer_trace(
        self,
        precision: Precision,
        optimizer: OptimizerChoice,
        levers: Levers = ...,
        only: tuple[str, ...] | None = ...,
        shard: tuple[int, int] | None = ...,
        implementation: OptimizerImplementation = ...,
    ) -> OptimizerTrace: ...

    def lora_profile(
        self, rank: int, targets: tuple[str, ...] | None, dtype: str | None = None
    ) -> ModelProfile: ...

    def quantized_profile(
        self,
        weights: Weights,
        rank: int | None = None,
        targets: tuple[str, ...] | None = None,
        dtype: str | None = None,
    ) -> ModelProfile: ...

    def float8_profile(self, float8: Float8) -> ModelProfile: ...
    def tensor_parallel_estimate(
        self, tp: int, tp_plan: object, recipe: Recipe
    ) -> MemoryEstimate: ...

    def tensor_parallel_cached(self, tp: int, tp_plan: object, recipe: Recipe) -> bool: ...

    def tensor_parallel_refusal(self, tp: int) -> str | None: ...
    def pipeline_parallel_refusal(self, pp: int) -> str | None: ...
    def pipeline_stage_peaks(
        self,
        pp: int,
        schedule: PipelineSchedule,
        microbatches: int,
        batch_size: int,
        seq_len: int | None,
        precision: Precision,
        optimizer: OptimizerChoice | None,
        implementation: OptimizerImplementation | None,
        split: tuple[str, ...] | None = None,
    ) -> tuple[Any, ...]: ...

    def generation(
        self,
        precision: Precision,
        seq_len: int | None,
        *,
        decode_steps: int = ...,
        new_tokens: int | None = ...,
    ) -> Timeline: ...

    def load_layout(self, dtype: str, weights: Weights) -> LoadLayout: ...


class ModelProfile:
    """The cached profile of one model; ``estimate`` answers any setting in milliseconds.

    Build it with :func:`vram_widget.profile_model`.
    """

    def __init__(
        self,
        rows: ModuleRows,
        device: Device,
        source: ProfileSource,
        *,
        model_name: str = "",
        input_shape: str = "",
        fallback_reason: str | None = None,
        seq_len: int | None = None,
        no_seq_reason: str = "",
        seq_len_limit: int | None = None,
        seq_window: int | None = None,
        generates: bool = False,
        generation_limit: int | None = None,
        cache_implementation: str | None = None,
        param_names: tuple[str, ...] = (),
        param_shapes: tuple[tuple[int, ...], ...] = (),
        param_trainable: tuple[bool, ...] = (),
        checkpoint_blocks: tuple[str, ...] = (),
        hf_checkpointing: bool = False,
        loss_chunks_refusal: str = CHUNKING_UNKNOWN,
    ) -> None:
        self.rows = rows
        self.device = device
        self.model_name = model_name
        # The profiled inputs as a person reads them ("batch × 3 × 224 × 224"): every
        # estimate is for this shape at its batch size, so it is shown wherever one is.
        self.input_shape = input_shape
        self.fallback_reason = fallback_reason
        self._source = source
        # The example's sequence length (None: no sequence axis), and why there is none
        self.seq_len = seq_len
        self._no_seq_reason = no_seq_reason
        # the longest sequence the model takes (learned absolute positions), if it has one
        self.seq_len_limit = seq_len_limit
        # a length where the model's attention changes form (a sliding window, chunks): the
        # fit in the length serves only lengths on the example's side of it
        self.seq_window = seq_window
        # whether the model generates with a KV cache (mode="generate"), and the most
        # positions a prompt and its new tokens may take (config.max_position_embeddings)
        self.generates = generates
        self.generation_limit = generation_limit
        # the model's generation_config.cache_implementation (None: DynamicCache)
        self.cache_implementation = cache_implementation
        # the parameters' qualified names (tied ones once), which ``trainable`` patterns match
        self.param_names = param_names
        self.param_shapes = param_shapes
        # each parameter's requires_grad as the model has it (the levers may freeze more)
        self.param_trainable = param_trainable or tuple(True for _ in param_names)
        # parameters kept in their own dtype whatever the precision (PEFT's adapters: fp32
        # on a half base by default), name -> dtype name
        self.fixed_param_dtypes: dict[str, str] = {}
        # what ``checkpoint="auto"`` wraps, and whether Hugging Face's own call applies it
        self.checkpoint_blocks = checkpoint_blocks
        self.hf_checkpointing = hf_checkpointing
        # why ``loss_chunks`` cannot be applied to the model ("": it can; chunked_loss.py)
        self.loss_chunks_refusal = loss_chunks_refusal
        # Every cache is per (precision, mode, levers); inference has no levers.
        self._timelines: dict[tuple[Precision, Mode, Levers], Timeline] = {}
        # the timeline as a polynomial in (batch, seq), made on the first other length
        # asked (None: memory is no such polynomial in the length)
        self._across_lengths: dict[tuple[Precision, Mode, Levers], Timeline | None] = {}
        # where it is none: other sequence lengths, each profiled on first use (cached)
        self._other_lengths: dict[tuple[Precision, Mode, Levers, int], Timeline] = {}
        # a setting that failed to profile fails again at once, without another run
        self._failures: dict[tuple[Precision, Mode, Levers], ProfilingError] = {}
        self._optimizers: dict[
            tuple[
                Precision,
                OptimizerChoice,
                Levers,
                tuple[str, ...] | None,
                tuple[int, int] | None,
                OptimizerImplementation,
            ],
            OptimizerTrace,
        ] = {}
        # LoRA: the profile of a meta copy that PEFT's get_peft_model wrapped, per (rank,
        # targets); its module names carry PEFT's prefix
        self._lora_profiles: dict[tuple[int, tuple[str, ...] | None, str | None], ModelProfile] = {}
        # quantized weights: the profile of bitsandbytes' quantized meta copy, per (weights,
        # LoRA rank, targets, adapters' dtype)
        self._quantized_profiles: dict[
            tuple[Weights, int | None, tuple[str, ...] | None, str | None], ModelProfile
        ] = {}
        # float8 training: the profile of torchao's float8 conversion of a meta copy
        self._float8_profiles: dict[Float8, ModelProfile] = {}
        # data parallelism: (precision, levers, ranks, rank) -> buffers, optimizer shards
        self._rank_layouts: dict[
            tuple[Precision, Levers, Parallel, int | None],
            tuple[tuple[int, ...], list[tuple[int, tuple[str, ...]]] | None],
        ] = {}
        # FSDP2: (timeline id, precision, levers, ranks) -> what it inserts into the step
        self._step_edits: dict[tuple[int, Precision, Levers, Parallel], StepEdits] = {}
        # generation across a sliding window: a run at a prompt just below it, per precision
        self._across_windows: dict[Precision, Timeline] = {}
        # generation with a StaticCache: runs at STATIC_CACHE_TOKENS, per precision and prompt
        self._static_caches: dict[tuple[Precision, int | None], tuple[Timeline, ...]] = {}
        self.name_prefix = ""
        # the tensors a loader leaves, per (dtype, weights): load_bytes
        self._load_layouts: dict[tuple[str, Weights], LoadLayout] = {}

    def __repr__(self) -> str:
        return (
            f"ModelProfile({self.model_name or 'model'}: {self.param_count:,} parameters, "
            f"{len(self.rows.names) - 2} modules, inputs: {self.input_shape or '?'}, "
            f"device={self.device.value!r})"
        )

    @property
    def param_count(self) -> int:
        """Parameters of the model, shared (tied) ones counted once."""
        return int(self.rows.param_count.sum())

    @property
    def trainable_param_count(self) -> int:
        return int(self.rows.trainable_param_count.sum())

    def levers(
        self,
        checkpoint: object = None,
        trainable: object = None,
        grad_accumulation: object = 1,
        lora_rank: object = None,
        lora_targets: object = "auto",
        checkpoint_policy: object = None,
    ) -> Levers:
        """The :class:`Levers` that ``estimate``'s lever keywords mean for this model (a
        ValueError / TypeError naming the problem and the valid forms)."""
        if isinstance(checkpoint, list | tuple) and self.name_prefix:
            # patterns of the plain model's names also match inside PEFT's wrapper
            checkpoint = [self.name_prefix + str(p) for p in checkpoint]
        return resolve_levers(
            module_names=self.rows.names[:-2],
            module_types=self.rows.types[:-2],
            param_names=self.param_names,
            auto_blocks=self.checkpoint_blocks,
            hf_auto=self.hf_checkpointing,
            model_name=self.model_name,
            checkpoint=checkpoint,
            trainable=trainable,
            grad_accumulation=grad_accumulation,
            lora_rank=lora_rank,
            lora_targets=lora_targets,
            checkpoint_policy=checkpoint_policy,
        )

    def _lora(
        self, levers: Levers, dtype: str | None = None
    ) -> tuple[ModelProfile, dict[str, Any]]:
        """The LoRA profile of ``levers`` with the adapters in ``dtype``
        (``parse_lora_dtype``; made on first use, one per dtype) and the levers to ask it
        for: checkpointing by the same names inside PEFT's wrapper, accumulation as it is."""
        assert levers.lora_rank is not None
        key = (levers.lora_rank, levers.lora_targets, dtype)
        if key not in self._lora_profiles:
            self._lora_profiles[key] = self._source.lora_profile(*key)
        return self._lora_profiles[key], self._lora_levers(levers)

    def _lora_levers(self, levers: Levers) -> dict[str, Any]:
        """The levers to ask a LoRA sub-profile for: checkpointing by the same names inside
        PEFT's wrapper, accumulation and ``torch.compile`` as they are: PEFT wraps the
        model, then it is compiled, as with Hugging Face's ``Trainer`` (``get_peft_model``
        before the ``Trainer`` is made; transformers 5.24's ``Trainer`` enables
        checkpointing, then ``self.accelerator.prepare(self.model)``, where accelerate
        1.15's ``prepare_model`` calls ``torch.compile(model, **dynamo_plugin.to_kwargs())``
        for ``torch_compile=True``)."""
        checkpoint: object = None
        if levers.checkpoint_hf:
            checkpoint = "auto"
        elif levers.checkpoint:
            checkpoint = list(levers.checkpoint)  # prefixed by the sub-profile's levers()
        policy = levers.checkpoint_policy if checkpoint is not None else None
        return {
            "checkpoint": checkpoint,
            "checkpoint_policy": policy,
            "grad_accumulation": levers.grad_accumulation,
            "loss_chunks": levers.loss_chunks,
            "offload_activations": levers.offload_activations,
            "compile": levers.compile,
            "activation_memory_budget": levers.activation_memory_budget,
        }

    def _quantized(
        self, weights: Weights, levers: Levers, lora_dtype: str | None
    ) -> tuple[ModelProfile, dict[str, Any]]:
        """The profile of the model with its weights quantized by bitsandbytes (and, with
        ``levers.lora_rank``, QLoRA's adapters), made on first use and cached, and the
        levers to ask it for (as :meth:`_lora` gives them)."""
        rank = levers.lora_rank
        targets = levers.lora_targets if rank is not None else None
        key = (weights, rank, targets, lora_dtype)
        if key not in self._quantized_profiles:
            self._quantized_profiles[key] = self._source.quantized_profile(*key)
        sub = self._quantized_profiles[key]
        return sub, {} if rank is None else self._lora_levers(levers)

    def _float8(self, recipe: Recipe) -> tuple[ModelProfile, Recipe]:
        """The profile of the model converted to float8 training by torchao (made on first
        use, cached per setting; refused by name before any profiling where the step is not
        estimated) and the recipe to ask it: the same, float8 off (the copy has the same
        module names, so the levers apply as they are)."""
        float8 = recipe.float8
        check_float8(
            float8,
            recipe.step.mode,
            recipe.step.precision,
            recipe.weights,
            recipe.levers.lora_rank,
            recipe.parallel.gpus,
            recipe.levers.compile,
        )
        if float8 not in self._float8_profiles:
            self._float8_profiles[float8] = self._source.float8_profile(float8)
        return self._float8_profiles[float8], dataclasses.replace(recipe, float8=Float8())

    def _made_lora(self, levers: Levers) -> tuple[ModelProfile, Levers] | None:
        """The LoRA profile of ``levers`` and the levers to ask it for, where it was made
        already (None: asking would profile it)."""
        if (levers.lora_rank, levers.lora_targets, None) not in self._lora_profiles:
            return None
        sub, kwargs = self._lora(levers)
        chunks = kwargs.pop("loss_chunks")
        offload = kwargs.pop("offload_activations")
        compiled = {name: kwargs.pop(name) for name in ("compile", "activation_memory_budget")}
        return sub, dataclasses.replace(
            sub.levers(**kwargs),
            loss_chunks=chunks,
            offload_activations=offload,
            compile_batch=levers.compile_batch,
            **compiled,
        )

    def is_cached(
        self,
        precision: str | Precision,
        mode: str | Mode = Mode.TRAIN,
        optimizer: str | OptimizerName | None = None,
        seq_len: int | None = None,
        levers: Levers = NO_LEVERS,
        parallel: Parallel = SINGLE_DEVICE,
        new_tokens: int | None = None,
        batch_size: int | None = None,
    ) -> bool:
        """Whether an estimate at this precision, mode (in training, optimizer), sequence
        length, levers and data parallelism needs no further profiling run (FSDP2 under
        autocast steps on half-precision parameters: a run of its own; a generation of
        ``new_tokens`` across a sliding window, one recorded across it). A compiled step
        (``levers.compile``) is profiled at its batch size (``compiled.decided_at``):
        ``batch_size``, where ``levers.compile_batch`` does not say it; without either, a
        compiled step is not known to be cached (False)."""
        prec = parse_option(Precision, precision, "precision")
        run_mode = parse_option(Mode, mode, "mode")
        if run_mode is Mode.TRAIN and levers.compile is not None and levers.compile_batch is None:
            if batch_size is None:
                return False
            levers = decided_at(levers, batch_size)
        if levers.lora_rank is not None and run_mode is Mode.TRAIN:
            made = self._made_lora(levers)
            return made is not None and made[0].is_cached(
                prec, run_mode, optimizer, seq_len, made[1], parallel
            )
        if run_mode is Mode.GENERATE and self.cache_implementation == "static":
            length = None if seq_len == self.seq_len else seq_len
            return (prec, length) in self._static_caches
        levers = _step_levers(levers, run_mode, parallel, prec)
        key = (prec, run_mode, _profiled(levers, run_mode))
        if key not in self._timelines:
            return False
        if seq_len is not None and seq_len != self.seq_len:
            if key not in self._across_lengths:
                return False  # the fit in the length runs first
            fitted = self._across_lengths[key]
            no_fit = fitted is None or not self._same_side_of_window(seq_len)
            if no_fit and (*key, seq_len) not in self._other_lengths:
                return False  # profiled at that length
        if run_mode is Mode.GENERATE and new_tokens is not None:
            prompt = self.seq_len if seq_len is None else seq_len
            forwards = len(self.timeline(prec, run_mode, seq_len).step_starts) - 1  # cached
            crossing = prompt is not None and crosses_window(
                prompt, new_tokens, forwards, self.seq_window
            )
            if crossing and prec not in self._across_windows:
                return False
        opt, impl = parse_optimizer_choice(optimizer)
        impl = impl or default_implementation(self.device)
        return (
            run_mode is not Mode.TRAIN  # no optimizer outside training
            or opt is None
            or levers.in_backward is not None  # its steps are in the timeline
            or (prec, opt, _optimizer_levers(levers), None, None, impl) in self._optimizers
        )

    def length_fit_tried(
        self, precision: str | Precision, mode: str | Mode = Mode.TRAIN, levers: Levers = NO_LEVERS
    ) -> bool:
        """Whether the fit in the sequence length has been made (or found impossible) for
        this precision, mode and levers: from then on, which other lengths are numpy is
        known."""
        prec = parse_option(Precision, precision, "precision")
        run_mode = parse_option(Mode, mode, "mode")
        if levers.lora_rank is not None and run_mode is Mode.TRAIN:
            made = self._made_lora(levers)
            return made is not None and made[0].length_fit_tried(prec, run_mode, made[1])
        return (prec, run_mode, _profiled(levers, run_mode)) in self._across_lengths

    def _same_side_of_window(self, seq_len: int) -> bool:
        window = self.seq_window
        return (
            window is None or self.seq_len is None or (seq_len < window) == (self.seq_len < window)
        )

    @property
    def has_seq_axis(self) -> bool:
        """Whether ``estimate(seq_len=...)`` can vary the sequence length."""
        return self.seq_len is not None

    def check_seq_len(self, seq_len: object) -> int | None:
        """``seq_len`` validated (ValueError / TypeError naming the problem); None where it is
        None or the example's own length."""
        if seq_len is None:
            return None
        if not self.has_seq_axis:
            raise ValueError(
                f"seq_len={seq_len!r}: this profile has no sequence axis (inputs: "
                f"{self.input_shape}; {self._no_seq_reason})"
            )
        if isinstance(seq_len, bool) or not isinstance(seq_len, int | np.integer):
            raise TypeError(f"seq_len must be a positive integer, got {seq_len!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len} (inputs: {self.input_shape})")
        if self.seq_len_limit is not None and seq_len > self.seq_len_limit:
            raise ValueError(
                f"seq_len={seq_len} is beyond the model's {self.seq_len_limit} learned "
                "positions (config.max_position_embeddings): a real step would index past "
                "its position table"
            )
        return None if seq_len == self.seq_len else int(seq_len)

    def timeline(
        self,
        precision: Precision,
        mode: Mode,
        seq_len: int | None = None,
        levers: Levers = NO_LEVERS,
    ) -> Timeline:
        asked = levers if mode is Mode.TRAIN else NO_LEVERS
        profiled = _profiled(levers, mode)
        timeline = self._profiled_timeline(precision, mode, seq_len, profiled)
        if asked.grad_accumulation > profiled.grad_accumulation:
            # k > 2 micro-batches: the memory of 2, the FLOPs of k (2 profiled: exact halves)
            timeline = _scaled_flops(timeline, asked.grad_accumulation, 2)
        return timeline

    def _profiled_timeline(
        self, precision: Precision, mode: Mode, seq_len: int | None, levers: Levers
    ) -> Timeline:
        if seq_len is not None and seq_len != self.seq_len:
            # Another length. Once per setting, the profile is fitted as a polynomial in the
            # length too (runs at two more lengths, checked exactly at a fourth); then every
            # length is numpy. Where memory is no such polynomial, the length is profiled as
            # the example was, at that length (cached): exact either way.
            base = self._profiled_timeline(precision, mode, None, levers)  # fails as it fails
            key = (precision, mode, levers)
            if key not in self._across_lengths:
                self._across_lengths[key] = self._source.timeline_across_lengths(
                    precision, mode, base, levers
                )
            polynomial = self._across_lengths[key]
            if polynomial is not None and self._same_side_of_window(seq_len):
                return polynomial
            length_key = (*key, seq_len)
            if length_key not in self._other_lengths:
                self._other_lengths[length_key] = self._source.timeline(
                    precision, mode, seq_len, levers
                )
            return self._other_lengths[length_key]
        key = (precision, mode, levers)
        if key not in self._timelines and key not in self._failures:
            try:
                self._timelines[key] = self._source.timeline(precision, mode, None, levers)
            except ProfilingError as exc:
                self._failures[key] = exc
        failure = self._failures.get(key)
        if failure is not None:
            others = [p.value for p, m, lv in self._timelines if m is mode and lv == levers]
            if not others:  # no precision runs: the model's own failure, as it came
                raise failure
            raise ProfilingError(
                f"{mode.value} in {precision.value} cannot run for device={self.device.value!r} "
                f"({', '.join(others)} can): {failure}"
            ) from failure.__cause__
        return self._timelines[key]

    @property
    def precisions(self) -> tuple[Precision, ...]:
        """The precisions profiled so far whose training step runs (the widget starts there
        when fp32 does not: a kernel that runs in some dtypes only). Where no training step
        has been profiled yet (``profile_model`` defers its runs), fp32's is profiled now,
        then bf16's and fp16's while it fails; where none runs, fp32's error is raised."""
        if not any(m is Mode.TRAIN and lv == NO_LEVERS for _p, m, lv in self._timelines):
            first: ProfilingError | None = None
            for precision in (Precision.FP32, Precision.BF16, Precision.FP16):
                try:
                    self.timeline(precision, Mode.TRAIN)
                    break
                except ProfilingError as exc:
                    first = first or exc
            else:
                assert first is not None
                raise first
        return tuple(p for p, m, lv in self._timelines if m is Mode.TRAIN and lv == NO_LEVERS)

    def optimizer_trace(
        self,
        precision: Precision,
        optimizer: OptimizerChoice,
        levers: Levers = NO_LEVERS,
        only: tuple[str, ...] | None = None,
        shard: tuple[int, int] | None = None,
        implementation: OptimizerImplementation | None = None,
    ) -> OptimizerTrace:
        """The optimizer's step (``only``: over these parameters alone, a ZeRO shard;
        ``shard=(world_size, rank)``: over that rank's FSDP2 shard of each parameter),
        run as ``implementation`` (None: torch's default on the profile's device)."""
        impl = implementation or default_implementation(self.device)
        key = (precision, optimizer, _optimizer_levers(levers), only, shard, impl)
        if key not in self._optimizers:
            # the training step of these levers first: it says which parameters got a
            # gradient (the optimizer's state is made for those)
            self.timeline(precision, Mode.TRAIN, None, levers)
            self._optimizers[key] = self._source.optimizer_trace(
                precision, optimizer, _profiled(levers, Mode.TRAIN), only, shard, impl
            )
        return self._optimizers[key]

    def estimate(
        self,
        batch_size: int = default(1),
        precision: str | Precision = default("fp32"),
        optimizer: str | OptimizerName | None = default("adam"),
        mode: str | Mode = default("train"),
        *,
        seq_len: int | None = default(None),
        compute_capability: tuple[int, int] | None = default(None),
        checkpoint: object = default(None),
        trainable: object = default(None),
        grad_accumulation: int = default(1),
        lora_rank: int | None = default(None),
        lora_targets: object = default("auto"),
        weights: object = default(None),
        float8: object = default(None),
        expandable_segments: bool = default(False),
        gpus: int = default(1),
        strategy: str | Strategy = default("ddp"),
        rank: int | None = default(None),
        gpus_per_node: int = default(DEFAULT_GPUS_PER_NODE),
        fsdp_units: object = default(None),
        new_tokens: int | None = default(None),
        recipe: Recipe | None = None,
        **settings: Any,
    ) -> MemoryEstimate:
        """Memory and FLOPs of one step at this setting, from the cached profile.

        Parameters
        ----------
        batch_size : int
            Samples per step (>= 1).
        precision : {"fp32", "bf16", "fp16", "amp-bf16", "amp-fp16"}
        optimizer : str, callable or None
            ``"sgd"``, ``"sgd-momentum"``, ``"adam"``, ``"adamw"``, ``"adagrad"``,
            ``"rmsprop"`` (``-fused`` / ``-foreach`` / ``-forloop`` for SGD and Adam /
            AdamW); ``"adamw8bit"`` and ``"paged-adamw8bit"`` (bitsandbytes),
            ``"adamw8bit-torchao"`` and ``"adamw4bit-torchao"`` (torchao), ``"adafactor"``
            (transformers, with its Trainer's settings), each stepped by its library (a
            missing library is named with its ``pip install``); a callable ``params ->
            torch.optim.Optimizer`` (a class or a ``functools.partial``), whose own
            ``step()`` is traced; or None. Bitsandbytes' paged state is not in
            ``peak_bytes`` on CUDA: it is in unified memory, reported as ``paged_bytes``.
            Ignored in inference and generate modes.
        mode : {"train", "inference", "generate"}
            ``"generate"``: Hugging Face's greedy ``model.generate`` of ``new_tokens`` tokens
            after a prompt of ``seq_len`` tokens per sequence, ``batch_size`` sequences at
            once: the prefill of the prompt, then one decode step per further token with
            the model's own ``DynamicCache`` (``generation``: its code recorded on fake
            tensors for the prefill and 4 decode steps, the rest extrapolated from a pattern
            checked exactly on them, ``decoding``). The peak is over every step
            (``est.peak_step``: 0 the prefill, k decode step k); ``est.kv_cache_bytes`` and
            ``est.kv_cache_bytes_per_token`` give the cache. Prompts are taken as unpadded.
        seq_len : int, optional
            Tokens per sample, where the profile has a sequence axis (``has_seq_axis``);
            None is the example's length (``self.seq_len``). A length used for the first time
            is profiled at that length (cached), so the answer is exact at any length.
        compute_capability : (major, minor), optional
            The target GPU's, as ``torch.cuda.get_device_capability()`` gives it; it sizes
            the cuBLAS workspace in ``est.extras`` (32 MiB on 9.x, 8 MiB before). Default
            (9, 0), an H100.
        checkpoint : None, "auto", str or list of str
            Activation checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``):
            the modules whose forward is recomputed in the backward. ``"auto"``: each child
            of the model's largest ``ModuleList`` of repeated blocks (for a Hugging Face
            model, applied by its own ``activation_checkpointing_enable``); a class name
            (``"GPT2Block"``); or a list of fnmatch patterns of qualified module names
            (``["layer1", "layer2"]``), each wrapped as torch's ``checkpoint_wrapper`` wraps
            it. The recompute's FLOPs are in the backward's.
        trainable : None, str or list of str
            fnmatch patterns of the parameter names that train (``"classifier.*"``); every
            other parameter is frozen (no gradient, no optimizer state). None: as the model's
            ``requires_grad`` flags are.
        grad_accumulation : int
            Micro-batches of ``batch_size`` whose gradients accumulate before one optimizer
            step: the peak is over the whole step (the second micro-batch's backward runs with
            the gradients resident), the FLOPs those of all micro-batches.
        lora_rank : int, optional
            LoRA adapters of this rank, applied by PEFT's own ``get_peft_model(model,
            LoraConfig(r=lora_rank, target_modules=...))`` on a meta copy of the model (the
            model itself is not touched), so what is frozen, added and saved is exactly
            PEFT's. Needs ``pip install peft``. Not with ``trainable``.
        lora_targets : "auto", "all-linear" or list of str
            PEFT's ``target_modules``; ``"auto"``: PEFT's defaults for the architecture
            (Hugging Face models; other models must name their modules).
        weights : None, str ("nf4", "int8-torchao", "nf4-torchao", ...) or Weights
            The base weights stored by bitsandbytes, as transformers'
            ``from_pretrained(quantization_config=BitsAndBytesConfig(...))`` stores them:
            its ``replace_with_bnb_linear`` on a meta copy of the model (``nn.Linear`` and
            ``Conv1D`` layers, the output embeddings and last module kept), each weight
            quantized by bitsandbytes' own ``quantize_4bit`` on fake tensors, the step run
            through ``Linear4bit``'s kernels. ``"nf4"`` / ``"fp4"``: ``Linear4bit`` at
            ``BitsAndBytesConfig``'s defaults (compute in float32, no double quantization,
            blocks of 64); a :class:`~vram_widget.Weights` (or a ``BitsAndBytesConfig``)
            sets them (``Weights("nf4", double_quant=True, compute_dtype="bf16")``, QLoRA's).
            In training, the quantized weights are frozen: ``lora_rank`` is needed (QLoRA:
            PEFT's ``prepare_model_for_kbit_training``, which casts the other half-precision
            parameters to fp32, then ``get_peft_model``). ``"int8"`` (``Linear8bitLt``,
            inference): with ``Weights("int8", int8_threshold=0.0)``; at
            ``BitsAndBytesConfig``'s threshold 6.0 its outlier split depends on the
            activations' values, refused (``measure`` takes it). On ``device="cuda"``,
            ``gemm_4bit`` runs as its unfused fallback does
            (the weight dequantized, then ``F.linear``: bitsandbytes/backends/cuda/ops.py,
            ``_dequant_linear_fallback``); for up to 1,536 rows of input it may pick a fused
            kernel by the GPU's architecture (``_gemm_4bit_use_custom_cuda``) that makes
            only the output, so the estimate is an upper bound there (UNCONFIRMED on a GPU).
            Needs ``pip install bitsandbytes transformers``. ``"int8-torchao"`` /
            ``"int4-torchao"``: torchao's ``quantize_`` (``Int8WeightOnlyConfig``; int4 on
            ``device="cpu"`` only, ``PrototypeInt4WeightOnlyConfig``'s
            ``Int4OpaqueTensor``), inference only, on the ``nn.Linear`` layers (on a
            transformers model, not the output embeddings, as ``TorchAoConfig``); needs
            ``pip install torchao``.
        float8 : None, True, "tensorwise", "rowwise" or Float8
            Float8 training by torchao: ``convert_to_float8_training`` on a meta copy (every
            ``nn.Linear``, torchao's default; ``Float8(recipe, filter_fqns=...)`` keeps
            layers in high precision, as torchtitan's ``filter_fqns`` does), with
            ``Float8LinearConfig.from_recipe_name(recipe)``; True is torchao's default,
            ``"tensorwise"``. The weights, their gradients and the optimizer state stay in
            the precision's dtype; the casts to float8 are added. Training only, in fp32,
            bf16 or fp16, on one GPU; a Linear whose dims are not multiples of 16 is refused
            by name. ``device="cpu"`` runs torchao's ``emulate=True`` (what ``measure``
            runs on a CPU); ``device="cuda"`` its ``torch._scaled_mm`` path (the kernel's
            workspace UNCONFIRMED). Needs ``pip install torchao``.
            ``pip install torchao``. ``"nf4-torchao"``: torchao's ``NF4Tensor`` as
            torchtune's QLoRA applies it: its ``LoRALinear(..., quantize_base=True)`` on the
            ``lora_targets``, ``FrozenNF4Linear`` on the other Linear layers (on a
            transformers model, not the output embeddings; elsewhere ``skip_modules``), only
            the adapters trained, in the model's dtype (or ``lora_dtype``); each weight's
            size a multiple of ``blocksize x scaler_blocksize`` (64 x 256); needs ``pip
            install torchao torchtune``.
        expandable_segments : bool
            The caching allocator's ``expandable_segments:True`` for ``reserved_bytes``,
            ``device_bytes``, ``fits_device`` and ``memory_snapshot`` (``device="cuda"``
            only).
        gpus : int
            Data-parallel ranks. The estimate is one rank's training step at ``batch_size``
            samples per rank (the global batch is ``gpus * batch_size``). 1: one device, no
            wrapper. Inference is not wrapped (each rank runs the forward alone).
        strategy : {"ddp", "zero1", "zero2", "zero3", "hsdp"}
            How the ranks share the step (``sharding.STRATEGIES``): ``"ddp"`` is
            ``DistributedDataParallel`` with its defaults, whose flat gradient buckets
            (25 MiB, the first 1 MiB) add the trainable parameters' bytes once more on each
            rank, in ``communication_bytes``. ``"zero1"`` adds
            ``ZeroRedundancyOptimizer``: each rank's optimizer state and step are those of
            its shard of the parameters (ZeRO's own partition); ranks differ, and the
            estimate is the worst one (``est.rank``). ``"zero2"`` and ``"zero3"`` are
            FSDP2's ``fully_shard`` on each repeated block and the root
            (``sharding.fsdp_step_edits``): parameters, gradients and optimizer state are
            each rank's padded dim-0 shards; each unit is all-gathered around its forward
            and backward (``"zero3"`` frees a block's after its forward, ``"zero2"`` keeps
            them) and its gradients reduce-scattered after its backward; ``"hsdp"`` is
            ``"zero3"`` within nodes of ``gpus_per_node``, replicated across. They compose
            with every lever (each micro-batch gathers and reduce-scatters again).
        rank : int, optional
            With ``gpus > 1``: the rank to estimate where ranks differ (ZeRO's shards;
            FSDP2's last ranks hold shorter chunks); None: the worst of the ranks that lead
            on optimizer state or on the step's largest temporaries
            (``sharding._zero_ranks``), rank 0 under FSDP2.
        gpus_per_node : int
            GPUs per node (default 8): ``"hsdp"`` is ``"zero3"`` within a node and
            replicated across nodes; ``gpus`` must be whole nodes (or at most one).
        fsdp_units : str or list of str, optional
            FSDP2's units under ``"zero2"`` / ``"zero3"`` / ``"hsdp"``: module names or
            class names (``"LlamaDecoderLayer"``), outermost matches, besides the root.
            None: each child of the largest ``ModuleList`` of repeated blocks, as
            torchtitan and accelerate wrap. A name that matches nothing is a ValueError.
        new_tokens : int, optional
            With ``mode="generate"`` (and only then): the tokens generated after the
            prompt, >= 1; the prompt plus them must fit the model's
            ``max_position_embeddings``. A generation whose steps cross the model's sliding
            window costs one more profiling run the first time (per precision): a run across
            the window, joined to the prompt's own. A model whose ``generation_config`` asks
            for another cache than the dynamic one is refused by name (not estimated yet).
        recipe : Recipe, optional
            The whole setup as one value; the keywords above build one (a keyword that
            asks for something else than ``recipe`` holds is a ValueError).
        **settings
            Any other setting of a :class:`~vram_widget.Recipe` by its flat name
            (:meth:`Recipe.with_ <vram_widget.Recipe.with_>`), e.g.
            ``optimizer_in_backward=True``, ``set_to_none=False``, ``lora_dtype="bf16"``,
            ``context_bytes=...``; an unknown name is a TypeError listing the valid ones.
            ``tp=k`` (with ``gpus=k``) estimates one of ``k`` tensor-parallel ranks, in
            training or inference: a meta copy of the model sharded by its own plan (a
            Hugging Face model's ``base_model_tp_plan``) or ``tp_plan={pattern:
            ParallelStyle}`` with DTensor on PyTorch's fake process group, profiled once
            per question (``_profiling/tensor_parallel.py``; docs: the guide on several
            GPUs).
            ``pp=k`` (with ``gpus=k``), ``pp_schedule="gpipe"`` / ``"1f1b"`` and
            ``microbatches=m`` (default ``k``), ``pp_split=["layers.K", ...]`` (the first
            layer of each stage after the first; default: the layers evenly) estimate each
            of ``k`` pipeline stages of a Hugging Face decoder (fp32 / bf16 training, a
            ``device="cpu"`` profile):
            ``batch_size`` is the whole step's batch, split into ``m`` micro-batches; each
            stage's step runs as ``torch.distributed.pipelining`` schedules it, on fake
            tensors (``_profiling/pipeline_parallel.py``). ``peak_bytes`` is the worst
            stage's, ``est.stage_peak_bytes`` each stage's.
            ``context_bytes`` (bytes) replaces the CUDA context of
            ``accelerator.cuda_context``'s table, which ``compute_capability`` and
            ``lazy_loading`` (default True, torch's ``CUDA_MODULE_LOADING=LAZY``) pick;
            ``est.extras.cuda_context_source`` says which figure was used and its source.
            ``compile=True`` / ``"model"`` / ``"blocks"`` with ``activation_memory_budget``
            estimates the ``torch.compile`` training step (``est.levers.compile``): Inductor's
            partitioner on fake tensors decides what is saved for the backward, and the
            partitioned graphs run node by node, so each region's temporaries are the eager
            ops' (an upper bound on Inductor's fused kernels; the guide on torch.compile).

        Notes
        -----
        The levers apply in training; a new combination costs one more profiling run
        (cached), as a new precision does.

        Returns
        -------
        MemoryEstimate

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
        >>> est = profile.estimate(batch_size=64, optimizer="sgd")
        >>> est.peak_bytes > est.parameter_bytes
        True

        Generation (a Hugging Face causal LM; this GPT-2's KV cache is 2 layers x keys and
        values x 64 x 4 bytes = 1,024 B per token in fp32; after 8 new tokens on a prompt
        of 20 it holds 20 + 7 tokens of each of 4 sequences):

        >>> import torch, transformers
        >>> gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64))
        >>> prompts = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
        >>> est = profile_model(gpt2, inputs=prompts, device="cpu").estimate(
        ...     4, mode="generate", seq_len=20, new_tokens=8)
        >>> est.kv_cache_bytes_per_token, est.kv_cache_bytes == 4 * 27 * 1024
        (1024, True)
        """
        asked = Recipe.from_keywords(
            recipe,
            batch_size=batch_size,
            precision=precision,
            optimizer=optimizer,
            mode=mode,
            seq_len=seq_len,
            compute_capability=compute_capability,
            checkpoint=checkpoint,
            trainable=trainable,
            grad_accumulation=grad_accumulation,
            lora_rank=lora_rank,
            lora_targets=lora_targets,
            weights=weights,
            float8=float8,
            expandable_segments=expandable_segments,
            gpus=gpus,
            strategy=strategy,
            rank=rank,
            gpus_per_node=gpus_per_node,
            fsdp_units=fsdp_units,
            new_tokens=new_tokens,
            **settings,
        )
        est = self._estimate(asked)
        # what the config the Recipe was read from sets, and what the step runs, that the
        # estimate leaves out: named on the estimate and in a warning, never dropped
        ignored = (*asked.ignored, *_unmodelled_step(asked))
        if len(ignored) > len(asked.ignored):
            warn_ignored("the step", ignored[len(asked.ignored) :])
        return dataclasses.replace(est, ignored=ignored) if ignored else est

    def load_bytes(
        self,
        recipe: Recipe | None = None,
        *,
        precision: str | Precision = default("fp32"),
        weights: object = default(None),
    ) -> LoadEstimate:
        """The device memory once the model is loaded, before any step: its parameters and
        buffers at the precision's dtype, the Linear weights in ``weights``' quantized
        layout, as the real loaders leave them (``from_pretrained`` for a Hugging Face
        model, ``model.to(dtype)`` for any other: :mod:`~vram_widget._estimating.loading`).

        Parameters
        ----------
        recipe : Recipe, optional
            Its ``precision`` and ``weights`` are read; the rest of it is the step's.
        precision : str
            ``"bf16"`` / ``"fp16"`` load the weights in that dtype, ``"fp32"`` and the
            ``"amp-*"`` precisions in float32 (autocast keeps float32 weights).
        weights : str, Weights or transformers.BitsAndBytesConfig, optional
            bitsandbytes' quantization of the Linear weights (as ``estimate`` takes it).

        Returns
        -------
        LoadEstimate
            ``allocated_bytes`` and ``reserved_bytes`` (on CUDA with the caching
            allocator's rules), and what they are made of.

        Examples
        --------
        >>> import torch
        >>> from vram_widget import profile_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        >>> p = profile_model(model, input_size=(8,), device="cpu")
        >>> p.load_bytes(precision="bf16").allocated_bytes  # (128 + 16 + 64 + 4) x 2 B
        424
        """
        asked = self._load_asked(recipe, precision, weights)
        if asked.weights.torchao:
            fmt = asked.weights.format
            assert fmt is not None
            raise ValueError(
                f"load_bytes with weights={fmt.value!r} is not estimated yet: "
                "it follows from_pretrained's bitsandbytes loading (weights='nf4', 'fp4' or "
                "'int8') or no quantization; estimate(..., weights=...) gives torchao's "
                "stored bytes as parameter_bytes"
            )
        dtype = LOAD_DTYPES[asked.step.precision]
        key = (dtype, asked.weights)
        if key not in self._load_layouts:
            self._load_layouts[key] = self._source.load_layout(dtype, asked.weights)
        return load_estimate(
            self._load_layouts[key], asked.step.precision, asked.weights, self.device
        )

    def load_is_cached(
        self,
        recipe: Recipe | None = None,
        *,
        precision: str | Precision = default("fp32"),
        weights: object = default(None),
    ) -> bool:
        """Whether :meth:`load_bytes` of this setting answers without building the model's
        loaded layout (read from a meta build of the model once per dtype and weights).

        Examples
        --------
        >>> import torch
        >>> from vram_widget import profile_model
        >>> p = profile_model(torch.nn.Linear(8, 4), input_size=(8,), device="cpu")
        >>> p.load_is_cached(precision="bf16")
        False
        >>> _ = p.load_bytes(precision="bf16")
        >>> p.load_is_cached(precision="bf16")
        True
        """
        asked = self._load_asked(recipe, precision, weights)
        return (LOAD_DTYPES[asked.step.precision], asked.weights) in self._load_layouts

    @staticmethod
    def _load_asked(recipe: Recipe | None, precision: object, weights: object) -> Recipe:
        return Recipe.from_keywords(recipe, precision=precision, weights=weights)

    def tensor_parallel_refusal(self, tp: int = 2) -> str | None:
        """Why ``tp`` tensor-parallel ranks cannot be estimated for this model with its own
        plan (it has none, or ``tp`` does not divide a size the plan shards), or None;
        checked without profiling.

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> profile = profile_model(zoo.mlp(4, hidden=(8,)), input_size=(4,), device="cpu")
        >>> "has no tensor-parallel plan" in profile.tensor_parallel_refusal(2)
        True
        """
        return self._source.tensor_parallel_refusal(tp)

    def pipeline_parallel_refusal(self, pp: int = 2) -> str | None:
        """Why this model cannot be split into ``pp`` pipeline stages (not a Hugging Face
        decoder, ``pp`` not dividing its layers, inputs other than ids and labels, a profile
        not made with ``device="cpu"``), or None; checked without profiling.

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> profile = profile_model(zoo.mlp(4, hidden=(8,)), input_size=(4,), device="cpu")
        >>> "splits a Hugging Face decoder" in profile.pipeline_parallel_refusal(2)
        True
        """
        return self._source.pipeline_parallel_refusal(pp)

    def tensor_parallel_cached(self, batch_size: int = 1, **settings: Any) -> bool:
        """Whether :meth:`estimate` with these arguments needs no profiling run: True for
        ``tp`` = 1 and for settings it refuses at once; with ``tp`` > 1, whether the same
        question was answered before (each is one rank's sub-profile).

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> profile = profile_model(zoo.mlp(4, hidden=(8,)), input_size=(4,), device="cpu")
        >>> profile.tensor_parallel_cached(4, gpus=2)
        True
        """
        try:
            asked = Recipe.from_keywords(None, batch_size=batch_size, **settings)
            if asked.parallel.tp == 1:
                return True
            plain = _tensor_parallel_question(asked)
        except (ValueError, TypeError):  # refused at once: nothing is profiled
            return True
        return self._source.tensor_parallel_cached(asked.parallel.tp, asked.parallel.tp_plan, plain)

    def _pipeline_estimate(self, recipe: Recipe) -> MemoryEstimate:
        """``pp > 1``: each stage's peak from its step as the schedule runs it; the rest of
        the estimate (per-layer rows, FLOPs, breakdown) is the whole model's one-device
        step at the same batch, for reference."""
        par, step = recipe.parallel, recipe.step
        check_pipeline_parallel(par, step.batch_size)
        check_pipeline_parallel_settings(recipe)
        m = pipeline_microbatches(par)
        opt_name = recipe.optimizer.name
        stages = self._source.pipeline_stage_peaks(
            par.pp, par.pp_schedule, m, step.batch_size, step.seq_len, step.precision,
            opt_name, recipe.optimizer.implementation, par.pp_split,
        )  # fmt: skip
        whole = self._estimate(
            recipe.with_(gpus=1, pp=1, pp_schedule="gpipe", microbatches=None, pp_split=None)
        )
        worst = max(stages, key=lambda s: s.peak_bytes)
        return dataclasses.replace(
            whole,
            peak_bytes=worst.peak_bytes,
            parameter_bytes=worst.parameter_bytes,
            gpus=par.gpus,
            pp=par.pp,
            pp_schedule=par.pp_schedule.value,
            microbatches=m,
            stage_peak_bytes=tuple(s.peak_bytes for s in stages),
            stage_resident_bytes=tuple(s.resident_bytes for s in stages),
        )

    def _parallel_of(self, recipe: Recipe) -> Parallel:
        """The data parallelism a Recipe asks for, its FSDP units resolved to this model."""
        par = recipe.parallel
        parallel = resolve_parallel(par.gpus, par.strategy, gpus_per_node=par.gpus_per_node)
        if par.fsdp_units is None:
            return parallel
        return dataclasses.replace(parallel, fsdp_units=self._fsdp_units(par.fsdp_units))

    def _step_levers_of(self, recipe: Recipe, parallel: Parallel, length: int | None) -> Levers:
        """The levers of the step a Recipe runs, resolved against this model: the memory
        levers, offloading (refused by name on the CPU, in inference and across GPUs:
        offloading.py), and in training how the optimizer steps, the loop's protocol and the
        chunked loss at ``length`` (None: the example's); NO_LEVERS outside training."""
        lv, run_mode = recipe.levers, recipe.step.mode
        levers = self.levers(
            lv.checkpoint,
            lv.trainable,
            lv.grad_accumulation,
            lv.lora_rank,
            lv.lora_targets,
            lv.checkpoint_policy,
        )
        levers = offload_levers(levers, lv.offload_activations, run_mode, self.device, parallel)
        if run_mode is not Mode.TRAIN:
            compile_levers(levers, lv.compile, lv.activation_memory_budget, run_mode, parallel)
            return NO_LEVERS
        implementation = recipe.optimizer.resolved_implementation(self.device)
        levers = stepping_levers(levers, recipe.optimizer, implementation, parallel)
        levers = protocol_levers(levers, recipe.step, recipe.optimizer, parallel)
        levers = chunked_loss_levers(
            levers, lv.loss_chunks, self.loss_chunks_refusal, length or self.seq_len, parallel
        )
        return compile_levers(levers, lv.compile, lv.activation_memory_budget, run_mode, parallel)

    def _estimate(self, recipe: Recipe) -> MemoryEstimate:
        """:meth:`estimate` of one resolved Recipe."""
        if recipe.float8.enabled:  # torchao's float8 copy answers
            sub, plain = self._float8(recipe)
            est = sub._estimate(plain)
            return dataclasses.replace(est, float8=recipe.float8.describe())
        step, lv, par, acc = recipe.step, recipe.levers, recipe.parallel, recipe.accelerator
        batch, prec, run_mode = step.batch_size, step.precision, step.mode
        opt_name = recipe.optimizer.name
        implementation = recipe.optimizer.resolved_implementation(self.device)
        seq_len, compute_capability = step.seq_len, acc.compute_capability
        expandable_segments = acc.expandable_segments
        context = _context_of(acc)
        length = self.check_seq_len(seq_len)
        tokens = self._check_new_tokens(run_mode, recipe.generation.new_tokens, seq_len)
        if expandable_segments and self.device is not Device.CUDA:
            raise ValueError(
                "expandable_segments is a setting of the CUDA caching allocator; this profile "
                'is for device="cpu", which has none: profile with device="cuda"'
            )
        if par.pp > 1 or par.microbatches is not None or par.pp_split is not None:
            return self._pipeline_estimate(recipe)
        if par.tp > 1:  # one rank's sub-profile under DTensor (tensor_parallel.py)
            plain = _tensor_parallel_question(recipe)
            est = self._source.tensor_parallel_estimate(par.tp, par.tp_plan, plain)
            return dataclasses.replace(est, gpus=par.gpus, tp=par.tp)
        parallel = self._parallel_of(recipe)
        asked_rank = check_rank(par.rank, parallel.gpus)
        if recipe.weights.quantized:
            check_quantized(recipe.weights, run_mode, lv.lora_rank, parallel.gpus)
            check_weights_device(recipe.weights, self.device)
        levers = decided_at(self._step_levers_of(recipe, parallel, length), batch)
        lora_dtype = _lora_dtype_of(lv)
        if recipe.weights.quantized:
            sub, kwargs = self._quantized(recipe.weights, levers, lora_dtype)
            plain = dataclasses.replace(recipe, levers=LeverSettings(), weights=Weights())
            est = sub._estimate(plain.with_(**kwargs))
            return dataclasses.replace(est, levers=levers, weights=recipe.weights.describe())
        if levers.lora_rank is not None:
            sub, kwargs = self._lora(levers, lora_dtype)
            plain = dataclasses.replace(recipe, levers=LeverSettings())
            est = sub._estimate(plain.with_(**kwargs))
            return dataclasses.replace(est, levers=levers)
        across = None
        if tokens is not None and self.cache_implementation == "static":
            timeline = self._static_cache_timeline(prec, length, tokens)
        else:
            timeline = self.timeline(
                prec, run_mode, length, _step_levers(levers, run_mode, parallel, prec)
            )
        if tokens is not None:
            prompt = self.seq_len if length is None else length
            forwards = len(timeline.step_starts) - 1
            if prompt is not None and crosses_window(prompt, tokens, forwards, self.seq_window):
                if self.cache_implementation == "static":
                    raise ValueError(
                        f"a generation of {tokens} tokens after a prompt of {prompt} crosses "
                        f"the model's sliding window of {self.seq_window} tokens with a "
                        "StaticCache: not estimated yet (the dynamic cache is)"
                    )
                across = self._across_window(prec)
        train = run_mode is Mode.TRAIN
        if not train:
            parallel = SINGLE_DEVICE
        buffers, shards = self._rank_layout(prec, levers, parallel, asked_rank)
        edits = None
        fsdp_rank = 0
        if parallel.reshard_after_forward is not None:
            # FSDP2: every rank holds a padded chunk of each parameter; rank 0 the largest
            # (its chunks are never short), so it is the worst one unless another is asked
            fsdp_rank = 0 if asked_rank is None else asked_rank
            effective = timeline
            if batch == 1 and timeline.batch_one is not None:
                effective = timeline.batch_one
            edits = self._fsdp_edits(effective, prec, levers, parallel)

        def one_rank(opt: OptimizerTrace | None, rank: int | None) -> MemoryEstimate:
            return estimate(
                self.rows,
                timeline,
                opt,
                batch_size=batch,
                precision=prec,
                optimizer=opt_name,
                mode=run_mode,
                device=self.device,
                seq_len=self.seq_len if length is None else length,
                compute_capability=_check_capability(compute_capability),
                levers=levers,
                expandable_segments=bool(expandable_segments),
                parallel=parallel,
                communication_blocks=buffers,
                rank=rank,
                edits=edits,
                new_tokens=tokens,
                across_window=across,
                optimizer_implementation=None if implementation is None else implementation.value,
                context=context,
            )

        impl = implementation
        if not train or opt_name is None or levers.in_backward is not None:
            # stepped in the backward: its state and steps are in the timeline itself
            return one_rank(None, fsdp_rank if edits is not None else None)
        if edits is not None:
            # the rank's place in its shard group (hsdp: ranks are node-major)
            shard = (parallel.shard_ranks, fsdp_rank % parallel.shard_ranks)
            trace = self.optimizer_trace(prec, opt_name, levers, shard=shard, implementation=impl)
            return one_rank(trace, fsdp_rank)
        if shards is None:
            return one_rank(self.optimizer_trace(prec, opt_name, levers, implementation=impl), None)
        # ranks step different shards (ZeRO): the worst of the candidate ranks
        ranks = [
            one_rank(
                self.optimizer_trace(prec, opt_name, levers, only=names, implementation=impl), rank
            )
            for rank, names in shards
        ]
        return max(ranks, key=lambda e: (e.peak_bytes, -(e.rank or 0)))

    def _check_new_tokens(self, mode: Mode, new_tokens: object, seq_len: int | None) -> int | None:
        """``new_tokens`` checked against the mode, the model and its position limit."""
        if mode is not Mode.GENERATE:
            if new_tokens is not None:
                raise ValueError(f"new_tokens is for mode='generate'; got mode={mode.value!r}")
            return None
        prompt = self.seq_len if seq_len is None else seq_len
        name = self.model_name or "the model"
        tokens = check_generation(name, self.generates, self.generation_limit, prompt, new_tokens)
        if self.cache_implementation == "quantized":
            # transformers/cache_utils.py, QuantizedLayer.update: every decode step
            # dequantizes the whole quantized cache and concatenates it with the unquantized
            # residual; once the residual reaches residual_length (QuantizedCache's default
            # 128) everything is quantized again (QuantoQuantizedLayer._quantize)
            raise ValueError(
                f"{name}'s generation_config.cache_implementation='quantized' (transformers' "
                "QuantizedCache) is not estimated yet: each decode step dequantizes the whole "
                "cache, and every residual_length tokens (128 by default) it quantizes all of "
                "it again, so its decode steps are not one pattern in the cache length; "
                "measure(model, inputs, mode='generate', new_tokens=T) measures it with the "
                "model's generation_config.cache_config"
            )
        if self.cache_implementation not in (None, "static"):
            raise ValueError(
                f"{name}'s generation_config.cache_implementation="
                f"{self.cache_implementation!r} is not estimated yet (the default dynamic "
                "cache and 'static' are); measure(model, inputs, mode='generate', "
                "new_tokens=T) measures it"
            )
        return tokens

    def _static_cache_timeline(
        self, precision: Precision, seq_len: int | None, new_tokens: int
    ) -> Timeline:
        """The generation with a ``StaticCache`` for ``new_tokens`` tokens: recorded at
        ``STATIC_CACHE_TOKENS`` once per precision and prompt length, a line in them."""
        key = (precision, seq_len)
        if key not in self._static_caches:
            if self.device is Device.CUDA:
                # transformers/generation/utils.py, _valid_auto_compile_criteria: a
                # compileable cache on CUDA compiles the decode step
                warnings.warn(
                    "on a GPU, generate compiles the decode step of a StaticCache "
                    "(torch.compile), whose memory is not modelled: this estimate is of "
                    "the eager steps, as generate runs them with "
                    "generation_config.disable_compile=True",
                    UserWarning,
                    stacklevel=3,
                )
            self._static_caches[key] = tuple(
                self._source.generation(precision, seq_len, new_tokens=t)
                for t in STATIC_CACHE_TOKENS
            )
        return at_new_tokens(self._static_caches[key], new_tokens)

    def _across_window(self, precision: Precision) -> tuple[Timeline, int]:
        """The generation recorded across the model's sliding window (profiled once per
        precision), and its prompt's length."""
        window = self.seq_window
        assert window is not None
        prompt = window - PROMPT_BEFORE_WINDOW
        if prompt < 1:
            raise ValueError(
                f"a generation across a sliding window of {window} tokens is recorded from a "
                f"prompt of {PROMPT_BEFORE_WINDOW} fewer: the window is too short"
            )
        if precision not in self._across_windows:
            self._across_windows[precision] = self._source.generation(
                precision, prompt, decode_steps=DECODE_STEPS_ACROSS_WINDOW
            )
        return self._across_windows[precision], prompt

    def _rank_layout(
        self, precision: Precision, levers: Levers, parallel: Parallel, rank: int | None
    ) -> tuple[tuple[int, ...], list[tuple[int, tuple[str, ...]]] | None]:
        """A rank's resident communication buffers, and the ranks (with their optimizer
        shards) to estimate, from the strategy's rule; cached, so a slider move with many
        GPUs walks no parameter list."""
        if not parallel.distributed:
            return (), None
        key = (precision, levers, parallel, rank)
        if key not in self._rank_layouts:
            params = self._trainable_params(precision, levers)
            self._rank_layouts[key] = (
                tuple(parallel.communication_blocks(params)),
                parallel.optimizer_shards(params, rank),
            )
        return self._rank_layouts[key]

    def _fsdp_edits(
        self, timeline: Timeline, precision: Precision, levers: Levers, parallel: Parallel
    ) -> StepEdits:
        """What FSDP2 inserts into one rank's step (``sharding.fsdp_step_edits``): units
        are the repeated blocks (``levers.repeated_blocks``, as ``measure`` wraps them) and
        the root; cached per timeline, so a slider move walks no parameter list."""
        key = (id(timeline), precision, levers, parallel)
        if key in self._step_edits:
            return self._step_edits[key]
        names = self.rows.names
        n_rows = len(names)
        blocks = parallel.fsdp_units
        if blocks is None:
            blocks = repeated_blocks(names[:-2], self.rows.types[:-2])
        row_of = {name: i for i, name in enumerate(names[:-2])}
        unit_rows = [0, *(row_of[b] for b in blocks)]
        unit_of_block = {b: u for u, b in enumerate(blocks, start=1)}
        unit_of_row = np.zeros(n_rows, np.int64)
        for i, name in enumerate(names[:-2]):  # the innermost unit among the row's ancestors
            parts = name.split(".")
            for depth in range(len(parts), 0, -1):
                unit = unit_of_block.get(".".join(parts[:depth]))
                if unit is not None:
                    unit_of_row[i] = unit
                    break
        stepped = {p.name for p in self._trainable_params(precision, levers)}
        # MixedPrecisionPolicy(param_dtype=half, reduce_dtype=fp32) under amp
        gather, reduce = (2, 4) if parallel.param_dtype(precision) else (None, None)
        params = []
        for name, shape in zip(self.param_names, self.param_shapes, strict=True):
            row = row_of.get(name.rpartition(".")[0], 0)
            itemsize = ITEMSIZE[self._grad_dtype(name, precision)]
            unit = int(unit_of_row[row])
            params.append(
                FsdpParam(name, tuple(shape), itemsize, row, unit, name in stepped, gather, reduce)
            )
        grads: list[tuple[int, int, int, int]] = []
        accumulated: list[tuple[int, int, int, int]] = []
        zero_grad: list[tuple[int, int, int, int]] = []
        storage = timeline.event_storage
        cats = timeline.storage_category
        sizes = timeline.storage_bytes.at(1, self.seq_len or 1)
        micro_batches = _micro_batches(timeline)
        gradient = CATEGORY_CODE[Category.GRADIENT]
        if storage is not None:
            k, end = timeline.backward_start, timeline.optimizer_at
            sids, first = np.unique(storage[k:end], return_index=True)
            made = (cats[sids] == gradient) & ~timeline.storage_resident[sids]
            rows = timeline.storage_module[sids]
            grads = [
                (int(sid), int(sizes[sid]), int(row), k + int(at))
                for sid, row, at in zip(sids[made], rows[made], first[made], strict=True)
            ]
            nbytes = timeline.events_at(1, self.seq_len or 1)
            index = np.arange(len(nbytes))
            frees = nbytes < 0

            def freed(mask: np.ndarray) -> list[tuple[int, int, int, int]]:
                at = index[mask]
                rows = timeline.event_module[at]
                return [
                    (int(storage[j]), int(-nbytes[j]), int(row), int(j))
                    for j, row in zip(at, rows, strict=True)
                ]

            # a later micro-batch's gradients, freed once AccumulateGrad added them in
            adds = np.asarray([*("AccumulateGrad" in op for op in timeline.op_names), False])
            later = micro_batches[1][0] if len(micro_batches) > 1 else timeline.optimizer_at
            accumulated = freed(frees & adds[timeline.event_op] & (index >= later) & (index < end))
            # zero_grad's frees of the whole gradients, after the optimizer
            zero_grad = freed(frees & (index >= end) & (cats[storage] == gradient))
        _warn_if_one_unit_holds_most(params, blocks, parallel)
        edits = fsdp_step_edits(
            params,
            unit_rows,
            unit_of_row,
            world_size=parallel.shard_ranks,
            reshard_after_forward=bool(parallel.reshard_after_forward),
            gloo=self.device is Device.CPU,
            event_module=timeline.event_module,
            loss_row=n_rows - 2,
            micro_batches=micro_batches,
            optimizer_at=timeline.optimizer_at,
            gradient_allocs=grads,
            n_rows=n_rows,
            accumulate_frees=accumulated,
            zero_grad_frees=zero_grad,
        )
        self._step_edits[key] = edits
        return edits

    def _fsdp_units(self, units: object) -> tuple[str, ...] | None:
        """``fsdp_units`` resolved against this profile's modules (names given for the
        model as the user has it also match in PEFT's wrapped copy)."""
        names, types = self.rows.names[:-2], self.rows.types[:-2]
        if self.name_prefix and isinstance(units, str | list | tuple):
            items = [units] if isinstance(units, str) else list(units)
            known = set(names) | set(types)
            units = [
                u if not isinstance(u, str) or u in known else self.name_prefix + u for u in items
            ]
        return resolve_fsdp_units(names, types, units)

    def _grad_dtype(self, name: str, precision: Precision) -> str:
        """A parameter's dtype (its gradient's) at ``precision``: half under bf16 / fp16,
        but the parameters kept in their own dtype whatever the precision (PEFT's
        adapters)."""
        if name in self.fixed_param_dtypes:
            return self.fixed_param_dtypes[name]
        half = {Precision.BF16: "bfloat16", Precision.FP16: "float16"}.get(precision)
        return "float32" if half is None else half

    def _trainable_params(self, precision: Precision, levers: Levers) -> list[TrainableParam]:
        """The parameters that get a gradient in a training step with ``levers``, in
        registration order, with their gradients' bytes and dtype at ``precision``."""
        keep = None if levers.trainable is None else set(levers.trainable)
        return [
            TrainableParam(
                name, int(np.prod(shape, dtype=np.int64)), self._grad_dtype(name, precision)
            )
            for name, shape, trains in zip(
                self.param_names, self.param_shapes, self.param_trainable, strict=True
            )
            if trains and (keep is None or name in keep)
        ]

    def max_batch_size(
        self,
        capacity_bytes: int | str | Gpu,
        precision: str | Precision = default("fp32"),
        optimizer: str | OptimizerName | None = default("adam"),
        mode: str | Mode = default("train"),
        *,
        seq_len: int | None = default(None),
        compute_capability: tuple[int, int] | None = default(None),
        limit: int = 2**40,
        basis: str | FitBasis = FitBasis.DEVICE,
        recipe: Recipe | None = None,
        **levers: Any,
    ) -> int:
        """The largest batch whose estimated peak plus accelerator extras fits in
        ``capacity_bytes`` (0 when not even one sample fits), at ``seq_len`` tokens per
        sample where the profile has a sequence axis (None: the example's length).

        Parameters
        ----------
        capacity_bytes : int, str or Gpu
            Bytes (an int, at least 1 MiB: ``max_batch_size(80)`` is refused, not read as
            80 bytes; floats are refused), a string with a unit (``"80GiB"``, ``"80G"``:
            80 * 2**30; ``"24 GB"``: 24 * 10**9) or a GPU name of the catalog
            (``"A100 80GB"``, ``"H100"``): every form of ``gpus.resolve_gpu``, read alike by
            ``MemoryEstimate.fits``, :meth:`max_seq_len`, :meth:`frontier`, :meth:`min_gpus`
            and ``show_memory(gpu=...)``.
        precision, optimizer, mode, seq_len, compute_capability
            As for :meth:`estimate`. Where ``compute_capability`` is not given and the
            capacity names a catalog GPU, that GPU's is used (its cuBLAS workspace), as the
            widget and the CLI do; the same in :meth:`max_seq_len`, :meth:`frontier` and
            :meth:`min_gpus`.
        basis : {"device", "allocated"}
            What "fits" means (``MemoryEstimate.fits``). ``"device"`` (default): the step,
            replayed through the CUDA caching allocator under the capacity less the CUDA
            context, never fails to reserve a segment (fragmentation and segment sizes count,
            as for a real out-of-memory error). ``"allocated"``: ``est.total_bytes``, the
            allocated peak plus the CUDA context, cuBLAS workspace and 512-byte rounding,
            must not pass the capacity. On ``device="cpu"`` both are the allocated basis.
        **levers
            ``checkpoint``, ``trainable``, ``grad_accumulation``: as for :meth:`estimate`
            (the batch is then the micro-batch); ``new_tokens`` with ``mode="generate"``:
            the batch is then the number of sequences generated at once, each a prompt of
            ``seq_len`` tokens and ``new_tokens`` more.
        recipe : Recipe, optional
            The setup as one value (its batch size is the one searched); keywords that
            conflict with it are a ValueError.

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
        >>> b = profile.max_batch_size(2**30, optimizer="adam")
        >>> profile.estimate(b).fits(2**30), profile.estimate(b + 1).fits(2**30)
        (True, False)
        """
        capacity, card = _card(capacity_bytes)
        base = _on_card(
            Recipe.from_keywords(
                recipe,
                precision=precision,
                optimizer=optimizer,
                mode=mode,
                seq_len=seq_len,
                compute_capability=compute_capability,
                **levers,
            ),
            card,
        )

        def at(batch: int) -> MemoryEstimate:
            return self.estimate(recipe=base.with_(batch_size=batch))

        fit_basis = parse_option(FitBasis, basis, "basis")

        def fits(batch: int) -> bool:
            return at(batch).fits(capacity, fit_basis)

        one = at(1)
        _check_above_context(one, capacity)
        if not fits(1):
            return 0
        start = _affine_guess(one, at(2), capacity, limit)
        if fit_basis is FitBasis.DEVICE and one.allocator is not None:
            # The allocated answer first (numpy), then a line through what the replayed
            # allocator reserves at batch 1 and there: reserved bounds the device need from
            # above, so the guess fits and the walk up from it is short.
            allocated = _largest_fitting(lambda b: at(b).total_bytes <= capacity, start, limit)
            start = _reserved_guess(one, at(allocated), capacity, allocated)
        return _largest_fitting(fits, start, limit)

    def min_gpus(
        self,
        capacity_bytes: int | str | Gpu,
        batch_size: int = default(1),
        precision: str | Precision = default("fp32"),
        optimizer: str | OptimizerName | None = default("adam"),
        *,
        strategy: str | Strategy = default("ddp"),
        limit: int = 1024,
        basis: str | FitBasis = FitBasis.DEVICE,
        recipe: Recipe | None = None,
        **settings: Any,
    ) -> int | None:
        """The fewest data-parallel GPUs of ``capacity_bytes`` each on which every rank's
        training step at ``batch_size`` samples per rank fits (on the ``basis`` of
        :meth:`max_batch_size`); None where no number up to ``limit`` does.

        1 is one device, no wrapper. From 2 on, a rank's memory does not grow with the ranks
        (DDP's stays the same: more GPUs never make a DDP step fit; ZeRO's and FSDP2's
        shards shrink), so the search doubles and then bisects (``_largest_fitting``);
        under ``"hsdp"`` past one node it counts whole nodes. ``settings``: any other
        keywords of :meth:`estimate` (``seq_len``, levers, ``compute_capability``,
        ``gpus_per_node``, ``fsdp_units``).

        Examples
        --------
        >>> from torch import nn
        >>> from vram_widget import profile_model
        >>> model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])  # 8 x 16 MiB
        >>> profile = profile_model(model, input_size=(2048,))
        >>> context = profile.estimate(1).extras.cuda_context_bytes
        >>> room = context + 530 * 2**20  # 530 MiB beside the CUDA context
        >>> profile.min_gpus(room, strategy="ddp") is None   # every DDP rank holds it all
        True
        >>> profile.min_gpus(room, strategy="zero1")  # Adam's state split 4 ways fits
        4
        """
        capacity, card = _card(capacity_bytes)
        fit_basis = parse_option(FitBasis, basis, "basis")
        base = _on_card(
            Recipe.from_keywords(
                recipe, batch_size=batch_size, precision=precision, optimizer=optimizer,
                strategy=strategy, **settings,
            ).with_(mode="train", gpus=1),
            card,
        )  # fmt: skip
        # a clear error for a strategy not modelled; hsdp counts whole nodes past one
        per_node = resolve_parallel(
            2, base.parallel.strategy, gpus_per_node=base.parallel.gpus_per_node
        )

        def world(gpus: int) -> int:
            if per_node.strategy is Strategy.HSDP and gpus > per_node.gpus_per_node:
                return -(-gpus // per_node.gpus_per_node) * per_node.gpus_per_node
            return gpus

        def too_small(gpus: int) -> bool:
            est = self.estimate(recipe=base.with_(gpus=world(gpus)))
            return not est.fits(capacity, fit_basis)

        _check_above_context(self.estimate(recipe=base), capacity)
        if not too_small(1):
            return 1
        # the most GPUs that are still too few (a rank's memory never grows with the ranks)
        most = _largest_fitting(too_small, 1, limit)
        return None if most >= limit else world(most + 1)

    def max_seq_len(
        self,
        capacity_bytes: int | str | Gpu,
        batch_size: int = default(1),
        precision: str | Precision = default("fp32"),
        optimizer: str | OptimizerName | None = default("adam"),
        mode: str | Mode = default("train"),
        *,
        compute_capability: tuple[int, int] | None = default(None),
        limit: int = 2**20,
        basis: str | FitBasis = FitBasis.DEVICE,
        recipe: Recipe | None = None,
        **levers: Any,
    ) -> int:
        """The longest sequence whose estimated peak plus accelerator extras fits in
        ``capacity_bytes`` at ``batch_size`` (0 when not even one token fits), "fits" on
        the ``basis`` of :meth:`max_batch_size`. With ``mode="generate"`` and
        ``new_tokens=T`` (in ``levers``): the longest prompt that ``T`` more tokens still
        fit after (the context is the prompt plus ``T``).

        The search is a doubling bracket from the example's length, then bisection (about
        ``2 * log2(answer / seq_len)`` lengths). Where the profile holds memory as a verified
        polynomial in the length (made on the first other length), each is numpy; where
        not, each length tried is profiled once (cached).

        Examples
        --------
        >>> import torch
        >>> from vram_widget import profile_model
        >>> emb = torch.nn.Embedding(100, 16)
        >>> profile = profile_model(emb, inputs=torch.zeros(2, 8, dtype=torch.long), device="cpu")
        >>> n = profile.max_seq_len("64 MiB", batch_size=4, optimizer="sgd")
        >>> profile.estimate(4, optimizer="sgd", seq_len=n).fits(64 * 2**20)
        True
        """
        if not self.has_seq_axis:
            self.check_seq_len(1)  # raises: no sequence axis
        capacity, card = _card(capacity_bytes)
        fit_basis = parse_option(FitBasis, basis, "basis")
        assert self.seq_len is not None
        base = _on_card(
            Recipe.from_keywords(
                recipe, batch_size=batch_size, precision=precision, optimizer=optimizer,
                mode=mode, compute_capability=compute_capability, **levers,
            ),
            card,
        )  # fmt: skip

        def fits(length: int) -> bool:
            return self.estimate(recipe=base.with_(seq_len=length)).fits(capacity, fit_basis)

        _check_above_context(self.estimate(recipe=base.with_(seq_len=None)), capacity)
        if not fits(1):
            return 0
        if self.seq_len_limit is not None:
            limit = min(limit, self.seq_len_limit)
        tokens = base.generation.new_tokens
        if tokens is not None and self.generation_limit is not None:
            limit = min(limit, self.generation_limit - int(tokens))  # prompt + new tokens
        return _largest_fitting(fits, min(self.seq_len, limit), limit)

    def frontier(
        self,
        capacity_bytes: int | str | Gpu,
        precision: str | Precision = default("fp32"),
        optimizer: str | OptimizerName | None = default("adam"),
        mode: str | Mode = default("train"),
        *,
        seq_lens: Sequence[int] | None = None,
        compute_capability: tuple[int, int] | None = default(None),
        profile_lengths: bool = False,
        basis: str | FitBasis = FitBasis.DEVICE,
        recipe: Recipe | None = None,
        **levers: Any,
    ) -> Frontier:
        """The batch x sequence-length frontier: the largest batch that fits
        ``capacity_bytes`` at each sequence length (:meth:`max_batch_size` per length).

        Parameters
        ----------
        capacity_bytes : int, str or Gpu
            As for :meth:`max_batch_size`.
        precision, optimizer, mode, compute_capability
            As for :meth:`estimate`.
        seq_lens : sequence of int, optional
            The lengths; default two per doubling from 1 to the model's position limit (or
            ``DEFAULT_MAX_SEQ_LEN``), plus the example's length.
        profile_lengths : bool
            Where memory is no verified polynomial in the length (padding, windows, kernel
            choices that switch with the length), each length needs a profiling run of its
            own. False (default) leaves those lengths out, except ones already profiled, and
            the result's ``complete`` is False; True profiles each (seconds per length).
        basis : {"device", "allocated"}
            What "fits" means, as for :meth:`max_batch_size`.
        recipe : Recipe, optional
            The setup as one value (its batch size and sequence length are the ones
            searched); keywords that conflict with it are a ValueError.
        **levers
            Any other setting of :meth:`estimate` by its flat name.

        Returns
        -------
        Frontier
            ``seq_lens`` and ``max_batch_sizes`` arrays, ascending in the length.

        Examples
        --------
        >>> import torch
        >>> from vram_widget import profile_model
        >>> emb = torch.nn.Embedding(100, 16)
        >>> profile = profile_model(emb, inputs=torch.zeros(2, 8, dtype=torch.long), device="cpu")
        >>> f = profile.frontier("64 MiB", optimizer="sgd", seq_lens=[8, 64, 512])
        >>> f.seq_lens.tolist()
        [8, 64, 512]
        >>> b = f.max_batch_at(64)
        >>> profile.estimate(b, optimizer="sgd", seq_len=64).fits(64 * 2**20)
        True
        """
        if not self.has_seq_axis:
            self.check_seq_len(1)  # raises: no sequence axis
        assert self.seq_len is not None
        capacity, card = _card(capacity_bytes)
        base = _on_card(
            Recipe.from_keywords(
                recipe, precision=precision, optimizer=optimizer, mode=mode,
                compute_capability=compute_capability, **levers,
            ).with_(batch_size=1, seq_len=None),
            card,
        )  # fmt: skip
        prec, run_mode = base.step.precision, base.step.mode
        if seq_lens is None:
            limit = self.seq_len_limit or DEFAULT_MAX_SEQ_LEN
            lengths = length_grid(limit, extra=[self.seq_len]).tolist()
        else:
            # check_seq_len gives None for the example's own length
            checked = [self.check_seq_len(n) for n in seq_lens]
            lengths = [self.seq_len if n is None else n for n in checked]
        # the example's length, the optimizer
        _check_above_context(self.estimate(recipe=base), capacity)
        lv = base.levers
        # the levers the estimates at each length run (the same resolution as estimate's)
        parallel = self._parallel_of(base)
        resolved = self._step_levers_of(base, parallel, None)
        lora_dtype = _lora_dtype_of(lv)
        if base.float8.enabled:  # the float8 copy's own frontier
            sub, plain = self._float8(base)
            return sub.frontier(
                capacity,
                seq_lens=lengths,
                profile_lengths=profile_lengths,
                basis=basis,
                recipe=plain,
            )
        if base.weights.quantized:  # the quantized copy's own frontier
            check_quantized(base.weights, run_mode, lv.lora_rank, parallel.gpus)
            check_weights_device(base.weights, self.device)
            sub, kwargs = self._quantized(base.weights, resolved, lora_dtype)
            plain = dataclasses.replace(base, levers=LeverSettings(), weights=Weights())
            return sub.frontier(
                capacity,
                seq_lens=lengths,
                profile_lengths=profile_lengths,
                basis=basis,
                recipe=plain.with_(**kwargs),
            )
        if resolved.lora_rank is not None:
            sub, kwargs = self._lora(resolved, lora_dtype)
            return sub.frontier(
                capacity,
                seq_lens=lengths,
                profile_lengths=profile_lengths,
                basis=basis,
                recipe=dataclasses.replace(base, levers=LeverSettings()).with_(**kwargs),
            )
        opt = _optimizer_choice(base)

        def answerable(length: int) -> bool:
            return profile_lengths or self.is_cached(
                prec, run_mode, opt, length, resolved, parallel
            )

        # the first other length makes the fit in the length (runs once), so that
        # ``answerable`` can tell which lengths are numpy from here on
        other = next((n for n in lengths if n != self.seq_len), None)
        if other is not None and not self.is_cached(prec, run_mode, opt, other, resolved, parallel):
            self.timeline(prec, run_mode, other, _step_levers(resolved, run_mode, parallel, prec))
        return batch_seq_frontier(
            lambda length: self.max_batch_size(
                capacity, basis=basis, recipe=base.with_(seq_len=length)
            ),
            lengths,
            capacity,
            answerable,
        )

    def bytes_per_sample(
        self,
        precision: str | Precision = "fp32",
        optimizer: str | OptimizerName | None = "adam",
        mode: str | Mode = "train",
        seq_len: int | None = None,
        **levers: Any,
    ) -> int:
        """How much the peak grows per extra sample, asymptotically (at ``seq_len`` tokens
        per sample where the profile has a sequence axis).

        The peak is a maximum of polynomials in the batch (one per moment of the step),
        so its slope rises with the batch until one moment dominates; this is that final
        slope, read between batch 2**30 and 2**30 + 1.
        """
        big = self.estimate(
            2**30 + 1, precision, optimizer, mode, seq_len=seq_len, **levers
        ).peak_bytes
        small = self.estimate(
            2**30, precision, optimizer, mode, seq_len=seq_len, **levers
        ).peak_bytes
        return int(big) - int(small)


def _step_levers(levers: Levers, mode: Mode, parallel: Parallel, precision: Precision) -> Levers:
    """The levers of the step that is profiled for ``parallel``: FSDP2's
    MixedPrecisionPolicy steps on parameters gathered in half precision under autocast (a
    profile of its own; the shards and their optimizer stay fp32)."""
    cast = parallel.param_dtype(precision) if mode is Mode.TRAIN else None
    return levers if cast is None else dataclasses.replace(levers, param_dtype=cast)


def _profiled(levers: Levers, mode: Mode) -> Levers:
    """The levers of the run that profiles ``levers`` in ``mode`` (none in inference)."""
    return levers.for_profiling() if mode is Mode.TRAIN else NO_LEVERS


def _optimizer_levers(levers: Levers) -> Levers:
    """What the optimizer's trace depends on: which parameters train, and in which
    parameter groups."""
    return Levers(trainable=levers.trainable, decay_groups=levers.decay_groups)


def _scaled_flops(timeline: Timeline, numerator: int, denominator: int) -> Timeline:
    """``timeline`` with its FLOPs (and batch 1's) times ``numerator / denominator``."""

    def scale(poly: Poly) -> Poly:
        return dataclasses.replace(poly, coef=poly.coef // denominator * numerator)

    one = timeline.batch_one
    if one is not None:
        one = _scaled_flops(one, numerator, denominator)
    return dataclasses.replace(
        timeline,
        flops_forward=scale(timeline.flops_forward),
        flops_backward=scale(timeline.flops_backward),
        batch_one=one,
    )


def _micro_batches(timeline: Timeline) -> list[tuple[int, int, int]]:
    """Each micro-batch's (forward start, backward start, backward end) event indices: the
    runs of forward, then backward, events before the optimizer (one pair per micro-batch
    where gradients accumulate)."""
    phases = timeline.event_phase[: timeline.optimizer_at]
    backward = phases == PHASE_CODE[Phase.BACKWARD]
    starts = [0, *(i for i in range(1, len(phases)) if backward[i - 1] and not backward[i])]
    out = []
    for m, f0 in enumerate(starts):
        end = starts[m + 1] if m + 1 < len(starts) else timeline.optimizer_at
        back = np.nonzero(backward[f0:end])[0]
        b0 = f0 + int(back[0]) if len(back) else end
        out.append((f0, b0, end))
    return out


def _warn_if_one_unit_holds_most(
    params: Sequence[FsdpParam], blocks: Sequence[str], parallel: Parallel
) -> None:
    """ZeRO-3 gathers a whole unit at a time: where one unit holds most of the model (no
    repeated blocks found, or units chosen too coarse), the GPUs save little; say so."""
    sizes = [0] * (len(blocks) + 1)
    for p in params:
        sizes[p.unit] += p.itemsize * int(np.prod(p.shape, dtype=np.int64))
    total = sum(sizes)
    if not parallel.reshard_after_forward or total == 0 or max(sizes) * 2 <= total:
        return
    which = "the root (the parameters outside every unit)"
    if sizes.index(max(sizes)):
        which = f"unit {blocks[sizes.index(max(sizes)) - 1]!r}"
    warnings.warn(
        f"{parallel.strategy.value}: {which} holds {max(sizes) / total:.0%} of the "
        "parameters, and each unit is all-gathered whole, so sharding saves little at the "
        "gathers; choose smaller units with fsdp_units=[...] (module or class names)",
        UserWarning,
        stacklevel=4,
    )


def _check_capability(value: tuple[int, int] | None) -> tuple[int, int]:
    if value is None:
        return DEFAULT_COMPUTE_CAPABILITY
    try:
        major, minor = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(
            f"compute_capability must be (major, minor), e.g. (8, 0) for an A100; got {value!r}"
        ) from None
    if major < 1 or minor < 0:
        raise ValueError(f"compute_capability must be (major, minor) >= (1, 0); got {value!r}")
    return major, minor


def _lora_dtype_of(levers: LeverSettings) -> str | None:
    """The adapters' dtype the lever settings ask for (``parse_lora_dtype``), checked; a
    dtype without ``lora_rank`` is refused: there are no adapters to hold it."""
    dtype = parse_lora_dtype(levers.lora_dtype)
    if dtype is not None and levers.lora_rank is None:
        raise ValueError(
            f"lora_dtype={levers.lora_dtype!r} is the LoRA adapters' dtype, but no adapters "
            "are asked for: give lora_rank=... too, or leave lora_dtype at None"
        )
    return dtype


def _optimizer_choice(recipe: Recipe) -> str | None:
    """The recipe's optimizer as ``is_cached`` takes it: ``"adamw"`` or ``"adamw-fused"``."""
    opt = recipe.optimizer
    if opt.name is None:
        return None
    suffix = "" if opt.implementation is None else f"-{opt.implementation.value}"
    return f"{opt.name.value}{suffix}"


def _context_of(acc: Accelerator) -> CudaContext:
    """The CUDA context the Accelerator settings mean: ``context_bytes`` where given, else
    the table's row for the GPU and the module loading (``accelerator.cuda_context``)."""
    if acc.context_bytes is not None:
        return given_cuda_context(acc.context_bytes)
    capability = _check_capability(acc.compute_capability)
    if not isinstance(acc.lazy_loading, bool):
        raise ValueError(
            f"lazy_loading must be True (CUDA_MODULE_LOADING=LAZY, torch's default) or False "
            f"(eager loading); got {acc.lazy_loading!r}"
        )
    return cuda_context(capability, acc.lazy_loading)


# torchao's low-bit Adam compiles each parameter's update (torchao/optim/adam.py,
# ``_AdamBase.step``: ``torch.compile(single_param_adam, fullgraph=True, dynamic=False)``);
# the profiler traces it uncompiled, so its state is exact and its step's temporaries are
# the eager ops', not Inductor's buffers (on the CPU the real step peaked 6.4 MB below the
# estimate with AdamW8bit and 0.8 MB above it with AdamW4bit, a zoo MLP at batch 4).
_COMPILED_OPTIMIZERS = ("adamw8bit-torchao", "adamw4bit-torchao")


def _unmodelled_step(recipe: Recipe) -> tuple[str, ...]:
    """What the asked step runs that the estimate does not model, by name."""
    outliers = int8_outlier_note(recipe.weights)
    if outliers:
        return (outliers,)
    name = recipe.optimizer.name
    if recipe.step.mode is Mode.TRAIN and name is not None and name.value in _COMPILED_OPTIMIZERS:
        return (
            f"optimizer={name.value!r}: its step is compiled by torch.compile, and only its "
            "state is estimated exactly (the step's temporaries are the uncompiled ops')",
        )
    return ()


def _card(capacity_bytes: Any) -> tuple[int, tuple[int, int] | None]:
    """The bytes of a capacity in any form (``gpus.resolve_gpu``) and, where it names a
    catalog GPU, that GPU's compute capability (its cuBLAS workspace, as the widget and the
    command line take it); None for a bare capacity."""
    gpu = resolve_gpu(capacity_bytes)
    return gpu.memory_bytes, gpu.compute_capability


def _on_card(recipe: Recipe, card: tuple[int, int] | None) -> Recipe:
    """``recipe`` on a named GPU: its compute capability where the recipe gives none."""
    if card is None or recipe.accelerator.compute_capability is not None:
        return recipe
    return recipe.with_(compute_capability=card)


def _check_above_context(est: MemoryEstimate, capacity: int) -> None:
    """A capacity that the CUDA context alone fills leaves the allocator nothing: refused,
    rather than "0 samples fit", which reads as a property of the model."""
    context = est.extras.cuda_context_bytes
    if capacity <= context:
        raise ValueError(
            f"a capacity of {capacity:,} bytes ({capacity / 2**30:.3g} GiB) is not above the "
            f"CUDA context alone ({context:,} bytes, {context / 2**30:.3g} GiB, outside the "
            "caching allocator): give the card's whole memory, as bytes, a string with a unit "
            '("24 GB", "80GiB") or a GPU name ("A100 80GB")'
        )


def _affine_guess(one: MemoryEstimate, two: MemoryEstimate, capacity_bytes: int, limit: int) -> int:
    """Where the search starts: live bytes after each event are mostly affine in the batch
    (``a + b * batch``), so the estimates at 1 and 2 give every event's line and the batch
    where the first one crosses the capacity (less the extras at batch 1). Allocator rounding
    and interpolated CPU workspaces move the true answer by a few samples at most; a step
    quadratic in the batch (a loss over every pair) by more, which the search then walks."""
    if len(one.live_bytes) != len(two.live_bytes) or not len(one.live_bytes):
        return 1
    slope = np.append(
        two.live_bytes.astype(np.float64) - one.live_bytes, two.peak_bytes - one.peak_bytes
    )
    intercept = np.append(one.live_bytes.astype(np.float64), one.peak_bytes) - slope
    room = capacity_bytes - (one.total_bytes - one.peak_bytes)
    grows = slope > 0
    if not grows.any():
        return limit
    guess = np.floor(np.min((room - intercept[grows]) / slope[grows]))
    return int(min(max(1.0, guess), limit))


def _reserved_guess(
    one: MemoryEstimate, there: MemoryEstimate, capacity_bytes: int, batch: int
) -> int:
    """Where the device-basis search starts: the batch where a line through the reserved
    memory (plus the CUDA context) at batch 1 and at ``batch`` meets the capacity."""
    if one.allocator is None or there.allocator is None or batch <= 1:
        return max(1, batch)
    context = one.extras.cuda_context_bytes
    need_one = one.allocator.peak_reserved_bytes + context
    need_there = there.allocator.peak_reserved_bytes + context
    slope = (need_there - need_one) / (batch - 1)
    if slope <= 0:
        return batch
    return max(1, min(batch, 1 + int((capacity_bytes - need_one) // slope)))


def _largest_fitting(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """The largest batch in [1, limit] that fits, given that batch 1 fits and that fitting is
    monotone (the peak is a maximum of polynomials in the batch, none decreasing): the
    bracket grows by doubling steps from ``start`` in the direction that holds the boundary,
    then is bisected.
    A good ``start`` (the affine guess) answers in two or three estimates."""
    start = min(max(1, start), limit)
    if fits(start):
        lo, step = start, 1
        while True:
            hi = min(lo + step, limit)
            if hi == lo:
                return lo  # the limit fits
            if not fits(hi):
                break
            lo, step = hi, step * 2
    else:
        hi, step = start, 1
        lo = max(start - 1, 1)
        while lo > 1 and not fits(lo):
            hi, step = lo, step * 2
            lo = max(start - step, 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _tensor_parallel_question(recipe: Recipe) -> Recipe:
    """The single-rank Recipe a ``tp`` > 1 estimate profiles (its layout and settings
    checked first, each refusal a ValueError naming it)."""
    check_tensor_parallel(recipe.parallel)
    check_tensor_parallel_settings(recipe)
    return recipe.with_(tp=1, tp_plan=None, gpus=1, rank=None)
