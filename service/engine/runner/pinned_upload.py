"""Uploads that never wait for the device: double-buffered pinned host memory for the small uploads of a replayed
decode step (the host fills one half for the next step while the other half's copy may still wait behind the step in
flight), and `to_device` for any other host data.
"""

import numpy as np
import torch


class PinnedUpload:
    """A pinned host buffer for one kind of upload, in two halves used in turn.

    The host fills one half for the next step while the other's copy may still wait behind the step in
    flight; an event recorded after each copy says when its half may be written again.
    """

    def __init__(self, numel: int, dtype: torch.dtype):
        self.halves = [torch.empty(numel, dtype=dtype, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.used = [False, False]
        self.turn = 0

    def take(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
        """The next half as a tensor of `shape` and a numpy view of it to fill."""
        i = self.turn
        if self.used[i]:
            self.events[i].synchronize()  # its copy ran long ago unless the device is far behind
        t = self.halves[i][:int(np.prod(shape))].view(shape)
        return t, t.numpy()

    def send(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        self.events[self.turn].record()
        self.used[self.turn] = True
        self.turn ^= 1


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or array on `device` without waiting for the device (through pinned memory on CUDA).

    A plain `torch.tensor(..., device="cuda")` waits for all queued work first, which would stall the
    host behind the step in flight. The caching host allocator keeps the pinned buffer until the copy ran.
    """
    t = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
