"""`bench compare BASE.json NEW.json --threshold 5%`: the change of every metric; exit 1 on a regression.

A regression is a change in the worse direction beyond the threshold, relative to the base, for a metric whose
better direction is known (latency and errors: lower; throughput, goodput and SLO attainment: higher; the one
table in service/bench/regress/directions.py). Other numbers (counts, durations, the generator's own rates and
lag) are shown but never fail the comparison. Two files hold one summary per run, so this is a point
comparison; runs recorded in the results store (bench serve --db) carry every request's latencies, and
`bench regress` judges those with a confidence interval.
Sweep files are compared point by point. Exit codes: 0 no regression, 1 regression, 2 unusable input.
"""

import argparse
import fnmatch
import json
import sys

from rich.console import Console
from rich.table import Table

from service.bench.regress.directions import direction
from service.bench.regress.verdicts import parse_threshold

# settings that may differ without making two runs incomparable
INCIDENTAL_SETTINGS = {"label", "started_at", "command", "client", "base_url", "model", "slo", "percentiles"}


def compare_summaries(base: dict, new: dict, threshold: float, only: list[str] | None = None) -> list[dict]:
    """One row per metric: base, new, relative change, direction and verdict (ok, better, worse, REGRESSION)."""
    rows = []
    for metric in list(base) + [m for m in new if m not in base]:
        b, n = base.get(metric), new.get(metric)
        if metric.startswith("errors."):  # an error kind missing from a run means none of it
            b, n = b or 0, n or 0
        if not isinstance(b, (int, float)) or not isinstance(n, (int, float)):
            rows.append({"metric": metric, "base": b, "new": n, "change": None, "direction": 0, "verdict": "n/a"})
            continue
        change = (n - b) / abs(b) if b else (0.0 if n == b else float("inf") if n > b else float("-inf"))
        d = direction(metric) if not only or any(fnmatch.fnmatchcase(metric, p) for p in only) else 0
        worse = d != 0 and change * d < 0
        verdict = "ok" if d == 0 or change == 0 else "worse" if worse else "better"
        if worse and abs(change) > threshold:
            verdict = "REGRESSION"
        rows.append({"metric": metric, "base": b, "new": n, "change": change, "direction": d, "verdict": verdict})
    return rows


def settings_differences(base: dict, new: dict) -> list[str]:
    keys = sorted((set(base) | set(new)) - INCIDENTAL_SETTINGS)
    return [f"{k}: {base.get(k)!r} -> {new.get(k)!r}" for k in keys if base.get(k) != new.get(k)]


def _runs(document: dict) -> list[tuple[str, dict]]:
    if "runs" in document:
        axis = document["sweep"]["axis"]
        return [(f"{axis} = {v:g}", run) for v, run in zip(document["sweep"]["values"], document["runs"])]
    if "summary" not in document:
        raise ValueError("not a bench serve result: no 'summary' and no 'runs'")
    return [("", document)]


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.3f}" if isinstance(value, float) else str(value)


def print_rows(console: Console, title: str, rows: list[dict], show_all: bool) -> None:
    table = Table(title=title, title_justify="left")
    for col, justify in (("metric", "left"), ("base", "right"), ("new", "right"), ("change", "right"),
                         ("better", "center"), ("verdict", "left")):
        table.add_column(col, justify=justify)
    for r in rows:
        if not show_all and r["direction"] == 0 and not r["metric"].startswith("requests."):
            continue
        change = "-" if r["change"] is None else f"{r['change']:+.1%}"
        better = {-1: "lower", 1: "higher", 0: ""}[r["direction"]]
        verdict = {"REGRESSION": "[bold red]REGRESSION[/bold red]", "worse": "[yellow]worse[/yellow]",
                   "better": "[green]better[/green]"}.get(r["verdict"], r["verdict"])
        table.add_row(r["metric"], _fmt(r["base"]), _fmt(r["new"]), change, better, verdict)
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="service bench compare", description=__doc__)
    ap.add_argument("base", help="result JSON of the baseline run (bench serve --json)")
    ap.add_argument("new", help="result JSON of the run to judge")
    ap.add_argument("--threshold", default="5%", help="largest tolerated change in the worse direction")
    ap.add_argument("--metrics", default=None, help="comma list of glob patterns: only these can fail the "
                                                    "comparison, e.g. 'ttft_ms.p95,output_throughput'")
    ap.add_argument("--all", action="store_true", help="also show the information-only numbers")
    args = ap.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    try:
        threshold = parse_threshold(args.threshold)
        with open(args.base) as f:
            base = _runs(json.load(f))
        with open(args.new) as f:
            new = _runs(json.load(f))
        if [name for name, _ in base] != [name for name, _ in new]:
            raise ValueError(f"the files hold different runs: {[n for n, _ in base]} vs {[n for n, _ in new]}")
    except (OSError, ValueError, KeyError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(2)
    only = [p.strip() for p in args.metrics.split(",")] if args.metrics else None
    regressions = []
    for (name, b), (_, n) in zip(base, new):
        differences = settings_differences(b.get("settings", {}), n.get("settings", {}))
        loads = [r.get("settings", {}).get("client", {}).get("load_average_1m") for r in (b, n)]
        if all(loads):
            console.print("client machine load average (1 min) before -> after the run: base "
                          + ", new ".join(f"{x['before']:.2f} -> {x['after']:.2f}" for x in loads))
        if differences:
            console.print(f"[yellow]note:[/yellow] the runs{' at ' + name if name else ''} differ in their settings: "
                          + "; ".join(differences))
        rows = compare_summaries(b["summary"], n["summary"], threshold, only)
        print_rows(console, f"{args.base} -> {args.new}{' (' + name + ')' if name else ''}, threshold "
                            f"{threshold:.1%}", rows, args.all)
        regressions += [f"{name + ': ' if name else ''}{r['metric']} {r['change']:+.1%}" for r in rows
                        if r["verdict"] == "REGRESSION"]
    if regressions:
        console.print(f"[bold red]{len(regressions)} regression(s) beyond {threshold:.1%}:[/bold red] "
                      + ", ".join(regressions))
        sys.exit(1)
    console.print(f"no regression beyond {threshold:.1%}")
