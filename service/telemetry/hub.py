"""One server's telemetry: the metric catalog, the engine recorder, tracing and the GPU sampler.

The API builds it, hands `observer` to the engine and serves `render` at /metrics; nothing here
calls the engine.
"""

import asyncio
import threading

from prometheus_client.exposition import choose_encoder

from service.engine import StepObserver, StepStats
from service.settings import TelemetrySettings
from service.telemetry.gpu import GPUSampler
from service.telemetry.metrics import Metrics
from service.telemetry.recorder import EngineRecorder
from service.telemetry.tracing import Tracing, make_provider


class Telemetry:
    def __init__(self, settings: TelemetrySettings, model: str):
        self.settings = settings
        self.metrics = Metrics(model)
        self.tracing = Tracing(make_provider(settings.trace_sample_ratio), settings.trace_engine_steps,
                               settings.trace_text)
        exemplars = {"trace_id": self.tracing.trace_id} if self.tracing.enabled else {}
        self.recorder = EngineRecorder(self.metrics, **exemplars) if settings.metrics else None
        # what the engine calls after each step; None when nothing is recorded (no cost at all)
        self.observer: StepObserver | None = self._observe_both if self.recorder and self.tracing.trace_steps \
            else self.recorder or (self.tracing.step if self.tracing.trace_steps else None)
        self.gpu: GPUSampler | None = None

    def _observe_both(self, step: StepStats) -> None:
        self.recorder(step)
        self.tracing.step(step)

    def model_loaded(self, dtype: str, quantization: str, kv_block_size: int, kv_blocks: int) -> None:
        """Publish how the model runs (llm_model_info), once it is loaded."""
        self.metrics.model_info.labels(self.metrics.model, dtype, quantization, str(kv_block_size),
                                       str(kv_blocks)).set(1)

    def start(self) -> None:
        if self.settings.gpu_sample_interval > 0:
            self.gpu = GPUSampler(self.metrics.registry, self.settings.gpu_sample_interval).start()

    def watch_runtime(self, state) -> None:
        """Gauges read at scrape time: threads, the event loop's tasks and the KV blocks in use (call this
        on the server's event loop; `state.facade` is read when scraped, so it may still be loading)."""
        loop = asyncio.get_running_loop()
        m = self.metrics
        m.threads.set_function(threading.active_count)
        m.asyncio_tasks.set_function(lambda: len(asyncio.all_tasks(loop)))

        def blocks_used() -> int:
            blocks = state.facade.engine.blocks if state.facade is not None else None
            return blocks.num_usable_blocks - blocks.num_free_blocks if blocks is not None else 0
        m.kv_blocks_used.labels(m.model).set_function(blocks_used)

    def shutdown(self) -> None:
        if self.gpu is not None:
            self.gpu.stop()
        self.tracing.shutdown()

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The registry in the format the scraper asks for (OpenMetrics, with exemplars, or Prometheus text)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.metrics.registry), content_type
