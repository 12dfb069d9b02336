"""Turns what happens to requests and engine steps into the catalog's metrics, each where it is measured.

`RequestRecorder` runs in a front end, on its event loop, as each step's message arrives: TTFT, token gaps,
end-to-end time and token counts are measured where the client's clock is. `EngineRecorder` runs in the engine
process after each step: step time, batch size, queue and KV state, preemptions and failures. The token gaps of
one step's message take few distinct values (its tokens share one clock reading), so they are added to the
histogram grouped by value rather than one observation per token.
"""

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable

from service.engine.results import StepStats
from service.telemetry.metrics import Metrics


def observe_many(histogram, value: float, count: int) -> None:
    """`histogram.observe(value)` repeated `count` times, as one update (prometheus_client has no bulk form)."""
    histogram._sum.inc(value * count)
    histogram._buckets[bisect_left(histogram._upper_bounds, value)].inc(count)


class RequestRecorder:
    """Per request: TTFT, queue, front-end and prefill time and prompt tokens at its first token; every gap
    between output tokens; end-to-end and decode time and the finish reason when it ends."""

    def __init__(self, metrics: Metrics, trace_id: Callable[[str], str | None] = lambda request_id: None):
        self.m = metrics
        self.trace_id = trace_id  # request id -> trace id of its sampled span, for exemplars

    def _exemplar(self, request_id: str) -> dict[str, str] | None:
        trace_id = self.trace_id(request_id)
        return {"trace_id": trace_id} if trace_id else None

    def first_token(self, stream) -> None:
        m, t = self.m, stream.timings
        m.ttft_m.observe(t.first_token - t.arrival, self._exemplar(stream.request_id))
        if t.first_scheduled is not None:
            m.queue_m.observe(t.first_scheduled - t.arrival)
            m.prefill_m.observe(t.first_token - t.first_scheduled)
        m.frontend_m.observe(t.submitted - t.arrival)
        m.prompt_tokens_m.inc(len(stream.prompt_ids))

    def tokens(self, count: int) -> None:
        self.m.generation_tokens_m.inc(count)

    def gaps(self, gaps: Counter) -> None:
        for gap, count in gaps.items():
            observe_many(self.m.itl_m, gap, count)

    def finished(self, stream, reason: str) -> None:
        m, t = self.m, stream.timings
        m.finish_m[reason].inc()
        m.duration_m.observe(t.finished - t.arrival, self._exemplar(stream.request_id))
        if t.first_token is not None:
            m.decode_m.observe(t.finished - t.first_token)


class EngineRecorder:
    """A StepObserver in the engine: step time and tokens by phase, load and KV state after each step."""

    def __init__(self, metrics: Metrics):
        self.m = metrics
        self.rank_seconds: list[float] = []  # each tensor-parallel rank's forward time, as last counted

    def __call__(self, step: StepStats) -> None:
        m = self.m
        if step.phase is not None:
            seconds, tokens = m.step_m[step.phase]
            seconds.observe(step.duration)
            tokens.observe(step.num_tokens)
        if step.error is not None:
            m.step_failures.labels(m.model, step.error).inc()
        if step.preempted:
            m.preemptions_m.inc(len(step.preempted))
        m.running_m.set(step.num_running)
        m.waiting_m.set(step.num_waiting)
        m.kv_usage_m.set(step.kv_usage)
        m.kv_blocks_used_m.set(step.kv_blocks_used)
        if step.rank_seconds and step.rank_seconds != self.rank_seconds:
            self._count_rank_seconds(step.rank_seconds)

    def _count_rank_seconds(self, seconds: list[float]) -> None:
        previous = self.rank_seconds or [0.0] * len(seconds)
        for rank, (now, before) in enumerate(zip(seconds, previous)):
            if now > before:
                self.m.rank_forward_seconds.labels(self.m.model, str(rank)).inc(now - before)
        self.rank_seconds = list(seconds)
