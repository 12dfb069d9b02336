"""The dashboard's history: points made from the same merged metrics /metrics serves, a bounded ring, the slowest
requests exactly, the thresholds read from the alert rules' own file, and the routes of a live server."""

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import msgspec

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter
from hypothesis import given, settings
from hypothesis import strategies as st

from service.telemetry import dashboard, gather
from service.telemetry.dashboard import History, Keeper, Slowest, quantile
from service.telemetry.metrics import GPUMetrics, Metrics
from service.telemetry.recorder import RequestRecorder
from tests import web
from tests.conftest import LiveServer, wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "random:tiny"


def test_thresholds_are_the_alert_rules_own_file():
    packaged = ROOT / "service" / "telemetry" / "thresholds.yml"
    assert os.path.realpath(packaged) == str(ROOT / "deploy" / "rules" / "llm-thresholds.yml")
    rules = [r for g in yaml.safe_load(packaged.read_text())["groups"] for r in g["rules"]]
    expected = {r["record"].removeprefix("llm:threshold:"): float(re.search(r"[0-9.]+", r["expr"]).group())
                for r in rules if r["record"].startswith("llm:threshold:")}
    found = dashboard.thresholds()
    assert {k: v for k, v in found.items() if not k.startswith("slo_objective_")} == expected
    assert found["ttft_p95_seconds"] == 1.0 and found["slo_objective_ttft"] == 0.95


def test_quantile_interpolates_as_histogram_quantile_does():
    buckets = [(0.1, 0.0), (0.2, 10.0), (0.5, 20.0), (float("inf"), 20.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.2)  # rank 10: the top of the second bucket
    assert quantile(0.25, buckets) == pytest.approx(0.15)  # rank 5: halfway through it
    assert quantile(0.99, buckets) == pytest.approx(0.2 + 0.3 * 9.8 / 10)
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 4.0)]) == 0.1  # in +Inf: the largest finite bound
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert quantile(0.5, [(0.1, 4.0), (float("inf"), 4.0)]) == pytest.approx(0.05)  # the first bucket from 0


@given(st.lists(st.integers(0, 5), min_size=2, max_size=8), st.floats(0.01, 0.99))
def test_a_quantile_lies_in_the_bucket_its_rank_falls_in(counts, q):
    bounds = [0.01 * 2 ** i for i in range(len(counts) - 1)] + [float("inf")]
    cumulative = [sum(counts[:i + 1]) for i in range(len(counts))]
    value = quantile(q, list(zip(bounds, map(float, cumulative))))
    if cumulative[-1] == 0:
        assert value is None
        return
    i = next(i for i, c in enumerate(cumulative) if c >= q * cumulative[-1])
    upper = bounds[i] if bounds[i] != float("inf") else bounds[i - 1]
    lower = bounds[i - 1] if i > 0 and bounds[i] != float("inf") else (0.0 if i == 0 else upper)
    assert lower - 1e-12 <= value <= upper + 1e-12


def history_of(steps):
    """A History fed by a real Metrics catalog: `steps` is a list of (t, callable changing the metrics)."""
    m, history = Metrics(MODEL), History()
    for t, change in steps:
        change(m)
        history.add(gather.merge({"api-0": gather.snapshot(m)}, MODEL), [], t)
    return m, history


def test_points_hold_rates_over_ten_seconds_and_percentiles_over_the_last_minute():
    def load(m, ttft, tokens, finished):
        for value in ttft:
            m.ttft_m.observe(value)
        m.generation_tokens_m.inc(tokens)
        m.received_m.inc(finished)
        m.finish_m["length"].inc(finished)
        m.running_m.set(3)
    steps = [(100.0 + i, lambda m: load(m, [0.03] * 2, 50, 2)) for i in range(20)]
    m, history = history_of(steps)
    t, last = history.points[-1]
    assert t == 119.0
    assert last["output_tokens_per_s"] == pytest.approx(50.0)  # 500 tokens over the 10 s before
    assert last["finished_per_s"] == last["arrivals_per_s"] == pytest.approx(2.0)
    assert last["running"] == 3 and last["errors_per_s"] == 0
    assert 0.025 <= last["ttft_p50"] <= 0.05 and 0.025 <= last["ttft_p99"] <= 0.05  # the bucket (0.025, 0.05]
    assert history.points[0][1].get("output_tokens_per_s") is None  # one frame: no rate yet
    assert history.totals["requests_finished"] == history.totals["requests_length"] == 40
    assert history.totals["output_tokens"] == 1000 and history.totals["requests_received"] == 40
    # a minute later with slower first tokens only, the percentiles are theirs alone
    _, later = history_of(steps + [(120.0 + i, lambda m: load(m, [0.4], 0, 0)) for i in range(70)])
    t, last = later.points[-1]
    assert 0.3 <= last["ttft_p50"] <= 0.4 and last["output_tokens_per_s"] == 0


def test_the_history_is_a_ring_of_fifteen_minutes():
    registry = CollectorRegistry()  # one counter: 2,000 gatherings of the whole catalog would take seconds
    tokens, history = Counter("llm_generation_tokens", "", registry=registry), History()
    for t in range(2000):
        tokens.inc()
        history.add(registry.collect(), [], float(t))
    assert len(history.points) == dashboard.WINDOW + 1 and history.points[0][0] == 2000 - 901
    assert len(history.frames) <= dashboard.QUANTILE_WINDOW + 2
    view = history.view(since=1995.0)
    assert view["points"]["t"] == [1996.0, 1997.0, 1998.0, 1999.0]
    assert view["points"]["output_tokens_per_s"] == [pytest.approx(1.0)] * 4


def test_per_process_and_per_gpu_series_are_named_by_process_and_gpu():
    engine, front = Metrics(MODEL), Metrics(MODEL)
    front.loop_lag.set(0.002)
    history = History()
    for t in (1.0, 2.0):
        history.add(gather.merge({"engine": gather.snapshot(engine), "api-0": gather.snapshot(front)}, MODEL), [], t)
    point = history.points[-1][1]
    assert point["loop_lag:api-0"] == 0.002 and "loop_lag:engine" not in point  # the engine has no event loop
    assert point["cpu:engine"] is not None and point["cpu:api-0"] is not None
    assert history.processes == ["api-0", "engine"] and history.gpus == []


def test_gpu_readings_are_series_per_gpu():
    registry = CollectorRegistry()
    gpus = GPUMetrics(registry)
    for index, (util, power) in enumerate([(0.93, 610.0), (0.1, 120.0)]):
        gpus.utilization.labels(str(index)).set(util)
        gpus.power.labels(str(index)).set(power)
        gpus.memory_used.labels(str(index)).set(2e9)
    history = History()
    history.add(registry.collect(), [], 1.0)
    point = history.points[-1][1]
    assert history.gpus == ["0", "1"]
    assert point["gpu_util:0"] == 0.93 and point["gpu_power_watts:1"] == 120.0
    assert point["gpu_memory_used_bytes:1"] == 2e9


def test_a_finished_request_enters_the_slowest_with_its_timings_and_trace_id():
    m = Metrics(MODEL)
    recorder = RequestRecorder(m, trace_id=lambda rid: "ab" * 16 if rid == "traced" else None)
    for rid, e2e in (("traced", 2.0), ("plain", 1.0)):
        t = SimpleNamespace(arrival=10.0, first_scheduled=10.1, first_token=10.25, finished=10.0 + e2e, submitted=10.01)
        recorder.finished(SimpleNamespace(request_id=rid, timings=t, prompt_ids=[1] * 5, token_ids=[2] * 7,
                                          operation="chat"), "length")
    slow = recorder.slowest()
    assert [e["request_id"] for e in slow] == ["traced", "plain"] and slow[0]["trace_id"] == "ab" * 16
    assert slow[1]["trace_id"] is None
    assert slow[0]["queue"] == pytest.approx(0.1) and slow[0]["ttft"] == pytest.approx(0.25)
    assert slow[0]["e2e"] == pytest.approx(2.0) and (slow[0]["prompt_tokens"], slow[0]["output_tokens"]) == (5, 7)
    assert msgspec.msgpack.decode(gather.snapshot(m, slow))[2] == slow  # as the history gathers it


entries = st.lists(st.tuples(st.floats(0, 3000), st.floats(0, 100)), max_size=200)


@settings(max_examples=60)
@given(entries, st.floats(0, 3000))
def test_the_slowest_are_exactly_those_of_the_last_fifteen_whole_minutes(items, now):
    now = max([now, *(finished for finished, _ in items)])  # asked after they finished, as the history asks
    slowest = Slowest()
    for finished, e2e in sorted(items):  # requests finish in time order
        slowest.add({"finished": finished, "e2e": e2e})
    since = (now - dashboard.WINDOW) // 60 * 60
    expected = sorted((e2e for finished, e2e in items if since <= finished), reverse=True)[:dashboard.SLOWEST]
    assert [e["e2e"] for e in slowest.top(now)] == expected


def test_keeper_answers_points_after_since_as_json_without_nan():
    clock = iter(float(t) for t in range(1000, 1010))
    m = Metrics(MODEL)
    keeper = Keeper(lambda: {"api-0": gather.snapshot(m)}, MODEL, "http://viewer/{trace_id}",
                    clock=lambda: next(clock))
    for _ in range(3):
        m.generation_tokens_m.inc(7)
        keeper.sample()
    body = json.loads(keeper.view(None, "up"))
    assert body["points"]["t"] == [1000.0, 1001.0, 1002.0] and body["status"] == "up"
    assert body["points"]["output_tokens_per_s"] == [None, 7.0, 7.0]
    assert body["totals"]["output_tokens"] == 21 and body["trace_url"] == "http://viewer/{trace_id}"
    assert body["thresholds"] == dashboard.thresholds()
    assert json.loads(keeper.view(1001.0, "engine down"))["points"]["t"] == [1002.0]


# -- on a live server (the engine on a thread of the one process, which keeps the history) ---------------
def test_the_page_its_files_and_its_data_behind_the_metrics_token(tiny_model):
    with LiveServer(tiny_model, metrics_token="scrape") as s:
        page = web.get(s.url + "/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        scripts = re.findall(r'src="(/dashboard/static/[^"]+)"', page.text)
        assert scripts and all(web.get(s.url + src).status_code == 200 for src in scripts)
        assert web.get(s.url + "/dashboard/static/vendor/LICENSE").status_code == 200
        denied = web.get(s.url + "/dashboard/data")
        assert denied.status_code == 401 and "/dashboard/data" in denied.json()["error"]["message"]
        auth = {"Authorization": "Bearer scrape"}
        for _ in range(3):
            assert web.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 3,
                                                             "ignore_eos": True}).status_code == 200
        assert s.wait_idle()
        body = wait_until(lambda: (b := web.get(s.url + "/dashboard/data", headers=auth).json())["totals"]
                          ["requests_finished"] == 3 and b, 30, "the history to see the requests")
        assert body["status"] == "up" and body["processes"] == ["api-0"] and len(body["slowest"]) == 3
        assert {e["output_tokens"] for e in body["slowest"]} == {3}
        assert body["totals"]["output_tokens"] == 9 and body["totals"]["requests_received"] == 3
        assert web.get(s.url + "/dashboard/data?since=x", headers=auth).status_code == 400


def test_no_dashboard_serves_no_page(tiny_model):
    with LiveServer(tiny_model, telemetry={"dashboard": False}) as s:
        assert web.get(s.url + "/dashboard").status_code == 404
        assert web.get(s.url + "/dashboard/data").status_code == 404
        assert s.app.state.server.telemetry.keeper is None
