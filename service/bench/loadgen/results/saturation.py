"""Did the load generator keep up? A run's client is saturated when it sent late or a worker ran out of CPU.

Dispatch lag (sent minus the earliest moment a request could have been sent) over LAG_P99_LIMIT_S at the 99th
percentile, or a worker busy for CPU_SHARE_LIMIT of the run's wall time, means the latencies include the
generator's own queueing: the result is flagged (table, JSON, results store) and `bench capacity` does not name
the server as the limit at such a load. The requests due at the very start with a slot free (a closed loop's
first wave, or everything in a run at an infinite rate) are left out of the lag: a burst due at one instant
cannot all go out at that instant, on any client.
"""

import numpy as np

LAG_P99_LIMIT_S = 0.025
CPU_SHARE_LIMIT = 0.9


def client_saturation(results, workers=()) -> dict:
    """{'saturated', 'reasons', 'workers': [{rank, sent, cpu_share, dispatch_lag_p99_ms}]} for one run.

    `workers`: the WorkerStats of a run in worker processes (none for a run in this process)."""
    reasons = []
    results = [r for r in results if r.ready > 0]
    lag = np.array([r.sent - r.ready for r in results], dtype=float)
    if lag.size and np.percentile(lag, 99) > LAG_P99_LIMIT_S:
        reasons.append(f"dispatch lag p99 {np.percentile(lag, 99) * 1e3:,.0f} ms > {LAG_P99_LIMIT_S * 1e3:g} ms")
    rows = []
    for w in workers:
        own = np.array([r.sent - r.ready for r in results if r.worker == w.rank], dtype=float)
        p99 = float(np.percentile(own, 99)) * 1e3 if own.size else None
        rows.append({"rank": w.rank, "sent": w.sent, "cpu_share": w.cpu_share, "dispatch_lag_p99_ms": p99})
        if w.cpu_share >= CPU_SHARE_LIMIT:
            reasons.append(f"worker {w.rank} busy {w.cpu_share:.0%} of the run")
        if p99 is not None and p99 > LAG_P99_LIMIT_S * 1e3:
            reasons.append(f"worker {w.rank} dispatch lag p99 {p99:,.0f} ms")
    return {"saturated": bool(reasons), "reasons": reasons, "workers": rows}
