"""Ports for the servers that tests start: one allocator per process (conftest is imported both as `conftest` and
as `tests.conftest`; this module only ever as `tests.ports`), so that no port is handed out twice in a run."""

import itertools
import os
import socket

# Below the kernel's ephemeral range (32768 and up on Linux), where no outgoing connection is ever given a port;
# each pytest-xdist worker has its own slice.
PORT_SLICE = 1500
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) % 8
_LOW = 20000 + _WORKER * PORT_SLICE
_offsets = itertools.count(os.getpid() % PORT_SLICE)  # a start that differs between suites run side by side


def free_port(count: int = 1) -> int:
    """A loopback port nothing listens on, or the first of `count` consecutive ones. (A port found by binding to 0
    and closing lay in the ephemeral range, where a client's connection could take it before the server bound it.)"""
    for _ in range(PORT_SLICE):
        base = _LOW + next(_offsets) % PORT_SLICE
        if base + count > _LOW + PORT_SLICE:
            continue
        for _ in range(count - 1):
            next(_offsets)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} free consecutive ports in {_LOW}..{_LOW + PORT_SLICE}")
