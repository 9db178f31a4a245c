"""The widget's "weights" control: the Linear weights' storage (bitsandbytes' and torchao's
quantized formats) and torchao's float8 training, one dropdown in the Step tab over two
traits, ``weights`` and ``float8`` (estimate's keywords of the same names).

The two are exclusive in an estimate (``check_float8`` refuses quantized weights), so the
traits move as a pair: setting one clears the other, in one estimate. A choice the current
setting refuses at once (int8 or torchao's formats in training, a 4-bit format in training
without a LoRA rank, int4-torchao on ``device="cuda"``, float8 outside training or across
GPUs, a library that is not installed) is answered without profiling: the headline shows
the refusal and the control goes back (an ipywidgets ``Dropdown`` cannot disable single
options). A choice not profiled yet is a sub-profile (seconds), behind the busy label.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import traitlets

from .._estimating.float8 import check_float8, check_float8_layout
from .._estimating.options import Mode, Precision
from .._estimating.quantized import check_quantized, check_weights_device
from .._estimating.recipe.float8 import Float8, float8_recipe
from .._estimating.recipe.weights import Weights
from .widget_settings import weights_arg

if TYPE_CHECKING:
    from .widget import MemoryWidget

__all__ = [
    "FLOAT8_CHOICES",
    "WEIGHTS_CHOICES",
    "WEIGHTS_OFF",
    "WEIGHT_FORMATS",
    "Float8Trait",
    "WeightsMixin",
    "WeightsTrait",
    "missing_library",
    "recipe_weights_choice",
    "weights_control_value",
]

WEIGHTS_OFF = "off"
"""The dropdown's choice of no quantization and no float8 (both traits None)."""

# the weights trait's values: bitsandbytes' 4-bit formats (nf4, with QLoRA's double
# quantization too; fp4), LLM.int8 without its outlier split (threshold 0: the default
# threshold's split depends on the activations' values); torchao's int8 and int4
# weight-only formats (quantize_) and its NF4Tensor as torchtune's QLoRA applies it
WEIGHT_FORMATS: tuple[str, ...] = (
    "int8", "nf4", "nf4-dq", "fp4", "int8-torchao", "int4-torchao", "nf4-torchao",
)  # fmt: skip
# the float8 trait's values: torchao's two float8 training recipes (Float8Recipe)
FLOAT8_CHOICES: tuple[str, ...] = ("tensorwise", "rowwise")

WEIGHTS_CHOICES: tuple[tuple[str, str], ...] = (
    ("model's own", WEIGHTS_OFF),
    ("int8", "int8"),
    ("nf4", "nf4"),
    ("nf4 (double quant)", "nf4-dq"),
    ("fp4", "fp4"),
    ("int8 (torchao)", "int8-torchao"),
    ("int4 (torchao)", "int4-torchao"),
    ("nf4 (torchao)", "nf4-torchao"),
    ("float8 training (tensorwise)", "float8-tensorwise"),
    ("float8 training (rowwise)", "float8-rowwise"),
)
"""The dropdown's (label, value) pairs: a weights format, ``float8-<recipe>``, or off."""

_FLOAT8_PREFIX = "float8-"

# the library that applies each choice (what its profiling run imports first:
# _profiling/quantized.py require_bitsandbytes, torchao_weights.py and float8.py's
# torchao imports, nf4_torchao.py's torchtune files)
_LIBRARIES: dict[str, tuple[str, ...]] = {
    "int8": ("bitsandbytes",),
    "nf4": ("bitsandbytes",),
    "nf4-dq": ("bitsandbytes",),
    "fp4": ("bitsandbytes",),
    "int8-torchao": ("torchao",),
    "int4-torchao": ("torchao",),
    "nf4-torchao": ("torchao", "torchtune"),
    "float8": ("torchao",),
}


def missing_library(choice: str) -> str:
    """The first library a dropdown choice needs that is not installed ("" where all are);
    found with ``importlib.util.find_spec``, so nothing heavy is imported.

    Examples
    --------
    >>> missing_library("off"), missing_library("float8-rowwise") in ("", "torchao")
    ('', True)
    """
    key = "float8" if choice.startswith(_FLOAT8_PREFIX) else choice
    for name in _LIBRARIES.get(key, ()):
        if importlib.util.find_spec(name) is None:
            return name
    return ""


def weights_control_value(weights: str | None, float8: str | None) -> str:
    """The dropdown's value for the two traits.

    Examples
    --------
    >>> weights_control_value(None, None), weights_control_value("nf4", None)
    ('off', 'nf4')
    >>> weights_control_value(None, "rowwise")
    'float8-rowwise'
    """
    if float8 is not None:
        return f"{_FLOAT8_PREFIX}{float8}"
    return WEIGHTS_OFF if weights is None else weights


class WeightsTrait(traitlets.Unicode):
    """``weights`` as the control holds it: None (the precision's dtype) or a format of
    :data:`WEIGHT_FORMATS`; ``"off"`` / ``"none"`` are stored as None."""

    info_text = f"None or one of {', '.join(map(repr, WEIGHT_FORMATS))}"

    def validate(self, obj: Any, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            text = value.strip().lower()
            if text in (WEIGHTS_OFF, "none"):
                return None
            if text in WEIGHT_FORMATS:
                return text
            if text.startswith(_FLOAT8_PREFIX):
                raise traitlets.TraitError(
                    f"weights={value!r}: float8 training is the float8 setting "
                    f"(float8={text.removeprefix(_FLOAT8_PREFIX)!r}), not a weights format"
                )
        raise traitlets.TraitError(
            f"weights={value!r} is not a format the weights control holds; valid values are "
            f"None, {', '.join(map(repr, WEIGHT_FORMATS))} (a Weights record or a "
            "BitsAndBytesConfig: profile.estimate(weights=...) or a Recipe)"
        )


class Float8Trait(traitlets.Unicode):
    """``float8`` as the control holds it: None or a recipe of :data:`FLOAT8_CHOICES`;
    True is ``"tensorwise"`` (torchao's default), False / ``"off"`` None."""

    info_text = "None, True, 'tensorwise' or 'rowwise'"

    def validate(self, obj: Any, value: Any) -> Any:
        try:
            recipe = float8_recipe(value)
        except (TypeError, ValueError) as exc:
            raise traitlets.TraitError(str(exc)) from None
        return None if recipe is None else recipe.value


class WeightsMixin:
    """The weights / float8 pair, its dropdown and its sub-profiles' state, for
    :class:`~.widget.MemoryWidget` (``self`` is the widget)."""

    def _build_weights_control(self: MemoryWidget) -> widgets.Dropdown:  # type: ignore[misc]
        """The dropdown, a view of the two traits (a refused choice leaves them as they
        were and the control shows them again); disabled where a Recipe holds either."""
        dropdown = widgets.Dropdown(
            options=list(WEIGHTS_CHOICES),
            value=weights_control_value(self.weights, self.float8),
            layout={"width": "270px"},
        )
        dropdown.disabled = self._weights_held
        dropdown.observe(self._weights_chosen, "value")
        self._weights_dropdown = dropdown
        return dropdown

    @property
    def _weights_held(self: MemoryWidget) -> bool:  # type: ignore[misc]
        """Whether a Recipe's own Weights or Float8 (no form the control holds) is held."""
        return "weights" in self._fixed or "float8" in self._fixed

    def _weights_chosen(self: MemoryWidget, change: dict[str, Any]) -> None:  # type: ignore[misc]
        """The dropdown moved: set the one trait it names (its pair clears the other)."""
        if self._syncing:
            return
        choice = str(change["new"])
        if choice.startswith(_FLOAT8_PREFIX):
            self._set_from_control("float8", choice.removeprefix(_FLOAT8_PREFIX))
        elif choice != WEIGHTS_OFF:
            self._set_from_control("weights", choice)
        elif self.float8 is not None:
            self._set_from_control("float8", None)
        else:
            self._set_from_control("weights", None)
        self._sync_weights_control()

    def _sync_weights_control(self: MemoryWidget) -> None:  # type: ignore[misc]
        """Show the traits on the dropdown, without feedback."""
        value = weights_control_value(self.weights, self.float8)
        self._show_quietly(self._weights_dropdown, value)

    def _pair_weights(self: MemoryWidget, moved: str | None) -> tuple[str, Any] | None:  # type: ignore[misc]
        """After ``weights`` or ``float8`` moved to a value, clear the other (an estimate
        takes one of the two). Returns the partner's name and old value where it moved."""
        partner = {"weights": "float8", "float8": "weights"}.get(moved or "")
        if partner is None or getattr(self, str(moved)) is None:
            return None
        old = getattr(self, partner)
        if old is None:
            return None
        self._pairing = True
        try:
            setattr(self, partner, None)
        finally:
            self._pairing = False
        return partner, old

    def _weights_settings(self: MemoryWidget) -> dict[str, Any]:  # type: ignore[misc]
        """``estimate``'s ``weights`` and ``float8`` for the two traits."""
        return {"weights": weights_arg(self.weights, self.precision), "float8": self.float8}

    def _weights_refusal(self: MemoryWidget) -> str:  # type: ignore[misc]
        """Why the estimate refuses the traits' weights or float8 at once, before any
        profiling ("" where it does not): the estimate's own checks, and a library that is
        not installed."""
        choice = weights_control_value(self.weights, self.float8)
        if choice == WEIGHTS_OFF or self._weights_held:
            return ""
        lib = missing_library(choice)
        if lib:
            return (
                f"{choice} is applied by {lib}, which is not installed: pip install {lib}"
                " (or: pip install 'vram_widget[optimizers]')"
            )
        mode = Mode(self.mode)
        lora_rank = self.lora_rank or None
        try:
            if self.float8 is not None:
                check_float8(
                    Float8(self.float8),
                    mode,
                    Precision(self.precision),
                    Weights(),
                    lora_rank,
                    self.gpus,
                    self._compile_settings().get("compile"),
                )
                layouts = {"tp": self.tp, "pp": self.pp, "ep": self.ep, "cp": self.cp}
                check_float8_layout(Float8(self.float8), self.gpus, self.strategy, layouts)
            else:
                weights = weights_arg(self.weights, self.precision)
                assert weights is not None
                check_quantized(weights, mode, lora_rank, self.gpus)
                check_weights_device(weights, self._profile.device)
        except ValueError as exc:
            return str(exc)
        return ""

    def _weights_needs_profiling(self: MemoryWidget) -> bool | None:  # type: ignore[misc]
        """Whether the traits' quantized or float8 step still has to be profiled (its
        sub-profile, or the step in it: ``ModelProfile.weights_cached``); None where
        neither is asked (the plain profile answers), False where the estimate refuses it
        at once (it says why)."""
        if self.weights is None and self.float8 is None and not self._weights_held:
            return None
        if self._weights_refusal():
            return False
        settings = self._settings()
        del settings["compute_capability"]  # the extras' only: no profile's key
        try:
            return not self._profile.weights_cached(self.batch_size, **settings)
        except (TypeError, ValueError):  # refused by the estimate, which says why
            return False


def recipe_weights_choice(key: str, value: object, precision: str) -> str | None:
    """A Recipe's ``weights`` (a Weights) or ``float8`` (a Float8) as the trait holds it,
    or None where the control has no such choice (a Weights with its own block size,
    compute dtype or modules kept; a Float8 with ``filter_fqns`` or ``all_gather``): the
    widget holds those as the Recipe gives them.

    Examples
    --------
    >>> recipe_weights_choice("weights", Weights("nf4", compute_dtype="bf16"), "bf16")
    'nf4'
    >>> recipe_weights_choice("weights", Weights("nf4", blocksize=128), "bf16") is None
    True
    >>> recipe_weights_choice("float8", Float8("rowwise"), "bf16")
    'rowwise'
    """
    if isinstance(value, Float8):
        if key != "float8" or value.filter_fqns or value.all_gather or value.recipe is None:
            return None
        return value.recipe.value
    if key != "weights" or not isinstance(value, Weights):
        return None
    for choice in WEIGHT_FORMATS:
        if weights_arg(choice, precision) == value:
            return choice
    return None
