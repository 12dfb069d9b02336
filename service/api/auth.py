"""API keys (one or several, from the settings or a file) and the optional /metrics token.

Keys are compared with hmac.compare_digest, against every configured key, so the time a check
takes says nothing about how much of a guess was right, nor which key it was close to.
"""

import hmac
from pathlib import Path

from fastapi import Request

from service.api.errors import APIError
from service.settings import ServerSettings


def load_api_keys(settings: ServerSettings) -> list[bytes]:
    """The keys a client may send: `api_key` (comma-separated) plus one per line of `api_key_file`
    (blank lines and lines starting with # skipped). An unreadable or empty file is a start-up error."""
    keys = [k.strip() for k in (settings.api_key or "").split(",")]
    if settings.api_key_file:
        try:
            lines = Path(settings.api_key_file).read_text().splitlines()
        except OSError as exc:
            raise SystemExit(f"--api-key-file: cannot read {settings.api_key_file}: {exc.strerror}") from None
        file_keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not file_keys:
            raise SystemExit(f"--api-key-file: {settings.api_key_file} holds no key")
        keys += file_keys
    return [k.encode() for k in keys if k]


def bearer_matches(request: Request, keys: list[bytes]) -> bool:
    sent = request.headers.get("authorization", "").encode("latin-1", "replace")
    scheme, _, token = sent.partition(b" ")
    ok = False
    for key in keys:  # no early exit: every key is compared whatever the outcome
        ok |= hmac.compare_digest(token.strip(), key)
    return ok and scheme.lower() == b"bearer"


async def require_api_key(request: Request) -> None:  # async: a sync dependency would hop to a worker thread
    keys = request.app.state.api_keys
    if keys and not bearer_matches(request, keys):
        raise APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


async def require_metrics_token(request: Request) -> None:
    token = request.app.state.metrics_token
    if token and not bearer_matches(request, token):
        raise APIError(401, f"{request.url.path} needs 'Authorization: Bearer <metrics token>'", code="invalid_api_key")
