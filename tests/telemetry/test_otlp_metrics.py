"""Metrics pushed over OTLP (--otlp-metrics) to a real receiver (tests/otlp.py, the OpenTelemetry proto packages):
the GenAI server instruments from every process, in exact agreement with the Prometheus scrape, and serving that a
down, hanging or failing collector never touches."""

import asyncio
import contextlib
import logging
import time

import httpx
import pytest
import torch
from prometheus_client import CollectorRegistry

from service.settings import parse
from service.telemetry import otlp
from service.telemetry.gpu import GPUSampler
from service.telemetry.metrics import GENAI_DURATION_BUCKETS, GENAI_TPOT_BUCKETS, GENAI_TTFT_BUCKETS, OTLPMetrics
from tests import web
from tests.conftest import LiveServer, free_port, wait_until
from tests.otlp import ErroringCollector, HangingCollector, Receiver, latest
from tests.served import Served, sample

MODEL = "random:tiny"
TTFT, TPOT, DURATION = ("gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token",
                        "gen_ai.server.request.duration")
TOKENS, STEP = "llm.server.token.usage", "llm.engine.step.duration"
CUMULATIVE, DELTA = 2, 1  # AggregationTemporality in the OTLP protocol


def total(points: dict, name: str, field: str = "count", **attributes) -> float:
    """`field` of the named metric's points (the latest of each series), summed over processes and attributes."""
    return sum(getattr(p, field) for p in points.values()
               if p.name == name and all(p.attributes.get(k) == v for k, v in attributes.items()))


def by_process(points: dict, name: str, field: str = "count") -> dict[str, float]:
    out: dict[str, float] = {}
    for p in points.values():
        if p.name == name:
            out[p.resource["llm.process"]] = out.get(p.resource["llm.process"], 0) + getattr(p, field)
    return out


def post_all(url: str, bodies: list[tuple[str, dict]]) -> list[httpx.Response]:
    """Every request at once, each on its own connection (so that the kernel spreads them over the front ends)."""
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=len(bodies))) as c:
            return await asyncio.gather(*[c.post(path, json=body) for path, body in bodies])
    return asyncio.run(main())


def completions(n: int, max_tokens: int) -> list[tuple[str, dict]]:
    return [("/v1/completions", {"model": MODEL, "prompt": [i + 1, 2, 3], "max_tokens": max_tokens,
                                 "ignore_eos": True}) for i in range(n)]


def generates(n: int, max_tokens: int) -> list[tuple[str, dict]]:
    return [("/generate", {"token_ids": [i + 7, 8], "max_tokens": max_tokens, "ignore_eos": True}) for i in range(n)]


def test_every_process_pushes_genai_metrics_whose_counts_and_sums_equal_the_scrape(monkeypatch):
    # the flag wins over the standard variable, which points at nothing
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"http://127.0.0.1:{free_port()}/v1/metrics")
    with Receiver("http/protobuf") as receiver:
        with Served("--api-servers", "2", "--otlp-metrics", "--otlp-metrics-interval", "0.2",
                    "--otlp-metrics-endpoint", receiver.endpoint + "/v1/metrics") as s:
            sent = 0
            while sent < 96:  # until both front ends have served some (the kernel picks who accepts)
                answers = post_all(s.url, completions(8, 5) + generates(4, 5))
                assert all(r.status_code == 200 for r in answers)
                sent += len(answers)
                served = receiver.wait_for_metrics(lambda pts: sum(by_process(pts, DURATION).values()) == sent)
                if len(by_process(served, DURATION)) == 2:
                    break

            def agree():
                text = s.metrics()
                points = latest(receiver.points)
                steps = sample(text, "llm_engine_step_seconds_count")
                if sample(text, "llm_requests_total") == sent and total(points, STEP) == steps > 0:
                    return text, points
            text, points = wait_until(agree, 60, "the pushed step count to reach the scraped one")

    # every process pushed, each once: its own service.instance.id
    resources = {p.resource["service.instance.id"]: p.resource for p in points.values()}
    assert sorted(r["llm.process"] for r in resources.values()) == ["api-0", "api-1", "engine"]
    assert all(r["service.name"] == "llm-service" and r["llm.model"] == MODEL and r["llm.quantization"] == "none"
               and r["llm.tensor_parallel_size"] == 1 and r["service.version"] for r in resources.values())
    assert set(by_process(points, DURATION)) == {"api-0", "api-1"} and set(by_process(points, STEP)) == {"engine"}
    # one recording point: counts and sums equal the scrape's twins exactly
    assert total(points, DURATION) == sample(text, "llm_request_duration_seconds_count") == sent
    assert total(points, DURATION, "sum") == sample(text, "llm_request_duration_seconds_sum")
    assert total(points, TTFT) == sample(text, "llm_time_to_first_token_seconds_count") == sent
    assert total(points, TTFT, "sum") == sample(text, "llm_time_to_first_token_seconds_sum")
    assert total(points, STEP, "sum") == sample(text, "llm_engine_step_seconds_sum")
    assert total(points, TOKENS, "value", **{"gen_ai.token.type": "input"}) == sample(text, "llm_prompt_tokens_total")
    assert total(points, TOKENS, "value", **{"gen_ai.token.type": "output"}) == \
        sample(text, "llm_generation_tokens_total") == sent * 5
    # time per output token: one per response, its decode time over the 4 tokens after the first
    assert total(points, TPOT) == sent
    assert total(points, TPOT, "sum") == pytest.approx(sample(text, "llm_request_decode_seconds_sum") / 4)
    # as the conventions define them: attributes, cumulative histograms with the advised buckets
    operations = {p.attributes["gen_ai.operation.name"]: p.count for p in points.values() if p.name == DURATION}
    assert set(operations) == {"text_completion", "generate"}
    buckets = {TTFT: GENAI_TTFT_BUCKETS, TPOT: GENAI_TPOT_BUCKETS, DURATION: GENAI_DURATION_BUCKETS}
    for p in (p for p in points.values() if p.name in buckets):
        assert p.attributes["gen_ai.provider.name"] == "llm-service" and p.attributes["gen_ai.request.model"] == MODEL
        assert p.temporality == CUMULATIVE and p.unit == "s" and p.bounds == buckets[p.name]
        assert p.attributes.get("gen_ai.response.finish_reasons", ["length"]) == ["length"]
    # the engine's state at rest
    gauges = {p.name: p.value for p in points.values() if p.resource["llm.process"] == "engine" and p.kind == "gauge"}
    assert gauges == {"llm.engine.requests.running": 0, "llm.engine.requests.waiting": 0,
                      "llm.engine.kv_cache.usage": 0}


def test_the_standard_variables_configure_grpc_delta_headers_and_resource(tiny_model, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    with Receiver("grpc") as receiver:
        variables = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": receiver.endpoint,
                     "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc", "OTEL_METRIC_EXPORT_INTERVAL": "200",
                     "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "delta",
                     "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "x-api-key=secret", "OTEL_SERVICE_NAME": "my-llm",
                     "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,service.instance.id=pod-7"}
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        with LiveServer(tiny_model, telemetry={"otlp_metrics": True}) as s:
            answers = post_all(s.url, completions(3, 4))
            assert all(r.status_code == 200 for r in answers)
            # delta: each export carries what happened since the last one, so the points add up to the requests
            wait_until(lambda: sum(p.count for p in receiver.points if p.name == DURATION) == 3, 60,
                       "three requests' durations")
    durations = [p for p in receiver.points if p.name == DURATION]
    assert all(p.temporality == DELTA for p in durations)
    assert receiver.headers["x-api-key"] == "secret"
    resource = durations[0].resource
    assert resource["service.name"] == "my-llm" and resource["deployment.environment"] == "test"
    assert resource["service.instance.id"] == "pod-7/api-0" and resource["llm.process"] == "api-0"
    # one process plays both parts here: it pushes the engine's state too
    assert {p.name for p in receiver.points} >= {TTFT, TPOT, DURATION, TOKENS, STEP, "llm.engine.kv_cache.usage"}


def scrape(s: LiveServer) -> str:
    return web.get(s.url + "/metrics", timeout=30).text


def test_an_outage_is_logged_once_and_cumulative_totals_survive_it(tiny_model, caplog):
    receiver = Receiver("http/protobuf")  # its port is chosen, nothing listens yet: the collector is down
    telemetry = {"otlp_metrics": True, "otlp_metrics_endpoint": receiver.endpoint + "/v1/metrics",
                 "otlp_metrics_interval": 0.2, "otlp_metrics_timeout": 1.0}
    caplog.set_level(logging.INFO, logger="service.telemetry.otlp")
    with contextlib.ExitStack() as up:  # the collector, once up, stays up until the server has stopped
        with LiveServer(tiny_model, telemetry=telemetry) as s:
            assert all(r.status_code == 200 for r in post_all(s.url, completions(6, 3)))
            wait_until(lambda: sample(scrape(s), "llm_otlp_metric_export_failures_total", process="api-0") >= 3,
                       60, "three failed exports")
            up.enter_context(receiver)  # the next export carries every total since the start
            points = receiver.wait_for_metrics(lambda pts: total(pts, DURATION) == 6)
            wait_until(lambda: any("work again" in r.getMessage() for r in caplog.records), 30, "the recovery line")
            text = scrape(s)
    assert total(points, DURATION, "sum") == sample(text, "llm_request_duration_seconds_sum")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "service.telemetry.otlp"]
    assert len(warnings) == 1 and "export to" in warnings[0].getMessage()
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]
    assert sample(text, "llm_otlp_metric_points_dropped_total", process="api-0") > 0


@pytest.mark.parametrize("collector", ["refusing", "hanging", "erroring"])
def test_serving_goes_on_when_the_metrics_collector_is_down_hangs_or_fails(tiny_model, collector, caplog):
    with HangingCollector() as hanging, ErroringCollector() as erroring:
        endpoint = {"hanging": hanging.endpoint, "erroring": erroring.endpoint}.get(
            collector, f"http://127.0.0.1:{free_port()}")
        telemetry = {"otlp_metrics": True, "otlp_metrics_endpoint": endpoint + "/v1/metrics",
                     "otlp_metrics_interval": 0.2, "otlp_metrics_timeout": 1.0}
        s = LiveServer(tiny_model, telemetry=telemetry)
        with s:
            answers = post_all(s.url, completions(40, 8))
            wait_until(lambda: sample(scrape(s), "llm_otlp_metric_export_failures_total") >= 2, 60,
                       "two failed exports")
            started = time.monotonic()
        stopped_in = time.monotonic() - started
        assert not s.thread.is_alive()  # and the server still shut down, its last export bounded
    assert all(r.status_code == 200 for r in answers)
    assert stopped_in < otlp.SHUTDOWN_TIMEOUT_MS / 1000 + 10
    if collector == "erroring":
        assert erroring.attempts > 0  # the exports really went out and really failed
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "OTLP" in r.getMessage()]
    assert len(warnings) == 1


def test_an_unknown_protocol_or_temporality_is_refused_at_start():
    for flag, value in (("--otlp-metrics-protocol", "http/json"), ("--otlp-metrics-temporality", "sometimes")):
        with pytest.raises(SystemExit) as exit_:
            parse([flag, value])
        assert exit_.value.code == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run on the GPU machine)")
def test_gpu_readings_are_pushed_under_the_hw_names_with_the_scraped_values():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    registry, reader = CollectorRegistry(), InMemoryMetricReader()
    sampler = GPUSampler(registry, interval=3600)  # one reading, taken as it starts
    try:
        instruments = OTLPMetrics(MeterProvider([reader]).get_meter("test"), MODEL)
        instruments.observe_gpus(lambda: sampler.last)
        pushed = {(m.name, dp.attributes["hw.id"]): dp.value for rm in reader.get_metrics_data().resource_metrics
                  for sm in rm.scope_metrics for m in sm.metrics for dp in m.data.data_points}
        assert sampler.gpus
        for index, _ in sampler.gpus:
            scraped = lambda name: registry.get_sample_value(name, {"gpu": index})
            assert pushed[("hw.gpu.utilization", index)] == scraped("llm_gpu_utilization_ratio")
            assert pushed[("hw.gpu.memory.usage", index)] == scraped("llm_gpu_memory_used_bytes") > 0
            assert pushed[("hw.gpu.memory.limit", index)] == scraped("llm_gpu_memory_total_bytes") > 0
            if scraped("llm_gpu_power_watts") is not None:  # some boards do not report power
                assert pushed[("hw.power", index)] == scraped("llm_gpu_power_watts")
    finally:
        sampler.stop()
