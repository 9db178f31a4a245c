"""The estimate of one step from a profile: the levers and parallel layout a Recipe asks for
resolved to the model, the timeline they need, one rank's layout (FSDP's edits), and
generation's timelines; numpy arithmetic over the cached timelines. No torch here.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .accelerator import CudaContext, cuda_context, given_cuda_context
from .chunked_loss import chunked_loss_levers
from .compiled import CompileScope, check_compile_parallel, compile_levers, decided_at
from .decoding import (
    DECODE_STEPS_ACROSS_WINDOW,
    PROMPT_BEFORE_WINDOW,
    STATIC_CACHE_TOKENS,
    at_new_tokens,
    check_generation,
    crosses_window,
)
from .estimator import DEFAULT_COMPUTE_CAPABILITY, MemoryEstimate, estimate
from .float8 import check_float8, check_float8_layout
from .kv_cache import check_quantized_cache, decode_steps_across_flush
from .levers import NO_LEVERS, Levers, parse_lora_dtype, repeated_blocks
from .offloading import offload_levers
from .options import (
    CATEGORY_CODE,
    PHASE_CODE,
    Category,
    Device,
    Mode,
    OptimizerName,
    Phase,
    Precision,
    Strategy,
)
from .profile_rungs import (
    _context_parallel_question,
    _expert_parallel_question,
    _tensor_parallel_question,
)
from .quantized import check_quantized, check_weights_device, int8_outlier_note
from .recipe import Accelerator, LeverSettings, Recipe
from .recipe.float8 import Float8
from .recipe.weights import Weights
from .sharding import (
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
from .table import OptimizerTrace, Poly, Timeline

if TYPE_CHECKING:
    from .profile import ModelProfile


class StepMixin:
    """The one-step estimate of :class:`~.profile.ModelProfile` (``self`` is the profile)."""

    def _parallel_of(self: ModelProfile, recipe: Recipe) -> Parallel:  # type: ignore[misc]
        """The data parallelism a Recipe asks for, its FSDP units resolved to this model."""
        par = recipe.parallel
        parallel = resolve_parallel(par.gpus, par.strategy, gpus_per_node=par.gpus_per_node)
        if par.fsdp_units is None:
            return parallel
        return dataclasses.replace(parallel, fsdp_units=self._fsdp_units(par.fsdp_units))

    def _step_levers_of(  # type: ignore[misc]
        self: ModelProfile, recipe: Recipe, parallel: Parallel, length: int | None
    ) -> Levers:
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
        levers = compile_levers(levers, lv.compile, lv.activation_memory_budget, run_mode, parallel)
        if levers.compile is not None and parallel.distributed:
            scope = CompileScope(levers.compile)
            check_compile_parallel(scope, parallel, precision=recipe.step.precision)
            if self.compile_fsdp_refusal:
                raise ValueError(
                    f"compile={scope.value!r} with strategy={parallel.strategy.value!r}: "
                    f"{self.compile_fsdp_refusal}; leave compile=None for this model, or "
                    "estimate it on one device (gpus=1)"
                )
        return levers

    def _estimate(self: ModelProfile, recipe: Recipe) -> MemoryEstimate:  # type: ignore[misc]
        """:meth:`estimate` of one resolved Recipe."""
        if recipe.generation.kv_cache is not None:  # the copy whose generate asks for it
            sub, plain = self._kv_cache(recipe)
            assert sub is not None  # made
            return sub._estimate(plain)
        if recipe.float8.all_gather:  # one FSDP2 rank's step run as it is (profile_rungs.py)
            return self._float8_all_gather_estimate(recipe)
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
        if (
            par.cp > 1
        ):  # one rank's sub-profile at seq_len / cp, ring attention (context_parallel.py)
            whole = seq_len if seq_len is not None else self.seq_len
            plain = _context_parallel_question(recipe, whole)
            assert whole is not None  # checked: a profile without a sequence axis is refused
            est = self._source.context_parallel_estimate(par.cp, whole, plain)
            return dataclasses.replace(est, gpus=par.gpus, cp=par.cp, seq_len=whole)
        if par.ep > 1:  # one rank's sub-profiles, experts sharded (expert_parallel.py)
            plain = _expert_parallel_question(recipe)
            est = self._source.expert_parallel_estimate(par.ep, plain)
            return dataclasses.replace(est, gpus=par.gpus, ep=par.ep)
        pipeline = (par.microbatches, par.pp_split, par.stages_per_rank)
        if par.pp > 1 or any(x is not None for x in pipeline):
            return self._pipeline_estimate(recipe)
        if par.tp > 1:  # one rank's sub-profile under DTensor (tensor_parallel.py)
            plain = _tensor_parallel_question(recipe)
            est = self._source.tensor_parallel_estimate(par.tp, par.tp_plan, plain)
            # the asked rank of the world; unasked, rank 0 of dp rank 0's group (the worst)
            rank = est.rank if par.rank is None or plain.parallel.gpus == 1 else par.rank
            return dataclasses.replace(est, gpus=par.gpus, tp=par.tp, rank=rank)
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
        elif tokens is not None and self._flush_steps(tokens) is not None:
            timeline = self._across_flush_timeline(prec, length, tokens)
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

    def weights_cached(  # type: ignore[misc]
        self: ModelProfile, batch_size: int = 1, recipe: Recipe | None = None, **keywords: Any
    ) -> bool:
        """Whether :meth:`estimate` with these arguments needs no further profiling run for
        its quantized weights (``weights=``), float8 training (``float8=``) or quantized KV
        cache (``kv_cache=``): the sub-profile of that setting is made and holds the step.
        With none, whether the step itself is in this profile (as :meth:`is_cached` says).
        A question the estimate refuses raises its ValueError.

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> p = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
        >>> p.weights_cached(4, mode="inference", weights="nf4")
        False
        >>> _ = p.estimate(4, mode="inference", weights="nf4")  # makes the sub-profile
        >>> p.weights_cached(64, mode="inference", weights="nf4")
        True
        """
        asked = Recipe.from_keywords(recipe, batch_size=batch_size, **keywords)
        if asked.generation.kv_cache is not None:  # the copy whose generate asks for it
            sub, plain = self._kv_cache(asked, make=False)
            return sub is not None and sub.weights_cached(batch_size, recipe=plain)
        if asked.float8.all_gather:  # the reference's sub-profile, and the rank's run kept
            high, question = self._float8_all_gather_question(asked)
            return self.weights_cached(batch_size, recipe=high) and self._source.float8_fsdp_cached(
                *question
            )
        if asked.float8.enabled:
            check_float8(
                asked.float8,
                asked.step.mode,
                asked.step.precision,
                asked.weights,
                asked.levers.lora_rank,
                asked.parallel.gpus,
                asked.levers.compile,
            )
            par = asked.parallel
            layouts = {"tp": par.tp, "pp": par.pp, "ep": par.ep, "cp": par.cp}
            check_float8_layout(asked.float8, par.gpus, par.strategy.value, layouts)
            sub = self._float8_profiles.get(asked.float8)
            return sub is not None and sub._step_cached(dataclasses.replace(asked, float8=Float8()))
        if not asked.weights.quantized:
            return self._step_cached(asked)
        parallel = self._parallel_of(asked)
        check_quantized(asked.weights, asked.step.mode, asked.levers.lora_rank, parallel.gpus)
        check_weights_device(asked.weights, self.device)
        length = self.check_seq_len(asked.step.seq_len)
        levers = decided_at(self._step_levers_of(asked, parallel, length), batch_size)
        lora_dtype = _lora_dtype_of(asked.levers)
        targets = levers.lora_targets if levers.lora_rank is not None else None
        if (asked.weights, levers.lora_rank, targets, lora_dtype) not in self._quantized_profiles:
            return False
        sub, kwargs = self._quantized(asked.weights, levers, lora_dtype)
        plain = dataclasses.replace(asked, levers=LeverSettings(), weights=Weights())
        return sub._step_cached(plain.with_(**kwargs))

    def _step_cached(self: ModelProfile, recipe: Recipe) -> bool:  # type: ignore[misc]
        """Whether the step of a Recipe with neither quantized weights nor float8 is in
        this profile (:meth:`is_cached` of its resolved levers)."""
        parallel = self._parallel_of(recipe)
        step = recipe.step
        length = self.check_seq_len(step.seq_len)
        levers = decided_at(self._step_levers_of(recipe, parallel, length), step.batch_size)
        name = recipe.optimizer.name
        impl = recipe.optimizer.implementation
        optimizer: object = name
        if isinstance(name, OptimizerName) and impl is not None:
            optimizer = f"{name.value}-{impl.value}"
        return self.is_cached(
            step.precision,
            step.mode,
            optimizer,  # type: ignore[arg-type]
            step.seq_len,
            levers,
            parallel,
            recipe.generation.new_tokens,
            batch_size=step.batch_size,
        )

    def _check_new_tokens(  # type: ignore[misc]
        self: ModelProfile, mode: Mode, new_tokens: object, seq_len: int | None
    ) -> int | None:
        """``new_tokens`` checked against the mode, the model and its position limit."""
        if mode is not Mode.GENERATE:
            if new_tokens is not None:
                raise ValueError(f"new_tokens is for mode='generate'; got mode={mode.value!r}")
            return None
        prompt = self.seq_len if seq_len is None else seq_len
        name = self.model_name or "the model"
        tokens = check_generation(name, self.generates, self.generation_limit, prompt, new_tokens)
        if self.cache_implementation == "quantized":
            # transformers' QuantizedCache: estimated between two of its flushes (kv_cache.py)
            check_quantized_cache(name, dict(self.cache_config), tokens)
            return tokens
        if self.cache_implementation not in (None, "static"):
            raise ValueError(
                f"{name}'s generation_config.cache_implementation="
                f"{self.cache_implementation!r} is not estimated yet (the default dynamic "
                "cache and 'static' are); measure(model, inputs, mode='generate', "
                "new_tokens=T) measures it"
            )
        return tokens

    def _static_cache_timeline(  # type: ignore[misc]
        self: ModelProfile, precision: Precision, seq_len: int | None, new_tokens: int
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

    def _flush_steps(self: ModelProfile, new_tokens: int) -> int | None:  # type: ignore[misc]
        """The decode steps a generation of ``new_tokens`` with this profile's quantized
        cache is recorded through where it crosses a flush (``kv_cache.py``); None where the
        profile's own recorded steps and their pattern answer it."""
        if self.cache_implementation != "quantized":
            return None
        return decode_steps_across_flush(dict(self.cache_config), new_tokens)

    def _across_flush_timeline(  # type: ignore[misc]
        self: ModelProfile, precision: Precision, seq_len: int | None, new_tokens: int
    ) -> Timeline:
        """The generation with the quantized cache recorded through all its decode steps,
        flushes included (once per precision, prompt length and new tokens)."""
        steps = self._flush_steps(new_tokens)
        assert steps is not None
        key = (precision, seq_len, steps)
        if key not in self._across_flushes:
            self._across_flushes[key] = self._source.generation(
                precision, seq_len, decode_steps=steps
            )
        return self._across_flushes[key]

    def _across_window(self: ModelProfile, precision: Precision) -> tuple[Timeline, int]:  # type: ignore[misc]
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

    def _rank_layout(  # type: ignore[misc]
        self: ModelProfile,
        precision: Precision,
        levers: Levers,
        parallel: Parallel,
        rank: int | None,
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

    def _fsdp_edits(  # type: ignore[misc]
        self: ModelProfile,
        timeline: Timeline,
        precision: Precision,
        levers: Levers,
        parallel: Parallel,
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
        seeds: list[tuple[int, int, int, int]] = []
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
            seeds = _gradient_seeds(timeline, storage, nbytes, micro_batches, n_rows - 2)
            # a seed dies as the backward ends, often within an AccumulateGrad: not a gradient
            seeded = {sid for sid, *_rest in seeds}
            accumulated = [a for a in accumulated if a[0] not in seeded]
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
            seed_frees=seeds,
            compiled_units=levers.compile is not None,  # per block (compiled.py)
            # FSDP2 reduces fp32 and bf16 gradients with ReduceOp.AVG, fp16 ones with SUM
            # and its own divisions (_fsdp_collectives.py, _get_gradient_divide_factors:
            # overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)); under
            # amp the reduce dtype is fp32 (FSDP_PARAM_DTYPE's policy)
            averaged=precision is not Precision.FP16,
            # hsdp across more than one node: FSDP2 all-reduces over the replicate dim
            replicated=parallel.strategy is Strategy.HSDP and parallel.gpus > parallel.shard_ranks,
        )
        self._step_edits[key] = edits
        return edits

    def _fsdp_units(self: ModelProfile, units: object) -> tuple[str, ...] | None:  # type: ignore[misc]
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

    def _grad_dtype(self: ModelProfile, name: str, precision: Precision) -> str:  # type: ignore[misc]
        """A parameter's dtype (its gradient's) at ``precision``: half under bf16 / fp16,
        but the parameters kept in their own dtype whatever the precision (PEFT's
        adapters)."""
        if name in self.fixed_param_dtypes:
            return self.fixed_param_dtypes[name]
        half = {Precision.BF16: "bfloat16", Precision.FP16: "float16"}.get(precision)
        return "float32" if half is None else half

    def _trainable_params(  # type: ignore[misc]
        self: ModelProfile, precision: Precision, levers: Levers
    ) -> list[TrainableParam]:
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


def _gradient_seeds(
    timeline: Timeline,
    storage: np.ndarray,
    nbytes: np.ndarray,
    micro_batches: Sequence[tuple[int, int, int]],
    loss_row: int,
) -> list[tuple[int, int, int, int]]:
    """Each micro-batch's gradient seed, ``(storage id, bytes, row, index of its free)``:
    the backward's first allocation, a Temporary on the loss row (``loss.backward()``'s
    ``ones_like``), where the single-device timeline frees it within the backward.
    ``torch.autograd.backward`` holds it in ``grad_tensors_`` (torch/autograd/__init__.py)
    until the engine returns, which is after the callbacks queued on it have run
    (FSDP2's root post-backward); ``fsdp_step_edits`` moves its free after them."""
    out = []
    for _f0, b0, b1 in micro_batches:
        allocs = np.nonzero(nbytes[b0:b1] > 0)[0]
        if not len(allocs):
            continue
        first = b0 + int(allocs[0])
        sid = storage[first]
        temporary = timeline.storage_category[sid] == CATEGORY_CODE[Category.TEMPORARY]
        if int(timeline.event_module[first]) != loss_row or not temporary:
            continue
        gone = np.nonzero((storage[first + 1 : b1] == sid) & (nbytes[first + 1 : b1] < 0))[0]
        if len(gone):
            j = first + 1 + int(gone[0])
            out.append((int(sid), int(-nbytes[j]), int(timeline.event_module[j]), j))
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
