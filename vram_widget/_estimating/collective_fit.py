"""A parallel rank's collectives across batch sizes and lengths: the collectives each run
recorded (``_profiling/collectives.py``), their payloads fitted as polynomials as the
table fits a run's events, and checked exactly at another run. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .communication import Collective, CollectiveKind

if TYPE_CHECKING:
    from .table import Poly


@dataclass(frozen=True)
class StepCollectives:
    """The collectives a parallel rank's step issues, in order (``communication.
    Collective``): each one's kind and group size, and its payload and own bytes as
    polynomials in (batch, seq)."""

    kinds: tuple[CollectiveKind, ...]
    group_sizes: tuple[int, ...]
    payload_bytes: Poly
    own_bytes: Poly

    def at(self, batch_size: int, seq_len: int = 1) -> tuple[Collective, ...]:
        """The step's collectives at this batch size and length.

        Examples
        --------
        >>> from vram_widget._estimating.table import Poly
        >>> zero, per_sample = np.array([0]), np.array([96])
        >>> fit = StepCollectives((CollectiveKind.ALL_REDUCE,), (2,),
        ...                       Poly.affine(zero, per_sample), Poly.affine(zero, zero))
        >>> fit.at(6)[0].payload_bytes  # 96 B a sample, 6 samples
        576
        """
        payload = self.payload_bytes.at(batch_size, seq_len)
        own = self.own_bytes.at(batch_size, seq_len)
        return tuple(
            Collective(kind, int(p), size, int(o))
            for kind, size, p, o in zip(self.kinds, self.group_sizes, payload, own, strict=True)
        )


def fit_collectives(
    traces: Sequence[Any],
    fit: Callable[[tuple[np.ndarray, ...]], Poly],
    check: Any,
) -> StepCollectives | None:
    """The collectives the ``traces`` recorded (``RawTrace.collectives``), each payload and
    own share fitted by ``fit`` (the table's fit in the batch), checked exactly against
    ``check``'s; None where a trace recorded none, the traces issue other kinds or groups,
    or the check fails."""
    recorded = [getattr(t, "collectives", None) for t in traces]
    logs: list[Sequence[Collective]] = [log for log in recorded if log is not None]
    if len(logs) != len(recorded):
        return None
    signatures = {tuple((c.kind, c.group_size) for c in log) for log in logs}
    if len(signatures) != 1:
        return None
    kinds = tuple(c.kind for c in logs[0])
    sizes = tuple(c.group_size for c in logs[0])
    payload = fit(tuple(np.asarray([c.payload_bytes for c in log], np.int64) for log in logs))
    own = fit(tuple(np.asarray([c.own_bytes for c in log], np.int64) for log in logs))
    return _checked(StepCollectives(kinds, sizes, payload, own), check, 1)


def collectives_across(
    fits: Sequence[StepCollectives | None],
    fit: Callable[[tuple[Poly, ...]], Poly | None],
    check: Any,
    check_seq: int,
) -> StepCollectives | None:
    """The collectives of timelines at several lengths (``fits``, each in the batch) fitted
    in the length by ``fit`` (the table's), checked exactly against ``check``'s at
    ``check_seq``; None where one is unknown, they differ in kind or group, or the check
    fails."""
    known = [f for f in fits if f is not None]
    if not known or len(known) != len(fits):
        return None
    first = known[0]
    if any((f.kinds, f.group_sizes) != (first.kinds, first.group_sizes) for f in known):
        return None
    payload = fit(tuple(f.payload_bytes for f in known))
    own = fit(tuple(f.own_bytes for f in known))
    if payload is None or own is None:
        return None
    return _checked(StepCollectives(first.kinds, first.group_sizes, payload, own), check, check_seq)


def _checked(fitted: StepCollectives, check: Any, seq_len: int) -> StepCollectives | None:
    """``fitted`` where it gives ``check``'s collectives exactly, else None."""
    recorded = getattr(check, "collectives", None)
    if recorded is None or len(recorded) != len(fitted.kinds):
        return None
    return fitted if fitted.at(check.batch_size, seq_len) == tuple(recorded) else None
