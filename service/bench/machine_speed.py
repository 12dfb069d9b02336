"""The machine's own speed at the moment of a measurement: a fixed reference workload, timed beside each iteration.

A shared or virtual machine does not keep one speed: on the 2-core development VM an unchanged `bench run` read
anywhere from 0.60 s to 1.13 s a batch-1 iteration over half an hour, each run's iterations agreeing with each
other, because what the neighbours do to the memory bus and the caches changes by the minute. A baseline
measured at one slow moment then makes every later run look faster. `bench run` on CPU therefore times this
reference before and after every measured iteration (`machine_reference_seconds`), and `bench regress` judges
time metrics per unit of it: how long the code took in units of how fast the machine was just then.

The reference streams a fixed array with numpy, which the code under test (torch) never runs, so a change to the
engine, or to torch's build and settings, cannot move it. It is memory-bound like a CPU decode step; beside the
engine over 5 minutes its per-run medians tracked the engine's with a correlation of 0.82, and dividing by them
took the spread of the engine's per-run medians from 7.3% to 4.2% (`docs/benchmark-history.md`).
"""

import time

import numpy as np

METRIC = "machine_reference_seconds"
_ARRAY_BYTES = 64 * 2**20  # larger than any last-level cache of the machines we run on
_PASSES = 2
_array: np.ndarray | None = None


def reference_seconds() -> float:
    """Seconds to read a fixed 64 MiB array twice (about 12 ms on the development VM)."""
    global _array
    if _array is None:
        _array = np.ones(_ARRAY_BYTES // 4, dtype=np.float32)
        _array.sum()  # fault the pages in before the first timing
    start = time.perf_counter()
    for _ in range(_PASSES):
        _array.sum()
    return time.perf_counter() - start


def normalizable(metric: str) -> int:
    """How a metric scales with the machine's speed: 1 for times (`_seconds`: divide by the reference), -1 for
    rates (`_per_second`: multiply), 0 for what does not (bytes, counts, ratios, the reference itself)."""
    if metric == METRIC:
        return 0
    if metric.endswith("_per_second"):
        return -1
    return 1 if metric.endswith("_seconds") else 0


def per_machine_speed(values: list[float], reference: list[float], power: int) -> list[float]:
    """A run's iterations in units of the machine's speed at each (`power` from `normalizable`)."""
    return [v / r ** power for v, r in zip(values, reference)]
