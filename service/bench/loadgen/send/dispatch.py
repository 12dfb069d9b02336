"""The load loop: one asyncio loop sends requests on a precomputed schedule, under an optional concurrency cap.

Open loop (a request rate, or arrival times given as they are), closed loop (a concurrency cap with every request
due at once), or both. The run is bounded by a request count, a duration (no request is sent after it), and a
timeout per request; each request's sample may choose its own endpoint, streaming, body fields and timeout.
Each request's dispatch lag (sent minus the earliest moment it could have been sent) measures the generator.
A caller may end a run early through a `Stop`: drain (send nothing more, let the requests in flight finish) or
abort (also cancel those in flight; they end with the error kind 'stopped').
A worker process sends only its share of the schedule (`mine`) from a start time common to all workers.

Requests go through one aiohttp session per loop: its C HTTP parser reads a streamed token in about a seventh of
the CPU time httpx took (8.9 against 60 us a token on the 2-core machine, against the mock server), and a
generator's CPU per token is what limits it. Idle pooled connections are closed after KEEPALIVE_S, well before the
usual servers' keep-alive timeout (uvicorn and vLLM: 5 s): with equal timeouts a request could go out on a
connection the server was closing that instant and end as connection_lost ('Server disconnected'), leaving
nothing in the server's log.
"""

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from service.bench.loadgen.send.request import RequestResult, request_body, send
from service.bench.loadgen.workload.arrivals import arrival_offsets
from service.bench.loadgen.workload.datasets import Sample

KEEPALIVE_S = 2.0


@dataclass
class LoadSpec:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    constant_rate: bool = False  # evenly spaced arrivals instead of gamma-distributed gaps
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration: float | None = None  # seconds after which no new request is sent
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    request_timeout: float = 600.0
    api_key: str | None = None
    schedule: tuple[float, ...] | None = None  # arrival offsets given as they are (bench soak's bursts): the rate,
    # burstiness and seed then play no part, and num_requests may be at most its length

    def check(self) -> None:
        if self.num_requests is None and self.duration is None:
            raise ValueError("bound the run: give a request count, a duration, or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("the request count must be >= 1")
        if self.duration is not None and not self.duration > 0:
            raise ValueError("the duration must be > 0 seconds")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("the maximum concurrency must be >= 1")
        if self.schedule is not None and (self.num_requests or math.inf) > len(self.schedule):
            raise ValueError("a given schedule bounds the run: the request count must be at most its length")
        if self.num_requests is None and math.isinf(self.request_rate) and self.max_concurrency is None:
            raise ValueError("a duration with an infinite request rate needs --max-concurrency (closed loop) "
                             "or a finite --request-rate")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise ValueError("the request rate and the burstiness must be > 0")


class Slots:
    """A concurrency cap that tells each taker when its slot was freed (so waiting is not counted as lag)."""

    def __init__(self, n: int):
        self.free: deque[float | None] = deque([None] * n)  # when each free slot was freed; None: at the start
        self.waiters: deque[asyncio.Future] = deque()

    async def acquire(self) -> float | None:
        """The perf_counter time at which the slot taken was freed (None: free from the start)."""
        if self.free and not self.waiters:
            return self.free.popleft()
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        return await waiter

    def release(self) -> None:
        now = time.perf_counter()
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(now)
                return
        self.free.append(now)


class Stop:
    """Ends a run early from outside the dispatch loop (a monitor task on the same event loop)."""

    def __init__(self):
        self.draining = asyncio.Event()  # send nothing more; the requests in flight may finish
        self.aborted = asyncio.Event()  # cancel the requests in flight too

    def drain(self) -> None:
        self.draining.set()

    def abort(self) -> None:
        self.draining.set()
        self.aborted.set()


@dataclass
class LoadRun:
    results: list[RequestResult]
    duration: float  # seconds from the run's start to the last request's end
    started_at: float  # wall-clock (time.time()) of the start
    cpu_seconds: float  # CPU time this process spent during the run: the generator's own cost


async def run_load(spec: LoadSpec, sample_at: Callable, on_done: Callable[[RequestResult], None] | None = None,
                   stop: Stop | None = None, on_send: Callable[[RequestResult], None] | None = None,
                   on_first: Callable[[RequestResult], None] | None = None, mine: Callable[[int], bool] | None = None,
                   start_at: float | None = None) -> LoadRun:
    """Send the schedule's requests (sample_at(i) gives request i's Sample) and wait for all of them.

    `on_send` sees each request as it is sent, `on_first` at its first token, `on_done` as it ends; `stop` ends
    the run early. A worker process passes `mine` (which indices of the schedule are its own; its
    spec.max_concurrency is its share of the cap) and `start_at`, the common start (time.perf_counter(): the
    system's monotonic clock, the same in every process of the host).
    """
    spec.check()
    root = spec.base_url.rstrip("/")
    cap = spec.max_concurrency
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    slots = Slots(cap) if cap else None
    results: list[RequestResult] = []
    tasks: list[asyncio.Task] = []
    # no session-wide timeout: each request has its own (send); limit 0 is aiohttp's "no limit"
    connector = aiohttp.TCPConnector(limit=cap or 0, keepalive_timeout=KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=None)
                                     ) as client:
        async def one(result: RequestResult, sample: Sample) -> None:
            try:
                endpoint = sample.endpoint or spec.endpoint
                body = request_body(endpoint, spec.model, sample, spec.ignore_eos, spec.temperature, spec.extra_body)
                await send(client, root + endpoint, body, result, start, sample.timeout or spec.request_timeout,
                           on_first, sample.leave_after)
            finally:
                if slots:
                    slots.release()
            if on_done:
                on_done(result)

        offsets = (iter(spec.schedule) if spec.schedule is not None else
                   arrival_offsets(spec.request_rate, spec.burstiness, spec.seed, spec.constant_rate))
        if start_at is not None and start_at > time.perf_counter():
            await asyncio.sleep(start_at - time.perf_counter())
        start = time.perf_counter() if start_at is None else start_at
        started_at, cpu_start = time.time() - (time.perf_counter() - start), time.process_time()
        deadline = start + spec.duration if spec.duration else math.inf
        counter = range(spec.num_requests) if spec.num_requests is not None else itertools.count()
        for i in counter:
            offset = next(offsets)  # kept as drawn: `due - start` would round differently for each start
            due = start + offset
            if due >= deadline:
                break
            if mine is not None and not mine(i):
                continue
            # measured as the result's times are (now - start), so that a request is never sent before its offset;
            # again if the loop woke it a hair early (asyncio's clock resolution)
            while (delay := offset - (time.perf_counter() - start)) > 0 and not (stop and stop.draining.is_set()):
                await _sleep(delay, stop)
            freed = (await _first(slots.acquire(), stop.draining) if stop else await slots.acquire()) if slots else None
            if stop and stop.draining.is_set():
                if slots and freed is not _STOPPED:
                    slots.release()
                break
            if time.perf_counter() >= deadline:
                if slots:
                    slots.release()
                break
            result = RequestResult(i, offset, offset if freed is None else max(offset, freed - start))
            results.append(result)
            tasks.append(asyncio.create_task(one(result, sample_at(i))))
            if on_send:
                on_send(result)
        if stop:
            await _finish_or_abort(tasks, stop)
        await asyncio.gather(*tasks, return_exceptions=stop is not None)
        for result, task in zip(results, tasks):
            if task.cancelled():  # aborted by `stop`: the request never finished
                result.error, result.message = "stopped", "cancelled when the run was stopped early"
                result.ended, result.e2e = time.perf_counter() - start, None
        cpu = time.process_time() - cpu_start
    return LoadRun(results, max((r.ended for r in results), default=0.0), started_at, cpu)


_STOPPED = object()


async def _first(awaitable, event: asyncio.Event):
    """Await something, or give up (returning _STOPPED, the awaitable cancelled) once the event is set."""
    task = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(event.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()  # a cancelled slot waiter is skipped by Slots.release, which only wakes futures not done
    return _STOPPED


async def _sleep(delay: float, stop: Stop | None) -> None:
    """Sleep, waking early when the run is stopped."""
    if stop is None:
        await asyncio.sleep(delay)
    else:
        await _first(asyncio.sleep(delay), stop.draining)


async def _finish_or_abort(tasks: list[asyncio.Task], stop: Stop) -> None:
    """Wait for the requests in flight, cancelling those left when the stop aborts."""
    pending = [t for t in tasks if not t.done()]
    if pending and await _first(asyncio.wait(pending), stop.aborted) is _STOPPED:
        for t in pending:
            t.cancel()
