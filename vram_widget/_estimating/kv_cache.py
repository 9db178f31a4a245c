"""Which generations with transformers' quantized KV cache (``QuantizedCache``, quanto
backend) are estimated, how, and the refusals of the others, before any profiling.

``QuantizedLayer.update`` (transformers/cache_utils.py) quantizes the prompt's keys and
values at the prefill, then at each decode step dequantizes the whole quantized part and
concatenates it with an unquantized residual, which grows by the new token; once the
residual and the new token reach ``residual_length`` (``residual_length +
key_states.shape[-2] >= self.residual_length``) it quantizes everything again and empties
the residual (a *flush*). After a prompt, the decode step ``j`` (1, 2, ...) holds ``j - 1``
tokens in the residual, so the flushes are at steps ``residual_length``, ``2 *
residual_length``, ...: a generation of ``new_tokens`` (the prefill and ``new_tokens - 1``
decode steps) has none while ``new_tokens <= residual_length``. Between flushes each step is
the one before with one residual token more, a pattern like the dynamic cache's, read from
the profile's ``DECODE_STEPS_PROFILED`` recorded decode steps. A flush is a step of another
shape, and the steps after it hold a longer quantized part (whose packed codes are rounded
up to whole bytes: not one line in the steps), so a generation whose extrapolated steps
would cross a flush is recorded whole instead (:func:`decode_steps_across_flush`: every
decode step a fake step, up to ``DECODE_STEPS_ACROSS_FLUSH_MAX``) and refused beyond that.
"""

from __future__ import annotations

from collections.abc import Mapping

from .decoding import DECODE_STEPS_PROFILED
from .recipe.generation import KV_BITS, RESIDUAL_LENGTH_DEFAULT

# The most decode steps a generation across a flush is recorded through: each is a fake step
# of the whole model (tiny Llama of tests/models.py, fitted in the batch: about 1.3 s a step
# on a loaded 2-core CPU), so a long generation is refused rather than recorded for minutes.
DECODE_STEPS_ACROSS_FLUSH_MAX = 32


def _residual_of(config: Mapping[str, object]) -> object:
    residual = config.get("residual_length")
    return RESIDUAL_LENGTH_DEFAULT if residual is None else residual


def decode_steps_across_flush(config: Mapping[str, object], new_tokens: int) -> int | None:
    """The decode steps to record for a generation of ``new_tokens`` with the quantized
    cache of ``config`` whose extrapolated steps would cross a flush (all of them:
    ``new_tokens - 1``); None where the profile's recorded steps, and the pattern past them,
    hold none (``new_tokens <= residual_length``, or no step past those recorded).

    Examples
    --------
    >>> decode_steps_across_flush({"residual_length": 4}, 10)
    9
    >>> decode_steps_across_flush({"residual_length": 4}, 5) is None  # 4 steps: recorded
    True
    >>> decode_steps_across_flush({}, 128) is None  # no flush before step 128
    True
    """
    residual = _residual_of(config)
    assert isinstance(residual, int)
    if new_tokens <= residual or new_tokens - 1 <= DECODE_STEPS_PROFILED:
        return None
    return new_tokens - 1


def check_quantized_cache(name: str, config: Mapping[str, object], new_tokens: int) -> None:
    """Refuse, by name, a generation with a quantized cache of ``config``
    (``generation_config.cache_config``: transformers' names and defaults) that is not
    estimated.

    Examples
    --------
    >>> check_quantized_cache("Llama", {"backend": "quanto", "nbits": 4}, 128)
    >>> check_quantized_cache("Llama", {"backend": "quanto", "residual_length": 8}, 20)
    >>> check_quantized_cache("Llama", {"backend": "quanto", "residual_length": 8}, 40)
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
    residual = _residual_of(config)
    if not isinstance(residual, int) or isinstance(residual, bool) or residual < 1:
        raise ValueError(
            f"{name}'s quantized KV cache has residual_length={residual!r}: a positive int "
            f"(transformers' default is {RESIDUAL_LENGTH_DEFAULT})"
        )
    steps = decode_steps_across_flush(config, new_tokens)
    if steps is not None and steps > DECODE_STEPS_ACROSS_FLUSH_MAX:
        most = DECODE_STEPS_ACROSS_FLUSH_MAX + 1
        raise ValueError(
            f"{name}'s quantized KV cache quantizes all of it again once {residual} new "
            f"tokens are in its unquantized residual (residual_length; QuantizedLayer.update"
            f", transformers/cache_utils.py): new_tokens={new_tokens} crosses that flush, "
            f"and a generation across it is estimated up to {most} new tokens (recorded "
            f"step by step: each decode step a fake step of the model). Ask for "
            f"new_tokens <= {max(residual, most)}, or a larger residual_length; "
            "measure(model, inputs, mode='generate', new_tokens=T) with the same "
            "generation_config measures it"
        )
