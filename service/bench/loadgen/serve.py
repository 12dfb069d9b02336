"""`bench serve`: load any OpenAI-compatible server with streamed requests and report latency, throughput and goodput.

Open loop (--request-rate, Poisson or gamma-bursty or constant arrivals), closed loop (--max-concurrency), or
both; bounded by --num-requests and/or --duration. A rich progress bar while running, summary tables at the end,
JSON of the settings and the summary, CSV of every request, and --sweep over rates or concurrencies with plots.
"""

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import shlex
import sys
import time

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from service.bench import flags
from service.bench.loadgen.results import crosscheck, latency, report
from service.bench.loadgen.results.saturation import client_saturation
from service.bench.loadgen.results.record import record_run
from service.bench.loadgen.results.summary import summarize
from service.bench.loadgen.send.dispatch import LoadSpec
from service.bench.loadgen.send.workers import run_workers
from service.bench.loadgen.send.request import CHAT, COMPLETIONS
from service.bench.loadgen.workload import datasets
from service.bench.slo import parse as parse_slo
from service.bench.store import StoreError, add_db_argument, open_store


def add_server_arguments(ap: argparse.ArgumentParser) -> None:
    """Which server, how to talk to it, and what each request asks for (shared with bench capacity)."""
    g = ap.add_argument_group("server")
    a = g.add_argument
    url = flags.add_url(g, "http://127.0.0.1:8000", "server root; the endpoint path is appended (default %(default)s)",
                        dest="base_url")
    flags.deprecated_alias(g, "--base-url", url)
    a("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT], help="the route every request goes to "
      "(default %(default)s)")
    a("--model", default=None, help="model name to send; default: the first one GET /v1/models lists")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token (default: $OPENAI_API_KEY)")
    a("--request-timeout", type=float, default=600.0, help="seconds a request may take in all before it is an error (default %(default)s)")
    a("--extra-body", default=None, help="JSON object merged into every request body, e.g. '{\"top_k\": 1}'")
    a("--temperature", type=float, default=0.0, help="sampling temperature sent with every request; 0 is greedy "
      "(default %(default)s)")
    ignore_eos = flags.add_switch(g, "ignore-eos", None, "send ignore_eos so every request generates max_tokens "
                                  "(default: on for the random dataset only)", bare_deprecated=True)
    flags.deprecated_alias(g, "--no-ignore-eos", ignore_eos, value=False)


def add_server_metrics_argument(ap: argparse.ArgumentParser, old: str) -> None:
    """--server-metrics on|off: scrape the server's /metrics (`old`: this command's deprecated spelling of off)."""
    switch = flags.add_switch(ap, "server-metrics", True, "read the server's /metrics")
    flags.deprecated_alias(ap, old, switch, value=False)


def add_prompt_arguments(ap: argparse.ArgumentParser) -> None:
    a = ap.add_argument_group("prompts").add_argument
    a("--dataset", choices=["random", "builtin", "sharegpt"], default="random",
      help="where prompts come from: random (ids or words, as --random-prompt says), the built-in prompts, or a "
           "ShareGPT file (--dataset-path) (default %(default)s)")
    a("--dataset-path", default=None, help="the ShareGPT JSON file")
    a("--input-len", type=int, default=128, help="random: prompt tokens (default %(default)s)")
    a("--output-len", type=int, default=None, help="max_tokens of every request (default: 64 for random, each "
      "sample's own otherwise)")
    a("--range-ratio", type=float, default=0.0, help="random: lengths uniform in [len * (1 - r), len * (1 + r)] (default %(default)s)")
    a("--random-prompt", choices=["auto", "ids", "words"], default="auto",
      help="random: token ids (exact lengths; completions only) or random common words (about one token each); "
           "auto (default): ids on /v1/completions, words on chat")
    a("--random-token-range", default="1000:10000", help="random ids: LOW:HIGH, inside the server's vocabulary "
                                                         "and clear of special tokens (default %(default)s)")
    a("--prefix-len", type=int, default=0, help="random: tokens of one shared prefix before every prompt")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="service bench serve", description=__doc__)
    add_server_arguments(ap)
    add_server_metrics_argument(ap, "--no-crosscheck")
    a = ap.add_argument_group("load").add_argument
    a("--request-rate", type=float, default=math.inf, help="requests per second; inf (the default) sends all at once")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the inter-arrival gaps; 1 is Poisson, "
                                                      "lower is burstier (default %(default)s)")
    a("--arrival", choices=["gamma", "constant"], default="gamma", help="gamma (default): gaps drawn as --burstiness says; constant: evenly spaced")
    a("--max-concurrency", type=int, default=None, help="most requests in flight (closed loop)")
    a("--num-requests", type=int, default=None, help="requests to send (default 100 when no --duration)")
    a("--duration", type=float, default=None, help="seconds after which no request is sent")
    a("--seed", type=int, default=0, help="seeds the prompts, their lengths and the arrival times (default %(default)s)")
    flags.add_workers(ap)
    add_prompt_arguments(ap)
    g = ap.add_argument_group("results")
    a = g.add_argument
    a("--slo", action="append", default=[], metavar="METRIC:VALUE",
      help="repeatable: a bound on every request, for goodput: ttft, tpot, itl (a request's largest gap) or "
           "e2e, in ms or s, e.g. ttft:500ms (grammar: service/bench/slo.py)")
    a("--percentiles", default="50,90,95,99", help="the latency percentiles reported, a comma list "
      "(default %(default)s)")
    flags.deprecated_alias(g, "--result-json", flags.add_json(g, dest="result_json"))
    flags.deprecated_alias(g, "--result-csv", flags.add_csv(g, "write one row per request here", dest="result_csv"))
    a("--sweep", default=None, metavar="{rate,concurrency}:V1,V2,...", help="one run per value")
    a("--plot-dir", default=None, help="with --sweep: write latency.png and goodput.png here")
    a("--replot", default=None, metavar="SWEEP.json", help="draw the plots of a saved sweep result into "
                                                           "--plot-dir instead of running anything")
    a("--label", default=None, help="a name for this run in the results and plots")
    flags.add_progress(g)
    add_db_argument(ap)
    return ap.parse_args(argv)


def parse_sweep(text: str) -> tuple[str, list[float]]:
    axis, _, values = text.partition(":")
    if axis not in ("rate", "concurrency") or not values:
        raise ValueError(f"--sweep is rate:V1,V2,... or concurrency:V1,V2,..., got {text!r}")
    parsed = [float(v) for v in values.split(",") if v.strip()]
    if not parsed or not all(0 < v < math.inf for v in parsed):
        raise ValueError(f"sweep values must be finite and > 0, got {values!r}")
    if axis == "concurrency" and not all(v == int(v) for v in parsed):
        raise ValueError("concurrency values must be whole numbers")
    return axis, parsed


def discover_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def make_workload(args: argparse.Namespace, seed: int):
    if args.dataset == "random":
        low, _, high = args.random_token_range.partition(":")
        kind = args.random_prompt if args.random_prompt != "auto" else ("words" if args.endpoint == CHAT else "ids")
        return datasets.RandomWorkload(args.input_len, args.output_len or 64, args.range_ratio, seed, kind,
                                       (int(low), int(high)), args.prefix_len), kind
    if args.dataset == "builtin":
        return datasets.builtin(args.output_len, seed), "text"
    if not args.dataset_path:
        raise ValueError("--dataset sharegpt needs --dataset-path")
    return datasets.sharegpt(args.dataset_path, args.output_len, seed), "text"


def run_settings(args: argparse.Namespace, spec: LoadSpec, prompt_kind: str) -> dict:
    """Everything needed to run the same load again (the API key excepted), and where it ran."""
    keys = ("label", "dataset", "dataset_path", "input_len", "output_len", "range_ratio", "random_token_range",
            "prefix_len", "slo", "percentiles", "arrival")
    return {"base_url": spec.base_url, "endpoint": spec.endpoint, "model": spec.model,
            "request_rate": spec.request_rate, "burstiness": spec.burstiness, "max_concurrency": spec.max_concurrency,
            "num_requests": spec.num_requests, "duration": spec.duration, "seed": spec.seed,
            "ignore_eos": spec.ignore_eos, "temperature": spec.temperature, "extra_body": spec.extra_body,
            "request_timeout": spec.request_timeout, "prompt_kind": prompt_kind,
            **{k: getattr(args, k) for k in keys},
            "command": "python -m service bench serve " + shlex.join(args.argv),
            "client": {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
                       "cpus": os.cpu_count()}}


def describe(spec: LoadSpec, args: argparse.Namespace) -> str:
    """The load in one line, for the log."""
    size = " and ".join(filter(None, [f"{spec.num_requests} requests" if spec.num_requests else "",
                                      f"{spec.duration:g} s" if spec.duration else ""]))
    arrivals = "all at once" if math.isinf(spec.request_rate) else (
        f"{spec.request_rate:g} req/s " + ("constant" if spec.constant_rate else
                                           "Poisson" if spec.burstiness == 1 else f"gamma, burstiness {spec.burstiness:g}"))
    cap = f", at most {spec.max_concurrency} in flight" if spec.max_concurrency else ""
    return f"{size}, {arrivals}{cap}; dataset {args.dataset}, seed {spec.seed}"


def _progress(console: Console, spec: LoadSpec, enabled: bool):
    """A rich progress bar over requests (or over seconds in a duration-only run) and a completion callback."""
    if not enabled:
        return None, lambda result: None
    by_time = spec.num_requests is None
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[errors]}"),
                   TimeElapsedColumn(), console=console, refresh_per_second=4, transient=False)
    task = bar.add_task("seconds" if by_time else "requests", total=spec.duration if by_time else spec.num_requests,
                        errors="", completed=0)
    errors, start = [0], time.perf_counter()

    def on_done(result) -> None:
        errors[0] += not result.ok
        label = f"{errors[0]} errors" if errors[0] else ""
        if by_time:
            bar.update(task, completed=min(spec.duration, int(time.perf_counter() - start)), errors=label)
        else:
            bar.update(task, advance=1, errors=label)
    return bar, on_done


def run_once(args: argparse.Namespace, spec: LoadSpec, workload, prompt_kind: str, percentiles, slos,
             console: Console) -> tuple[dict, list]:
    """One run: scrape, load, scrape again; returns the result document and the per-request results."""
    check = args.server_metrics
    before, why = crosscheck.scrape(spec.base_url, spec.api_key) if check else (None, "skipped (--server-metrics off)")
    bar, on_done = _progress(console, spec, args.progress)
    load_before = os.getloadavg()[0]
    if bar:
        bar.start()
    try:
        run = asyncio.run(run_workers(spec, workload, args.workers, on_done))
    finally:
        if bar:
            bar.stop()
    summary = summarize(run.results, run.duration, percentiles, slos, spec.request_rate, run.cpu_seconds)
    settings = run_settings(args, spec, prompt_kind)
    settings["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(run.started_at))
    # other work on the client's machine (a server on the same host, say) shows up in every latency
    settings["client"]["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    settings["client"]["workers"] = len(run.workers)  # where it ran, not what load: results do not depend on it
    document = {"settings": settings, "summary": summary,
                "load_generator": client_saturation(run.results, run.workers),
                "crosscheck": crosscheck.check_run(spec.base_url, spec.api_key, spec.model, before, why, run.results)
                if check else {"note": why}}
    return document, run.results


def replot(args: argparse.Namespace, console: Console) -> list[dict]:
    from service.bench.loadgen.results.plots import plot_sweep
    try:
        with open(args.replot) as f:
            document = json.load(f)
        sweep, runs = document["sweep"], document["runs"]
    except (OSError, ValueError, KeyError) as exc:
        console.print(f"[red]error:[/red] {args.replot} is not a saved sweep ({exc!r})")
        sys.exit(2)
    label = args.label or runs[0]["settings"].get("label") or runs[0]["settings"]["model"]
    console.print("plots: " + ", ".join(plot_sweep(sweep["axis"], sweep["values"], runs, args.plot_dir or ".", label)))
    return runs


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.argv = argv
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a log line per request would cost the generator time
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # logs and pipes: wide enough that the tables do not wrap
    if args.replot:
        return replot(args, console)
    try:
        percentiles = latency.parse_percentiles(args.percentiles)
        slos = [parse_slo(s) for s in args.slo]
        if any(s.percentile is not None for s in slos):
            raise ValueError("bench serve bounds every request (--slo ttft:500ms) and counts goodput by them; "
                             "a percentile target (ttft:p95<=500ms) is for bench capacity")
        sweep = parse_sweep(args.sweep) if args.sweep else None
        workload, prompt_kind = make_workload(args, args.seed)
        if prompt_kind == "ids" and args.endpoint == CHAT:
            raise ValueError("token-id prompts need /v1/completions; use --random-prompt words for chat")
        extra = json.loads(args.extra_body) if args.extra_body else {}
        model = args.model or discover_model(args.base_url, args.api_key)
        store = open_store(args.db)
    except (ValueError, OSError, httpx.HTTPError, KeyError, IndexError, StoreError) as exc:
        console.print(f"[red]error:[/red] {exc!r}" if isinstance(exc, LookupError) else f"[red]error:[/red] {exc}")
        sys.exit(2)
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset == "random"
    num_requests = args.num_requests if args.num_requests or args.duration else 100
    base = LoadSpec(args.base_url, model, args.endpoint, args.request_rate, args.burstiness, args.arrival == "constant",
                    args.max_concurrency, num_requests, args.duration, args.seed, ignore_eos, args.temperature, extra,
                    args.request_timeout, args.api_key)
    points = [(None, base, workload)]
    if sweep:
        # Each point gets its own seed (seed + k): with the same prompts, a later point would find them in the
        # server's prefix cache and look faster than it is.
        field = "request_rate" if sweep[0] == "rate" else "max_concurrency"
        cast = float if sweep[0] == "rate" else int
        points = [(v, LoadSpec(**{**base.__dict__, field: cast(v), "seed": args.seed + k}),
                   make_workload(args, args.seed + k)[0]) for k, v in enumerate(sweep[1])]
    try:
        for _, spec, _ in points:
            spec.check()
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        sys.exit(2)

    documents, per_request = [], []
    for value, spec, workload in points:
        title = f"bench serve: {model} at {args.base_url}{spec.endpoint}" + (
            f" ({sweep[0]} = {value:g})" if sweep else "")
        console.print(f"{title}: {describe(spec, args)}")
        document, results = run_once(args, spec, workload, prompt_kind, percentiles, slos, console)
        report.print_summary(console, document["summary"], title, document["crosscheck"], document["load_generator"])
        documents.append(document)
        per_request.append(("" if value is None else value, results))
        run_id = record_run(store, document, results, f"serve-{model}" + (f"-{sweep[0]}{value:g}" if sweep else ""))
        console.print(f"stored as run {run_id} in {store.url}", highlight=False)
        # written after every point, so that an interrupted sweep keeps the points it finished
        if args.result_json:
            report.write_json(args.result_json, documents[0] if not sweep else
                              {"sweep": {"axis": sweep[0], "values": sweep[1][:len(documents)]}, "runs": documents})
        if args.result_csv:
            report.write_csv(args.result_csv, per_request)

    if sweep and args.plot_dir:
        from service.bench.loadgen.results.plots import plot_sweep
        paths = plot_sweep(sweep[0], sweep[1], documents, args.plot_dir, args.label or model)
        console.print("plots: " + ", ".join(paths))
    return documents
