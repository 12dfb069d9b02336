"""One process's telemetry: the metric catalog, its recorder, tracing, the GPU sampler and the metrics responder.

A front end builds it with `process="api-<i>"`: it records requests (`requests`, a RequestRecorder) and serves
`render` at /metrics, which gathers every process of the server. The engine process builds it with
`process="engine"` and hands `observer` to the engine. With no `folder` (one process: tests, the engine in a
thread) the same object plays both parts and nothing is gathered. With --otlp-metrics each process also pushes
its own metrics over OTLP (service.telemetry.otlp), described by `resource` (service.telemetry.otlp.make_resource).
"""

import asyncio
import gc
import logging
import threading
import time

from service.engine import StepObserver, StepStats
from service.engine.config import dtype_name
from service.settings import TelemetrySettings
from service.telemetry import dashboard, gather, otlp
from service.telemetry.gpu import GPUSampler
from service.telemetry.metrics import Metrics
from service.telemetry.recorder import EngineRecorder, RequestRecorder
from service.telemetry.tracing import Tracing, make_provider

log = logging.getLogger(__name__)
LAG_PERIOD = 0.5  # seconds between the event-loop lag checks


class Telemetry:
    def __init__(self, settings: TelemetrySettings, model: str, process: str = "api-0", folder: str | None = None,
                 peers: tuple[str, ...] = (), resource=None):
        self.settings = settings
        self.process, self.folder, self.peers = process, folder, peers  # peers: the other processes to gather
        self.metrics = Metrics(model)
        self.tracing = Tracing(make_provider(settings.trace_sample_ratio, process), settings.trace_engine_steps,
                               settings.trace_text)
        self.meter_provider, self.otlp = None, None  # with --otlp-metrics: the SDK's provider, the instruments
        if settings.otlp_metrics and settings.metrics:
            self.meter_provider, self.otlp = otlp.start(settings, self.metrics,
                                                        resource or otlp.make_resource(process, model))
        exemplars = {"trace_id": self.tracing.trace_id} if self.tracing.enabled else {}
        self.requests = RequestRecorder(self.metrics, otlp=self.otlp, **exemplars) if settings.metrics else None
        self.recorder = EngineRecorder(self.metrics, self.otlp) if settings.metrics else None
        # what the engine calls after each step; None when nothing is recorded (no cost at all)
        self.observer: StepObserver | None = self._observe_both if self.recorder and self.tracing.trace_steps \
            else self.recorder or (self.tracing.step if self.tracing.enabled else None)
        self.gpu: GPUSampler | None = None
        self.responder = gather.Responder(lambda _: self.snapshot(), gather.address(folder, process)) if folder \
            else None
        self.keeper: dashboard.Keeper | None = None  # the dashboard's history, when this process keeps it
        self._askers = gather.Askers()  # a kept socket to each peer, and to the supervisor's history
        self._lag_task: asyncio.Task | None = None
        self._gc_started: float | None = None  # when the collection under way began (perf_counter)

    def _observe_both(self, step: StepStats) -> None:
        self.recorder(step)
        self.tracing.step(step)

    def engine_loaded(self, engine) -> None:
        """Publish how the model runs (llm_model_info) and start observing the engine's steps."""
        runner = engine.runner
        self.metrics.model_info.labels(self.metrics.model, dtype_name(runner.dtype),
                                       engine.quantization, dtype_name(runner.kv_dtype),
                                       str(engine.config.block_size), str(runner.num_blocks)).set(1)
        engine.observer = self.observer
        self.metrics.threads.set_function(threading.active_count)
        if self.otlp is not None:
            self.otlp.observe_engine(lambda: self.recorder.state)

    def watch_gc(self) -> None:
        """Time each of this process's garbage collections into llm_gc_pause_seconds (until shutdown)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # a collection can start on any thread, never inside a prometheus_client value's lock (only float arithmetic
        # runs there); multiprocess mode, whose global lock guards allocating code, is not used
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self.metrics.gc_pause_m[info["generation"]].observe(time.perf_counter() - self._gc_started)
            self._gc_started = None

    def start(self) -> None:
        self.watch_gc()
        if self.settings.gpu_sample_interval > 0:
            self.gpu = GPUSampler(self.metrics.registry, self.settings.gpu_sample_interval).start()
            if self.otlp is not None and self.gpu.enabled:
                self.otlp.observe_gpus(lambda: self.gpu.last)

    def watch_runtime(self, client_backlog=lambda: 0, connections=lambda: 0) -> None:
        """Per-process gauges of a front end: threads, tasks, open connections, IPC backlog, event-loop lag (call on
        its loop)."""
        loop = asyncio.get_running_loop()
        m = self.metrics
        self.watch_gc()
        m.threads.set_function(threading.active_count)
        m.asyncio_tasks.set_function(lambda: len(asyncio.all_tasks(loop)))
        m.connections.set_function(connections)
        m.ipc_backlog.set_function(client_backlog)

        async def lag():
            while True:
                due = time.perf_counter() + LAG_PERIOD
                await asyncio.sleep(LAG_PERIOD)
                m.loop_lag.set(max(0.0, time.perf_counter() - due))
        self._lag_task = loop.create_task(lag(), name="event-loop-lag")

    def snapshot(self) -> bytes:
        """This process's metrics (and slowest requests) for /metrics and /dashboard, gathered elsewhere."""
        return gather.snapshot(self.metrics, self.requests.slowest() if self.requests is not None else ())

    def keep_history(self) -> None:
        """Keep the dashboard's history here (one process serves everything: no `folder`)."""
        self.keeper = dashboard.Keeper(lambda: {self.process: self.snapshot()}, self.metrics.model,
                                       self.settings.trace_url).start()

    async def dashboard(self, since: float | None, status: str) -> bytes | None:
        """The dashboard page's data: from the history kept here, else from the supervisor's (None: no answer)."""
        if self.keeper is not None:  # (one process serves everything: it keeps the history itself)
            return self.keeper.view(since, status)
        return await self._askers[dashboard.address(self.folder)].ask(dashboard.question(since, status))

    def shutdown(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self.keeper is not None:
            self.keeper.stop()
        if self._lag_task is not None:
            self._lag_task.cancel()
        if self.gpu is not None:
            self.gpu.stop()
        if self.responder is not None:
            self.responder.close()
        self._askers.close()
        self.tracing.shutdown()
        if self.meter_provider is not None:
            otlp.shutdown(self.meter_provider)

    def forget(self, process: str) -> None:
        """A process of the server has died: later scrapes no longer ask it (each would wait gather.ASK_TIMEOUT_MS
        for it)."""
        self.peers = tuple(p for p in self.peers if p != process)
        self._askers.forget(gather.address(self.folder, process))
        log.info("%s is gone: its metrics are left out of /metrics from now on", process)

    async def render(self, accept: str | None) -> tuple[bytes, str]:
        """Every process's metrics, merged, in the format the scraper asks for."""
        snapshots = {self.process: self.snapshot()}
        if self.folder and self.peers:
            snapshots.update(await self._askers.snapshots(self.folder, self.peers, "metrics"))
        return gather.render(gather.merge(snapshots, self.metrics.model), accept)
