"""Expert and context parallelism in the widget: the ``ep`` and ``cp`` traits as
``estimate`` takes them, their checks (the model's side, before any profiling), their
controls in the GPUs group, the world size that follows them, their rows in the details,
and whether a setting still has to be profiled.

``ep`` ranks share one batch and are the whole world, as are ``cp`` ranks
(``check_expert_parallel``, ``check_context_parallel``), so moving either moves ``gpus`` to
the world size, ``pp x tp x ep x cp`` (every other combination is refused by the estimate,
by name). The ep control shows for a model with experts only, offering the rank counts that
divide them; the cp control shows in training where the profile has a sequence axis,
offering the rank counts that divide the sequence length, and is off (the reason in its
tooltip) where the model cannot run torch's ring attention (a ``device="cpu"`` profile
among them). Each batch with ``ep`` or ``cp > 1`` is one rank's sub-profile
(``ModelProfile.estimate``), so the searches over the batch are not run, as with
``tp > 1``. Context parallelism is UNCONFIRMED against a real CUDA run (docs/known-gaps.md):
the details and the figure's title say so.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import traitlets

from .._estimating.estimator import MemoryEstimate
from .._estimating.options import Mode
from .._estimating.recipe import Recipe
from .._estimating.recipe.parallel import (
    ParallelSettings,
    check_context_parallel,
    check_expert_parallel,
    context_parallel_refusals,
    parallel_refusals,
)
from .widget_text import format_bytes

if TYPE_CHECKING:
    from .widget import MemoryWidget

__all__ = [
    "CP_CHOICES",
    "EP_MAX",
    "RANK_TOOLTIPS",
    "RanksMixin",
    "check_rank_forms",
    "context_parallel_text",
    "expert_parallel_text",
    "ranks_not_searched",
]

# the expert-parallel rank counts tried (those that divide the model's experts are offered)
EP_MAX = 64
# the context-parallel rank counts offered (those that divide the sequence length)
CP_CHOICES: tuple[int, ...] = (1, 2, 4, 8)
# the estimate's words for context parallelism's status (docs/known-gaps.md)
CP_UNCONFIRMED = "UNCONFIRMED against a real CUDA run (docs/known-gaps.md)"

RANK_TOOLTIPS: dict[str, str] = {
    "ep": "expert-parallel ranks: the model's experts split over them by its own plan "
    "(transformers' base_model_ep_plan), the dense modules whole on each, one batch shared "
    "with the tokens routed evenly (the details give the bound where every token goes to "
    "one rank's experts). Moving it sets GPUs to ep, the world size. Each new batch or "
    "setting with ep > 1 profiles one rank (seconds); the largest-batch searches are not run",
    "cp": "context-parallel ranks: each holds seq_len / cp tokens of every sequence and the "
    "whole model, torch's ring attention in place of SDPA (context_parallel; a CUDA profile "
    "of an SDPA model without a mask). UNCONFIRMED against a real CUDA run. Moving it sets "
    "GPUs to cp, the world size. Each new batch or setting with cp > 1 profiles one rank "
    "(seconds); the largest-batch searches are not run",
}
"""What each rank control changes (its tooltip), by the trait it sets."""


def ranks_not_searched(name: str) -> str:
    """The note in place of a search over the batch where each batch is one rank's
    profiling run (``name`` > 1).

    Examples
    --------
    >>> ranks_not_searched("ep")
    'not searched with ep > 1 (each batch is a profiling run of its own)'
    """
    return f"not searched with {name} > 1 (each batch is a profiling run of its own)"


def check_rank_forms(settings: Mapping[str, Any]) -> None:
    """``ep`` and ``cp`` in the forms their controls hold, and their layout with the other
    GPU settings (``gpus``, when not given, is the world size the controls set), checked
    before the model is run (whether the model has experts, or runs ring attention, the
    widget checks once it is profiled).

    Examples
    --------
    >>> check_rank_forms({"ep": 2, "cp": 1})
    >>> check_rank_forms({"ep": 2, "gpus": 4})
    Traceback (most recent call last):
    ...
    ValueError: invalid setting: ep=2 with gpus=4: the ep ranks share one batch and ...
    """
    ep, cp = settings.get("ep", 1), settings.get("cp", 1)
    for name, value in (("ep", ep), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"invalid setting: {name}={value!r}; give a whole number of ranks >= 1 (1: none)"
            )
    if ep == 1 and cp == 1:
        return
    tp, pp = settings.get("tp", 1), settings.get("pp", 1)
    gpus = settings.get("gpus", pp * tp * ep * cp)
    try:
        parallel = ParallelSettings(
            gpus=gpus, strategy=settings.get("strategy", "ddp"), tp=tp, pp=pp, ep=ep, cp=cp
        )
        check_expert_parallel(parallel)
        check_context_parallel(parallel, settings.get("seq_len"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid setting: {exc}") from None


def expert_parallel_text(est: MemoryEstimate) -> str:
    """One of ``ep`` expert-parallel ranks: the layout, the routing shown, and the bound
    where every token's picks go to this rank's experts."""
    worst = est.ep_worst_case_bytes
    return (
        f"{est.ep} ranks share one batch of {est.batch_size:,}, the experts split over them "
        "(the dense modules whole on each); shown: rank 0 with the tokens routed evenly"
        + (
            f"; if every token's picks go to its experts, up to {format_bytes(worst)} "
            f"({worst:,} B), a bound for a skewed router"
            if worst is not None and worst != est.peak_bytes
            else " (inference: every rank's experts see the whole batch, whatever the routing)"
            if worst is not None
            else ""
        )
    )


def context_parallel_text(est: MemoryEstimate) -> str:
    """One of ``cp`` context-parallel ranks: its share of the sequence, and the status."""
    seq = est.seq_len or 0
    return (
        f"{est.cp} ranks share one batch of {est.batch_size:,}, each holding {seq // est.cp:,} "
        f"of the {seq:,} tokens of every sequence and the whole model (torch's ring "
        "attention); shown: rank 0, without the gradients' reduction over the ranks; "
        + html.escape(CP_UNCONFIRMED)
    )


class RanksMixin:
    """The ep and cp traits' checks, arguments, pairing, controls and profiling state, for
    :class:`~.widget.MemoryWidget` (``self`` is the widget)."""

    # the questions with ep or cp > 1 answered so far (each a profiling run the first time)
    _ranks_answered: set[tuple[Any, ...]]

    @traitlets.validate("ep")
    def _valid_ep(self: MemoryWidget, proposal: dict[str, Any]) -> int:
        """``ep`` the model's experts can be split over (its own plan), else refused."""
        value = int(proposal["value"])
        refusal = None if value == 1 else self._profile.expert_parallel_refusal(value)
        if refusal:
            raise traitlets.TraitError(refusal)
        return value

    @traitlets.validate("cp")
    def _valid_cp(self: MemoryWidget, proposal: dict[str, Any]) -> int:
        """``cp`` where the model and its inputs can run ring attention, else refused."""
        value = int(proposal["value"])
        refusal = None if value == 1 else self._profile.context_parallel_refusal()
        if refusal:
            raise traitlets.TraitError(refusal)
        return value

    @property
    def _rank_parallel(self: MemoryWidget) -> bool:  # type: ignore[misc]
        """Whether the estimate is one of ep or cp > 1 ranks' (a sub-profile per batch)."""
        return self.ep > 1 or self.cp > 1

    @property
    def _ranks_note(self: MemoryWidget) -> str:  # type: ignore[misc]
        """In place of the searches over the batch with ep or cp > 1 ("" otherwise)."""
        if self.ep > 1:
            return ranks_not_searched("ep")
        return ranks_not_searched("cp") if self.cp > 1 else ""

    def _world_size(self: MemoryWidget) -> int:  # type: ignore[misc]
        """The GPUs the layout's ranks are: pp x tp x ep x cp."""
        return self.pp * self.tp * self.ep * self.cp

    def _rank_settings(self: MemoryWidget) -> dict[str, Any]:  # type: ignore[misc]
        """``ep`` and ``cp`` as ``estimate`` takes them (none where 1)."""
        return {name: getattr(self, name) for name in ("ep", "cp") if getattr(self, name) > 1}

    def _ranks_key(self: MemoryWidget) -> tuple[Any, ...]:  # type: ignore[misc]
        # the sub-profile's answer is kept per whole question, the card's settings included
        return (self.batch_size, *self._settings_key(card=False))

    def _ranks_need_profiling(self: MemoryWidget) -> bool:  # type: ignore[misc]
        """Whether the estimate at this setting (ep or cp > 1) profiles one rank: not for a
        question answered before, nor for one the estimate refuses before profiling."""
        if self._ranks_key() in self._ranks_answered:
            return False
        try:
            asked = Recipe.from_keywords(None, batch_size=self.batch_size, **self._settings())
            check_expert_parallel(asked.parallel)
            check_context_parallel(asked.parallel, self.seq_len)
        except (TypeError, ValueError):  # refused at once: nothing is profiled
            return False
        # the settings not estimated with ep or cp > 1 yet are refused at once too
        refusals = context_parallel_refusals if self.cp > 1 else parallel_refusals
        return not refusals(asked)

    def _ranks_answered_now(self: MemoryWidget) -> None:  # type: ignore[misc]
        """Note the current setting's rank as profiled (after its estimate)."""
        if self._rank_parallel:
            self._ranks_answered.add(self._ranks_key())

    def _pair_world(self: MemoryWidget, moved: str | None) -> list[tuple[str, Any]]:  # type: ignore[misc]
        """After a move of ``ep`` or ``cp`` (not a revert): GPUs to the world size. Returns
        the partner's name and old value where it moved."""
        if moved not in ("ep", "cp") or self._reverting:
            return []
        old = self.gpus
        if self._world_size() == old:
            return []
        self._pairing = True
        try:
            self.gpus = self._world_size()
        finally:
            self._pairing = False
        return [("gpus", old)]

    # ------------------------------------------------------------------ controls

    def _build_rank_controls(self: MemoryWidget) -> list[widgets.Dropdown]:  # type: ignore[misc]
        """The ep dropdown (the rank counts that divide the model's experts; hidden for a
        model without experts) and the cp dropdown (the counts that divide the sequence
        length; shown in training with a sequence axis, off with the reason in its tooltip
        where the model cannot run ring attention): views of their traits, which a refused
        value leaves as they were."""
        style = {"description_width": "initial"}
        profile = self._profile
        self._ep_offered = [1] + [
            k for k in range(2, EP_MAX + 1) if profile.expert_parallel_refusal(k) is None
        ]
        self._cp_refusal = profile.context_parallel_refusal() or ""
        cp_tooltip = f"not available: {self._cp_refusal}" if self._cp_refusal else ""
        self._ep_dropdown = widgets.Dropdown(
            options=self._ep_options(),
            value=self.ep,
            description="ep",
            tooltip=RANK_TOOLTIPS["ep"],
            style=style,
            layout={"width": "110px"},
        )
        self._cp_dropdown = widgets.Dropdown(
            options=self._cp_options(),
            value=self.cp,
            description="cp",
            tooltip=cp_tooltip or RANK_TOOLTIPS["cp"],
            disabled=bool(self._cp_refusal),
            style=style,
            layout={"width": "110px"},
        )
        for control, name in ((self._ep_dropdown, "ep"), (self._cp_dropdown, "cp")):
            control.observe(
                lambda change, name=name: self._set_from_control(name, change["new"]), "value"
            )
        self._sync_rank_controls()
        return [self._ep_dropdown, self._cp_dropdown]

    def _ep_options(self: MemoryWidget) -> list[int]:  # type: ignore[misc]
        return sorted({*self._ep_offered, self.ep})

    def _cp_options(self: MemoryWidget) -> list[int]:  # type: ignore[misc]
        """The context-parallel rank counts that divide the sequence length (and the
        current one)."""
        seq = self.seq_len or 0
        return sorted({*(k for k in CP_CHOICES if seq % k == 0), self.cp})

    def _sync_rank_controls(self: MemoryWidget) -> None:  # type: ignore[misc]
        """Show the ep and cp traits on their controls (no feedback: the caller holds
        ``_syncing``, or nothing observes yet): ep for a model with experts, cp in training
        with a sequence axis (each also while above 1)."""
        for control, options in (
            (self._ep_dropdown, self._ep_options()),
            (self._cp_dropdown, self._cp_options()),
        ):
            if list(control.options) != options:
                control.options = options
        self._ep_dropdown.value = self.ep
        self._cp_dropdown.value = self.cp
        experts = len(self._ep_offered) > 1
        self._ep_dropdown.layout.display = None if experts or self.ep > 1 else "none"
        train = self.mode == Mode.TRAIN.value and self._profile.has_seq_axis
        self._cp_dropdown.layout.display = None if train or self.cp > 1 else "none"
