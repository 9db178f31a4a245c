"""Which generations with transformers' quantized KV cache (``QuantizedCache``, quanto
backend) are estimated, and the refusals of the others, before any profiling.

``QuantizedLayer.update`` (transformers/cache_utils.py) quantizes the prompt's keys and
values at the prefill, then at each decode step dequantizes the whole quantized part and
concatenates it with an unquantized residual, which grows by the new token; once the
residual and the new token reach ``residual_length`` (``residual_length +
key_states.shape[-2] >= self.residual_length``) it quantizes everything again and empties
the residual (a *flush*). After a prompt, the decode step ``j`` (1, 2, ...) holds ``j - 1``
tokens in the residual, so the first flush is at step ``residual_length``: a generation of
``new_tokens`` (the prefill and ``new_tokens - 1`` decode steps) has none while
``new_tokens <= residual_length``. Between flushes each step is the one before with one
residual token more, a pattern like the dynamic cache's; across a flush the steps are not
one pattern in the cache length, and are not estimated. The profile records
``DECODE_STEPS_PROFILED`` decode steps, which must hold no flush either.
"""

from __future__ import annotations

from collections.abc import Mapping

from .decoding import DECODE_STEPS_PROFILED
from .recipe.generation import KV_BITS, RESIDUAL_LENGTH_DEFAULT


def check_quantized_cache(name: str, config: Mapping[str, object], new_tokens: int) -> None:
    """Refuse, by name, a generation with a quantized cache of ``config``
    (``generation_config.cache_config``: transformers' names and defaults) that is not
    estimated.

    Examples
    --------
    >>> check_quantized_cache("Llama", {"backend": "quanto", "nbits": 4}, 128)
    >>> check_quantized_cache("Llama", {"backend": "quanto", "residual_length": 8}, 9)
    Traceback (most recent call last):
    ...
    ValueError: Llama's quantized KV cache quantizes all of it again once 8 ...
    """
    backend = config.get("backend", "quanto")
    if backend != "quanto":
        raise ValueError(
            f"{name}'s quantized KV cache with backend={backend!r} is not estimated (the "
            "quanto backend is: cache_config={'backend': 'quanto', ...}, or "
            "Generation(kv_cache='quantized')); measure(model, inputs, mode='generate', "
            "new_tokens=T) measures it"
        )
    bits = config.get("nbits", 4)
    if bits not in KV_BITS:
        raise ValueError(f"{name}'s quantized KV cache has nbits={bits!r}: quanto takes 2 or 4")
    for axis in ("axis_key", "axis_value"):
        if config.get(axis, 0) not in (0, None):
            raise ValueError(
                f"{name}'s quantized KV cache with {axis}={config[axis]!r} is not estimated "
                "(transformers' default 0 is)"
            )
    residual = config.get("residual_length")
    residual = RESIDUAL_LENGTH_DEFAULT if residual is None else residual
    if not isinstance(residual, int) or residual <= DECODE_STEPS_PROFILED:
        raise ValueError(
            f"{name}'s quantized KV cache with residual_length={residual!r} is not "
            f"estimated: the profile records {DECODE_STEPS_PROFILED} decode steps, which "
            f"must come before the first flush (residual_length > {DECODE_STEPS_PROFILED}; "
            f"transformers' default is {RESIDUAL_LENGTH_DEFAULT})"
        )
    if new_tokens > residual:
        raise ValueError(
            f"{name}'s quantized KV cache quantizes all of it again once {residual} new "
            f"tokens are in its unquantized residual (residual_length; QuantizedLayer.update"
            f", transformers/cache_utils.py): new_tokens={new_tokens} crosses that flush, "
            f"whose decode steps are not estimated. Ask for new_tokens <= {residual}, or a "
            "larger residual_length; measure(model, inputs, mode='generate', "
            "new_tokens=T) with the same generation_config measures it"
        )
