import numpy as np
import pytest

from coconet.tuner.stats import median_ci_ranks, summarize


def test_median_and_ci_bracket_it():
    s = summarize([5, 1, 3, 2, 4, 9, 7, 8, 6, 10])
    assert s.median == 5.5 and s.ci95[0] <= 5.5 <= s.ci95[1] and (s.min, s.max) == (1, 10)


def test_ci_ranks_known_values():
    # n=10: P(Bin <= 1) = 0.0107 <= 0.025 < P(Bin <= 2) = 0.0547 -> ranks 1..8 (0-based)
    assert median_ci_ranks(10) == (1, 8)
    assert median_ci_ranks(100) == (39, 60)


def test_coverage_is_at_least_95_percent():
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(2000):
        xs = rng.lognormal(size=25)  # skewed, true median 1
        lo, hi = summarize(xs).ci95
        hits += lo <= 1.0 <= hi
    assert hits / 2000 >= 0.94


def test_few_samples_and_errors():
    assert summarize([2.0]).ci95 == (2.0, 2.0)
    assert summarize([1.0, 3.0]).rel_halfwidth == pytest.approx(0.5)
    with pytest.raises(ValueError):
        summarize([])


def test_the_interval_is_scipys_distribution_free_one():
    from scipy import stats

    rng = np.random.default_rng(0)
    for n in range(6, 200, 7):
        x = rng.lognormal(size=n)
        ci = stats.quantile_test(x, q=float(np.median(x)), p=0.5).confidence_interval(0.95)
        assert summarize(x).ci95 == (ci.low, ci.high), n
