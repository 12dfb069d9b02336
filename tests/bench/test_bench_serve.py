"""bench serve against real uvicorn servers on loopback: counts, concurrency, bounds, overload, outputs."""

import asyncio
import csv
import json

import pytest

from service.bench.loadgen.workload import datasets
from service.bench.loadgen import serve
from service.bench.loadgen.send.request import CHAT
from service.bench.loadgen.send.dispatch import LoadSpec, run_load
from service.bench.loadgen.results.summary import max_in_flight, summarize
from tests.conftest import LiveServer

TINY = "random:tiny"  # vocabulary of 512 ids, no tokenizer: prompts are token ids, streamed text is empty


@pytest.fixture(scope="module")
def server(tiny_model):
    with LiveServer(tiny_model, {"max_num_seqs": 32}) as s:
        yield s


def load(server_url: str, workload, **spec) -> list:
    run = asyncio.run(run_load(LoadSpec(server_url, spec.pop("model", TINY), **spec), workload.sample))
    return sorted(run.results, key=lambda r: r.index), run.duration


def tiny_prompts(input_len=16, output_len=8, range_ratio=0.0, seed=0):
    return datasets.RandomWorkload(input_len, output_len, range_ratio, seed, id_range=(10, 500))


def test_rate_run_completes_every_request_with_exact_token_counts(server):
    results, duration = load(server.url, tiny_prompts(), request_rate=40.0, num_requests=24, seed=1,
                             ignore_eos=True)
    assert [r.index for r in results] == list(range(24))
    assert all(r.ok and r.status == 200 for r in results), [r.message for r in results if not r.ok]
    assert all(r.usage_reported and r.prompt_tokens == 16 and r.output_tokens == 8 for r in results)
    # this server streams a token per chunk, merging the tokens a lagging stream has not yet taken into one
    # (on a busy machine its event loop may run behind the engine): 1 to 8 chunk times, one gap fewer
    assert all(1 <= len(r.chunk_times) <= 8 and len(r.itl) == len(r.chunk_times) - 1 and 0 < r.ttft <= r.e2e
               for r in results)
    assert all(r.scheduled <= r.ready <= r.sent < r.ended <= duration for r in results), \
        [(r.scheduled, r.ready, r.sent, r.ended, duration) for r in results]
    s = summarize(results, duration)
    assert s["requests.completed"] == 24 and s["output_tokens"] == 24 * 8 and s["input_tokens"] == 24 * 16
    assert server.wait_idle()


def test_closed_loop_never_exceeds_the_concurrency_cap(server):
    results, _ = load(server.url, tiny_prompts(output_len=16), max_concurrency=3, num_requests=15, ignore_eos=True)
    assert all(r.ok for r in results) and len(results) == 15
    assert max_in_flight(results) == 3  # all due at once: the cap is reached and held
    assert all(r.scheduled == 0 for r in results)
    # a waiting request becomes ready when a slot frees, so waiting for a slot is not dispatch lag
    assert sum(r.ready > 0 for r in results) >= 12 and all(r.ready <= r.sent for r in results)


def test_rate_and_cap_together(server):
    results, _ = load(server.url, tiny_prompts(), request_rate=200.0, max_concurrency=2, num_requests=12,
                      ignore_eos=True)
    assert all(r.ok for r in results) and max_in_flight(results) <= 2
    assert all(r.ready >= r.scheduled for r in results)


def test_duration_bounds_open_and_closed_loops(server):
    results, _ = load(server.url, tiny_prompts(), request_rate=30.0, duration=0.6, ignore_eos=True)
    assert results and all(r.ok for r in results)
    assert all(r.scheduled < 0.6 and r.ready < 0.6 for r in results)
    # a third request needs one of the first two to end within the duration: 2 s, not 0.4, on a busy machine
    closed, _ = load(server.url, tiny_prompts(output_len=2), max_concurrency=2, duration=2.0, ignore_eos=True)
    assert len(closed) > 2 and all(r.ready < 2.0 for r in closed) and max_in_flight(closed) <= 2
    both, _ = load(server.url, tiny_prompts(), request_rate=1000.0, duration=5.0, num_requests=5, ignore_eos=True)
    assert len(both) == 5  # the count ends it first


def test_an_overloaded_server_gives_503s_that_are_counted_not_crashed_on(tiny_model):
    with LiveServer(tiny_model, {"max_num_seqs": 1}, max_waiting=1) as s:
        # long replies, so that the requests overlap even when a busy process sends them slowly
        results, duration = load(s.url, tiny_prompts(output_len=256), num_requests=12, ignore_eos=True)
        summary = summarize(results, duration)
        assert s.wait_idle()
    failed = [r for r in results if not r.ok]
    assert failed and all(r.error == "http_503" and r.status == 503 for r in failed)
    assert all("too many requests waiting" in r.message for r in failed)
    assert summary["requests.completed"] >= 1
    assert summary["requests.completed"] + summary["errors.http_503"] == 12
    assert all(r.output_tokens == 256 for r in results if r.ok)


def test_a_wrong_model_name_is_an_error_kind_with_the_servers_message(server):
    results, _ = load(server.url, tiny_prompts(), num_requests=2, model="gpt-5")
    assert [r.error for r in results] == ["http_404", "http_404"] and "does not exist" in results[0].message


def test_text_prompts_on_both_endpoints_of_the_default_model(default_model):
    """Chat's first chunk carries only the role: it must not count as the first token."""
    with LiveServer(default_model, {"max_num_seqs": 8}) as s:
        model = "SmolLM2-135M-Instruct"
        chat, _ = load(s.url, datasets.builtin(output_len=6), model=model, endpoint=CHAT, num_requests=4,
                       max_concurrency=2)
        words, _ = load(s.url, datasets.RandomWorkload(20, 6, prompt_kind="words"), model=model, num_requests=3,
                        ignore_eos=True)
        assert s.wait_idle()
    assert all(r.ok and 1 <= r.output_tokens <= 6 for r in chat), [r.message for r in chat]
    assert all(1 <= len(r.chunk_times) <= r.output_tokens for r in chat)
    assert all(r.ok and r.output_tokens == 6 and r.prompt_tokens >= 15 for r in words)


def test_cli_writes_json_csv_and_a_sweep_with_plots(server, tmp_path):
    out = tmp_path / "sweep.json"
    docs = serve.main(["--url", server.url, "--num-requests", "10", "--input-len", "16", "--output-len", "4",
                       "--random-token-range", "10:500", "--sweep", "rate:20,80", "--slo", "ttft:2s",
                       "--json", str(out), "--csv", str(tmp_path / "r.csv"),
                       "--plot-dir", str(tmp_path / "plots"), "--progress", "off", "--server-metrics", "off"])
    assert [d["settings"]["request_rate"] for d in docs] == [20.0, 80.0]
    assert [d["settings"]["seed"] for d in docs] == [0, 1]  # new prompts per point: no prefix-cache hits
    saved = json.loads(out.read_text())
    assert saved["sweep"] == {"axis": "rate", "values": [20.0, 80.0]} and len(saved["runs"]) == 2
    run = saved["runs"][0]
    assert run["settings"]["model"] == TINY  # discovered from /v1/models
    assert run["settings"]["seed"] == 0 and run["settings"]["ignore_eos"] is True
    assert set(run["settings"]["client"]["load_average_1m"]) == {"before", "after"}
    assert run["summary"]["requests.completed"] == 10 and run["summary"]["output_tokens"] == 40
    assert run["summary"]["goodput"] > 0 and "ttft_ms.p99" in run["summary"]
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert len(rows) == 20 and {r["point"] for r in rows} == {"20.0", "80.0"}
    assert all(r["output_tokens"] == "4" and len(r["itl_ms"].split()) <= 3 for r in rows)  # lagging chunks merge
    serve.main(["--replot", str(out), "--plot-dir", str(tmp_path / "again")])  # from the saved result alone
    for folder in ("plots", "again"):
        for name in ("latency.png", "goodput.png"):
            assert (tmp_path / folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_an_unbounded_or_impossible_run(server, capsys):
    for argv in (["--duration", "5"], ["--endpoint", CHAT, "--random-prompt", "ids"], ["--slo", "ttft:soon"], ["--slo", "ttft:p95<=500ms"],
                 ["--sweep", "speed:1,2"], ["--sweep", "rate:1,inf"], ["--sweep", "concurrency:1.5"]):
        with pytest.raises(SystemExit) as exc:
            serve.main(["--url", server.url, "--progress", "off"] + argv)
        assert exc.value.code == 2, argv


def test_progress_bar_by_requests_and_by_time_does_not_get_in_the_way(server):
    by_count = serve.main(["--url", server.url, "--num-requests", "4", "--input-len", "8", "--output-len", "2",
                           "--random-token-range", "10:500"])
    by_time = serve.main(["--url", server.url, "--duration", "0.5", "--request-rate", "20", "--input-len", "8",
                          "--output-len", "2", "--random-token-range", "10:500"])
    assert by_count[0]["summary"]["requests.completed"] == 4
    assert by_time[0]["summary"]["requests.completed"] == by_time[0]["summary"]["requests.sent"] > 0
