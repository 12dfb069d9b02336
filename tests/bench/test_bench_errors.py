"""Failures other servers (or networks) produce, each kept as an error kind, never a crash.

A small raw HTTP/1.1 server on loopback plays a misbehaving OpenAI-compatible server; the model name in the
request picks the misbehaviour. (Our own server's behaviour is tested against the real thing elsewhere.)
"""

import asyncio
import json

import pytest

from service.bench.loadgen import serve
from service.bench.loadgen.workload.datasets import RandomWorkload
from service.bench.loadgen.send.dispatch import LoadSpec, run_load
from service.bench.loadgen.results.summary import summarize
from tests.conftest import free_port


def _chunk(text: str, finish=None) -> bytes:
    body = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}\n\n'
DONE = b"data: [DONE]\n\n"
SILENT_S = 5  # how long the "slow" model keeps its first byte back
# what each "model" answers after the response headers (None: a plain HTTP error, see _handle)
BEHAVIOURS = {
    "fine": [_chunk("a"), _chunk("b"), _chunk("c", "length"), USAGE, DONE],
    "no-usage": [_chunk("a"), _chunk("b"), _chunk("c", "length"), DONE],
    "midstream-error": [_chunk("a"), b'data: {"error": {"message": "engine died", "type": "internal_error"}}\n\n',
                        DONE],
    "truncated": [_chunk("a"), _chunk("b")],
    "garbage": [_chunk("a"), b"data: {not json\n\n", DONE],
    "list-chunk": [_chunk("a"), b"data: [1, 2]\n\n", DONE],
    "odd-choices": [b'data: {"choices": ["text"]}\n\n', DONE],
    "nothing": [USAGE, DONE],
}


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    path = head.split(b" ")[1].decode()
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    body = json.loads(await reader.readexactly(length)) if length else {}
    model = body.get("model", "")
    if path == "/metrics" or model == "http-500":
        status, payload = ("404 Not Found", b"not here") if path == "/metrics" else (
            "500 Internal Server Error", b'{"error": {"message": "boom", "type": "internal_error"}}')
        writer.write(f"HTTP/1.1 {status}\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload)
    elif model == "tgi-style-503":
        payload = b'{"error": "Model is overloaded", "error_type": "overloaded"}'
        writer.write(f"HTTP/1.1 503 Service Unavailable\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload)
    elif model == "hang-up":  # the request read, no answer at all
        pass
    elif model == "drop":  # a chunked body: one whole chunk, then half of one, then hang up
        first = _chunk("a")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     + f"{len(first):x}\r\n".encode() + first + b"\r\n" + b"ff\r\ndata: {")
    else:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        if model == "slow":
            await asyncio.sleep(SILENT_S)
        for part in BEHAVIOURS.get(model, []):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.002)
    await writer.drain()
    writer.close()


async def _run_against_fake(model: str, timeout: float = 10.0, n: int = 2, endpoint: str = "/v1/completions"):
    port = free_port()
    server = await asyncio.start_server(_handle, "127.0.0.1", port)
    async with server:
        spec = LoadSpec(f"http://127.0.0.1:{port}", model, endpoint, num_requests=n, request_timeout=timeout)
        run = await run_load(spec, RandomWorkload(8, 3, prompt_kind="words").sample)
    return run


@pytest.mark.parametrize("model, kind, message", [
    ("http-500", "http_500", "boom"),
    ("tgi-style-503", "http_503", "Model is overloaded"),
    ("midstream-error", "stream_error", "engine died"),
    ("truncated", "truncated_stream", "without data: [DONE]"),
    ("garbage", "bad_response", ""),
    ("list-chunk", "bad_response", "not a JSON object"),
    ("nothing", "no_tokens", "no token"),
])
def test_each_failure_is_its_kind(model, kind, message):
    run = asyncio.run(_run_against_fake(model))
    assert [r.error for r in run.results] == [kind, kind]
    assert all(message in r.message and r.e2e is None for r in run.results)
    s = summarize(run.results, run.duration)
    assert s["requests.failed"] == 2 and s[f"errors.{kind}"] == 2 and s["ttft_ms.mean"] is None


def test_json_of_an_unexpected_shape_is_a_bad_response_not_a_crash():
    run = asyncio.run(_run_against_fake("odd-choices", endpoint="/v1/chat/completions"))
    assert [r.error for r in run.results] == ["bad_response", "bad_response"]


def test_a_timeout_bounds_a_silent_server():
    run = asyncio.run(_run_against_fake("slow", timeout=0.3, n=1))
    assert run.results[0].error == "timeout" and run.duration < SILENT_S  # it gave up before the server answered


def test_a_dropped_connection_is_connection_lost():
    run = asyncio.run(_run_against_fake("drop", n=1))
    r = run.results[0]
    assert r.error == "connection_lost" and len(r.chunk_times) == 1, r.message
    assert r.exception == "aiohttp.ClientPayloadError" and r.status == 200 and r.where == "after 1 events"


def test_a_server_that_hangs_up_before_answering_is_connection_lost_before_headers():
    run = asyncio.run(_run_against_fake("hang-up", n=1))
    r = run.results[0]
    assert (r.error, r.exception, r.status, r.where) == ("connection_lost", "aiohttp.ServerDisconnectedError", None,
                                                         "before headers"), r.message
    assert "Server disconnected" in r.message and r.e2e is None


def test_a_stream_without_usage_counts_its_token_chunks():
    run = asyncio.run(_run_against_fake("no-usage", n=1))
    r = run.results[0]
    assert r.ok and not r.usage_reported and r.output_tokens == 3 and r.prompt_tokens is None
    assert summarize(run.results, run.duration)["requests.without_usage"] == 1


def test_a_refused_connection_is_connect_error():
    run = asyncio.run(run_load(LoadSpec(f"http://127.0.0.1:{free_port()}", "m", num_requests=3),
                               RandomWorkload(8, 3).sample))
    assert [r.error for r in run.results] == ["connect_error"] * 3


def test_a_server_without_metrics_gets_a_note_and_client_numbers(capsys):
    async def main():
        port = free_port()
        server = await asyncio.start_server(_handle, "127.0.0.1", port)
        async with server:
            return await asyncio.to_thread(serve.main, [
                "--url", f"http://127.0.0.1:{port}", "--model", "fine", "--num-requests", "3",
                "--input-len", "8", "--output-len", "3", "--progress", "off"])
    [doc] = asyncio.run(main())
    assert doc["summary"]["requests.completed"] == 3 and doc["summary"]["output_tokens"] == 9
    assert "rows" not in doc["crosscheck"] and "404" in doc["crosscheck"]["note"]
    assert "client numbers only" in " ".join(capsys.readouterr().out.split())
