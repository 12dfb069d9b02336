"""API errors in OpenAI's shape, raised once anywhere and turned into responses in one place."""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.engine.errors import EngineDeadError, InvalidRequestError, SlowReaderError


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def checked(out):
    """A request's output, or the 500 of a generation that failed inside the engine."""
    if out.finish_reason == "error":
        raise APIError(500, "generation failed inside the engine", type="internal_error")
    return out


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, type="service_unavailable", code="overloaded",
                    headers={"Retry-After": str(retry_after)})


def to_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return bad_request(exc.message, exc.param)
    if isinstance(exc, EngineDeadError):
        return unavailable(str(exc), retry_after=5)
    if isinstance(exc, SlowReaderError):  # only ever seen as a stream's last event
        return APIError(408, str(exc), type="client_too_slow")
    return APIError(500, "internal error", type="internal_error")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(EngineDeadError)
    async def _api_error(request: Request, exc: Exception):
        return to_api_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message, param = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
        else:
            message = f"{param + ': ' if param else ''}{first.get('msg', 'invalid request')}"
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None)).response()
