"""Turns engine steps and their request outputs into the catalog's metrics.

The cost per step is one pass over its outputs and a few metric updates: the token gaps of one step
take few distinct values (every token of a step shares one clock reading), so they are added to the
histogram grouped by value instead of one observation per token. It may run after the engine has
moved on (see hub.BackgroundObserver), so it reads only what later steps cannot change: the output's
own fields, and token times by index (the list only grows).
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
    """A StepObserver: request latencies and token counts from outputs, step time and load from the step.

    Per request: TTFT, queue and prefill time and prompt tokens at its first token; every gap between
    output tokens; end-to-end and decode time and the finish reason when it finishes.
    """

    def __init__(self, metrics: Metrics, trace_id: Callable[[str], str | None] = lambda request_id: None):
        self.m = metrics
        self.trace_id = trace_id  # request id -> trace id of its sampled span, for exemplars

    def __call__(self, step: StepStats, outputs: list[RequestOutput]) -> None:
        m = self.m
        if step.phase is not None:
            seconds, tokens = m.step_m[step.phase]
            seconds.observe(step.duration)
            tokens.observe(step.num_tokens)
        if step.num_preempted:
            m.preemptions_m.inc(step.num_preempted)
        m.running_m.set(step.num_running)
        m.waiting_m.set(step.num_waiting)
        m.kv_usage_m.set(step.kv_usage)

        produced = [out for out in outputs if out.new_token_ids]
        if produced:
            m.generation_tokens_m.inc(sum(len(out.new_token_ids) for out in produced))
        # the gap between each output's newest token and the one before it
        ends = [(out.timings.token_times, out.num_output_tokens) for out in produced]
        gaps = Counter([times[n - 1] - times[n - 2] for times, n in ends if n > 1])
        for gap, count in gaps.items():
            observe_many(m.itl_m, gap, count)
        for out in produced:
            if out.num_output_tokens == len(out.new_token_ids):
                self._first_token(out)
        for out in outputs:
            if out.finished:
                self._finished(out)

    def _exemplar(self, request_id: str) -> dict[str, str] | None:
        trace_id = self.trace_id(request_id)
        return {"trace_id": trace_id} if trace_id else None

    def _first_token(self, out: RequestOutput) -> None:
        m, t = self.m, out.timings
        m.ttft_m.observe(t.first_token - t.arrival, self._exemplar(out.request_id))
        m.queue_m.observe(t.first_scheduled - t.arrival)
        m.prefill_m.observe(t.first_token - t.first_scheduled)
        m.prompt_tokens_m.inc(out.num_prompt_tokens)

    def _finished(self, out: RequestOutput) -> None:
        m, t = self.m, out.timings
        m.finish_m[out.finish_reason].inc()
        m.duration_m.observe(t.finished - t.arrival, self._exemplar(out.request_id))
        if t.first_token is not None:
            m.decode_m.observe(t.finished - t.first_token)
