import math

import numpy as np

from coconet.schedules.equivalence import _BLOCK, rel_err


def test_rel_err_finds_a_difference_in_any_block():
    want = np.linspace(0.5, 2.0, 3 * _BLOCK + 5, dtype=np.float32)
    assert rel_err(want.copy(), want) == 0.0
    for k in (0, _BLOCK - 1, _BLOCK, want.size - 1):
        got = want.copy()
        got[k] *= 1.25
        assert math.isclose(rel_err(got, want), 0.25 * want[k] / max(1.0, want[k]), rel_tol=1e-5), k
    square = want[: 2 * _BLOCK].reshape(2, _BLOCK)
    got = square.T.copy().T  # the same values, laid out column by column
    got[1, 3] = -1.0
    assert rel_err(got, square) > 1.0


def test_rel_err_nans_and_infinities():
    want = np.array([1.0, np.nan, np.inf, -np.inf])
    assert rel_err(want.copy(), want) == 0.0  # NaN where NaN is due, the same infinity
    assert rel_err(np.array([1.0, np.nan, -np.inf, -np.inf]), want) == math.inf
    assert rel_err(np.array([np.nan, 1.0]), np.array([1.0, 1.0])) == math.inf
    assert rel_err(np.array([1.0, 5.0]), np.array([1.0, np.inf])) == math.inf
    assert rel_err(np.array([1.0, np.inf]), np.array([1.0, 5.0])) == math.inf
    assert rel_err(np.array([1.0, 1.0]), np.array([1.0, np.nan])) == math.inf


def test_rel_err_shapes_and_scalars():
    assert rel_err(np.zeros(3), np.zeros(4)) == math.inf
    assert rel_err(np.float32(2.5), np.float64(2.0)) == 0.25
    assert rel_err(np.zeros(0), np.zeros(0)) == 0.0
    assert rel_err(np.array([0.5]), np.array([0.25])) == 0.25  # below 1 the error is absolute
