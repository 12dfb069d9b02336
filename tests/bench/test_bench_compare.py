"""bench compare: per-metric change, the better direction of each metric, and the exit code on a regression."""

import copy
import json
import subprocess
import sys

import pytest

from service.bench.loadgen.results import compare
from service.bench.loadgen import serve
from tests.conftest import LiveServer


def test_each_metric_knows_its_better_direction():
    assert compare.direction("ttft_ms.p95") == compare.direction("errors.http_503") == -1
    assert compare.direction("requests.failed") == compare.direction("itl_ms.mean") == -1
    assert compare.direction("output_throughput") == compare.direction("goodput") == 1
    assert compare.direction("slo_attainment.ttft") == compare.direction("requests.completed") == 1
    # the generator's own numbers and the run's size inform, never fail
    for metric in ("dispatch_lag_ms.p99", "achieved_rate", "duration_s", "requests.sent", "concurrency.mean",
                   "generator.cpu_share"):
        assert compare.direction(metric) == 0


def _verdicts(base, new, threshold=0.05, only=None):
    return {r["metric"]: r["verdict"] for r in compare.compare_summaries(base, new, threshold, only)}


def test_a_change_is_a_regression_only_beyond_the_threshold_in_the_worse_direction():
    base = {"ttft_ms.p95": 100.0, "output_throughput": 200.0, "dispatch_lag_ms.p99": 1.0}
    assert _verdicts(base, {"ttft_ms.p95": 105.0, "output_throughput": 190.0, "dispatch_lag_ms.p99": 9.0}) == {
        "ttft_ms.p95": "worse", "output_throughput": "worse", "dispatch_lag_ms.p99": "ok"}
    assert _verdicts(base, {"ttft_ms.p95": 105.1, "output_throughput": 189.0, "dispatch_lag_ms.p99": 1.0}) == {
        "ttft_ms.p95": "REGRESSION", "output_throughput": "REGRESSION", "dispatch_lag_ms.p99": "ok"}
    assert _verdicts(base, {"ttft_ms.p95": 50.0, "output_throughput": 400.0, "dispatch_lag_ms.p99": 1.0}) == {
        "ttft_ms.p95": "better", "output_throughput": "better", "dispatch_lag_ms.p99": "ok"}
    # only the selected metrics can fail
    assert _verdicts(base, {"ttft_ms.p95": 200.0, "output_throughput": 100.0}, only=["output_*"])["ttft_ms.p95"] == "ok"


def test_new_errors_are_a_regression_and_missing_ones_are_zero():
    assert _verdicts({"errors.http_503": 0}, {"errors.timeout": 2}) == {"errors.http_503": "ok",
                                                                        "errors.timeout": "REGRESSION"}
    assert _verdicts({"errors.timeout": 4}, {}) == {"errors.timeout": "better"}
    assert _verdicts({"ttft_ms.p95": 10.0}, {"ttft_ms.p95": None}) == {"ttft_ms.p95": "n/a"}


def test_parse_threshold():
    assert compare.parse_threshold("5%") == compare.parse_threshold("5") == 0.05
    assert compare.parse_threshold("0.5%") == 0.005
    with pytest.raises(ValueError):
        compare.parse_threshold("-1%")


@pytest.fixture(scope="module")
def real_run(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "base.json"
    with LiveServer(tiny_model) as s:
        serve.main(["--url", s.url, "--num-requests", "12", "--request-rate", "50", "--input-len", "16",
                    "--output-len", "6", "--random-token-range", "10:500", "--slo", "ttft:1s", "--progress", "off",
                    "--server-metrics", "off", "--json", str(path)])
    return path


def _cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service", "bench", "compare", *argv], capture_output=True,
                          text=True, timeout=120)


def test_compare_exits_1_on_a_planted_regression_and_0_otherwise(real_run, tmp_path):
    base = json.loads(real_run.read_text())
    same = _cli(str(real_run), str(real_run), "--threshold", "5%")
    assert same.returncode == 0 and "no regression beyond 5.0%" in same.stdout

    slower = copy.deepcopy(base)
    slower["summary"]["ttft_ms.p95"] *= 1.10
    (tmp_path / "slower.json").write_text(json.dumps(slower))
    out = _cli(str(real_run), str(tmp_path / "slower.json"), "--threshold", "5%")
    assert out.returncode == 1 and "ttft_ms.p95 +10.0%" in out.stdout
    assert _cli(str(real_run), str(tmp_path / "slower.json"), "--threshold", "15%").returncode == 0

    with pytest.raises(SystemExit) as exc:  # fewer requests completed: throughput and completions regress
        broken = copy.deepcopy(base)
        broken["summary"]["requests.completed"] -= 3
        broken["summary"]["errors.http_503"] = 3
        (tmp_path / "broken.json").write_text(json.dumps(broken))
        compare.main([str(real_run), str(tmp_path / "broken.json")])
    assert exc.value.code == 1


def test_compare_of_sweeps_goes_point_by_point_and_notes_different_settings(real_run, tmp_path, capsys):
    run = json.loads(real_run.read_text())
    fast = copy.deepcopy(run)
    fast["settings"]["request_rate"] = 100.0
    slow_point = copy.deepcopy(fast)
    slow_point["summary"]["e2e_ms.median"] *= 2
    base = {"sweep": {"axis": "rate", "values": [50, 100]}, "runs": [run, fast]}
    new = {"sweep": {"axis": "rate", "values": [50, 100]}, "runs": [run, slow_point]}
    (tmp_path / "b.json").write_text(json.dumps(base))
    (tmp_path / "n.json").write_text(json.dumps(new))
    with pytest.raises(SystemExit) as exc:
        compare.main([str(tmp_path / "b.json"), str(tmp_path / "n.json")])
    out = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 1 and "rate = 100: e2e_ms.median +100.0%" in out and "rate = 50:" not in out
    assert "client machine load average (1 min) before -> after the run: base" in out

    other = copy.deepcopy(run)
    other["settings"]["input_len"] = 999
    (tmp_path / "o.json").write_text(json.dumps(other))
    compare.main([str(real_run), str(tmp_path / "o.json")])
    assert "differ in their settings: input_len: 16 -> 999" in " ".join(capsys.readouterr().out.split())
    assert _cli(str(real_run), str(tmp_path / "b.json")).returncode == 2  # a run against a sweep: unusable
