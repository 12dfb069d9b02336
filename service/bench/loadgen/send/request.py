"""One streamed request to an OpenAI-compatible server, timed chunk by chunk, every failure kept as a result.

Timing follows vLLM's benchmark: the clock starts just before the request is sent; a token-bearing chunk is any
chunk with a choice on /v1/completions (its text may be empty for special tokens or a partial character), and a
chunk with non-empty content (or reasoning) on /v1/chat/completions (the role-only first chunk is no token;
a reply without any content has its one token at the finish chunk).
Output tokens come from the final `usage` chunk; without one, the token-bearing chunks are counted instead.
A request its sample asks not to stream gets one JSON reply, all its tokens at once (its first token is its last);
one whose sample says `leave_after` N is hung up by the client after N data events (error kind client_left:
bench soak's clients that leave, so that the server must abort the request).
A failure is never raised and never counted as a success: it keeps its kind, the exception's class, and where
in the exchange it happened (before the response headers, or after N data events of the stream).
"""

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from service.bench.loadgen.workload.datasets import Sample

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass
class RequestResult:
    index: int
    scheduled: float  # seconds from the run's start when the schedule said to send it
    ready: float  # max(scheduled, when a concurrency slot freed up): the earliest it could have been sent
    sent: float = 0.0  # when it was sent; sent - ready is the generator's own dispatch lag
    chunk_times: list[float] = field(default_factory=list)  # token-bearing chunks, seconds after sending
    e2e: float | None = None  # seconds from sending to the end of the stream (successful requests)
    ended: float = 0.0  # seconds from the run's start when the request finished, whatever the outcome
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    usage_reported: bool = False
    status: int | None = None  # HTTP status
    error: str | None = None  # kind: http_503, timeout, connect_error, connection_lost, stream_error, ...
    message: str = ""
    exception: str = ""  # the class of the exception behind the error, e.g. aiohttp.ClientPayloadError
    events: int = 0  # `data:` events of the stream received (before the failure, for a failed request)
    worker: int = 0  # the rank of the worker process that sent it

    @property
    def where(self) -> str:
        """Where in the exchange a failure happened: 'before headers' or 'after N events'."""
        return "before headers" if self.status is None else f"after {self.events} events"

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


def request_body(endpoint: str, model: str, sample: Sample, ignore_eos: bool, temperature: float,
                 extra: dict | None = None) -> dict:
    body = {"model": model, "max_tokens": sample.output_len, "temperature": temperature, "stream": sample.stream}
    if sample.stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True  # an extension that vLLM, SGLang and this service accept
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    return {**body, **(extra or {}), **(sample.extra or {})}


def _error_message(raw: bytes) -> str:
    """The message of an OpenAI ({'error': {'message'}}), TGI ({'error': str}) or FastAPI ({'detail'}) error."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:300]
    error = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error)[:300]


def _bears_token(chunk: dict, chat: bool, seen: bool) -> bool:
    choices = chunk.get("choices")
    if not choices:
        return False
    if not chat:
        return True
    delta = choices[0].get("delta") or {}
    if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
        return True
    # a reply whose only token decodes to nothing (say, end of sequence at once) arrives with its finish reason
    return not seen and choices[0].get("finish_reason") is not None


async def _lines(resp: aiohttp.ClientResponse):
    """The body's lines (without their line ends) as they arrive, whatever their length: each chunk the socket
    gives is split at once (aiohttp's own line reader refuses lines over its buffer size)."""
    pending = b""
    async for chunk in resp.content.iter_any():
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending.rstrip(b"\r")


async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult, chat: bool, t0: float,
                       on_first: Callable | None, leave_after: int | None) -> dict | None:
    """Consume the SSE stream; returns the last usage seen; sets e2e at `data: [DONE]`, or an error kind."""
    usage = None
    async for line in _lines(resp):
        if result.e2e is not None:
            continue  # read past [DONE] to the end of the body, so the connection goes back to the pool
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, `event:` lines
        now = time.perf_counter()
        result.events += 1
        data = line[5:].strip()
        if data == b"[DONE]":
            result.e2e = now - t0
            continue
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError(f"a data line that is not a JSON object: {data[:100]!r}")
        if "error" in chunk:
            result.error, result.message = "stream_error", _error_message(data)
            return usage
        if _bears_token(chunk, chat, bool(result.chunk_times)):
            result.chunk_times.append(now - t0)
            if on_first is not None and len(result.chunk_times) == 1:
                on_first(result)
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
        if leave_after is not None and result.events >= leave_after:
            result.error, result.message = "client_left", f"the client hung up after {result.events} events, as asked"
            resp.close()  # drop the connection mid-stream rather than give it back to the pool
            return usage
    if result.e2e is None:
        result.error, result.message = "truncated_stream", "the stream ended without data: [DONE]"
    return usage


async def _read_reply(resp: aiohttp.ClientResponse, result: RequestResult, t0: float,
                      on_first: Callable | None) -> dict | None:
    """A non-streamed reply: its usage; its one time is both the first token's and the end's."""
    raw = await resp.read()
    now = time.perf_counter()
    reply = json.loads(raw)
    if not isinstance(reply, dict) or not reply.get("choices"):
        raise ValueError(f"a reply without choices: {raw[:100]!r}")
    result.chunk_times.append(now - t0)
    result.e2e = now - t0
    if on_first is not None:
        on_first(result)
    return reply["usage"] if isinstance(reply.get("usage"), dict) else None


def _failure_kind(exc: Exception) -> str | None:
    """The error kind of an exception that a server or the network can cause; None for any other."""
    if isinstance(exc, TimeoutError):  # asyncio's, and aiohttp's ServerTimeoutError
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):  # refused, unreachable, no such host
        return "connect_error"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError,
                        ConnectionError)):
        return "connection_lost"  # the server hung up before answering, mid-body, or the connection was reset
    if isinstance(exc, aiohttp.ClientError):
        return "http_client_error"
    if isinstance(exc, (ValueError, AttributeError, TypeError, IndexError, KeyError)):
        return "bad_response"  # a data line that is not JSON, not an object, or JSON of an unexpected shape
    return None


async def send(client: aiohttp.ClientSession, url: str, body: dict, result: RequestResult, start: float,
               timeout: float, on_first: Callable[[RequestResult], None] | None = None,
               leave_after: int | None = None) -> RequestResult:
    """Send one request (streamed unless the body says `"stream": false`) and fill in `result`; never raises for a
    server or network failure.

    `on_first` sees the request when its first token arrives; `leave_after` N hangs up after N data events."""
    t0 = time.perf_counter()
    result.sent = t0 - start
    usage = None
    try:
        async with asyncio.timeout(timeout):
            async with client.post(url, json=body) as resp:
                result.status = resp.status
                if resp.status == 200 and body.get("stream"):
                    usage = await _read_stream(resp, result, url.endswith(CHAT), t0, on_first, leave_after)
                elif resp.status == 200:
                    usage = await _read_reply(resp, result, t0, on_first)
                else:
                    result.error, result.message = f"http_{resp.status}", _error_message(await resp.read())
    except Exception as exc:  # server and network failures become error kinds; any other is a bug here
        kind = _failure_kind(exc)
        if kind is None:
            raise
        module = type(exc).__module__
        module = "aiohttp" if module.startswith("aiohttp.") else module  # the name aiohttp exports it under
        result.error, result.exception = kind, f"{module}.{type(exc).__qualname__}"
        if type(exc) is TimeoutError:
            result.message = f"no complete response within {timeout:g} s"
        elif isinstance(exc, ValueError) or kind in ("connect_error", "connection_lost"):
            result.message = (str(exc) or repr(exc))[:300]
        else:
            result.message = repr(exc)[:300]
    result.ended = time.perf_counter() - start
    if result.ok and not result.chunk_times:
        result.error, result.message = "no_tokens", "the stream carried no token"
    if not result.ok:
        result.e2e = None
    if usage:
        result.prompt_tokens, result.output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        result.usage_reported = result.output_tokens is not None
    if not result.usage_reported and result.ok:
        result.output_tokens = len(result.chunk_times)
    return result
