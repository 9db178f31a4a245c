"""The profile table: raw traces at a few batch sizes, fitted to integer polynomials in the
batch size (``bytes = a + b * batch``, or ``+ c * batch**2`` where a loss compares every pair
of samples).

numpy only. Each allocation or free of a step is one event; profiling at two batch sizes
and matching events one to one gives each event's constant part ``a`` and per-sample part
``b``; a third batch size checks the fit exactly. Where that check fails but the step is the
same event for event, the three give a quadratic, checked exactly at a fourth.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

import numpy as np

from .collective_fit import StepCollectives, collectives_across, fit_collectives
from .options import CATEGORIES, CATEGORY_CODE, Category

N_CATEGORIES = len(CATEGORIES)


class _Trace(Protocol):
    """The fields of the profiler's RawTrace the table uses (no import of the profiler);
    read-only, as the frozen RawTrace has them."""

    @property
    def batch_size(self) -> int: ...

    @property
    def event_storage(self) -> np.ndarray: ...

    @property
    def event_bytes(self) -> np.ndarray: ...

    @property
    def event_module(self) -> np.ndarray: ...

    @property
    def event_phase(self) -> np.ndarray: ...

    @property
    def event_op(self) -> np.ndarray: ...

    @property
    def op_names(self) -> tuple[str, ...]: ...

    @property
    def storage_category(self) -> np.ndarray: ...

    @property
    def storage_module(self) -> np.ndarray: ...

    @property
    def storage_resident(self) -> np.ndarray: ...

    @property
    def storage_bytes(self) -> np.ndarray: ...

    @property
    def flops_forward(self) -> np.ndarray: ...

    @property
    def flops_backward(self) -> np.ndarray: ...

    @property
    def output_shapes(self) -> tuple[tuple[int, ...] | None, ...]: ...

    @property
    def workspace_storages(self) -> np.ndarray: ...

    @property
    def backward_start(self) -> int: ...

    @property
    def optimizer_at(self) -> int: ...

    @property
    def uses_matmul(self) -> bool: ...

    @property
    def step_starts(self) -> tuple[int, ...]: ...

    @property
    def step_flops(self) -> np.ndarray: ...


@dataclass(frozen=True)
class Poly:
    """Integer arrays that are polynomials in the batch size and the sequence length:
    ``coef[..., k] * batch**i * seq**j`` summed over the monomials ``k``, whose exponents
    ``(i, j)`` are ``exponents[k]`` (by default ``(k, 0)``: the batch alone).

    A monomial ``(i, j, m)`` is ``batch**i * seq**j * pad(seq, m)``: ``pad(seq, m) =
    ceil(seq / m) * m - seq``, the padding a kernel adds to reach a multiple of ``m``
    (:data:`PAD_MULTIPLES`)."""

    coef: np.ndarray  # int64 (..., monomials)
    exponents: tuple[tuple[int, ...], ...] | None = None  # None: ((0, 0), (1, 0), ...)

    @property
    def monomials(self) -> tuple[tuple[int, ...], ...]:
        if self.exponents is not None:
            return self.exponents
        return tuple((k, 0) for k in range(self.coef.shape[-1]))

    @property
    def degree(self) -> int:
        """The degree in the batch size."""
        return max((e[0] for e in self.monomials), default=0)

    @property
    def seq_degree(self) -> int:
        """The degree in the sequence length (0: the same at every length; a padding term
        counts 1)."""
        return max((e[1] + (len(e) > 2 and e[2] > 0) for e in self.monomials), default=0)

    def at(self, batch_size: int, seq_len: int = 1) -> np.ndarray:
        """Evaluate at one point; Python ints (object array) where int64 could overflow."""
        if self.coef.size == 0:
            return np.zeros(self.coef.shape[:-1], np.int64)
        powers = [batch_size ** e[0] * seq_term(seq_len, e[1:]) for e in self.monomials]
        bound = sum(int(np.abs(self.coef[..., k]).max()) * p for k, p in enumerate(powers))
        if bound < 2**62:
            return self.coef @ np.asarray(powers, dtype=np.int64)
        return self.coef.astype(object) @ np.asarray(powers, dtype=object)

    @staticmethod
    def affine(a: np.ndarray, b: np.ndarray) -> Poly:
        """``a + b * batch``."""
        return Poly(np.stack([np.asarray(a, np.int64), np.asarray(b, np.int64)], axis=-1))

    @staticmethod
    def fit(batches: tuple[int, ...], values: tuple[np.ndarray, ...]) -> Poly:
        """The polynomial of degree ``len(batches) - 1`` in the batch through the points, by
        Newton's divided differences in integers (floor division: where the data is not an
        integer polynomial the result is off, which the caller's check at another batch
        finds)."""
        return Poly(np.stack(_newton(batches, values), axis=-1))

    @staticmethod
    def across(lengths: tuple[int, ...], polys: tuple[Poly, ...]) -> Poly:
        """The polynomial in (batch, seq) whose value at ``lengths[j]`` is ``polys[j]`` (each a
        polynomial in the batch alone, profiled at that length): each batch coefficient is
        interpolated in the length, to degree ``len(lengths) - 1``."""
        degree = max(p.degree for p in polys)
        columns = [_pad_batch_degree(p, degree) for p in polys]  # (..., degree + 1) each
        coef = np.stack(_newton(lengths, tuple(columns)), axis=-1)  # (..., degree + 1, len)
        exponents = tuple((i, j) for j in range(len(lengths)) for i in range(degree + 1))
        return Poly(np.swapaxes(coef, -1, -2).reshape(*coef.shape[:-2], -1), exponents)

    @staticmethod
    def across_terms(
        lengths: tuple[int, ...], polys: tuple[Poly, ...], terms: tuple[tuple[int, int], ...]
    ) -> Poly | None:
        """As :meth:`across`, in the functions of the length ``terms`` (``(j, m)``: ``seq**j
        * pad(seq, m)``, or ``seq**j`` where ``m`` is 0), one per length: each batch
        coefficient solves the square system exactly in integers. None where the lengths
        do not tell the terms apart, or the data is no integer combination of them."""
        degree = max(p.degree for p in polys)
        columns = [_pad_batch_degree(p, degree).astype(object) for p in polys]
        matrix = [[Fraction(seq_term(n, t)) for t in terms] for n in lengths]
        inverse = _inverse(matrix)
        if inverse is None:
            return None
        denominator = math.lcm(*(f.denominator for row in inverse for f in row))
        solved = []
        for row in inverse:
            scaled = sum(
                (int(f * denominator) * col for f, col in zip(row, columns, strict=True)),
                start=np.zeros_like(columns[0]),
            )
            if np.any(scaled % denominator):
                return None  # not an integer combination of the terms
            solved.append(scaled // denominator)
        coef = np.stack(solved, axis=-2)  # (..., terms, degree + 1)
        if coef.size and np.abs(coef).max() >= 2**62:
            return None
        exponents = tuple((i, *t) for t in terms for i in range(degree + 1))
        return Poly(coef.reshape(*coef.shape[:-2], -1).astype(np.int64), exponents)


# Kernels that pad a length to a multiple, so that memory is a polynomial in the length and
# that padding: the memory-efficient attention's logsumexp is (B, H, ceil(S / 32) * 32) fp32
# (torch/_meta_registrations.py, meta__efficient_attention_forward: "logsumexp = ...
# math.ceil(max_seqlen_q / 32) * 32" where compute_log_sumexp); an attention mask handed to
# it is padded to a multiple of 8 in its last dim (aten/src/ATen/native/transformers/
# attention.cpp, preprocess_mask: pad_bias<8>; cuda_kernels._preprocess_mask).
PAD_MULTIPLES = (32, 8)

# The functions of the length tried after the powers 1, S, S**2 fail their check: the
# padding to 32 and to 8, and S times the padding to 8 (a (S, ceil(S / 8) * 8) mask).
PADDED_TERMS: tuple[tuple[int, int], ...] = ((0, 0), (1, 0), (2, 0), (0, 32), (0, 8), (1, 8))


def padded_fit_lengths(s0: int, terms: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], int]:
    """Lengths to fit ``terms`` at (the example's ``s0`` and the plain fit's ``2 * s0 + 1``
    and ``3 * s0 + 2`` first, so their runs serve again) and a length to check at: more
    lengths of the form ``k * s0 + c`` taken while they make the system better determined,
    until it is square and invertible; the check is the next such length.

    Examples
    --------
    >>> padded_fit_lengths(20, PADDED_TERMS)
    ((20, 41, 62, 85, 87, 89), 147)
    """
    chosen = [s0, 2 * s0 + 1, 3 * s0 + 2]
    candidates = (k * s0 + c for k in range(4, 64) for c in (5, 7, 9, 11, 13, 3))
    for n in candidates:
        if len(chosen) == len(terms):
            break
        if n in chosen:
            continue
        rows = [[seq_term(m, t) for t in terms] for m in (*chosen, n)]
        if np.linalg.matrix_rank(np.asarray(rows, dtype=np.float64)) == len(chosen) + 1:
            chosen.append(n)
    square = [[Fraction(seq_term(m, t)) for t in terms] for m in chosen]
    if len(chosen) != len(terms) or _inverse(square) is None:
        raise ValueError(f"no lengths near {s0} tell the terms {terms} apart")
    check = next(n for n in (k * s0 + 7 for k in range(len(terms) + 1, 128)) if n not in chosen)
    return tuple(chosen), check


def pad_to(seq_len: int, multiple: int) -> int:
    """``ceil(seq_len / multiple) * multiple - seq_len``: what a kernel pads ``seq_len`` by."""
    return -seq_len % multiple


def seq_term(seq_len: int, term: tuple[int, ...]) -> int:
    """The value of one function of the length: ``seq**j`` times ``pad_to(seq, m)`` where a
    multiple ``m`` is given (``term = (j,)`` or ``(j, m)``)."""
    value = seq_len ** term[0]
    if len(term) > 1 and term[1]:
        value *= pad_to(seq_len, term[1])
    return int(value)


def _inverse(matrix: list[list[Fraction]]) -> list[list[Fraction]] | None:
    """The exact inverse of a small square matrix (Gauss-Jordan), None where singular."""
    n = len(matrix)
    rows = [[*row, *(Fraction(int(i == j)) for j in range(n))] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if rows[r][col] != 0), None)
        if pivot is None:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        lead = rows[col][col]
        rows[col] = [v / lead for v in rows[col]]
        for r in range(n):
            if r != col and rows[r][col] != 0:
                factor = rows[r][col]
                rows[r] = [v - factor * w for v, w in zip(rows[r], rows[col], strict=True)]
    return [row[n:] for row in rows]


def _pad_batch_degree(poly: Poly, degree: int) -> np.ndarray:
    assert poly.seq_degree == 0
    out = np.zeros((*poly.coef.shape[:-1], degree + 1), np.int64)
    out[..., : poly.coef.shape[-1]] = poly.coef
    return out


def _newton(xs: tuple[int, ...], values: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    """Coefficients of ``1, x, x**2, ...`` of the integer polynomial through ``(xs[k],
    values[k])``, by Newton's divided differences (floor division: off where the data is not
    such a polynomial, which a check at another point finds)."""
    x = [int(v) for v in xs]
    diffs = [np.asarray(v, np.int64) for v in values]
    newton = [diffs[0]]
    for k in range(1, len(x)):
        diffs = [(diffs[i + 1] - diffs[i]) // (x[i + k] - x[i]) for i in range(len(diffs) - 1)]
        newton.append(diffs[0])
    # expand sum_k newton[k] * prod_{i<k} (x - x_i) into powers of x
    coef = [np.zeros(newton[0].shape, np.int64) for _ in x]
    basis = [1]  # coefficients of prod_{i<k} (x - x_i), lowest power first
    for k, n_k in enumerate(newton):
        for power, c in enumerate(basis):
            coef[power] = coef[power] + n_k * c
        basis = [0, *basis]
        for power in range(len(basis) - 1):
            basis[power] -= x[k] * basis[power + 1]
    return coef


@dataclass(frozen=True)
class Timeline:
    """Every allocation (+) and free (-) of one run, in order, as affine functions of batch."""

    event_bytes: Poly
    event_module: np.ndarray  # int32 row
    event_phase: np.ndarray  # int8 phase code
    event_category: np.ndarray  # int8 category code of the storage
    event_op: np.ndarray  # int32 index into op_names of the op running (-1: none)
    op_names: tuple[str, ...]  # "aten.addmm" in forward, the autograd node in backward
    storage_bytes: Poly  # per storage id
    storage_category: np.ndarray  # int8
    storage_module: np.ndarray  # int32 row that allocated it (owner row for residents)
    storage_resident: np.ndarray  # bool
    flops_forward: Poly  # per row
    flops_backward: Poly  # per row
    output_shapes: tuple[tuple[tuple[int, int], ...] | None, ...]  # per row: (a, b) per dim
    workspace_alloc_at: np.ndarray  # event index of each kernel workspace's allocation
    workspace_free_at: np.ndarray  # ... and of its free
    workspace_grid: np.ndarray  # int64 batch sizes the workspaces were measured at
    workspace_bytes: np.ndarray  # int64 [workspace, grid]
    backward_start: int
    optimizer_at: int
    uses_matmul: bool
    exact: bool  # False when the check at a held-out batch size failed: extrapolated
    nonaffine_row: int | None  # the first row whose memory the fit does not reproduce
    # where the check failed and the events still match: (batch, fitted peak, profiled peak)
    check_peaks: tuple[int, int, int] | None = None
    # the output dims as polynomials in (batch, seq), where the timeline spans lengths
    dims_across_lengths: Poly | None = None
    # the step at batch 1 where it is not the fit's at 1 (size-1 dims take other paths)
    batch_one: Timeline | None = None
    # the storage id of each event (None: not recorded), for the allocator replay
    event_storage: np.ndarray | None = None
    # generation (``generation``): the event where each forward starts, then the end
    step_starts: tuple[int, ...] = ()
    # ... and the FLOPs per row counted before each of them (steps x rows)
    step_flops: Poly | None = None
    # activation offloading: the host bytes the offloaded copies take at their peak, one
    # value (None: nothing offloaded)
    host_bytes: Poly | None = None
    # torch.compile: why a compiled graph ran node by node (the profile's RawTrace)
    compile_fallbacks: tuple[str, ...] = ()
    # a parallel rank's collectives, fitted as the events are (collective_fit.py; None:
    # not recorded, or no such polynomial)
    collectives: StepCollectives | None = None

    @property
    def seq_degree(self) -> int:
        """0 for a timeline of one sequence length; else its degree in the length."""
        return self.event_bytes.seq_degree

    @functools.cached_property
    def output_dims(self) -> tuple[Poly, np.ndarray]:
        """Every row's output shape as one padded (rows x max_ndim) polynomial array (padding
        is 1, so a row's numel is the product of its row), and each row's ndim (-1: no
        output). Derived once, so that an estimate builds no per-row Python objects."""
        ndim = np.asarray([-1 if s is None else len(s) for s in self.output_shapes], np.int64)
        if self.dims_across_lengths is not None:
            return self.dims_across_lengths, ndim
        ndim = np.asarray([-1 if s is None else len(s) for s in self.output_shapes], np.int64)
        width = max(1, int(ndim.max(initial=0)))
        a = np.ones((len(ndim), width), np.int64)
        b = np.zeros((len(ndim), width), np.int64)
        for row, shape in enumerate(self.output_shapes):
            for dim, (ad, bd) in enumerate(shape or ()):
                a[row, dim], b[row, dim] = ad, bd
        return Poly(np.stack([a, b], axis=-1)), ndim

    def events_at(self, batch_size: int, seq_len: int = 1) -> np.ndarray:
        """Signed bytes of every event at this batch size and length (workspaces
        interpolated)."""
        seq = self.event_bytes.at(batch_size, seq_len)
        if len(self.workspace_alloc_at):
            ws = interpolate_columns(self.workspace_grid, self.workspace_bytes, batch_size)
            seq = seq.copy()
            seq[self.workspace_alloc_at] = ws
            freed = self.workspace_free_at >= 0
            seq[self.workspace_free_at[freed]] = -ws[freed]
        return seq

    def resident_by_category(self, batch_size: int, seq_len: int = 1) -> np.ndarray:
        """Bytes resident before the run starts, per category code."""
        sizes = self.storage_bytes.at(batch_size, seq_len)[self.storage_resident]
        cats = self.storage_category[self.storage_resident]
        out = np.zeros(N_CATEGORIES, dtype=object if sizes.dtype == object else np.int64)
        for code in range(N_CATEGORIES):
            out[code] = sizes[cats == code].sum()
        return out

    def rows_of_category(
        self, category: Category, batch_size: int, n_rows: int, seq_len: int = 1
    ) -> np.ndarray:
        """Bytes of the storages of one category, per row (the allocating or owning row)."""
        mask = self.storage_category == CATEGORY_CODE[category]
        sizes = self.storage_bytes.at(batch_size, seq_len)[mask]
        return sum_by(self.storage_module[mask].clip(0), sizes, n_rows)


@dataclass(frozen=True)
class ModuleRows:
    """One row per module (``named_modules`` order, shared modules once), then the two
    pseudo-rows for the loss and the optimizer."""

    names: tuple[str, ...]
    types: tuple[str, ...]
    depths: np.ndarray  # int32
    param_count: np.ndarray  # int64, parameters owned directly (tied ones at first owner)
    trainable_param_count: np.ndarray  # int64
    buffer_count: np.ndarray  # int64


@dataclass(frozen=True)
class OptimizerTrace:
    """The steady-state ``optimizer.step()``: temporaries as events, state per row."""

    event_bytes: np.ndarray  # int64, signed
    state_bytes: np.ndarray  # int64 per row (state of the parameters each row owns)
    state_block_bytes: np.ndarray  # int64, the size of each state storage on the device
    event_storage: np.ndarray | None = None  # the storage id of each event (None: unknown)
    # state outside the caching allocator (bitsandbytes' paged state in CUDA unified memory)
    paged_bytes: int = 0


def sum_by(groups: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Exact integer sums of ``values`` per group (int64, or Python ints for object arrays:
    no float64 rounding, whatever the batch size)."""
    out = np.zeros(n_groups, dtype=object if values.dtype == object else np.int64)
    np.add.at(out, groups, values)
    return out


def interpolate_columns(grid: np.ndarray, values: np.ndarray, x: int) -> np.ndarray:
    """Piecewise-linear interpolation of each row of ``values`` over ``grid`` at ``x``;
    beyond the grid, the last segment's slope continues (never below 0)."""
    if len(grid) == 1:
        return values[:, 0].copy()
    j = int(np.clip(np.searchsorted(grid, x) - 1, 0, len(grid) - 2))
    x0, x1 = int(grid[j]), int(grid[j + 1])
    v0, v1 = values[:, j].astype(object), values[:, j + 1].astype(object)
    out = v0 + (v1 - v0) * (x - x0) // (x1 - x0)
    return np.maximum(out, 0).astype(np.int64) if x < 2**40 else np.maximum(out, 0)


def _fill_unknown(grid: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Replace unknown workspace sizes (negative: the call was too large to run for real) by
    continuing the line through the two nearest known smaller batch sizes (or the one known
    value; 0 when none is known)."""
    out = values.astype(np.int64).copy()
    for j in range(out.shape[1]):
        unknown = out[:, j] < 0
        if not unknown.any():
            continue
        if j >= 2:
            x0, x1 = int(grid[j - 2]), int(grid[j - 1])
            v0, v1 = out[unknown, j - 2], out[unknown, j - 1]
            slope = (v1 - v0) / (x1 - x0)
            out[unknown, j] = np.maximum(0, np.round(v1 + slope * (int(grid[j]) - x1)))
        elif j == 1:
            out[unknown, j] = np.maximum(out[unknown, 0], 0)
        else:
            out[unknown, j] = 0
    return out


class NotAffineError(ValueError):
    """Two traces do not match event for event, so no per-event fit exists. ``row`` is the
    module row where they first differ (None if unknown), for the caller to name."""

    def __init__(self, message: str, row: int | None = None) -> None:
        super().__init__(message)
        self.row = row


def _shapes_fit(
    s1: tuple[int, ...] | None, s2: tuple[int, ...] | None, b1: int, b2: int
) -> tuple[tuple[int, int], ...] | None:
    if s1 is None or s2 is None or len(s1) != len(s2):
        return None
    out = []
    for d1, d2 in zip(s1, s2, strict=True):
        slope = (d2 - d1) // (b2 - b1)
        out.append((d1 - slope * b1, slope))
    return tuple(out)


def fit_timeline(fit: tuple[_Trace, ...], check: _Trace, grid: tuple[_Trace, ...] = ()) -> Timeline:
    """Fit the ``fit`` traces (two: ``a + b * batch``; three: with ``c * batch**2``) and check
    the fit exactly against ``check``, a trace at another batch size.

    Kernel workspaces (measured, not polynomial) are left out of the check; their sizes at
    every trace's batch size (``grid`` too) make an interpolation grid. Output shapes are
    fitted per dimension from the first two (a dimension is affine in the batch).
    Raises NotAffineError when the fit traces do not match event for event.
    """
    t1 = fit[0]
    for other in fit[1:]:
        if not same_step(t1, other):
            raise NotAffineError(_first_difference(t1, other), _first_difference_row(t1, other))
    batches = tuple(t.batch_size for t in fit)
    if len(fit) == 1:  # one batch size: the step there as it is (no slope)
        fit, batches = (t1, t1), (t1.batch_size, t1.batch_size + 1)
    events = Poly.fit(batches, tuple(t.event_bytes for t in fit))
    storages = Poly.fit(batches, tuple(t.storage_bytes for t in fit))
    flops_f = Poly.fit(batches, tuple(t.flops_forward for t in fit))
    flops_b = Poly.fit(batches, tuple(t.flops_backward for t in fit))
    b1, b2 = batches[:2]
    shapes = tuple(
        _shapes_fit(s1, s2, b1, b2)
        for s1, s2 in zip(t1.output_shapes, fit[1].output_shapes, strict=True)
    )
    ws_sids = t1.workspace_storages
    is_ws = np.isin(t1.event_storage, ws_sids)
    alloc_at = np.asarray(
        [np.flatnonzero(t1.event_storage == sid)[0] for sid in ws_sids], dtype=np.int64
    )
    # -1 where the storage outlives the run (no free event)
    free_at = np.asarray(
        [
            idx[-1] if len(idx) > 1 else -1
            for idx in (np.flatnonzero(t1.event_storage == sid) for sid in ws_sids)
        ],
        dtype=np.int64,
    )
    traces = {t.batch_size: t for t in (*fit, check, *grid)}
    aligned = [
        traces[b] for b in sorted(traces) if len(traces[b].storage_bytes) == len(t1.storage_bytes)
    ]
    ws_grid = np.asarray([t.batch_size for t in aligned], dtype=np.int64)
    ws_bytes = (
        np.stack([t.storage_bytes[ws_sids] for t in aligned], axis=1)
        if len(ws_sids)
        else np.zeros((0, len(aligned)), np.int64)
    )
    ws_bytes = _fill_unknown(ws_grid, ws_bytes)
    host = None
    if any(_host_peak(t)[0] for t in fit):
        host = Poly.fit(batches, tuple(_host_peak(t) for t in fit))
    exact, bad_row, check_peaks = True, None, None
    b3 = check.batch_size
    if host is not None and not np.array_equal(host.at(b3), _host_peak(check)):
        exact = False
    if len(check.event_bytes) != len(t1.event_bytes):
        exact = False
        bad_row = _first_difference_row(t1, check)
    else:
        fitted = events.at(b3)
        wrong = np.flatnonzero((fitted != check.event_bytes) & ~is_ws)
        if wrong.size:
            exact = False
            bad_row = int(check.event_module[wrong[0]])
            resident = int(storages.at(b3)[t1.storage_resident].sum())
            check_peaks = (
                b3,
                resident + _max_prefix(np.where(is_ws, check.event_bytes, fitted)),
                int(check.storage_bytes[check.storage_resident].sum())
                + _max_prefix(check.event_bytes),
            )
    category = (
        t1.storage_category[t1.event_storage] if len(t1.event_storage) else np.zeros(0, np.int8)
    )
    return Timeline(
        event_bytes=events,
        event_module=t1.event_module,
        event_phase=t1.event_phase,
        event_category=category.astype(np.int8),
        event_op=t1.event_op,
        op_names=t1.op_names,
        storage_bytes=storages,
        storage_category=t1.storage_category,
        storage_module=t1.storage_module,
        storage_resident=t1.storage_resident,
        flops_forward=flops_f,
        flops_backward=flops_b,
        output_shapes=shapes,
        workspace_alloc_at=alloc_at,
        workspace_free_at=free_at,
        workspace_grid=ws_grid,
        workspace_bytes=ws_bytes,
        backward_start=t1.backward_start,
        optimizer_at=t1.optimizer_at,
        uses_matmul=t1.uses_matmul,
        exact=exact,
        nonaffine_row=bad_row,
        check_peaks=check_peaks,
        event_storage=np.asarray(t1.event_storage, dtype=np.int64),
        step_starts=t1.step_starts,
        step_flops=(
            Poly.fit(batches, tuple(t.step_flops for t in fit)) if t1.step_flops.size else None
        ),
        host_bytes=host,
        compile_fallbacks=tuple(getattr(t1, "compile_fallbacks", ())),
        collectives=fit_collectives(fit, lambda values: Poly.fit(batches, values), check),
    )


def _host_peak(trace: _Trace) -> np.ndarray:
    """The host bytes a trace's offloaded copies took at their peak, as a 1-array (0 for a
    trace that offloads nothing, or that does not say)."""
    return np.asarray([getattr(trace, "host_peak_bytes", 0)], np.int64)


def across_lengths(
    lengths: tuple[int, ...],
    timelines: tuple[Timeline, ...],
    check: _Trace,
    check_seq: int,
    terms: tuple[tuple[int, int], ...] | None = None,
    flops: bool = True,
) -> Timeline | None:
    """One timeline in (batch, seq) from timelines profiled at ``lengths`` (each exact in the
    batch), checked exactly against ``check``, a trace at another batch size and length
    ``check_seq``; None where the lengths do not make the same step event for event, a
    timeline is not exact, kernel workspaces are measured (not polynomial), or the check
    fails: memory is then not such a polynomial in the length.

    ``terms`` are the functions of the length to fit in (:meth:`Poly.across_terms`, one per
    length); None: the powers of the length, ``len(lengths) - 1`` at most. ``flops=False``
    leaves the FLOPs out of the fit (the batch-1 timelines, whose FLOPs are the fit's)."""
    first = timelines[0]
    for tl in timelines:
        if not tl.exact or len(tl.workspace_alloc_at) or not _same_timeline_steps(first, tl):
            return None

    def fit(polys: tuple[Poly, ...]) -> Poly | None:
        if terms is None:
            return Poly.across(lengths, polys)
        return Poly.across_terms(lengths, polys, terms)

    events = fit(tuple(tl.event_bytes for tl in timelines))
    if events is None:
        return None
    fitted = events.at(check.batch_size, check_seq)
    if len(check.event_bytes) != len(fitted) or not np.array_equal(fitted, check.event_bytes):
        return None
    storage = fit(tuple(tl.storage_bytes for tl in timelines))
    dims = fit(tuple(tl.output_dims[0] for tl in timelines))
    forward: Poly | None = first.flops_forward
    backward: Poly | None = first.flops_backward
    steps: Poly | None = first.step_flops
    if flops:
        forward = fit(tuple(tl.flops_forward for tl in timelines))
        backward = fit(tuple(tl.flops_backward for tl in timelines))
        if first.step_flops is not None:
            steps = fit(tuple(tl.step_flops for tl in timelines if tl.step_flops is not None))
            if steps is None:
                return None
    if storage is None or dims is None or forward is None or backward is None:
        return None
    host = None
    if first.host_bytes is not None:
        hosts = tuple(tl.host_bytes for tl in timelines)
        host = None if any(h is None for h in hosts) else fit(hosts)  # type: ignore[arg-type]
        check_host = host.at(check.batch_size, check_seq) if host is not None else None
        if check_host is None or not np.array_equal(check_host, _host_peak(check)):
            return None
    collectives = collectives_across(
        tuple(tl.collectives for tl in timelines), fit, check, check_seq
    )
    return dataclasses.replace(
        first,
        event_bytes=events,
        storage_bytes=storage,
        collectives=collectives,
        dims_across_lengths=dims,
        flops_forward=forward,
        flops_backward=backward,
        step_flops=steps,
        host_bytes=host,
        batch_one=None,  # the caller fits batch 1 across the lengths apart, where it differs
    )


def _same_timeline_steps(a: Timeline, b: Timeline) -> bool:
    return (
        a.event_bytes.coef.shape == b.event_bytes.coef.shape
        and a.storage_bytes.coef.shape == b.storage_bytes.coef.shape
        and a.output_dims[0].coef.shape == b.output_dims[0].coef.shape
        and np.array_equal(a.event_module, b.event_module)
        and np.array_equal(a.event_phase, b.event_phase)
        and np.array_equal(a.event_category, b.event_category)
        and np.array_equal(a.storage_category, b.storage_category)
        and a.backward_start == b.backward_start
        and a.optimizer_at == b.optimizer_at
        and a.step_starts == b.step_starts
        # the allocator replay pairs frees with allocations by storage id
        and (
            a.event_storage is None
            or b.event_storage is None
            or np.array_equal(a.event_storage, b.event_storage)
        )
    )


def same_step(t1: _Trace, t2: _Trace) -> bool:
    """Whether two traces are the same step event for event (sizes aside)."""
    return (
        len(t1.event_bytes) == len(t2.event_bytes)
        and len(t1.storage_bytes) == len(t2.storage_bytes)
        and np.array_equal(t1.event_storage, t2.event_storage)
        and np.array_equal(t1.event_module, t2.event_module)
        and np.array_equal(t1.event_phase, t2.event_phase)
        and np.array_equal(t1.storage_category, t2.storage_category)
        and t1.backward_start == t2.backward_start
        and t1.optimizer_at == t2.optimizer_at
        and t1.step_starts == t2.step_starts
    )


def _max_prefix(deltas: np.ndarray) -> int:
    return max(0, int(np.cumsum(deltas).max())) if len(deltas) else 0


def _first_difference_row(t1: _Trace, t2: _Trace) -> int | None:
    n = min(len(t1.event_module), len(t2.event_module))
    diff = np.flatnonzero(t1.event_module[:n] != t2.event_module[:n])
    if diff.size:
        return int(t2.event_module[diff[0]])
    if n < len(t2.event_module):
        return int(t2.event_module[n])
    if n < len(t1.event_module):
        return int(t1.event_module[n])
    return None


def _first_difference(t1: _Trace, t2: _Trace) -> str:
    return (
        f"the step allocates differently at batch {t1.batch_size} and {t2.batch_size} "
        f"({len(t1.event_bytes)} vs {len(t2.event_bytes)} allocations and frees)"
    )
