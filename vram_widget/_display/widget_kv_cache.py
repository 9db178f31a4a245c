"""The widget's KV-cache control (mode "generate"): the model's own cache or transformers'
quantized cache (``QuantizedCache``, optimum-quanto's backend) at 4 or 2 bits, one dropdown in
the generation row over two traits, ``kv_cache`` and ``kv_bits`` (estimate's keywords of the
same names).

``kv_bits`` is a setting of the quantized cache alone: with ``kv_cache`` None it waits, as
the whole setting waits outside mode "generate" (the row is hidden then). A choice the
estimate refuses (a generation whose new tokens cross the cache's flush, ``new_tokens >
residual_length``; optimum-quanto not installed) keeps the last setting, the headline and
the status saying why. A choice not profiled yet is a sub-profile (a meta copy whose
generation config asks for the cache: seconds), behind the busy label.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import traitlets

from .._estimating.recipe.generation import KV_BITS, KV_BITS_DEFAULT, QUANTIZED_DEFAULTS, KVCache

if TYPE_CHECKING:
    from .widget import MemoryWidget

__all__ = [
    "KV_CACHE_CHOICES",
    "KV_CACHE_OWN",
    "KV_CACHE_TOOLTIP",
    "KVBitsTrait",
    "KVCacheMixin",
    "KVCacheTrait",
    "check_kv_cache_forms",
    "kv_cache_control_value",
]

KV_CACHE_OWN = "own"
"""The dropdown's choice of the model's own cache (``kv_cache`` None)."""

KV_CACHE_CHOICES: tuple[tuple[str, str], ...] = (
    ("model's own", KV_CACHE_OWN),
    ("quantized 4-bit", "quantized-4"),
    ("quantized 2-bit", "quantized-2"),
)
"""The dropdown's (label, value) pairs: the model's own cache, or ``quantized-<bits>``."""

KV_CACHE_TOOLTIP = (
    "the KV cache generate keeps: the model's own (its generation_config's, DynamicCache by "
    "default) or transformers' QuantizedCache (optimum-quanto backend) at 4 or 2 bits, "
    "residual_length 128 and groups of 64 (transformers' defaults): the prompt's keys and "
    "values quantized, the new tokens kept unquantized up to residual_length; a generation "
    "past it (a flush) is not estimated. A new choice profiles once (seconds)"
)

# optimum-quanto, whose quantizer the cache's profiling run imports (quantized_cache.py)
_QUANTO = "optimum.quanto"


def kv_cache_control_value(kv_cache: str | None, kv_bits: int) -> str:
    """The dropdown's value for the two traits.

    Examples
    --------
    >>> kv_cache_control_value(None, 2), kv_cache_control_value("quantized", 2)
    ('own', 'quantized-2')
    """
    return KV_CACHE_OWN if kv_cache is None else f"{kv_cache}-{kv_bits}"


class KVCacheTrait(traitlets.Unicode):
    """``kv_cache`` as the control holds it: None (the model's own) or ``"quantized"``."""

    info_text = "None (the model's own cache) or 'quantized'"

    def validate(self, obj: Any, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str) and value in {k.value for k in KVCache}:
            return value
        valid = ", ".join(repr(k.value) for k in KVCache)
        raise traitlets.TraitError(
            f"kv_cache={value!r}: valid values are None (the model's own cache) or {valid}"
        )


class KVCacheMixin:
    """The kv_cache / kv_bits pair and its dropdown, for :class:`~.widget.MemoryWidget`
    (``self`` is the widget)."""

    def _build_kv_cache_control(self: MemoryWidget) -> widgets.Dropdown:  # type: ignore[misc]
        """The dropdown, a view of the two traits (a refused choice leaves them as they
        were and the control shows them again)."""
        dropdown = widgets.Dropdown(
            options=list(KV_CACHE_CHOICES),
            value=kv_cache_control_value(self.kv_cache, self.kv_bits),
            description="KV cache",
            tooltip=KV_CACHE_TOOLTIP,
            style={"description_width": "initial"},
            layout={"width": "230px"},
        )
        dropdown.observe(self._kv_cache_chosen, "value")
        self._kv_cache_dropdown = dropdown
        return dropdown

    def _kv_cache_chosen(self: MemoryWidget, change: dict[str, Any]) -> None:  # type: ignore[misc]
        """The dropdown moved: one estimate. Bits chosen with the model's own cache are set
        first without one (they wait while the cache is the model's own), then the cache."""
        if self._syncing:
            return
        choice = str(change["new"])
        if choice == KV_CACHE_OWN:
            self._set_from_control("kv_cache", None)
        else:
            kind, bits = choice.rsplit("-", 1)
            if self.kv_cache is None:
                self._pairing = True  # no estimate: the bits wait for the cache
                try:
                    self.kv_bits = int(bits)
                finally:
                    self._pairing = False
                self._set_from_control("kv_cache", kind)
            else:
                self._set_from_control("kv_bits", int(bits))
        self._sync_kv_cache_control()

    def _sync_kv_cache_control(self: MemoryWidget) -> None:  # type: ignore[misc]
        """Show the traits on the dropdown, without feedback."""
        value = kv_cache_control_value(self.kv_cache, self.kv_bits)
        self._show_quietly(self._kv_cache_dropdown, value)

    @property
    def _kv_cache_active(self: MemoryWidget) -> bool:  # type: ignore[misc]
        """Whether the estimate shown is of the quantized cache (chosen, in mode generate)."""
        return self.kv_cache is not None and self._generating

    def _kv_cache_settings(self: MemoryWidget) -> dict[str, Any]:  # type: ignore[misc]
        """``estimate``'s ``kv_cache`` and ``kv_bits`` for the two traits; with the model's
        own cache (or outside mode generate) none, and a Recipe's quantized-cache settings
        held fixed (``residual_length``, ``q_group_size``) back at their defaults: they wait
        with the cache."""
        if not self._kv_cache_active:
            return {k: QUANTIZED_DEFAULTS[k] for k in self._fixed if k in QUANTIZED_DEFAULTS}
        return {"kv_cache": self.kv_cache, "kv_bits": self.kv_bits}

    def _kv_cache_refusal(self: MemoryWidget) -> str:  # type: ignore[misc]
        """Why the quantized cache cannot be estimated at once ("" where it can): the
        library that is not installed."""
        if self._kv_cache_active and importlib.util.find_spec(_QUANTO) is None:
            return (
                "the quantized KV cache is optimum-quanto's (transformers' QuantizedCache "
                "backend), which is not installed: pip install optimum-quanto"
            )
        return ""

    def _kv_cache_needs_profiling(self: MemoryWidget) -> bool | None:  # type: ignore[misc]
        """Whether the quantized cache's sub-profile (or the step in it) is still to be
        made; None where the model's own cache is asked (the other checks answer), False
        where the estimate refuses the setting at once (it says why)."""
        if not self._kv_cache_active:
            return None
        if self._kv_cache_refusal():
            return False
        settings = self._settings()
        del settings["compute_capability"]  # the extras' only: no profile's key
        try:
            return not self._profile.weights_cached(self.batch_size, **settings)
        except (TypeError, ValueError):  # refused by the estimate, which says why
            return False


def check_kv_cache_forms(settings: Mapping[str, Any]) -> None:
    """``kv_cache`` and ``kv_bits`` among ``show_memory``'s settings, checked before the
    model is run (a ValueError naming the valid values).

    Examples
    --------
    >>> check_kv_cache_forms({"kv_cache": "quantized", "kv_bits": 2})
    >>> check_kv_cache_forms({"kv_bits": 8})
    Traceback (most recent call last):
    ...
    ValueError: invalid setting: kv_bits=8: the quantized KV cache (quanto backend) takes 2 ...
    """
    try:
        if "kv_cache" in settings:
            KVCacheTrait().validate(None, settings["kv_cache"])
        if "kv_bits" in settings:
            _check_bits(settings["kv_bits"])
    except traitlets.TraitError as exc:
        raise ValueError(f"invalid setting: {exc}") from None


def _check_bits(value: object) -> int:
    """``kv_bits`` as the trait holds it (a TraitError naming the valid values)."""
    if isinstance(value, bool) or value not in KV_BITS:
        raise traitlets.TraitError(
            f"kv_bits={value!r}: the quantized KV cache (quanto backend) takes 2 or 4 bits"
        )
    return int(value)


class KVBitsTrait(traitlets.Int):
    """``kv_bits``: 4 (transformers' default) or 2."""

    info_text = "4 or 2"

    def __init__(self) -> None:
        super().__init__(KV_BITS_DEFAULT)

    def validate(self, obj: Any, value: Any) -> Any:
        return _check_bits(value)
