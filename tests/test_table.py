"""The profile table's numpy pieces: affine evaluation, workspace grids."""

from __future__ import annotations

import numpy as np
import pytest

from vram_widget._estimating.table import (
    PADDED_TERMS,
    Poly,
    _fill_unknown,
    interpolate_columns,
    pad_to,
    padded_fit_lengths,
    seq_term,
)


def test_affine_fit_and_evaluation() -> None:
    # bytes 100 + 40 * batch: at batch 2 -> 180, at 3 -> 220
    fit = Poly.fit((2, 3), (np.array([180]), np.array([220])))
    assert fit.coef[:, 0].tolist() == [100] and fit.coef[:, 1].tolist() == [40]
    assert fit.at(10).tolist() == [500]


def test_affine_switches_to_python_ints_before_int64_overflows() -> None:
    fit = Poly.affine(np.array([1], dtype=np.int64), np.array([2**40], dtype=np.int64))
    value = fit.at(10**9)[0]
    assert value == 1 + 2**40 * 10**9 and isinstance(value, int)


def test_interpolation_between_and_beyond_the_grid() -> None:
    grid = np.array([1, 2, 4])
    values = np.array([[10, 20, 40], [5, 5, 5]])
    assert interpolate_columns(grid, values, 3).tolist() == [30, 5]  # halfway 20 -> 40
    assert interpolate_columns(grid, values, 8).tolist() == [80, 5]  # last slope, 10 / sample
    assert interpolate_columns(grid, values, 1).tolist() == [10, 5]


def test_unknown_workspaces_continue_the_known_line() -> None:
    grid = np.array([1, 2, 3, 8])
    # row 0 known at 1, 2, 3 (slope 10) and unknown at 8 -> 30 + 10 * 5 = 80
    # row 1 unknown from batch 2 on -> repeats its one known value, then stays on the line
    values = np.array([[10, 20, 30, -1], [7, -1, -1, -1]])
    filled = _fill_unknown(grid, values)
    assert filled.tolist() == [[10, 20, 30, 80], [7, 7, 7, 7]]


def test_quadratic_fit_and_evaluation() -> None:
    # B x B fp32 logits plus 64 B per sample plus 16 B: 4 B^2 + 64 B + 16.
    # At batch 2: 16 + 128 + 16 = 160; at 3: 36 + 192 + 16 = 244; at 5: 100 + 320 + 16 = 436.
    # A second entry, 7 (constant), and a third, -(the first) (its free).
    values = tuple(np.array([v, 7, -v]) for v in (160, 244, 436))
    fit = Poly.fit((2, 3, 5), values)
    assert fit.degree == 2
    assert fit.coef.tolist() == [[16, 64, 4], [7, 0, 0], [-16, -64, -4]]
    # at 1024: 4 * 1024**2 + 64 * 1024 + 16 = 4,194,304 + 65,536 + 16 = 4,259,856
    assert fit.at(1024).tolist() == [4_259_856, 7, -4_259_856]
    # past int64: exact Python ints
    assert fit.at(2**40).tolist()[0] == 4 * 2**80 + 64 * 2**40 + 16


def test_quadratic_fit_of_a_line_has_no_square_term() -> None:
    fit = Poly.fit((2, 3, 5), (np.array([180]), np.array([220]), np.array([300])))
    assert fit.coef.tolist() == [[100, 40, 0]]


def test_polynomial_across_lengths() -> None:
    # bytes = 4 B S^2 + 8 B S + 2 S + 16 (attention scores, a projection, a mask row, a
    # constant): profiled at S = 16, 33, 50, each a line in B (a = 2 S + 16, b = 4 S^2 + 8 S)
    def line(s: int) -> Poly:
        return Poly.affine(np.array([2 * s + 16]), np.array([4 * s * s + 8 * s]))

    fit = Poly.across((16, 33, 50), (line(16), line(33), line(50)))
    assert (fit.degree, fit.seq_degree) == (1, 2)
    # at B = 8, S = 4096: 4 * 8 * 4096^2 + 8 * 8 * 4096 + 2 * 4096 + 16
    #                   = 536,870,912 + 262,144 + 8,192 + 16 = 537,141,264
    assert fit.at(8, 4096).tolist() == [537_141_264]
    assert fit.at(3, 16).tolist() == line(16).at(3).tolist()
    # a quadratic in the batch at one length and a line at others pads to one degree
    quad = Poly(np.array([[16, 8, 4]]))
    mixed = Poly.across((1, 2, 3), (quad, line(2), line(3)))
    assert mixed.degree == 2


def test_polynomial_across_lengths_and_their_padding() -> None:
    # A memory-efficient attention's logsumexp, (B, 2 heads, ceil(S / 32) * 32) fp32:
    # 8 B ceil32(S) = 8 B S + 8 B pad32(S); a bool mask (S, ceil(S / 8) * 8): S^2 + S pad8(S);
    # and 16 B constant. At each length a line in B: a = S ceil8(S) + 16, b = 8 ceil32(S).
    def ceil(s: int, m: int) -> int:
        return -(-s // m) * m

    def line(s: int) -> Poly:
        return Poly.affine(np.array([s * ceil(s, 8) + 16]), np.array([8 * ceil(s, 32)]))

    lengths, check = padded_fit_lengths(20, PADDED_TERMS)
    fit = Poly.across_terms(lengths, tuple(line(s) for s in lengths), PADDED_TERMS)
    assert fit is not None
    assert fit.at(5, check).tolist() == line(check).at(5).tolist()
    # at B = 8, S = 4097 (pad32 = 31, pad8 = 7): a = 4097 * 4104 + 16 = 16,814,104,
    # b = 8 * 4128 = 33,024: 16,814,104 + 8 * 33,024 = 16,814,104 + 264,192 = 17,078,296
    assert fit.at(8, 4097).tolist() == [17_078_296]
    # at a multiple of 32 the padding is 0: 4096^2 + 16 + 8 * 8 * 4096 = 16,777,232 + 262,144
    assert fit.at(8, 4096).tolist() == [17_039_376]
    assert (fit.degree, fit.seq_degree) == (1, 2)


def test_lengths_that_are_no_combination_of_the_terms_give_none() -> None:
    # S // 3 is no integer combination of 1, S, S^2 and the paddings to 32 and 8
    lengths, _check = padded_fit_lengths(20, PADDED_TERMS)
    values = tuple(Poly.affine(np.array([s // 3]), np.array([0])) for s in lengths)
    assert Poly.across_terms(lengths, values, PADDED_TERMS) is None
    # lengths that cannot tell the terms apart (all multiples of 32: no padding) give none
    same = (32, 64, 96, 128, 160, 192)
    assert Poly.across_terms(same, tuple(line for line in values), PADDED_TERMS) is None


@pytest.mark.parametrize("s0", [1, 2, 7, 16, 20, 32, 64, 100, 512, 4096])
def test_padded_fit_lengths_start_with_the_plain_fit_and_solve(s0: int) -> None:
    lengths, check = padded_fit_lengths(s0, PADDED_TERMS)
    assert lengths[:3] == (s0, 2 * s0 + 1, 3 * s0 + 2)  # the plain fit's runs serve again
    assert len(set(lengths)) == len(PADDED_TERMS) and check not in lengths


def test_seq_terms() -> None:
    assert [pad_to(s, 32) for s in (1, 31, 32, 33)] == [31, 1, 0, 31]
    # S^1 * pad8(S) at 13: 13 * 3 = 39; S^2 at 13: 169
    assert seq_term(13, (1, 8)) == 39 and seq_term(13, (2, 0)) == 169 and seq_term(13, (2,)) == 169
