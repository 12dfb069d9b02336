"""The wait for a child server that a bench command started (`python -m service serve`, the mock server) to answer."""

import subprocess
import time

import httpx


def answers(proc: subprocess.Popen, url: str, timeout: float, interval: float) -> bool:
    """Whether GET `url` answered 200 before `timeout` seconds passed or `proc` exited (asked every `interval`)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:  # one client: each new one builds a TLS context (~50 ms of CPU)
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if client.get(url).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(interval)
    return False
