"""Metrics, traces and GPU sampling: exact values, real OTLP receivers, a real Prometheus."""

import asyncio
import gc
import json
import logging
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus

from service.engine import SamplingParams
from service.telemetry.gpu import GPUSampler
from service.telemetry.metrics import GPUMetrics, Metrics
from service.telemetry.recorder import EngineRecorder, RequestRecorder, observe_many
from tests import web
from tests.conftest import Linked, LiveServer, free_port, make_engine, wait_until
from tests.otlp import ErroringCollector, HangingCollector, Receiver
from tests.prometheus import Prometheus

MODEL = "random:tiny"

# The catalog of ../shared/DESIGN.md: what every dashboard and alert relies on (GPU gauges: see below)
CATALOG = {
    "llm_time_to_first_token_seconds": "histogram", "llm_time_per_output_token_seconds": "histogram",
    "llm_request_duration_seconds": "histogram", "llm_request_queue_seconds": "histogram",
    "llm_request_prefill_seconds": "histogram", "llm_request_decode_seconds": "histogram",
    "llm_request_frontend_seconds": "histogram",
    "llm_prompt_tokens": "counter", "llm_generation_tokens": "counter", "llm_requests": "counter",
    "llm_prompt_tokens_computed": "counter", "llm_prompt_tokens_cached": "counter",
    "llm_http_requests": "counter", "llm_requests_running": "gauge", "llm_requests_waiting": "gauge",
    "llm_kv_cache_usage_ratio": "gauge", "llm_preemptions": "counter", "llm_engine_step_seconds": "histogram",
    "llm_batch_tokens": "histogram", "llm_tensor_parallel_forward_seconds": "counter", "llm_model_info": "gauge",
    "llm_engine_step_failures": "counter", "llm_kv_cache_blocks_used": "gauge",
    "llm_process_threads": "gauge", "llm_asyncio_tasks": "gauge", "llm_event_loop_lag_seconds": "gauge",
    "llm_ipc_backlog": "gauge", "llm_http_connections": "gauge", "llm_otlp_metric_export_failures": "counter",
    "llm_otlp_metric_points_dropped": "counter", "llm_structured_requests": "counter", "llm_tool_calls": "counter",
    "llm_grammar_compile_seconds": "histogram", "llm_grammar_cache_hits": "counter",
    "llm_grammar_mask_seconds": "histogram", "llm_requests_received": "counter",
    "llm_engine_step_host_seconds": "histogram", "llm_gc_pause_seconds": "histogram",
    "llm_gc_frozen_objects": "gauge",
}
GPU_GAUGES = ["llm_gpu_utilization_ratio", "llm_gpu_memory_used_bytes", "llm_gpu_memory_total_bytes",
              "llm_gpu_power_watts", "llm_gpu_temperature_celsius", "llm_gpu_sm_clock_hertz"]
LATENCIES = ["llm_time_to_first_token_seconds", "llm_request_queue_seconds", "llm_request_prefill_seconds",
             "llm_request_duration_seconds", "llm_request_decode_seconds", "llm_request_frontend_seconds"]


def recorded_engine(loaded, **overrides):
    metrics = Metrics(MODEL)
    engine = make_engine(loaded, enable_prefix_caching=False, **overrides)
    engine.observer = EngineRecorder(metrics)
    return engine, metrics


def run_linked(engine, metrics: Metrics, prompts: list, params) -> list:
    """Run prompts through the engine's core and a front end's client recording into `metrics`; each one's last
    output."""
    params = params if isinstance(params, list) else [params] * len(prompts)

    async def main():
        async with Linked(engine, recorder=RequestRecorder(metrics)) as link:
            async def one(prompt, sp):
                return [o async for o in link.generate(prompt, sp, streaming=False)][-1]
            return await asyncio.gather(*[one(p, sp) for p, sp in zip(prompts, params)])
    return asyncio.run(main())


def value(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model": MODEL, **labels}) or 0.0


def phases_total(metrics: Metrics, name: str) -> float:
    return sum(value(metrics, name, phase=p) for p in ("prefill", "decode", "mixed"))


def assert_at_rest(metrics: Metrics) -> None:
    for gauge in ("llm_requests_running", "llm_requests_waiting", "llm_kv_cache_usage_ratio"):
        assert value(metrics, gauge) == 0, gauge


def test_telemetry_doc_metric_table_is_the_catalog():
    page = Path(__file__).resolve().parents[2] / "docs" / "telemetry.md"
    rows = dict(re.findall(r"^\| (llm_\w+) \| (\w+) \|", page.read_text(), re.M))
    registry = CollectorRegistry()
    metrics = Metrics(MODEL, registry)
    GPUMetrics(registry)
    exported = {f.name + ("_total" if f.type == "counter" else ""): f.type
                for r in (registry, metrics.local) for f in r.collect() if f.name.startswith("llm_")}
    assert rows == exported
    assert {name.removesuffix("_total") for name in rows} == set(CATALOG) | set(GPU_GAUGES)


# -- the recorder, on the engine alone -------------------------------------------------------------------
def test_prompt_tokens_computed_and_cached_count_shared_prompts(tiny_model):
    metrics = Metrics(MODEL)
    engine = make_engine(tiny_model)
    engine.observer = EngineRecorder(metrics)
    engine.generate([[9] * 40], SamplingParams(max_tokens=3), n=3)  # 2 full blocks of 16 shared by samples 1, 2
    assert value(metrics, "llm_prompt_tokens_computed_total") == 40 + 2 * 8
    assert value(metrics, "llm_prompt_tokens_cached_total") == 2 * 32
    engine.generate([[9] * 40], SamplingParams(max_tokens=3))  # all of it cached now, but the last partial block
    assert value(metrics, "llm_prompt_tokens_computed_total") == 40 + 3 * 8
    assert value(metrics, "llm_prompt_tokens_cached_total") == 3 * 32


def test_counters_and_histograms_match_the_requests_exactly(tiny_model):
    engine, m = recorded_engine(tiny_model)
    prompts = [[5] * 3, [6] * 17, [7] * 40, [8]]
    lengths = [5, 1, 9, 12]
    run_linked(engine, m, prompts, [SamplingParams(max_tokens=k, ignore_eos=True) for k in lengths])
    assert value(m, "llm_requests_total", finish_reason="length") == 4
    assert all(value(m, "llm_requests_total", finish_reason=r) == 0 for r in ("stop", "abort", "error"))
    assert value(m, "llm_generation_tokens_total") == sum(lengths)
    assert value(m, "llm_prompt_tokens_total") == sum(map(len, prompts))
    for name in LATENCIES:
        assert value(m, name + "_count") == 4, name
    assert value(m, "llm_time_per_output_token_seconds_count") == sum(k - 1 for k in lengths)
    # a request's decode time is the sum of its token gaps
    assert value(m, "llm_time_per_output_token_seconds_sum") == pytest.approx(value(m, "llm_request_decode_seconds_sum"))
    # the model computed every prompt token and every output token but the last (never fed back)
    assert phases_total(m, "llm_batch_tokens_sum") == sum(len(p) + k - 1 for p, k in zip(prompts, lengths))
    assert phases_total(m, "llm_engine_step_seconds_count") == phases_total(m, "llm_batch_tokens_count") > 0
    # each step's host time under its own phase: as many of each as of steps
    for phase in ("prefill", "decode", "mixed"):
        assert value(m, "llm_engine_step_host_seconds_count", phase=phase) == value(
            m, "llm_engine_step_seconds_count", phase=phase), phase
    assert value(m, "llm_engine_step_host_seconds_count", phase="decode") > 0
    assert_at_rest(m)


def test_preemptions_are_counted_and_gauges_follow_the_load(tiny_model):
    engine, m = recorded_engine(tiny_model, num_blocks=8, max_num_seqs=8)
    seen = []
    record = engine.observer

    def spy(step):
        record(step)
        seen.append((value(m, "llm_requests_running"), value(m, "llm_requests_waiting"),
                     value(m, "llm_kv_cache_usage_ratio")))

    engine.observer = spy
    run_linked(engine, m, [[9 + i] * 30 for i in range(6)], SamplingParams(max_tokens=20, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    assert value(m, "llm_preemptions_total") == engine.scheduler.num_preemptions
    assert value(m, "llm_generation_tokens_total") == 6 * 20
    assert max(s[0] for s in seen) >= 2 and max(s[1] for s in seen) >= 1 and max(s[2] for s in seen) > 0.5
    assert_at_rest(m)


def test_aborts_and_failed_steps_are_counted_by_finish_reason(tiny_model):
    engine, m = recorded_engine(tiny_model)

    async def leave_after_two(link):
        async for out in link.generate([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)):
            if out.num_output_tokens >= 2:
                return
    async def main():
        async with Linked(engine, recorder=RequestRecorder(m)) as link:
            await leave_after_two(link)
            while engine.has_unfinished():
                await asyncio.sleep(0.01)
    asyncio.run(main())
    assert value(m, "llm_requests_total", finish_reason="abort") == 1
    assert 2 <= value(m, "llm_generation_tokens_total") < 50  # what reached the front end before it left
    assert value(m, "llm_request_duration_seconds_count") == 1
    assert_at_rest(m)

    run = engine.runner.forward
    engine.runner.forward = lambda batch: 1 / 0  # a fault inside the forward pass
    assert run_linked(engine, m, [[4, 5, 6]], SamplingParams(max_tokens=5))[0].finish_reason == "error"
    engine.runner.forward = run
    assert value(m, "llm_requests_total", finish_reason="error") == 1
    assert value(m, "llm_engine_step_failures_total", error="ZeroDivisionError") == 1
    assert run_linked(engine, m, [[7, 8]], SamplingParams(max_tokens=2))[0].finish_reason == "length"
    assert value(m, "llm_requests_total", finish_reason="length") == 1
    assert_at_rest(m)


def test_grouped_observations_equal_single_ones():
    single, grouped = (Histogram("h", "h", registry=CollectorRegistry(), buckets=(0.001, 0.01, 1.0)) for _ in "ab")
    values = [0.0005, 0.001, 0.003, 0.003, 0.003, 0.7, 1.0, 42.0]
    for v in values:
        single.observe(v)
    for v, n in Counter(values).items():
        observe_many(grouped, v, n)
    assert [s for f in single.collect() for s in f.samples] == [s for f in grouped.collect() for s in f.samples]


# -- /metrics over HTTP ----------------------------------------------------------------------------------
def scrape(server, openmetrics: bool = False) -> dict[str, object]:
    accept = "application/openmetrics-text; version=1.0.0" if openmetrics else "text/plain"
    r = web.get(server.url + "/metrics", headers={"Accept": accept})
    assert r.status_code == 200
    parse = parse_openmetrics if openmetrics else parse_prometheus
    return {f.name: f for f in parse(r.text)}


def sample_value(families, family: str, name: str, **labels) -> float:
    return sum(s.value for s in families[family].samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_route_matches_usage_and_counts_statuses(tiny_model):
    with LiveServer(tiny_model, {"enable_prefix_caching": False}) as s:
        usages = []
        with httpx.Client(base_url=s.url) as c:
            for i, stream in enumerate([False, True, False, True]):
                body = {"model": MODEL, "prompt": [3 + i] * (4 + i), "max_tokens": 3 + i, "ignore_eos": True}
                if stream:
                    with c.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}}) as r:
                        events = [line for line in r.iter_lines() if line.startswith("data: {")]
                    usages.append(json.loads(events[-1][6:])["usage"])
                else:
                    usages.append(c.post("/v1/completions", json=body).json()["usage"])
            usages.append(c.post("/generate", json={"token_ids": [1, 2], "max_tokens": 4}).json()["usage"])
            assert c.post("/v1/completions", json={"model": MODEL, "prompt": [1], "temperature": -1}).status_code == 400
            assert c.post("/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": "hi"}]}).status_code == 400  # a random model has no chat template
            assert c.get("/no/such/route").status_code == 404
        assert s.wait_idle()
        families = scrape(s)

    for name, kind in CATALOG.items():
        assert families[name].type == kind, name
    assert sample_value(families, "llm_generation_tokens", "llm_generation_tokens_total") == \
        sum(u["completion_tokens"] for u in usages)
    assert sample_value(families, "llm_prompt_tokens", "llm_prompt_tokens_total") == \
        sum(u["prompt_tokens"] for u in usages)
    assert sample_value(families, "llm_requests", "llm_requests_total", finish_reason="length") == 5
    assert sample_value(families, "llm_time_to_first_token_seconds", "llm_time_to_first_token_seconds_count") == 5
    http = lambda route, status: sample_value(families, "llm_http_requests", "llm_http_requests_total",
                                              route=route, status=status, model=MODEL)
    assert http("/v1/completions", "200") == 4 and http("/generate", "200") == 1
    assert http("/v1/completions", "400") == 1 and http("/v1/chat/completions", "400") == 1
    assert http("unmatched", "404") == 1
    for gauge in ("llm_requests_running", "llm_requests_waiting", "llm_kv_cache_usage_ratio"):
        assert sample_value(families, gauge, gauge) == 0, gauge
    assert "process_cpu_seconds" in families and "process_resident_memory_bytes" in families
    assert not any(name.startswith("llm_gpu_") for name in families) or torch.cuda.is_available()


def test_client_disconnect_counts_as_abort(tiny_model):
    with LiveServer(tiny_model) as s:
        with web.stream("POST", s.url + "/v1/completions", json={
                "model": MODEL, "prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))
        assert s.wait_idle()
        families = scrape(s)
    assert sample_value(families, "llm_requests", "llm_requests_total", finish_reason="abort") == 1
    assert sample_value(families, "llm_kv_cache_usage_ratio", "llm_kv_cache_usage_ratio") == 0


# -- traces ----------------------------------------------------------------------------------------------
EXPORT_TIMEOUT_S = 4


def use_collector(monkeypatch, endpoint: str, protocol: str = "http/protobuf") -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # milliseconds: export soon after each span
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", str(EXPORT_TIMEOUT_S))


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_request_span_joins_the_callers_trace_with_gen_ai_attributes_events_and_exemplars(
        tiny_model, monkeypatch, protocol):
    trace_id, caller = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    with Receiver(protocol) as receiver:
        use_collector(monkeypatch, receiver.endpoint, protocol)
        with LiveServer(tiny_model) as s:
            r = web.post(s.url + "/v1/completions", headers={"traceparent": f"00-{trace_id}-{caller}-01"},
                         json={"model": MODEL, "prompt": [4, 5, 6], "max_tokens": 6, "ignore_eos": True,
                               "temperature": 0.5, "seed": 7})
            assert r.status_code == 200
            families = scrape(s, openmetrics=True)
            expected = {f"text_completion {MODEL}", "POST /v1/completions", "engine.request"}
            spans = receiver.wait_for(lambda spans: expected <= {sp.name for sp in spans if sp.trace_id == trace_id}
                                      and any(t == trace_id for sp in spans for t, _ in sp.links))

    mine = {sp.name: sp for sp in spans if sp.trace_id == trace_id}
    gen, http_span = mine[f"text_completion {MODEL}"], mine["POST /v1/completions"]
    assert http_span.parent_span_id == caller and gen.parent_span_id == http_span.span_id
    a = gen.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.request.seed"] == 7 and a["gen_ai.response.id"] == r.json()["id"]
    assert a["gen_ai.usage.input_tokens"] == 3 and a["gen_ai.usage.output_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert "gen_ai.prompt" not in a and "gen_ai.completion" not in a  # no text unless enabled
    names = [e[0] for e in gen.events]
    assert names == ["received", "queued", "scheduled", "first_token", "finished"]
    assert gen.start_ns == gen.events[0][1] and gen.attributes["llm.request.frontend_seconds"] > 0
    assert [e[1] for e in gen.events] == sorted(e[1] for e in gen.events)
    assert gen.resource["service.name"] == "llm-service"
    # the engine's side of the request: a child span (its context went with the request to the engine), linked
    # from the steps that changed its life: the one that admitted it, the one it ended in
    engine_side = mine["engine.request"]
    assert engine_side.parent_span_id == gen.span_id and gen.start_ns < engine_side.start_ns < gen.end_ns
    assert [e[0] for e in engine_side.events] == ["scheduled"]
    steps = sorted((sp for sp in spans if sp.name == "engine.step" and (trace_id, engine_side.span_id) in sp.links),
                   key=lambda sp: sp.start_ns)
    assert [(sp.attributes["llm.step.phase"], sp.attributes["llm.step.admitted"], sp.attributes["llm.step.finished"])
            for sp in steps] == [("prefill", 1, 0), ("decode", 0, 1)]
    assert steps[0].attributes["llm.step.tokens"] == 3 and steps[0].attributes["llm.step.sequences"] == 1

    exemplars = [s.exemplar for s in families["llm_time_to_first_token_seconds"].samples if s.exemplar]
    assert [e.labels["trace_id"] for e in exemplars] == [trace_id]
    exemplars = [s.exemplar for s in families["llm_request_duration_seconds"].samples if s.exemplar]
    assert [e.labels["trace_id"] for e in exemplars] == [trace_id]


def test_a_request_of_several_samples_is_one_span_with_their_usage_and_counts_each_prompt_once(
        tiny_model, monkeypatch):
    with Receiver("http/protobuf") as receiver:
        use_collector(monkeypatch, receiver.endpoint)
        with LiveServer(tiny_model) as s:
            r = web.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": [[4, 5, 6], [7] * 20], "n": 2,
                                                          "max_tokens": 5, "ignore_eos": True})
            assert r.status_code == 200
            usage = r.json()["usage"]
            spans = receiver.wait_for(lambda spans: sum(sp.name == "engine.request" for sp in spans) == 4
                                      and any(sp.name.startswith("text_completion") for sp in spans))
            families = scrape(s)
    assert usage["prompt_tokens"] == 23 and usage["completion_tokens"] == 20
    gen = next(sp for sp in spans if sp.name.startswith("text_completion"))
    assert gen.attributes["gen_ai.usage.input_tokens"] == 23 and gen.attributes["gen_ai.usage.output_tokens"] == 20
    assert gen.attributes["gen_ai.response.finish_reasons"] == ["length"] * 4
    assert {sp.parent_span_id for sp in spans if sp.name == "engine.request"} == {gen.span_id}
    count = lambda name, **labels: sample_value(families, name, name + "_total", **labels)
    assert count("llm_prompt_tokens") == 23  # once per prompt, as usage counts
    assert count("llm_generation_tokens") == 20
    assert count("llm_requests", finish_reason="length") == 4  # each sample is a request of the engine
    assert count("llm_prompt_tokens_computed") + count("llm_prompt_tokens_cached") == 2 * 23


def test_preempted_requests_carry_preempted_events_and_step_links(tiny_model, monkeypatch):
    with Receiver("http/protobuf") as receiver:
        use_collector(monkeypatch, receiver.endpoint)
        # 7 usable blocks of 16 tokens cannot hold six requests of 30 + 20 tokens: some are preempted
        with LiveServer(tiny_model, {"num_blocks": 8, "max_num_seqs": 8}) as s:
            async def load():
                async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                    return await asyncio.gather(*[c.post("/v1/completions", json={
                        "model": MODEL, "prompt": [9 + i] * 30, "max_tokens": 20, "ignore_eos": True}) for i in range(6)])
            assert all(r.status_code == 200 for r in asyncio.run(load()))
            preemptions = s.engine.scheduler.num_preemptions
            spans = receiver.wait_for(lambda spans: sum(sp.name.startswith("text_completion") for sp in spans) == 6)
    assert preemptions > 0
    generations = {sp.span_id: sp for sp in spans if sp.name.startswith("text_completion")}
    # the engine's side of each request is a child span of its request span, which carries its preemptions
    engine_side = [sp for sp in spans if sp.name == "engine.request"]
    assert sorted(sp.parent_span_id for sp in engine_side) == sorted(generations)
    preempted = [sp for sp in engine_side if any(e[0] == "preempted" for e in sp.events)]
    assert sum(sum(e[0] == "preempted" for e in sp.events) for sp in preempted) == preemptions
    steps = receiver.wait_for(lambda spans: sum(sp.attributes.get("llm.step.preempted", 0)
                                                for sp in spans if sp.name == "engine.step") == preemptions)
    linked = {span_id for sp in steps if sp.name == "engine.step" and sp.attributes["llm.step.preempted"]
              for _, span_id in sp.links}
    assert {sp.span_id for sp in preempted} <= linked


def test_prompt_and_output_text_are_traced_only_when_enabled(tiny_model, default_model, monkeypatch):
    with Receiver("http/protobuf") as receiver:
        use_collector(monkeypatch, receiver.endpoint)
        with LiveServer(default_model, telemetry={"trace_text": True, "trace_engine_steps": False}) as s:
            text = web.post(s.url + "/v1/chat/completions", json={
                "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 4}).json()["choices"][0]["message"]["content"]
            spans = receiver.wait_for(lambda spans: any(sp.name.startswith("chat ") for sp in spans))
    chat = next(sp for sp in spans if sp.name.startswith("chat "))
    assert "Say hi" in chat.attributes["gen_ai.prompt"] and chat.attributes["gen_ai.completion"] == text
    assert not any(sp.name == "engine.step" for sp in spans)


@pytest.mark.parametrize("collector", ["refusing", "hanging", "erroring"])
def test_serving_goes_on_when_the_collector_is_down_or_hangs(tiny_model, monkeypatch, collector):
    with HangingCollector() as hanging, ErroringCollector() as erroring:
        endpoint = {"hanging": hanging.endpoint, "erroring": erroring.endpoint}.get(
            collector, f"http://127.0.0.1:{free_port()}")
        use_collector(monkeypatch, endpoint)
        s = LiveServer(tiny_model)
        with s:
            async def load():
                async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                    async def one(i):
                        start = time.perf_counter()
                        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [i + 1, 2], "max_tokens": 8})
                        return r.status_code, time.perf_counter() - start
                    return await asyncio.gather(*[one(i) for i in range(40)])
            results = asyncio.run(load())
        assert not s.thread.is_alive()  # and the server still shut down
    assert all(status == 200 for status, _ in results)
    if collector == "erroring":
        assert erroring.attempts > 0  # the exports really went out and really failed
    # had serving waited on an export, a request would have taken at least the export's timeout
    assert max(seconds for _, seconds in results) < EXPORT_TIMEOUT_S


def test_traced_decorator_spans_sync_async_and_generator_functions(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from service.telemetry import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    traced = tracing.traced

    @traced("child")
    def child():
        return 1

    @traced("sync", kind="s")
    def sync():
        return child() + 1

    @traced()
    async def coro():
        return child()

    @traced("gen")
    def gen():
        yield child()
        yield 2

    @traced("agen")
    async def agen():
        yield child()
        await asyncio.sleep(0)
        yield child()

    @traced("fails")
    def fails():
        raise ValueError("boom")

    assert sync() == 2 and asyncio.run(coro()) == 1 and list(gen()) == [1, 2]

    async def consume():
        return [x async for x in agen()]
    assert asyncio.run(consume()) == [1, 1]
    with pytest.raises(ValueError):
        fails()

    spans = exporter.get_finished_spans()
    by_name = Counter(sp.name for sp in spans)
    assert by_name == {"child": 5, "sync": 1, coro.__qualname__: 1, "gen": 1, "agen": 1, "fails": 1}
    name_of = {sp.context.span_id: sp.name for sp in spans}
    # each child span's parent is the span of the function that called it
    assert Counter(name_of[sp.parent.span_id] for sp in spans if sp.name == "child") == \
        {"sync": 1, coro.__qualname__: 1, "gen": 1, "agen": 2}
    named = {sp.name: sp for sp in spans}
    assert named["sync"].attributes["kind"] == "s"
    assert named["fails"].status.status_code.name == "ERROR"


# -- a real Prometheus -----------------------------------------------------------------------------------
def test_prometheus_scrapes_the_live_service_and_answers_the_dashboard_queries(tiny_model):
    with LiveServer(tiny_model, {"max_num_seqs": 8}) as s, Prometheus([s.host]) as prom:
        async def load(seconds: float):
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                async def client(i):
                    end = time.monotonic() + seconds
                    while time.monotonic() < end:
                        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [i + 1] * 20,
                                                                  "max_tokens": 30, "ignore_eos": True})
                        assert r.status_code == 200
                return await asyncio.gather(*[client(i) for i in range(4)])
        up = prom.wait_for_data('up{job="llm-service"} == 1')  # scraped once: the load's increase will show
        asyncio.run(load(5.0))
        ttft_p95 = prom.wait_for_data(
            'histogram_quantile(0.95, sum by (le) (rate(llm_time_to_first_token_seconds_bucket[30s])))')
        tokens_per_second = prom.wait_for_data('sum(rate(llm_generation_tokens_total[30s]))')
        running = prom.wait_for_data('llm_requests_running')
        kv = prom.wait_for_data('llm_kv_cache_usage_ratio')
    assert 0 < float(ttft_p95[0]["value"][1]) < 60
    assert float(tokens_per_second[0]["value"][1]) > 0
    assert running[0]["metric"]["model"] == MODEL and float(kv[0]["value"][1]) >= 0
    assert up[0]["value"][1] == "1"


# -- GPU sampling ----------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without NVIDIA GPUs")
def test_gpu_sampler_without_gpus_logs_once_and_exports_nothing(caplog):
    registry = CollectorRegistry()
    with caplog.at_level(logging.INFO, logger="service.telemetry.gpu"):
        sampler = GPUSampler(registry, interval=0.1).start()
        sampler.stop()
    assert not sampler.enabled
    assert len(caplog.records) == 1 and "GPU metrics off" in caplog.records[0].getMessage()
    assert not [f for f in registry.collect() if f.name.startswith("llm_gpu")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run on the GPU machine)")
def test_gpu_sampler_reads_every_visible_gpu():
    registry = CollectorRegistry()
    sampler = GPUSampler(registry, interval=0.2).start()
    try:
        last = str(torch.cuda.device_count() - 1)  # every GPU sampled once, however busy the machine
        wait_until(lambda: registry.get_sample_value("llm_gpu_sm_clock_hertz", {"gpu": last}) is not None, 60,
                   "a sample of every GPU")
        for i in range(torch.cuda.device_count()):
            get = lambda name: registry.get_sample_value(name, {"gpu": str(i)})
            assert get("llm_gpu_memory_total_bytes") >= torch.cuda.get_device_properties(i).total_memory
            assert 0 < get("llm_gpu_memory_used_bytes") <= get("llm_gpu_memory_total_bytes")
            assert 0 <= get("llm_gpu_utilization_ratio") <= 1
            assert get("llm_gpu_power_watts") > 0 and get("llm_gpu_temperature_celsius") > 0
            assert get("llm_gpu_sm_clock_hertz") > 1e8
    finally:
        sampler.stop()


def test_garbage_collections_are_timed_per_generation_until_shutdown():
    from service.settings import TelemetrySettings
    from service.telemetry.hub import Telemetry

    telemetry = Telemetry(TelemetrySettings(gpu_sample_interval=0), MODEL)
    count = lambda g: telemetry.metrics.local.get_sample_value("llm_gc_pause_seconds_count", {"generation": g}) or 0
    telemetry.start()
    telemetry.watch_gc()  # twice: still one callback
    try:
        assert gc.callbacks.count(telemetry._on_gc) == 1
        gc.collect(0)
        gc.collect()
        assert count("0") >= 1 and count("2") >= 1
        assert telemetry.metrics.local.get_sample_value("llm_gc_pause_seconds_sum", {"generation": "2"}) > 0
    finally:
        telemetry.shutdown()
    assert telemetry._on_gc not in gc.callbacks
    before = count("2")
    gc.collect()
    assert count("2") == before


def test_a_process_freezes_its_heap_once():
    """freeze_heap in a fresh interpreter: what is alive is frozen; a second call freezes nothing more."""
    code = ("import gc; from service.processes import freeze_heap; assert gc.get_freeze_count() == 0; "
            "freeze_heap(); n = gc.get_freeze_count(); assert n > 1000, n; keep = [[] for _ in range(5000)]; "
            "freeze_heap(); assert gc.get_freeze_count() == n; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "ok", out.stderr


def test_a_front_end_linked_in_process_leaves_the_heap_unfrozen(tiny_model):
    """Only a server's own processes freeze their heaps: one that hosts engines in turn (this one) would keep
    each one's cyclic garbage forever."""
    engine, metrics = recorded_engine(tiny_model)
    outputs = run_linked(engine, metrics, [[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert outputs[0].finished and outputs[0].num_output_tokens == 2
    assert gc.get_freeze_count() == 0
