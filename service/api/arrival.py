"""Starts each request's clock the moment the server receives it, before its body is read or parsed.

The generation routes hand that reading to the engine as the request's arrival, so TTFT, queue time and
end-to-end latency include the server's own front-end work (body, validation, chat template, tokenization), and the
wait before it: under uvicorn the clock starts when the request's first bytes are parsed (`StampingHttpTools`), not
when its ASGI task first runs, which may be after the handlers of a burst of requests that came before it (on the
H200, closed-loop clients saw TTFT about 20 ms above a clock started there, at 256 concurrent streams).
"""

import time

from fastapi import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class StampingHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, noting in each request's ASGI state when its first bytes were parsed."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["state"]["arrival"] = time.perf_counter()


class ArrivalClock:
    """Pure ASGI middleware: notes `time.perf_counter()` (the clock of the engine's Timings) in the request's state,
    unless the server's protocol did so already (StampingHttpTools).

    Added last, so it runs first: only Starlette's error middleware (and, with tracing on, the OpenTelemetry
    HTTP middleware, which opens the server span) see the request before it.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {}).setdefault("arrival", time.perf_counter())
        await self.app(scope, receive, send)


def arrival(request: Request) -> float | None:
    """When the server received this request (None for an app built without ArrivalClock)."""
    return getattr(request.state, "arrival", None)
