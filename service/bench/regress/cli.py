"""`bench regress`: did the candidate get worse than the baseline, per configuration and metric, beyond noise?

REF is a run id, a commit (or a prefix of one) or a label; configurations are matched by their hash (two run
ids are compared even when their configurations differ). The noise is the drift between invocations (separate
`bench run` processes) that the store knows for the configuration on this machine: the spread of invocation
means under one label at one commit (e.g. the baseline run twice: `bench run --label L --force` the second
time). With no such drift known, the verdicts say so and a change is at most "maybe regressed". Every verdict
names the noise it used. Exit 1 on a regression, 0 otherwise, 2 on unusable input.
`--history N` instead walks each configuration's last N commits and names the commits where a metric stepped.
"""

import argparse
import dataclasses
import fnmatch
import sys

import numpy as np
from rich.console import Console
from rich.table import Table

from service.bench import flags
from service.bench.machine_speed import METRIC as REFERENCE
from service.bench.machine_speed import normalizable, per_machine_speed
from service.bench.regress import queries
from service.bench.regress.directions import direction
from service.bench.regress.verdicts import MIN_ITERATIONS, find_steps, judge_runs, parse_threshold
from service.bench.store import StoreError, add_db_argument, open_store

COLOURS = {"regressed": "bold red", "maybe regressed": "red", "improved": "green", "maybe improved": "green",
           "unchanged": "", "inconclusive": "yellow"}


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="service bench regress", description=__doc__)
    ap.add_argument("--baseline", metavar="REF", help="run id, commit or label")
    ap.add_argument("--candidate", metavar="REF", help="run id, commit or label")
    ap.add_argument("--history", type=int, metavar="N", help="find steps over each configuration's last N commits")
    ap.add_argument("--kind", default=None, help="only runs of this kind (run, offline, serve, model, kernel ...)")
    ap.add_argument("--config", default=None, help="--history: only configurations whose hash or name matches")
    ap.add_argument("--threshold", default="5%", help="smallest change that counts (default %(default)s)")
    ap.add_argument("--metrics", default=None, help="comma list of glob patterns: judge only these")
    ap.add_argument("--min-iterations", type=int, default=MIN_ITERATIONS,
                    help="fewer measured iterations on either side: inconclusive (default %(default)s)")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for a pull-request comment)")
    flags.add_switch(ap, "machine-speed", True, "judge times and rates per unit of the machine's speed at each "
                     "iteration, where every run on both sides recorded it (bench run on CPU)")
    add_db_argument(ap)
    args = ap.parse_args(argv)
    if (args.history is None) == (args.baseline is None or args.candidate is None):
        ap.error("give --baseline and --candidate, or --history N")
    return args


def _judged(metrics: dict, only: list[str] | None) -> list[str]:
    return sorted(m for m in metrics if direction(m) and (not only or any(fnmatch.fnmatchcase(m, p) for p in only)))


def compare(store, args, threshold: float, only) -> list[dict]:
    base = queries.resolve_groups(store, args.baseline, args.kind)
    cand = queries.resolve_groups(store, args.candidate, args.kind)
    if args.baseline.isdigit() and args.candidate.isdigit() and len(base) == len(cand) == 1:
        pairs = [(base[0], cand[0])]  # two runs named by id: compared whatever their configurations
    else:
        by_hash = {b[0]["config_hash"]: b for b in base}
        pairs = [(by_hash[c[0]["config_hash"]], c) for c in reversed(cand) if c[0]["config_hash"] in by_hash]
    if not pairs:
        raise StoreError(f"empty comparison: the baseline's {len(base)} and the candidate's {len(cand)} "
                         "configurations have none in common")
    values = queries.values(store, [r["id"] for pair in pairs for group in pair for r in group])
    rows = []
    for b, c in pairs:
        same = b[0]["config_hash"] == c[0]["config_hash"]  # else no group measures the drift of both
        known = [g for g in (queries.drift_groups(store, b + c) if same else []) if len(_invocations(g)) > 1]
        known_values = queries.values(store, [r["id"] for g in known for r in g])
        vb, vc = [values[r["id"]] for r in b], [values[r["id"]] for r in c]
        for metric in _judged(set.intersection(*(set(v) for v in vb + vc)), only):
            xb, xc = [v[metric][1] for v in vb], [v[metric][1] for v in vc]
            per_machine = bool(args.machine_speed and normalizable(metric)
                               and all(_series(v, metric, True) for v in vb + vc))
            sides = [[[_series(values[r["id"]], metric, per_machine) for r in inv] for inv in _invocations(side)]
                     for side in (b, c)]
            verdict = judge_runs(*sides, direction(metric), threshold, args.min_iterations,
                                 _drift_groups(known, known_values, metric, per_machine))
            if per_machine:
                machine = _typical([v[REFERENCE][1] for v in vc]) / _typical([v[REFERENCE][1] for v in vb])
                verdict = dataclasses.replace(verdict, why=f"{verdict.why}; per unit of the machine's speed "
                                              f"(its reference {machine:.3f}x)")
            rows.append({"configuration": c[0]["name"], "config_hash": c[0]["config_hash"],
                         "baseline_run": b[0]["id"], "candidate_run": c[0]["id"], "metric": metric,
                         "unit": vb[0][metric][0], "baseline": _typical(xb), "candidate": _typical(xc),
                         **verdict.__dict__})
    if not rows:
        raise StoreError("empty comparison: the matched runs share no metric with a known better direction")
    return rows


def _drift_groups(known: list[list[dict]], values: dict, metric: str, per_machine: bool) -> list[tuple]:
    """The groups of unchanged code as judge_runs takes them: (name, invocations of runs' iterations), each with
    two or more invocations that measured the metric (per unit of the machine's speed, if the sides are)."""
    groups = []
    for g in known:
        invocations = []
        for inv in _invocations(g):
            series = [_series(values[r["id"]], metric, per_machine) for r in inv]
            if (runs := [x for x in series if x and np.median(x) > 0]):
                invocations.append(runs)
        if len(invocations) > 1:
            groups.append((_name(g), invocations))
    return groups


def _invocations(runs: list[dict]) -> list[list[dict]]:
    """Runs by the process that recorded them, in order of first appearance; a run older than the invocation
    column is its own."""
    by: dict = {}
    for run in runs:
        by.setdefault(run["invocation"] or ("run", run["id"]), []).append(run)
    return list(by.values())


def _name(runs: list[dict]) -> str:
    """A group of runs as a reader knows it: its label, or its commit."""
    labels = {r["label"] for r in runs}
    if len(labels) == 1 and None not in labels:
        return labels.pop()
    commits = {(r["git_commit"] or "?")[:10] for r in runs}
    return "commit " + ", ".join(sorted(commits))


def _series(v: dict, metric: str, per_machine: bool) -> list[float] | None:
    """A run's iterations of a metric, per unit of the machine's speed at each when asked (None where the run
    lacks the metric, or the reference for every iteration)."""
    if metric not in v:
        return None
    if not per_machine:
        return v[metric][1]
    if REFERENCE not in v or len(v[REFERENCE][1]) != len(v[metric][1]):
        return None
    return per_machine_speed(v[metric][1], v[REFERENCE][1], normalizable(metric))


def _typical(runs: list) -> float:
    """A side's value: the median of its one run, or the geometric mean of its runs' medians (as the ratio)."""
    return float(np.exp(np.mean(np.log([np.median(r) for r in runs])))) if len(runs) > 1 else float(np.median(runs[0]))


def _ci(row) -> str:
    return "-" if row["ratio"] is None else f"{row['ratio']:.3f} [{row['low']:.3f}, {row['high']:.3f}]"


def print_rows(console: Console, rows: list[dict], markdown: bool) -> None:
    head = ["configuration", "metric", "runs", "baseline", "candidate", "ratio [95% CI]", "verdict", "why"]
    cells = [[r["configuration"], r["metric"], f"{r['runs_baseline']}:{r['runs_candidate']}", f"{r['baseline']:.4g}",
              f"{r['candidate']:.4g}", _ci(r), r["verdict"], r["why"]] for r in rows]
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for row in cells:
            row[6] = f"**{row[6]}**" if row[6] in ("regressed", "improved") else row[6]
            print("| " + " | ".join(row) + " |")
        return
    table = Table(title_justify="left")
    for col in head:
        table.add_column(col, justify="right" if col in ("runs", "baseline", "candidate") else "left")
    for row in cells:
        row[6] = f"[{COLOURS[row[6]]}]{row[6]}[/]" if COLOURS[row[6]] else row[6]
        table.add_row(*row)
    console.print(table)


def steps(store, args, threshold: float, only) -> list[dict]:
    latest = queries.history(store, kind=args.kind, config=args.config, status="ok", limit=10_000)
    found, seen = [], set()
    for run in latest:
        if (run["kind"], run["config_hash"]) in seen:
            continue
        seen.add((run["kind"], run["config_hash"]))
        series = queries.commit_series(store, run["config_hash"], run["kind"], args.history)
        if len(series) < 4:  # a step needs two runs on each side
            continue
        values = queries.values(store, [s["id"] for s in series])
        for metric in _judged(set.intersection(*(set(values[s["id"]]) for s in series)), only):
            medians = [float(np.median(values[s["id"]][metric][1])) for s in series]
            for at, change in find_steps(medians, threshold):
                worse = change * direction(metric) < 0
                found.append({"configuration": run["name"], "metric": metric, "commit": series[at]["git_commit"],
                              "subject": series[at]["git_subject"] or "", "change": change,
                              "verdict": "regressed" if worse else "improved",
                              "series": " ".join(f"{m:.4g}" for m in medians)})
    return found


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = Console() if Console().is_terminal else Console(width=160)
    try:
        threshold = parse_threshold(args.threshold)
        only = [p.strip() for p in args.metrics.split(",")] if args.metrics else None
        store = open_store(args.db)
        rows = steps(store, args, threshold, only) if args.history else compare(store, args, threshold, only)
        if not args.history:
            queries.save_verdicts(store, rows, args.baseline, args.candidate, threshold)
    except (StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.history:
        if not rows:
            console.print(f"no step beyond {threshold:.0%} in the last {args.history} commits of any configuration")
        for r in rows:
            console.print(f"{r['configuration']}: {r['metric']} stepped {r['change']:+.1%} ({r['verdict']}) at "
                          f"{r['commit'][:12]} {r['subject']!r}; per commit: {r['series']}", markup=False)
        sys.exit(1 if any(r["verdict"] == "regressed" for r in rows) else 0)
    print_rows(console, rows, args.markdown)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in COLOURS}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    (print if args.markdown else console.print)(
        f"\n{summary} (threshold {threshold:.0%}; 95% interval of the ratio: Student's t on the drift between "
        "invocations, or where none is known on the repeats or the iterations' bootstrap, at most \"maybe\")")
    if counts["regressed"]:
        sys.exit(1)
    return rows
