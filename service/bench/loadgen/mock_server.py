"""`bench mock-server`: an OpenAI-compatible server with no model, for measuring and testing the load generator.

Every request gets exactly max_tokens tokens (16 when absent): the first after --ttft-ms, the rest --itl-ms
apart (timed from the request's arrival, so a late wake-up does not push every later token back), streamed one
token per SSE event, or in one JSON body when not streaming. Usage counts come with the reply (prompt tokens:
the ids given, or the words of the text). /health and /v1/models answer, and /metrics counts what was served
(METRICS below; with --workers > 1 each process counts into its own file of one shared folder and /metrics sums
them, prometheus_client's multiprocess mode, so the counts are exact whichever process answers). It has no TTFT
histogram, so `bench serve`'s cross-check notes that and reports client numbers only. --drop-every K makes every K-th request (counted per worker process) hang up after
--drop-after N token events, with the response headers already sent, to test how the client records a lost
connection. A raw ASGI app on uvicorn (uvloop, httptools); --workers processes share the port.
"""

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

CONFIG_ENV = "LLM_MOCK_SERVER_CONFIG"  # how the configuration reaches uvicorn's worker processes
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # set (before uvicorn starts its processes) when --workers > 1
DEFAULT_MAX_TOKENS = 16
ROUTES = ("/v1/completions", "/v1/chat/completions")
# what /metrics counts (Prometheus text; counters, so each name ends in _total there), label `route` (one of ROUTES)
METRICS = {
    "llm_mock_requests": "generation requests answered (a body that is not JSON gets a 400 and is not counted)",
    "llm_mock_streamed_tokens": "token events streamed, one token each (those written before a hang-up included; "
                                "non-streamed replies are not streamed tokens)",
    "llm_mock_dropped_requests": "requests hung up on purpose (--drop-every)",
}


@dataclass
class MockConfig:
    model: str = "mock"
    ttft_s: float = 0.0  # from the request's arrival to its first token
    itl_s: float = 0.0  # between tokens (0: as fast as the connection takes them)
    drop_every: int = 0  # every K-th request hangs up mid-stream (0: never)
    drop_after: int = 0  # token events sent before the hang-up


class DroppedOnPurpose(Exception):
    """Raised inside a response that has started: uvicorn then closes the connection without ending the body."""


def _quiet_drops(record: logging.LogRecord) -> bool:
    if record.exc_info and isinstance(record.exc_info[1], DroppedOnPurpose):
        record.msg, record.args, record.exc_info, record.levelno, record.levelname = (
            f"dropped on purpose: {record.exc_info[1]}", (), None, logging.WARNING, "WARNING")
    return True


def _prompt_tokens(body: dict) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"] if isinstance(m, dict))
    prompt = body.get("prompt", "")
    return len(prompt) if isinstance(prompt, list) else len(str(prompt).split())


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class MockServer:
    """The ASGI app."""

    def __init__(self, config: MockConfig):
        self.config = config
        self.requests = 0  # in this worker process
        self.registry = CollectorRegistry()
        counters = {name: Counter(name, help, ["route"], registry=self.registry) for name, help in METRICS.items()}
        # route -> metric -> the labelled counter, bound once: the mock must stay cheap per request
        self.count = {route: {name: c.labels(route) for name, c in counters.items()} for route in ROUTES}

    def metrics(self) -> bytes:
        if MULTIPROC_ENV not in os.environ:
            return generate_latest(self.registry)
        merged = CollectorRegistry()  # every process's counts, from the shared folder
        MultiProcessCollector(merged)
        return generate_latest(merged)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                # a hang-up on purpose is no server error: one warning line, not a traceback
                logging.getLogger("uvicorn.error").addFilter(_quiet_drops)
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/health":
            return await _json(send, 200, {"status": "ok"})
        if method == "GET" and path == "/metrics":
            return await _reply(send, 200, self.metrics(), b"text/plain; version=0.0.4; charset=utf-8")
        if method == "GET" and path == "/v1/models":
            return await _json(send, 200, {"object": "list", "data": [
                {"id": self.config.model, "object": "model", "owned_by": "mock"}]})
        if method != "POST" or path not in ROUTES:
            return await _json(send, 404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})
        arrived = time.perf_counter()
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            body = json.loads(raw)
            n = int(body.get("max_tokens") or DEFAULT_MAX_TOKENS)
        except (ValueError, TypeError, AttributeError) as exc:
            return await _json(send, 400, {"error": {"message": f"bad request body: {exc}", "type": "invalid_request"}})
        self.requests += 1
        count = self.count[path]
        count["llm_mock_requests"].inc()
        drop = self.config.drop_every > 0 and self.requests % self.config.drop_every == 0
        if drop:
            count["llm_mock_dropped_requests"].inc()
        usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": n,
                 "total_tokens": _prompt_tokens(body) + n}
        chat = path.endswith("chat/completions")
        if body.get("stream"):
            await self._stream(send, arrived, n, chat, usage, drop,
                               (body.get("stream_options") or {}).get("include_usage", False),
                               count["llm_mock_streamed_tokens"])
        else:
            await self._sleep_until(arrived, n - 1)
            choice = ({"index": 0, "message": {"role": "assistant", "content": " x" * n}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": " x" * n, "finish_reason": "length"})
            await _json(send, 200, {"id": "mock", "object": "chat.completion" if chat else "text_completion",
                                    "model": self.config.model, "choices": [choice], "usage": usage},
                        hang_up=drop)

    async def _sleep_until(self, arrived: float, k: int) -> None:
        """Until token k (0-based) is due."""
        delay = arrived + self.config.ttft_s + k * self.config.itl_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _stream(self, send, arrived: float, n: int, chat: bool, usage: dict, drop: bool,
                      include_usage: bool, streamed: Counter) -> None:
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": "mock", "object": kind, "model": self.config.model}
        token = _event({**head, "choices": [{"index": 0, "delta": {"content": " x"}, "finish_reason": None}]
                        if chat else [{"index": 0, "text": " x", "finish_reason": None}]})
        last = _event({**head, "choices": [{"index": 0, "delta": {"content": " x"}, "finish_reason": "length"}]
                       if chat else [{"index": 0, "text": " x", "finish_reason": "length"}]})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        if chat:
            await send({"type": "http.response.body", "more_body": True, "body": _event(
                {**head, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})})
        sent = 0
        try:
            for k in range(n):
                if drop and k == self.config.drop_after:
                    raise DroppedOnPurpose(f"request {self.requests}: hung up after {k} token events (--drop-every)")
                await self._sleep_until(arrived, k)
                await send({"type": "http.response.body", "body": last if k == n - 1 else token, "more_body": True})
                sent += 1
        finally:
            streamed.inc(sent)  # before [DONE] goes out: a client that scrapes once it has every reply sees them all
        if drop:  # --drop-after >= max_tokens: hang up before the end of the stream
            raise DroppedOnPurpose(f"request {self.requests}: hung up after {n} token events (--drop-every)")
        tail = (_event({**head, "choices": [], "usage": usage}) if include_usage else b"") + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _json(send, status: int, payload: dict, hang_up: bool = False) -> None:
    await _reply(send, status, json.dumps(payload).encode(), b"application/json", hang_up)


async def _reply(send, status: int, body: bytes, content_type: bytes, hang_up: bool = False) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
    if hang_up:
        await send({"type": "http.response.body", "body": body[:len(body) // 2], "more_body": True})
        raise DroppedOnPurpose("hung up halfway through the body (--drop-every)")
    await send({"type": "http.response.body", "body": body})


def app_from_env() -> MockServer:
    """The factory uvicorn's worker processes call (--workers > 1)."""
    return MockServer(MockConfig(**json.loads(os.environ[CONFIG_ENV])))


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="service bench mock-server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--host", default="127.0.0.1", help="the address to listen on (default %(default)s)")
    a("--port", type=int, default=8000, help="the port to listen on (default %(default)s)")
    a("--workers", type=int, default=1, help="server processes sharing the port (default %(default)s)")
    a("--model", default="mock", help="the model name /v1/models lists (default %(default)s)")
    a("--ttft-ms", type=float, default=0.0, help="from a request's arrival to its first token (default %(default)s)")
    a("--itl-ms", type=float, default=0.0, help="between tokens; 0 streams as fast as the client reads (default %(default)s)")
    a("--drop-every", type=int, default=0, metavar="K", help="every K-th request per worker hangs up mid-stream")
    a("--drop-after", type=int, default=0, metavar="N", help="token events sent before that hang-up (default %(default)s)")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.drop_every < 0 or args.drop_after < 0 or args.ttft_ms < 0 or args.itl_ms < 0:
        ap.error("--workers >= 1; --drop-every, --drop-after, --ttft-ms and --itl-ms >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(sys.argv[1:] if argv is None else argv)
    config = MockConfig(args.model, args.ttft_ms / 1000, args.itl_ms / 1000, args.drop_every, args.drop_after)
    options = dict(host=args.host, port=args.port, loop="uvloop", http="httptools", log_level="warning",
                   access_log=False, lifespan="on", proxy_headers=False)
    print(f"mock server on http://{args.host}:{args.port}: {asdict(config)}, {args.workers} worker(s)", flush=True)
    if args.workers == 1:
        uvicorn.run(MockServer(config), **options)
    else:
        os.environ[CONFIG_ENV] = json.dumps(asdict(config))
        with tempfile.TemporaryDirectory(prefix="llm-mock-metrics-") as shared:  # each process's counts, for /metrics
            os.environ[MULTIPROC_ENV] = shared
            uvicorn.run("service.bench.loadgen.mock_server:app_from_env", factory=True, workers=args.workers,
                        **options)


@contextmanager
def running(port: int, *flags: str, timeout: float = 60.0):
    """A mock server in a child process on 127.0.0.1:port until the block ends; yields its base URL."""
    from service.bench import child

    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "service", "bench", "mock-server", "--port", str(port), *flags])
    try:
        if not child.answers(proc, url + "/health", timeout, 0.05):
            raise RuntimeError(f"the mock server on port {port} did not start (exit {proc.poll()})")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
