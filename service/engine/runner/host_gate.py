"""A point in the compute stream where the device waits for the host: the grammars' masks of a step are filled on the
host while the device runs the step's forward pass, and its sampler, launched at once behind it, reads them only once
the host says they are there.

The host launches the whole step (forward pass, the gate, the masks' copy, the sampler, and the next step's forward pass
behind it) without waiting; a thread fills the masks into pinned memory and opens the gate, and the device goes on. With
CUDA graphs the gate and the copy are on a stream of their own, beside the forward pass, and the sampler waits for the
copy only (cuda_graphs.DecodeGraphs.masks_behind). The wait is the driver's own (`cuStreamWaitValue32`: the stream's
front end waits for a word of pinned host memory to reach the ticket; no kernel, no SM, no time limit), so the host must
open every ticket it queues: the masks' thread opens its ticket however its fill ends, and `close` opens all of them.
"""

import ctypes
import itertools

import numpy as np
import torch

_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: wait until (int32)(*addr - value) >= 0 (a cyclic comparison: tickets wrap)


class HostGate:
    """Tickets, each a wait of the stream that the host opens. Raises at construction where the driver lacks the call
    (the caller then waits on the host instead)."""

    def __init__(self, device: torch.device):
        driver = ctypes.CDLL("libcuda.so.1")
        self._wait = driver.cuStreamWaitValue32_v2  # (v2: enabled by default since CUDA 12; v1 needs a driver option)
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._wait.restype = ctypes.c_int
        self.word = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # the latest ticket opened
        address = ctypes.c_uint64()  # (with unified addressing, the host's address; asked all the same)
        get = driver.cuMemHostGetDevicePointer_v2
        get.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        with torch.cuda.device(device):
            _check(get(ctypes.byref(address), self.word.data_ptr(), 0), "cuMemHostGetDevicePointer")
            self._address, self._word = address.value, self.word.numpy().view(np.uint32)
            self.wait(0)  # (open already: whether the driver takes the call at all)
        self._tickets = itertools.count(1)
        self.last = 0  # the latest ticket given out

    def ticket(self) -> int:
        """A new ticket: the device's wait for it is queued by `wait`, and ends when the host calls `open` with it."""
        self.last = next(self._tickets) & 0xFFFFFFFF
        return self.last

    def wait(self, ticket: int) -> None:
        """Make the current stream wait until `open(ticket)` (or a later ticket's)."""
        stream = torch.cuda.current_stream().cuda_stream
        _check(self._wait(stream, self._address, ticket, _GEQ), "cuStreamWaitValue32")

    def open(self, ticket: int) -> None:
        """Let the device past every wait up to `ticket` (tickets are opened in order, by one thread)."""
        self._word[0] = ticket

    def close(self) -> None:
        """Open every wait queued: nothing will open them any more."""
        self._word[0] = self.last


def _check(code: int, call: str) -> None:
    if code != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {code}")
