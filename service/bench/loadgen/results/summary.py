"""The flat summary of one load run: latency distributions, throughput, goodput, errors and the generator's lag.

Keys are flat ('ttft_ms.p95', 'output_throughput', 'errors.http_503') so that `bench compare` can diff any two
runs. Latencies are over successful requests; inter-token gaps are pooled over all of them (as vLLM does).
"""

import math
from collections import Counter

import numpy as np

from service.bench.loadgen.results import latency
from service.bench.loadgen.send.request import RequestResult
from service.bench.slo import goodput, meets


def _ms(values) -> np.ndarray:
    return np.asarray(values, dtype=float) * 1000.0


def _rate(times) -> float | None:
    """Events per second over the span of `times` ((n - 1) gaps); None with fewer than two."""
    t = np.sort(np.asarray(times, dtype=float))
    return float((t.size - 1) / (t[-1] - t[0])) if t.size > 1 and t[-1] > t[0] else None


def max_in_flight(results: list[RequestResult]) -> int:
    """The most requests open at the same moment (sent, not yet ended)."""
    events = sorted([(r.sent, 1) for r in results] + [(r.ended, -1) for r in results], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def summarize(results: list[RequestResult], duration: float, percentiles=latency.DEFAULT_PERCENTILES,
              slos=(), offered_rate: float = math.inf, cpu_seconds: float | None = None) -> dict:
    """`cpu_seconds`: the generator process's CPU time during the run (its own cost, if no server shares it)."""
    ok = [r for r in results if r.ok]
    ttft = np.array([r.ttft for r in ok], dtype=float)
    e2e = np.array([r.e2e for r in ok], dtype=float)
    out_tokens = np.array([r.output_tokens for r in ok], dtype=float)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    tpot = latency.tpot(e2e, ttft, out_tokens)
    gaps = [g for r in ok for g in r.itl]
    s: dict = {
        "requests.sent": len(results),
        "requests.completed": len(ok),
        "requests.failed": len(results) - len(ok),
        "requests.without_usage": sum(1 for r in ok if not r.usage_reported),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": int(out_tokens.sum()),
    }
    s.update({f"errors.{kind}": n for kind, n in sorted(Counter(r.error for r in results if r.error).items())})
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    s["request_throughput"] = per_second(len(ok))
    s["output_throughput"] = per_second(float(out_tokens.sum()))
    s["total_throughput"] = per_second(float(out_tokens.sum()) + in_tokens)
    if slos:
        max_itl = np.array([max(r.itl) if r.itl else np.nan for r in ok], dtype=float)
        met = meets(slos, ttft, tpot, max_itl, e2e, np.ones(len(ok), dtype=bool))
        s["goodput"] = goodput(met, duration)
        s["goodput_ratio"] = float(met.sum()) / len(results) if results else 0.0
        for slo in slos:
            alone = meets([slo], ttft, tpot, max_itl, e2e, np.ones(len(ok), dtype=bool))
            s[f"slo_attainment.{slo.metric}"] = float(alone.sum()) / len(results) if results else 0.0
    for name, values in (("ttft_ms", _ms(ttft)), ("tpot_ms", _ms(tpot)), ("itl_ms", _ms(gaps)), ("e2e_ms", _ms(e2e))):
        s.update({f"{name}.{k}": v for k, v in latency.distribution(values, percentiles).items()})
    # the generator itself: did it send on time, and at the offered rate?
    lag = _ms([r.sent - r.ready for r in results])
    s["dispatch_lag_ms.mean"] = float(lag.mean()) if lag.size else None
    s["dispatch_lag_ms.p99"] = float(np.percentile(lag, 99)) if lag.size else None
    s["dispatch_lag_ms.max"] = float(lag.max()) if lag.size else None
    s["offered_rate"] = None if math.isinf(offered_rate) else offered_rate
    s["scheduled_rate"] = _rate([r.scheduled for r in results])
    s["achieved_rate"] = _rate([r.sent for r in results])
    s["concurrency.mean"] = per_second(sum(r.ended - r.sent for r in results))
    s["concurrency.max"] = max_in_flight(results)
    if cpu_seconds is not None:
        s["generator.cpu_s"] = cpu_seconds
        s["generator.cpu_share"] = per_second(cpu_seconds)  # of one core
    return s
