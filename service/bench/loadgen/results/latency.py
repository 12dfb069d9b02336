"""Statistics of a load run as pure functions over numpy arrays: percentiles and TPOT (SLOs: bench/slo.py).

Percentiles use numpy's default method, 'linear' (Hyndman & Fan type 7: the value at rank p/100 * (n - 1),
interpolated between the two nearest samples). Undefined values are NaN and are left out of statistics.
"""

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


def parse_percentiles(text: str) -> tuple[float, ...]:
    """'50,90,99.9' -> (50.0, 90.0, 99.9); each in [0, 100]."""
    values = tuple(float(p) for p in text.split(",") if p.strip())
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"percentiles must be a comma list of numbers in [0, 100], got {text!r}")
    return values


def percentile_key(p: float) -> str:
    """50 -> 'median', 99 -> 'p99', 99.9 -> 'p99.9'."""
    return "median" if p == 50 else f"p{p:g}"


def distribution(values, percentiles=DEFAULT_PERCENTILES) -> dict[str, float | None]:
    """mean, median and the given percentiles of the finite values; None for each when there are none."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    keys = ["mean", "median"] + [percentile_key(p) for p in percentiles if p != 50]
    if x.size == 0:
        return dict.fromkeys(keys)
    out = {"mean": float(x.mean()), "median": float(np.percentile(x, 50))}
    for p in percentiles:
        if p != 50:
            out[percentile_key(p)] = float(np.percentile(x, p))
    return out


def tpot(e2e, ttft, output_tokens) -> np.ndarray:
    """Time per output token after the first: (e2e - ttft) / (output_tokens - 1); NaN with fewer than 2 tokens."""
    e2e, ttft, n = (np.asarray(a, dtype=float) for a in (e2e, ttft, output_tokens))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 1, (e2e - ttft) / (n - 1), np.nan)

