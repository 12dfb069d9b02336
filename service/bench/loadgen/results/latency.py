"""Latency statistics of a load run as pure functions over numpy arrays: percentiles, TPOT, SLOs and goodput.

Percentiles use numpy's default method, 'linear' (Hyndman & Fan type 7: the value at rank p/100 * (n - 1),
interpolated between the two nearest samples). Undefined values are NaN and are left out of statistics.
"""

import math
import re
from dataclasses import dataclass

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


# --- service level objectives -------------------------------------------------------------------------------

SLO_METRICS = {
    "ttft": "time to first token",
    "tpot": "time per output token after the first",
    "itl": "the request's largest inter-token gap",
    "e2e": "end-to-end latency",
}


@dataclass(frozen=True)
class SLO:
    metric: str  # one of SLO_METRICS
    seconds: float

    def __str__(self) -> str:
        return f"{self.metric}<={self.seconds * 1000:g}ms"


def parse_slo(text: str) -> SLO:
    """'ttft:500ms', 'tpot:0.05s', 'e2e:2s' (a bare number is milliseconds)."""
    m = re.fullmatch(r"\s*(\w+)\s*[:=]\s*([0-9.eE+-]+)\s*(ms|s)?\s*", text)
    if not m or m.group(1).lower() not in SLO_METRICS:
        raise ValueError(f"an SLO is METRIC:VALUE with METRIC in {sorted(SLO_METRICS)} and VALUE like 500ms "
                         f"or 2s, got {text!r}")
    value = float(m.group(2))
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"an SLO value must be a positive number, got {text!r}")
    return SLO(m.group(1).lower(), value / 1000 if m.group(3) in (None, "ms") else value)


def meets_slos(slos, ttft, tpot_s, max_itl, e2e, ok) -> np.ndarray:
    """Which requests succeeded and met every SLO.

    A request with one output token has no TPOT and no gap (NaN); it meets those SLOs, as it has no decode phase.
    """
    values = {"ttft": ttft, "tpot": tpot_s, "itl": max_itl, "e2e": e2e}
    met = np.asarray(ok, dtype=bool).copy()
    for slo in slos:
        v = np.asarray(values[slo.metric], dtype=float)
        met &= np.isnan(v) | (v <= slo.seconds) if slo.metric in ("tpot", "itl") else (v <= slo.seconds)
    return met


def goodput(met, duration: float) -> float:
    """Requests per second that succeeded within every SLO (vLLM's and DistServe's definition)."""
    return float(np.count_nonzero(met)) / duration if duration > 0 else 0.0
