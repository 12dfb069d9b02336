"""When each request of a load run is due: a precomputed, seeded arrival schedule.

Inter-arrival gaps are gamma distributed with shape = burstiness and mean = 1 / rate, so burstiness 1 is a
Poisson process, below 1 is burstier (same mean, variance 1 / (burstiness * rate**2)), above 1 is smoother.
"""

import math
from collections.abc import Iterator

import numpy as np

_BLOCK = 1024  # gaps are drawn in blocks, so a long duration run never holds more than it needs


def gamma_intervals(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Endless inter-arrival gaps in seconds; all zero when the rate is infinite (everything due at once)."""
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be > 0 (got rate={rate}, burstiness={burstiness})")
    if math.isinf(rate):
        while True:
            yield 0.0
    scale = 1.0 / (rate * burstiness)  # the mean of gamma(shape k, scale s) is k * s = 1 / rate
    while True:
        yield from rng.gamma(burstiness, scale, _BLOCK).tolist()


def constant_intervals(rate: float) -> Iterator[float]:
    """Endless gaps of exactly 1 / rate seconds."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (got {rate})")
    gap = 0.0 if math.isinf(rate) else 1.0 / rate
    while True:
        yield gap


def arrival_offsets(rate: float, burstiness: float = 1.0, seed: int = 0, constant: bool = False) -> Iterator[float]:
    """Endless arrival times in seconds from the run's start; the first request is due at 0.

    The same (rate, burstiness, seed) always gives the same sequence.
    """
    gaps = constant_intervals(rate) if constant else gamma_intervals(rate, burstiness, np.random.default_rng(seed))
    t = 0.0
    while True:
        yield t
        t += next(gaps)


def first_arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0, constant: bool = False) -> np.ndarray:
    """The first n arrival times of `arrival_offsets` as an array."""
    offsets = arrival_offsets(rate, burstiness, seed, constant)
    return np.array([next(offsets) for _ in range(n)], dtype=float)
