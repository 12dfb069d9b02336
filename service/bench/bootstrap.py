"""Percentile-bootstrap confidence intervals, seeded, for every bench command that judges measurements.

Each interval resamples its samples with replacement RESAMPLES times and takes the central `confidence` share of
the statistic's draws. The seed is fixed, so the same data always gets the same interval (and the same verdict).
"""

import math

import numpy as np

RESAMPLES = 2000
CONFIDENCE = 0.95


def draws(values, statistic, rng: np.random.Generator, resamples: int = RESAMPLES) -> np.ndarray:
    """The statistic (a numpy reduction taking axis=1) of `resamples` resamples of the values."""
    x = np.asarray(values, dtype=float)
    return statistic(x[rng.integers(0, x.size, (resamples, x.size))], axis=1)


def central(draws_: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The central `confidence` share of the draws: (low, high)."""
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(draws_, [tail, 100 - tail])
    return float(low), float(high)


def percentile_ci(values, q: float, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                  seed: int = 0) -> tuple[float, float, float]:
    """The q-th percentile of the finite values and its interval; NaNs when there are none."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return math.nan, math.nan, math.nan
    pct = lambda a, axis: np.percentile(a, q, axis=axis)  # noqa: E731
    low, high = central(draws(x, pct, np.random.default_rng(seed), resamples), confidence)
    return float(np.percentile(x, q)), low, high


def median_ratio_ci(baseline, candidate, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                    seed: int = 0) -> tuple[float, float, float]:
    """median(candidate) / median(baseline) and its interval; the two samples are resampled independently."""
    b, c = np.asarray(baseline, dtype=float), np.asarray(candidate, dtype=float)
    rng = np.random.default_rng(seed)
    boot_b, boot_c = draws(b, np.median, rng, resamples), draws(c, np.median, rng, resamples)
    low, high = central(boot_c / boot_b, confidence)
    return float(np.median(c) / np.median(b)), low, high



def log_median_sd(values, resamples: int = RESAMPLES, seed: int = 0) -> float:
    """The standard error of log(median(values)): how far a run's median moves with the noise inside the run."""
    return float(np.std(np.log(draws(values, np.median, np.random.default_rng(seed), resamples)), ddof=1))
