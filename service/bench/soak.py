"""`bench soak`: hours of mixed traffic against a server, watching its resources for anything that grows.

Streamed and non-streamed requests, clients that leave mid-stream or time out, hostile bodies and overload
bursts run for --duration seconds, sent from the load generator's --workers processes (as bench serve's and
bench capacity's load), while the server's /metrics is sampled: RSS, open fds, threads, asyncio tasks (each
summed over the engine process and every front end) and KV blocks in use. Once idle again, it must be back where
it started (no fd, thread, task or block left behind), RSS must not keep climbing, and no request may get an
unexpected status. Writes soak.csv (the samples), soak.json (the verdict) and soak.png, records the run in the
results store (--db), and exits 1 on a failed check.
"""

import argparse
import asyncio
import csv
import json
import logging
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.bench import child, flags
from service.bench.loadgen.send.dispatch import LoadSpec
from service.bench.loadgen.send.request import RequestResult
from service.bench.loadgen.send.workers import run_workers
from service.bench.loadgen.serve import discover_model
from service.bench.loadgen.workload.mix import Mix, burst_times
from service.bench.store import StoreError, add_db_argument, open_store

# the series sampled from /metrics: column -> metric sample name
WATCHED = {"rss_bytes": "process_resident_memory_bytes", "open_fds": "process_open_fds",
           "threads": "llm_process_threads", "asyncio_tasks": "llm_asyncio_tasks",
           "kv_blocks_used": "llm_kv_cache_blocks_used", "running": "llm_requests_running",
           "waiting": "llm_requests_waiting"}


@dataclass
class Tally:
    """What the clients saw, by kind of request and outcome."""

    counts: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)  # the first few surprises, for the report

    def add(self, what: str, ok: bool = True, detail: str = "") -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        if not ok and len(self.unexpected) < 20:
            self.unexpected.append(f"{what}: {detail}"[:300])

    @property
    def num_unexpected(self) -> int:
        return sum(n for k, n in self.counts.items() if k.startswith("unexpected"))


class Soak:
    """The load goes out from the load generator's worker processes (as bench serve's and capacity's does); this
    process samples the server's /metrics meanwhile and tallies the merged results."""

    def __init__(self, url: str, api_key: str | None, metrics_token: str | None, seed: int,
                 request_timeout: float = 600.0, workers: int = 1):
        self.url = url.rstrip("/")
        self.api_key, self.seed, self.workers = api_key, seed, workers
        self.request_timeout = request_timeout  # past it a slow answer counts as unexpected
        self.metrics_headers = {"Authorization": f"Bearer {metrics_token}"} if metrics_token else {}
        self.tally = Tally()
        self.model = ""
        self.finished = 0  # requests that have ended, for the samples' `requests` column

    async def load(self, mix: Mix, duration: float, **how) -> None:
        """One load of `duration` seconds from the worker processes; every answer goes into the tally."""
        spec = LoadSpec(self.url, self.model, duration=duration, seed=self.seed, api_key=self.api_key,
                        request_timeout=self.request_timeout, **how)
        run = await run_workers(spec, mix, self.workers, on_done=self.count)
        for r in run.results:
            name, ok = mix.outcome(r)
            self.tally.add(name, ok, r.message)

    def count(self, _: RequestResult) -> None:
        self.finished += 1

    async def sample(self, client: httpx.AsyncClient) -> dict[str, float]:
        r = await client.get(self.url + "/metrics", headers=self.metrics_headers)
        r.raise_for_status()
        # per-process series (label `process`: the engine and every front end) are summed, so that growth in
        # any one process shows; the others appear once
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                values[s.name] = values.get(s.name, 0.0) + s.value
        return {col: values.get(name, float("nan")) for col, name in WATCHED.items()}

    async def sampler(self, rows: list[dict], start: float, done: asyncio.Event, every: float) -> None:
        """Samples until the load's last request has finished."""
        async with httpx.AsyncClient(timeout=30) as client:
            while not done.is_set():
                rows.append({"t": round(time.monotonic() - start, 2), "phase": "load", **await self.sample(client),
                             "requests": self.finished})
                try:
                    await asyncio.wait_for(done.wait(), every)
                except asyncio.TimeoutError:
                    pass

    async def idle_sample(self, start: float, timeout: float = 120.0) -> dict:
        """Once the server holds no request and no block (fresh connection: the load's ones are closed)."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=30) as c:
            while True:
                s = await self.sample(c)
                if (s["running"] == s["waiting"] == s["kv_blocks_used"] == 0) or time.monotonic() > deadline:
                    await asyncio.sleep(1.0)  # let closed connections' fds and finished tasks go
                    s = await self.sample(c)
                    return {"t": round(time.monotonic() - start, 2), "phase": "idle", **s, "requests": self.finished}
                await asyncio.sleep(0.5)

    async def run(self, duration: float, concurrency: int, sample_every: float, burst_every: float,
                  burst_size: int, warmup: float) -> list[dict]:
        self.model = await asyncio.to_thread(discover_model, self.url, self.api_key)
        start = time.monotonic()
        steady = dict(max_concurrency=concurrency)  # clients sending back to back
        if warmup > 0:  # first-use allocations, before the first idle sample
            await self.load(Mix(self.seed), warmup, **steady)
        rows = [await self.idle_sample(start)]
        done = asyncio.Event()
        sampling = asyncio.create_task(self.sampler(rows, start, done, sample_every))
        loads = [self.load(Mix(self.seed), duration, **steady)]
        if bursts := burst_times(duration, burst_every, burst_size):
            loads.append(self.load(Mix(self.seed, burst=True), duration, schedule=bursts, num_requests=len(bursts)))
        try:
            await asyncio.gather(*loads)
        finally:
            done.set()
            await sampling
        rows.append(await self.idle_sample(start))
        return rows


def verdict(rows: list[dict], tally: Tally, rss_growth_mib: float) -> dict:
    """The checks: idle end vs idle start, RSS trend over the load, and what the clients saw."""
    first, last = rows[0], rows[-1]
    load = [r for r in rows if r["phase"] == "load"]
    fifth = max(1, len(load) // 5)
    median = lambda xs: sorted(xs)[len(xs) // 2]
    # RSS over the second fifth of the load (past the allocator's first growth) vs the last fifth
    rss_early = median([r["rss_bytes"] for r in load[fifth:2 * fifth]] or [first["rss_bytes"]])
    rss_late = median([r["rss_bytes"] for r in load[-fifth:]] or [last["rss_bytes"]])
    checks = {
        "open_fds back to idle": last["open_fds"] <= first["open_fds"] + 4,
        "threads back to idle": last["threads"] <= first["threads"] + 2,
        "asyncio tasks back to idle": last["asyncio_tasks"] <= first["asyncio_tasks"] + 2,
        "no KV block held when idle": last["kv_blocks_used"] == 0,
        f"RSS grew under {rss_growth_mib:.0f} MiB over the load": rss_late - rss_early < rss_growth_mib * 2**20,
        "every request got the expected answer": tally.num_unexpected == 0,
    }
    return {"passed": all(checks.values()), "checks": checks, "idle_start": first, "idle_end": last,
            "rss_load_early_bytes": rss_early, "rss_load_late_bytes": rss_late,
            "peak": {k: max(r[k] for r in rows) for k in WATCHED}, "requests": tally.counts,
            "num_requests": sum(tally.counts.values()), "unexpected": tally.unexpected}


def write(out: Path, rows: list[dict], result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "soak.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "soak.json").write_text(json.dumps(result, indent=2, default=str))
    panels = [("rss_bytes", "RSS (MiB)", 2**20), ("open_fds", "open fds", 1), ("threads", "threads", 1),
              ("asyncio_tasks", "asyncio tasks", 1), ("kv_blocks_used", "KV blocks used", 1),
              ("requests", "requests done", 1)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 12), sharex=True)
    minutes = [r["t"] / 60 for r in rows]
    for ax, (col, label, scale) in zip(axes, panels):
        ax.plot(minutes, [r[col] / scale for r in rows], lw=1)
        ax.scatter([minutes[0], minutes[-1]], [rows[0][col] / scale, rows[-1][col] / scale], color="red", s=12,
                   zorder=3, label="idle")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    axes[-1].set_xlabel("minutes")
    fig.suptitle(f"soak: {result['num_requests']} requests, {'passed' if result['passed'] else 'FAILED'}")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)
    plt.close(fig)


def spawn(server_args: list[str], port: int) -> tuple[subprocess.Popen, str]:
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--port", str(port), *server_args])
    if child.answers(proc, url + "/ready", 600, 1):
        return proc, url
    proc.kill()
    raise SystemExit(f"the server ({shlex.join(server_args)}) did not become ready")


def measure_into(run, rows: list[dict], result: dict) -> None:
    """Into the results store: the verdict's figures as measurements, every /metrics sample as a sample."""
    first, last = result["idle_start"], result["idle_end"]
    run.measure("soak_requests", result["num_requests"], unit="requests")
    run.measure("soak_unexpected_responses", len(result["unexpected"]), unit="requests")
    run.measure("soak_rss_growth_bytes", result["rss_load_late_bytes"] - result["rss_load_early_bytes"], unit="B")
    for col in ("open_fds", "threads", "asyncio_tasks", "kv_blocks_used"):
        run.measure(f"soak_idle_{col}_delta", last[col] - first[col])
    for r in rows:
        run.sample({k: r[k] for k in WATCHED}, t=r["t"])


class SoakFailed(Exception):
    pass


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The soak's settings, and the arguments after -- for the server it starts."""
    ap = argparse.ArgumentParser(prog="service bench soak", description=__doc__,
                                 epilog="Arguments after -- go to the server this starts (without --url).")
    a = ap.add_argument
    a("--url", default=None, help="a running server; default: start `python -m service serve` on --port")
    a("--port", type=int, default=8011, help="port of the server this starts (default %(default)s)")
    a("--api-key", default=None, help="the server's API key, sent as a Bearer token with every request")
    a("--metrics-token", default=None, help="the Bearer token the server's /metrics asks for")
    a("--duration", type=float, default=1800.0, help="seconds of load (default %(default)s)")
    # dests "warmup" and "out": the names soak.json's settings and the stored configuration have always used
    flags.deprecated_alias(ap, "--warmup", flags.add_warmup_seconds(ap, 30.0, "seconds of load before the first idle "
                                                                              "sample", dest="warmup"))
    a("--concurrency", type=int, default=6, help="clients sending back to back (default %(default)s)")
    flags.add_workers(ap)
    a("--sample-interval", type=float, default=5.0, help="seconds between /metrics samples (default %(default)s)")
    a("--burst-interval", type=float, default=60.0, help="seconds between overload bursts (default %(default)s)")
    a("--burst-size", type=int, default=48, help="requests in one burst (default %(default)s)")
    a("--rss-growth-mib", type=float, default=64.0, help="most RSS growth allowed over the load (default %(default)s)")
    a("--request-timeout", type=float, default=600.0, help="seconds a client waits for an answer before it counts "
      "as unexpected (default %(default)s: generous, since overload bursts queue requests)")
    a("--seed", type=int, default=0, help="seeds the prompts and the traffic's mix (default %(default)s)")
    out = a("--out-dir", type=Path, default=Path("soak-results"), dest="out", metavar="DIR",
            help="where soak.csv, soak.json and soak.png go (default %(default)s)")
    flags.deprecated_alias(ap, "--out", out)
    a("--label", default=None, help="a label for the run in the results store")
    add_db_argument(ap)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else ["--max-waiting", "16", "--log-level", "warning"]
    return ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv), server_args


def main(argv: list[str] | None = None) -> None:
    args, server_args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the report
    # --workers says where the load ran, not what load: runs that differ only in it are one configuration
    config = {k: v for k, v in vars(args).items()
              if k not in ("db", "label", "out", "api_key", "metrics_token", "workers")}
    config["server_args"] = server_args
    try:
        store = open_store(args.db)  # before the hours of load: a wrong --db fails at once
        with store.run(kind="soak", config=config, label=args.label) as run:
            result = soak_once(args, server_args)
            measure_into(run, result.pop("rows"), result)
            if not result["passed"]:
                raise SoakFailed("failed: " + ", ".join(k for k, ok in result["checks"].items() if not ok))
    except StoreError as exc:
        sys.exit(f"bench soak: {exc}")
    except SoakFailed as exc:
        sys.exit(f"bench soak {exc}")


def soak_once(args: argparse.Namespace, server_args: list[str]) -> dict:
    """Start the server (unless --url), run the soak, write its files, print the verdict; return it."""
    proc, url = (None, args.url) if args.url else spawn(server_args, args.port)
    try:
        soak = Soak(url, args.api_key, args.metrics_token, args.seed, args.request_timeout, args.workers)
        rows = asyncio.run(soak.run(args.duration, args.concurrency, args.sample_interval, args.burst_interval,
                                    args.burst_size, args.warmup))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    result = verdict(rows, soak.tally, args.rss_growth_mib)
    result["settings"] = {**vars(args), "out": str(args.out), "server_args": server_args}
    write(args.out, rows, result)
    for name, ok in result["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    first, last = result["idle_start"], result["idle_end"]
    print(f"{result['num_requests']} requests; idle start -> end: RSS {first['rss_bytes'] / 2**20:.0f} -> "
          f"{last['rss_bytes'] / 2**20:.0f} MiB, fds {first['open_fds']:.0f} -> {last['open_fds']:.0f}, threads "
          f"{first['threads']:.0f} -> {last['threads']:.0f}, tasks {first['asyncio_tasks']:.0f} -> "
          f"{last['asyncio_tasks']:.0f}, KV blocks {first['kv_blocks_used']:.0f} -> {last['kv_blocks_used']:.0f}")
    print(f"written: {args.out}/soak.csv, soak.json, soak.png")
    return {**result, "rows": rows}
