"""A real Prometheus (the Debian package) for tests: its own config, storage and free port; always stopped."""

import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

from tests import web
from tests.conftest import free_port, wait_until


class Prometheus:
    """Scrapes `targets` (host:port) every `scrape_interval`; extra config keys merge into the top level."""

    def __init__(self, targets: list[str], scrape_interval: str = "1s", **config):
        self.dir = Path(tempfile.mkdtemp(prefix="prometheus-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
                       "scrape_configs": [{"job_name": "llm-service", "static_configs": [{"targets": targets}]}],
                       **config}

    def __enter__(self) -> "Prometheus":
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(self.config))
        self.log = open(self.dir / "log", "w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--enable-feature=exemplar-storage"],
            stdout=self.log, stderr=subprocess.STDOUT)
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.dir / 'log').read_text()[-2000:]}")
            return web.get(self.url + "/-/ready", timeout=1).status_code == 200

        try:
            wait_until(ready, 30, "prometheus to be ready")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def query(self, expr: str) -> list[dict]:
        r = web.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]

    def wait_for_data(self, expr: str, timeout: float = 30.0) -> list[dict]:
        """Poll a query until it returns at least one series."""
        return wait_until(lambda: self.query(expr), timeout, f"data for {expr!r}", interval=0.5)
