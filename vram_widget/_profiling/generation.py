"""The generation pass: Hugging Face's own ``model.generate`` recorded on fake tensors, for
the prompt's prefill and the first few decode steps.

Greedy generation is the prompt's forward (the *prefill*, which fills the KV cache), then one
forward per further token (a *decode step*) on the one new token, with the cache of every
earlier one. The memory of a decode step depends on how many tokens the cache holds, and
every step after the first few is the same step at a cache one token longer
(``decoding``, numpy, turns the recorded steps into any number of them). So the pass
records generate's set-up, the prefill and :data:`DECODE_STEPS_PROFILED` decode steps, and
stops generate at the start of the next forward.

The run is Hugging Face's code itself (``DynamicCache`` growing by ``torch.cat``, a
``StaticCache``, sliding-window layers, logits processors, the bookkeeping of the generated
ids), so that what the cache and the loop allocate is what they allocate for real. Fake
tensors hold no values, and generate reads a few: whether the prompt has padding or special
tokens, and whether every sequence has finished. :class:`GenerationValues` answers them as
for an unpadded prompt that has not finished: a test that every position is a real token
(``(attention_mask == 1).all()``) holds, a test for any padding or stop token does not, and
the loop does not stop before the pre-hook ends it.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .._estimating.decoding import DECODE_STEPS_PROFILED
from .._estimating.options import Category, Phase, Precision
from .fake import FakeTensor, TorchDispatchMode, quieted
from .quantized_cache import quanto_on_fake
from .recorder import Recorder
from .step import ModelInputs, generate_pass, restored_modules

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_ALL_OPS = frozenset(
    {
        torch.ops.aten.all.default,
        torch.ops.aten.all.dim,
        torch.ops.aten.all.dims,
    }
)


# The keyword generate hands each forward its cache under: ``past_key_values`` up to
# transformers 5.23, ``cache`` from 5.24 (GPT2LMHeadModel.forward:
# ``@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")``).
_CACHE_KEYWORDS = ("past_key_values", "cache")


class _Enough(Exception):
    """Raised by the root's pre-hook once the profiled steps are recorded."""


class GenerationValues(TorchDispatchMode):
    """Answers generate's reads of fake tensor values as for an unpadded prompt whose
    sequences have not finished: the output of an ``all`` reduction reads true (every
    position of the mask is a real token); any other read reads false or 0 (no padding, no
    stop token among the prompt's, ``unfinished_sequences.max() == 0`` false). A fake tensor
    that carries a constant (made from a literal: the special token ids) reads as it."""

    def __init__(self) -> None:
        super().__init__()
        self._all_outputs: dict[int, weakref.ref[Any]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _LOCAL_SCALAR and isinstance(args[0], FakeTensor):
            t = args[0]
            constant = getattr(t, "constant", None)
            if constant is not None:
                return constant.item()
            ref = self._all_outputs.get(id(t))
            answer = ref is not None and ref() is t
            if t.dtype is torch.bool:
                return answer
            return int(answer) if not t.is_floating_point() else float(answer)
        out = func(*args, **kwargs)
        if func in _ALL_OPS and isinstance(out, torch.Tensor):
            self._all_outputs[id(out)] = weakref.ref(out)
        return out


def _tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors a cache object holds: Hugging Face's Cache classes (their layers' keys and
    values, an encoder-decoder's two caches) or the legacy tuples of tuples; a tensor
    subclass's inner tensors (``__tensor_flatten__``) in its place."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is None or isinstance(obj, FakeTensor) or depth > 5:
            yield obj
            return
        # a tensor subclass (optimum-quanto's quantized keys and values: packed codes,
        # scales, shifts) holds its bytes in its inner tensors
        for name in flatten()[0]:
            yield from _tensors_in(getattr(obj, name), depth + 1)
    elif depth > 5:
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item, depth + 1)
    elif type(obj).__module__.startswith("transformers") and hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            yield from _tensors_in(item, depth + 1)


def recorded_generation(
    model: Any,
    inputs: ModelInputs,
    precision: Precision,
    rec: Recorder,
    context: Any = None,
    decode_steps: int = DECODE_STEPS_PROFILED,
    max_new_tokens: int | None = None,
) -> tuple[tuple[int, ...], np.ndarray]:
    """Run ``model.generate`` on ``inputs`` under ``rec`` (inside the caller's fake mode)
    until ``decode_steps`` decode steps are recorded (``max_new_tokens``: what generate is
    asked for, which sizes a ``StaticCache``; by default the recorded forwards and one more).
    Returns the event index where each forward starts (the prefill's, then each decode
    step's) and, last, where the recording stopped: the step ``k`` spans
    ``starts[k]:starts[k + 1]``, what generate does around its forward included; the events
    before ``starts[0]`` are its set-up. The cache's storages are marked KV cache. Also
    returns the FLOPs per row counted before each of those points (steps x rows)."""
    starts: list[int] = []
    flops: list[np.ndarray] = []

    def before_forward(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        if starts:  # what the cache holds now, the last forward put there
            cache = next((kwargs[k] for k in _CACHE_KEYWORDS if kwargs.get(k) is not None), None)
            ids = (rec.storage_id(t) for t in _tensors_in(cache))
            rec.set_category([s for s in ids if s is not None], Category.KV_CACHE)
        starts.append(rec.event_count())
        flops.append(rec.flops_forward.copy())
        if len(starts) > decode_steps + 1:
            rec.stop()
            raise _Enough
        rec.set_phase(Phase.PREFILL if len(starts) == 1 else Phase.DECODE)

    rec.set_phase(Phase.PREFILL)
    handle = model.register_forward_pre_hook(before_forward, with_kwargs=True)
    try:
        # the model as it was, whatever generate sets on it (the static cache's size)
        with restored_modules(model):
            _generate(model, inputs, precision, context, decode_steps, max_new_tokens)
    except _Enough:
        pass
    finally:
        handle.remove()
    if len(starts) != decode_steps + 2:
        raise RuntimeError(
            f"generate ran {len(starts)} forwards, not the {decode_steps + 2} asked for"
        )
    return tuple(starts), np.stack(flops)


def _generate(
    model: Any,
    inputs: ModelInputs,
    precision: Precision,
    context: Any,
    decode_steps: int,
    max_new_tokens: int | None,
) -> None:
    """generate asked for ``max_new_tokens`` (at least one more than the recorded forwards,
    which the pre-hook stops it after)."""
    # generate's notes to the user (no attention mask, pad token set to eos) are about the
    # user's own calls; a profiling run is not one
    quantized = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    packing = quanto_on_fake() if quantized == "quantized" else contextlib.nullcontext()
    with quieted("transformers", logging.ERROR), GenerationValues(), packing:
        generate_pass(
            model,
            inputs,
            precision,
            "cpu",
            max(decode_steps + 2, max_new_tokens or 0),
            context=context,
        )


def prompt_inputs(inputs: Any) -> Any:
    """A batch as generate takes it: ``labels`` left out (a generation has no targets, and a
    forward given them computes a loss at every step), so that they are not counted either."""
    if isinstance(inputs, dict):
        return {k: v for k, v in inputs.items() if k != "labels"}
    return inputs


def cache_config_of(model: Any) -> tuple[tuple[str, object], ...]:
    """The model's ``generation_config.cache_config`` (the settings of its cache
    implementation: ``QuantizedCache``'s backend, nbits, residual_length...) as sorted
    items; () where it has none."""
    config = getattr(getattr(model, "generation_config", None), "cache_config", None)
    if not isinstance(config, dict):
        config = getattr(config, "__dict__", None) or {}
    return tuple(sorted((str(k), v) for k, v in config.items() if k != "config"))


def generation_limit(model: Any) -> tuple[bool, int | None, str | None]:
    """Whether ``model`` generates with a KV cache (a Hugging Face model: ``generate()`` and
    a config), the most positions it takes (its config's ``max_position_embeddings``,
    GPT-2's ``n_positions``; None where it gives none), and the cache implementation its
    generation config asks for (None: the default ``DynamicCache``)."""
    config = getattr(model, "config", None)
    if not callable(getattr(model, "generate", None)) or config is None:
        return False, None, None
    cache = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    cache = None if cache in (None, "dynamic") else str(cache)
    for name in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, name, None)
        if isinstance(limit, int) and not isinstance(limit, bool):
            return True, limit, cache
    return True, None, cache
