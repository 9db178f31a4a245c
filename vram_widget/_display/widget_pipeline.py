"""Pipeline parallelism in the widget: the ``pp``, ``pp_schedule``, ``microbatches`` and
``stages_per_rank`` traits as ``estimate`` takes them, their controls in the GPUs group, the
world size that follows ``pp``, and whether a setting still has to be profiled.

``gpus`` is the world size, data-parallel ranks x pipeline stages x tensor-parallel ranks
(``estimate`` takes ``dp > 1`` over stages with ``"zero2"``, ``"zero3"`` and ``"hsdp"``
only, FSDP2 over each stage's ranks, and refuses the rest by name:
``check_pipeline_parallel``), so moving
``pp`` moves ``gpus`` to ``dp x pp x tp``, ``dp`` kept under those strategies and 1 under
the others (``pp x tp``, back to ``tp`` at ``pp = 1``; ``ep`` and ``cp`` ranks multiply it
likewise, :mod:`.widget_parallel`); while ``pp > 1`` the GPUs control steps in multiples of
``pp x tp``. ``pp = 1`` puts ``microbatches`` and ``stages_per_rank``
back to their defaults (``pp``; 2 under ``"interleaved-1f1b"``), as a schedule other than
``"interleaved-1f1b"`` puts ``stages_per_rank`` back; a refused move puts them back with
it. The stages-a-rank control shows under ``"interleaved-1f1b"`` only, offering the counts
the model's layers can be split into at the current ``pp``. Each batch with ``pp > 1`` is
a profiling run of every stage (``ModelProfile.estimate``), so the searches over the batch
are not run (:data:`PP_NOT_SEARCHED`), as with ``tp > 1``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import traitlets

from .._estimating.estimator import MemoryEstimate
from .._estimating.options import PipelineSchedule
from .._estimating.recipe import Recipe
from .._estimating.recipe.pipeline import (
    STAGE_DATA_PARALLEL,
    check_pipeline_parallel,
    check_pipeline_parallel_settings,
    pipeline_stages_per_rank,
)
from .figure_stages import pipeline_layout, stage_data_parallel, stage_unit
from .widget_text import format_bytes

if TYPE_CHECKING:
    from .widget import MemoryWidget

__all__ = [
    "MICROBATCH_CHOICES",
    "PP_CHOICES",
    "PP_NOT_SEARCHED",
    "PP_SCHEDULES",
    "PP_TOOLTIPS",
    "STAGES_PER_RANK_CHOICES",
    "PipelineMixin",
    "check_pipeline_forms",
    "stages_text",
]

# the pipeline stage counts offered (those the model's decoder layers divide)
PP_CHOICES: tuple[int, ...] = (1, 2, 4, 8)
# the schedules estimated (torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and
# ScheduleInterleaved1F1B, the last with 2 stages a rank)
PP_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")
# the micro-batch counts offered; the dropdown's 0 is the default, pp (the trait's None)
MICROBATCH_CHOICES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
# the stages a rank tried under "interleaved-1f1b" (those the model's layers can be split
# into at the current pp are offered); the dropdown's 0 is the default (the trait's None):
# 2, torchtitan's (pipeline_stages_per_rank)
STAGES_PER_RANK_CHOICES: tuple[int, ...] = (2, 3, 4, 6, 8)
_INTERLEAVED = PipelineSchedule.INTERLEAVED_1F1B.value
# in place of a search with pp > 1, where each batch is a profiling run of its own
PP_NOT_SEARCHED = "not searched with pp > 1 (each batch is a profiling run of its own)"

PP_TOOLTIPS: dict[str, str] = {
    "pp": "pipeline stages, one a GPU: a Hugging Face decoder's layers split evenly, as "
    "torchtitan splits them (a CPU profile, fp32 or bf16 training). Moving it sets GPUs to "
    "pp x tp, the world size (back to tp at 1), or under zero2 / zero3 / hsdp to dp x pp x tp, "
    "keeping the data-parallel ranks (FSDP2 over each stage's). Each new batch or setting "
    "with pp > 1 profiles every stage (seconds); the largest-batch searches are not run",
    "pp_schedule": "how the stages run the micro-batches: gpipe (ScheduleGPipe: every "
    "micro-batch's forward, then the backwards), 1f1b (Schedule1F1B: at most pp "
    "micro-batches' activations held; needs micro-batches >= pp) or interleaved-1f1b "
    "(ScheduleInterleaved1F1B: 2 stages a rank, rank r holding stages r and r + pp, the "
    "layers split as torchtitan counts them; micro-batches a multiple of "
    "max(1, micro-batches // pp))",
    "microbatches": "micro-batches the batch is split into (the batch is the whole step's; "
    "each micro-batch is batch / micro-batches, which must divide it); = pp: as many as "
    "stages",
    "stages_per_rank": "stages each pipeline rank holds under interleaved-1f1b (rank r "
    "holding stages r, r + pp, ...; pp x stages-a-rank stages, the layers split as "
    "torchtitan counts them); = 2: torchtitan's default. Only the counts the model's layers "
    "can be split into at this pp are offered; the bars are then one a rank",
}
"""What each pipeline control changes (its tooltip), by the trait it sets."""


def check_pipeline_forms(settings: Mapping[str, Any]) -> None:
    """``pp``, ``pp_schedule`` and ``microbatches`` in the forms their controls hold, checked
    before the model is run (whether the model splits, and the layout, the estimate says).

    Examples
    --------
    >>> check_pipeline_forms({"pp": 3})
    Traceback (most recent call last):
    ...
    ValueError: invalid setting: pp=3; the widget offers pp in (1, 2, 4, 8)
    """
    pp = settings.get("pp", 1)
    if isinstance(pp, bool) or pp not in PP_CHOICES:
        raise ValueError(f"invalid setting: pp={pp!r}; the widget offers pp in {PP_CHOICES}")
    schedule = settings.get("pp_schedule", PP_SCHEDULES[0])
    if schedule not in PP_SCHEDULES:
        raise ValueError(
            f"invalid setting: pp_schedule={schedule!r}; the widget estimates "
            f"{' or '.join(map(repr, PP_SCHEDULES))}"
        )
    m = settings.get("microbatches")
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ValueError(
            f"invalid setting: microbatches={m!r}; give a whole number >= 1, or None for pp"
        )
    v = settings.get("stages_per_rank")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(
            f"invalid setting: stages_per_rank={v!r}; give a whole number >= 2 (with "
            "pp_schedule='interleaved-1f1b'), or None for its default, 2"
        )


def stages_text(est: MemoryEstimate) -> str:
    """Each stage's (each rank's, with several stages a rank) peak and what it holds
    between steps, the worst in bold."""
    worst = max(range(len(est.stage_peak_bytes)), key=est.stage_peak_bytes.__getitem__)
    unit = stage_unit(est)
    stages = [
        ("<b>{}</b>" if i == worst else "{}").format(
            f"{unit} {i}: {format_bytes(peak)} (resident {format_bytes(resident)})"
        )
        for i, (peak, resident) in enumerate(
            zip(est.stage_peak_bytes, est.stage_resident_bytes, strict=True)
        )
    ]
    held = "stages" if est.stages_per_rank == 1 else f"ranks of {est.stages_per_rank} stages"
    dp = stage_data_parallel(est)
    ranks = (
        ""
        if dp == 1
        else f" on {est.gpus:,} GPUs, {html.escape(pipeline_layout(est))}: each stage's "
        f"{dp} data-parallel ranks shard it with FSDP2 and each runs the whole step's batch "
        f"(global batch {dp:,} x {est.batch_size:,} = {dp * est.batch_size:,}); shown: "
        "the peak per GPU of each stage"
    )
    return (
        f"{est.pp} {held}{ranks}, {html.escape(str(est.pp_schedule))}, {est.microbatches} "
        f"micro-batches of {est.batch_size // (est.microbatches or 1):,}: "
        + "; ".join(stages)
        + "; the waterfall and the layers are the whole model's one-device step"
    )


class PipelineMixin:
    """The pipeline traits' arguments, pairing, controls and profiling state, for
    :class:`~.widget.MemoryWidget` (``self`` is the widget)."""

    # the questions with pp > 1 answered so far (each a profiling run the first time)
    _pipeline_answered: set[tuple[Any, ...]]

    @property
    def _pipeline_parallel(self: MemoryWidget) -> bool:  # type: ignore[misc]
        """Whether the estimate is each of pp > 1 pipeline stages' (profiled per batch)."""
        return self.pp > 1

    def _pipeline_settings(self: MemoryWidget) -> dict[str, Any]:  # type: ignore[misc]
        """The pipeline traits as ``estimate`` takes them: none at ``pp = 1`` (but a
        micro-batch count, which the estimate refuses there by name)."""
        given = {
            name: getattr(self, name)
            for name in ("microbatches", "stages_per_rank")
            if getattr(self, name) is not None
        }
        if self.pp == 1:
            return given
        return {"pp": self.pp, "pp_schedule": self.pp_schedule, "microbatches": None, **given}

    def _pipeline_key(self: MemoryWidget) -> tuple[Any, ...]:  # type: ignore[misc]
        # the card's compute capability sets the extras only, never a stage's run; the
        # stages a rank as the stages are run (the default, None, is 2 or 1)
        stages = self.stages_per_rank or (2 if self.pp_schedule == _INTERLEAVED else 1)
        leave_out = ("compute_capability", "stages_per_rank")
        return (self.batch_size, stages, *self._settings_key(*leave_out, card=False))

    @traitlets.validate("stages_per_rank")
    def _valid_stages_per_rank(self: MemoryWidget, proposal: dict[str, Any]) -> int | None:
        """Stages a rank the model's layers can be split into at the current ``pp`` (the
        schedule and the micro-batches are the estimate's to check), else refused."""
        value = proposal["value"]
        if value is not None and value > 1 and self.pp > 1:
            refusal = self._profile.pipeline_parallel_refusal(self.pp, value, self.tp)
            if refusal:
                raise traitlets.TraitError(refusal)
        return value

    def _pipeline_needs_profiling(self: MemoryWidget) -> bool:  # type: ignore[misc]
        """Whether the estimate at this setting (pp > 1) runs the stages: not for a
        question answered before, nor for one the estimate refuses before profiling."""
        if self._pipeline_key() in self._pipeline_answered:
            return False
        settings = self._settings()
        try:
            asked = Recipe.from_keywords(None, batch_size=self.batch_size, **settings)
            check_pipeline_parallel(asked.parallel, self.batch_size)
            check_pipeline_parallel_settings(asked)
        except (TypeError, ValueError):  # refused at once: nothing is profiled
            return False
        stages = pipeline_stages_per_rank(asked.parallel)
        return self._profile.pipeline_parallel_refusal(self.pp, stages, self.tp) is None

    def _pipeline_answered_now(self: MemoryWidget) -> None:  # type: ignore[misc]
        """Note the current setting's stages as profiled (after its estimate)."""
        if self._pipeline_parallel:
            self._pipeline_answered.add(self._pipeline_key())

    def _data_parallel_ranks(self: MemoryWidget, pp: int) -> int:  # type: ignore[misc]
        """The data-parallel degree of ``gpus`` at ``pp`` stages, kept when ``pp`` moves:
        ``gpus / (pp x tp x ep x cp)`` where that divides it and the strategy is one the
        estimate takes over stages (FSDP2, ``STAGE_DATA_PARALLEL``), else 1 (the pipeline
        alone, as before any data-parallel ranks)."""
        world = pp * self.tp * self.ep * self.cp
        if self.strategy not in STAGE_DATA_PARALLEL or self.gpus % world:
            return 1
        return self.gpus // world

    def _stage_ranks_text(self: MemoryWidget) -> str:  # type: ignore[misc]
        """``"dp=d {strategy} x "`` where ``d > 1`` data-parallel ranks share each stage
        (FSDP2 over the stages), for the status line; "" for the pipeline alone."""
        dp = self._data_parallel_ranks(self.pp)
        return f"dp={dp} {self.strategy} x " if dp > 1 else ""

    def _gpus_step(self: MemoryWidget, asked: float) -> int:  # type: ignore[misc]
        """The GPUs a move of their control to ``asked`` gives with ``pp > 1``: the next
        multiple of the world size ``pp x tp`` (x ep x cp) up or down from ``gpus``, in the
        direction moved, at least the world size."""
        unit = self._world_size()
        if asked > self.gpus:
            return max(unit, -(-math.ceil(asked - 1e-9) // unit) * unit)
        return max(unit, math.floor(asked + 1e-9) // unit * unit)

    def _pair_pipeline(  # type: ignore[misc]
        self: MemoryWidget, moved: str | None, old: Any = None
    ) -> list[tuple[str, Any]]:
        """After a move of ``pp`` from ``old`` (not a revert): GPUs to ``dp x pp x tp``
        (and any ep or cp ranks), the data-parallel degree ``dp`` kept under FSDP2
        (:meth:`_data_parallel_ranks`, else 1), and at ``pp = 1`` the micro-batches and the
        stages a rank to their defaults; after a move of the schedule away from
        ``"interleaved-1f1b"``, the stages a rank to its default. Returns each partner's
        name and old value."""
        if moved not in ("pp", "pp_schedule") or self._reverting:
            return []
        moves: list[tuple[str, Any]] = []
        if moved == "pp":
            dp = self._data_parallel_ranks(old) if old in PP_CHOICES else 1
            moves.append(("gpus", dp * self._world_size()))
        if moved == "pp" and self.pp == 1:
            moves.append(("microbatches", None))
        if self.pp == 1 or self.pp_schedule != _INTERLEAVED:
            moves.append(("stages_per_rank", None))
        partners = []
        for name, value in moves:
            old = getattr(self, name)
            if value != old:
                self._pairing = True
                try:
                    setattr(self, name, value)
                finally:
                    self._pairing = False
                partners.append((name, old))
        return partners

    # ------------------------------------------------------------------ controls

    def _build_pipeline_controls(self: MemoryWidget) -> list[widgets.Dropdown]:  # type: ignore[misc]
        """The pp dropdown (the stage counts the model's layers divide; off, the reason
        in its tooltip, where none does), the schedule's and the micro-batches' (shown
        with pp > 1); views of their traits, which a refused value leaves as they were."""
        style = {"description_width": "initial"}
        profile = self._profile
        self._pp_offered = [1] + [
            k for k in PP_CHOICES[1:] if profile.pipeline_parallel_refusal(k) is None
        ]
        self._pp_refusal = "" if len(self._pp_offered) > 1 else profile.pipeline_parallel_refusal(2)
        self._pp_dropdown = widgets.Dropdown(
            options=self._pp_options(),
            value=self.pp,
            description="pp",
            tooltip=(
                PP_TOOLTIPS["pp"] if not self._pp_refusal else f"not available: {self._pp_refusal}"
            ),
            disabled=bool(self._pp_refusal),
            style=style,
            layout={"width": "110px"},
        )
        self._schedule_dropdown = widgets.Dropdown(
            options=list(PP_SCHEDULES),
            value=self.pp_schedule,
            description="schedule",
            tooltip=PP_TOOLTIPS["pp_schedule"],
            style=style,
            layout={"width": "170px"},
        )
        self._microbatch_dropdown = widgets.Dropdown(
            options=self._microbatch_options(),
            value=self.microbatches or 0,
            description="pp micro-batches",
            tooltip=PP_TOOLTIPS["microbatches"],
            style=style,
            layout={"width": "210px"},
        )
        # the stages a rank each pp offers (its layers' split), found once per pp
        self._stages_offered: dict[int, list[int]] = {}
        self._stages_dropdown = widgets.Dropdown(
            options=self._stages_options(),
            value=self.stages_per_rank or 0,
            description="stages a rank",
            tooltip=PP_TOOLTIPS["stages_per_rank"],
            style=style,
            layout={"width": "190px"},
        )
        defaults = ("microbatches", "stages_per_rank")  # the dropdowns' 0 is the trait's None
        for control, name in (
            (self._pp_dropdown, "pp"),
            (self._schedule_dropdown, "pp_schedule"),
            (self._microbatch_dropdown, "microbatches"),
            (self._stages_dropdown, "stages_per_rank"),
        ):
            control.observe(
                lambda change, name=name: self._set_from_control(
                    name, (change["new"] or None) if name in defaults else change["new"]
                ),
                "value",
            )
        self._sync_pipeline_controls()
        return [
            self._pp_dropdown,
            self._schedule_dropdown,
            self._stages_dropdown,
            self._microbatch_dropdown,
        ]

    def _pp_options(self: MemoryWidget) -> list[int]:  # type: ignore[misc]
        return sorted({*self._pp_offered, self.pp})

    def _microbatch_options(self: MemoryWidget) -> list[tuple[str, int]]:  # type: ignore[misc]
        counts = sorted({*MICROBATCH_CHOICES, self.microbatches or 1})
        return [(f"= pp ({self.pp})", 0), *((str(m), m) for m in counts)]

    def _stages_options(self: MemoryWidget) -> list[tuple[str, int]]:  # type: ignore[misc]
        """The default, and the stages a rank the model's layers can be split into at the
        current pp (and the current count); none but the default at pp = 1."""
        if self.pp > 1 and self.pp not in self._stages_offered:
            self._stages_offered[self.pp] = [
                v
                for v in STAGES_PER_RANK_CHOICES
                if self._profile.pipeline_parallel_refusal(self.pp, v) is None
            ]
        offered = self._stages_offered.get(self.pp, [])
        counts = sorted({*offered, *([self.stages_per_rank] if self.stages_per_rank else [])})
        return [("= 2", 0), *((str(v), v) for v in counts)]

    def _sync_pipeline_controls(self: MemoryWidget) -> None:  # type: ignore[misc]
        """Show the pipeline traits on their controls (no feedback: the caller holds
        ``_syncing``, or nothing observes yet); the schedule and micro-batches with pp > 1."""
        if list(self._pp_dropdown.options) != self._pp_options():
            self._pp_dropdown.options = self._pp_options()
        self._pp_dropdown.value = self.pp
        self._schedule_dropdown.value = self.pp_schedule
        if list(self._microbatch_dropdown.options) != self._microbatch_options():
            self._microbatch_dropdown.options = self._microbatch_options()
        self._microbatch_dropdown.value = self.microbatches or 0
        if list(self._stages_dropdown.options) != self._stages_options():
            self._stages_dropdown.options = self._stages_options()
        self._stages_dropdown.value = self.stages_per_rank or 0
        shown = None if self.pp > 1 or self.microbatches is not None else "none"
        self._schedule_dropdown.layout.display = shown
        self._microbatch_dropdown.layout.display = shown
        interleaved = self.pp > 1 and self.pp_schedule == _INTERLEAVED
        self._stages_dropdown.layout.display = (
            None if interleaved or self.stages_per_rank is not None else "none"
        )
