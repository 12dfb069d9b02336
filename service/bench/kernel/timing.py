"""Timing one call of a kernel: CUDA events around each repeat after an L2 flush, or perf_counter on CPU.

Clocks are never changed here (locking them needs root and changes the machine for everyone); what the
GPU ran at is read through NVML and reported next to the numbers instead.
"""

import time
from typing import Callable

import torch

MIN_FLUSH_BYTES = 128 * 2**20


def time_calls(fn: Callable, device: torch.device, warmup: int, repeats: int, flush_l2: bool = True) -> list[float]:
    """Seconds per call, one value per repeat, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out
    props = torch.cuda.get_device_properties(device)
    flush = torch.empty(max(2 * getattr(props, "L2_cache_size", 0), MIN_FLUSH_BYTES) // 4, dtype=torch.int32,
                        device=device) if flush_l2 else None
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    torch.cuda.synchronize(device)
    for start, end in events:
        if flush is not None:
            flush.zero_()  # writes more than L2 holds: every repeat starts with cold caches
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def clock_report(device: torch.device) -> str:
    """One line on the GPU's clocks: current and maximum SM clock, and whether application clocks are pinned."""
    if device.type != "cuda":
        return "CPU: clocks not controlled (frequency scaling as the OS sets it)"
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        sm = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
        top = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
        try:
            app = pynvml.nvmlDeviceGetApplicationsClock(handle, pynvml.NVML_CLOCK_SM)
        except pynvml.NVMLError:
            app = None
        return (f"GPU clocks not locked by this benchmark (that needs root and changes the machine for everyone): "
                f"SM {sm} MHz now, {top} MHz max" + (f", application clock {app} MHz" if app else ""))
    except Exception as exc:  # no NVML library or driver
        return f"GPU clocks not locked and not readable here ({exc})"
