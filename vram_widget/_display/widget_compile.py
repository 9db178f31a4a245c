"""The widget's ``torch.compile`` control: what is compiled ("off", "model" or "blocks") and the
partitioner's ``activation_memory_budget``, two traits and their two dropdowns in the Step tab.

The compiled step is profiled at the asked batch size itself (``compiled.decided_at``: the
partitioner weighs tensors by their sizes), so with compile on a batch move may profile (the
batch slider then reports on release), and the searches over the batch (largest batch, memory
per extra sample, the batch x length frontier, the longest sequence) are not run: each would
profile one compiled step per batch it tries. The headline and the details say so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import traitlets

from .._estimating.compiled import CompileScope, parse_activation_memory_budget, parse_compile
from .._estimating.options import Mode

if TYPE_CHECKING:
    from .widget import MemoryWidget

__all__ = [
    "BUDGET_CHOICES",
    "COMPILE_CHOICES",
    "COMPILE_OFF",
    "COMPILE_TOOLTIPS",
    "DEFAULT_BUDGET",
    "NOT_SEARCHED",
    "CompileMixin",
    "CompileTrait",
    "compile_args",
    "compile_choice",
]

COMPILE_OFF = "off"
COMPILE_CHOICES: tuple[str, ...] = (COMPILE_OFF, *(s.value for s in CompileScope))
# torch._functorch.config.activation_memory_budget's default, 1.0 (torch/_functorch/config.py):
# the estimate is asked with None there, the partitioner's default, as estimate() is by default
DEFAULT_BUDGET = 1.0
# the budget dropdown's fractions: the default, half, and a tenth of the default partition's
# saved activations (a recipe's other value is added to them)
BUDGET_CHOICES: tuple[float, ...] = (DEFAULT_BUDGET, 0.5, 0.1)

COMPILE_TOOLTIPS: dict[str, str] = {
    "compile": "torch.compile of the training step (Inductor): model compiles the whole "
    "model, blocks each repeated block with fullgraph=True (torchtitan's per-block "
    "compile); the saved set is the partitioner's, each compiled region's temporaries "
    "Inductor's generated code's (its CPU plan); profiled at each batch size; off: the "
    "eager step",
    "activation_memory_budget": "torch.compile's activation_memory_budget: the fraction of "
    "the default partition's saved activations the partitioner may keep (1.0 the default; "
    "below, it recomputes more in the backward); with compile on only",
}
"""What the two controls change (their tooltips)."""

NOT_SEARCHED = "n/a with torch.compile (the compiled step is profiled at each batch size)"
"""What the headline and the details show in place of a search over the batch."""


class CompileTrait(traitlets.Unicode):
    """``compile`` as the control holds it: "off", "model" or "blocks"; estimate's None and
    False are stored as "off", True as "model"."""

    info_text = "'off', 'model' or 'blocks' (or None, False, True)"

    def validate(self, obj: Any, value: Any) -> Any:
        try:
            return compile_choice(value)
        except (TypeError, ValueError) as exc:
            raise traitlets.TraitError(str(exc)) from None


def compile_choice(value: object) -> str:
    """Any form ``estimate``'s ``compile`` takes, or "off", as the trait holds it (a
    ValueError naming the valid forms).

    Examples
    --------
    >>> compile_choice(True), compile_choice(None), compile_choice("Blocks"), compile_choice("off")
    ('model', 'off', 'blocks', 'off')
    >>> compile_choice("max-autotune")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: compile='max-autotune' is not a compile setting; valid values are False or ...
    """
    if isinstance(value, str) and value.strip().lower() == COMPILE_OFF:
        return COMPILE_OFF
    scope = parse_compile(value)
    return COMPILE_OFF if scope is None else scope.value


def compile_args(choice: str, budget: float, mode: str) -> dict[str, Any]:
    """``estimate``'s ``compile`` and ``activation_memory_budget`` for the two traits: none
    with compile off or outside training (the compiled step is estimated for training only,
    so the control's setting waits while the mode is inference or generate), the budget
    None at the partitioner's default.

    Examples
    --------
    >>> compile_args("blocks", 0.5, "train")
    {'compile': 'blocks', 'activation_memory_budget': 0.5}
    >>> compile_args("model", 1.0, "train"), compile_args("model", 0.5, "inference")
    ({'compile': 'model', 'activation_memory_budget': None}, {})
    """
    if choice == COMPILE_OFF or mode != Mode.TRAIN.value:
        return {}
    return {
        "compile": choice,
        "activation_memory_budget": None if budget == DEFAULT_BUDGET else budget,
    }


class CompileMixin:
    """The compile traits' check, their controls and the compiled setting's state, for
    :class:`~.widget.MemoryWidget` (``self`` is the widget)."""

    @traitlets.validate("activation_memory_budget")
    def _valid_budget(self: MemoryWidget, proposal: dict[str, Any]) -> float:
        try:
            budget = parse_activation_memory_budget(proposal["value"], CompileScope.MODEL)
        except (TypeError, ValueError) as exc:
            raise traitlets.TraitError(str(exc)) from None
        assert budget is not None
        return budget

    @property
    def _compiled(self: MemoryWidget) -> bool:  # type: ignore[misc]
        """Whether the step shown is the compiled one (compile on, in training)."""
        return bool(compile_args(self.compile, self.activation_memory_budget, self.mode))

    def _compile_settings(self: MemoryWidget) -> dict[str, Any]:  # type: ignore[misc]
        return compile_args(self.compile, self.activation_memory_budget, self.mode)

    def _build_compile_controls(self: MemoryWidget) -> None:  # type: ignore[misc]
        """The compile dropdown (linked to its trait) and the budget's (a view of its
        trait, which a refused value leaves as it was: ``_set_from_control``), disabled
        while compile is off."""
        style = {"description_width": "initial"}
        self._compile_dropdown = widgets.Dropdown(
            options=list(COMPILE_CHOICES),
            description="compile",
            tooltip=COMPILE_TOOLTIPS["compile"],
            style=style,
            layout={"width": "170px"},
        )
        widgets.link((self, "compile"), (self._compile_dropdown, "value"))
        self._budget_dropdown = widgets.Dropdown(
            options=[(str(b), b) for b in BUDGET_CHOICES],
            description="memory budget",
            tooltip=COMPILE_TOOLTIPS["activation_memory_budget"],
            style=style,
            layout={"width": "190px"},
        )
        self._budget_dropdown.observe(
            lambda change: self._set_from_control("activation_memory_budget", change["new"]),
            "value",
        )
        self._sync_compile_controls()

    def _sync_compile_controls(self: MemoryWidget) -> None:  # type: ignore[misc]
        """Show the budget on its dropdown (a value not offered is added) and enable it
        with compile on; the batch slider reports on release while a batch move may
        profile (no feedback: the caller holds ``_syncing``, or nothing observes yet)."""
        budget = self.activation_memory_budget
        if budget not in dict(self._budget_dropdown.options).values():
            self._budget_dropdown.options = sorted(
                {*self._budget_dropdown.options, (str(budget), budget)},
                key=lambda o: -o[1],
            )
        self._budget_dropdown.value = budget
        self._budget_dropdown.disabled = self.compile == COMPILE_OFF
        self._batch_slider.continuous_update = self.compile == COMPILE_OFF
