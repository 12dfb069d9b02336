"""Service level objectives: one grammar, one dataclass, for `bench serve` and `bench capacity`.

An SLO bounds one latency metric. Without a percentile it is a per-request bound: a request meets it when its own
value is within the bound, and goodput counts the requests that meet every such bound. With a percentile it is a
target for the whole run: that percentile of the metric must be within the bound (`bench capacity` judges it).

    METRIC[:pPCT] (<= | : | =) VALUE[ms|s]       ttft:500ms  ttft<=500ms  tpot=0.05s  ttft:p95<=500ms  e2e<=2s

METRIC is ttft, tpot, itl or e2e; VALUE is in milliseconds unless it ends in s. A percentile needs `<=`.
"""

import math
import re
from dataclasses import dataclass

import numpy as np

METRICS = {
    "ttft": "time to first token",
    "tpot": "time per output token after the first",
    "itl": "inter-token gap (per request: its largest gap)",
    "e2e": "end-to-end latency",
}

_GRAMMAR = re.compile(r"\s*(\w+)\s*(?::\s*p(\d+(?:\.\d+)?)\s*(?=<=))?(<=|:|=)\s*([0-9.]+(?:[eE][+-]?\d+)?)\s*(ms|s)?\s*")


@dataclass(frozen=True)
class SLO:
    metric: str  # one of METRICS
    seconds: float
    percentile: float | None = None  # None: a bound on every request; else a target on this percentile of the run

    def __str__(self) -> str:
        p = "" if self.percentile is None else f":p{self.percentile:g}"
        return f"{self.metric}{p}<={self.seconds * 1000:g}ms"


def parse(text: str) -> SLO:
    """'ttft:500ms', 'tpot=0.05s', 'e2e<=2000' (per request) or 'ttft:p95<=500ms' (a percentile target)."""
    m = _GRAMMAR.fullmatch(text)
    if not m or m.group(1).lower() not in METRICS:
        raise ValueError(f"an SLO is METRIC:pXX<=VALUE (a percentile target) or METRIC:VALUE (a bound on every "
                         f"request) with METRIC one of {', '.join(METRICS)} and VALUE like 500ms or 2s, got {text!r}")
    percentile = float(m.group(2)) if m.group(2) else None
    if percentile is not None and not 0 < percentile < 100:
        raise ValueError(f"an SLO percentile is between 0 and 100 (exclusive), got {text!r}")
    value = float(m.group(4))
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"an SLO value must be a positive number, got {text!r}")
    return SLO(m.group(1).lower(), value / 1000 if m.group(5) in (None, "ms") else value, percentile)


def meets(slos, ttft, tpot_s, max_itl, e2e, ok) -> np.ndarray:
    """Which requests succeeded and met every SLO's bound (a percentile, if given, plays no part per request).

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
