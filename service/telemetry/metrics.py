"""Every metric the service exports: names, types, labels, buckets and help text, in one place.

Dashboards and alerts in deploy/ query these names; change them only together with those files.
Each process of a server (the engine, each front end) owns a `Metrics`: `registry` holds the series that are
summed across processes at /metrics (each is set by the one process that measures it, the others leave it at
zero), `local` the per-process ones (process_*, threads, tasks, event-loop lag, IPC backlog), which /metrics
shows with a `process` label (service.telemetry.gather). With --otlp-metrics each process also pushes the
instruments of `OTLPMetrics` (service.telemetry.otlp), fed by the same recorders at the same points.
"""

import math
from collections.abc import Callable

from opentelemetry.metrics import Meter, Observation
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

from service import processes

disable_created_metrics()  # `*_created` series add nothing the dashboards use

# Latency buckets fit LLM serving: first tokens from a few ms to a minute, token gaps from 1 ms to seconds.
# 0.5 s is a boundary on purpose: the default TTFT SLO in deploy/ counts requests under it.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 20.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
                    180.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# The front end (body, validation, chat template, tokenization) takes well under a millisecond to seconds.
FRONTEND_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0)
BATCH_TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384

FINISH_REASONS = ("stop", "length", "abort", "error")
CONSTRAINTS = ("json_object", "json_schema", "tools")  # what constrains a request's output (response_format, tools)
# compiling a grammar against the vocabulary: about a millisecond cached, tens of ms for a large schema, the limit 10 s
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
MASK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
PHASES = ("prefill", "decode", "mixed")


class Metrics:
    """The metric catalog of one server, every request metric bound to its `model` label."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None):
        self.model = model
        self.registry = r = registry or CollectorRegistry()
        self.local = local = CollectorRegistry()
        ProcessCollector(registry=local)
        PlatformCollector(registry=local)
        GCCollector(registry=local)
        m = ["model"]

        def histogram(name, doc, buckets, labels=m):
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        self.ttft = histogram("llm_time_to_first_token_seconds",
                              "Time from a request's arrival at the server to its first output token.", TTFT_BUCKETS)
        self.itl = histogram("llm_time_per_output_token_seconds",
                             "Gap between consecutive output tokens of a request (inter-token latency); 0 between "
                             "tokens that arrive together (--decode-steps).", ITL_BUCKETS)
        self.duration = histogram("llm_request_duration_seconds",
                                  "Time from a request's arrival to its last token (end to end).", DURATION_BUCKETS)
        self.queue = histogram("llm_request_queue_seconds",
                               "Time from a request's arrival to its first scheduling.", QUEUE_BUCKETS)
        self.frontend = histogram("llm_request_frontend_seconds",
                                  "Time from a request's arrival to its hand-over to the engine: body, validation, "
                                  "chat template and tokenization (part of its queue time and TTFT).",
                                  FRONTEND_BUCKETS)
        self.prefill = histogram("llm_request_prefill_seconds",
                                 "Time from a request's first scheduling to its first output token.", TTFT_BUCKETS)
        self.decode = histogram("llm_request_decode_seconds",
                                "Time from a request's first output token to its last.", DURATION_BUCKETS)
        self.prompt_tokens = Counter("llm_prompt_tokens", "Prompt tokens of requests that reached their first "
                                     "output (once per prompt, as usage counts them: the samples of an n > 1 "
                                     "request share theirs).", m, registry=r)
        self.prompt_computed = Counter("llm_prompt_tokens_computed", "Prompt tokens the engine computed, counted "
                                       "when each request is admitted (again after a preemption).", m, registry=r)
        self.prompt_cached = Counter("llm_prompt_tokens_cached", "Prompt tokens served from the prefix cache instead "
                                     "of computed, counted when each request is admitted (samples of an n > 1 "
                                     "request share their prompt this way).", m, registry=r)
        self.generation_tokens = Counter("llm_generation_tokens", "Output tokens generated (output throughput is "
                                         "its rate).", m, registry=r)
        self.received = Counter("llm_requests_received", "Requests the engine admitted: arrivals (each sample of an "
                                "n > 1 request is one, as in llm_requests).", m, registry=r)
        self.requests = Counter("llm_requests", "Finished requests, by why they finished: stop (stop token or "
                                "string), length (max_tokens or context), abort (client gone), error.",
                                ["model", "finish_reason"], registry=r)
        self.http_requests = Counter("llm_http_requests", "HTTP requests answered, by route template and status "
                                     "code (rejections included).", ["model", "route", "status"], registry=r)
        self.running = Gauge("llm_requests_running", "Requests being generated (in the running batch).", m,
                             registry=r)
        self.waiting = Gauge("llm_requests_waiting", "Requests waiting to be scheduled (preempted ones included).",
                             m, registry=r)
        self.kv_usage = Gauge("llm_kv_cache_usage_ratio", "Share of KV cache blocks in use by requests.", m,
                              registry=r)
        self.preemptions = Counter("llm_preemptions", "Requests preempted (blocks freed, recomputed later) because "
                                   "the KV cache was full.", m, registry=r)
        self.rank_forward_seconds = Counter(
            "llm_tensor_parallel_forward_seconds", "Time each tensor-parallel rank spent in forward passes (gathered "
            "every 16 passes); a rank whose rate stands out is the one the others wait for.", ["model", "rank"],
            registry=r)
        self.step_seconds = histogram("llm_engine_step_seconds", "Duration of one engine step (one forward pass and "
                                      "sampling), by phase.", STEP_BUCKETS, ["model", "phase"])
        self.step_host_seconds = histogram("llm_engine_step_host_seconds", "Host time of one engine step: its "
                                           "duration less the engine thread's wait for the device's results (on "
                                           "a CPU, where the model runs on the host, the whole step), by phase.",
                                           STEP_BUCKETS, ["model", "phase"])
        self.batch_tokens = histogram("llm_batch_tokens", "Tokens computed in one engine step, by phase.",
                                      BATCH_TOKEN_BUCKETS, ["model", "phase"])
        self.model_info = Gauge("llm_model_info", "The served model and how it runs (always 1, set once the model "
                                "is loaded): dtype, weight quantization, KV cache dtype, block size and block count.",
                                ["model", "dtype", "quantization", "kv_cache_dtype", "kv_block_size", "kv_blocks"],
                                registry=r)

        self.structured_requests = Counter("llm_structured_requests", "Requests whose output a grammar constrains, "
                                           "by what asked for it: response_format json_object or json_schema, or "
                                           "tools (tool_choice required or a named function; auto parses what the "
                                           "model writes and counts here too).", ["model", "constraint"], registry=r)
        self.tool_calls = Counter("llm_tool_calls", "Tool calls returned to clients (message.tool_calls entries).", m,
                                  registry=r)
        self.grammar_compile_seconds = histogram("llm_grammar_compile_seconds", "Time from a constrained request's "
                                                 "arrival at the engine to its grammar being ready (compiled, or "
                                                 "found in the cache: see cache_hits).", COMPILE_BUCKETS)
        self.grammar_cache_hits = Counter("llm_grammar_cache_hits", "Constrained requests whose grammar was compiled "
                                          "already (same response_format or tools).", m, registry=r)
        self.grammar_mask_seconds = histogram("llm_grammar_mask_seconds", "Host time a step with constrained rows "
                                              "spends advancing their grammars and filling their token masks, in a "
                                              "thread beside the device (steps without constrained rows record "
                                              "nothing).", MASK_BUCKETS)
        self.step_failures = Counter("llm_engine_step_failures", "Engine steps that raised (out of memory, NaN "
                                     "logits, any exception), by the exception's type; the requests of such a step "
                                     "finish with finish_reason error and the engine serves on.", ["model", "error"],
                                     registry=r)
        # the soak watches it for leaks
        self.kv_blocks_used = Gauge("llm_kv_cache_blocks_used", "KV cache blocks held by requests (blocks kept "
                                    "only for prefix caching count as free).", m, registry=r)
        # per process (label `process` at /metrics: engine, api-0 ...)
        self.threads = Gauge("llm_process_threads", "Threads alive in the process.", registry=local)
        self.asyncio_tasks = Gauge("llm_asyncio_tasks", "asyncio tasks alive on the process's event loop (front "
                                   "ends).", registry=local)
        self.loop_lag = Gauge("llm_event_loop_lag_seconds", "How late the front end's event loop ran a timer "
                              "due 0.5 s earlier, at its last check: the time requests on it wait for the loop "
                              "(HTTP, JSON, text and token handling all run on it).", registry=local)
        self.connections = Gauge("llm_http_connections", "HTTP connections open on the front end (each stays with "
                                 "the front end that accepted it): their spread over the front ends is the "
                                 "spread of the load.", registry=local)
        self.gc_pause = Histogram("llm_gc_pause_seconds", "How long each of Python's cyclic garbage collections "
                                  "stopped the process, by generation (2: a full collection). Each process freezes "
                                  "what it loaded at start (gc.freeze), so full collections stay short.",
                                  ["generation"], registry=local, buckets=GC_BUCKETS)
        self.gc_frozen = Gauge("llm_gc_frozen_objects", "Objects the process froze out of the garbage collector's "
                               "reach once it had loaded (gc.freeze; 0 until then), read at scrape time.",
                               registry=local)
        self.gc_frozen.set_function(lambda: processes.frozen)
        self.ipc_backlog = Gauge("llm_ipc_backlog", "Requests a front end has sent to the engine process and not "
                                 "yet heard back about (admitted or refused).", registry=local)
        self.otlp_export_failures = Counter("llm_otlp_metric_export_failures", "OTLP metric exports "
                                            "(--otlp-metrics) that failed: the collector down, refusing, or slower "
                                            "than the export timeout. Serving never waits on an export.",
                                            registry=local)
        self.otlp_points_dropped = Counter("llm_otlp_metric_points_dropped", "Data points of the failed OTLP "
                                           "metric exports. With cumulative temporality the next export that "
                                           "succeeds carries their totals again; with delta they are lost.",
                                           registry=local)

        # children bound to this server's model, so the hot path does no label lookups
        self.ttft_m, self.itl_m, self.duration_m = self.ttft.labels(model), self.itl.labels(model), \
            self.duration.labels(model)
        self.queue_m, self.prefill_m, self.decode_m = self.queue.labels(model), self.prefill.labels(model), \
            self.decode.labels(model)
        self.frontend_m = self.frontend.labels(model)
        self.kv_blocks_used_m = self.kv_blocks_used.labels(model)
        self.prompt_tokens_m = self.prompt_tokens.labels(model)
        self.prompt_computed_m, self.prompt_cached_m = self.prompt_computed.labels(model), \
            self.prompt_cached.labels(model)
        self.generation_tokens_m = self.generation_tokens.labels(model)
        self.grammar_compile_m, self.grammar_hits_m, self.grammar_mask_m = self.grammar_compile_seconds.labels(
            model), self.grammar_cache_hits.labels(model), self.grammar_mask_seconds.labels(model)
        self.tool_calls_m = self.tool_calls.labels(model)
        for constraint in CONSTRAINTS:  # every series exists from the start (at zero): queries of it find data
            self.structured_requests.labels(model, constraint)
        self.preemptions_m = self.preemptions.labels(model)
        self.received_m = self.received.labels(model)
        self.gc_pause_m = [self.gc_pause.labels(str(generation)) for generation in range(3)]
        self.running_m, self.waiting_m, self.kv_usage_m = self.running.labels(model), self.waiting.labels(model), \
            self.kv_usage.labels(model)
        self.finish_m = {reason: self.requests.labels(model, reason) for reason in FINISH_REASONS}
        self.step_m = {phase: (self.step_seconds.labels(model, phase), self.batch_tokens.labels(model, phase),
                               self.step_host_seconds.labels(model, phase)) for phase in PHASES}
        for gauge in (self.running_m, self.waiting_m, self.kv_usage_m, self.kv_blocks_used_m):
            gauge.set(0)


class GPUMetrics:
    """NVML readings per GPU (label `gpu`: the device index); registered only where NVML answers."""

    def __init__(self, registry: CollectorRegistry):
        g = ["gpu"]
        self.utilization = Gauge("llm_gpu_utilization_ratio", "Share of the last sample period in which a kernel ran "
                                 "on the GPU (NVML utilization.gpu / 100).", g, registry=registry)
        self.memory_used = Gauge("llm_gpu_memory_used_bytes", "GPU memory in use, all processes.", g,
                                 registry=registry)
        self.memory_total = Gauge("llm_gpu_memory_total_bytes", "GPU memory in all.", g, registry=registry)
        self.power = Gauge("llm_gpu_power_watts", "GPU power draw.", g, registry=registry)
        self.temperature = Gauge("llm_gpu_temperature_celsius", "GPU core temperature.", g, registry=registry)
        self.sm_clock = Gauge("llm_gpu_sm_clock_hertz", "Current SM clock.", g, registry=registry)


# -- pushed over OTLP (--otlp-metrics) ------------------------------------------------------------------------
# The GenAI model-server instruments as the OpenTelemetry semantic conventions v1.41.0 define them (names, units,
# attributes, and the bucket boundaries they advise); token counts and the engine's state under this project's
# `llm.*` names, GPU readings under the conventions' `hw.*` names. docs/telemetry.md maps each to its `llm_*` twin.
SEMCONV_VERSION = "1.41.0"
GENAI_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
GENAI_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GENAI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
PROVIDER = "llm-service"  # gen_ai.provider.name, as in the request spans


class OTLPMetrics:
    """The instruments one process pushes. The front ends' RequestRecorder records the request instruments and the
    engine's EngineRecorder the step time, each beside its Prometheus twin; the engine's state and the GPU readings
    are read at each export (`observe_engine`, `observe_gpus`)."""

    def __init__(self, meter: Meter, model: str):
        self.meter, self.model = meter, model
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", "s", "Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=GENAI_TTFT_BUCKETS)
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", "s", "Time per output token generated after the first token for "
            "successful responses.", explicit_bucket_boundaries_advisory=GENAI_TPOT_BUCKETS)
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", "s", "Generative AI server request duration such as time-to-last byte "
            "or last output token.", explicit_bucket_boundaries_advisory=GENAI_DURATION_BUCKETS)
        self.tokens = meter.create_counter(
            "llm.server.token.usage", "{token}", "Tokens the server processed, by gen_ai.token.type: input (prompt "
            "tokens, counted at each request's first token) and output (generated).")
        self.step = meter.create_histogram(
            "llm.engine.step.duration", "s", "Duration of one engine step (one forward pass and sampling), by "
            "llm.step.phase.", explicit_bucket_boundaries_advisory=STEP_BUCKETS)

    def observe_engine(self, state: Callable[[], tuple[int, int, float]]) -> None:
        """Gauges of the engine's state after its last step: `state()` is (running, waiting, KV usage)."""
        attributes = {"gen_ai.request.model": self.model}
        for index, name, unit, description in (
                (0, "llm.engine.requests.running", "{request}", "Requests in the running batch."),
                (1, "llm.engine.requests.waiting", "{request}", "Requests waiting to be scheduled (preempted ones "
                 "included)."),
                (2, "llm.engine.kv_cache.usage", "1", "Share of KV cache blocks in use by requests.")):
            self.meter.create_observable_gauge(
                name, [lambda options, i=index: [Observation(state()[i], attributes)]], unit, description)

    def observe_gpus(self, readings: Callable[[], dict[str, dict[str, float]]]) -> None:
        """The GPU sampler's last readings (GPU index -> reading -> value) under the conventions' hw.* names."""
        def observe(reading: str, extra: dict | None = None):
            return [lambda options: [Observation(values[reading], {"hw.id": gpu, **(extra or {})})
                                     for gpu, values in list(readings().items()) if reading in values]]
        m = self.meter
        m.create_observable_gauge("hw.gpu.utilization", observe("utilization"), "1",
                                  "Fraction of time spent in a specific task.")
        m.create_observable_up_down_counter("hw.gpu.memory.usage", observe("memory_used"), "By", "GPU memory used.")
        m.create_observable_up_down_counter("hw.gpu.memory.limit", observe("memory_total"), "By",
                                            "Size of the GPU memory.")
        m.create_observable_gauge("hw.power", observe("power", {"hw.type": "gpu"}), "W",
                                  "Instantaneous power consumed by the component.")


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q * count.

    `buckets` maps each upper bound (le, +Inf included) to its cumulative count. Past the last finite bound the
    answer is that bound. None when the histogram is empty.
    """
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower
