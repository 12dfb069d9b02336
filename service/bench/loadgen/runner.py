"""The load loop: one asyncio loop sends requests on a precomputed schedule, under an optional concurrency cap.

Open loop (a request rate), closed loop (a concurrency cap with every request due at once), or both. The run
is bounded by a request count, a duration (no request is sent after it), and a timeout per request.
Each request's dispatch lag (sent minus the earliest moment it could have been sent) measures the generator.
"""

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from service.bench.loadgen.arrivals import arrival_offsets
from service.bench.loadgen.client import RequestResult, request_body, send


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

    def check(self) -> None:
        if self.num_requests is None and self.duration is None:
            raise ValueError("bound the run: give a request count, a duration, or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("the request count must be >= 1")
        if self.duration is not None and not self.duration > 0:
            raise ValueError("the duration must be > 0 seconds")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("the maximum concurrency must be >= 1")
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


@dataclass
class LoadRun:
    results: list[RequestResult]
    duration: float  # seconds from the run's start to the last request's end
    started_at: float  # wall-clock (time.time()) of the start
    cpu_seconds: float  # CPU time this process spent during the run: the generator's own cost


async def run_load(spec: LoadSpec, sample_at: Callable, on_done: Callable[[RequestResult], None] | None = None
                   ) -> LoadRun:
    """Send the schedule's requests (sample_at(i) gives request i's Sample) and wait for all of them."""
    spec.check()
    url = spec.base_url.rstrip("/") + spec.endpoint
    cap = spec.max_concurrency
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    slots = Slots(cap) if cap else None
    results: list[RequestResult] = []
    tasks: list[asyncio.Task] = []

    async with httpx.AsyncClient(limits=limits, headers=headers, timeout=httpx.Timeout(spec.request_timeout)) as client:
        async def one(result: RequestResult, body: dict) -> None:
            try:
                await send(client, url, body, result, start, spec.request_timeout)
            finally:
                if slots:
                    slots.release()
            if on_done:
                on_done(result)

        offsets = arrival_offsets(spec.request_rate, spec.burstiness, spec.seed, spec.constant_rate)
        started_at, cpu_start, start = time.time(), time.process_time(), time.perf_counter()
        deadline = start + spec.duration if spec.duration else math.inf
        counter = range(spec.num_requests) if spec.num_requests is not None else itertools.count()
        for i in counter:
            due = start + next(offsets)
            if due >= deadline:
                break
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            freed = await slots.acquire() if slots else None
            if time.perf_counter() >= deadline:
                if slots:
                    slots.release()
                break
            body = request_body(spec.endpoint, spec.model, sample_at(i), spec.ignore_eos, spec.temperature,
                                spec.extra_body)
            ready = due if freed is None else max(due, freed)
            result = RequestResult(i, due - start, ready - start)
            results.append(result)
            tasks.append(asyncio.create_task(one(result, body)))
        await asyncio.gather(*tasks)
        cpu = time.process_time() - cpu_start
    return LoadRun(results, max((r.ended for r in results), default=0.0), started_at, cpu)
