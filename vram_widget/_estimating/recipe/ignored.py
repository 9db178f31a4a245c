"""What a reader of someone else's config could not model: named, never dropped."""

from __future__ import annotations

import warnings
from collections.abc import Sequence


class RecipeSettingIgnored(UserWarning):
    """A setting of a training config that changes memory but that the estimate does not
    model: the Recipe read from the config lists it in ``Recipe.ignored`` (and every estimate
    made from that Recipe in ``MemoryEstimate.ignored``)."""


def warn_ignored(source: str, ignored: Sequence[str]) -> None:
    """One :class:`RecipeSettingIgnored` naming every ignored setting of ``source``."""
    if ignored:
        warnings.warn(
            f"{source}: not estimated, so the estimate leaves out what these settings change: "
            + "; ".join(ignored),
            RecipeSettingIgnored,
            stacklevel=4,
        )


def refuse(source: str, setting: str, why: str) -> ValueError:
    """The error for a setting that changes the step too much for an estimate without it."""
    return ValueError(
        f"{source}: {setting} is not estimated ({why}); remove it to estimate the rest"
    )
