"""One probe of `bench capacity`: hold a load until steady-state statistics are in, sampling the server's /metrics.

A monitor on the load's event loop ends the probe: normally once the warm-up is over and both the minimum count of
measured requests and the minimum measured duration are reached (then the requests in flight finish); early, with
the requests in flight cancelled, when the server is saturated or errors exceed their limit.
"""

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from service.bench.loadgen.capacity import search as capacity_search
from service.bench.loadgen.results import crosscheck
from service.bench.loadgen.send.request import RequestResult
from service.bench.loadgen.results.saturation import client_saturation
from service.bench.loadgen.send.dispatch import LoadSpec, Stop
from service.bench.loadgen.send.workers import run_workers

TICK_S = 0.1  # how often the monitor looks at the requests
SCRAPE_EVERY_S = 1.0  # how often the server's /metrics is read during a probe

# the server's scheduler metrics under each naming (vLLM's checked against its docs only, not a live vLLM)
SERVER_NAMES = {
    "llm-service": {"waiting": "llm_requests_waiting", "running": "llm_requests_running",
                    "kv": "llm_kv_cache_usage_ratio", "preemptions": "llm_preemptions_total",
                    "queue": "llm_request_queue_seconds", "ttft": "llm_time_to_first_token_seconds",
                    "model_label": "model"},
    "vllm": {"waiting": "vllm:num_requests_waiting", "running": "vllm:num_requests_running",
             "kv": "vllm:kv_cache_usage_perc", "preemptions": "vllm:num_preemptions_total",
             "queue": "vllm:request_queue_time_seconds", "ttft": "vllm:time_to_first_token_seconds",
             "model_label": "model_name"},
}


@dataclass
class Steady:
    """When a probe has measured enough, and when it must stop."""
    warmup_s: float = 10.0  # requests sent before this are warm-up, left out of the statistics
    min_requests: int = 50  # measured requests (sent after the warm-up)
    min_duration_s: float = 30.0  # measured seconds (after the warm-up)
    max_duration_s: float = 600.0  # no request is sent after this, whatever was measured
    max_error_rate: float = 0.05  # of finished requests; beyond it (after 10 of them) the probe is stopped
    skip_first: int = 0  # also warm-up: the first N requests (concurrency mode: the first wave finds the server empty)
    detect_saturation: bool = True  # open loop only: a closed loop cannot grow a backlog


@dataclass
class Probe:
    load: float
    results: list[RequestResult]
    measured: list[RequestResult]
    stopped: str | None  # None (steady minimum reached), 'saturated', 'errors', 'time limit'
    wall_s: float
    server: dict | None = None  # what /metrics showed during the measured window
    server_note: str = ""
    generator: dict | None = None  # the load generator's own state: client_saturation() of the probe


def _kind(samples) -> str | None:
    names = {n for n, _, _ in samples}
    return next((k for k, v in SERVER_NAMES.items() if v["waiting"] in names), None)


def summarize_server(timeline: list[tuple[float, list]], warmup_s: float, model: str, why: str = ""
                     ) -> tuple[dict | None, str]:
    """Gauges averaged over the measured window's scrapes; counters as deltas across it."""
    if not timeline:
        return None, f"server metrics skipped: {why or 'no /metrics scrape succeeded during the probe'}"
    kind = _kind(timeline[-1][1])
    if kind is None:
        return None, ("server metrics skipped: /metrics holds none of the known scheduler gauges ("
                      + ", ".join(v["waiting"] for v in SERVER_NAMES.values()) + ")")
    names = SERVER_NAMES[kind]
    label = names["model_label"]
    window = [s for t, s in timeline if t >= warmup_s] or [timeline[-1][1]]
    first = next((s for t, s in timeline if t >= warmup_s), timeline[0][1])
    if first is window[-1] and len(timeline) > 1:
        first = timeline[0][1]  # one scrape in the window: take the deltas over the whole probe
    total = lambda s, name: crosscheck._total(s, name, label, model)
    gauge = lambda name: np.array([total(s, name) for s in window])
    delta = lambda name: total(window[-1], name) - total(first, name)
    waiting, running, kv = gauge(names["waiting"]), gauge(names["running"]), gauge(names["kv"])
    queue_n, ttft_n = delta(names["queue"] + "_count"), delta(names["ttft"] + "_count")
    return {"kind": kind, "scrapes": len(window),
            "waiting_mean": float(waiting.mean()), "waiting_max": float(waiting.max()),
            "running_mean": float(running.mean()), "running_max": float(running.max()),
            "kv_usage_mean": float(kv.mean()), "kv_usage_max": float(kv.max()),
            "preemptions": delta(names["preemptions"]),
            "queue_s_mean": delta(names["queue"] + "_sum") / queue_n if queue_n > 0 else None,
            "ttft_s_mean": delta(names["ttft"] + "_sum") / ttft_n if ttft_n > 0 else None}, ""


async def _sample_server(spec: LoadSpec, clock: dict, stop: Stop, timeline: list, why: list) -> None:
    while True:
        samples, reason = await asyncio.to_thread(crosscheck.scrape, spec.base_url, spec.api_key, 2.0)
        if samples is not None:
            timeline.append((time.perf_counter() - clock["t0"], samples))
        elif not timeline:
            why.append(reason)
            return  # no /metrics at all: nothing to sample
        if stop.draining.is_set():
            return  # one scrape after the last request was sent closes the window
        try:
            await asyncio.wait_for(stop.draining.wait(), SCRAPE_EVERY_S)
        except TimeoutError:
            pass


async def _probe(spec: LoadSpec, workload, steady: Steady, read_server: bool, workers: int) -> tuple:
    sent: list[RequestResult] = []
    finished: list[RequestResult] = []
    stop = Stop()
    reason: list[str | None] = [None]
    until = 0.0  # the monitor's last look before the drain
    timeline: list[tuple[float, list]] = []
    why: list[str] = []
    measured = lambda r: r.sent >= steady.warmup_s and r.index >= steady.skip_first
    # the workers' common start, once they are ready: request times are seconds from it
    clock = {"t0": time.perf_counter(), "started": False}

    def started(t0: float) -> None:
        clock.update(t0=t0, started=True)

    def end(cause: str | None, abort: bool) -> None:
        reason[0] = reason[0] or cause
        stop.abort() if abort else stop.drain()

    async def monitor() -> None:
        nonlocal until
        while not stop.aborted.is_set():
            await asyncio.sleep(TICK_S)
            if not clock["started"]:
                continue
            now = time.perf_counter() - clock["t0"]
            if not stop.draining.is_set():
                until = now
            failed = [r for r in finished if not r.ok]
            if len(finished) >= 10 and len(failed) > steady.max_error_rate * len(finished):
                end("errors", abort=True)
                return
            if steady.detect_saturation and until - steady.warmup_s >= steady.min_duration_s / 3:
                # requests in flight over the measured window (up to the drain), rebuilt from send and end times,
                # so a starved monitor loop still sees the whole curve
                grid = np.linspace(steady.warmup_s, until, 24)
                in_flight = (np.searchsorted(np.sort([r.sent for r in sent]), grid, side="right")
                             - np.searchsorted(np.sort([r.ended for r in finished]), grid, side="right"))
                first = [r for r in sent if measured(r) and r.chunk_times]
                # too few first tokens to fit a trend to: the backlog alone decides, after a full measured window
                blind = len(first) < 8
                if (not blind or until - steady.warmup_s >= steady.min_duration_s) and capacity_search.saturated(
                        grid, in_flight, [r.sent for r in first], [r.ttft for r in first], backlog_only=blind):
                    end("saturated", abort=True)
                    return
            if stop.draining.is_set():
                if len(finished) == len(sent):
                    return
                continue
            if now >= steady.warmup_s + steady.min_duration_s and sum(map(measured, sent)) >= steady.min_requests:
                end(None, abort=False)
            elif now >= steady.max_duration_s:
                end("time limit", abort=False)

    tasks = [asyncio.create_task(monitor())]
    if read_server:
        tasks.append(asyncio.create_task(_sample_server(spec, clock, stop, timeline, why)))
    run = await run_workers(spec, workload, workers, on_done=finished.append, stop=stop, on_send=sent.append,
                            on_start=started)
    stop.drain()  # the schedule may end on its own (the duration bound): let the monitor and sampler finish
    await asyncio.gather(*tasks)
    if read_server and timeline:  # the last scrape, after every request of the probe ended
        samples, _ = await asyncio.to_thread(crosscheck.scrape, spec.base_url, spec.api_key, 2.0)
        if samples is not None:
            timeline.append((time.perf_counter() - clock["t0"], samples))
    return run, reason[0], timeline, measured, "; ".join(why)


def run_probe(load: float, spec: LoadSpec, workload, steady: Steady, read_server: bool, workers: int = 1) -> Probe:
    started = time.perf_counter()
    run, reason, timeline, measured, why = asyncio.run(_probe(spec, workload, steady, read_server, workers))
    kept = [r for r in run.results if measured(r) and r.error != "stopped"]
    if reason is None and len(kept) < steady.min_requests:
        reason = "time limit"  # the schedule ran out (--max-probe-duration) before the minimum was measured
    probe = Probe(load, run.results, kept, reason, time.perf_counter() - started,
                  generator=client_saturation(kept, run.workers))  # judged on the measured requests only
    if read_server:
        probe.server, probe.server_note = summarize_server(timeline, steady.warmup_s, spec.model, why)
    else:
        probe.server_note = "server metrics not read (--server-metrics off)"
    return probe
