"""Typed errors the engine raises for bad requests.

The API maps `InvalidRequestError` to HTTP 400; the engine keeps serving after raising it.
"""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot run: bad sampling values, empty or over-long prompt."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class EngineDeadError(EngineError):
    """The engine loop has stopped; no request can be served."""


class RankFailedError(EngineDeadError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on."""
