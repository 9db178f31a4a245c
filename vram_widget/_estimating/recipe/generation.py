"""What a generating step produces after its prompt."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Generation:
    """Settings of ``mode="generate"``.

    Attributes
    ----------
    new_tokens : int, optional
        Tokens generated after the prompt (``mode="generate"`` only).

    Examples
    --------
    >>> Generation(new_tokens=32).new_tokens
    32
    """

    new_tokens: int | None = None
