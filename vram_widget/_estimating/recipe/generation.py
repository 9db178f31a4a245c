"""What a generating step produces after its prompt, and the KV cache it keeps."""

from __future__ import annotations

import dataclasses

from ..options import StrEnum

# transformers' QuantizedCache defaults (transformers/cache_utils.py, QuantizedLayer.__init__:
# nbits=4, q_group_size=64, residual_length=128), and the bits its quanto backend takes
# (QuantoQuantizedLayer.__init__: "`nbits` for `quanto` backend has to be one of [`2`, `4`]")
KV_BITS_DEFAULT = 4
KV_BITS = (2, 4)
Q_GROUP_SIZE_DEFAULT = 64
RESIDUAL_LENGTH_DEFAULT = 128
# the quantized cache's settings and their defaults (set only with kv_cache="quantized")
QUANTIZED_DEFAULTS: dict[str, int] = {
    "kv_bits": KV_BITS_DEFAULT,
    "residual_length": RESIDUAL_LENGTH_DEFAULT,
    "q_group_size": Q_GROUP_SIZE_DEFAULT,
}


class KVCache(StrEnum):
    """The KV cache generate keeps, as ``generation_config.cache_implementation`` names it:
    ``"quantized"`` is transformers' ``QuantizedCache`` with the quanto backend."""

    QUANTIZED = "quantized"


@dataclasses.dataclass(frozen=True)
class Generation:
    """Settings of ``mode="generate"``.

    Attributes
    ----------
    new_tokens : int, optional
        Tokens generated after the prompt (``mode="generate"`` only).
    kv_cache : {"quantized"}, optional
        The KV cache generate keeps: None, the one the model's own
        ``generation_config.cache_implementation`` asks for (``DynamicCache`` by default);
        ``"quantized"``, transformers' ``QuantizedCache`` with the quanto backend
        (``cache_implementation="quantized"``, ``cache_config={"backend": "quanto", ...}``).
    kv_bits : {4, 2}
        The quantized cache's bits per key and value (``cache_config["nbits"]``; 4 by
        default, as transformers').
    residual_length : int
        New tokens the quantized cache keeps unquantized before it quantizes the whole cache
        again (``cache_config["residual_length"]``; 128 by default, as transformers').
    q_group_size : int
        Keys and values quantized in groups of this many (``cache_config["q_group_size"]``;
        64 by default, as transformers').

    Examples
    --------
    >>> Generation(new_tokens=32).new_tokens
    32
    >>> g = Generation(new_tokens=32, kv_cache="quantized", kv_bits=2)
    >>> g.cache_config()
    {'backend': 'quanto', 'nbits': 2, 'q_group_size': 64, 'residual_length': 128}
    >>> Generation(kv_cache="quantized", kv_bits=8)
    Traceback (most recent call last):
    ...
    ValueError: kv_bits=8: the quantized KV cache (quanto backend) takes 2 or 4 bits
    >>> Generation(kv_bits=2)
    Traceback (most recent call last):
    ...
    ValueError: kv_bits=2: settings of the quantized KV cache, which kv_cache=None ...
    """

    new_tokens: int | None = None
    kv_cache: KVCache | None = None
    kv_bits: int = KV_BITS_DEFAULT
    residual_length: int = RESIDUAL_LENGTH_DEFAULT
    q_group_size: int = Q_GROUP_SIZE_DEFAULT

    def __post_init__(self) -> None:
        kind = self.kv_cache
        if kind is not None and not isinstance(kind, KVCache):
            valid = ", ".join(repr(k.value) for k in KVCache)
            if kind not in {k.value for k in KVCache}:
                raise ValueError(
                    f"unknown kv_cache {kind!r}; valid: None (the model's own "
                    f"generation_config.cache_implementation) or {valid}"
                )
            object.__setattr__(self, "kv_cache", KVCache(kind))
        if self.kv_bits not in KV_BITS or isinstance(self.kv_bits, bool):
            raise ValueError(
                f"kv_bits={self.kv_bits!r}: the quantized KV cache (quanto backend) takes "
                "2 or 4 bits"
            )
        for name in ("residual_length", "q_group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: a positive int")
        if self.kv_cache is None:  # settings of a cache not asked for: never dropped silently
            given = [
                f"{name}={getattr(self, name)!r}"
                for name, default in QUANTIZED_DEFAULTS.items()
                if getattr(self, name) != default
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: settings of the quantized KV cache, which "
                    "kv_cache=None (the model's own cache) does not take; add "
                    "kv_cache='quantized', or leave them out"
                )

    def cache_config(self) -> dict[str, object]:
        """``generation_config.cache_config`` of this quantized cache, as generate takes it
        (``QuantizedCache(backend=..., nbits=..., ...)``)."""
        return {
            "backend": "quanto",
            "nbits": self.kv_bits,
            "q_group_size": self.q_group_size,
            "residual_length": self.residual_length,
        }
