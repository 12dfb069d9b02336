"""The pure logic of `bench capacity`: a probe's verdict on the SLOs with its uncertainty, saturation, the search.

No I/O here: every function takes numbers and returns numbers, so the search is tested with known answers.
"""

import math
from dataclasses import dataclass, field

import numpy as np

from service.bench.bootstrap import CONFIDENCE, percentile_ci
from service.bench.slo import SLO


def parse_precision(text: str) -> float:
    """'5%' or '0.05' -> 0.05: the largest gap left between the last passing and the first failing load."""
    t = text.strip()
    value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    if not 0 < value < 1:
        raise ValueError(f"--precision is a fraction in (0, 1) or a percentage like 5%, got {text!r}")
    return value


# --- one probe's verdict ------------------------------------------------------------------------------------

def wilson_ci(successes: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """A share and its Wilson score interval (honest near 0 and 1, where a bootstrap collapses to a point)."""
    if n == 0:
        return math.nan, 0.0, 1.0
    z = _z(confidence)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return p, max(0.0, centre - half), min(1.0, centre + half)


def _z(confidence: float) -> float:
    """The two-sided standard normal quantile (statistics.NormalDist keeps scipy out)."""
    from statistics import NormalDist
    return NormalDist().inv_cdf(0.5 + confidence / 2)


@dataclass
class Check:
    """One objective on one probe: the measured value, its interval, and pass / fail / close."""
    name: str
    value: float
    low: float
    high: float
    limit: float
    verdict: str  # pass, fail, close (the interval holds the limit)
    higher_is_better: bool = False


def _verdict(value: float, low: float, high: float, limit: float, higher_is_better: bool) -> str:
    if math.isnan(value):
        return "fail"  # nothing measured (every request failed) cannot meet an objective
    ok, sure_ok, sure_bad = ((value >= limit, low >= limit, high < limit) if higher_is_better else
                             (value <= limit, high <= limit, low > limit))
    return "pass" if sure_ok else "fail" if sure_bad else "close"


def judge(targets: list[SLO], samples: dict[str, np.ndarray], met: np.ndarray | None = None,
          target_ratio: float | None = None, confidence: float = CONFIDENCE) -> list[Check]:
    """Hold a probe's measured requests against the objectives.

    Percentile mode (target_ratio None): each target's percentile of `samples[metric]` (seconds) with a
    bootstrap interval. Goodput mode: the share of requests in `met` (one bool per request sent, failures
    included) with a Wilson interval, against target_ratio. A verdict is 'close' when the interval holds the limit.
    """
    if target_ratio is not None:
        share, low, high = wilson_ci(int(np.count_nonzero(met)), len(met), confidence)
        return [Check("goodput_ratio", share, low, high, target_ratio, _verdict(share, low, high, target_ratio, True),
                      True)]
    checks = []
    for t in targets:
        value, low, high = percentile_ci(samples[t.metric], t.percentile, confidence)
        checks.append(Check(str(t), value, low, high, t.seconds, _verdict(value, low, high, t.seconds, False)))
    return checks


def overall(checks: list[Check], decide: bool = False) -> str:
    """fail if any objective surely fails, pass if all surely pass, else close; `decide` settles a close call
    by the point estimates (used once the repeats are spent)."""
    verdicts = [c.verdict for c in checks]
    if "fail" in verdicts:
        return "fail"
    if "close" not in verdicts:
        return "pass"
    if not decide:
        return "close"
    within = [(c.value >= c.limit) if c.higher_is_better else (c.value <= c.limit) for c in checks]
    return "pass" if all(within) else "fail"


# --- saturation: a queue that grows without bound -----------------------------------------------------------

def rising(t, y, z: float = 3.0) -> tuple[float, bool]:
    """Least-squares slope of y over t, and whether it is positive beyond z standard errors."""
    t, y = np.asarray(t, dtype=float), np.asarray(y, dtype=float)
    if t.size < 8 or np.ptp(t) == 0:
        return 0.0, False
    tc = t - t.mean()
    slope = float((tc * (y - y.mean())).sum() / (tc * tc).sum())
    residual = y - y.mean() - slope * tc
    se = math.sqrt(float((residual * residual).sum()) / (t.size - 2) / float((tc * tc).sum()))
    return slope, slope - z * se > 0


def saturated(times, in_flight, sent_at, ttft, min_rise: float = 4.0, backlog_only: bool = False) -> bool:
    """Requests in flight and time to first token both rising (beyond noise), and the backlog grown by at least
    `min_rise` requests over the window: the server takes in less than it is offered (guidellm's idea, own test).
    `backlog_only`: judge by requests in flight alone, for a server so far behind that too few measured requests
    have a first token to fit a trend to."""
    flight_slope, flight_up = rising(times, in_flight)
    span = float(np.ptp(times)) if len(times) else 0.0
    ttft_up = backlog_only or rising(sent_at, ttft)[1]
    return flight_up and ttft_up and flight_slope * span >= min_rise


# --- the search ---------------------------------------------------------------------------------------------

@dataclass
class Search:
    """Ramp from `start` by `factor` until one load passes and one fails, then bisect until the gap between the
    last pass and the first fail is at most `precision` of the last pass (or one step, for whole numbers)."""
    start: float
    low: float
    high: float
    precision: float = 0.05
    factor: float = 2.0
    integer: bool = False  # concurrency
    results: dict[float, bool] = field(default_factory=dict)  # load -> passed

    def __post_init__(self):
        if not 0 < self.low <= self.start <= self.high:
            raise ValueError(f"need 0 < min <= start <= max, got {self.low:g}, {self.start:g}, {self.high:g}")
        if not self.factor > 1:
            raise ValueError(f"the ramp factor must be > 1, got {self.factor:g}")

    def record(self, load: float, passed: bool) -> None:
        self.results[load] = passed

    @property
    def first_fail(self) -> float | None:
        return min((v for v, ok in self.results.items() if not ok), default=None)

    @property
    def last_pass(self) -> float | None:
        """The highest passing load below the first failure (a noisy pass above it does not count)."""
        ceiling = self.first_fail if self.first_fail is not None else math.inf
        return max((v for v, ok in self.results.items() if ok and v < ceiling), default=None)

    @property
    def outcome(self) -> str | None:
        """None while searching; found, none_meets (even `low` fails) or all_meet (even `high` passes)."""
        p, f = self.last_pass, self.first_fail
        if f is not None and f <= self.low:
            return "none_meets"
        if f is None and p is not None and p >= self.high:
            return "all_meet"
        if p is not None and f is not None and f - p <= (max(1.0, self.precision * p) if self.integer
                                                         else self.precision * p):
            return "found"
        return None

    def next_load(self) -> float | None:
        if self.outcome:
            return None
        p, f = self.last_pass, self.first_fail
        if p is None and f is None:
            return self.start
        if f is None:  # ramp up
            value = min(self.high, math.ceil(p * self.factor) if self.integer else p * self.factor)
        elif p is None:  # the first load failed: ramp down
            value = max(self.low, math.floor(f / self.factor) if self.integer else f / self.factor)
        else:  # bisect the bracket
            value = (p + f) // 2 if self.integer else _round((p + f) / 2)
        return float(value)


def _round(x: float) -> float:
    """Four significant digits: loads print cleanly, and the bracket still shrinks."""
    return float(f"{x:.4g}")


# --- what limited capacity ----------------------------------------------------------------------------------

def diagnose(failing: list[str], server: dict | None) -> tuple[str, str]:
    """(kind, explanation) for the first failing load: kv_cache, queueing, decode or prefill.

    `failing`: the metrics whose objective failed there (ttft, tpot, itl, e2e; 'goodput' in goodput mode).
    `server`: what the server's /metrics showed during that probe (None when it could not be read).
    """
    decode_bound = any(m in ("tpot", "itl") for m in failing)
    if not server:
        kind = "decode" if decode_bound and "ttft" not in failing else "unknown"
        return kind, ("server metrics unavailable; judged from the client only: " +
                      ("time per output token failed first, so decode speed" if kind == "decode" else
                       f"the objectives that failed were {', '.join(failing)}"))
    preempted, kv = server.get("preemptions") or 0, server.get("kv_usage_max")
    waiting, queue_s, ttft_s = server.get("waiting_mean") or 0.0, server.get("queue_s_mean"), server.get("ttft_s_mean")
    if preempted > 0:
        return "kv_cache", (f"KV-cache pressure: {preempted:g} preemptions (KV usage peaked at "
                            f"{kv:.0%}); preempted requests are recomputed" if kv is not None else
                            f"KV-cache pressure: {preempted:g} preemptions")
    queued_share = queue_s / ttft_s if queue_s is not None and ttft_s else None
    if waiting >= 1.0 or (queued_share is not None and queued_share >= 0.5):
        share = f", {queued_share:.0%} of the server's mean TTFT spent queued" if queued_share is not None else ""
        return "queueing", (f"queueing: {waiting:.1f} requests waiting on average{share}; the batch is full "
                            "(max_num_seqs or the token budget)")
    if decode_bound:
        return "decode", ("decode speed: no queue and no preemption, but each step slows as the batch grows "
                          f"(failed: {', '.join(failing)})")
    return "prefill", (f"prefill/compute: no queue and no preemption, yet {', '.join(failing)} failed; "
                       "prompt processing competes with the running batch")
