"""What a load run leaves behind: the summary tables on the console, the result JSON and the per-request CSV."""

import csv
import json
import math

from rich.console import Console
from rich.table import Table

from service.bench.loadgen.send.request import RequestResult
from service.bench.loadgen.results.latency import tpot

# summary key, short name, what it is
LATENCIES = (("ttft_ms", "TTFT", "time to first token"), ("tpot_ms", "TPOT", "time per output token after the first"),
             ("itl_ms", "ITL", "gap between token chunks"), ("e2e_ms", "E2E", "end-to-end latency"))


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def print_summary(console: Console, summary: dict, title: str = "bench serve", crosscheck: dict | None = None,
                  generator: dict | None = None) -> None:
    """`generator`: the run's load_generator entry (workers, saturation), when it has one."""
    s = summary
    console.print(f"[bold]{title}[/bold]")
    overview = Table(show_header=False)
    overview.add_column("metric")
    overview.add_column("value", justify="right")
    rows = [("requests sent / completed / failed",
             f"{s['requests.sent']} / {s['requests.completed']} / {s['requests.failed']}"),
            ("duration (s)", _fmt(s["duration_s"])),
            ("input / output tokens", f"{s['input_tokens']:,} / {s['output_tokens']:,}"),
            ("request throughput (req/s)", _fmt(s["request_throughput"], 3)),
            ("output token throughput (tok/s)", _fmt(s["output_throughput"], 1)),
            ("total token throughput (tok/s)", _fmt(s["total_throughput"], 1))]
    if "goodput" in s:
        rows.append(("goodput (req/s within all SLOs)", f"{_fmt(s['goodput'], 3)} ({s['goodput_ratio']:.1%} of sent)"))
        rows += [(f"  met {k.split('.', 1)[1]} SLO", f"{v:.1%}") for k, v in s.items() if k.startswith("slo_attainment.")]
    rows += [(f"error {k.split('.', 1)[1]}", str(v)) for k, v in s.items() if k.startswith("errors.")]
    if s.get("requests.without_usage"):
        rows.append(("completed without usage (tokens counted from chunks)", str(s["requests.without_usage"])))
    for row in rows:
        overview.add_row(*row)
    console.print(overview)

    keys = [k.split(".", 1)[1] for k in s if k.startswith("ttft_ms.")]
    latency = Table(title="latency (ms)", title_justify="left")
    latency.add_column("")
    for k in keys:
        latency.add_column(k, justify="right")
    for name, short, _ in LATENCIES:
        latency.add_row(short, *[_fmt(s.get(f"{name}.{k}")) for k in keys])
    console.print(latency)

    gen = Table(title="load generator", show_header=False, title_justify="left")
    gen.add_column("metric")
    gen.add_column("value", justify="right")
    gen.add_row("offered / scheduled / achieved send rate (req/s)", " / ".join(
        _fmt(s[k], 2) if s[k] is not None else ("inf" if k == "offered_rate" else "-")
        for k in ("offered_rate", "scheduled_rate", "achieved_rate")))
    gen.add_row("dispatch lag mean / p99 / max (ms)", " / ".join(
        _fmt(s[f"dispatch_lag_ms.{k}"], 3) for k in ("mean", "p99", "max")))
    gen.add_row("concurrency mean / max", f"{_fmt(s['concurrency.mean'])} / {s['concurrency.max']}")
    if "generator.cpu_s" in s:
        gen.add_row("generator CPU (s, share of one core)",
                    f"{_fmt(s['generator.cpu_s'])} ({s['generator.cpu_share']:.1%})")
    if generator:
        for w in generator["workers"]:
            lag = w["dispatch_lag_p99_ms"]
            gen.add_row(f"worker {w['rank']}: requests / CPU share / dispatch lag p99 (ms)",
                        f"{w['sent']} / {w['cpu_share']:.0%} / {'-' if lag is None else _fmt(lag, 3)}")
    console.print(gen)
    if generator and generator["saturated"]:
        console.print("[bold red]warning: the load generator fell behind[/bold red] ("
                      + "; ".join(generator["reasons"]) + "): its latencies include its own queueing; "
                      "use more --workers or a bigger client machine", highlight=False)

    if crosscheck is not None:
        print_crosscheck(console, crosscheck)


def print_crosscheck(console: Console, crosscheck: dict) -> None:
    if crosscheck.get("note"):
        console.print(f"[bold]server cross-check:[/bold] {crosscheck['note']}")
    if not crosscheck.get("rows"):
        return
    table = Table(title=f"server cross-check (/metrics deltas, {crosscheck['kind']} names)", title_justify="left")
    for col in ("quantity", "client", "server", "tolerance", "agrees"):
        table.add_column(col, justify="left" if col in ("quantity", "tolerance") else "right")
    for name, row in crosscheck["rows"].items():
        table.add_row(name, _fmt(row["client"]), _fmt(row["server"]), row["tolerance"],
                      "yes" if row["agrees"] else "[red]NO[/red]")
    console.print(table)


def _clean(value):
    """JSON has no inf or NaN: write them as null (an infinite rate is kept as the string 'inf')."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value == math.inf else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: str, document: dict) -> None:
    with open(path, "w") as f:
        json.dump(_clean(document), f, indent=2, allow_nan=False)
        f.write("\n")


CSV_COLUMNS = ("point", "index", "scheduled_s", "ready_s", "sent_s", "ended_s", "dispatch_lag_ms", "status", "error",
               "prompt_tokens", "output_tokens", "usage_reported", "chunks", "ttft_ms", "tpot_ms", "e2e_ms",
               "itl_ms", "exception", "where", "message")


def csv_row(r: RequestResult, point="") -> dict:
    ms = lambda x: "" if x is None else f"{x * 1e3:.3f}"
    t = tpot([r.e2e], [r.ttft], [r.output_tokens]) if r.ok else [math.nan]
    return {"point": point, "index": r.index, "scheduled_s": f"{r.scheduled:.6f}", "ready_s": f"{r.ready:.6f}",
            "sent_s": f"{r.sent:.6f}", "ended_s": f"{r.ended:.6f}", "dispatch_lag_ms": ms(r.sent - r.ready),
            "status": r.status if r.status is not None else "", "error": r.error or "",
            "prompt_tokens": "" if r.prompt_tokens is None else r.prompt_tokens,
            "output_tokens": "" if r.output_tokens is None else r.output_tokens,
            "usage_reported": int(r.usage_reported), "chunks": len(r.chunk_times), "ttft_ms": ms(r.ttft),
            "tpot_ms": "" if math.isnan(t[0]) else ms(float(t[0])), "e2e_ms": ms(r.e2e),
            "itl_ms": " ".join(f"{g * 1e3:.3f}" for g in r.itl), "exception": r.exception,
            "where": "" if r.ok else r.where, "message": r.message}


def write_csv(path: str, points: list[tuple[object, list[RequestResult]]]) -> None:
    """One row per request; `point` is the sweep value (empty for a single run); itl_ms is space-separated."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for point, results in points:
            writer.writerows(csv_row(r, point) for r in results)
