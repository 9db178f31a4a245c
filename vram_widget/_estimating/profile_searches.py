"""The searches over estimates: the largest batch size and sequence length that fit, the fewest
GPUs, the batch x length frontier and the bytes per sample. No torch here.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .communication import CollectiveKind, data_parallel_volume
from .estimator import MemoryEstimate
from .gpus import Gpu, resolve_gpu
from .layouts import (
    Candidate,
    Layout,
    LayoutPlan,
    RefusedLayout,
    candidates,
    fit_bytes,
    layout_order,
    traffic_params,
)
from .options import (
    FitBasis,
    Mode,
    OptimizerName,
    PipelineSchedule,
    Precision,
    Strategy,
    parse_option,
)
from .profile_source import ProfilingError
from .profile_step import (
    _lora_dtype_of,
    _step_levers,
)
from .quantized import check_quantized, check_weights_device
from .recipe import LeverSettings, Recipe
from .recipe.parallel import ParallelSettings
from .recipe.recipe import default
from .recipe.weights import Weights
from .sharding import (
    FSDP_PARAM_DTYPE,
    resolve_parallel,
)
from .tradeoff import Frontier, batch_seq_frontier, length_grid

if TYPE_CHECKING:
    from .profile import ModelProfile


# The frontier's longest length where the model has no learned position table: 128k tokens
DEFAULT_MAX_SEQ_LEN = 2**17


class SearchesMixin:
    """The searches of :class:`~.profile.ModelProfile` (``self`` is the profile)."""

    def max_batch_size(  # type: ignore[misc]
        self: ModelProfile,
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

    def min_gpus(  # type: ignore[misc]
        self: ModelProfile,
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
        >>> room = context + 562 * 2**20  # 562 MiB beside the CUDA context
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

    def plan_layouts(  # type: ignore[misc]
        self: ModelProfile,
        capacity_bytes: int | str | Gpu,
        gpus: int,
        batch_size: int | None = None,
        *,
        strategies: Sequence[str | Strategy] | None = None,
        basis: str | FitBasis = FitBasis.DEVICE,
        recipe: Recipe | None = None,
        **settings: Any,
    ) -> LayoutPlan:
        """Every layout of ``gpus`` GPUs as data-parallel x tensor-parallel x pipeline
        ranks (``dp * tp * pp = gpus``) that the estimate answers, each rank's step against
        ``capacity_bytes``, best first; and those it refuses, with its reasons.

        Layouts tried: ``tp`` and ``pp`` over the divisors of ``gpus``; with ``dp > 1``
        each data-parallel strategy (``strategies``, default all five); with ``pp > 1``
        each schedule, at ``microbatches`` micro-batches (a keyword in ``settings``;
        default ``pp``). Each is one :meth:`estimate` (the worst rank, or the worst
        pipeline stage, decides); what it refuses (tensor parallelism without a plan or
        beside a data-parallel strategy other than zero2, zero3 or hsdp, a model that is not a
        Hugging Face decoder with ``pp``, a setting not checked against real ranks...) is
        listed in ``refused`` with the
        estimate's own message. Data-parallel layouts are numpy on the cached profile
        (milliseconds); each tensor-parallel layout is one profiling run of a rank and
        each pipeline layout one of every stage (seconds each for a small model, minutes
        for a large one), cached as :meth:`estimate` caches them, nothing more. The
        warnings a layout's estimate gives (zero3's units that hold most of the parameters,
        settings it leaves out) are kept on its row, ``Layout.warnings``, not issued.

        Parameters
        ----------
        capacity_bytes : int, str or Gpu
            Each GPU's memory, in every form of :meth:`max_batch_size`.
        gpus : int
            The GPUs (>= 1): the world size every layout uses.
        batch_size : int, optional
            The step's whole batch, the same for every layout: each of ``dp``
            data-parallel ranks takes ``batch_size / dp`` (a ``dp`` that does not divide
            it is refused), tensor-parallel ranks all take it, a pipeline splits it into
            micro-batches. Default: ``gpus`` (one sample a GPU). Unlike :meth:`min_gpus`,
            whose batch is per rank.
        strategies : sequence of str, optional
            The data-parallel strategies to try (default: ``"ddp"``, ``"zero1"``,
            ``"zero2"``, ``"zero3"``, ``"hsdp"``).
        basis : {"device", "allocated"}
            What "fits" means, as for :meth:`max_batch_size`.
        recipe : Recipe, optional
            The setup as one value; its layout (``gpus``, ``strategy``, ``tp``, ``pp``)
            must be left at one device: the plan chooses it.
        **settings
            Any other keyword of :meth:`estimate` (``precision``, ``optimizer``, ``mode``,
            ``seq_len``, levers, ``gpus_per_node``, ``fsdp_units``, ``microbatches``...).

        Returns
        -------
        LayoutPlan
            ``layouts`` best first (:func:`~vram_widget._estimating.layouts.layout_order`):
            those that fit first, then the fewest bytes a rank sends per step
            (``Layout.communication_sent_bytes``: recorded from a tensor-parallel rank's
            or each pipeline stage's step, from the strategy's collectives over the
            parameters and gradients for a data-parallel one, both for FSDP2 over
            tensor-parallel ranks, over the rank's own tp shard), then the lowest
            ``fit_bytes``. ``best`` is the first that fits.

        Raises
        ------
        ValueError
            For ``gpus`` or ``batch_size`` below 1, a capacity in no valid form or not
            above the CUDA context, a layout setting in ``settings`` or ``recipe``, or a
            setting the one-device estimate refuses: before any layout is profiled.

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
        >>> plan = profile.plan_layouts("64 MiB", gpus=2, batch_size=8)
        >>> [(row.label, row.fits) for row in plan.layouts][:3]
        [('dp=2 zero2', True), ('dp=2 ddp', True), ('dp=2 zero3', True)]
        >>> plan.refused[0].label, "Hugging Face decoder" in plan.refused[0].reason
        ('pp=2 gpipe m=2', True)
        """
        n = _whole_gpus(gpus)
        batch = n if batch_size is None else batch_size
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch_size must be a whole number >= 1 or None, got {batch!r}")
        capacity, card = _card(capacity_bytes)
        fit_basis = parse_option(FitBasis, basis, "basis")
        shares = tuple(
            parse_option(Strategy, s, "strategies")
            for s in (tuple(Strategy) if strategies is None else strategies)
        )
        if not shares:
            raise ValueError("strategies is empty: give at least one of " + _strategy_names())
        base = _on_card(Recipe.from_keywords(recipe, batch_size=batch, **settings), card)
        _check_no_layout(base.parallel)
        microbatches = base.parallel.microbatches
        one = base.with_(microbatches=None)
        whole = self.estimate(recipe=one)  # one device: the model's whole step
        _check_above_context(whole, capacity)  # and the settings
        rows: list[Layout] = []
        refused: list[RefusedLayout] = []
        for c in candidates(n, batch, microbatches, tuple(dict.fromkeys(shares))):
            if isinstance(c, RefusedLayout):
                refused.append(c)
                continue
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    est = self.estimate(recipe=_layout_recipe(one, n, c))
            except (ValueError, ProfilingError) as exc:
                refused.append(
                    RefusedLayout(
                        c.dp, c.tp, c.pp, c.strategy, c.pp_schedule, c.microbatches, str(exc)
                    )
                )
                continue
            row = _layout_row(c, est, capacity, fit_basis, base.parallel.gpus_per_node, whole)
            said = tuple(dict.fromkeys(str(w.message) for w in caught))
            rows.append(dataclasses.replace(row, warnings=said))
        return LayoutPlan(
            n, batch, capacity, fit_basis, tuple(sorted(rows, key=layout_order)), tuple(refused)
        )

    def max_seq_len(  # type: ignore[misc]
        self: ModelProfile,
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

    def frontier(  # type: ignore[misc]
        self: ModelProfile,
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

    def bytes_per_sample(  # type: ignore[misc]
        self: ModelProfile,
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


def _whole_gpus(gpus: object) -> int:
    """``gpus`` as a whole number of GPUs >= 1, else a ValueError naming it."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a whole number of GPUs >= 1, got {gpus!r}")
    return gpus


def _strategy_names() -> str:
    return ", ".join(repr(s.value) for s in Strategy)


def _check_no_layout(parallel: ParallelSettings) -> None:
    """A plan chooses the layout: one asked in its settings is a ValueError naming it."""
    asked = {
        "gpus": parallel.gpus != 1,
        "strategy": parallel.strategy is not Strategy.DDP,
        "tp": parallel.tp != 1,
        "pp": parallel.pp != 1,
        "pp_schedule": parallel.pp_schedule is not PipelineSchedule.GPIPE,
        "pp_split": parallel.pp_split is not None,
        "stages_per_rank": parallel.stages_per_rank is not None,
        "rank": parallel.rank is not None,
        "tp_plan": parallel.tp_plan is not None,
    }
    given = [name for name, on in asked.items() if on]
    if given:
        raise ValueError(
            f"plan_layouts chooses the layout; {', '.join(given)} cannot be given (in the "
            "keywords or the recipe): give the GPUs as gpus=N, restrict the data-parallel "
            f"strategies with strategies=[...] ({_strategy_names()}), and the pipeline's "
            "micro-batches with microbatches=M"
        )


def _layout_recipe(one: Recipe, gpus: int, c: Candidate) -> Recipe:
    """The Recipe of layout ``c`` on ``gpus`` GPUs, the rest of ``one`` kept."""
    return one.with_(
        batch_size=c.rank_batch_size,
        gpus=gpus,
        strategy=Strategy.DDP if c.strategy is None else c.strategy,
        tp=c.tp,
        pp=c.pp,
        pp_schedule=PipelineSchedule.GPIPE if c.pp_schedule is None else c.pp_schedule,
        microbatches=c.microbatches,
    )


def _layout_row(
    c: Candidate,
    est: MemoryEstimate,
    capacity: int,
    basis: FitBasis,
    gpus_per_node: int,
    whole: MemoryEstimate,
) -> Layout:
    model_parallel = c.tp > 1 or c.pp > 1
    recorded = (est.communication_sent_bytes, dict(est.communication_sent_bytes_by_kind))
    sent: int | None = 0
    by_kind: dict[CollectiveKind, int] = {}
    if model_parallel:  # recorded from the rank's step (None where it was not)
        sent, by_kind = recorded
    if c.dp > 1 and sent is not None:
        # the strategy's collectives over the one-device step's parameters and gradients;
        # over tensor-parallel ranks, FSDP2 shards each rank's own tp shard (1 / tp)
        gather = whole.parameter_bytes // c.tp
        if est.precision in FSDP_PARAM_DTYPE:  # fp32 weights gathered in 2-byte bf16 / fp16
            gather //= 2
        volume = data_parallel_volume(
            c.strategy if est.mode is Mode.TRAIN else None,
            c.dp,
            whole.parameter_bytes // c.tp,
            whole.gradient_bytes // c.tp,
            gpus_per_node,
            gather,
        )
        sent += volume.sent_bytes
        for kind, nbytes in volume.sent_bytes_by_kind.items():
            by_kind[kind] = by_kind.get(kind, 0) + nbytes
    return Layout(
        dp=c.dp,
        tp=c.tp,
        pp=c.pp,
        strategy=c.strategy,
        pp_schedule=c.pp_schedule,
        microbatches=c.microbatches,
        rank_batch_size=c.rank_batch_size,
        peak_bytes=est.peak_bytes,
        fit_bytes=fit_bytes(est, basis),
        fits=est.fits(capacity, basis),
        communication_bytes=None if model_parallel else est.communication_bytes,
        traffic_params=traffic_params(c, gpus_per_node),
        estimate=est,
        communication_sent_bytes=sent,
        communication_sent_bytes_by_kind=by_kind,
    )


def _optimizer_choice(recipe: Recipe) -> str | None:
    """The recipe's optimizer as ``is_cached`` takes it: ``"adamw"`` or ``"adamw-fused"``."""
    opt = recipe.optimizer
    if opt.name is None:
        return None
    suffix = "" if opt.implementation is None else f"-{opt.implementation.value}"
    return f"{opt.name.value}{suffix}"


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
