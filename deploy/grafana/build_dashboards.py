"""Writes the Grafana dashboards (deploy/grafana/dashboards/*.json) from the panel lists below.

Edit here, run `python deploy/grafana/build_dashboards.py`, commit both; a test fails when they differ.
Queries read the recording rules of deploy/rules (5-minute rates per instance and model), summed over the
instances and models picked in the `instance` and `model` variables. TTFT and end-to-end panels query the
raw histograms instead: exemplars (trace ids) exist only on raw series.
"""

import json
from pathlib import Path

from bench_history import bench_history  # the results store's dashboard (PostgreSQL), in its own module

OUT = Path(__file__).parent / "dashboards"
PROM = {"type": "prometheus", "uid": "prometheus"}
TEMPO = {"type": "tempo", "uid": "tempo"}
SEL = 'instance=~"$instance", model=~"$model"'  # the two dashboard variables, in every selector
THRESHOLD = "alert threshold"  # legend of constant series from deploy/rules/llm-thresholds.yml


def target(expr: str, legend: str = "", exemplar: bool = False, instant: bool = False) -> dict:
    return {"datasource": PROM, "expr": expr, "legendFormat": legend or "__auto", "range": not instant,
            "instant": instant, "exemplar": exemplar, "editorMode": "code"}


def threshold(name: str) -> dict:
    return target(f"llm:threshold:{name}", THRESHOLD)


def timeseries(title: str, description: str, targets: list[dict], unit: str, w: int = 8, h: int = 8,
               stack: bool = False, thresholds: list[tuple[float, str]] = ()) -> dict:
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never", "spanNulls": False,
              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    if thresholds:
        custom["thresholdsStyle"] = {"mode": "dashed"}
    overrides = [{
        "matcher": {"id": "byName", "options": THRESHOLD},
        "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
                       {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                       {"id": "custom.fillOpacity", "value": 0},
                       {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}}]}]
    return {"type": "timeseries", "title": title, "description": description, "datasource": PROM,
            "targets": targets, "_size": (w, h),
            "fieldConfig": {"defaults": {"unit": unit, "min": 0, "custom": custom,
                                         "thresholds": _steps(thresholds, "transparent")},
                            "overrides": overrides},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title: str, description: str, expr: str, unit: str, steps: list[tuple[float, str]] = (),
         w: int = 3, h: int = 4, decimals: int | None = None) -> dict:
    defaults = {"unit": unit, "thresholds": _steps(steps, "green"), "color": {"mode": "thresholds"}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {"type": "stat", "title": title, "description": description, "datasource": PROM,
            "targets": [target(expr)], "_size": (w, h),
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "justifyMode": "auto", "textMode": "auto"}}


def _steps(steps, base: str) -> dict:
    return {"mode": "absolute", "steps": [{"color": base, "value": None}] +
            [{"color": color, "value": value} for value, color in steps]}


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def quantiles(metric: str, rate: str | None = None, exemplar_q: str | None = None) -> list[dict]:
    """p50/p95/p99 over the selected instances: from recorded bucket rates, or from the raw histogram."""
    out = []
    for q in ("0.5", "0.95", "0.99"):
        if rate:
            inner = f"rate({metric}_bucket{{{SEL}}}[{rate}])"
        else:
            inner = f"instance_model:{metric}_bucket:rate5m{{{SEL}}}"
        out.append(target(f"histogram_quantile({q}, sum by (le) ({inner}))", f"p{float(q) * 100:g}",
                          exemplar=q == exemplar_q))
    return out


def layout(panels: list[dict]) -> list[dict]:
    """Flow panels left to right on Grafana's 24-column grid; a row starts a new line."""
    x = y = line_h = 0
    for i, p in enumerate(panels, start=1):
        p["id"] = i
        if p["type"] == "row":
            y += line_h
            p["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            x, y, line_h = 0, y + 1, 0
            continue
        w, h = p.pop("_size")
        if x + w > 24:
            x, y, line_h = 0, y + line_h, 0
        p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        x, line_h = x + w, max(line_h, h)
    return panels


def variables(instance_metric: str = "llm_requests_running") -> list[dict]:
    def var(name, query, label):
        return {"name": name, "label": label, "type": "query", "datasource": PROM,
                "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
                "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*", "sort": 1,
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}
    return [var("instance", f"label_values({instance_metric}, instance)", "Instance"),
            var("model", 'label_values(llm_requests_running{instance=~"$instance"}, model)', "Model")]


def dashboard(uid: str, title: str, description: str, panels: list[dict], instance_metric: str = "llm_requests_running"
              ) -> dict:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["llm"], "editable": False,
        "schemaVersion": 39, "version": 1, "timezone": "browser", "refresh": "30s", "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "links": [{"type": "dashboards", "tags": ["llm"], "asDropdown": False, "includeVars": True,
                   "keepTime": True, "title": "LLM dashboards"}],
        "annotations": {"list": [{
            "name": "Firing alerts", "datasource": PROM, "enable": True, "iconColor": "red",
            "expr": 'ALERTS{alertstate="firing", alertname=~"LLM.*"}', "step": "60s",
            "titleFormat": "{{alertname}}", "textFormat": "{{instance}} {{model}}", "useValueForTime": False}]},
        "templating": {"list": variables(instance_metric)},
        "panels": layout(panels),
    }


def model_info() -> dict:
    """How each instance runs its model: dtype, weight quantization, KV cache (llm_model_info labels)."""
    labels = "instance, model, dtype, quantization, kv_cache_dtype, kv_block_size, kv_blocks"
    return {"type": "table", "title": "Model, dtype and quantization", "_size": (24, 5), "datasource": PROM,
            "description": "Per instance: the served model, its dtype, its quantization (none; weight-only int8, "
                           "int4, fp8; weights and activations int8-w8a8, fp8-w8a8; or a pre-quantized checkpoint's "
                           "method) and its KV cache (element type, block size in tokens, block count).",
            "targets": [target(f"max by ({labels}) (llm_model_info{{{SEL}}})", instant=True)],
            "transformations": [{"id": "labelsToFields", "options": {}}],
            "fieldConfig": {"defaults": {}, "overrides": []}, "options": {"showHeader": True}}


def replicas() -> list[dict]:
    """Per-replica series, for the questions a fleet raises: does the load spread, and which replica is saturated."""
    by = "{{instance}}"
    return [
        row("Replicas"),
        stat("Replicas serving", "Replicas whose metrics Prometheus scraped last (a down one drops out; "
             "LLMServiceDown names it).", f"count(count by (instance) (llm_requests_running{{{SEL}}}))", "short",
             w=4, h=8),
        timeseries("Requests/s by replica", "Finished requests per second on each replica: the load balancer's "
                   "spread.", [target(f"sum by (instance) (instance_model:llm_requests:rate5m{{{SEL}}})", by)],
                   "reqps", w=10),
        timeseries("Waiting requests by replica", "Requests waiting for a batch slot on each replica: a replica "
                   "above the line is saturated (autoscaling adds replicas on the fleet's mean).",
                   [target(f"sum by (instance) (llm_requests_waiting{{{SEL}}})", by), threshold("waiting_requests")],
                   "short", w=10),
        timeseries("Time to first token p95 by replica", "p95 TTFT of each replica over 5 minutes (what "
                   "LLMHighTimeToFirstToken compares per replica); the Latency row shows the fleet's.",
                   [target(f'max by (instance) (instance_model:llm_time_to_first_token_seconds:quantile_rate5m'
                           f'{{quantile="0.95", {SEL}}})', by), threshold("ttft_p95_seconds")], "s", w=12),
        timeseries("Output tokens/s by replica", "Generated tokens per second on each replica.",
                   [target(f"sum by (instance) (instance_model:llm_generation_tokens:rate5m{{{SEL}}})", by)],
                   "suffix: tok/s", w=12),
    ]


def overview() -> dict:
    errors = (f"sum(instance_model:llm_slo_availability_bad:rate5m{{{SEL}}})"
              f" / sum(instance_model:llm_slo_availability_total:rate5m{{{SEL}}})")
    panels = [
        row("Now"),
        stat("Requests/s", "Finished generation requests per second (5-minute rate).",
             f"sum(instance_model:llm_requests:rate5m{{{SEL}}})", "reqps", decimals=2),
        stat("Error ratio", "Generation requests answered 5xx or failed in the engine (the availability SLI).",
             errors, "percentunit", [(0.01, "orange"), (0.05, "red")]),
        stat("TTFT p95", "95th percentile of time to first token, 5 minutes.",
             f"histogram_quantile(0.95, sum by (le) (instance_model:llm_time_to_first_token_seconds_bucket:rate5m{{{SEL}}}))",
             "s", [(0.5, "orange"), (1, "red")]),
        stat("Inter-token p95", "95th percentile of the gap between output tokens, 5 minutes.",
             f"histogram_quantile(0.95, sum by (le) (instance_model:llm_time_per_output_token_seconds_bucket:rate5m{{{SEL}}}))",
             "s", [(0.05, "orange"), (0.1, "red")]),
        stat("Request p95, worst instance", "95th percentile of end-to-end request duration on the slowest "
             "selected instance, 5 minutes.",
             f'max(instance_model:llm_request_duration_seconds:quantile_rate5m{{quantile="0.95", {SEL}}})', "s"),
        stat("Output tokens/s", "Generated tokens per second (5-minute rate).",
             f"sum(instance_model:llm_generation_tokens:rate5m{{{SEL}}})", "suffix: tok/s", decimals=1),
        stat("Running", "Requests in the running batch, now.", f"sum(llm_requests_running{{{SEL}}})", "short"),
        stat("Waiting", "Requests waiting for a slot in the batch, now.", f"sum(llm_requests_waiting{{{SEL}}})",
             "short", [(1, "orange"), (8, "red")]),

        *replicas(),

        row("Traffic"),
        timeseries("Requests by finish reason", "Finished requests per second: stop (stop token or string), "
                   "length (max_tokens), abort (client gone), error (failed in the engine).",
                   [target(f"sum by (finish_reason) (instance_model:llm_requests:rate5m{{{SEL}}})",
                           "{{finish_reason}}")], "reqps", stack=True),
        timeseries("HTTP responses by route and status", "Every HTTP answer, rejections (503, 4xx) included.",
                   [target(f"sum by (route, status) (instance_model:llm_http_requests:rate5m{{{SEL}}})",
                           "{{status}} {{route}}")], "reqps", stack=True),
        timeseries("Error ratio", "Share of generation requests answered 5xx or failed in the engine "
                   "(LLMHighErrorRatio compares it per instance with the red line).",
                   [target(errors, "error ratio"), threshold("error_ratio")], "percentunit"),
        timeseries("Tokens per second", "Prompt tokens prefilled (in) and tokens generated (out).",
                   [target(f"sum(instance_model:llm_prompt_tokens:rate5m{{{SEL}}})", "prompt (in)"),
                    target(f"sum(instance_model:llm_generation_tokens:rate5m{{{SEL}}})", "generated (out)")],
                   "suffix: tok/s", w=12),
        timeseries("Running and waiting requests", "Requests in the running batch, and waiting to enter it "
                   "(preempted ones included).",
                   [target(f"sum(llm_requests_running{{{SEL}}})", "running"),
                    target(f"sum(llm_requests_waiting{{{SEL}}})", "waiting"),
                    threshold("waiting_requests")], "short", w=12),

        row("Latency"),
        timeseries("Time to first token", "From arrival to the first output token. Diamonds are exemplars: "
                   "click one to open that request's trace in Tempo.",
                   quantiles("llm_time_to_first_token_seconds", rate="$__rate_interval", exemplar_q="0.95")
                   + [threshold("ttft_p95_seconds")], "s"),
        timeseries("Inter-token latency", "Gap between consecutive output tokens of a request.",
                   quantiles("llm_time_per_output_token_seconds") + [threshold("itl_p95_seconds")], "s"),
        timeseries("End-to-end request duration", "From arrival to the last token. Diamonds are exemplars "
                   "(trace ids).", quantiles("llm_request_duration_seconds", rate="$__rate_interval",
                                             exemplar_q="0.95"), "s"),
        timeseries("Where the time goes (p95)", "p95 of each phase of a request: waiting to be scheduled "
                   "(queue), prompt processing up to the first token (prefill), generating the rest (decode); "
                   "frontend is the part of the queue before the engine (body, validation, chat template, "
                   "tokenization): high while the engine is idle means a slow front end.",
                   [target(f"histogram_quantile(0.95, sum by (le) (instance_model:llm_request_{p}_seconds_bucket:"
                           f"rate5m{{{SEL}}}))", p) for p in ("queue", "prefill", "decode", "frontend")], "s", w=12),
        timeseries("Queue time", "From arrival to first scheduling: above a few ms the server is saturated.",
                   quantiles("llm_request_queue_seconds"), "s", w=12),
        timeseries("TTFT p95: scraped and pushed (GenAI)", "The same first tokens, measured once, seen two ways: "
                   "llm_time_to_first_token_seconds scraped from /metrics, and gen_ai.server.time_to_first_token "
                   "pushed over OTLP (--otlp-metrics; Prometheus's OTLP receiver names it "
                   "gen_ai_server_time_to_first_token_seconds). Their counts and sums agree exactly; the p95s differ "
                   "within a bucket, as the GenAI histogram has the semantic conventions' own buckets. The pushed "
                   "series follow the model variable only: their instance is the process (docs/telemetry.md).",
                   [target(f"histogram_quantile(0.95, sum by (le) (instance_model:llm_time_to_first_token_seconds_"
                           f"bucket:rate5m{{{SEL}}}))", "llm_time_to_first_token_seconds (scraped)"),
                    target('histogram_quantile(0.95, sum by (le) (rate(gen_ai_server_time_to_first_token_seconds_'
                           'bucket{gen_ai_request_model=~"$model"}[5m])))',
                           "gen_ai.server.time_to_first_token (OTLP)")],
                   "s", w=24, h=7),

        row("Engine"),
        timeseries("KV cache usage", "Share of KV cache blocks held by requests, per instance. Near full, "
                   "requests wait for blocks and running ones get preempted.",
                   [target(f"max by (instance) (llm_kv_cache_usage_ratio{{{SEL}}})", "{{instance}}"),
                    threshold("kv_cache_usage_ratio")], "percentunit"),
        timeseries("Preemptions", "Requests preempted per second because the KV cache ran out (they are "
                   "recomputed later: wasted work).",
                   [target(f"sum(instance_model:llm_preemptions:rate5m{{{SEL}}})", "preemptions")], "ops"),
        timeseries("Engine busy", "Seconds of engine steps per second, by phase: near 1 the engine never idles.",
                   [target(f"sum by (phase) (instance_model:llm_engine_step_seconds_sum:rate5m{{{SEL}}})",
                           "{{phase}}")], "percentunit", stack=True),
        timeseries("Engine step time", "p50 and p95 duration of one engine step (a forward pass and sampling), "
                   "by phase.",
                   [target(f"histogram_quantile({q}, sum by (phase, le) (instance_model:llm_engine_step_seconds_bucket:"
                           f"rate5m{{{SEL}}}))", f"{{{{phase}}}} p{float(q) * 100:g}") for q in ("0.5", "0.95")],
                   "s"),
        timeseries("Tokens per step", "Tokens computed in one engine step, by phase (mean and p95): the batch "
                   "size the scheduler achieves. Every step is one observation of step time and of batch tokens.",
                   [target(f"sum by (phase) (instance_model:llm_batch_tokens_sum:rate5m{{{SEL}}})"
                           f" / sum by (phase) (instance_model:llm_engine_step_seconds_count:rate5m{{{SEL}}})",
                           "{{phase}} mean"),
                    target(f"histogram_quantile(0.95, sum by (phase, le) (instance_model:llm_batch_tokens_bucket:"
                           f"rate5m{{{SEL}}}))", "{{phase}} p95")], "short"),
        timeseries("Steps per second", "Engine steps per second, by phase.",
                   [target(f"sum by (phase) (instance_model:llm_engine_step_seconds_count:rate5m{{{SEL}}})",
                           "{{phase}}")], "ops", stack=True),
        timeseries("Prompt tokens: computed and from the prefix cache", "Prompt tokens per second the engine "
                   "computed, and those it found in the prefix cache instead (counted at admission): samples of an "
                   "n > 1 request, a shared system prompt or a repeated evaluation context show as cached.",
                   [target(f"sum(rate(llm_prompt_tokens_computed_total{{{SEL}}}[$__rate_interval]))", "computed"),
                    target(f"sum(rate(llm_prompt_tokens_cached_total{{{SEL}}}[$__rate_interval]))", "cached")],
                   "suffix: tok/s", w=24, h=7, stack=True),
        model_info(),

        row("Structured output"),
        timeseries("Constrained requests and tool calls", "Requests per second whose output a grammar constrains, "
                   "by what asked for it (response_format json_object or json_schema, or tools); tool calls returned "
                   "per second; and constrained requests whose grammar was compiled already (cache hits).",
                   [target(f"sum by (constraint) (rate(llm_structured_requests_total{{{SEL}}}[$__rate_interval]))",
                           "{{constraint}}"),
                    target(f"sum(rate(llm_tool_calls_total{{{SEL}}}[$__rate_interval]))", "tool calls"),
                    target(f"sum(rate(llm_grammar_cache_hits_total{{{SEL}}}[$__rate_interval]))", "cache hits")],
                   "reqps"),
        timeseries("Grammar compile time", "From a constrained request's arrival at the engine to its grammar "
                   "being ready: compiled (milliseconds to tens of them for a large schema; the limit is 10 s), or "
                   "found compiled (microseconds). The request waits outside the batch meanwhile.",
                   quantiles("llm_grammar_compile_seconds", "$__rate_interval"), "s"),
        timeseries("Grammar masks per step", "Host time a step with constrained rows spends having their grammars "
                   "take the last tokens and filling and uploading their token masks. It runs while the device "
                   "computes the step's forward pass; what exceeds that delays the step.",
                   quantiles("llm_grammar_mask_seconds", "$__rate_interval"), "s"),

        row("Processes"),
        timeseries("Front-end event-loop lag", "How late each front end's event loop runs (label process: api-0 "
                   "...): every request on that front end waits this long for HTTP, JSON and token handling. "
                   "Steadily above a few ms, the front ends are the bottleneck: add --api-servers.",
                   [target(f"max by (instance, process) (llm_event_loop_lag_seconds{{{SEL}}})",
                           "{{instance}} {{process}}")], "s"),
        timeseries("CPU per process", "CPU seconds per second of the engine process and each front end: the "
                   "engine near 1.0 is the Python loop's limit; front ends near 1.0 need more of them.",
                   [target(f"sum by (instance, process) (rate(process_cpu_seconds_total{{{SEL}}}"
                           f"[$__rate_interval]))",
                           "{{instance}} {{process}}")], "percentunit"),
        timeseries("Open connections per front end", "HTTP connections each front end holds (label process): a "
                   "connection stays with the front end that accepted it, and the kernel spreads new ones over the "
                   "front ends' sockets by a hash of their addresses and ports, so with many clients each front end "
                   "holds about its share. One far above the others sets the pace of its requests.",
                   [target(f"sum by (instance, process) (llm_http_connections{{{SEL}}})", "{{instance}} {{process}}")],
                   "short"),
        timeseries("Garbage-collection pauses", "Share of each process's time that Python's garbage collector "
                   "stopped it (label process), and its longest collections: the p99 pause of full ones "
                   "(generation 2). Each process freezes what it loaded at start, so full collections take "
                   "milliseconds; one far longer stalls every request of that process.",
                   [target(f"sum by (instance, process) (rate(llm_gc_pause_seconds_sum{{{SEL}}}[$__rate_interval]))",
                           "{{instance}} {{process}} share"),
                    target(f"histogram_quantile(0.99, sum by (instance, process, le) "
                           f"(rate(llm_gc_pause_seconds_bucket{{{SEL}, generation=\"2\"}}[$__rate_interval])))",
                           "{{instance}} {{process}} full p99")], "s"),
        timeseries("IPC backlog", "Requests each front end has sent to the engine process and not yet heard "
                   "back about: above zero for long, the engine's loop is not reading its inbox.",
                   [target(f"sum by (instance, process) (llm_ipc_backlog{{{SEL}}})", "{{instance}} {{process}}")],
                   "short"),

        row("Traces"),
        {"type": "table", "title": "Recent generation requests (Tempo)", "_size": (24, 8), "datasource": TEMPO,
         "description": "The latest generation spans; click a trace id to open it.",
         "targets": [{"datasource": TEMPO, "queryType": "traceql", "limit": 20, "tableType": "traces",
                      "query": '{resource.service.name="llm-service" && span.gen_ai.request.model=~"${model:regex}"}'}],
         "fieldConfig": {"defaults": {}, "overrides": []}, "options": {"showHeader": True}},
    ]
    return dashboard("llm-overview", "LLM service overview", "Traffic, errors, latency and engine state of "
                     "the LLM service.", panels)


def gpu() -> dict:
    # GPU gauges carry `gpu` and `instance` but no `model`: keep the GPUs of instances serving $model
    sel = 'instance=~"$instance"'
    of_model = ' and on (job, instance) llm_requests_running{model=~"$model"}'
    legend = "{{instance}} gpu {{gpu}}"

    def per_gpu(title, description, metric, unit, extra=(), w=12):
        return timeseries(title, description, [target(f"{metric}{{{sel}}}{of_model}", legend), *extra], unit, w=w)

    panels = [
        row("Compute"),
        per_gpu("GPU utilization", "Share of the sample period in which a kernel ran (NVML).",
                "llm_gpu_utilization_ratio", "percentunit", [threshold("gpu_idle_utilization_ratio")]),
        timeseries("Busiest GPU vs waiting requests", "What LLMGPUIdleWhileRequestsWait watches: requests "
                   "waiting while no GPU of the instance works.",
                   [target(f"max by (instance) (llm_gpu_utilization_ratio{{{sel}}}{of_model})",
                           "{{instance}} busiest GPU"),
                    target(f'sum by (instance) (llm_requests_waiting{{{sel}, model=~"$model"}})',
                           "{{instance}} waiting requests")], "short", w=12),
        row("Memory"),
        per_gpu("GPU memory used", "Memory in use on each GPU, all processes (weights, KV cache, activations).",
                "llm_gpu_memory_used_bytes", "bytes",
                [target(f"llm_gpu_memory_total_bytes{{{sel}}}{of_model}", "{{instance}} gpu {{gpu}} total")]),
        timeseries("GPU memory used share", "Used / total memory of each GPU.",
                   [target(f"llm_gpu_memory_used_bytes{{{sel}}} / llm_gpu_memory_total_bytes{{{sel}}}{of_model}",
                           legend)], "percentunit", w=12),
        row("Power and clocks"),
        per_gpu("Power draw", "Watts drawn by each GPU.", "llm_gpu_power_watts", "watt", w=8),
        per_gpu("Temperature", "Core temperature of each GPU.", "llm_gpu_temperature_celsius", "celsius", w=8),
        per_gpu("SM clock", "Current streaming-multiprocessor clock: a drop under load means throttling "
                "(power or heat).", "llm_gpu_sm_clock_hertz", "hertz", w=8),
    ]
    return dashboard("llm-gpu", "LLM service GPUs", "Per-GPU utilization, memory, power, temperature and clocks "
                     "(NVML; empty on CPU-only machines).", panels, instance_metric="llm_gpu_utilization_ratio")


def slo() -> dict:
    def ratio(slo_name: str, window: str) -> str:
        return (f"sum(instance_model:llm_slo_{slo_name}_bad:{window}{{{SEL}}})"
                f" / sum(instance_model:llm_slo_{slo_name}_total:{window}{{{SEL}}})")

    def budget(slo_name: str) -> str:
        return f'scalar(1 - llm:slo_objective:ratio{{slo="{slo_name}"}})'

    def over_30d(slo_name: str) -> str:
        # sum_over_time of recorded 5-minute rates weighs every request alike: the ratio over 30 days
        return (f"sum(sum_over_time(instance_model:llm_slo_{slo_name}_bad:rate5m{{{SEL}}}[30d]))"
                f" / sum(sum_over_time(instance_model:llm_slo_{slo_name}_total:rate5m{{{SEL}}}[30d]))")

    burn_steps = [(1, "yellow"), (6, "orange"), (14.4, "red")]
    panels = []
    for name, title, what in (
            ("availability", "Availability", "generation requests that were not answered 5xx and did not "
                                             "fail in the engine"),
            ("ttft", "Time to first token", "requests whose first token came within 0.5 s")):
        panels += [
            row(f"{title} SLO"),
            stat("Objective", f"Target share of {what}, over 30 days (deploy/rules/llm-thresholds.yml).",
                 f'llm:slo_objective:ratio{{slo="{name}"}}', "percentunit", decimals=2, w=4),
            stat("SLI, 30 days", f"Measured share of {what} over the last 30 days (or since data began).",
                 f"1 - ({over_30d(name)})", "percentunit", decimals=3, w=4),
            stat("Error budget left", "Share of the 30-day error budget not yet spent: 1 - error ratio / "
                 "(1 - objective). Below 0 the SLO is broken.", f"1 - ({over_30d(name)}) / {budget(name)}",
                 "percentunit", [(-1e9, "red"), (0, "orange"), (0.25, "green")], decimals=1, w=4),
            stat("Burn rate, 1 h", "How fast the budget burns now: 1 spends it in exactly 30 days; 14.4 over "
                 "1 h (and 5 min) pages.", f"({ratio(name, 'rate1h')}) / {budget(name)}", "short",
                 burn_steps, decimals=1, w=4),
            stat("Error budget spent in range", "Share of a 30-day budget spent during the dashboard's time range.",
                 f"(sum(sum_over_time(instance_model:llm_slo_{name}_bad:rate5m{{{SEL}}}[$__range]))"
                 f" / sum(sum_over_time(instance_model:llm_slo_{name}_total:rate5m{{{SEL}}}[$__range])))"
                 f" / {budget(name)} * ($__range_s / (30 * 86400))", "percentunit", decimals=2, w=8),
            timeseries("Burn rate by window", "Error ratio / (1 - objective) over each alert window. Page: 1h and "
                       "5m above 14.4, or 6h and 30m above 6. Ticket: 1d and 2h above 3, or 3d and 6h above 1.",
                       [target(f"({ratio(name, 'rate' + w)}) / {budget(name)}", w)
                        for w in ("5m", "30m", "1h", "2h", "6h", "1d", "3d")],
                       "short", w=12, thresholds=burn_steps),
            timeseries("Error ratio", "Share of bad events over 5 minutes and 1 hour, against the budget "
                       "(1 - objective).",
                       [target(ratio(name, "rate5m"), "5m"), target(ratio(name, "rate1h"), "1h"),
                        target(f'1 - llm:slo_objective:ratio{{slo="{name}"}}', "error budget (1 - objective)")],
                       "percentunit", w=12),
        ]
    panels += [
        row("Alerts"),
        {"type": "table", "title": "Firing and pending alerts", "_size": (24, 6), "datasource": PROM,
         "description": "LLM alerts Prometheus evaluates as pending or firing now (Alertmanager routes them).",
         "targets": [target('sum by (alertname, alertstate, severity, instance, model, slo) '
                            '(ALERTS{alertname=~"LLM.*"})', instant=True)],
         "transformations": [{"id": "labelsToFields", "options": {}}],
         "fieldConfig": {"defaults": {}, "overrides": []}, "options": {"showHeader": True}},
    ]
    return dashboard("llm-slo", "LLM service SLOs", "Availability and time-to-first-token SLOs: error budget "
                     "left and burn rates over the multi-window alert windows.", panels)


DASHBOARDS = {"llm-overview.json": overview, "llm-gpu.json": gpu, "llm-slo.json": slo,
              "llm-bench-history.json": lambda: bench_history(dashboard, row)}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print("wrote", OUT / name)
