"""bench regress: verdicts with known answers (one run each side; separate invocations whose spread is the drift
between them; the sequence of a baseline run twice and unchanged reruns), step detection, and the commands over a
real store (each store test on SQLite and on PostgreSQL)."""

import json

import numpy as np
import pytest
import sqlalchemy as sa

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


def apart(levels, rng, cv=0.002, iterations=10) -> list[list[np.ndarray]]:
    """One invocation of one run per level: its iterations scatter around the level by `cv` (the noise inside a
    run), and the levels scatter as separate invocations do."""
    return [[level * rng.normal(1, cv, iterations)] for level in levels]


def test_a_difference_inside_the_drift_between_invocations_is_unchanged_though_outside_the_within_run_interval():
    rng = np.random.default_rng(20)
    # invocations scatter by about 2%, iterations by 0.2% inside a run; the newest candidate invocation is 6% slow
    base = apart([1.00, 1.02, 0.98, 1.01, 0.99, 1.00], rng)
    cand = apart([1.00, 0.99, 1.02, 0.98, 1.01, 1.06], rng)
    ratio, low, high = median_ratio_ci(base[-1][0], cand[-1][0])
    assert low > 1.05  # the within-run interval of the newest pair excludes no change, by more than the threshold
    assert judge(base[-1][0], cand[-1][0], LOWER).verdict == "regressed"  # so one run against one cries wolf
    v = judge_runs(base, cand, LOWER)
    assert v.verdict == "unchanged" and v.low < 1 < v.high and (v.runs_baseline, v.runs_candidate) == (6, 6)
    assert v.why.startswith("within 5%; invocations 6 and 6 (runs 6 and 6), noise ")
    assert v.why.endswith("between invocations (baseline, candidate: 12 invocations, df 10)")
    assert 0.015 < v.noise < 0.03  # the spread between invocations, ten times the noise inside a run


def test_a_clear_regression_over_separate_invocations_is_called_regressed():
    rng = np.random.default_rng(21)
    for _ in range(20):
        base, cand = apart(rng.normal(1, 0.03, 3), rng), apart(rng.normal(1.5, 0.045, 3), rng)
        v = judge_runs(base, cand, LOWER)
        assert v.verdict == "regressed" and v.low > 1.3, v


def test_a_smaller_consistent_slowdown_is_never_called_unchanged():
    rng = np.random.default_rng(22)
    verdicts = []
    for _ in range(200):  # 8% slower, invocations scattering by 2%: three a side cannot always tell, never clear it
        base, cand = apart(rng.normal(1, 0.02, 3), rng), apart(rng.normal(1.08, 0.0216, 3), rng)
        verdicts.append(judge_runs(base, cand, LOWER).verdict)
    assert (verdicts.count("regressed"), verdicts.count("inconclusive")) == (181, 19)


def test_unchanged_reruns_with_more_drift_between_invocations_than_inside_runs_are_not_called_regressed():
    rng = np.random.default_rng(23)
    verdicts = [judge_runs(apart(rng.normal(1, 0.02, 3), rng), apart(rng.normal(1, 0.02, 3), rng), LOWER).verdict
                for _ in range(200)]
    assert (verdicts.count("unchanged"), verdicts.count("inconclusive")) == (97, 103)  # no regressed, no improved
    # one run against one, the within-run bootstrap calls 7 in 200 of such reruns regressed
    pairs = [(apart([rng.normal(1, 0.02)], rng)[0][0], apart([rng.normal(1, 0.02)], rng)[0][0]) for _ in range(200)]
    assert sum(judge(b, c, LOWER).verdict == "regressed" for b, c in pairs) == 7


def invocation(level, rng, drift=0.03, repeat=0.01, cv=0.002, runs=3, iterations=10) -> list[np.ndarray]:
    """One `bench run` of one configuration: the process lands `drift` away from the level (separate invocations
    scatter so), its `runs` repeats scatter by `repeat` around that, and iterations by `cv` inside a run."""
    landed = level * rng.normal(1, drift)
    return [landed * rng.normal(1, repeat) * rng.normal(1, cv, iterations) for _ in range(runs)]


def the_sequence(rng, scale):
    """The baseline run twice under one label, two earlier labels each run twice (what the store knows), and one
    candidate invocation `scale` times slower; the drift between invocations (3%) is three times the repeats'."""
    base = [invocation(1.0, rng), invocation(1.0, rng)]
    groups = [("baseline", base)] + [(f"earlier-{k}", [invocation(1.0, rng), invocation(1.0, rng)]) for k in (1, 2)]
    return base, [invocation(scale, rng)], groups


def test_unchanged_reruns_judged_on_the_drift_between_invocations_keep_to_the_promised_false_alarms():
    rng = np.random.default_rng(30)
    on_drift, on_repeats = [], []
    for _ in range(200):
        base, cand, groups = the_sequence(rng, 1.0)
        on_drift.append(judge_runs(base, cand, LOWER, groups=groups).verdict)
        on_repeats.append(judge_runs(base[-1:], cand, LOWER, groups=[]).verdict)  # one invocation a side
    # a one-sided 95% interval allows 2.5% (5 of 200) regressed by chance; the 5% threshold keeps it below that
    assert {v: on_drift.count(v) for v in set(on_drift)} == {
        "inconclusive": 188, "unchanged": 6, "improved": 3, "regressed": 3}
    # the repeats of one invocation share its moment of the machine: beyond them 30 of 200 (15%), never "regressed"
    assert {v: on_repeats.count(v) for v in set(on_repeats)} == {
        "unchanged": 92, "inconclusive": 57, "maybe regressed": 30, "maybe improved": 21}


def test_a_twofold_slowdown_is_regressed_and_a_seventeen_percent_one_never_unchanged():
    rng = np.random.default_rng(31)
    doubled = [judge_runs(*the_sequence(rng, 2.0)[:2], LOWER, groups=the_sequence(rng, 1.0)[2]) for _ in range(20)]
    assert all(v.verdict == "regressed" and v.low > 1.5 for v in doubled), doubled
    rng = np.random.default_rng(32)
    sixth = []
    for _ in range(200):
        base, cand, groups = the_sequence(rng, 1.17)
        sixth.append(judge_runs(base, cand, LOWER, groups=groups).verdict)
    assert (sixth.count("regressed"), sixth.count("inconclusive")) == (156, 44)


def test_with_no_drift_known_a_twofold_slowdown_is_at_most_maybe_regressed():
    rng = np.random.default_rng(33)
    base, cand = [invocation(1.0, rng)], [invocation(2.0, rng)]
    v = judge_runs(base, cand, LOWER)  # one invocation a side: nothing to measure the drift between them with
    assert v.verdict == "maybe regressed" and v.low > 1.8
    assert v.why.endswith("invocations 1 and 1 (runs 3 and 3), noise 0.8% of the repeats of one invocation; "
                          "no drift between invocations known (run the baseline twice: bench run --label L --force)")
    one = judge_runs([[base[0][0]]], [[cand[0][0]]], LOWER)  # one run a side: the bootstrap of its iterations
    assert one.verdict == "maybe regressed" and one.why.endswith(
        "; noise inside runs only (one run on each side); no drift between invocations known (run the baseline "
        "twice: bench run --label L --force)")


def test_the_reason_names_the_noise_used():
    rng = np.random.default_rng(34)
    base, cand, groups = the_sequence(rng, 1.0)
    assert judge_runs(base, cand, LOWER, groups=groups).why.endswith(
        "between invocations (baseline, earlier-1, earlier-2: 6 invocations, df 3)")
    # two invocations that agree by chance cannot narrow the interval below what their repeats imply
    quiet = [invocation(1.0, rng, drift=0, repeat=0.02), invocation(1.0, rng, drift=0, repeat=0.02)]
    v = judge_runs(quiet, [invocation(1.0, rng, drift=0, repeat=0.02)], LOWER)
    assert v.why.endswith("noise 1.2% of the repeats of one invocation, more than the 0.2% between invocations "
                          "(baseline: 2 invocations, df 1)")
    # and runs whose iterations scatter more than the runs do are judged on that
    noisy = [invocation(1.0, rng, drift=0, repeat=0, cv=0.1), invocation(1.0, rng, drift=0, repeat=0, cv=0.1)]
    v = judge_runs(noisy, [invocation(1.0, rng, drift=0, repeat=0, cv=0.1)], LOWER)
    assert "inside runs, more than the" in v.why


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


def record(url, label, scale, commit="c0ffee00", iterations=10, seed=0, config=None, runs=1, machine=None,
           invocations=1, drift=0.0):
    """`invocations` separate invocations of `runs` runs each of one configuration (a store opened for each, as each
    `bench run` process opens one), each landing `drift` away from the level; the id of the last run. `machine`:
    how slow the machine was during each run (times scale with it), recorded as bench run on CPU does."""
    rng = np.random.default_rng(seed)
    for j in range(invocations):
        store = open_store(url, {"commit": commit})
        landed = scale * rng.normal(1, drift) if drift else scale
        for k in range(j * runs, (j + 1) * runs):
            with store.run(kind="run", config=config or {"batch_size": 4}, label=label, name="b4") as run:
                for i in range(iterations):
                    slow = landed if machine is None else landed * machine[k] * rng.normal(1, 0.01)
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
    record(store_url, "base", 1.0, seed=1, runs=3, invocations=2)  # the baseline run twice: its drift is known
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


def test_repeats_of_one_invocation_a_side_make_a_slowdown_at_most_maybe_regressed(store_url, capsys):
    # one `bench run` a side: its repeats share the process and a moment of the machine, so their spread says
    # nothing of how far the next invocation lands
    record(store_url, "base", 1.0, seed=1, runs=3)
    record(store_url, "slow", 1.10, seed=2, runs=3)
    assert regress(store_url, "--baseline", "base", "--candidate", "slow", "--metrics", "wall_seconds",
                   "--markdown") == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| b4 |"))
    assert "| maybe regressed | " in row and row.endswith(
        "noise 0.3% inside runs; no drift between invocations known (run the baseline twice: bench run --label L "
        "--force) |")


def test_the_sequence_two_baseline_invocations_then_unchanged_reruns_then_slowdowns(store_url, capsys):
    # three times: the baseline run twice under a new label, then three unchanged reruns, each its own label and
    # invocation; the invocations land 3% apart (the iterations scatter by 1%); the store's knowledge of the
    # drift grows with each baseline label
    verdicts = []
    for s in range(1, 4):
        record(store_url, f"baseline-{s}", 1.0, seed=100 + s, runs=3, invocations=2, drift=0.03)
        for k in range(1, 4):
            record(store_url, f"rerun-{s}-{k}", 1.0, seed=10 * s + k, runs=3, drift=0.03)
            assert regress(store_url, "--baseline", f"baseline-{s}", "--candidate", f"rerun-{s}-{k}",
                           "--markdown") == 0
            verdicts += [line.split(" | ")[5:8] for line in capsys.readouterr().out.splitlines()
                         if line.startswith("| b4 |")]
    assert max(float(ratio.split()[0]) for ratio, v, why in verdicts) > 1.05  # a rerun landed beyond the threshold
    assert {v for ratio, v, why in verdicts} == {"inconclusive"}  # and none is called regressed
    assert verdicts[0][2].endswith("noise 2.8% between invocations (baseline-1: 2 invocations, df 1) |")
    assert verdicts[-1][2].endswith("between invocations (baseline-1, baseline-2, baseline-3: 6 invocations, df 3) |")
    record(store_url, "double", 2.0, seed=200, runs=3, drift=0.03)
    assert regress(store_url, "--baseline", "baseline-3", "--candidate", "double") == 1
    assert "2 regressed" in capsys.readouterr().out
    for t in range(3):
        record(store_url, f"sixth-{t}", 1.17, seed=300 + t, runs=3, drift=0.03)
        regress(store_url, "--baseline", "baseline-3", "--candidate", f"sixth-{t}")
        assert "unchanged" not in capsys.readouterr().out


def test_a_slowdown_at_the_same_commit_under_another_label_does_not_count_as_drift(store_url, capsys):
    # a slowdown injected without a commit (PYTHONPATH) shares the baseline's commit: grouped by commit, its
    # invocations would pass for drift and widen every interval; grouped by label they measure only their own
    record(store_url, "base", 1.0, seed=1, runs=3, invocations=2)
    record(store_url, "double", 2.0, seed=2, runs=3, invocations=2)
    record(store_url, "slow", 1.10, seed=3, runs=3)
    assert regress(store_url, "--baseline", "base", "--candidate", "slow", "--metrics", "wall_seconds",
                   "--markdown") == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| b4 |"))
    assert "| **regressed** | " in row and row.endswith("between invocations (base, double: 4 invocations, df 2) |")


def test_runs_older_than_the_invocation_column_count_as_their_own_invocation_each(store_url, capsys):
    record(store_url, "base", 1.0, seed=1, runs=3)
    record(store_url, "slow", 1.10, seed=2, runs=3)
    engine = sa.create_engine(store_url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:  # as a schema-3 store's runs are after the upgrade
        conn.execute(schema.runs.update().values(invocation=None))
    assert regress(store_url, "--baseline", "base", "--candidate", "slow", "--metrics", "wall_seconds",
                   "--markdown") == 1
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| b4 |"))
    assert "| **regressed** | " in row and row.endswith("between invocations (base, slow: 6 invocations, df 4) |")


def test_a_baseline_measured_while_the_machine_ran_slow_is_judged_per_unit_of_the_machines_speed(store_url, capsys):
    # the baseline's runs all came at a moment when the machine ran 30% slow: its repeats and its drift, measured
    # at that one moment, cannot see it; the machine's reference, timed beside every iteration, can
    record(store_url, "base", 1.0, seed=1, runs=3, invocations=3,
           machine=[1.30, 1.28, 1.32, 1.31, 1.29, 1.30, 1.32, 1.30, 1.29])
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
    # unlabelled runs: their commit is the group whose invocations measure the drift (when the tree is not dirty)
    a = record(store_url, None, 1.0, commit="aaaa1111", seed=1, runs=2, invocations=2)
    record(store_url, None, 1.2, commit="bbbb2222", seed=2, runs=2)
    assert regress(store_url, "--baseline", "aaaa", "--candidate", "bbbb2222", "--markdown") == 1
    out = capsys.readouterr().out
    assert "| configuration | metric | runs | baseline | candidate | ratio [95% CI] | verdict | why |" in out
    assert "| b4 | wall_seconds | 4:2 |" in out and "**regressed**" in out
    assert "between invocations (commit aaaa1111: 2 invocations, df 1) |" in out
    assert regress(store_url, "--baseline", str(a), "--candidate", str(a)) == 0  # a run id: that one run


def test_one_run_on_each_side_says_no_drift_is_known_and_never_exits_1(store_url, capsys):
    record(store_url, "base", 1.0, seed=1)
    record(store_url, "slow", 1.2, seed=2)
    assert regress(store_url, "--baseline", "base", "--candidate", "slow", "--metrics", "wall_seconds",
                   "--markdown") == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| b4 |"))
    assert row.startswith("| b4 | wall_seconds | 1:1 |") and row.endswith(
        "| maybe regressed | 20.2% worse, beyond the 5% threshold; noise inside runs only (one run on each side); "
        "no drift between invocations known (run the baseline twice: bench run --label L --force) |")


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
