"""Worker processes: one schedule, dealt to N processes that each run `run_load` on their own uvloop event loop.

The schedule (arrival times from the seed, request i's prompt from the workload) is the same in every process;
`deal` says which indices each worker sends and what share of the concurrency cap it holds (a closed loop's
indices are dealt in proportion to those shares, an open loop's round robin). The parent waits until every worker
is ready, then gives all of them one start time a little ahead; each request keeps its intended (scheduled) and
actual (sent) start, relative to that common start. Workers stream each request to the parent as it is sent,
at its first token and at its end, in batches (so `bench capacity` can watch a probe live), and the parent can
drain or abort them all. The merge is exact: every index once, each worker's count checked against what it sent.
"""

import asyncio
import math
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from service.bench.loadgen.send.dispatch import LoadRun, LoadSpec, Stop, run_load
from service.bench.loadgen.send.request import RequestResult

START_AHEAD_S = 0.2  # the common start is this far after the last worker said it is ready
FLUSH_S = 0.02  # a worker sends its news to the parent at least this often


def default_workers() -> int:
    """One per CPU the process may use, leaving one for the parent (and the rest of the machine)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def deal(workers: int, cap: int | None) -> tuple[list[int | None], list[int]]:
    """(each worker's share of the cap, the cycle of worker ranks that request indices follow).

    With a cap, there are never more workers than slots, and a worker holding k slots takes k of each cap indices.
    """
    if cap is None:
        return [None] * workers, list(range(workers))
    n = min(workers, cap)
    shares = [cap // n + (rank < cap % n) for rank in range(n)]
    return shares, [rank for rank, share in enumerate(shares) for _ in range(share)]


@dataclass
class WorkerStats:
    rank: int
    sent: int
    cpu_s: float  # the worker's CPU time from the common start to its last request's end
    wall_s: float

    @property
    def cpu_share(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class WorkersRun(LoadRun):
    workers: list[WorkerStats] = field(default_factory=list)


async def run_workers(spec: LoadSpec, workload, workers: int, on_done: Callable | None = None,
                      stop: Stop | None = None, on_send: Callable | None = None,
                      hook: Callable[[int, int], None] | None = None,
                      on_start: Callable[[float], None] | None = None) -> WorkersRun:
    """Like run_load, from `workers` processes; `workload.sample(i)` gives request i's sample.

    `on_start` learns the common start (a time.perf_counter() value) once it is set; every request's times are
    seconds from it. `hook(rank, index)`, a module-level function, runs in the worker as each request is sent
    (tests starve a worker with it)."""
    spec.check()
    shares, cycle = deal(workers, spec.max_concurrency)
    ctx = mp.get_context("spawn")  # a fresh interpreter: no threads or event loop inherited from this one
    news = ctx.Queue()
    pipes, procs = [], []
    for rank, share in enumerate(shares):
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, daemon=True, name=f"loadgen-worker-{rank}",
                           args=(rank, replace(spec, max_concurrency=share), workload, cycle, news, child_end, hook))
        proc.start()
        pipes.append(parent_end)
        procs.append(proc)
    live: dict[int, RequestResult] = {}
    merged: dict[int, RequestResult] = {}
    stats: list[WorkerStats] = []
    ready, started_at = 0, time.time()

    async def next_batch() -> list:
        while True:
            try:
                return await asyncio.to_thread(news.get, True, 0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"load generator worker {dead[0].name} died (exit {dead[0].exitcode})")

    async def relay_stop() -> None:
        await stop.draining.wait()
        for pipe in pipes:
            pipe.send("drain")
        await stop.aborted.wait()
        for pipe in pipes:
            pipe.send("abort")

    relay = asyncio.create_task(relay_stop()) if stop else None
    try:
        while len(stats) < len(procs):
            for kind, rank, payload in await next_batch():
                if kind == "ready":
                    ready += 1
                    if ready == len(procs):
                        start = time.perf_counter() + START_AHEAD_S
                        started_at = time.time() + START_AHEAD_S
                        for pipe in pipes:
                            pipe.send(("start", start))
                        if on_start:
                            on_start(start)
                elif kind == "sent":
                    live[payload.index] = payload
                    if on_send:
                        on_send(payload)
                elif kind == "first":
                    live[payload[0]].chunk_times[:] = [payload[1]]
                elif kind == "done":
                    _take(merged, live, payload)
                    if on_done:
                        on_done(live.get(payload.index, payload))
                elif kind == "stopped":  # cancelled by an abort: never reported as done
                    for r in payload:
                        _take(merged, live, r)
                else:  # "finished"
                    stats.append(payload)
    finally:
        if relay:
            relay.cancel()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    if len(merged) != sum(s.sent for s in stats):
        raise RuntimeError(f"the workers sent {sum(s.sent for s in stats)} requests but reported {len(merged)}")
    results = [merged[i] for i in sorted(merged)]
    return WorkersRun(results, max((r.ended for r in results), default=0.0), started_at,
                      sum(s.cpu_s for s in stats), sorted(stats, key=lambda s: s.rank))


def _take(merged: dict, live: dict, result: RequestResult) -> None:
    if result.index in merged:
        raise RuntimeError(f"request {result.index} was reported twice")
    placeholder = live.get(result.index)
    if placeholder is not None:  # the object callers saw at send time becomes the finished request
        placeholder.__dict__.update(result.__dict__)
        result = placeholder
    merged[result.index] = result


def _worker_main(rank, spec, workload, cycle, news, pipe, hook) -> None:
    import uvloop

    uvloop.run(_worker(rank, spec, workload, cycle, news, pipe, hook))


async def _worker(rank, spec: LoadSpec, workload, cycle: list[int], news, pipe, hook) -> None:
    loop = asyncio.get_running_loop()
    outbox: list = []
    stop = Stop()
    started = loop.create_future()

    def on_command() -> None:
        while pipe.poll():
            command = pipe.recv()
            if command == "drain":
                stop.drain()
            elif command == "abort":
                stop.abort()
            elif not started.done():
                started.set_result(command[1])

    loop.add_reader(pipe.fileno(), on_command)

    async def flush_often() -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            flush()

    def flush() -> None:
        if outbox:
            news.put(outbox[:])
            outbox.clear()

    def sent(r: RequestResult) -> None:
        r.worker = rank
        if hook:
            hook(rank, r.index)
        outbox.append(("sent", rank, RequestResult(r.index, r.scheduled, r.ready, r.sent, worker=rank)))

    news.put([("ready", rank, None)])
    start = await started
    flusher = asyncio.create_task(flush_often())
    cpu = time.process_time()
    mine = (lambda i: cycle[i % len(cycle)] == rank)
    run = await run_load(spec, workload.sample, on_done=lambda r: outbox.append(("done", rank, r)), stop=stop,
                         on_send=sent, on_first=lambda r: outbox.append(("first", rank, (r.index, r.ttft))),
                         mine=mine, start_at=start)
    cpu = time.process_time() - cpu
    flusher.cancel()
    stopped = [r for r in run.results if r.error == "stopped"]
    outbox.append(("stopped", rank, stopped))
    wall = max(run.duration, math.ulp(1.0))
    outbox.append(("finished", rank, WorkerStats(rank, len(run.results), cpu, wall)))
    flush()
    news.close()
    news.join_thread()
