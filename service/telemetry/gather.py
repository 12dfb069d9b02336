"""One /metrics for every process of a server: each series once, counts exact, exemplars kept.

Every process (the engine, each front end) answers on an `ipc://` socket of its own with its metric families,
read at that moment. The front end that is scraped asks the others and merges: the shared series (requests,
tokens, steps, queue, KV, GPU) are summed sample by sample (each is set by the process that measures it, the
others hold zeros), keeping an exemplar where one process has it; per-process series get a `process` label.
prometheus_client's multiprocess mode would merge files instead, but it drops exemplars.
"""

import asyncio
import logging
import os
import threading
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Exemplar, Sample

log = logging.getLogger(__name__)
ASK_TIMEOUT_MS = 2000  # a process that does not answer in this long is left out of the scrape (and logged)


def address(folder: str, process: str) -> str:
    return f"ipc://{os.path.join(folder, f'metrics-{process}')}"


def dump(registry) -> list:
    """A registry's families as plain lists: [name, documentation, type, unit, samples]."""
    return [[m.name, m.documentation, m.type, m.unit,
             [[s.name, s.labels, s.value, s.timestamp, list(s.exemplar) if s.exemplar else None] for s in m.samples]]
            for m in registry.collect()]


def snapshot(metrics, slowest: list[dict] = ()) -> bytes:
    """A process's metric families, and the slowest requests it finished lately (for /dashboard)."""
    return msgspec.msgpack.encode([dump(metrics.registry), dump(metrics.local), list(slowest)])


class Responder:
    """Answers every question on the `ipc://` socket `where` with `answer(question)`, on its own thread: a process's
    snapshot for /metrics, the supervisor's history for /dashboard."""

    def __init__(self, answer: Callable[[bytes], bytes], where: str, name: str = "metrics-responder"):
        self.answer = answer
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REP)
        self.sock.bind(where)
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while True:
                question = self.sock.recv()
                try:
                    answer = self.answer(question)
                except Exception:
                    log.exception("%s: an answer failed", self.thread.name)
                    answer = b""
                self.sock.send(answer)
        except zmq.ContextTerminated:
            pass
        finally:
            self.sock.close(0)

    def close(self) -> None:
        self.ctx.term()


class Asker:
    """Questions to one Responder, one at a time over one kept socket (a socket per question doubled the CPU of a
    dashboard poll); a question not answered in ASK_TIMEOUT_MS, or answered empty, gets None."""

    def __init__(self, ctx: zmq.asyncio.Context, where: str):
        self.ctx, self.where = ctx, where
        self.sock = None
        self.lock = asyncio.Lock()

    async def ask(self, question: bytes = b"") -> bytes | None:
        async with self.lock:
            if self.sock is None:
                self.sock = self.ctx.socket(zmq.REQ)
                self.sock.setsockopt(zmq.LINGER, 0)
                self.sock.connect(self.where)
            await self.sock.send(question)
            if await self.sock.poll(ASK_TIMEOUT_MS):
                return (await self.sock.recv()) or None
            self.close()  # a REQ socket waits for its answer forever: start again
            return None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None


class Askers:
    """A kept Asker for each address, over one context made at first use: what /metrics, the dashboard's front ends
    and the supervisor's history ask each other through."""

    def __init__(self):
        self.ctx: zmq.asyncio.Context | None = None
        self.askers: dict[str, Asker] = {}

    def __getitem__(self, where: str) -> Asker:
        if where not in self.askers:
            self.ctx = self.ctx or zmq.asyncio.Context()
            self.askers[where] = Asker(self.ctx, where)
        return self.askers[where]

    async def snapshots(self, folder: str, processes, what: str | None = None) -> dict[str, bytes]:
        """Each process's snapshot, asked at once; one that does not answer in ASK_TIMEOUT_MS is left out, with a
        warning that names the asker `what` (None: none, as for the dashboard's history, asked every second, to
        which a starting process does not answer yet)."""
        answers = await asyncio.gather(*(self[address(folder, p)].ask() for p in processes))
        for p, raw in zip(processes, answers):
            if raw is None and what is not None:
                log.warning("%s: process %s did not answer in %d ms; left out this time", what, p, ASK_TIMEOUT_MS)
        return {p: raw for p, raw in zip(processes, answers) if raw is not None}

    def forget(self, where: str) -> None:
        if (asker := self.askers.pop(where, None)) is not None:
            asker.close()

    def close(self) -> None:
        for asker in self.askers.values():
            asker.close()
        if self.ctx is not None:
            self.ctx.term()


def merge(snapshots: dict[str, bytes], model: str, slowest: list[dict] | None = None) -> list[Metric]:
    """Families from every process's snapshot: shared ones summed, local ones labelled by process (and by the
    served model, as every other series is, so that one dashboard selector fits all). With a `slowest` list, each
    process's slowest requests are added to it."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict] = {}  # family -> (sample name, labels) -> [value, exemplar]
    for process, raw in snapshots.items():
        shared, local, slow = msgspec.msgpack.decode(raw)
        if slowest is not None:
            slowest += slow
        for name, doc, typ, unit, samples in shared:
            if name not in families:
                families[name], sums[name] = Metric(name, doc, typ, unit), {}
            into = sums[name]
            for sname, labels, value, _, exemplar in samples:
                key = (sname, tuple(sorted(labels.items())))
                if key in into:
                    into[key][0] += value
                    into[key][1] = into[key][1] or exemplar
                else:
                    into[key] = [value, exemplar, labels]
        for name, doc, typ, unit, samples in local:
            family = families.setdefault(name, Metric(name, doc, typ, unit))
            for sname, labels, value, timestamp, exemplar in samples:
                family.samples.append(Sample(sname, {**labels, "model": model, "process": process}, value, timestamp,
                                             Exemplar(*exemplar) if exemplar else None))
    for name, into in sums.items():
        families[name].samples.extend(Sample(sname, labels, value, None, Exemplar(*ex) if ex else None)
                                      for (sname, _), (value, ex, labels) in into.items())
    return list(families.values())


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


def render(families: list[Metric], accept: str | None) -> tuple[bytes, str]:
    """The families in the format the scraper asks for (OpenMetrics, with exemplars, or Prometheus text)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(_Families(families)), content_type
