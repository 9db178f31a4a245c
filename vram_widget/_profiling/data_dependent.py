"""Branches a model takes on tensor values, decided for the fake run as a real step decides
them.

A fake tensor has shapes and no values, so model code that branches on values either fails
(the profiler then falls back to a real run) or takes a branch the real step would not.
Two kinds are decided here instead:

* **Randomness that changes the graph.** Hugging Face's LayerDrop skips a random layer per
  step (``if self.training and torch.rand([]) < self.layerdrop: continue``, in ~50 models:
  wav2vec2, HuBERT, BART, Whisper, ...). Fake tensors cannot decide the comparison, and two
  real runs drop different layers. The estimate is for the step that drops none: the worst
  case, and the one any step can hit.
* **Hugging Face's all-ones mask skip.** ``transformers/masking_utils.py`` drops a padding
  mask that holds only ones (``_ignore_causal_mask_sdpa``, ``_ignore_bidirectional_mask_sdpa``):
  SDPA then runs without a mask, ``is_causal=True``, and a grouped-query model passes
  ``enable_gqa=True`` instead of repeating its key/value heads (``repeat_kv``). Both refuse to
  drop a mask for which ``is_tracing(mask)`` holds, and that is every FakeTensor, so the fake
  run built the (B, 1, S, S) fp32 mask and the repeated k and v that the real step never
  builds: 8 * E * S + 4 * S**2 bytes per sample per layer for a GQA model of hidden size E at
  S tokens (+2.4 % of a small Llama's step), 4 * S**2 for the others (OPT, Phi, BART, ALBERT).
  While a run is profiled, a fake mask reaching either predicate holds what the example's
  masks hold: where every ``*attention_mask*`` input of the example is all ones, or there is
  none (the model then makes its own ``torch.ones`` mask, as BART's decoder does), it is
  dropped, as the predicate drops an all-ones mask in a training or inference step (no
  cache: kv_length == q_length); a padded example mask is kept. A tensor ``q_offset`` (a
  fake ``cache_position``) is refused as traced too; it is passed as -1, which keeps the mask
  wherever the offset would decide. Before that, ``find_packed_sequence_indices`` looks for
  several sequences packed in a row (position ids that restart) and forbids the skip for any
  position ids it cannot read: fake ones are taken as the example's (the model's own
  ``arange`` where the example gives none). A model that
  derives its mask from token values (``input_ids != pad``) is taken as unpadded.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .fake import FakeTensor

# -- LayerDrop -------------------------------------------------------------------------------

# Each knob: a module or config attribute whose name ends so, and the value that runs every
# layer.
_WORST_CASE_KNOBS: dict[str, float] = {"layerdrop": 0.0}

Knob = tuple[Any, str, float, float]  # (owner, attribute, value, the value that runs all)


def _attributes(owner: object) -> dict[str, Any]:
    """An object's attributes: its ``__dict__`` and the slots of its classes. A
    ``@dataclass(slots=True)`` has no ``__dict__`` (torchtitan 0.3.0's model configs, e.g.
    ``Decoder.Config`` in ``models/common/decoder.py``, are such dataclasses); a slot never
    set is left out."""
    found = dict(getattr(owner, "__dict__", {}))
    for cls in type(owner).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in found or name in ("__dict__", "__weakref__"):
                continue
            try:
                found[name] = getattr(owner, name)
            except AttributeError:
                continue
    return found


def graph_randomness(model: torch.nn.Module) -> list[Knob]:
    """Every knob set to randomize the graph: module attributes and those of each module's
    ``config`` (once per config object)."""
    found: list[Knob] = []
    seen: set[int] = set()
    for module in model.modules():
        for owner in (module, getattr(module, "config", None)):
            if owner is None or id(owner) in seen:
                continue
            seen.add(id(owner))
            for name, value in _attributes(owner).items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                for suffix, off in _WORST_CASE_KNOBS.items():
                    if name.endswith(suffix) and value != off:
                        found.append((owner, name, value, off))
    return found


@contextlib.contextmanager
def worst_case_graph(knobs: list[Knob]) -> Iterator[None]:
    """Set the knobs to the value that runs every layer, and back, whatever happens."""
    try:
        for owner, name, _value, off in knobs:
            setattr(owner, name, off)
        yield
    finally:
        for owner, name, value, _off in knobs:
            setattr(owner, name, value)


# -- Hugging Face's all-ones mask skip -------------------------------------------------------

_MASK_PREDICATES = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


def _named_arguments(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    try:
        return dict(inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {**kwargs, **{f"[{i}]": a for i, a in enumerate(args)}}


def masks_all_ones(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> bool:
    """Whether every attention-mask input of the example holds only ones (True without one;
    False for a mask on the meta device, whose values are unknown)."""
    masks = [
        value
        for name, value in _named_arguments(model, args, kwargs).items()
        if isinstance(value, torch.Tensor) and "attention_mask" in name
    ]
    return all(not m.is_meta and bool((m == 1).all()) for m in masks)


@contextlib.contextmanager
def example_mask_values(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Iterator[None]:
    """While active, Hugging Face's mask predicates see a fake padding mask as the example's
    masks are (dropped where they hold only ones), and its packed-sequence test sees fake
    position ids as the example's (a no-op without transformers loaded)."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    named = _named_arguments(model, args, kwargs)
    patches: dict[str, Any] = {}
    if masks_all_ones(model, args, kwargs):
        for name in _MASK_PREDICATES:
            if hasattr(masking, name):
                patches[name] = _mask_predicate(getattr(masking, name))
    if hasattr(masking, "find_packed_sequence_indices"):
        patches["find_packed_sequence_indices"] = _packing_test(
            masking.find_packed_sequence_indices, named.get("position_ids")
        )
    saved = {name: getattr(masking, name) for name in patches}
    try:
        for name, patched in patches.items():
            setattr(masking, name, patched)
        yield
    finally:
        for name, original in saved.items():
            setattr(masking, name, original)


def _mask_predicate(original: Any) -> Any:
    signature = inspect.signature(original)

    def predicate(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        values = bound.arguments
        if isinstance(values.get("padding_mask"), FakeTensor):
            values["padding_mask"] = None  # the example's masks hold ones only
        if isinstance(values.get("q_offset"), FakeTensor):
            # A tensor offset (from a fake cache_position) is refused as traced too. It
            # matters only where the query is not the whole key (a cache's prefill), which -1
            # keeps masked; without a cache q_length == kv_length decides alone.
            values["q_offset"] = -1
        return original(*bound.args, **bound.kwargs)

    return predicate


def _packing_test(original: Any, example_positions: Any) -> Any:
    """``find_packed_sequence_indices`` answers None (one sequence per row: the mask may be
    skipped) only for position ids it can read; for fake ones it returns the packing mask,
    which forbids the skip. Position ids the model made itself (no ``position_ids`` input)
    are an ``arange``, one sequence per row; given ones are as the example's are."""
    example_packed = isinstance(example_positions, torch.Tensor) and (
        example_positions.is_meta or original(example_positions) is not None
    )

    def find_packed_sequence_indices(position_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(position_ids, FakeTensor) and not example_packed:
            return None
        return original(position_ids, *args, **kwargs)

    return find_packed_sequence_indices


__all__ = ["example_mask_values", "graph_randomness", "masks_all_ones", "worst_case_graph"]
