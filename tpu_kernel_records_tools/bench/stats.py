"""Per-case timing statistics and paired ratios with bootstrap confidence intervals (numpy only)."""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


def summarize(samples_ms: Sequence[float]) -> dict[str, float | None]:
    """Median, min, max, first and third quartile and IQR of timing samples, all in ms.

    Quartiles use numpy's default (linear) interpolation. Every value is ``None`` for no samples.
    """
    keys = ("median_ms", "min_ms", "max_ms", "q1_ms", "q3_ms", "iqr_ms")
    if len(samples_ms) == 0:
        return dict.fromkeys(keys)
    x = np.asarray(samples_ms, dtype=np.float64)
    q1, median, q3 = np.percentile(x, [25, 50, 75])
    values = (median, x.min(), x.max(), q1, q3, q3 - q1)
    return {k: float(v) for k, v in zip(keys, values)}


def _rng(seed: int, key: str) -> np.random.Generator:
    """A generator fixed by ``seed`` and ``key``, so each pair's CI is reproducible on its own."""
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(key.encode())]))


def ratio_of_medians(numerator_ms: Sequence[float], denominator_ms: Sequence[float], *, seed: int = 0,
                     key: str = "", resamples: int = BOOTSTRAP_RESAMPLES,
                     confidence: float = CONFIDENCE) -> tuple[float | None, float | None, float | None]:
    """``median(numerator) / median(denominator)`` and its percentile-bootstrap confidence interval.

    Both sample sets are resampled independently with replacement ``resamples`` times; the interval
    is the central ``confidence`` mass of the resampled ratios. The RNG is seeded by ``seed`` and
    ``key`` (e.g. the pair's case ids), so the interval is reproducible. Returns
    ``(ratio, ci_low, ci_high)``; ``(None, None, None)`` when either side has no samples or a
    non-positive median.
    """
    num = np.asarray(numerator_ms, dtype=np.float64)
    den = np.asarray(denominator_ms, dtype=np.float64)
    if num.size == 0 or den.size == 0 or np.median(den) <= 0:
        return None, None, None
    ratio = float(np.median(num) / np.median(den))
    rng = _rng(seed, key)
    num_boot = np.median(rng.choice(num, size=(resamples, num.size), replace=True), axis=1)
    den_boot = np.median(rng.choice(den, size=(resamples, den.size), replace=True), axis=1)
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(num_boot / den_boot, [tail, 100 - tail])
    return ratio, float(low), float(high)


def scaling_efficiency(t1_ms: float | None, tn_ms: float | None, devices: int) -> float | None:
    """Strong-scaling efficiency ``t1 / (n * tn)``: 1.0 is perfect, ``None`` when a time is missing."""
    if t1_ms is None or tn_ms is None or tn_ms <= 0 or devices < 1:
        return None
    return float(t1_ms / (devices * tn_ms))
