"""Counts every HTTP response into llm_http_requests_total by route template and status code."""

from prometheus_client import Counter


class HTTPMetrics:
    """Pure ASGI middleware (no buffering, so streamed responses pass through untouched)."""

    def __init__(self, app, counter: Counter, model: str):
        self.app = app
        self.counter = counter
        self.model = model

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # what the client gets if the app raises before it answers

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # the route template, never the raw path: labels must stay bounded
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.counter.labels(self.model, route, str(status)).inc()
