"""One server's telemetry: the metric catalog, the engine recorder, tracing and the GPU sampler.

The API builds it, hands `observer` to the engine and serves `render` at /metrics; nothing here
calls the engine.
"""

import logging
import queue
import threading
import time

from prometheus_client.exposition import choose_encoder

from service.engine import RequestOutput, StepObserver, StepStats
from service.settings import TelemetrySettings
from service.telemetry.gpu import GPUSampler
from service.telemetry.metrics import Metrics
from service.telemetry.recorder import EngineRecorder
from service.telemetry.tracing import Tracing, make_provider

log = logging.getLogger(__name__)


class BackgroundObserver:
    """Runs a step observer on a thread of its own: the engine's thread only hands each step over.

    The engine thread spends much of a GPU step waiting for the device with the GIL released; the
    recording happens then. `flush` returns once every step handed over so far is recorded.
    """

    def __init__(self, observer: StepObserver):
        self.observer = observer
        self.busy = 0.0  # seconds spent recording
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)

    def __call__(self, step: StepStats, outputs: list[RequestOutput]) -> None:
        self._queue.put((step, outputs))

    def start(self) -> None:
        self._thread.start()

    def flush(self, timeout: float = 2.0) -> None:
        if self._thread.is_alive():
            done = threading.Event()
            self._queue.put(done)
            done.wait(timeout)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(5.0)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            start = time.perf_counter()
            try:
                self.observer(*item)
            except Exception:  # a recording bug must not stop the recording of later steps
                log.exception("telemetry failed to record an engine step")
            self.busy += time.perf_counter() - start


class Telemetry:
    def __init__(self, settings: TelemetrySettings, model: str):
        self.settings = settings
        self.metrics = Metrics(model)
        self.tracing = Tracing(make_provider(settings.trace_sample_ratio), settings.trace_engine_steps,
                               settings.trace_text)
        self.recorder = EngineRecorder(self.metrics, self.tracing.trace_id) if settings.metrics else None
        observe = self._observe_both if self.recorder and self.tracing.trace_steps \
            else self.recorder or (self.tracing.step if self.tracing.trace_steps else None)
        # what the engine calls after each step; None when nothing is recorded (no cost at all)
        self.observer = BackgroundObserver(observe) if observe else None
        self.gpu: GPUSampler | None = None

    def _observe_both(self, step: StepStats, outputs: list[RequestOutput]) -> None:
        self.recorder(step, outputs)
        self.tracing.step(step)

    def start(self) -> None:
        if self.observer:
            self.observer.start()
        if self.settings.gpu_sample_interval > 0:
            self.gpu = GPUSampler(self.metrics.registry, self.settings.gpu_sample_interval).start()

    def shutdown(self) -> None:
        if self.observer:
            self.observer.close()
        if self.gpu is not None:
            self.gpu.stop()
        self.tracing.shutdown()

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The registry in the format the scraper asks for (OpenMetrics, with exemplars, or Prometheus text).

        Steps the engine finished before the scrape are recorded first, so a scrape is never behind.
        """
        if self.observer:
            self.observer.flush()
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.metrics.registry), content_type
