"""The profile table's numpy pieces: affine evaluation, workspace grids."""

from __future__ import annotations

import numpy as np

from vram_widget._table import Affine, _fill_unknown, interpolate_columns


def test_affine_fit_and_evaluation() -> None:
    # bytes 100 + 40 * batch: at batch 2 -> 180, at 3 -> 220
    fit = Affine.fit(np.array([180]), np.array([220]), 2, 3)
    assert fit.a.tolist() == [100] and fit.b.tolist() == [40]
    assert fit.at(10).tolist() == [500]


def test_affine_switches_to_python_ints_before_int64_overflows() -> None:
    fit = Affine(np.array([1], dtype=np.int64), np.array([2**40], dtype=np.int64))
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
