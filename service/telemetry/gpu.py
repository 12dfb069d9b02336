"""A background thread that reads NVML every few seconds into the llm_gpu_* gauges, one series per GPU.

On a machine without NVIDIA GPUs (or without the driver) it logs one line and exports nothing.
A reading a GPU does not support (power on some boards, say) is skipped, not fatal.
"""

import logging
import os
import threading

from prometheus_client import CollectorRegistry

from service.telemetry.metrics import GPUMetrics

log = logging.getLogger(__name__)


def _visible(nvml, count: int) -> list[int]:
    """NVML indices of the GPUs CUDA_VISIBLE_DEVICES lets this process see (indices or UUIDs), else all."""
    wanted = os.environ.get("CUDA_VISIBLE_DEVICES")
    if wanted is None:
        return list(range(count))
    picked = []
    for item in filter(None, (w.strip() for w in wanted.split(","))):
        if item.isdigit():
            if int(item) < count:
                picked.append(int(item))
            continue
        for i in range(count):
            if nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)).startswith(item):
                picked.append(i)
    return picked


class GPUSampler:
    def __init__(self, registry: CollectorRegistry, interval: float = 5.0):
        self.interval = interval
        self.gpus: list[tuple[str, object]] = []
        self.last: dict[str, dict[str, float]] = {}  # GPU index -> reading -> value, as last sampled (for OTLP)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml
            pynvml.nvmlInit()
            indices = _visible(pynvml, pynvml.nvmlDeviceGetCount())
        except Exception as exc:  # no library, no driver, no device
            log.info("GPU metrics off: NVML is not available (%s)", exc)
            return
        if not indices:
            log.info("GPU metrics off: no visible NVIDIA GPU")
            pynvml.nvmlShutdown()
            return
        self.nvml = pynvml
        self.gpus = [(str(i), pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]
        self.metrics = GPUMetrics(registry)
        self.sample()

    @property
    def enabled(self) -> bool:
        return bool(self.gpus)

    def start(self) -> "GPUSampler":
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 1)
        if self.enabled:
            self.nvml.nvmlShutdown()
            self.gpus = []

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        nvml, m = self.nvml, self.metrics
        readings = [
            ("utilization", m.utilization, lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
            ("memory_used", m.memory_used, lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used),
            ("memory_total", m.memory_total, lambda h: nvml.nvmlDeviceGetMemoryInfo(h).total),
            ("power", m.power, lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("temperature", m.temperature, lambda h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            ("sm_clock", m.sm_clock, lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM) * 1e6),
        ]
        for index, handle in self.gpus:
            values = {}
            for name, gauge, read in readings:
                try:
                    values[name] = read(handle)
                except nvml.NVMLError:
                    continue
                gauge.labels(index).set(values[name])
            self.last[index] = values
