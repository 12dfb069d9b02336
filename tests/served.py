"""`python -m service serve` in a subprocess, for the tests of the served layout (one engine process, N front ends)
and of what runs on it: its log kept, its process ids read from its first log line, waited on by events."""

import os
import re
import subprocess
import sys
import threading

import httpx
import pytest

from tests import web
from tests.conftest import wait_until
from tests.ports import free_port

MODEL = "random:tiny"


class Served:
    """`python -m service serve` in a subprocess, its log kept, its process ids read from its first log line."""

    def __init__(self, *args: str, model: str | None = MODEL, timeout: float = 120):
        """`model` None: the default model."""
        self.port, self.timeout = free_port(), timeout
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "service", "serve", *(["--model", model] if model else []),
                                      "--device", "cpu",
                                      "--port", str(self.port), "--gpu-sample-interval", "0", *args],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)

    def __enter__(self) -> "Served":
        line = wait_until(lambda: next((l for l in self.lines if "serving on" in l), None) or
                          (self.proc.poll() is not None and pytest.fail(self.log())), self.timeout,
                          "the supervisor's line")
        self.engine_pid = int(re.search(r"engine process (\d+)", line).group(1))
        self.frontend_pids = [int(p) for p in re.search(r"\[([\d, ]+)\]", line).group(1).split(",")]
        linked = lambda: self.log().count("linked to the engine process") == len(self.frontend_pids)
        wait_until(lambda: linked() or (self.proc.poll() is not None and pytest.fail(self.log())), self.timeout,
                   "every front end to be linked to the loaded engine")
        assert self.ready()
        return self

    def ready(self) -> bool:
        try:
            return web.get(self.url + "/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for pid in [self.engine_pid, *self.frontend_pids]:
            wait_until(lambda: not _alive(pid), 30, f"process {pid} to end with its supervisor")

    def metrics(self) -> str:
        return web.get(self.url + "/metrics", timeout=30).text


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def sample(text: str, name: str, **labels) -> float:
    """The sum of a metric's samples with these labels in a /metrics text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total
