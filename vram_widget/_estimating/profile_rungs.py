"""The rungs of the ladder a profile answers from a sub-profile its source makes: LoRA's
adapters, quantized weights, float8 training, one tensor-parallel rank, the pipeline's
stages; and the bytes of loading the model. No torch here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .communication import volume_of
from .decoding import check_generation
from .estimator import MemoryEstimate
from .float8 import (
    FLOAT8_ALL_GATHER_CUDA_NOTE,
    check_float8,
    check_float8_layout,
    float8_all_gather_refusals,
)
from .kv_cache import check_quantized_cache
from .levers import Levers
from .loading import LOAD_DTYPES, LoadEstimate, load_estimate
from .options import (
    Mode,
    Precision,
    Strategy,
)
from .quantized import check_weights_device
from .recipe import Recipe
from .recipe.float8 import Float8
from .recipe.generation import Generation
from .recipe.parallel import (
    check_context_parallel,
    check_expert_parallel,
    check_tensor_parallel,
    check_tensor_parallel_settings,
    context_parallel_refusals,
    parallel_refusals,
    tensor_parallel_hsdp,
)
from .recipe.pipeline import (
    check_pipeline_parallel,
    check_pipeline_parallel_settings,
    pipeline_checkpoint_layers,
    stage_question,
)
from .recipe.recipe import default
from .recipe.weights import Weights
from .sharding import check_rank

if TYPE_CHECKING:
    from .profile import ModelProfile


class RungsMixin:
    """The rungs of :class:`~.profile.ModelProfile` that need a profile of their own (LoRA,
    quantized weights, float8, tensor and pipeline parallelism) and the load estimate
    (``self`` is the profile)."""

    def _lora(  # type: ignore[misc]
        self: ModelProfile, levers: Levers, dtype: str | None = None
    ) -> tuple[ModelProfile, dict[str, Any]]:
        """The LoRA profile of ``levers`` with the adapters in ``dtype``
        (``parse_lora_dtype``; made on first use, one per dtype) and the levers to ask it
        for: checkpointing by the same names inside PEFT's wrapper, accumulation as it is."""
        assert levers.lora_rank is not None
        key = (levers.lora_rank, levers.lora_targets, dtype)
        if key not in self._lora_profiles:
            self._lora_profiles[key] = self._source.lora_profile(*key)
        return self._lora_profiles[key], self._lora_levers(levers)

    def _lora_levers(self: ModelProfile, levers: Levers) -> dict[str, Any]:  # type: ignore[misc]
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

    def _quantized(  # type: ignore[misc]
        self: ModelProfile, weights: Weights, levers: Levers, lora_dtype: str | None
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

    def _kv_cache(  # type: ignore[misc]
        self: ModelProfile, recipe: Recipe, make: bool = True
    ) -> tuple[ModelProfile | None, Recipe]:
        """The profile of a meta copy of the model whose generation config asks for the
        recipe's KV cache (made on first use, cached per setting; refused by name before
        any profiling where the generation is not estimated: ``kv_cache.py``) and the recipe
        to ask it: the same, with the model's own cache setting (now the copy's). With
        ``make=False``, None where it is not made yet (nothing is profiled)."""
        gen = recipe.generation
        mode = recipe.step.mode
        if mode is not Mode.GENERATE:
            raise ValueError(
                f"kv_cache={gen.kv_cache.value if gen.kv_cache else None!r} is the KV cache of "
                f"mode='generate'; got mode={mode.value!r}"
            )
        name = self.model_name or "the model"
        prompt = self.seq_len if recipe.step.seq_len is None else recipe.step.seq_len
        tokens = check_generation(
            name, self.generates, self.generation_limit, prompt, gen.new_tokens
        )
        check_quantized_cache(name, gen.cache_config(), tokens)
        key = dataclasses.replace(gen, new_tokens=None)
        if key not in self._kv_cache_profiles and make:
            self._kv_cache_profiles[key] = self._source.kv_cache_profile(gen.cache_config())
        plain = dataclasses.replace(recipe, generation=Generation(new_tokens=tokens))
        return self._kv_cache_profiles.get(key), plain

    def _float8(self: ModelProfile, recipe: Recipe) -> tuple[ModelProfile, Recipe]:  # type: ignore[misc]
        """The profile of the model converted to float8 training by torchao (made on first
        use, cached per setting; refused by name before any profiling where the step is not
        estimated) and the recipe to ask it: the same, float8 off (the copy has the same
        module names, so the levers apply as they are)."""
        float8 = recipe.float8
        self._check_float8(recipe)
        if float8 not in self._float8_profiles:
            self._float8_profiles[float8] = self._source.float8_profile(float8)
        return self._float8_profiles[float8], dataclasses.replace(recipe, float8=Float8())

    def _check_float8(self: ModelProfile, recipe: Recipe) -> None:  # type: ignore[misc]
        """Refuse, before any profiling, the float8 steps that are not estimated."""
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
        par = recipe.parallel
        layouts = {"tp": par.tp, "pp": par.pp, "ep": par.ep, "cp": par.cp}
        check_float8_layout(float8, par.gpus, par.strategy.value, layouts)

    def _float8_all_gather_estimate(self: ModelProfile, recipe: Recipe) -> MemoryEstimate:  # type: ignore[misc]
        """``float8_all_gather=True`` on FSDP2: the rank's peak and bytes sent from its step
        as torchao and FSDP2 run it on fake tensors (``_source.float8_fsdp_step``); the rest
        of the estimate (per-layer rows, FLOPs, the breakdown and where the peak is) is the
        float8 profile under FSDP2 with the high-precision gather, for reference, as for a
        pipeline. Refused by name, before any run, where the step is not estimated
        (:func:`~.float8.float8_all_gather_refusals`).

        On ``device="cuda"`` (UNCONFIRMED on a GPU) the rank runs torchao's ``_scaled_mm``
        path with CUDA's kernel choices, and the allocator's 512-byte rounding at its peak
        is the rank's own (``extras.allocator_rounding_bytes``: its peak of blocks less its
        peak of bytes); the cuBLAS workspaces, CUDA context and NCCL buffers are the
        reference's. The rank's allocation stream is not kept, so nothing is replayed:
        ``allocated_bytes``, ``reserved_bytes`` and ``device_bytes`` are None, and a
        capacity is compared with ``total_bytes``, the allocated basis."""
        high, asked = self._float8_all_gather_question(recipe)
        whole = self._estimate(high)
        ran = self._source.float8_fsdp_step(*asked)
        sent = volume_of(ran.collectives)
        extras, described = whole.extras, recipe.float8.describe()
        if ran.block_peak_bytes is not None:  # a CUDA rank
            extras = dataclasses.replace(
                extras, allocator_rounding_bytes=max(0, ran.block_peak_bytes - ran.peak_bytes)
            )
            described += FLOAT8_ALL_GATHER_CUDA_NOTE
        return dataclasses.replace(
            whole,
            peak_bytes=ran.peak_bytes,
            extras=extras,
            # the reference's allocation stream is not the rank's: no allocator replay
            event_storage=None,
            communication_sent_bytes=sent.sent_bytes,
            communication_sent_bytes_by_kind=sent.sent_bytes_by_kind,
            float8=described,
        )

    def _float8_all_gather_question(  # type: ignore[misc]
        self: ModelProfile, recipe: Recipe
    ) -> tuple[Recipe, tuple[Any, ...]]:
        """The checks of a ``float8_all_gather=True`` estimate (each refusal a ValueError
        naming it, before any run); the same recipe with the high-precision gather (the
        reference the rank's run replaces the peak of) and the arguments of the source's
        ``float8_fsdp_step``."""
        float8 = recipe.float8
        self._check_float8(recipe)
        refused = float8_all_gather_refusals(recipe)
        if refused:
            raise ValueError(
                f"float8_all_gather=True with {', '.join(refused)}: not estimated yet (the "
                "rank's step is run for the training step with batch_size, seq_len, "
                "precision, optimizer and its implementation, checkpoint (the whole "
                "modules), grad_accumulation, gpus, strategy 'zero2', 'zero3' or 'hsdp', "
                "gpus_per_node, fsdp_units, rank); float8_all_gather=False (torchao's "
                "default) is estimated with all of these"
            )
        high = dataclasses.replace(recipe, float8=dataclasses.replace(float8, all_gather=False))
        parallel = self._parallel_of(recipe)
        rank = check_rank(recipe.parallel.rank, parallel.gpus)
        step, lv = recipe.step, recipe.levers
        levers = self.levers(checkpoint=lv.checkpoint, grad_accumulation=lv.grad_accumulation)
        implementation = recipe.optimizer.resolved_implementation(self.device)
        asked = (
            float8, parallel, step.batch_size, step.seq_len, step.precision,
            recipe.optimizer.name, implementation, 0 if rank is None else rank, levers,
        )  # fmt: skip
        return high, asked

    def _made_lora(self: ModelProfile, levers: Levers) -> tuple[ModelProfile, Levers] | None:  # type: ignore[misc]
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

    def load_bytes(  # type: ignore[misc]
        self: ModelProfile,
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
            bitsandbytes' quantization of the Linear weights, or torchao's
            ``"int8-torchao"`` / ``"int4-torchao"`` (``quantize_`` on the loaded model; int4
            on ``device="cpu"`` only), as ``estimate`` takes it; ``"nf4-torchao"``:
            torchtune's ``FrozenNF4Linear`` in place of each quantized Linear, its weight
            the ``NF4Tensor`` torchao's ``to_nf4`` makes (no LoRA adapters: they are not
            part of the load, as with the other formats).

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
            check_weights_device(asked.weights, self.device)
        dtype = LOAD_DTYPES[asked.step.precision]
        key = (dtype, asked.weights)
        if key not in self._load_layouts:
            self._load_layouts[key] = self._source.load_layout(dtype, asked.weights)
        return load_estimate(
            self._load_layouts[key], asked.step.precision, asked.weights, self.device
        )

    def load_is_cached(  # type: ignore[misc]
        self: ModelProfile,
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

    def tensor_parallel_refusal(self: ModelProfile, tp: int = 2) -> str | None:  # type: ignore[misc]
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

    def pipeline_parallel_refusal(  # type: ignore[misc]
        self: ModelProfile, pp: int = 2, stages_per_rank: int = 1, tp: int = 1
    ) -> str | None:
        """Why this model cannot be split into ``pp`` pipeline ranks of ``stages_per_rank``
        stages each, with ``tp`` > 1 each stage sharded by the model's own plan over ``tp``
        ranks (not a Hugging Face decoder, ``pp`` not dividing its layers, too few layers
        for the stages, inputs other than ids and labels, no plan or ``tp`` not dividing what
        it shards, a profile not made with ``device="cpu"``), or None; checked without
        profiling.

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> profile = profile_model(zoo.mlp(4, hidden=(8,)), input_size=(4,), device="cpu")
        >>> "splits a Hugging Face decoder" in profile.pipeline_parallel_refusal(2)
        True
        """
        return self._source.pipeline_parallel_refusal(pp, stages_per_rank, tp)

    def expert_parallel_refusal(self: ModelProfile, ep: int = 2) -> str | None:  # type: ignore[misc]
        """Why this model's experts cannot be split over ``ep`` ranks by its own plan (it
        has no experts, or ``ep`` does not divide their number), or None; checked without
        profiling.

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> profile = profile_model(zoo.mlp(4, hidden=(8,)), input_size=(4,), device="cpu")
        >>> "has no experts to split" in profile.expert_parallel_refusal(2)
        True
        """
        return self._source.expert_parallel_refusal(ep)

    def context_parallel_refusal(self: ModelProfile) -> str | None:  # type: ignore[misc]
        """Why this model or its inputs cannot run torch's ring attention over
        context-parallel ranks (a ``device="cpu"`` profile, attention other than SDPA, a
        mask input), or None; checked without profiling (the layout and the sequence length
        are :meth:`estimate`'s to check).

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> profile = profile_model(zoo.mlp(4, hidden=(8,)), input_size=(4,), device="cpu")
        >>> "device='cuda' profiles only" in profile.context_parallel_refusal()
        True
        """
        return self._source.context_parallel_refusal()

    def tensor_parallel_cached(self: ModelProfile, batch_size: int = 1, **settings: Any) -> bool:  # type: ignore[misc]
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

    def _pipeline_estimate(self: ModelProfile, recipe: Recipe) -> MemoryEstimate:  # type: ignore[misc]
        """``pp > 1``: each stage's peak from its step as the schedule runs it; the rest of
        the estimate (per-layer rows, FLOPs, breakdown) is the whole model's one-device
        step at the same batch, for reference."""
        par, step = recipe.parallel, recipe.step
        check_pipeline_parallel(par, step.batch_size)
        check_pipeline_parallel_settings(recipe)
        lv = recipe.levers
        asked = self.levers(checkpoint=lv.checkpoint, checkpoint_policy=lv.checkpoint_policy)
        checkpoint = pipeline_checkpoint_layers(asked.checkpoint, self.rows.names)
        question = stage_question(recipe, checkpoint)
        dp = question.dp
        rank = check_rank(par.rank, par.gpus)
        stages = self._source.pipeline_stage_peaks(question)
        whole = self._estimate(
            recipe.with_(gpus=1, pp=1, pp_schedule="gpipe", microbatches=None, pp_split=None,
                         stages_per_rank=None, strategy="ddp", rank=None, tp=1, tp_plan=None)
        )  # fmt: skip
        # rank r of the (pp, [dp_replicate,] dp_shard, tp) mesh holds stage r // (dp x tp)
        # (pipeline_parallel._meshes); its data-parallel ranks hold the same bytes (FSDP2
        # pads every shard to rank 0's size), as do its tensor-parallel ranks (the plan's
        # shards are even: resolve_plan checks tp divides)
        worst = (
            max(stages, key=lambda s: s.peak_bytes)
            if rank is None
            else stages[rank // (dp * par.tp)]
        )
        # what each stage's rank sends: the estimate's is the stage that sends most
        sent = max((volume_of(s.collectives) for s in stages), key=lambda v: v.sent_bytes)
        return dataclasses.replace(
            whole,
            communication_sent_bytes=sent.sent_bytes,
            communication_sent_bytes_by_kind=sent.sent_bytes_by_kind,
            peak_bytes=worst.peak_bytes,
            parameter_bytes=worst.parameter_bytes,
            gpus=par.gpus,
            strategy=par.strategy if dp > 1 else None,
            rank=rank,
            pp=par.pp,
            tp=par.tp,
            pp_schedule=par.pp_schedule.value,
            microbatches=question.microbatches,
            stages_per_rank=question.stages_per_rank,
            stage_peak_bytes=tuple(s.peak_bytes for s in stages),
            stage_resident_bytes=tuple(s.resident_bytes for s in stages),
        )


def _expert_parallel_question(recipe: Recipe) -> Recipe:
    """The single-rank Recipe an ``ep`` > 1 estimate profiles (its layout and settings
    checked first, each refusal a ValueError naming it: the settings not checked against
    real ranks are those ``tp`` refuses)."""
    check_expert_parallel(recipe.parallel)
    refused = parallel_refusals(recipe)
    if refused:
        raise ValueError(
            f"ep={recipe.parallel.ep} with {', '.join(refused)}: not estimated with expert "
            "parallelism yet; leave ep at 1 for these"
        )
    return recipe.with_(ep=1, gpus=1, rank=None)


def _context_parallel_question(recipe: Recipe, seq_len: int | None) -> Recipe:
    """The single-rank Recipe a ``cp`` > 1 estimate profiles at its own (local) length,
    ``seq_len`` being the whole sequence's (its layout and settings checked first, each
    refusal a ValueError naming it)."""
    check_context_parallel(recipe.parallel, seq_len)
    if seq_len is None:
        raise ValueError(
            f"cp={recipe.parallel.cp}: context parallelism shards the sequence, and this "
            "profile has no sequence axis; profile token inputs (or give seq_axis=...)"
        )
    refused = context_parallel_refusals(recipe)
    if refused:
        raise ValueError(
            f"cp={recipe.parallel.cp} with {', '.join(refused)}: not estimated with context "
            "parallelism yet (trainable, grad_accumulation and every precision are); leave "
            "cp at 1 for these"
        )
    return recipe.with_(cp=1, gpus=1, rank=None, seq_len=None)


def _tensor_parallel_question(recipe: Recipe) -> Recipe:
    """The Recipe a ``tp`` > 1 estimate asks of one tensor-parallel rank's sub-profile (its
    layout and settings checked first, each refusal a ValueError naming it): one device,
    or with ``gpus = dp x tp`` (dp > 1), FSDP2 over ``dp`` data-parallel ranks of that
    sub-profile. FSDP2 applied after tensor parallelism shards each DTensor parameter's
    local tensor (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: ``_init_sharding_spec_tp``
    returns ``param._local_tensor``, which ``_init_sharded_param`` chunks on dim 0 over the
    dp_shard ranks with ``_chunk_with_empty``, rank 0's chunk padded), so FSDP2's rules
    (``sharding.fsdp_step_edits``) over the tp rank's local parameters (the sub-profile's
    parameter shapes are the local ones) are the rank's layout."""
    check_tensor_parallel(recipe.parallel)
    check_tensor_parallel_settings(recipe)
    par = recipe.parallel
    dp = par.gpus // par.tp
    # rank r of the (dp_shard, tp) mesh, tp the inner dimension (tensor_parallel.rank_setup),
    # is data-parallel rank r // tp; every tp rank of a group holds the same bytes
    rank = check_rank(par.rank, par.gpus)
    dp_rank = None if rank is None or dp == 1 else rank // par.tp
    if par.strategy is Strategy.HSDP and dp > 1:
        # hsdp on the (dp_replicate, dp_shard, tp) mesh: the data-parallel ranks' 2-D mesh
        # (dp_replicate, dp_shard) is plain hsdp's (replicate, shard) over a "node" of
        # dp_shard ranks, and rank r // tp is its rank there (node-major, as plain hsdp's)
        _replicate, shard = tensor_parallel_hsdp(par)
        return recipe.with_(tp=1, tp_plan=None, gpus=dp, rank=dp_rank, gpus_per_node=shard)
    return recipe.with_(tp=1, tp_plan=None, gpus=dp, rank=dp_rank)
