"""Turns engine steps into the catalog's metrics, on the engine's thread, between steps.

The engine waits for this, so a step costs one counting pass over its outputs and a few metric
updates: the token gaps of one step take few distinct values (all tokens of a step share one clock
reading), so they are added to the histogram grouped by value rather than one observation per token;
first tokens and finished requests come to it in lists of their own.
"""

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable

from service.engine import RequestOutput, StepStats
from service.telemetry.metrics import Metrics


def observe_many(histogram, value: float, count: int) -> None:
    """`histogram.observe(value)` repeated `count` times, as one update (prometheus_client has no bulk form)."""
    histogram._sum.inc(value * count)
    histogram._buckets[bisect_left(histogram._upper_bounds, value)].inc(count)


class EngineRecorder:
    """A StepObserver: request latencies and token counts from a step's outputs, step time and load.

    Per request: TTFT, queue, front-end and prefill time and prompt tokens at its first token; every gap between
    output tokens; end-to-end and decode time and the finish reason when it finishes.
    """

    def __init__(self, metrics: Metrics, trace_id: Callable[[str], str | None] = lambda request_id: None):
        self.m = metrics
        self.trace_id = trace_id  # request id -> trace id of its sampled span, for exemplars
        self.rank_seconds: list[float] = []  # each tensor-parallel rank's forward time, as last counted

    def __call__(self, step: StepStats) -> None:
        m = self.m
        if step.phase is not None:
            seconds, tokens = m.step_m[step.phase]
            seconds.observe(step.duration)
            tokens.observe(step.num_tokens)
            if step.outputs:  # every output of a step that ran carries one new token
                m.generation_tokens_m.inc(len(step.outputs))
                gaps = Counter([t[-1] - t[-2] for t in [out.timings.token_times for out in step.outputs]
                                if len(t) > 1])
                for gap, count in gaps.items():
                    observe_many(m.itl_m, gap, count)
        if step.preempted:
            m.preemptions_m.inc(len(step.preempted))
        for out in step.first_tokens:
            self._first_token(out)
        for out in step.finished:
            self._finished(out)
        m.running_m.set(step.num_running)
        m.waiting_m.set(step.num_waiting)
        m.kv_usage_m.set(step.kv_usage)
        if step.rank_seconds and step.rank_seconds != self.rank_seconds:
            self._count_rank_seconds(step.rank_seconds)

    def _count_rank_seconds(self, seconds: list[float]) -> None:
        previous = self.rank_seconds or [0.0] * len(seconds)
        for rank, (now, before) in enumerate(zip(seconds, previous)):
            if now > before:
                self.m.rank_forward_seconds.labels(self.m.model, str(rank)).inc(now - before)
        self.rank_seconds = list(seconds)

    def _exemplar(self, request_id: str) -> dict[str, str] | None:
        trace_id = self.trace_id(request_id)
        return {"trace_id": trace_id} if trace_id else None

    def _first_token(self, out: RequestOutput) -> None:
        m, t = self.m, out.timings
        m.ttft_m.observe(t.first_token - t.arrival, self._exemplar(out.request_id))
        m.queue_m.observe(t.first_scheduled - t.arrival)
        m.frontend_m.observe(t.submitted - t.arrival)
        m.prefill_m.observe(t.first_token - t.first_scheduled)
        m.prompt_tokens_m.inc(out.num_prompt_tokens)

    def _finished(self, out: RequestOutput) -> None:
        m, t = self.m, out.timings
        m.finish_m[out.finish_reason].inc()
        m.duration_m.observe(t.finished - t.arrival, self._exemplar(out.request_id))
        if t.first_token is not None:
            m.decode_m.observe(t.finished - t.first_token)
