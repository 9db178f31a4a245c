"""The profiles of converted meta copies of the model, one per rung that changes the model:
PEFT's LoRA adapters, bitsandbytes / torchao / torchtune quantized weights, torchao's float8
training, one tensor-parallel rank, and each pipeline stage's step; and the load layout.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._estimating.communication import Collective, CommunicationVolume, scaled, volume_of
from .._estimating.levers import NO_LEVERS, Levers
from .._estimating.loading import LoadLayout
from .._estimating.options import (
    Device,
    Mode,
    OptimizerChoice,
    OptimizerImplementation,
    Precision,
)
from .._estimating.profile import ModelProfile
from .._estimating.recipe.float8 import Float8
from .._estimating.recipe.pipeline import StageQuestion
from .._estimating.recipe.weights import WeightFormat, Weights
from .context_parallel import (
    check_context_parallel_model,
    local_length,
    no_ring_refusal,
    ring_attention,
    ring_refusal_in,
)
from .expert_parallel import expert_parallelized, resolve_ep_plan
from .float8 import float8_copy
from .loading import load_layout
from .nf4_torchao import nf4_copy, nf4_layers
from .quantized import (
    kept_dtypes,
    qlora_wrapped,
    quantized_copy,
    quantized_modules,
)
from .quantized_cache import check_full_attention, require_quanto
from .source_runs import SourceRuns
from .step import (
    PEFT_PREFIX,
    lora_wrapped,
    meta_copy,
)
from .subject import (
    InputShapeWarning,
)
from .tensor_parallel import (
    fake_process_group,
    is_dtensor,
    parallelized,
    resolve_plan,
    tensor_parallel_lora,
)
from .torchao_weights import torchao_copy, torchao_modules

if TYPE_CHECKING:
    from .profiler import _Source


class SubProfiles:
    """The sub-profiles of :class:`~.profiler._Source` (``self`` is the source): LoRA,
    quantized weights, float8, one tensor- or context-parallel rank, the pipeline's stages,
    and the load layout."""

    def lora_profile(  # type: ignore[misc]
        self: _Source, rank: int, targets: tuple[str, ...] | None, dtype: str | None = None
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
            base = meta_copy(subject.model) if self.fresh_model is None else self.fresh_model()
            base_ids = {id(p) for p in base.parameters()}
            # a tensor-parallel rank's copy (its weights DTensor shards): PEFT lays the
            # adapters out by the model's plan (tensor_parallel_lora)
            sharded = any(is_dtensor(p) for p in base.parameters())
            wrap = tensor_parallel_lora if sharded else lora_wrapped
            wrapped = wrap(base, rank, targets, dtype)
            # the adapters' dtypes are set below, before any run (and any cache entry)
            sub = self._sub_profile(wrapped, self.cache)
        # a rank's collectives recorded by the profile it is a sub-profile of are its too
        _runs_of(sub).profiler.record_collectives = self.profiler.record_collectives
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

    def quantized_profile(  # type: ignore[misc]
        self: _Source,
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

    def float8_profile(self: _Source, float8: Float8) -> ModelProfile:  # type: ignore[misc]
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

    def float8_fsdp_step(  # type: ignore[misc]
        self: _Source,
        float8: Float8,
        parallel: Any,
        batch_size: int,
        seq_len: int | None,
        precision: Precision,
        optimizer: OptimizerChoice | None,
        implementation: OptimizerImplementation | None,
        rank: int = 0,
        levers: Levers = NO_LEVERS,
    ) -> Any:
        """Rank ``rank``'s step under FSDP2 (``parallel``) with torchao's float8 all-gather
        (``float8.all_gather``) at ``batch_size`` (and ``seq_len``) with ``levers``
        (checkpointing, accumulation), run on fake tensors and the fake process group
        (``float8_fsdp.float8_fsdp_rank``) as a rank of the profile's device. Kept per
        question."""
        from .float8_fsdp import float8_fsdp_rank

        key = (
            float8, parallel, batch_size, seq_len, precision, optimizer, implementation, rank,
            levers,
        )  # fmt: skip
        if not self.float8_fsdp_cached(*key):
            subject = self.profiler.subject
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.simplefilter("ignore", InputShapeWarning)
                warnings.filterwarnings("ignore", module=r"(torchao|torch\.distributed)(\.|$)")
                try:
                    self._float8_fsdp[key] = float8_fsdp_rank(
                        subject.model,
                        lambda: subject.make_inputs(batch_size, precision, False, seq_len),
                        subject.loss_fn, float8, parallel, precision, optimizer,
                        implementation, rank, levers, cuda=subject.device is Device.CUDA,
                    )  # fmt: skip
                except (RuntimeError, NotImplementedError, TypeError, AssertionError) as exc:
                    raise ValueError(
                        "float8_all_gather=True: the FSDP2 rank's step could not be run on "
                        f"fake tensors ({type(exc).__name__}: {str(exc)[:300]}); "
                        f"measure(model, inputs, gpus={parallel.gpus}, "
                        f"strategy={parallel.strategy.value!r}, float8=True, "
                        "float8_all_gather=True) runs it on real gloo ranks"
                    ) from exc
        return self._float8_fsdp[key]

    def float8_fsdp_cached(self: _Source, *question: Any) -> bool:  # type: ignore[misc]
        """Whether :meth:`float8_fsdp_step` has the answer to ``question`` (its arguments)
        kept."""
        return tuple(question) in self._float8_fsdp

    def kv_cache_profile(self: _Source, cache_config: dict[str, object]) -> ModelProfile:  # type: ignore[misc]
        """The profile of a meta copy of the model whose generation config asks for
        transformers' ``QuantizedCache`` with ``cache_config`` (``cache_implementation=
        "quantized"``, as generate reads it; the model itself untouched), recorded with
        optimum-quanto's packing made on fake tensors (``quantized_cache.quanto_on_fake``)."""
        require_quanto()
        subject = self.profiler.subject
        check_full_attention(subject.model)  # refused by name before any run
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InputShapeWarning)
            copy_ = meta_copy(subject.model)
            config: Any = copy.deepcopy(copy_.generation_config)
            config.cache_implementation = "quantized"
            config.cache_config = dict(cache_config)
            copy_.generation_config = config
            # not cached: the profile key does not read the generation config
            return self._sub_profile(copy_, cache=False)

    def load_layout(self: _Source, dtype: str, weights: Weights) -> LoadLayout:  # type: ignore[misc]
        """The tensors the model holds once loaded in ``dtype`` with ``weights``
        (``loading.load_layout``; the model itself untouched), the quantized modules
        checked first (a ValueError where there are none)."""
        model = self.profiler.subject.model
        if weights.format is WeightFormat.NF4_TORCHAO:
            nf4_layers(model, weights, None, None, None)
        elif weights.torchao:
            torchao_modules(model, weights)
        elif weights.quantized:
            quantized_modules(model, weights)
        return load_layout(model, dtype, weights)

    def tensor_parallel_estimate(self: _Source, tp: int, tp_plan: object, recipe: Any) -> Any:  # type: ignore[misc]
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

    def tensor_parallel_cached(self: _Source, tp: int, tp_plan: object, recipe: Any) -> bool:  # type: ignore[misc]
        """Whether :meth:`tensor_parallel_estimate` has this answer kept."""
        try:
            return (tp, id(tp_plan), recipe) in self._tensor_parallel
        except TypeError:  # a setting that cannot be hashed: never kept
            return False

    def tensor_parallel_refusal(self: _Source, tp: int) -> str | None:  # type: ignore[misc]
        """Why the model's own plan cannot shard it over ``tp`` ranks, or None."""
        try:
            resolve_plan(self.profiler.subject.model, tp)
        except (ValueError, TypeError) as exc:
            return str(exc)
        return None

    def _tensor_parallel_estimate(self: _Source, tp: int, tp_plan: object, recipe: Any) -> Any:  # type: ignore[misc]
        plan = resolve_plan(self.profiler.subject.model, tp, tp_plan)
        return self._rank_estimate(tp, lambda m, mesh: parallelized(m, plan, mesh), recipe)

    def _rank_estimate(  # type: ignore[misc]
        self: _Source,
        world_size: int,
        shard: Callable[[torch.nn.Module, Any], torch.nn.Module],
        recipe: Any,
        at_batch: int | None = None,
    ) -> Any:
        """Rank 0's estimate of ``recipe`` on a meta copy of the model that ``shard`` lays out
        over a fake process group of ``world_size`` ranks, profiled as a sub-profile while
        the group is up (destroyed after, whatever happens); at ``at_batch`` only where
        given (``SourceRuns.at_batch``), else fitted over the batch."""
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", InputShapeWarning)
            warnings.filterwarnings("ignore", module=r"(transformers|torch\.distributed)(\.|$)")
            with fake_process_group(world_size) as mesh:
                model = self.profiler.subject.model
                copy_ = shard(meta_copy(model), mesh)
                # not cached: the profile key does not read the mesh (or the routing)
                sub = self._sub_profile(copy_, cache=False)
                _runs_of(sub).fresh_model = lambda: shard(meta_copy(model), mesh)
                _runs_of(sub).profiler.record_collectives = True
                _runs_of(sub).at_batch = at_batch
                asked = _timelines_asked(sub)
                est = sub._estimate(recipe)
                if not asked:  # answered without a step's timeline: nothing to record
                    return est
                stepped, precision, mode, seq_len, levers = _step_asked(asked, sub, recipe)
                volume = _step_communication(
                    stepped, precision, mode, seq_len, levers, recipe.step.batch_size
                )
                return dataclasses.replace(
                    est,
                    communication_sent_bytes=volume.sent_bytes,
                    communication_sent_bytes_by_kind=volume.sent_bytes_by_kind,
                )

    def context_parallel_estimate(self: _Source, cp: int, seq_len: int, recipe: Any) -> Any:  # type: ignore[misc]
        """One of ``cp`` context-parallel ranks' estimate (rank 0) of ``recipe``: a meta copy
        of the model profiled at ``seq_len / cp`` tokens under torch's ``context_parallel``
        on a fake process group, its SDPA calls run as ring attention (``context_parallel.
        ring_attention``); the model and inputs checked first (``context_parallel.
        check_context_parallel_model``). Kept per (cp, seq_len, recipe)."""
        key = (cp, seq_len, recipe)
        if key not in self._context_parallel:
            subject = self.profiler.subject
            names = [name for name, _ in subject.inputs.named_tensors()] if subject.inputs else []
            check_context_parallel_model(subject.model, names, subject.device)
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.simplefilter("ignore", InputShapeWarning)
                warnings.filterwarnings("ignore", module=r"(transformers|torch\.distributed)(\.|$)")
                with fake_process_group(cp) as mesh, ring_attention(mesh, seq_len) as ran:
                    copy_ = meta_copy(subject.model)
                    # not cached: the profile key does not read the mesh
                    sub = self._sub_profile(copy_, cache=False, seq_len=local_length(seq_len, cp))
                    try:
                        estimate = sub._estimate(recipe)
                    except (NotImplementedError, RuntimeError) as exc:
                        refusal = ring_refusal_in(exc)
                        if refusal is not None:  # named before the call ran
                            raise ValueError(str(refusal)) from None
                        raise ValueError(
                            f"cp={cp}: torch's ring attention refused this model's attention: {exc}"
                        ) from exc
            if not ran:
                raise ValueError(no_ring_refusal(cp))
            self._context_parallel[key] = estimate
        return self._context_parallel[key]

    def context_parallel_refusal(self: _Source) -> str | None:  # type: ignore[misc]
        """Why the model or its inputs cannot run torch's ring attention (a CPU profile,
        attention other than SDPA, a mask input), or None; the layout and the sequence
        length are the estimate's to check."""
        subject = self.profiler.subject
        names = [name for name, _ in subject.inputs.named_tensors()] if subject.inputs else []
        try:
            check_context_parallel_model(subject.model, names, subject.device)
        except ValueError as exc:
            return str(exc)
        return None

    def expert_parallel_estimate(self: _Source, ep: int, recipe: Any) -> Any:  # type: ignore[misc]
        """One of ``ep`` expert-parallel ranks' estimate of ``recipe`` (rank 0): a meta copy
        of the model with its experts sharded by its own plan (``expert_parallel.
        resolve_ep_plan``, checked first) on a fake process group, the tokens routed evenly;
        its ``ep_worst_case_bytes`` the peak of the same rank where all of them go to its
        experts. Kept per (ep, recipe)."""
        key = (ep, recipe)
        if key not in self._expert_parallel:
            plan = resolve_ep_plan(self.profiler.subject.model, ep)
            balanced = self._expert_parallel_run(ep, plan, recipe, "balanced")
            worst = self._expert_parallel_run(ep, plan, recipe, "worst")
            self._expert_parallel[key] = dataclasses.replace(
                balanced, ep_worst_case_bytes=max(worst.peak_bytes, balanced.peak_bytes)
            )
        return self._expert_parallel[key]

    def expert_parallel_refusal(self: _Source, ep: int) -> str | None:  # type: ignore[misc]
        """Why the model's own plan cannot split its experts over ``ep`` ranks, or None."""
        try:
            resolve_ep_plan(self.profiler.subject.model, ep)
        except ValueError as exc:
            return str(exc)
        return None

    def _expert_parallel_run(  # type: ignore[misc]
        self: _Source, ep: int, plan: dict[str, str], recipe: Any, routing: str
    ) -> Any:
        return self._rank_estimate(
            ep,
            lambda m, mesh: expert_parallelized(m, plan, mesh, routing),
            recipe,
            at_batch=recipe.step.batch_size,
        )

    def pipeline_stage_peaks(self: _Source, question: StageQuestion) -> tuple[Any, ...]:  # type: ignore[misc]
        """Each of the ``question.pp`` pipeline ranks' step (its stages) as
        ``torch.distributed.pipelining`` runs it, on fake tensors
        (``pipeline_parallel.stage_peak``): the layout, precision and optimizer the
        question asks (``recipe.pipeline.StageQuestion``), the model and inputs checked
        first (``pipeline_parallel.check_pipeline_model``). Kept per question."""
        q = question
        kwargs = self._pipeline_inputs(q.pp, q.split, q.stages_per_rank, q.tp)
        if q not in self._pipeline:
            length = q.seq_len or kwargs["input_ids"].shape[1]
            shaped = {
                k: torch.empty((q.batch_size, length), dtype=v.dtype, device="meta")
                for k, v in kwargs.items()
            }
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.filterwarnings("ignore", module=r"(transformers|torch\.distributed)(\.|$)")
                self._pipeline[q] = tuple(
                    self._stage_peak(shaped, stage, q) for stage in range(q.pp)
                )
        return self._pipeline[q]

    def pipeline_parallel_refusal(  # type: ignore[misc]
        self: _Source, pp: int, stages_per_rank: int = 1, tp: int = 1
    ) -> str | None:
        """Why the model or its inputs cannot be split into ``pp`` ranks of
        ``stages_per_rank`` stages each (with ``tp`` > 1, each sharded by the model's plan
        over ``tp`` ranks), or None."""
        try:
            self._pipeline_inputs(pp, None, stages_per_rank, tp)
        except ValueError as exc:
            return str(exc)
        return None

    def _pipeline_inputs(  # type: ignore[misc]
        self: _Source,
        pp: int,
        split: tuple[str, ...] | None,
        stages_per_rank: int,
        tp: int = 1,
    ) -> dict[str, Any]:
        """The example's keyword inputs, where the profile's device, the model and the
        inputs can be split into ``pp`` stages, each sharded over ``tp`` ranks by the model's
        plan (``tensor_parallel.resolve_plan``: a model without one, or a ``tp`` not
        dividing what it shards, refused), else a ValueError saying why."""
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
        check_pipeline_model(subject.model, kwargs, pp, split, stages_per_rank)
        if tp > 1:
            from .tensor_parallel import resolve_plan

            resolve_plan(subject.model, tp)
        assert kwargs is not None
        return dict(kwargs)

    def _stage_peak(  # type: ignore[misc]
        self: _Source, inputs: dict[str, torch.Tensor], stage: int, question: StageQuestion
    ) -> Any:
        from .pipeline_parallel import stage_peak

        return stage_peak(self.profiler.subject.model, inputs, stage, question)


def _timelines_asked(sub: ModelProfile) -> list[tuple[Any, ...]]:
    """The (profile, precision, mode, seq_len, levers) of each timeline ``sub``, or a LoRA
    sub-profile it makes (``_source.lora_profile``), is asked for from now on, in order
    (``_step_asked`` picks the estimate's own step)."""
    asked: list[tuple[Any, ...]] = []

    def watched(profile: ModelProfile) -> ModelProfile:
        original = profile.timeline

        def timeline(
            precision: Precision,
            mode: Mode,
            seq_len: int | None = None,
            levers: Levers = NO_LEVERS,
        ) -> Any:
            asked.append((profile, precision, mode, seq_len, levers))
            return original(precision, mode, seq_len, levers)

        profile.timeline = timeline  # type: ignore[method-assign]
        return profile

    source: Any = sub._source
    make_lora = source.lora_profile
    source.lora_profile = lambda *args, **kwargs: watched(make_lora(*args, **kwargs))
    watched(sub)
    return asked


def _step_asked(asked: list[tuple[Any, ...]], sub: ModelProfile, recipe: Any) -> tuple[Any, ...]:
    """The estimate's own step among the timelines ``sub`` was ``asked`` for: the last one
    of the recipe's precision, mode and length (None: the example's). The optimizer's trace
    asks for the training step at the example's length after it (``optimizer_trace``: which
    parameters get a gradient), so the last one asked is not the step's at another length."""
    step = recipe.step
    length = None if step.seq_len == sub.seq_len else step.seq_len
    matching = [a for a in asked if (a[1], a[2], a[3]) == (step.precision, step.mode, length)]
    return matching[-1] if matching else asked[-1]


def _runs_of(sub: ModelProfile) -> SourceRuns:
    """The source that runs ``sub``'s steps (under a DiskCachedSource, the wrapped one)."""
    source = getattr(sub._source, "inner", sub._source)
    assert isinstance(source, SourceRuns)
    return source


def _step_communication(
    sub: ModelProfile,
    precision: Precision,
    mode: Mode,
    seq_len: int | None,
    levers: Levers,
    batch_size: int,
) -> CommunicationVolume:
    """What one rank of ``sub`` (a model laid out over the fake process group that is up,
    its runs recording their collectives) sends in the step the estimate read: the
    collectives of that step's timeline (the runs it was fitted from, fitted and checked
    in the batch and length as its memory is: ``collective_fit.py``) at ``batch_size``
    and ``seq_len``. Where they are no such polynomial, the step is run once more at that
    point. An accumulated step of ``k`` micro-batches is profiled with two
    (``Levers.profiled_micro_batches``), each issuing the same collectives: the two count
    ``k / 2`` times."""
    train = mode is Mode.TRAIN
    profiled = levers.for_profiling() if train else NO_LEVERS
    timeline = sub.timeline(precision, mode, seq_len, levers)  # the estimate's: no run
    if batch_size == 1 and timeline.batch_one is not None:
        timeline = timeline.batch_one  # the step at batch 1 as profiled there
    fitted = timeline.collectives
    if fitted is not None:
        collectives = fitted.at(batch_size, seq_len or 1)
    else:
        collectives = _collectives_run(sub, batch_size, precision, mode, seq_len, profiled)
    volume = volume_of(collectives)
    asked_micro = levers.grad_accumulation if train else 1
    if asked_micro > profiled.grad_accumulation:
        volume = scaled(volume, asked_micro, profiled.grad_accumulation)
    return volume


def _collectives_run(
    sub: ModelProfile,
    batch_size: int,
    precision: Precision,
    mode: Mode,
    seq_len: int | None,
    profiled: Levers,
) -> tuple[Collective, ...]:
    """The collectives of ``sub``'s step run once more on fake tensors at ``batch_size``
    and ``seq_len`` with the ``profiled`` levers."""
    source = _runs_of(sub)
    profiler = source.profiler
    profiler.seq_len, profiler.levers = seq_len, profiled
    try:
        with source._as_every_run():
            trace = profiler.run(precision, batch_size, mode, flops=False)
    finally:
        profiler.seq_len, profiler.levers = None, NO_LEVERS
    assert trace.collectives is not None
    return trace.collectives


def _with_fixed_dtypes(sub: ModelProfile, fixed: dict[str, str]) -> ModelProfile:
    """``sub`` with the parameters whose dtype no precision changes (adapters kept in fp32,
    bitsandbytes' packed storage): in its runs, and for their gradients (DDP buckets them
    apart)."""
    _runs_of(sub).profiler.subject.fixed_dtypes = frozenset(fixed)
    sub.fixed_param_dtypes = fixed
    return sub
