"""The batch x sequence-length trade-off at a fixed memory budget (numpy, no torch).

"Batch 8 at 4k tokens, or batch 32 at 1k?": at each sequence length the largest batch
whose estimate fits is a point of the *frontier*; every setting under it fits and none above
it does. :func:`batch_seq_frontier` walks a grid of lengths with a ``max_batch_size``
function, so it is exactly as right as the estimates it is made of: where the profile holds
memory as a verified polynomial in the length, every length is numpy arithmetic; where not,
only the lengths already profiled are answered, and :attr:`Frontier.complete` says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["Frontier", "batch_seq_frontier", "length_grid"]


@dataclass(frozen=True)
class Frontier:
    """The largest batch that fits at each sequence length, for one capacity and setting.

    Attributes
    ----------
    capacity_bytes : int
        The budget every point was fitted to (the estimates' ``total_bytes`` against it).
    seq_lens : numpy.ndarray
        Lengths answered, ascending (int64).
    max_batch_sizes : numpy.ndarray
        The largest batch that fits at each of them (0: not even one sample fits).
    complete : bool
        False where some lengths of the grid were left out because answering them would
        need a profiling run each (memory is no verified polynomial in the length there).
    """

    capacity_bytes: int
    seq_lens: np.ndarray
    max_batch_sizes: np.ndarray
    complete: bool

    @property
    def tokens_per_step(self) -> np.ndarray:
        """``seq_lens * max_batch_sizes``: the most tokens one step can take at each length."""
        return self.seq_lens * self.max_batch_sizes

    def max_batch_at(self, seq_len: int) -> int | None:
        """The frontier's batch at ``seq_len`` if that length was answered, else None."""
        hit = np.flatnonzero(self.seq_lens == seq_len)
        return int(self.max_batch_sizes[hit[0]]) if len(hit) else None


def length_grid(limit: int, extra: Iterable[int] = (), steps_per_octave: int = 2) -> np.ndarray:
    """Lengths from 1 to ``limit`` spaced evenly on a log axis (``steps_per_octave`` per
    doubling, rounded to integers), plus ``extra`` lengths (the example's, the current one).

    Examples
    --------
    >>> length_grid(16).tolist()          # 2**(k/2) for k = 0..8, rounded
    [1, 2, 3, 4, 6, 8, 11, 16]
    >>> length_grid(10, extra=[7]).tolist()
    [1, 2, 3, 4, 6, 7, 8, 10]
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    octaves = np.log2(limit)
    k = np.arange(int(np.floor(octaves * steps_per_octave)) + 1)
    grid = np.rint(2.0 ** (k / steps_per_octave)).astype(np.int64)
    points = [*grid.tolist(), limit, *(int(e) for e in extra if 1 <= int(e) <= limit)]
    return np.unique(np.asarray(points, dtype=np.int64))


def batch_seq_frontier(
    max_batch_size: Callable[[int], int],
    lengths: Iterable[int],
    capacity_bytes: int,
    answerable: Callable[[int], bool] = lambda _length: True,
) -> Frontier:
    """The frontier over ``lengths``: ``max_batch_size(length)`` at each length that
    ``answerable`` allows (the others are left out and make the frontier incomplete).

    The largest batch never grows with the length (each event's bytes are polynomials with
    non-negative growth in both), so the walk stops at the first length where none fits and
    marks every longer one 0 without asking.

    Examples
    --------
    >>> # a toy step: 100 bytes per token, 1,000 bytes resident, 10 kB capacity
    >>> def largest(length):
    ...     return max(0, (10_000 - 1_000) // (100 * length))
    >>> f = batch_seq_frontier(largest, [1, 10, 90, 100], 10_000)
    >>> f.max_batch_sizes.tolist()      # 9000 // 100 = 90; // 1000 = 9; // 9000 = 1; none
    [90, 9, 1, 0]
    """
    answered: list[int] = []
    batches: list[int] = []
    complete = True
    none_fits = False
    for length in sorted(set(int(n) for n in lengths)):
        if none_fits:
            answered.append(length)
            batches.append(0)
            continue
        if not answerable(length):
            complete = False
            continue
        batch = max_batch_size(length)
        answered.append(length)
        batches.append(batch)
        none_fits = batch == 0
    return Frontier(
        capacity_bytes=int(capacity_bytes),
        seq_lens=np.asarray(answered, dtype=np.int64),
        max_batch_sizes=np.asarray(batches, dtype=np.int64),
        complete=complete,
    )
