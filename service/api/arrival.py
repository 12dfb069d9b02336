"""Starts each request's clock the moment the server receives it, before its body is read or parsed.

The generation routes hand that reading to the engine as the request's arrival, so TTFT, queue time and
end-to-end latency include the server's own front-end work (body, validation, chat template, tokenization).
"""

import time

from fastapi import Request


class ArrivalClock:
    """Pure ASGI middleware: notes `time.perf_counter()` (the clock of the engine's Timings) in the request's state.

    Added last, so it runs first: only Starlette's error middleware (and, with tracing on, the OpenTelemetry
    HTTP middleware, which opens the server span) see the request before it.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival"] = time.perf_counter()
        await self.app(scope, receive, send)


def arrival(request: Request) -> float | None:
    """When the server received this request (None for an app built without ArrivalClock)."""
    return getattr(request.state, "arrival", None)
