"""Every kind of benchmark lands in the results store: bench serve (per-request latencies) and bench offline."""

import pytest

from service.bench.loadgen import serve
from service.bench.offline import offline
from service.bench.regress import cli, queries
from service.bench.store import open_store
from service.engine import EngineConfig
from tests.conftest import LiveServer


@pytest.fixture(scope="module")
def server(tiny_model):
    with LiveServer(tiny_model, {"max_num_seqs": 8}) as s:
        yield s


def test_bench_serve_stores_each_request_and_regress_can_judge_two_runs(server, tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'bench.db'}"
    argv = ["--url", server.url, "--num-requests", "8", "--input-len", "8", "--output-len", "3",
            "--random-token-range", "10:500", "--progress", "off", "--server-metrics", "off", "--db", db]
    for label in ("a", "b"):
        serve.main(argv + ["--label", label])
    store = open_store(db)
    [a], [b] = queries.resolve(store, "a"), queries.resolve(store, "b")
    assert (a["kind"], a["config_hash"], a["name"]) == ("serve", b["config_hash"], "serve-random:tiny")
    stored = queries.values(store, [a["id"]])[a["id"]]
    assert len(stored["ttft_seconds"][1]) == len(stored["e2e_seconds"][1]) == 8
    assert stored["failed_requests"] == ("count", [0.0])
    rows = cli.main(["--db", db, "--baseline", "a", "--candidate", "b", "--metrics", "*_per_second"])
    # one rate per run cannot make a verdict: no exit 1, however different the two rates are
    assert [r["verdict"] for r in rows] == ["inconclusive"] * 3
    rows = cli.main(["--db", db, "--baseline", "a", "--candidate", "b", "--metrics", "ttft_seconds",
                     "--threshold", "1000%"])  # whatever the noise: this checks what is compared
    assert [(r["n_baseline"], r["n_candidate"]) for r in rows] == [(8, 8)]


def test_bench_offline_iterations_give_the_median_run_and_store_every_run(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'bench.db'}"
    args = ["--model", "random:tiny", "--device", "cpu", "--num-requests", "3", "--input-len", "5", "--output-len",
            "4", "--peers", "none", "--num-blocks", "32", "--db", db]
    rows = offline.main(args + ["--iterations", "3", "--label", "three"])
    engine = rows[0]
    assert engine["system"] == "this engine (all at once, median of 3)" and len(engine["runs"]) == 3
    assert engine["seconds"] == sorted(engine["runs"])[1]
    assert "the median of 3 runs" in capsys.readouterr().out
    store = open_store(db)
    [run] = queries.resolve(store, "three")
    assert queries.values(store, [run["id"]])[run["id"]]["wall_seconds"] == ("s", engine["runs"])
    with pytest.raises(SystemExit):
        offline.main(args + ["--iterations", "0"])
    assert "--iterations must be at least 1" in capsys.readouterr().err


def test_bench_offline_stores_its_engine_run(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'bench.db'}"
    rows = offline.main(["--model", "random:tiny", "--device", "cpu", "--num-requests", "3", "--input-len", "5",
                         "--output-len", "4", "--peers", "none", "--num-blocks", "32", "--kv-cache-dtype", "fp8",
                         "--db", db, "--label", "x"])
    out = capsys.readouterr().out
    assert "model random:tiny, quantization none, KV cache fp8, 3 requests" in out
    assert "| output tok/s | of roofline |" in out and "roofline on this device" not in out  # no peaks for a CPU
    store = open_store(db)
    [run] = queries.resolve(store, "x")
    assert run["kind"] == "offline" and run["config"]["input_len"] == "5" and run["config"]["num_requests"] == 3
    assert run["config"]["kv_cache_dtype"] == "fp8"
    # left out when auto, so that runs stored before the option keep their configuration's hash
    assert "kv_cache_dtype" not in offline.engine_settings(EngineConfig())
    stored = queries.values(store, [run["id"]])[run["id"]]
    assert stored["wall_seconds"] == ("s", [rows[0]["seconds"]])
    assert stored["output_tokens_per_second"] == ("tok/s", [pytest.approx(12 / rows[0]["seconds"])])
