"""A bench serve run into the results store: every request's latencies as iterations, the run's rates once.

Per-request values (TTFT, end-to-end, time per output token) let `bench regress` judge two load runs with the
same statistics as engine iterations; rates exist once per run, so regress calls them inconclusive alone.
"""

import numpy as np

from service.bench.loadgen.send.request import RequestResult
from service.bench.loadgen.results.latency import tpot

# settings that describe where and when, not what load: runs that differ only in them are one configuration
INCIDENTAL = ("label", "started_at", "command", "client", "base_url", "percentiles", "slo")
RATES = {"request_throughput": ("requests_per_second", "req/s"), "output_throughput": ("output_tokens_per_second", "tok/s"),
         "total_throughput": ("total_tokens_per_second", "tok/s"), "goodput": ("goodput_requests_per_second", "req/s"),
         "requests.failed": ("failed_requests", "count")}


def record_run(store, document: dict, results: list[RequestResult], name: str) -> int:
    settings = document["settings"]
    config = {k: v for k, v in settings.items() if k not in INCIDENTAL}
    with store.run(kind="serve", config=config, label=settings.get("label"), name=name) as run:
        run.client_saturated = document["load_generator"]["saturated"]
        record_requests(run, results)
        for key, (metric, unit) in RATES.items():
            if document["summary"].get(key) is not None:
                run.measure(metric, document["summary"][key], unit=unit)
    return run.id


def record_requests(run, results: list[RequestResult]) -> None:
    """Each successful request's TTFT, end-to-end latency and time per output token, as iterations."""
    ok = [r for r in results if r.ok]
    per_request = {"ttft_seconds": [r.ttft for r in ok], "e2e_seconds": [r.e2e for r in ok],
                   "tpot_seconds": tpot([r.e2e for r in ok], [r.ttft for r in ok], [r.output_tokens or 0 for r in ok])}
    for metric, values in per_request.items():
        for i, value in enumerate(values):
            if value is not None and np.isfinite(value):
                run.measure(metric, float(value), unit="s", iteration=i)
