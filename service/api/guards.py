"""ASGI guards around the app: a request-body size limit (413 without reading the rest), and a last
resort that turns an unexpected exception into a JSON 500 that keeps the client's connection open."""

import logging

from starlette.exceptions import HTTPException

from service.api.errors import APIError

log = logging.getLogger(__name__)


def too_large(limit: int) -> APIError:
    # the rest of the body stays unread, so the connection cannot be reused: say so and close it
    return APIError(413, f"the request body exceeds {limit} bytes (--max-request-bytes)",
                    headers={"Connection": "close"})


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a body without Content-Length passes the limit; FastAPI lets an
    HTTPException through its body parsing, and the app's handler answers it in OpenAI's shape."""

    def __init__(self, limit: int):
        error = too_large(limit)
        super().__init__(413, error.message, headers=error.headers)


class BodyLimit:
    """Bodies over `max_bytes` get 413: at once when Content-Length says so, else as soon as the chunks
    read pass the limit. Either way no more than `max_bytes` (plus one chunk) is ever read."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_large(self.max_bytes).response()(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


class ContainErrors:
    """A bug that escapes a route becomes a JSON 500 in OpenAI's shape, logged once. Starlette's own
    last-resort handler re-raises after answering, and uvicorn then drops the connection, so a client's
    next request on it would fail too. Once a response has started, the exception still propagates:
    a half-sent body can only end by closing the connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def note_start(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, note_start)
        except Exception:
            if started:
                raise
            log.exception("unhandled error answering %s %s", scope.get("method"), scope.get("path"))
            await APIError(500, "internal error", type="internal_error").response()(scope, receive, send)
