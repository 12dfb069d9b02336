"""The numbers of the /dashboard page: a short history of the server's merged metrics, kept by one process.

Every INTERVAL the keeper gathers every process's metrics (the same snapshots /metrics merges: one truth), turns
them into one point (rates, latency percentiles, gauges) and appends it to a ring of WINDOW seconds: bounded
memory, no database. The supervisor of a served server keeps it (it sees every process and is on no request's
path) and answers the front ends on an `ipc://` socket (gather's Responder and Asker, as /metrics asks the
processes), so that every front end shows the same view; a
server whose engine runs on a thread of its one process keeps it there. The page asks for the points after the
last one it has (`view(since)`), so a poll carries one point, not fifteen minutes.

A point's rates are over the last RATE_WINDOW seconds; its latency percentiles over the last QUANTILE_WINDOW,
interpolated in the histogram's buckets as Prometheus's histogram_quantile does. The alert thresholds drawn on
the charts are read from the rule file the alerts use (thresholds.yml, a link to deploy/rules/llm-thresholds.yml).
"""

import asyncio
import bisect
import heapq
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from importlib import resources

import msgspec
import yaml

from service.telemetry import gather
from service.telemetry.metrics import histogram_quantile

log = logging.getLogger(__name__)
INTERVAL = 1.0  # seconds between points
WINDOW = 900  # seconds of history kept (15 minutes)
RATE_WINDOW = 10.0  # seconds a point's rates are taken over
QUANTILE_WINDOW = 60.0  # seconds a point's latency percentiles are taken over
SLOWEST = 10  # requests in the table of the slowest
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
LATENCIES = {"ttft": "llm_time_to_first_token_seconds", "itl": "llm_time_per_output_token_seconds",
             "e2e": "llm_request_duration_seconds"}
# counters (summed over their labels), as a frame keys them
COUNTERS = {"llm_requests_received_total": "received", "llm_generation_tokens_total": "output_tokens",
            "llm_prompt_tokens_total": "prompt_tokens", "llm_preemptions_total": "preemptions",
            "llm_engine_step_host_seconds_sum": "host_sum", "llm_engine_step_host_seconds_count": "host_count",
            "llm_batch_tokens_sum": "batch_sum", "llm_batch_tokens_count": "batch_count"}
GAUGES = {"llm_requests_running": "running", "llm_requests_waiting": "waiting", "llm_kv_cache_usage_ratio": "kv_usage"}
PER_PROCESS = {"llm_event_loop_lag_seconds": "loop_lag", "llm_ipc_backlog": "ipc_backlog"}
PER_GPU = {"llm_gpu_utilization_ratio": "gpu_util", "llm_gpu_memory_used_bytes": "gpu_memory_used_bytes",
           "llm_gpu_memory_total_bytes": "gpu_memory_total_bytes", "llm_gpu_power_watts": "gpu_power_watts"}
FINISH = ("stop", "length", "abort", "error")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")  # whose 503s are refused requests


def thresholds() -> dict[str, float]:
    """The constants of the alert rules: `llm:threshold:NAME` as NAME, `llm:slo_objective:ratio{slo=S}` as
    slo_objective_S."""
    text = resources.files("service.telemetry").joinpath("thresholds.yml").read_text()
    found = {}
    for group in yaml.safe_load(text)["groups"]:
        for rule in group["rules"]:
            value = re.fullmatch(r"vector\(([0-9.eE+-]+)\)", str(rule["expr"]).strip())
            name = rule["record"]
            if value is None:
                continue
            if name.startswith("llm:threshold:"):
                found[name.removeprefix("llm:threshold:")] = float(value.group(1))
            elif name == "llm:slo_objective:ratio":
                found[f"slo_objective_{rule['labels']['slo']}"] = float(value.group(1))
    return found


class Frame:
    """The values of one gathering that points are made of: counters, gauges and cumulative latency buckets."""

    __slots__ = ("t", "counters", "gauges", "buckets")

    def __init__(self, t: float):
        self.t = t
        self.counters: dict[str, float] = {}
        self.gauges: dict[str, float] = {}
        self.buckets: dict[str, dict[float, float]] = {name: {} for name in LATENCIES}


def frame(families, t: float) -> Frame:
    """A Frame from merged metric families (service.telemetry.gather.merge)."""
    f = Frame(t)
    counters, gauges = f.counters, f.gauges
    latency = {f"{metric}_bucket": name for name, metric in LATENCIES.items()}

    def add(key, value):
        counters[key] = counters.get(key, 0.0) + value
    for family in families:
        for s in family.samples:
            name, labels = s.name, s.labels
            if name in COUNTERS:
                add(COUNTERS[name], s.value)
            elif name in latency:
                into = f.buckets[latency[name]]
                le = float(labels["le"])
                into[le] = into.get(le, 0.0) + s.value
            elif name == "llm_requests_total":
                add(f"finished:{labels.get('finish_reason')}", s.value)
            elif name == "llm_http_requests_total":
                if labels.get("status") == "503" and labels.get("route") in GENERATION_ROUTES:
                    add("rejected_503", s.value)
            elif name in ("llm_engine_step_seconds_sum", "llm_engine_step_seconds_count"):
                add(f"step_{name.rsplit('_', 1)[1]}:{labels.get('phase')}", s.value)
            elif name == "process_cpu_seconds_total":
                add(f"cpu:{labels.get('process', '')}", s.value)
            elif name in GAUGES:
                gauges[GAUGES[name]] = gauges.get(GAUGES[name], 0.0) + s.value
            elif name in PER_PROCESS:  # front ends' (the engine has no event loop, no backlog)
                if labels.get("process", "").startswith("api-"):
                    gauges[f"{PER_PROCESS[name]}:{labels.get('process', '')}"] = s.value
            elif name in PER_GPU:
                gauges[f"{PER_GPU[name]}:{labels.get('gpu', '')}"] = s.value
    return f


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """histogram_quantile (telemetry/metrics.py) over (upper bound, cumulative count) pairs."""
    return histogram_quantile(q, dict(buckets))


def point(new: Frame, rate_from: Frame | None, quantile_from: Frame | None) -> dict[str, float | None]:
    """One point of every series: rates since `rate_from`, percentiles of what was observed since
    `quantile_from`, and `new`'s gauges."""
    out: dict[str, float | None] = dict(new.gauges)
    if rate_from is not None and new.t > rate_from.t:
        dt, c, old = new.t - rate_from.t, new.counters, rate_from.counters

        def delta(key):
            d = c.get(key, 0.0) - old.get(key, 0.0)
            return d if d >= 0 else None  # a process left the sum: no honest difference

        def rate(key):
            d = delta(key)
            return None if d is None else d / dt

        def mean(total, count):
            n, s = delta(count), delta(total)
            return s / n if n and s is not None else None
        finished = [delta(f"finished:{r}") for r in FINISH]
        out.update({
            "arrivals_per_s": rate("received"),
            "finished_per_s": None if None in finished else sum(finished) / dt,
            "errors_per_s": rate("finished:error"),
            "rejected_503_per_s": rate("rejected_503"),
            "output_tokens_per_s": rate("output_tokens"),
            "prompt_tokens_per_s": rate("prompt_tokens"),
            "preemptions_per_s": rate("preemptions"),
            "batch_tokens": mean("batch_sum", "batch_count"),
            "engine_host_seconds_per_step": mean("host_sum", "host_count"),
        })
        for phase in ("prefill", "decode", "mixed"):
            out[f"step_seconds_{phase}"] = mean(f"step_sum:{phase}", f"step_count:{phase}")
        for key in c:
            if key.startswith("cpu:"):
                out[key] = rate(key)
    if quantile_from is not None:
        for name in LATENCIES:
            now, before = new.buckets[name], quantile_from.buckets[name]
            window = sorted((le, count - before.get(le, 0.0)) for le, count in now.items())
            if any(count < 0 for _, count in window):
                window = []
            for label, q in QUANTILES.items():
                out[f"{name}_{label}"] = quantile(q, window)
    return out


def totals(f: Frame) -> dict[str, int]:
    """Counts since the server started, at frame `f` (what /metrics shows at the same moment)."""
    c = f.counters
    out = {"requests_received": c.get("received", 0.0),
           "requests_finished": sum(c.get(f"finished:{r}", 0.0) for r in FINISH),
           **{f"requests_{r}": c.get(f"finished:{r}", 0.0) for r in FINISH},
           "rejected_503": c.get("rejected_503", 0.0), "output_tokens": c.get("output_tokens", 0.0),
           "prompt_tokens": c.get("prompt_tokens", 0.0), "preemptions": c.get("preemptions", 0.0)}
    return {k: int(round(v)) for k, v in out.items()}


class Slowest:
    """The slowest requests (end to end) of the last WINDOW seconds counted in whole minutes (the minute WINDOW ago
    whole: up to a minute more), in bounded memory: the SLOWEST slowest of each minute, whose union holds exactly
    the SLOWEST slowest of any run of whole minutes."""

    def __init__(self, keep: int = SLOWEST, window: float = WINDOW):
        self.keep, self.window = keep, window
        self._minutes: dict[int, list] = {}  # minute -> min-heap of (e2e, seq, entry)
        self._seq = 0

    def add(self, entry: dict) -> None:
        minute = int(entry["finished"] // 60)
        heap = self._minutes.setdefault(minute, [])
        self._seq += 1
        item = (entry["e2e"], self._seq, entry)
        if len(heap) < self.keep:
            heapq.heappush(heap, item)
        elif item[0] > heap[0][0]:
            heapq.heapreplace(heap, item)
        if len(self._minutes) > self.window // 60 + 2:
            for old in sorted(self._minutes)[:-int(self.window // 60 + 2)]:
                del self._minutes[old]

    def top(self, now: float) -> list[dict]:
        since = int((now - self.window) // 60)
        entries = [e for minute, heap in self._minutes.items() if minute >= since for _, _, e in heap]
        return heapq.nlargest(self.keep, entries, key=lambda e: e["e2e"])


class History:
    """Points of the last `window` seconds, and the frames the newest point's windows reach back to."""

    def __init__(self, window: float = WINDOW, interval: float = INTERVAL):
        self.points: deque[tuple[float, dict]] = deque(maxlen=int(window / interval) + 1)
        self.frames: deque[Frame] = deque()
        self.totals: dict[str, int] = {}
        self.slowest: list[dict] = []
        self.processes: list[str] = []
        self.gpus: list[str] = []

    def _back(self, t: float, seconds: float) -> Frame | None:
        """The oldest frame within `seconds` before `t` (None if there is only the newest)."""
        i = bisect.bisect_left(self.frames, t - seconds - 1e-6, key=lambda f: f.t)
        return self.frames[i] if i < len(self.frames) - 1 else None

    def add(self, families, slowest: list[dict], t: float) -> None:
        f = frame(families, t)
        self.frames.append(f)
        while self.frames and self.frames[0].t < t - max(RATE_WINDOW, QUANTILE_WINDOW) - 1e-6:
            self.frames.popleft()
        # the percentiles of a point whose frames reach back less than the window are those of what there is
        values = point(f, self._back(t, RATE_WINDOW), self._back(t, QUANTILE_WINDOW))
        self.points.append((t, {k: _finite(v) for k, v in values.items()}))  # (JSON has no NaN: once, not per view)
        self.totals = totals(f)
        self.slowest = heapq.nlargest(SLOWEST, slowest, key=lambda e: e["e2e"])  # each process sent its own
        natural = lambda name: (len(name), name)  # api-2 before api-10, GPU 2 before 10
        self.processes = sorted({k.split(":", 1)[1] for k in f.counters if k.startswith("cpu:")}, key=natural)
        self.gpus = sorted({k.split(":", 1)[1] for k in f.gauges if k.startswith("gpu_util:")}, key=natural)

    def view(self, since: float | None = None) -> dict:
        chosen = [(t, p) for t, p in self.points if since is None or t > since]
        names = list(dict.fromkeys(k for _, p in chosen for k in p))
        columns = {"t": [t for t, _ in chosen]}
        columns.update((name, [p.get(name) for _, p in chosen]) for name in names)
        return {"interval": INTERVAL, "window": WINDOW, "points": columns, "totals": self.totals,
                "slowest": self.slowest, "processes": self.processes, "gpus": self.gpus}


def _finite(value):
    return None if isinstance(value, float) and value != value else value


class Keeper:
    """Keeps the History: every `interval` seconds it gathers (`collect`: process -> snapshot), merges and adds a
    point, on its own thread; `view` answers the page."""

    def __init__(self, collect: Callable[[], dict[str, bytes]], model: str, trace_url: str | None = None,
                 interval: float = INTERVAL, clock: Callable[[], float] = time.time):
        self.collect, self.model, self.trace_url = collect, model, trace_url
        self.interval, self.clock = interval, clock
        self.history = History()
        self.thresholds = thresholds()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        slowest = []
        families = gather.merge(self.collect(), self.model, slowest)
        with self._lock:
            self.history.add(families, slowest, self.clock())

    def start(self) -> "Keeper":
        self._thread = threading.Thread(target=self._run, name="dashboard-keeper", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # a bad gathering must not end the history
                log.exception("dashboard: gathering the metrics failed")
            due = max(due + self.interval, time.monotonic())  # a late sample does not bunch the next ones
            self._stop.wait(due - time.monotonic())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def view(self, since: float | None, status: str) -> bytes:
        """The page's JSON: the points after `since` (all without), with what the page needs around them."""
        with self._lock:
            body = self.history.view(since)
        body.update(status=status, model=self.model, now=self.clock(), thresholds=self.thresholds,
                    trace_url=self.trace_url)
        return msgspec.json.encode(body)

    def answer(self, question: bytes) -> bytes:
        """A front end's question (msgpack [since, status], as `ask` sends it): the view."""
        return self.view(*msgspec.msgpack.decode(question))


# -- a served server: the supervisor keeps the history, the front ends ask it ------------------------------------
def address(folder: str) -> str:
    """Where the supervisor answers the front ends (gather.Responder, gather.Asker)."""
    return f"ipc://{folder}/dashboard"


def question(since: float | None, status: str) -> bytes:
    return msgspec.msgpack.encode([since, status])


def asker(folder: str, processes: Callable[[], list[str]]) -> Callable[[], dict[str, bytes]]:
    """A `collect` for the supervisor, called on the keeper's thread: asks each live process for its snapshot at
    once, each over its kept gather.Asker, on an event loop of that thread (a process that does not answer in
    gather.ASK_TIMEOUT_MS is left out of that point)."""
    loop, askers = None, gather.Askers()

    def collect() -> dict[str, bytes]:
        nonlocal loop
        loop = loop or asyncio.new_event_loop()
        return loop.run_until_complete(askers.snapshots(folder, processes()))
    return collect
