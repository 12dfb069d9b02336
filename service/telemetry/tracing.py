"""OpenTelemetry traces: exporter set-up from the standard OTEL_* variables, `@traced`, and request spans.

Tracing is on when an OTLP endpoint is configured (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). Spans leave through a batch processor on its own thread, so a
collector that is down, slow or refusing costs dropped spans, never serving time.
"""

import functools
import inspect
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from opentelemetry import context, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service import __version__
from service.engine import RequestOutput, SamplingParams, StepStats
from service.engine.sequence import Timings

log = logging.getLogger(__name__)
_propagator = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("service")  # the global provider's; the server sets it when tracing is on


def traced(name: str | None = None, **attributes):
    """Run the function (sync, async, generator or async generator) in a span named `name`."""

    def decorate(fn):
        span_name = name or fn.__qualname__

        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def agen(*args, **kwargs):
                # the span is current only while the generator runs, never while its consumer does
                span = _tracer.start_span(span_name, attributes=attributes)
                ctx, gen = trace.set_span_in_context(span), fn(*args, **kwargs)
                try:
                    while True:
                        token = context.attach(ctx)
                        try:
                            item = await gen.__anext__()
                        except StopAsyncIteration:
                            return
                        finally:
                            context.detach(token)
                        yield item
                except Exception as exc:
                    _record_error(span, exc)
                    raise
                finally:
                    await gen.aclose()
                    span.end()
            return agen

        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def gen(*args, **kwargs):
                with _tracer.start_as_current_span(span_name, attributes=attributes):
                    yield from fn(*args, **kwargs)
            return gen

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def coro(*args, **kwargs):
                with _tracer.start_as_current_span(span_name, attributes=attributes):
                    return await fn(*args, **kwargs)
            return coro

        @functools.wraps(fn)
        def sync(*args, **kwargs):
            with _tracer.start_as_current_span(span_name, attributes=attributes):
                return fn(*args, **kwargs)
        return sync

    return decorate


def _record_error(span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def _env(name: str) -> str | None:
    return os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}")


def make_provider(sample_ratio: float, process: str = "api-0"):
    """A TracerProvider exporting over OTLP as the OTEL_* variables say, or None when no endpoint is set."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or not _env("ENDPOINT") \
            or os.environ.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    protocol = _env("PROTOCOL") or "http/protobuf"
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTLP protocol {protocol!r} is not supported: use grpc or http/protobuf")
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "llm-service"),
                                "service.version": __version__, "llm.process": process})
    # OTEL_TRACES_SAMPLER, when set, wins (the SDK reads it when no sampler is given)
    sampler = None if "OTEL_TRACES_SAMPLER" in os.environ else ParentBased(TraceIdRatioBased(sample_ratio))
    provider = TracerProvider(sampler=sampler, resource=resource, span_limits=SpanLimits(max_links=1024),
                              shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("tracing on: OTLP %s to %s, sample ratio %s", protocol, _env("ENDPOINT"),
             os.environ.get("OTEL_TRACES_SAMPLER_ARG", sample_ratio) if sampler is None else sample_ratio)
    return provider


def _wall_clock():
    """Turns time.perf_counter readings (the engine's clock) into the wall-clock nanoseconds spans carry."""
    offset = time.time_ns() - time.perf_counter_ns()
    return lambda t: int(t * 1e9) + offset


class Tracing:
    """One server's spans: a generation span per request, and engine-step spans linked to the requests."""

    RECENT = 16384  # span contexts kept after their request ends (its finishing step links to it after)

    def __init__(self, provider=None, trace_steps: bool = True, trace_text: bool = False):
        self.provider = provider
        self.tracer = provider.get_tracer("service", __version__) if provider else None
        self.trace_steps = trace_steps and provider is not None
        self.trace_text = trace_text
        self.contexts: OrderedDict[str, trace.SpanContext] = OrderedDict()  # request id -> its span's context
        self.engine_spans: dict = {}  # in the engine: request id -> its open engine.request span
        self._clocks: dict = {}  # span id -> the clock offset its start was stamped with

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def trace_id(self, request_id: str) -> str | None:
        """The trace id of a recent request's span, if it is sampled (its trace will exist)."""
        ctx = self.contexts.get(request_id)
        return trace.format_trace_id(ctx.trace_id) if ctx is not None and ctx.trace_flags.sampled else None

    def request_span(self, request_id: str, operation: str, model: str, params: SamplingParams,
                     prompt: str | list[int], arrival: float | None = None):
        """A request's span (a child of the current HTTP span), started at its `arrival` (time.perf_counter) when
        given, so that its front end is inside the span. Its context travels to the engine (`traceparent`)."""
        attributes = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "llm-service",
                      "gen_ai.request.model": model, "gen_ai.request.max_tokens": params.max_tokens or 0,
                      "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                      "gen_ai.response.id": request_id}
        if params.top_k:
            attributes["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        if params.stop:
            attributes["gen_ai.request.stop_sequences"] = params.stop
        if self.trace_text:
            attributes["gen_ai.prompt"] = prompt if isinstance(prompt, str) else json.dumps(prompt)
        at = _wall_clock()  # one offset for the whole span, so its events line up with its start
        span = self.tracer.start_span(f"{operation} {model}", kind=SpanKind.INTERNAL, attributes=attributes,
                                      start_time=None if arrival is None else at(arrival))
        self._remember(request_id, span.get_span_context())
        self._clocks[span.get_span_context().span_id] = at
        return span

    def _remember(self, request_id: str, ctx: trace.SpanContext) -> None:
        self.contexts[request_id] = ctx
        if len(self.contexts) > self.RECENT:
            self.contexts.popitem(last=False)

    @staticmethod
    def traceparent(span) -> str | None:
        carrier: dict[str, str] = {}
        _propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def fail(self, span, exc: BaseException) -> None:
        """A request refused before its stream began (a 503 from the engine, a dead engine)."""
        self._clocks.pop(span.get_span_context().span_id, None)
        _record_error(span, exc)
        span.end()

    async def generation(self, stream: AsyncIterator[RequestOutput], span, model: str, summary=None
                         ) -> AsyncIterator[RequestOutput]:
        """Wrap a request's output stream in its span (from request_span), ended with the request. A request of
        several samples passes `summary`, called at the end: (finish reasons, input, output and cached tokens) of
        them all, for the span's usage (the timings are those of its last output's sample)."""
        at = self._clocks.pop(span.get_span_context().span_id, None) or _wall_clock()
        last, text = None, []
        try:
            async for out in stream:
                last = out
                if self.trace_text:
                    text.append(out.text_delta)
                yield out
        except Exception as exc:
            _record_error(span, exc)
            raise
        finally:
            await stream.aclose()  # an early exit must reach the engine stream now: it aborts the request
            self._finish(span, model, last, "".join(text), at, summary)

    def engine_request(self, request_id: str, traceparent: str) -> None:
        """In the engine: a span for the request's time there, a child of its span in the front end."""
        parent = _propagator.extract({"traceparent": traceparent})
        span = self.tracer.start_span("engine.request", context=parent, attributes={"gen_ai.response.id": request_id})
        self.engine_spans[request_id] = span
        self._remember(request_id, span.get_span_context())

    def _finish(self, span, model: str, last: RequestOutput | None, text: str, at, summary=None) -> None:
        """Usage, finish reason and the request's life as events, at the times the engine recorded them."""
        if last is None:
            span.end()
            return
        reason = last.finish_reason or "abort"  # the client left before the request finished
        reasons, usage = [reason], (last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
        if summary is not None:
            reasons, *usage = summary()
        span.set_attributes({"gen_ai.response.model": model, "gen_ai.response.finish_reasons": reasons,
                             "gen_ai.usage.input_tokens": usage[0], "gen_ai.usage.output_tokens": usage[1],
                             "llm.usage.cached_tokens": usage[2]})
        if self.trace_text:
            span.set_attribute("gen_ai.completion", text)
        t: Timings = last.timings
        if t.submitted is not None:  # the server's front end, on its own: a slow one is told from a slow engine
            span.set_attribute("llm.request.frontend_seconds", t.submitted - t.arrival)
        # received: the server got the request; queued: validated and tokenized, it entered the engine's queue
        events = [("received", t.arrival), ("queued", t.submitted), ("scheduled", t.first_scheduled),
                  ("first_token", t.first_token), *(("preempted", p) for p in t.preempted)]
        for name, when in sorted((e for e in events if e[1] is not None), key=lambda e: e[1]):
            span.add_event(name, timestamp=at(when))
        finished = t.finished if t.finished is not None else time.perf_counter()
        span.add_event("finished", {"finish_reason": reason}, timestamp=at(finished))
        if reason == "error":
            span.set_status(Status(StatusCode.ERROR, "generation failed inside the engine"))
        span.end(end_time=at(finished))

    def step(self, step: StepStats) -> None:
        """An engine-step span (a trace of its own) for each step that changes the batch, linked to the
        requests it admitted, preempted or finished: every request links to the steps that shaped its life.

        Steady decode steps get no span: each link costs the SDK about 8 us, so linking all 256 requests of
        a batch to every step would cost more than the step's GPU time (their time is in the metrics).
        """
        if self.trace_steps and step.phase is not None:
            changed = [*step.admitted, *step.preempted, *step.finished_ids]
            if changed:
                end = time.time_ns()
                links = [Link(ctx) for rid in changed if (ctx := self.contexts.get(rid))]
                self.tracer.start_span("engine.step", start_time=end - int(step.duration * 1e9), links=links,
                                       attributes={
                    "llm.step.phase": step.phase, "llm.step.tokens": step.num_tokens,
                    "llm.step.sequences": step.num_seqs, "llm.step.admitted": len(step.admitted),
                    "llm.step.preempted": len(step.preempted), "llm.step.finished": len(step.finished_ids),
                }).end(end_time=end)
        spans = self.engine_spans
        if spans:
            for rid in step.admitted:
                if (span := spans.get(rid)) is not None:
                    span.add_event("scheduled")
            for rid in step.preempted:
                if (span := spans.get(rid)) is not None:
                    span.add_event("preempted")
            for rid in step.finished_ids:
                if (span := spans.pop(rid, None)) is not None:
                    span.end()

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
