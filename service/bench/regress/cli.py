"""`bench regress`: did the candidate get worse than the baseline, per configuration and metric, beyond noise?

REF is a run id, a commit (or a prefix of one) or a label; configurations are matched by their hash (two run
ids are compared even when their configurations differ). Exit 1 on a regression, 0 otherwise, 2 on unusable
input. `--history N` instead walks each configuration's last N commits and names the commits where a metric
stepped.
"""

import argparse
import fnmatch
import sys

import numpy as np
from rich.console import Console
from rich.table import Table

from service.bench.regress import queries
from service.bench.regress.directions import direction
from service.bench.regress.verdicts import MIN_ITERATIONS, find_steps, judge, parse_threshold
from service.bench.store import StoreError, add_db_argument, open_store

COLOURS = {"regressed": "bold red", "improved": "green", "unchanged": "", "inconclusive": "yellow"}


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
    add_db_argument(ap)
    args = ap.parse_args(argv)
    if (args.history is None) == (args.baseline is None or args.candidate is None):
        ap.error("give --baseline and --candidate, or --history N")
    return args


def _judged(metrics: dict, only: list[str] | None) -> list[str]:
    return sorted(m for m in metrics if direction(m) and (not only or any(fnmatch.fnmatchcase(m, p) for p in only)))


def compare(store, args, threshold: float, only) -> list[dict]:
    base, cand = queries.resolve(store, args.baseline, args.kind), queries.resolve(store, args.candidate, args.kind)
    if args.baseline.isdigit() and args.candidate.isdigit() and len(base) == len(cand) == 1:
        pairs = [(base[0], cand[0])]  # two runs named by id: compared whatever their configurations
    else:
        by_hash = {b["config_hash"]: b for b in base}
        pairs = [(by_hash[c["config_hash"]], c) for c in reversed(cand) if c["config_hash"] in by_hash]
    if not pairs:
        raise StoreError(f"empty comparison: the baseline's {len(base)} and the candidate's {len(cand)} "
                         "configurations have none in common")
    values = queries.values(store, [r["id"] for pair in pairs for r in pair])
    rows = []
    for b, c in pairs:
        vb, vc = values[b["id"]], values[c["id"]]
        for metric in _judged(set(vb) & set(vc), only):
            unit, xb = vb[metric]
            v = judge(xb, vc[metric][1], direction(metric), threshold, args.min_iterations)
            rows.append({"configuration": c["name"], "config_hash": c["config_hash"], "baseline_run": b["id"],
                         "candidate_run": c["id"], "metric": metric, "unit": unit, "baseline": float(np.median(xb)),
                         "candidate": float(np.median(vc[metric][1])), **v.__dict__})
    if not rows:
        raise StoreError("empty comparison: the matched runs share no metric with a known better direction")
    return rows


def _ci(row) -> str:
    return "-" if row["ratio"] is None else f"{row['ratio']:.3f} [{row['low']:.3f}, {row['high']:.3f}]"


def print_rows(console: Console, rows: list[dict], markdown: bool) -> None:
    head = ["configuration", "metric", "baseline", "candidate", "ratio [95% CI]", "verdict", "why"]
    cells = [[r["configuration"], r["metric"], f"{r['baseline']:.4g}", f"{r['candidate']:.4g}", _ci(r), r["verdict"],
              r["why"]] for r in rows]
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for row in cells:
            row[5] = f"**{row[5]}**" if row[5] in ("regressed", "improved") else row[5]
            print("| " + " | ".join(row) + " |")
        return
    table = Table(title_justify="left")
    for col in head:
        table.add_column(col, justify="right" if col in ("baseline", "candidate") else "left")
    for row in cells:
        row[5] = f"[{COLOURS[row[5]]}]{row[5]}[/]" if COLOURS[row[5]] else row[5]
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
    (print if args.markdown else console.print)(f"\n{summary} (threshold {threshold:.0%}, 95% bootstrap interval "
                                               "of the median ratio)")
    if counts["regressed"]:
        sys.exit(1)
    return rows
