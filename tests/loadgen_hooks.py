"""Hooks that tests hand to load generator worker processes (a module of its own: a spawned worker imports it)."""

import time

STARVE_S = 0.1  # how long the starved worker's loop is blocked at each send


def starve_worker_0(rank: int, index: int) -> None:
    """Blocks worker 0's event loop at every send, as a saturated CPU would: its later requests go out late."""
    if rank == 0:
        until = time.perf_counter() + STARVE_S
        while time.perf_counter() < until:
            pass
