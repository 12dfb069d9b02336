"""A thread that records device readings into a run every `interval` seconds (0.1 s by default).

CPU utilisation (the whole machine and this process), process RSS, and on NVIDIA GPUs utilisation, memory used,
power and SM clock through NVML, one set per GPU this process sees (gpu0_..., gpu1_...).
"""

import threading

import psutil

from service.bench.store.errors import StoreError
from service.telemetry.gpu import _visible


class DeviceSampler:
    def __init__(self, run, interval: float = 0.1):
        self.run, self.interval = run, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-device-sampler", daemon=True)
        self._process = psutil.Process()
        self._gpus, self._nvml, self._error = [], None, None
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._gpus = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible(pynvml, pynvml.nvmlDeviceGetCount())]
        except Exception:  # no library, no driver, no device: CPU readings only
            if self._nvml is not None:  # initialised, then the devices could not be listed
                self._nvml.nvmlShutdown()
            self._nvml = None

    def __enter__(self) -> "DeviceSampler":
        psutil.cpu_percent(None)  # the first call only sets the reference point
        self._process.cpu_percent(None)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
        if self._error is not None and exc[0] is None:  # the caller's one-line StoreError, not a thread traceback
            raise self._error

    def _loop(self) -> None:
        stopped = False
        while not stopped:  # one last reading when stopped, so that even a run shorter than the interval has one
            stopped = self._stop.wait(self.interval)
            try:
                self.run.sample(self.read())
            except StoreError as exc:  # the database went away: stop sampling, report it on exit
                self._error = exc
                return

    def read(self) -> dict[str, float]:
        values = {"cpu_percent": psutil.cpu_percent(None), "process_cpu_percent": self._process.cpu_percent(None),
                  "rss_bytes": float(self._process.memory_info().rss)}
        nvml = self._nvml
        for k, h in enumerate(self._gpus):
            readings = {"utilization_ratio": lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
                        "memory_used_bytes": lambda: nvml.nvmlDeviceGetMemoryInfo(h).used,
                        "power_watts": lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                        "sm_clock_hertz": lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM) * 1e6}
            for name, read in readings.items():
                try:
                    values[f"gpu{k}_{name}"] = float(read())
                except nvml.NVMLError:  # a reading this board does not support
                    pass
        return values
