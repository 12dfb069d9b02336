"""bench regress: verdicts with known answers (one run each side, and repeated runs whose spread is the noise between
runs), step detection, and the commands over a real store (each store test on SQLite and on PostgreSQL)."""

import json

import numpy as np
import pytest

from service.bench.machine_speed import METRIC as MACHINE
from service.bench.regress import cli, export, history
from service.bench.regress.directions import direction
from service.bench.bootstrap import median_ratio_ci
from service.bench.regress.verdicts import find_steps, judge, judge_runs
from service.bench.store import open_store, schema
from tests.bench.test_bench_store import rows

LOWER, HIGHER = -1, 1


def test_a_ten_percent_slowdown_is_called_regressed():
    rng = np.random.default_rng(10)
    for _ in range(20):
        v = judge(rng.normal(1.0, 0.03, 10), rng.normal(1.10, 0.03, 10), LOWER)
        assert v.verdict == "regressed" and 1.05 < v.ratio < 1.15 and v.low > 1


def test_a_ten_percent_throughput_gain_is_called_improved():
    rng = np.random.default_rng(11)
    assert judge(rng.normal(100, 2, 10), rng.normal(110, 2, 10), HIGHER).verdict == "improved"


def test_pure_noise_gives_no_more_false_alarms_than_expected():
    # 200 seeded pairs from one distribution, judged with no practical threshold: only the 95% interval guards.
    # One-sided, 2.5% of pairs (5) are expected to look worse by chance; 11 or more has probability < 1%.
    pairs = [np.random.default_rng(1000 + k).normal(1, 0.05, (2, 10)) for k in range(200)]
    alarms = [judge(b, c, LOWER, threshold=0.0).verdict == "regressed" for b, c in pairs]
    assert sum(alarms) <= 10
    # the default 5% threshold on top only removes alarms
    with_threshold = [judge(b, c, LOWER).verdict == "regressed" for b, c in pairs]
    assert all(a or not t for a, t in zip(alarms, with_threshold)) and sum(with_threshold) <= sum(alarms)


def test_too_few_iterations_are_inconclusive_never_regressed():
    rng = np.random.default_rng(3)
    v = judge(rng.normal(1.0, 0.01, 4), rng.normal(2.0, 0.01, 4), LOWER)
    assert (v.verdict, v.why) == ("inconclusive", "too few iterations (4 and 4; 5 needed)")


def test_same_distribution_with_little_noise_is_unchanged():
    rng = np.random.default_rng(4)
    assert judge(rng.normal(1, 0.01, 10), rng.normal(1, 0.01, 10), LOWER).verdict == "unchanged"


def test_a_wide_interval_is_inconclusive():
    rng = np.random.default_rng(5)
    v = judge(rng.normal(1, 0.3, 6), rng.normal(1, 0.3, 6), LOWER)
    assert v.verdict == "inconclusive" and v.why.startswith("too noisy")


def runs_at(levels, rng, cv=0.002, iterations=10) -> list[np.ndarray]:
    """One run per level: its iterations scatter around the level by `cv` (the noise inside a run)."""
    return [level * rng.normal(1, cv, iterations) for level in levels]


def test_a_difference_inside_the_between_run_noise_is_unchanged_though_outside_the_within_run_interval():
    rng = np.random.default_rng(20)
    # runs scatter by about 2% from run to run, iterations by 0.2% inside a run; the newest candidate run is 6% slow
    base = runs_at([1.00, 1.02, 0.98, 1.01, 0.99, 1.00], rng)
    cand = runs_at([1.00, 0.99, 1.02, 0.98, 1.01, 1.06], rng)
    ratio, low, high = median_ratio_ci(base[-1], cand[-1])
    assert low > 1.05  # the within-run interval of the newest pair excludes no change, by more than the threshold
    assert judge(base[-1], cand[-1], LOWER).verdict == "regressed"  # so one run against one cries wolf
    v = judge_runs(base, cand, LOWER)
    assert v.verdict == "unchanged" and v.low < 1 < v.high and (v.runs_baseline, v.runs_candidate) == (6, 6)
    assert v.why.startswith("within 5%; runs 6 and 6, noise ") and v.why.endswith("(between runs)")
    assert 0.015 < v.noise < 0.03  # the run-to-run spread, ten times the noise inside a run


def test_a_clear_regression_over_repeated_runs_is_called_regressed():
    rng = np.random.default_rng(21)
    for _ in range(20):
        base, cand = runs_at(rng.normal(1, 0.03, 3), rng), runs_at(rng.normal(1.5, 0.045, 3), rng)
        v = judge_runs(base, cand, LOWER)
        assert v.verdict == "regressed" and v.low > 1.3, v


def test_a_smaller_consistent_slowdown_is_never_called_unchanged():
    rng = np.random.default_rng(22)
    verdicts = []
    for _ in range(200):  # 8% slower, runs scattering by 2%: three runs a side cannot always tell, never clear it
        base, cand = runs_at(rng.normal(1, 0.02, 3), rng), runs_at(rng.normal(1.08, 0.0216, 3), rng)
        verdicts.append(judge_runs(base, cand, LOWER).verdict)
    assert (verdicts.count("regressed"), verdicts.count("inconclusive")) == (181, 19)


def test_unchanged_reruns_with_more_noise_between_runs_than_inside_are_not_called_regressed():
    rng = np.random.default_rng(23)
    verdicts = [judge_runs(runs_at(rng.normal(1, 0.02, 3), rng), runs_at(rng.normal(1, 0.02, 3), rng), LOWER).verdict
                for _ in range(200)]
    assert (verdicts.count("unchanged"), verdicts.count("inconclusive")) == (97, 103)  # no regressed, no improved
    # one run against one, the within-run bootstrap calls 7 in 200 of such reruns regressed
    pairs = [(runs_at([rng.normal(1, 0.02)], rng)[0], runs_at([rng.normal(1, 0.02)], rng)[0]) for _ in range(200)]
    assert sum(judge(b, c, LOWER).verdict == "regressed" for b, c in pairs) == 7


def test_a_step_is_named_at_its_commit_and_one_noisy_run_is_not():
    assert find_steps([1, 1, 1.5, 1, 1, 1.2, 1.2, 1.2]) == [(5, pytest.approx(0.2))]
    assert find_steps([1, 1, 1, 1, 1.5, 1, 1, 1]) == []
    assert find_steps([1, 1, 1, 1, 1, 1, 1, 1.3]) == []  # one run at a new level is not yet a step


def test_metric_directions_come_from_their_units():
    assert [direction(m) for m in ("output_tokens_per_second", "wall_seconds", "peak_memory_bytes", "steps",
                                   "ttft_ms.p95", "output_throughput", "concurrency.max",
                                   "capacity_concurrent_requests", "max_abs_error", "predicted_memory_bytes",
                                   MACHINE)
            ] == [1, -1, -1, 0, -1, 1, 0, 1, -1, 0, 0]


def record(url, label, scale, commit="c0ffee00", iterations=10, seed=0, config=None, runs=1, machine=None):
    """`runs` runs of one configuration (as bench run --repeats stores them); the id of the last. `machine`: how
    slow the machine was during each run (times scale with it), recorded as bench run on CPU does."""
    rng = np.random.default_rng(seed)
    store = open_store(url, {"commit": commit})
    for k in range(runs):
        with store.run(kind="run", config=config or {"batch_size": 4}, label=label, name="b4") as run:
            for i in range(iterations):
                slow = scale if machine is None else scale * machine[k] * rng.normal(1, 0.01)
                run.measure("wall_seconds", rng.normal(1.0, 0.01) * slow, unit="s", iteration=i)
                run.measure("output_tokens_per_second", rng.normal(100, 1) / slow, unit="tok/s", iteration=i)
                run.measure("steps", 7, iteration=i)
                if machine is not None:
                    run.measure(MACHINE, 0.012 * machine[k] * rng.normal(1, 0.01), unit="s", iteration=i)
    return run.id


def regress(url, *argv):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--db", url, *argv])
        raise SystemExit(0)
    return exited.value.code


def test_regress_exits_1_on_a_slower_candidate_and_0_on_an_unchanged_one(store_url, capsys):
    record(store_url, "base", 1.0, seed=1, runs=3)
    record(store_url, "slow", 1.10, seed=2, runs=3)
    record(store_url, "same", 1.0, seed=3, runs=3)
    assert regress(store_url, "--baseline", "base", "--candidate", "slow") == 1
    out = capsys.readouterr().out
    assert out.count("regressed") >= 2 and "2 regressed" in out and "steps" not in out
    assert regress(store_url, "--baseline", "base", "--candidate", "same") == 0
    assert "2 unchanged" in capsys.readouterr().out
    saved = rows(store_url, schema.verdicts)  # every call is kept for the dashboard
    assert [(v["candidate_ref"], v["metric"], v["verdict"]) for v in saved] == [
        ("slow", "output_tokens_per_second", "regressed"), ("slow", "wall_seconds", "regressed"),
        ("same", "output_tokens_per_second", "unchanged"), ("same", "wall_seconds", "unchanged")]


def test_a_baseline_measured_while_the_machine_ran_slow_is_judged_per_unit_of_the_machines_speed(store_url, capsys):
    # the baseline's three runs all came at a moment when the machine ran 30% slow: between-run noise measured at
    # that one moment cannot see it; the machine's reference, timed beside every iteration, can
    record(store_url, "base", 1.0, seed=1, runs=3, machine=[1.30, 1.28, 1.32])
    record(store_url, "same", 1.0, seed=2, runs=3, machine=[0.80, 0.78, 0.82])  # unchanged code, a fast moment
    record(store_url, "double", 1.5, seed=3, runs=3, machine=[0.70, 0.72, 0.69])  # 1.5x slower, a faster moment
    assert regress(store_url, "--baseline", "base", "--candidate", "same", "--machine-speed", "off") == 0
    assert "2 improved" in capsys.readouterr().out  # raw: the unchanged rerun reads 38% faster
    assert regress(store_url, "--baseline", "base", "--candidate", "double", "--machine-speed", "off") == 0
    assert "2 improved" in capsys.readouterr().out  # and the 1.5x slowdown reads faster too
    assert regress(store_url, "--baseline", "base", "--candidate", "same", "--markdown") == 0
    out = capsys.readouterr().out
    assert "2 unchanged" in out and "per unit of the machine's speed (its reference 0.61" in out
    assert regress(store_url, "--baseline", "base", "--candidate", "double") == 1
    assert "2 regressed" in capsys.readouterr().out


def test_regress_matches_by_run_id_and_commit_and_writes_markdown(store_url, capsys):
    a = record(store_url, None, 1.0, commit="aaaa1111", seed=1, runs=2)
    record(store_url, None, 1.2, commit="bbbb2222", seed=2, runs=2)
    assert regress(store_url, "--baseline", "aaaa", "--candidate", "bbbb2222", "--markdown") == 1
    out = capsys.readouterr().out
    assert "| configuration | metric | runs | baseline | candidate | ratio [95% CI] | verdict | why |" in out
    assert "| b4 | wall_seconds | 2:2 |" in out and "**regressed**" in out
    assert regress(store_url, "--baseline", str(a), "--candidate", str(a)) == 0  # a run id: that one run


def test_one_run_on_each_side_says_no_between_run_noise_is_known_and_never_exits_1(store_url, capsys):
    record(store_url, "base", 1.0, seed=1)
    record(store_url, "slow", 1.2, seed=2)
    assert regress(store_url, "--baseline", "base", "--candidate", "slow", "--metrics", "wall_seconds",
                   "--markdown") == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| b4 |"))
    assert row.startswith("| b4 | wall_seconds | 1:1 |") and row.endswith(
        "| maybe regressed | 20.2% worse, beyond the 5% threshold; no between-run noise known (one run on each side; "
        "bench run --repeats measures it) |")


@pytest.mark.parametrize("argv, message", [
    (["--baseline", "nosuchlabel", "--candidate", "base"], "no successful run matches 'nosuchlabel'"),
    (["--baseline", "base", "--candidate", "other"], "empty comparison: the baseline's 1 and the candidate's 1"),
])
def test_unusable_input_is_one_line_and_exit_2(store_url, capsys, argv, message):
    record(store_url, "base", 1.0)
    record(store_url, "other", 1.0, config={"batch_size": 8})
    assert regress(store_url, *argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_history_names_the_commit_where_a_metric_stepped(store_url, capsys):
    for k in range(8):
        record(store_url, None, 1.0 if k < 5 else 1.2, commit=f"{k:08x}", seed=k)
    assert regress(store_url, "--history", "8") == 1
    out = capsys.readouterr().out
    assert "b4: wall_seconds stepped +20.0% (regressed) at 00000005" in out
    assert "b4: output_tokens_per_second stepped" in out and "at 00000005" in out


def test_history_and_export_list_what_is_stored(store_url, tmp_path, capsys):
    first = record(store_url, "base", 1.0)
    second = record(store_url, "slow", 1.1)
    rows = history.main(["--db", store_url])
    assert [r["id"] for r in rows] == [second, first]
    assert [r["id"] for r in history.main(["--db", store_url, "--label", "base"])] == [first]
    out = tmp_path / "all.json"
    export.main(["--db", store_url, "--format", "json", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["id"] for r in doc["runs"]] == [first, second]
    assert len(doc["measurements"]) == 2 * 30
    written = export.main(["--db", store_url, "--out", str(tmp_path / "csv"), "--label", "slow"])
    lines = (tmp_path / "csv" / "measurements.csv").read_text().splitlines()
    assert len(written) == 3 and lines[0] == "id,run_id,metric,unit,iteration,value" and len(lines) == 31


@pytest.mark.parametrize("command", [cli.main, history.main, export.main])
def test_an_unreachable_database_is_one_line_and_exit_2_for_every_reader(command, capsys, tmp_path):
    from tests.conftest import free_port

    argv = ["--db", f"postgresql://bench:pw@127.0.0.1:{free_port()}/bench"]
    argv += {cli.main: ["--baseline", "a", "--candidate", "b"], export.main: ["--out", str(tmp_path / "x")]}.get(command, [])
    with pytest.raises(SystemExit) as exited:
        command(argv)
    captured = capsys.readouterr()
    message = (captured.out + captured.err).strip()
    assert exited.value.code == 2 and len(message.splitlines()) == 1
    assert message.startswith("error: cannot open the results database postgresql+psycopg://bench:***@127.0.0.1:")


def test_a_query_the_database_refuses_after_opening_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    db = f"sqlite:///{tmp_path / 'b.db'}"
    store = open_store(db)
    with store.engine.begin() as conn:  # a store that opens, then fails its first read
        schema.runs.drop(conn)
    monkeypatch.setattr(history, "open_store", lambda url: store)  # opening again would recreate the table
    with pytest.raises(SystemExit) as exited:
        history.main(["--db", db])
    message = capsys.readouterr().err.strip()
    assert exited.value.code == 2
    assert message == f"error: cannot read or write {db}: no such table: bench_runs"


@pytest.mark.parametrize("baseline, candidate", [([0, 0, 1, 1, 1, 1], [1] * 6), ([0] * 6, [1] * 6), ([1] * 6, [-1] * 6)])
def test_a_baseline_with_zeros_or_negative_values_is_inconclusive_not_infinite(baseline, candidate):
    v = judge(baseline, candidate, LOWER)
    assert (v.verdict, v.ratio, v.low, v.high) == ("inconclusive", None, None, None)
    assert v.why == "a ratio needs positive baseline and non-negative candidate values"
