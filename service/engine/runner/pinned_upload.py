"""Uploads that never wait for the device: pinned host memory in a few buffers used in turn for the small uploads of a
replayed decode step (the host fills one for the next step while the others' copies may still wait behind the steps
in flight), and `to_device` for any other host data.
"""

import numpy as np
import torch


class PinnedUpload:
    """A pinned host buffer for one kind of upload, in `count` parts used in turn (two: one step in flight; more when
    several steps are launched before the host reads any back).

    The host fills one part for the next step while the others' copies may still wait behind the steps in
    flight; an event recorded after each copy says when its part may be written again.
    """

    def __init__(self, numel: int, dtype: torch.dtype, count: int = 2):
        self.parts = [torch.empty(numel, dtype=dtype, pin_memory=True) for _ in range(count)]
        self.events = [torch.cuda.Event() for _ in range(count)]
        self.used = [False] * count
        self.turn = 0

    def take(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
        """The next part as a tensor of `shape` and a numpy view of it to fill."""
        i = self.turn
        if self.used[i]:
            self.events[i].synchronize()  # its copy ran long ago unless the device is far behind
        t = self.parts[i][:int(np.prod(shape))].view(shape)
        return t, t.numpy()

    def send(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        self.events[self.turn].record()
        self.used[self.turn] = True
        self.turn = (self.turn + 1) % len(self.parts)


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or array on `device` without waiting for the device (through pinned memory on CUDA).

    A plain `torch.tensor(..., device="cuda")` waits for all queued work first, which would stall the
    host behind the step in flight. The caching host allocator keeps the pinned buffer until the copy ran.
    """
    t = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
