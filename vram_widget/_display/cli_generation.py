"""The command line's KV-cache flags (``--mode generate``): transformers' quantized KV cache
(``QuantizedCache``, optimum-quanto's backend) in place of the model's own cache, as
``estimate``'s flat keywords ``kv_cache``, ``kv_bits``, ``residual_length`` and
``q_group_size`` take it; and their checks, before any model is built or profiled.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .._estimating.kv_cache import check_quantized_cache
from .._estimating.options import Mode
from .._estimating.recipe.generation import (
    KV_BITS,
    KV_BITS_DEFAULT,
    Q_GROUP_SIZE_DEFAULT,
    RESIDUAL_LENGTH_DEFAULT,
    Generation,
    KVCache,
)

__all__ = [
    "check_kv_cache",
    "kv_cache_config",
    "kv_cache_flags",
    "kv_cache_keywords",
    "kv_cache_line",
]

# flag dest -> flag, of the quantized cache's own settings (each needs --kv-cache quantized)
_SETTINGS = (
    ("kv_bits", "--kv-bits"),
    ("residual_length", "--residual-length"),
    ("q_group_size", "--q-group-size"),
)


def kv_cache_flags(group: argparse._ArgumentGroup, count: Callable[[str], int]) -> None:
    """Add ``--kv-cache``, ``--kv-bits``, ``--residual-length`` and ``--q-group-size``
    (``count``: the parser's type of a whole number >= 1)."""
    group.add_argument(
        "--kv-cache",
        choices=[k.value for k in KVCache],
        help="with --mode generate: the KV cache generate keeps; quantized is transformers' "
        "QuantizedCache with the optimum-quanto backend (cache_implementation='quantized'), "
        "estimated within --residual-length new tokens, and across its flushes up to 33 "
        "new tokens (default: the model's own generation_config cache)",
    )
    group.add_argument(
        "--kv-bits",
        type=int,
        choices=sorted(KV_BITS, reverse=True),
        help=f"with --kv-cache quantized: bits per key and value (cache_config nbits; "
        f"default: {KV_BITS_DEFAULT}, transformers')",
    )
    group.add_argument(
        "--residual-length",
        type=count,
        metavar="N",
        help="with --kv-cache quantized: new tokens kept unquantized before the whole cache "
        f"is quantized again (default: {RESIDUAL_LENGTH_DEFAULT}, transformers')",
    )
    group.add_argument(
        "--q-group-size",
        type=count,
        metavar="N",
        help="with --kv-cache quantized: keys and values quantized in groups of N (default: "
        f"{Q_GROUP_SIZE_DEFAULT}, transformers')",
    )


def _generation(args: argparse.Namespace) -> Generation:
    """The flags' Generation (the defaults where left out)."""
    given = {dest: getattr(args, dest) for dest, _flag in _SETTINGS}
    return Generation(
        new_tokens=args.new_tokens,
        kv_cache=args.kv_cache,
        **{k: v for k, v in given.items() if v is not None},
    )


def check_kv_cache(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, as a usage error naming the flags, a KV-cache flag the step cannot take:
    ``--kv-cache`` outside ``--mode generate``, a quantized cache's setting without
    ``--kv-cache quantized``, and a generation the quantized cache's estimate refuses
    (``--new-tokens`` across its flush, past what is recorded step by step)."""
    settings = [flag for dest, flag in _SETTINGS if getattr(args, dest) is not None]
    if args.kv_cache is None:
        if settings:
            parser.error(
                f"{', '.join(settings)}: settings of the quantized KV cache; give "
                "--kv-cache quantized too (with --mode generate)"
            )
        return
    mode: Mode = args.mode
    if mode is not Mode.GENERATE:
        parser.error(f"--kv-cache is for --mode generate; got --mode {mode.value}")
    if args.new_tokens is None:
        return  # --mode generate without --new-tokens: refused by its own check
    try:
        check_quantized_cache("the model", _generation(args).cache_config(), args.new_tokens)
    except ValueError as exc:
        parser.error(
            f"--kv-cache quantized with --new-tokens {args.new_tokens} and "
            f"--residual-length {_generation(args).residual_length}: {exc}"
        )


def kv_cache_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """``estimate``'s keywords of the flags given (none without ``--kv-cache``)."""
    if args.kv_cache is None:
        return {}
    keywords: dict[str, Any] = {"kv_cache": args.kv_cache}
    for dest, _flag in _SETTINGS:
        if getattr(args, dest) is not None:
            keywords[dest] = getattr(args, dest)
    return keywords


def kv_cache_config(args: argparse.Namespace) -> dict[str, object] | None:
    """The quantized cache's ``cache_config`` (transformers' names), None without one."""
    return None if args.kv_cache is None else _generation(args).cache_config()


def kv_cache_line(args: argparse.Namespace) -> str | None:
    """The KV cache asked for, in words (None: the model's own).

    Examples
    --------
    >>> kv_cache_line(argparse.Namespace(
    ...     kv_cache="quantized", kv_bits=2, residual_length=None, q_group_size=None,
    ...     new_tokens=64))
    'KV cache: quantized (quanto), 2 bits, residual 128 tokens, groups of 64'
    """
    if args.kv_cache is None:
        return None
    g = _generation(args)
    return (
        f"KV cache: {g.kv_cache.value if g.kv_cache else ''} (quanto), {g.kv_bits} bits, "
        f"residual {g.residual_length} tokens, groups of {g.q_group_size}"
    )
