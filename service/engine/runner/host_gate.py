"""A point in the compute stream where the device waits for the host: the grammars' masks of a step are filled on the
host while the device runs the step's forward pass, and its sampler, launched at once behind it, reads them only once
the host says they are there.

The host launches the whole step (forward pass, the gate, the masks' copy, the sampler, and the next step's forward
pass behind it) without waiting; a thread fills the masks into pinned memory and opens the gate, and the device
goes on a few microseconds later. A gate the host never opens (a thread that cannot run: the engine's thread holding
the GIL in a call that waits for the device) would stop the device for good, so each wait ends after `timeout` seconds
all the same: its step is then failed (`expired`), and the device serves on.
"""

import itertools

import torch


class HostGate:
    SLOTS = 64  # expired tickets are remembered this many tickets back (a step's is asked for a step or two later)

    def __init__(self, timeout: float = 5.0):
        self.timeout = timeout
        self.word = torch.zeros(1, dtype=torch.int64, pin_memory=True)  # the highest ticket opened
        self.expired_tickets = torch.zeros(self.SLOTS, dtype=torch.int64, pin_memory=True)
        self._word, self._expired = self.word.numpy(), self.expired_tickets.numpy()
        self._tickets = itertools.count(1)

    def ticket(self) -> int:
        """A new ticket: the device's wait for it is queued by `wait`, and ends when the host calls `open` with it."""
        return next(self._tickets)

    def wait(self, ticket: int) -> None:
        """Make the current stream wait for `open(ticket)` (at most `timeout` seconds)."""
        from service.engine.runner import triton_sampling  # (Triton: CUDA only)

        triton_sampling.wait_for_host(self.word, self.expired_tickets, ticket, int(self.timeout * 1e9))

    def open(self, ticket: int) -> None:
        """Let the device past every wait up to `ticket` (tickets are opened in order, by one thread)."""
        self._word[0] = ticket

    def expired(self, ticket: int) -> bool:
        """Whether the device stopped waiting for `ticket` at its time limit (ask once the stream is past the wait)."""
        return int(self._expired[ticket % self.SLOTS]) == ticket

    def close(self) -> None:
        """Open every wait, queued or to come: nothing will open them any more."""
        self._word[0] = 2**62
