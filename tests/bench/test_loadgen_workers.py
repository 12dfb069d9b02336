"""The load generator's worker processes against the mock server (real uvicorn on 127.0.0.1): the merged result
is exact whatever the number of workers, a worker starved on purpose is flagged as a saturated client, and a
server that hangs up mid-stream leaves exact error records."""

import asyncio
import json

import pytest
import sqlalchemy as sa

from service.bench import slo
from service.bench.loadgen import serve
from service.bench.loadgen.mock_server import running
from service.bench.loadgen.results import crosscheck
from service.bench.loadgen.results.saturation import LAG_P99_LIMIT_S, client_saturation
from service.bench.loadgen.results.summary import summarize
from service.bench.loadgen.send.dispatch import LoadSpec
from service.bench.loadgen.send.workers import deal, run_workers
from service.bench.loadgen.send.request import CHAT
from service.bench.loadgen.workload.datasets import ListWorkload, RandomWorkload, Sample
from service.bench.store import open_store, schema
from tests.conftest import free_port
from tests.loadgen_hooks import STARVE_S, starve_worker_0



@pytest.fixture(scope="module")
def mock():
    with running(free_port(), "--itl-ms", "1") as url:
        yield url


def load(url: str, workers: int, hook=None, **spec):
    run = asyncio.run(run_workers(LoadSpec(url, "mock", **spec), RandomWorkload(8, 4, seed=3), workers, hook=hook))
    return run


def test_a_closed_loop_deals_indices_by_each_workers_share_of_the_cap():
    assert deal(3, 6) == ([2, 2, 2], [0, 0, 1, 1, 2, 2])
    assert deal(4, 5) == ([2, 1, 1, 1], [0, 0, 1, 2, 3])
    assert deal(8, 2) == ([1, 1], [0, 1])  # never a worker without a slot
    assert deal(3, None) == ([None] * 3, [0, 1, 2])


@pytest.mark.parametrize("shape", [dict(max_concurrency=6, num_requests=30),
                                   dict(request_rate=300.0, num_requests=30, seed=7)])
def test_one_worker_and_three_send_the_same_requests_each_exactly_once(mock, shape):
    one, three = load(mock, 1, **shape), load(mock, 3, **shape)
    for run in (one, three):
        assert [r.index for r in run.results] == list(range(30))
        assert all(r.ok and r.output_tokens == 4 and len(r.chunk_times) == 4 for r in run.results)
        assert all(r.scheduled <= r.ready <= r.sent < r.ended <= run.duration for r in run.results)
    # one schedule from the seed, whoever sends it
    assert [r.scheduled for r in one.results] == [r.scheduled for r in three.results]
    assert [r.prompt_tokens for r in one.results] == [r.prompt_tokens for r in three.results]
    s1, s3 = summarize(one.results, one.duration), summarize(three.results, three.duration)
    for key in ("requests.sent", "requests.completed", "requests.failed", "input_tokens", "output_tokens"):
        assert s1[key] == s3[key], key
    assert [w.sent for w in three.workers] == [10, 10, 10]
    assert {r.worker for r in three.results} == {0, 1, 2} and {r.worker for r in one.results} == {0}
    if "max_concurrency" in shape:
        assert s3["concurrency.max"] <= 6


def test_a_worker_starved_on_purpose_flags_the_client_as_saturated(mock):
    # 100 requests/s, every other one to worker 0, whose loop is blocked STARVE_S at each of its 6 sends: its last
    # request (due at 0.1 s) cannot go out before 6 * STARVE_S, on any machine
    run = load(mock, 2, hook=starve_worker_0, request_rate=100.0, constant_rate=True, num_requests=12)
    assert all(r.ok for r in run.results)
    verdict = client_saturation(run.results, run.workers)
    assert verdict["saturated"]
    assert [w["rank"] for w in verdict["workers"]] == [0, 1]
    assert max(r.sent - r.ready for r in run.results if r.worker == 0) >= 6 * STARVE_S - 0.1
    assert any(reason.startswith("worker 0 dispatch lag p99") for reason in verdict["reasons"])


def test_saturation_is_judged_from_lag_and_cpu_alone():
    from service.bench.loadgen.send.request import RequestResult
    from service.bench.loadgen.send.workers import WorkerStats
    on_time = [RequestResult(i, 0.1, 0.1, sent=0.1 + LAG_P99_LIMIT_S / 2) for i in range(100)]
    fine = client_saturation(on_time, [WorkerStats(0, 100, 0.5, 1.0)])
    assert (fine["saturated"], fine["reasons"]) == (False, [])
    assert fine["workers"] == [{"rank": 0, "sent": 100, "cpu_share": 0.5,
                                "dispatch_lag_p99_ms": pytest.approx(LAG_P99_LIMIT_S / 2 * 1e3)}]
    busy = client_saturation(on_time, [WorkerStats(0, 100, 0.95, 1.0)])
    assert busy["saturated"] and busy["reasons"] == ["worker 0 busy 95% of the run"]
    late = on_time[:98] + [RequestResult(i, 0.1, 0.1, sent=1.1) for i in (98, 99)]
    first_wave = [RequestResult(i, 0.0, 0.0, sent=1.0) for i in range(100)]  # all due at the start, slots free
    assert not client_saturation(first_wave)["saturated"]
    assert client_saturation(late)["reasons"] == [f"dispatch lag p99 1,000 ms > {LAG_P99_LIMIT_S * 1e3:g} ms"]


def test_each_sample_shapes_its_own_request_on_a_schedule_given_as_it_is(mock):
    # bench soak's mix: streamed, non-streamed, chat, a client that leaves, body fields, a client that gives up
    shapes = [Sample("a b", 3, 2), Sample("a b", 5, 2, stream=False), Sample("hi", 4, 1, endpoint=CHAT, stream=False),
              Sample("a b", 6, 2, leave_after=2), Sample("a b", 2, 2, extra={"max_tokens": 7}),
              Sample("a b", 5000, 2, timeout=0.2)]  # 5,000 tokens 1 ms apart cannot end within 0.2 s
    workload = ListWorkload(shapes, seed=5)
    schedule = (0.0, 0.0, 0.0, 0.05, 0.05, 0.1, 0.3, 0.3)
    run = asyncio.run(run_workers(LoadSpec(mock, "mock", schedule=schedule, num_requests=8), workload, 2))
    assert [r.scheduled for r in run.results] == list(schedule)
    for r in run.results:
        sample = workload.sample(r.index)
        if sample.leave_after:
            assert (r.error, r.events, len(r.chunk_times), r.e2e) == ("client_left", 2, 2, None)
        elif sample.timeout:
            assert (r.error, r.status) == ("timeout", 200)
        else:
            n = (sample.extra or {}).get("max_tokens", sample.output_len)
            assert r.ok and r.usage_reported and r.output_tokens == n, (sample, r)
            assert len(r.chunk_times) == (n if sample.stream else 1) and r.e2e >= r.ttft


def test_a_server_that_hangs_up_mid_stream_leaves_exact_error_records():
    with running(free_port(), "--drop-every", "3", "--drop-after", "2") as url:
        # one at a time, so the server's k-th request is index k - 1: indices 2, 5 and 8 are cut
        run = load(url, 1, max_concurrency=1, num_requests=9)
        counted = mock_counts(url)
    failed = [r for r in run.results if not r.ok]
    assert [r.index for r in failed] == [2, 5, 8]
    for r in failed:
        assert (r.error, r.exception, r.status, r.where) == (
            "connection_lost", "aiohttp.ClientPayloadError", 200, "after 2 events"), r.message
        assert len(r.chunk_times) == 2 and r.e2e is None
    assert all(r.output_tokens == 4 for r in run.results if r.ok)
    s = summarize(run.results, run.duration)
    assert (s["requests.sent"], s["requests.completed"], s["errors.connection_lost"]) == (9, 6, 3)
    assert (counted["llm_mock_requests_total"], counted["llm_mock_dropped_requests_total"],
            counted["llm_mock_streamed_tokens_total"]) == (9, 3, 6 * 4 + 3 * 2)


def mock_counts(url: str, route: str = "/v1/completions") -> dict[str, float]:
    """The mock server's /metrics counters for one route."""
    samples, why = crosscheck.scrape(url)
    assert samples is not None, why
    return {name: value for name, labels, value in samples if labels.get("route") == route}


def test_the_mock_servers_metrics_count_every_request_and_streamed_token_across_its_processes():
    with running(free_port(), "--workers", "2") as url:  # two server processes share the port and the counts
        assert mock_counts(url)["llm_mock_requests_total"] == 0
        run = load(url, 2, max_concurrency=4, num_requests=20)
        chat = asyncio.run(run_workers(LoadSpec(url, "mock", endpoint=CHAT, num_requests=3),
                                       ListWorkload([Sample("hi", 5, 1, stream=False)]), 1))
        completions, chats = mock_counts(url), mock_counts(url, CHAT)
        assert all(r.ok for r in run.results + chat.results)
        assert completions["llm_mock_requests_total"] == len(run.results) == 20
        assert completions["llm_mock_streamed_tokens_total"] == sum(r.output_tokens for r in run.results) == 80
        assert (chats["llm_mock_requests_total"], chats["llm_mock_streamed_tokens_total"]) == (3, 0)  # not streamed
        assert completions["llm_mock_dropped_requests_total"] == 0
        # bench serve's cross-check reads it and says why it compares nothing: the mock has no TTFT histogram
        before, _ = crosscheck.scrape(url)
        note = crosscheck.check_run(url, None, "mock", before, "", run.results)["note"]
        assert "none of the known TTFT histograms" in note


def test_bench_serve_in_worker_processes_reports_and_stores_the_generators_state(mock, tmp_path):
    out = tmp_path / "run.json"
    [doc] = serve.main(["--url", mock, "--workers", "2", "--num-requests", "8", "--max-concurrency", "4",
                        "--input-len", "8", "--output-len", "3", "--json", str(out), "--csv", str(tmp_path / "r.csv"),
                        "--progress", "off", "--server-metrics", "off"])
    saved = json.loads(out.read_text())
    generator = saved["load_generator"]
    assert [(w["rank"], w["sent"]) for w in generator["workers"]] == [(0, 4), (1, 4)]
    assert isinstance(generator["saturated"], bool) and saved["settings"]["client"]["workers"] == 2
    assert doc["summary"]["requests.completed"] == 8 and doc["summary"]["output_tokens"] == 24
    store = open_store()
    with store.begin() as conn:
        stored = conn.execute(sa.select(schema.runs.c.client_saturated).order_by(schema.runs.c.id.desc())).first()
    assert stored.client_saturated is generator["saturated"]


def test_capacity_names_the_client_not_the_server_where_the_client_fell_behind():
    from service.bench.loadgen.capacity import command as capacity, search as cs
    search = cs.Search(start=1, low=1, high=8, integer=True)
    search.record(1, True)
    search.record(2, False)
    failing = {"load": 2, "checks": [{"name": "ttft:p95<=500ms", "value": 0.9, "limit": 0.5, "low": 0.8, "high": 1.0,
                                      "higher_is_better": False}],
               "server": {"preemptions": 0, "waiting_mean": 3.0, "queue_s_mean": 0.4, "ttft_s_mean": 0.5},
               "stopped": None, "client_saturated": True, "client_reasons": ["worker 0 busy 97% of the run"]}
    result = capacity.conclude(search, [failing], [slo.parse("ttft:p95<=500ms")], "concurrency")
    assert result["limited_by"]["kind"] == "client"
    assert "worker 0 busy 97% of the run" in result["limited_by"]["explanation"]
    fed = capacity.conclude(search, [{**failing, "client_saturated": False}], [slo.parse("ttft:p95<=500ms")],
                            "concurrency")
    assert fed["limited_by"]["kind"] == "queueing"  # the server's own queue, as its metrics say
