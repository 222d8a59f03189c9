"""What the records and the card promise about their statistics, checked against independent code.

* ``median_ms`` and the quartiles are numpy's median and linear-interpolation percentiles.
* The ratio is ``median(numerator) / median(denominator)``.
* Its interval is a 95% percentile bootstrap: it agrees with ``scipy.stats.bootstrap`` (percentile
  method, both sample sets resampled independently), and it covers the true ratio of medians at least
  93% of the time (95% less the simulation's slack) at the sample count of every profile, for timings
  drawn from known log-normal distributions.
"""

from __future__ import annotations

import numpy as np
import pytest

from tpu_kernel_records_tools.bench import stats
from tpu_kernel_records_tools.bench.cases import PROFILES

COVERAGE_TRIALS = 1000
# 1,000 trials of a 95% interval: the observed rate has a standard error of 0.7 points, so 93% is
# about three standard errors below the promise.
MIN_COVERAGE = 0.93
PROFILE_SAMPLES = sorted({profile.samples for profile in PROFILES.values()})


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    return median * np.exp(sigma * rng.standard_normal(n))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 20, 51])
def test_summary_is_numpys_median_and_linear_quartiles(n):
    x = _lognormal(np.random.default_rng(n), 1.5, 0.4, n)
    s = stats.summarize(x)
    q1, q3 = np.percentile(x, [25, 75], method="linear")
    assert s["median_ms"] == pytest.approx(np.median(x), rel=1e-15)
    assert (s["q1_ms"], s["q3_ms"]) == pytest.approx((q1, q3), rel=1e-15)
    assert (s["min_ms"], s["max_ms"], s["iqr_ms"]) == pytest.approx((x.min(), x.max(), q3 - q1), rel=1e-15)


def test_the_ratio_is_the_ratio_of_numpys_medians():
    rng = np.random.default_rng(3)
    for n, m in ((20, 20), (4, 7), (3, 3)):
        num, den = _lognormal(rng, 2.0, 0.3, n), _lognormal(rng, 1.0, 0.3, m)
        ratio, _, _ = stats.ratio_of_medians(num, den)
        assert ratio == pytest.approx(np.median(num) / np.median(den), rel=1e-15)


def test_the_interval_is_a_95_percent_one():
    assert stats.CONFIDENCE == 0.95


@pytest.mark.parametrize("seed", range(4))
def test_the_interval_agrees_with_scipys_percentile_bootstrap(seed):
    import scipy.stats  # here, not at collection: importing it costs each xdist worker about 1.4 s

    rng = np.random.default_rng(seed)
    num, den = _lognormal(rng, 2.0, 0.2, 20), _lognormal(rng, 1.0, 0.2, 20)
    resamples = 20_000
    _, low, high = stats.ratio_of_medians(num, den, seed=seed, resamples=resamples)
    width = high - low

    def scipy_interval(confidence):
        result = scipy.stats.bootstrap(
            (num, den), lambda a, b, axis: np.median(a, axis=axis) / np.median(b, axis=axis),
            paired=False, vectorized=True, method="percentile", confidence_level=confidence,
            n_resamples=resamples, random_state=np.random.default_rng(100 + seed))
        return result.confidence_interval.low, result.confidence_interval.high

    ref_low, ref_high = scipy_interval(0.95)
    # Two Monte Carlo estimates of the same percentiles of a discrete distribution (medians of
    # resampled data take few values): equal up to a small part of the interval's width.
    assert abs(low - ref_low) <= 0.08 * width and abs(high - ref_high) <= 0.08 * width
    for other in (0.80, 0.99):
        o_low, o_high = scipy_interval(other)
        assert abs(low - ref_low) + abs(high - ref_high) < abs(low - o_low) + abs(high - o_high)


def _coverage(n: int, sigma: float, trials: int = COVERAGE_TRIALS) -> float:
    rng = np.random.default_rng([n, int(sigma * 1000)])
    true_ratio = 2.0
    covered = 0
    for trial in range(trials):
        num, den = _lognormal(rng, true_ratio, sigma, n), _lognormal(rng, 1.0, sigma, n)
        _, low, high = stats.ratio_of_medians(num, den, seed=trial)
        covered += low <= true_ratio <= high
    return covered / trials


@pytest.mark.parametrize("n", PROFILE_SAMPLES)
@pytest.mark.parametrize("sigma", [0.05, 0.3])
def test_the_interval_covers_the_true_ratio_at_every_profiles_sample_count(n, sigma):
    assert _coverage(n, sigma) >= MIN_COVERAGE


def test_coverage_falls_short_at_three_samples():
    """Why no profile takes three samples: the percentile interval of a median of three covers about
    90%, not 95% (and the check above would fail there)."""
    assert _coverage(3, 0.3) < MIN_COVERAGE


def test_non_positive_denominators_and_missing_times_give_nulls():
    """The docstrings: no ratio for a non-positive median, no efficiency for a missing or non-positive time."""
    assert stats.ratio_of_medians([1.0, 2.0], [0.0, 0.0, 1.0]) == (None, None, None)
    assert stats.ratio_of_medians([1.0, 2.0], [-0.5, -0.5]) == (None, None, None)
    assert stats.scaling_efficiency(8.0, -1.0, 8) is None and stats.scaling_efficiency(8.0, 0.0, 8) is None
    assert stats.scaling_efficiency(8.0, None, 8) is None and stats.scaling_efficiency(None, 1.0, 8) is None
    assert stats.scaling_efficiency(8.0, 1.0, 0) is None


def test_the_default_seed_is_the_recorded_default():
    """Callers that record no seed get seed 0 (the builder recomputes with the run's recorded seed)."""
    rng = np.random.default_rng(9)
    num, den = _lognormal(rng, 2.0, 0.3, 20), _lognormal(rng, 1.0, 0.3, 20)
    assert stats.ratio_of_medians(num, den) == stats.ratio_of_medians(num, den, seed=0, key="")
