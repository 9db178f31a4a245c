"""The profile table's numpy pieces: affine evaluation, workspace grids."""

from __future__ import annotations

import numpy as np

from vram_widget._table import Poly, _fill_unknown, interpolate_columns


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
