"""Peak memory of a timed region: CUDA's max allocated bytes, or on CPU the growth of the resident set.

On CPU the kernel's high-water mark (VmHWM) is reset just before the region (Linux >= 4.0, write 5 to
/proc/self/clear_refs), after glibc has handed its free pages back (malloc_trim), so the peak is exact
and no sampling thread can miss it. glibc's mmap threshold is pinned at its 128 KiB default: left dynamic it
rises to 32 MiB after the first large free, and activations freed during backward then stay in the heap
while gradients take new pages, so RSS overstated the live tensors by up to 50% (small preset, tiny model).
"""

import ctypes
import gc

import torch


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def release_free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:  # not glibc: RSS keeps what the allocator holds, and the peak reads high
            pass


def pin_mmap_threshold() -> None:
    """Every allocation of 128 KiB or more gets its own mapping, returned to the OS when the tensor is freed."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it stops the dynamic rise
    except OSError:  # not glibc
        pass


class PeakMemory:
    """start() at the region's beginning, peak() at its end; on CPU relative to `baseline` (RSS before the model)."""

    def __init__(self, device: torch.device, baseline: int = 0):
        self.device, self.baseline = device, baseline

    def start(self) -> None:
        release_free_memory(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _status_kib("VmHWM") * 1024 - self.baseline


def available_bytes(device: torch.device) -> int:
    """What a new model and its step may use: free GPU memory plus this process's cached blocks, or RAM available."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    import psutil
    return psutil.virtual_memory().available
