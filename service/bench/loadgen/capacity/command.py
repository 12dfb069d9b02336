"""`bench capacity`: the highest request rate (or concurrency) a server sustains within its latency SLOs.

Ramp to bracket the knee, bisect to --precision; each probe is measured in steady state, repeated when too close to
call, stopped early on saturation or errors; the server's /metrics say what limited capacity.
Exit status: 0 capacity found, 1 could not measure, 2 bad arguments, 3 no load meets the SLOs, 4 even --max does.
"""

import argparse
import json
import logging
import math
import os
import platform
import shlex
import sys
import time

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from service.bench import flags
from service.bench.loadgen.capacity import search as cs
from service.bench.loadgen.capacity.probe import Probe, Steady, run_probe
from service.bench.loadgen.results import latency, report
from service.bench.loadgen.results.record import record_requests
from service.bench.loadgen.results.summary import summarize
from service.bench.loadgen.send.dispatch import LoadSpec
from service.bench.loadgen.send.request import CHAT
from service.bench.loadgen.serve import (add_prompt_arguments, add_server_arguments, add_server_metrics_argument,
                                         discover_model, make_workload)
from service.bench.slo import meets, parse as parse_slo
from service.bench.store import StoreError, add_db_argument, open_store

EXIT = {"found": 0, "unmeasurable": 1, "usage": 2, "none_meets": 3, "all_meet": 4}
UNITS = {"rate": "req/s", "concurrency": "concurrent"}
MAX_POINTS = 40  # a search converges in far fewer; this bounds a pathological (non-monotone) server


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="service bench capacity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(ap)
    a = ap.add_argument_group("objectives").add_argument
    a("--slo", action="append", default=[], metavar="METRIC:pXX<=VALUE",
      help="repeatable, required: ttft, tpot, itl or e2e, e.g. ttft:p95<=500ms, tpot:p95<=50ms; with --target "
           "a bound on every request, e.g. ttft:500ms (grammar: service/bench/slo.py)")
    a("--target", type=float, default=None, metavar="RATIO",
      help="goodput mode: the share of requests meeting every SLO (percentiles ignored) must be >= RATIO, e.g. 0.99")
    a = ap.add_argument_group("search").add_argument
    a("--by", choices=["rate", "concurrency"], default="rate", help="what to search (default %(default)s)")
    a("--start", type=float, default=None, help="first load tried (default: 1)")
    a("--min", type=float, default=None, help="lowest load tried (default: 0.1 req/s or 1)")
    a("--max", type=float, default=None, help="highest load tried (default: 64 req/s or 256)")
    a("--precision", default="5%",
      help="stop when first fail - last pass <= this share of the last pass (default %(default)s)")
    a("--ramp-factor", type=float, default=2.0, help="each ramp step multiplies the load by this (default %(default)s)")
    a("--burstiness", type=float, default=1.0,
      help="rate: gamma shape of arrival gaps; 1 is Poisson (default %(default)s)")
    a("--arrival", choices=["gamma", "constant"], default="gamma", help="rate: gamma (default) or evenly spaced")
    a("--max-concurrency", type=int, default=None, help="rate: also cap requests in flight")
    g = ap.add_argument_group("each probe")
    a = g.add_argument
    # dest "warmup": the name the result's settings and the stored configuration have always used
    warmup = flags.add_warmup_seconds(g, 10.0, "seconds of requests left out of the statistics", dest="warmup")
    flags.deprecated_alias(g, "--warmup", warmup)
    a("--min-requests", type=int, default=50, help="measured requests per probe (default %(default)s)")
    a("--min-duration", type=float, default=30.0, help="measured seconds per probe (default %(default)s)")
    a("--max-probe-duration", type=float, default=600.0, help="no request is sent after this (default %(default)s)")
    a("--max-repeats", type=int, default=2, help="extra runs of a probe too close to call (default %(default)s)")
    a("--max-error-rate", type=float, default=0.05, help="share of failed requests that stops a probe (default %(default)s)")
    add_server_metrics_argument(g, "--no-server-metrics")
    a("--seed", type=int, default=0, help="probe k uses seed + k (default %(default)s)")
    flags.add_workers(ap)
    add_prompt_arguments(ap)
    g = ap.add_argument_group("results")
    a = g.add_argument
    flags.deprecated_alias(g, "--result-json", flags.add_json(g, "write the result here as JSON (after every probe)",
                                                              dest="result_json"))
    flags.deprecated_alias(g, "--result-csv", flags.add_csv(g, "write one row per load tried here", dest="result_csv"))
    a("--plot", default=None, metavar="PNG", help="SLO metrics against load, SLO lines and the capacity marked")
    a("--label", default=None, help="a name for this run in the results and the results store")
    add_db_argument(ap)
    return ap.parse_args(argv)


class Usage(ValueError):
    pass


def _setup(args: argparse.Namespace):
    targets = [parse_slo(s) for s in args.slo]
    if not targets:
        raise Usage("give at least one --slo, e.g. --slo ttft:p95<=500ms")
    if args.target is None and any(t.percentile is None for t in targets):
        raise Usage("without --target every SLO needs a percentile, e.g. ttft:p95<=500ms")
    if args.target is not None and not 0 < args.target <= 1:
        raise Usage(f"--target is a share in (0, 1], got {args.target:g}")
    integer = args.by == "concurrency"
    start = args.start or 1.0
    low = args.min or (1.0 if integer else min(0.1, start))
    high = args.max or (256.0 if integer else 64.0)
    if integer and not all(v == int(v) for v in (start, low, high)):
        raise Usage("--start, --min and --max are whole numbers with --by concurrency")
    search = cs.Search(start, low, high, cs.parse_precision(args.precision), args.ramp_factor, integer)
    if args.min_requests < 1 or args.min_duration < 0 or args.warmup < 0 or args.max_repeats < 0:
        raise Usage("--min-requests >= 1; --min-duration, --warmup-seconds and --max-repeats >= 0")
    return targets, search


def _spec(args, model: str, load: float, seed: int, steady: Steady) -> LoadSpec:
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset == "random"
    extra = json.loads(args.extra_body) if args.extra_body else {}
    by_rate = args.by == "rate"
    return LoadSpec(args.base_url, model, args.endpoint, load if by_rate else math.inf, args.burstiness,
                    args.arrival == "constant", args.max_concurrency if by_rate else int(load), None,
                    steady.max_duration_s, seed, ignore_eos, args.temperature, extra, args.request_timeout,
                    args.api_key)


def _samples(measured) -> tuple[dict, np.ndarray, np.ndarray]:
    ok = [r for r in measured if r.ok]
    ttft = np.array([r.ttft for r in ok], dtype=float)
    e2e = np.array([r.e2e for r in ok], dtype=float)
    tpot = latency.tpot(e2e, ttft, [r.output_tokens for r in ok])
    gaps = np.array([g for r in ok for g in r.itl], dtype=float)
    max_itl = np.array([max(r.itl) if r.itl else np.nan for r in ok], dtype=float)
    return {"ttft": ttft, "tpot": tpot, "itl": gaps, "e2e": e2e}, max_itl, np.array([r.ok for r in measured])


def judge_point(targets, target_ratio, probes: list[Probe], decide: bool):
    """Pool the measured requests of a load's probes and judge them; None when nothing was measured."""
    measured = [r for p in probes for r in p.measured]
    samples, max_itl, _ = _samples(measured)
    ok = [r for r in measured if r.ok]
    met_ok = meets(targets, samples["ttft"], samples["tpot"], max_itl, samples["e2e"], np.ones(len(ok), bool))
    met = np.concatenate([met_ok, np.zeros(len(measured) - len(ok), bool)])  # a failed request met nothing
    checks = cs.judge(targets, samples, met, target_ratio)
    verdict = cs.overall(checks, decide)
    if any(p.stopped in ("saturated", "errors") for p in probes):
        verdict = "fail"  # a saturated server does not sustain the load, whatever its first requests saw
    return checks, verdict


def measure(args, model, targets, load, seed, steady, read_server) -> tuple[dict, list]:
    """Probe one load; a close call is run again with new prompts and judged on the pooled requests.
    Returns the point's report and its measured requests."""
    probes, checks, verdict = [], [], "close"
    for repeat in range(args.max_repeats + 1):
        spec = _spec(args, model, load, seed + 1000 * repeat, steady)
        workload, _ = make_workload(args, seed + 1000 * repeat)
        probes.append(run_probe(load, spec, workload, steady, read_server, args.workers))
        checks, verdict = judge_point(targets, args.target, probes, decide=repeat == args.max_repeats)
        if verdict != "close":
            break
    measured = [r for p in probes for r in p.measured]
    span = sum((max(r.ended for r in p.measured) - min(r.sent for r in p.measured)) for p in probes if p.measured)
    percentiles = sorted({50.0, 90.0, 95.0, 99.0} | {t.percentile for t in targets if t.percentile})
    summary = summarize(measured, span, percentiles, targets, load if args.by == "rate" else math.inf)
    return {"load": load, "verdict": verdict, "close_call": len(probes) > 1, "probes": len(probes),
            "stopped": next((p.stopped for p in probes if p.stopped), None),
            "sent": sum(len(p.results) for p in probes), "measured": len(measured),
            "wall_s": sum(p.wall_s for p in probes),
            "checks": [vars(c) for c in checks], "summary": summary,
            "server": probes[-1].server, "server_note": probes[-1].server_note,
            "client_saturated": any(p.generator["saturated"] for p in probes),
            "client_reasons": [r for p in probes for r in p.generator["reasons"]],
            "unreachable": all(r.error == "connect_error" for p in probes for r in p.results)
            and any(p.results for p in probes)}, measured


def _ms(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1000:,.0f}"


def _check_text(c: dict) -> str:
    if c["higher_is_better"]:
        return f"{c['name']} {c['value']:.1%} [{c['low']:.1%}, {c['high']:.1%}] vs >= {c['limit']:.1%}"
    return f"{c['name'].split('<=')[0]} {_ms(c['value'])} ms [{_ms(c['low'])}, {_ms(c['high'])}]"


def point_line(k: int, p: dict, unit: str) -> str:
    colour = {"pass": "green", "fail": "red"}.get(p["verdict"], "yellow")
    srv = p["server"]
    server = (f"; server: {srv['waiting_mean']:.1f} waiting, KV {srv['kv_usage_max']:.0%} max, "
              f"{srv['preemptions']:g} preempted" if srv else "")
    notes = ", ".join(filter(None, [f"{p['probes']} runs pooled (close call)" if p["close_call"] else "",
                                    "[red]the load generator fell behind[/red]" if p["client_saturated"] else "",
                                    f"stopped early: {p['stopped']}" if p["stopped"] else ""]))
    return (f"probe {k}: {p['load']:g} {unit} [{colour}]{p['verdict'].upper()}[/{colour}] "
            f"({p['measured']} measured of {p['sent']}, {p['summary'].get('requests.failed', 0)} failed, "
            f"{p['wall_s']:.0f} s) " + "; ".join(_check_text(c) for c in p["checks"]) + server
            + (f" ({notes})" if notes else ""))


def _failing(point: dict, targets) -> list[str]:
    if point["checks"] and point["checks"][0]["higher_is_better"]:
        s = point["summary"]
        worst = sorted(targets, key=lambda t: s.get(f"slo_attainment.{t.metric}", 1.0))
        return [t.metric for t in worst if s.get(f"slo_attainment.{t.metric}", 1.0) < 1.0][:2] or ["goodput"]
    return [c["name"].split(":")[0].split("<")[0] for c in point["checks"] if c["value"] > c["limit"]] or \
        [c["name"].split(":")[0] for c in point["checks"]]


def conclude(search: cs.Search, points: list[dict], targets, by: str) -> dict:
    outcome = search.outcome or "unmeasurable"
    first_fail = next((p for p in points if p["load"] == search.first_fail), None)
    limit = ({"kind": "none", "explanation": "no load up to --max failed"} if first_fail is None else
             dict(zip(("kind", "explanation"), cs.diagnose(_failing(first_fail, targets), first_fail["server"]))))
    if outcome == "none_meets" and first_fail is not None and limit["kind"] != "kv_cache" and not (
            first_fail["server"] and first_fail["server"]["waiting_mean"] >= 1):
        limit = {"kind": "unloaded_speed", "explanation": (
            f"the server is too slow for these SLOs even at the lowest load ({first_fail['load']:g} "
            f"{UNITS[by]}): " + "; ".join(_check_text(c) for c in first_fail["checks"]))}
    if first_fail is not None and first_fail["stopped"] == "saturated":
        limit["explanation"] += "; the probe saw requests in flight and TTFT grow without bound (saturated)"
    if first_fail is not None and first_fail["client_saturated"]:
        # the latencies there include the generator's own queueing: they say nothing of the server
        limit = {"kind": "client", "explanation": (
            f"the load generator fell behind at {first_fail['load']:g} {UNITS[by]} ("
            + "; ".join(first_fail["client_reasons"]) + "): this capacity is the client's, not the server's; "
            "use more --workers or a bigger client machine")}
    return {"outcome": outcome, "by": by, "unit": UNITS[by], "capacity": search.last_pass,
            "last_pass": search.last_pass, "first_fail": search.first_fail, "precision": search.precision,
            "limited_by": limit}


def print_report(console: Console, points: list[dict], result: dict, targets) -> None:
    table = Table(title="bench capacity: every load tried", title_justify="left")
    for col in (result["unit"], "verdict", "measured", *[str(t) for t in targets], "goodput (req/s)", "within SLOs",
                "errors", "waiting", "KV max", "preempted"):
        table.add_column(col, justify="right")
    for p in sorted(points, key=lambda p: p["load"]):
        s, srv = p["summary"], p["server"] or {}
        cells = []
        for t in targets:
            v = s.get(f"{t.metric}_ms.{latency.percentile_key(t.percentile or 95)}")
            cells.append("-" if v is None else f"{v:,.0f}")
        table.add_row(f"{p['load']:g}", p["verdict"] + (" (close)" if p["close_call"] else ""), str(p["measured"]),
                      *cells, f"{s.get('goodput', 0):.3f}", f"{s.get('goodput_ratio', 0):.1%}",
                      str(s.get("requests.failed", 0)),
                      "-" if "waiting_mean" not in srv else f"{srv['waiting_mean']:.1f}",
                      "-" if "kv_usage_max" not in srv else f"{srv['kv_usage_max']:.0%}",
                      "-" if "preemptions" not in srv else f"{srv['preemptions']:g}")
    console.print(table)
    if result["outcome"] == "found":
        console.print(f"[bold]capacity: {result['capacity']:g} {result['unit']}[/bold] (last pass "
                      f"{result['last_pass']:g}, first fail {result['first_fail']:g}; precision "
                      f"{result['precision']:.0%})")
    elif result["outcome"] == "none_meets":
        console.print(f"[bold red]no load meets the SLOs[/bold red]: even {result['first_fail']:g} {result['unit']} "
                      "(--min) fails them")
    elif result["outcome"] == "all_meet":
        console.print(f"[bold yellow]even the highest load allowed meets the SLOs[/bold yellow]: capacity >= "
                      f"{result['last_pass']:g} {result['unit']} (raise --max to find it)")
    else:
        console.print("[bold red]the search could not finish[/bold red]")
    if result["limited_by"]["kind"] != "none":
        console.print(f"limited by: {result['limited_by']['explanation']}")
    notes = {p["server_note"] for p in points if p["server_note"]}
    for note in sorted(notes):
        console.print(f"note: {note}")


CSV_COLUMNS = ("load", "verdict", "close_call", "probes", "stopped", "sent", "measured", "failed", "goodput",
               "goodput_ratio", "request_throughput", "output_throughput", "waiting_mean", "kv_usage_max",
               "preemptions", "queue_s_mean")


def write_csv(path: str, points: list[dict]) -> None:
    import csv
    check_names = [c["name"] for c in points[0]["checks"]] if points else []
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS + tuple(f"{n} {k}" for n in check_names for k in ("value", "low", "high", "limit")))
        for p in sorted(points, key=lambda p: p["load"]):
            s, srv = p["summary"], p["server"] or {}
            w.writerow([p["load"], p["verdict"], p["close_call"], p["probes"], p["stopped"] or "", p["sent"],
                        p["measured"], s.get("requests.failed"), s.get("goodput"), s.get("goodput_ratio"),
                        s.get("request_throughput"), s.get("output_throughput"), srv.get("waiting_mean"),
                        srv.get("kv_usage_max"), srv.get("preemptions"), srv.get("queue_s_mean")]
                       + [c[k] for c in p["checks"] for k in ("value", "low", "high", "limit")])


class NoCapacity(Exception):
    """Stored as the run's error when the search found no capacity."""


def record(store, document: dict, at_capacity: list) -> int:
    """Into the results store: the capacity (and first failing load), and the requests measured at the capacity
    as iterations (TTFT, TPOT, end to end), so `bench regress` can compare latency at that load across commits.
    A search that found no capacity is stored as a failed run saying why."""
    settings, result = document["settings"], document["result"]
    config = {k: v for k, v in settings.items() if k not in ("label", "command", "client", "base_url", "finished_at")}
    unit = "requests_per_second" if result["by"] == "rate" else "concurrent_requests"
    run_id = None
    try:
        with store.run(kind="capacity", config=config, label=settings.get("label"),
                       name=f"capacity-{settings['model']}-{result['by']}") as run:
            run_id = run.id
            if result["outcome"] != "found":
                raise NoCapacity(f"{result['outcome']}: last pass {result['last_pass']}, first fail {result['first_fail']}")
            run.measure(f"capacity_{unit}", result["capacity"], unit=UNITS[result["by"]])
            run.measure(f"first_fail_{unit}", result["first_fail"], unit=UNITS[result["by"]])
            record_requests(run, at_capacity)
    except NoCapacity:
        pass
    return run_id


def settings(args, model: str, targets) -> dict:
    keep = ("by", "start", "min", "max", "precision", "ramp_factor", "burstiness", "arrival", "max_concurrency",
            "warmup", "min_requests", "min_duration", "max_probe_duration", "max_repeats", "max_error_rate", "seed",
            "endpoint", "dataset", "dataset_path", "input_len", "output_len", "range_ratio", "random_token_range",
            "prefix_len", "temperature", "extra_body", "label", "target")
    return {"base_url": args.base_url, "model": model, "slo": [str(t) for t in targets],
            **{k: getattr(args, k) for k in keep},
            "command": "python -m service bench capacity " + shlex.join(args.argv),
            "client": {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
                       "workers": args.workers}}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.argv = argv
    logging.getLogger("httpx").setLevel(logging.WARNING)
    console = Console() if Console().is_terminal else Console(width=150)
    try:
        targets, search = _setup(args)
        workload_kind = make_workload(args, args.seed)[1]
        if workload_kind == "ids" and args.endpoint == CHAT:
            raise Usage("token-id prompts need /v1/completions; use --random-prompt words for chat")
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(EXIT["usage"])
    try:
        store = open_store(args.db)
    except StoreError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(EXIT["usage"])
    try:
        model = args.model or discover_model(args.base_url, args.api_key)
    except (httpx.HTTPError, OSError, KeyError, IndexError, ValueError) as exc:
        console.print(f"[red]error:[/red] cannot reach an OpenAI-compatible server at {args.base_url}: {exc!r}")
        sys.exit(EXIT["unmeasurable"])
    steady = Steady(args.warmup, args.min_requests, args.min_duration, args.max_probe_duration, args.max_error_rate,
                    detect_saturation=args.by == "rate")
    mode = (f"goodput >= {args.target:g} within " if args.target is not None else "") + ", ".join(map(str, targets))
    console.print(f"bench capacity: {model} at {args.base_url}{args.endpoint}, by {args.by}, SLOs {mode}; "
                  f"load average {os.getloadavg()[0]:.2f}")
    if args.target is not None and any(t.percentile is not None for t in targets):
        console.print("note: with --target each SLO holds per request; the percentiles given are not used")
    document = {"settings": settings(args, model, targets), "points": [], "result": None}
    load_before = os.getloadavg()[0]
    points, requests = document["points"], {}
    while (load := search.next_load()) is not None and len(points) < MAX_POINTS:
        if args.by == "concurrency":
            steady.skip_first = int(load)  # the first wave finds the server empty
        point, requests[load] = measure(args, model, targets, load, args.seed + len(points), steady,
                                        args.server_metrics)
        points.append(point)
        console.print(point_line(len(points), point, UNITS[args.by]))
        if point["unreachable"]:
            console.print(f"[red]error:[/red] the server at {args.base_url} stopped answering (every request: "
                          "connect_error)")
            break
        search.record(load, point["verdict"] == "pass")
        if args.result_json:
            report.write_json(args.result_json, document)
    result = conclude(search, points, targets, args.by)
    document["result"] = result
    document["settings"]["client"]["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    document["settings"]["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print_report(console, points, result, targets)
    if args.result_json:
        report.write_json(args.result_json, document)
    if args.result_csv:
        write_csv(args.result_csv, points)
    if args.plot and points:
        from service.bench.loadgen.results.plots import plot_capacity
        console.print("plot: " + plot_capacity(document, args.plot, args.label or model))
    run_id = document["stored_run"] = record(store, document, requests.get(result["last_pass"], []))
    console.print(f"stored as run {run_id} in {store.url}", highlight=False)
    if result["outcome"] != "found":
        sys.exit(EXIT[result["outcome"]])
    return document
