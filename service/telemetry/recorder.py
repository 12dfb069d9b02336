"""Turns what happens to requests and engine steps into the catalog's metrics, each where it is measured.

`RequestRecorder` runs in a front end, on its event loop, as each step's message arrives: TTFT, token gaps,
end-to-end time and token counts are measured where the client's clock is. `EngineRecorder` runs in the engine
process after each step: step time, batch size, queue and KV state, preemptions and failures. The token gaps of
one step's message take few distinct values (its tokens share one clock reading), so they are added to the
histogram grouped by value rather than one observation per token.

With --otlp-metrics the same calls feed the OTLP instruments (metrics.OTLPMetrics) with the same values, so that
a request is recorded once, at one point, for both. Times that feed both are put on a grid of 2^-20 s (about a
microsecond) first: sums of such values are exact in any order, so the Prometheus sums (added per observation,
then across processes) and the OTLP ones (added per export interval) agree to the last bit.
"""

import threading
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable

from service.engine.results import StepStats
from service.telemetry.dashboard import Slowest
from service.telemetry.metrics import PROVIDER, Metrics, OTLPMetrics

GRID = 2.0 ** 20  # ticks per second


def on_grid(seconds: float) -> float:
    return round(seconds * GRID) / GRID


def observe_many(histogram, value: float, count: int) -> None:
    """`histogram.observe(value)` repeated `count` times, as one update (prometheus_client has no bulk form)."""
    histogram._sum.inc(value * count)
    histogram._buckets[bisect_left(histogram._upper_bounds, value)].inc(count)


class RequestRecorder:
    """Per request (each sample of an n > 1 request is one): TTFT, queue, front-end and prefill time and prompt tokens
    (once per prompt) at its first token; every gap
    between output tokens; end-to-end and decode time and the finish reason when it ends (and with OTLP, the
    GenAI time per output token of a successful response)."""

    def __init__(self, metrics: Metrics, trace_id: Callable[[str], str | None] = lambda request_id: None,
                 otlp: OTLPMetrics | None = None):
        self.m = metrics
        self.trace_id = trace_id  # request id -> trace id of its sampled span, for exemplars
        self.otlp = otlp
        self._attributes: dict[str, dict] = {}  # operation -> the GenAI attributes of its requests
        model = {"gen_ai.request.model": metrics.model}
        self._input, self._output = ({"gen_ai.token.type": kind, **model} for kind in ("input", "output"))
        self._slowest, self._lock = Slowest(), threading.Lock()  # the dashboard's table; read on another thread

    @staticmethod
    def _exemplar(trace_id: str | None) -> dict[str, str] | None:
        return {"trace_id": trace_id} if trace_id else None

    def _genai(self, operation: str) -> dict:
        if operation not in self._attributes:
            self._attributes[operation] = {"gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER,
                                           "gen_ai.request.model": self.m.model}
        return self._attributes[operation]

    def first_token(self, stream) -> None:
        m, t = self.m, stream.timings
        ttft = on_grid(t.first_token - t.arrival)
        m.ttft_m.observe(ttft, self._exemplar(self.trace_id(stream.request_id)))
        if t.first_scheduled is not None:
            m.queue_m.observe(t.first_scheduled - t.arrival)
            m.prefill_m.observe(t.first_token - t.first_scheduled)
        m.frontend_m.observe(t.submitted - t.arrival)
        if self.otlp is not None:
            self.otlp.ttft.record(ttft, self._genai(stream.operation))
        self._prompt(stream)

    def _prompt(self, stream) -> None:
        """Count the prompt's tokens, once per prompt (not again for its other samples), as usage does."""
        if stream.counts_prompt:
            self.m.prompt_tokens_m.inc(len(stream.prompt_ids))
            if self.otlp is not None:
                self.otlp.tokens.add(len(stream.prompt_ids), self._input)

    def received(self, count: int) -> None:
        """Requests (samples) the engine admitted."""
        self.m.received_m.inc(count)

    def slowest(self) -> list[dict]:
        """The slowest requests of the last 15 minutes, end to end (the dashboard's table)."""
        with self._lock:
            return self._slowest.top(time.time())

    def tokens(self, count: int) -> None:
        self.m.generation_tokens_m.inc(count)
        if self.otlp is not None:
            self.otlp.tokens.add(count, self._output)

    def gaps(self, gaps: Counter) -> None:
        for gap, count in gaps.items():
            observe_many(self.m.itl_m, gap, count)

    def finished(self, stream, reason: str) -> None:
        m, t = self.m, stream.timings
        m.finish_m[reason].inc()
        if t.first_token is None and reason in ("stop", "length"):  # the prompt only (max_tokens 0): no first token
            self._prompt(stream)
        duration = on_grid(t.finished - t.arrival)
        trace_id = self.trace_id(stream.request_id)
        m.duration_m.observe(duration, self._exemplar(trace_id))
        if t.first_token is not None:
            m.decode_m.observe(t.finished - t.first_token)
        if self.otlp is not None:
            self._finished_genai(stream, reason, duration)
        entry = {"request_id": stream.request_id, "finished": time.time(), "finish_reason": reason,
                 "prompt_tokens": len(stream.prompt_ids), "output_tokens": len(stream.token_ids),
                 "queue": None if t.first_scheduled is None else t.first_scheduled - t.arrival,
                 "ttft": None if t.first_token is None else t.first_token - t.arrival, "e2e": duration,
                 "trace_id": trace_id}
        with self._lock:
            self._slowest.add(entry)

    def _finished_genai(self, stream, reason: str, duration: float) -> None:
        """Duration of every request (error.type on a failed one); time per output token of a successful one: its
        decode time over its tokens after the first."""
        genai, t = self._genai(stream.operation), stream.timings
        attributes = {**genai, "gen_ai.response.finish_reasons": (reason,)}
        if reason == "error":
            attributes["error.type"] = type(stream.error).__name__ if stream.error is not None else "_OTHER"
        self.otlp.duration.record(duration, attributes)
        later = len(stream.token_ids) - 1
        if reason in ("stop", "length") and later > 0:
            self.otlp.tpot.record((t.finished - t.first_token) / later, genai)


class EngineRecorder:
    """A StepObserver in the engine: step time and tokens by phase, load and KV state after each step."""

    def __init__(self, metrics: Metrics, otlp: OTLPMetrics | None = None):
        self.m = metrics
        self.otlp = otlp
        self.rank_seconds: list[float] = []  # each tensor-parallel rank's forward time, as last counted
        self.state = (0, 0, 0.0)  # running, waiting, KV usage after the last step (OTLP reads it at each export)
        self._phases = {phase: {"llm.step.phase": phase, "gen_ai.request.model": metrics.model}
                        for phase in metrics.step_m}

    def __call__(self, step: StepStats) -> None:
        m = self.m
        if step.phase is not None:
            seconds, tokens, host = m.step_m[step.phase]
            duration = on_grid(step.duration)
            seconds.observe(duration)
            tokens.observe(step.num_tokens)
            host.observe(max(0.0, step.duration - step.device_wait))
            if self.otlp is not None:
                self.otlp.step.record(duration, self._phases[step.phase])
            if step.prompt_tokens_computed:
                m.prompt_computed_m.inc(step.prompt_tokens_computed)
            if step.prompt_tokens_cached:
                m.prompt_cached_m.inc(step.prompt_tokens_cached)
        for wait in step.grammar_waits:
            m.grammar_compile_m.observe(wait)
        if step.grammar_hits:
            m.grammar_hits_m.inc(step.grammar_hits)
        if step.mask_seconds:
            m.grammar_mask_m.observe(step.mask_seconds)
        if step.error is not None:
            m.step_failures.labels(m.model, step.error).inc()
        if step.preempted:
            m.preemptions_m.inc(len(step.preempted))
        m.running_m.set(step.num_running)
        m.waiting_m.set(step.num_waiting)
        m.kv_usage_m.set(step.kv_usage)
        m.kv_blocks_used_m.set(step.kv_blocks_used)
        self.state = (step.num_running, step.num_waiting, step.kv_usage)
        if step.rank_seconds and step.rank_seconds != self.rank_seconds:
            self._count_rank_seconds(step.rank_seconds)

    def _count_rank_seconds(self, seconds: list[float]) -> None:
        previous = self.rank_seconds or [0.0] * len(seconds)
        for rank, (now, before) in enumerate(zip(seconds, previous)):
            if now > before:
                self.m.rank_forward_seconds.labels(self.m.model, str(rank)).inc(now - before)
        self.rank_seconds = list(seconds)
