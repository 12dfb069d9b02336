"""Hostile input, body limits, keys, injected engine faults, dead engines, slow readers: the service keeps
serving, answers in OpenAI's error shape, and frees what each request held. Real uvicorn on loopback."""

import asyncio
import gc
import hmac
import http.client
import json
import select
import socket
import threading

import httpx
import pytest
import torch

from service.engine import InvalidRequestError, SamplingParams
from service.engine.errors import SlowReaderError
from tests import web
from tests.conftest import Linked, LiveServer, make_engine, wait_until
from tests.otlp import Receiver

VOCAB = 512  # random:tiny's vocabulary


@pytest.fixture(scope="module")
def server(tiny_model):
    with LiveServer(tiny_model, {"max_num_seqs": 16}, max_request_bytes=64 * 1024) as s:
        yield s


def completion(server, **fields) -> httpx.Response:
    body = {"model": server.engine.model_name, "prompt": [1, 2, 3], "max_tokens": 1, **fields}
    return web.post(server.url + "/v1/completions", json=body, timeout=60)


def metric(server, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = web.get(server.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


# every numeric field at and just past each end of its range: (field, value, accepted)
BOUNDARIES = [
    ("seed", 2**64 - 1, True), ("seed", 2**64, False), ("seed", 2**80, False), ("seed", -2**63, True),
    ("seed", -2**63 - 1, False),
    ("temperature", 0, True), ("temperature", 1e-30, True), ("temperature", 100, True), ("temperature", 100.001, False),
    ("temperature", -1e-9, False),
    ("top_p", 1, True), ("top_p", 1e-9, True), ("top_p", 0, False), ("top_p", 1.000001, False),
    ("top_k", -1, True), ("top_k", 2**31 - 1, True), ("top_k", 2**31, False), ("top_k", 2**80, False),
    ("top_k", -2, False),
    ("max_tokens", 1, True), ("max_tokens", 1021, True), ("max_tokens", 1022, False), ("max_tokens", 0, True),
    ("max_tokens", 2**80, False), ("max_tokens", -1, False),
    ("min_tokens", 1, True), ("min_tokens", 2, False), ("min_tokens", -1, False), ("min_tokens", 2**40, False),
    ("logprobs", 0, True), ("logprobs", 20, True), ("logprobs", 21, False), ("logprobs", -1, False),
    ("stop_token_ids", [VOCAB - 1], True), ("stop_token_ids", [VOCAB], False), ("stop_token_ids", [-1], False),
    ("stop_token_ids", [2**70], False),
    ("prompt", [0, VOCAB - 1], True), ("prompt", [VOCAB], False), ("prompt", [-1], False), ("prompt", [2**70], False),
    ("n", 1, True), ("n", 2**70, False), ("presence_penalty", 1e308, False), ("best_of", 2**70, False),
    ("presence_penalty", 2, True), ("presence_penalty", 2.0001, False), ("frequency_penalty", -2, True),
    ("frequency_penalty", -2.0001, False), ("repetition_penalty", 1e-9, True), ("repetition_penalty", 0, False),
    ("repetition_penalty", -1, False), ("logit_bias", {str(VOCAB - 1): 1e9}, True), ("logit_bias", {str(VOCAB): 1}, False),
]


@pytest.mark.parametrize("field, value, accepted", BOUNDARIES, ids=lambda v: str(v)[:12])
def test_every_numeric_field_is_checked_at_its_boundaries(server, field, value, accepted):
    r = completion(server, **{field: value})
    if accepted:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field


def test_min_tokens_beyond_the_context_left_is_refused(server):
    r = completion(server, max_tokens=None, min_tokens=1022)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


@pytest.mark.parametrize("raw, param", [
    (b'{"temperature": NaN}', "temperature"), (b'{"top_p": NaN}', "top_p"), (b'{"temperature": Infinity}', "temperature"),
    (b'{"top_p": -Infinity}', "top_p"), (b'{"max_tokens": 1e400}', "max_tokens"), (b'{"seed": 1.5}', "seed"),
])
def test_non_finite_and_non_integer_numbers_are_400s(server, raw, param):
    body = json.loads(raw)  # Python's json reads NaN and Infinity, as the server's does
    body.update(model=server.engine.model_name, prompt=[1, 2])
    r = web.post(server.url + "/v1/completions", content=json.dumps(body), timeout=60,
                 headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def nested(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


# schemas a client may send to exhaust the grammar compiler or the matcher: (field, schema, accepted). Refused ones
# get a 400 naming their field; accepted ones an answer within max_tokens. Either way the server serves on
HOSTILE_SCHEMAS = [
    ("response_format", {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}, False),
    ("response_format", {"enum": [f"value number {i}" for i in range(2000)]}, False),  # over 32 KiB too
    ("response_format", nested(30), False),
    ("response_format", {"type": "string", "pattern": "(("}, False),
    ("response_format", {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, False),
    ("response_format", {"type": "string", "pattern": "(a*)*b" * 200}, True),
    ("response_format", {"type": "string", "pattern": "|".join(f"w{i}x" for i in range(3000))}, True),
    ("response_format", {"type": "string", "pattern": "(a{1,1000}){1,1000}"}, False),
    ("response_format", {"type": "string", "pattern": "^.{0,256}$"}, False),  # every token of it would take ms
    ("response_format", {"type": "string", "pattern": "^(.{0,10}){0,100}$"}, False),  # a compile of minutes
    ("response_format", {"type": "string", "pattern": "^.{0,128}$", "maxLength": 1000000}, True),
    ("response_format", {"type": "array", "minItems": 1000000, "items": {"type": "integer"}}, False),
    ("response_format", {"type": "array", "maxItems": 1000000, "items": {"type": "integer"}}, True),
    ("response_format", {"type": "string", "minLength": 100000, "maxLength": 1000000}, True),
    ("response_format", {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}},
                         "$ref": "#/$defs/a"}, True),
    ("tools", {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}, False),
    ("tools", nested(30), False),
    ("tools", {"type": "string", "pattern": "(a*)*b" * 200}, True),
]


@pytest.fixture(scope="module")
def text_server(default_model):
    """Grammars need a tokenizer, which random:tiny lacks: the default model."""
    with LiveServer(default_model, {"max_num_seqs": 4}) as s:
        yield s


@pytest.mark.parametrize("field, schema, accepted", HOSTILE_SCHEMAS, ids=lambda v: str(v)[:24])
def test_a_hostile_schema_is_refused_or_bounded_and_the_server_serves_on(text_server, field, schema, accepted):
    if field == "tools":  # tool_choice required: the tools' arguments become the grammar
        fields = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": schema}}}}], "tool_choice": "required"}
    else:
        fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    body = {"model": text_server.engine.model_name, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "temperature": 0}
    r = web.post(text_server.url + "/v1/chat/completions", json={**body, **fields}, timeout=120)
    if accepted:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 4
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and r.json()["error"]["message"]
    plain = web.post(text_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"]
    assert text_server.wait_idle()


def test_an_unexpected_error_is_a_json_500_that_keeps_the_connection(server, monkeypatch):
    client = server.app.state.server.client
    monkeypatch.setattr(client, "submit", lambda *a, **k: 1 / 0)  # a bug in a route's path
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=30)
    body = json.dumps({"model": server.engine.model_name, "prompt": [1, 2], "max_tokens": 1})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    first = conn.getresponse()
    assert first.status == 500
    assert json.loads(first.read())["error"] == {"message": "internal error", "type": "internal_error",
                                                 "param": None, "code": None}
    sock = conn.sock
    assert sock is not None and first.getheader("connection") != "close"
    monkeypatch.undo()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    second = conn.getresponse()
    assert second.status == 200 and conn.sock is sock  # the same connection served the next request
    second.read()
    conn.close()


def raw_exchange(server, head: bytes, chunks: list[bytes]) -> tuple[bytes, int]:
    """Send a request head and body chunks on a raw socket (stopping when the server answers); return the
    answer and how many body bytes went out."""
    host, port = server.url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        sent = 0
        for chunk in chunks:
            # stop sending once the server has answered: more would be unread when it closes, and a close
            # with unread data resets the connection (and the answer with it)
            if select.select([sock], [], [], 0.5)[0]:
                break
            sock.sendall(chunk)
            sent += len(chunk)
        answer = b""
        while data := sock.recv(65536):
            answer += data
        return answer, sent


def test_a_body_over_the_limit_gets_413_without_being_read(server):
    # Content-Length says 64 MiB; only 1 KiB ever follows, and the answer comes at once
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 67108864\r\n\r\n")
    answer, _ = raw_exchange(server, head, [b" " * 1024])
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413 ") and b"connection: close" in rest.lower()
    error = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["message"] == "the request body exceeds 65536 bytes (--max-request-bytes)"
    assert error["type"] == "invalid_request_error"
    assert completion(server).status_code == 200


def test_a_chunked_body_over_the_limit_gets_413_once_the_limit_is_passed(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b" " * 8192
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    answer, _ = raw_exchange(server, head, [chunk] * 9 + [b"0\r\n\r\n"])  # 72 KiB, just past 64 KiB
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"exceeds 65536 bytes" in answer
    # a body just under the limit is read and parsed as usual
    padded = json.dumps({"model": server.engine.model_name, "prompt": [1, 2], "max_tokens": 1, "user": "x" * 60000})
    assert web.post(server.url + "/v1/completions", content=padded.encode(),
                    headers={"content-type": "application/json"}).status_code == 200


def test_several_api_keys_from_a_list_and_a_file_each_compared_in_constant_time(tiny_model, tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated monthly\nkey-from-file\n\n")
    with LiveServer(tiny_model, api_key="key-one, key-two", api_key_file=str(key_file), metrics_token="scrape") as s:
        models = lambda key: web.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code
        assert [models(k) for k in ["key-one", "key-two", "key-from-file"]] == [200, 200, 200]
        assert [models(k) for k in ["key-on", "key-one2", "key-one key-two", "rotated monthly", "scrape"]] == [401] * 5
        assert web.get(s.url + "/v1/models", headers={"Authorization": "Basic key-one"}).status_code == 401

        compared = []
        real = hmac.compare_digest
        monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
        models("key-one")
        assert compared == [b"key-one", b"key-two", b"key-from-file"]  # every key, no early exit
        monkeypatch.undo()

        assert web.get(s.url + "/metrics").status_code == 401
        assert web.get(s.url + "/metrics", headers={"Authorization": "Bearer key-one"}).status_code == 401
        scraped = web.get(s.url + "/metrics", headers={"Authorization": "Bearer scrape"})
        assert scraped.status_code == 200 and "llm_requests_total" in scraped.text
        assert web.get(s.url + "/health").status_code == 200 and web.get(s.url + "/ready").status_code == 200


def test_an_unreadable_key_file_stops_the_start_with_one_line(tiny_model, tmp_path):
    from service.api.auth import load_api_keys
    from service.settings import ServerSettings
    with pytest.raises(SystemExit, match="cannot read .*/missing: No such file or directory"):
        load_api_keys(ServerSettings(api_key_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(SystemExit, match="holds no key"):
        load_api_keys(ServerSettings(api_key_file=str(tmp_path / "empty")))


def inject_faults(engine, monkeypatch, faults: list):
    """The next len(faults) forward passes fail: an exception raised, or NaN logits handed to the sampler."""
    runner = engine.runner
    forward, sample = runner.forward, runner.sampler

    def nan_once(logits, seqs, masks=None, argmax=None, masked=None):  # (a graph's argmax and masked maxima are of
        # the logits before: dropped)
        runner.sampler = sample
        return sample(torch.full_like(logits, float("nan")), seqs, masks)

    def faulty_forward(batch):
        fault = faults.pop(0) if faults else None
        if isinstance(fault, Exception):
            raise fault
        if fault == "nan":
            runner.sampler = nan_once
        return forward(batch)
    monkeypatch.setattr(runner, "forward", faulty_forward)


def test_forward_faults_fail_their_requests_and_the_engine_serves_on(tiny_model, monkeypatch):
    from tests.telemetry.test_telemetry import use_collector
    with Receiver("http/protobuf") as receiver:
        use_collector(monkeypatch, receiver.endpoint)
        with LiveServer(tiny_model) as s:
            inject_faults(s.engine, monkeypatch, [torch.OutOfMemoryError("CUDA out of memory (injected)"), "nan",
                                                  RuntimeError("injected")])
            body = {"model": s.engine.model_name, "prompt": [1, 2, 3], "max_tokens": 8}
            oom = web.post(s.url + "/v1/completions", json=body, timeout=60)
            nan = web.post(s.url + "/v1/completions", json=body, timeout=60)
            with web.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            after = web.post(s.url + "/v1/completions", json=body, timeout=60)
            assert s.wait_idle()  # every failed request's blocks are free again
            failures = {e: metric(s, "llm_engine_step_failures_total", error=e)
                        for e in ["OutOfMemoryError", "NonFiniteLogitsError", "RuntimeError"]}
            errors = metric(s, "llm_requests_total", finish_reason="error")
            spans = receiver.wait_for(lambda spans: len([sp for sp in spans if sp.name.startswith("text_completion")
                                                         ]) >= 4)
    for r in (oom, nan):
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "generation failed inside the engine", "type": "internal_error",
                                     "param": None, "code": None}
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "internal_error"
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8
    assert failures == {"OutOfMemoryError": 1, "NonFiniteLogitsError": 1, "RuntimeError": 1} and errors == 3
    generations = sorted((sp for sp in spans if sp.name.startswith("text_completion")), key=lambda sp: sp.start_ns)
    assert [sp.attributes["gen_ai.response.finish_reasons"] for sp in generations] == [["error"]] * 3 + [["length"]]
    assert [sp.status_code for sp in generations] == [2, 2, 2, 0]  # ERROR, then UNSET


def test_a_failure_reported_to_an_idle_engine_ends_its_loop_at_once(tiny_model, idle_engine_core):
    with LiveServer(tiny_model) as s:
        assert idle_engine_core.wait(60)
        s.app.state.server.core.fail("tensor-parallel rank 1 exited with code -9")  # as the rank watcher reports it
        wait_until(lambda: web.get(s.url + "/health").status_code == 503, 60,
                   "the engine loop to end")  # unwoken, it would look again in ten minutes
        assert "tensor-parallel rank 1 exited with code -9" in web.get(s.url + "/health").json()["error"]
        r = web.post(s.url + "/v1/completions", json={"model": s.engine.model_name, "prompt": [1]})
        assert r.status_code == 503


def test_a_dead_engine_loop_fails_health_and_readiness(tiny_model, monkeypatch):
    with LiveServer(tiny_model) as s:
        monkeypatch.setattr(s.engine.scheduler, "schedule", lambda: 1 / 0)  # a bug in the loop itself
        r = web.post(s.url + "/v1/completions", json={"model": s.engine.model_name, "prompt": [1], "max_tokens": 2},
                     timeout=60)
        assert r.status_code == 503 and "engine loop died: ZeroDivisionError" in r.json()["error"]["message"]
        health, ready = web.get(s.url + "/health"), web.get(s.url + "/ready")
        assert health.status_code == 503
        assert health.json()["status"] == "engine dead"
        assert "engine loop died: ZeroDivisionError('division by zero')" in health.json()["error"]
        assert ready.status_code == 503 and ready.json()["reason"].startswith("failed: EngineDeadError(")
        later = web.post(s.url + "/v1/completions", json={"model": s.engine.model_name, "prompt": [1]})
        assert later.status_code == 503 and later.json()["error"]["type"] == "service_unavailable"


def test_a_reader_that_stops_reading_is_cut_off_with_bounded_memory(tiny_model):
    with LiveServer(tiny_model, {"max_model_len": 1024}, stream_backlog=16) as s:
        host, port = s.url.rsplit("/", 1)[1].split(":")
        body = json.dumps({"model": s.engine.model_name, "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True,
                           "logprobs": 20, "stream": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
        sock.connect((host, int(port)))
        # and small kernel buffers on the server's side of this connection (as over a slow network): else
        # loopback's autotuned buffers (up to 4 MiB) would absorb the whole stream
        me = sock.getsockname()
        conn = wait_until(lambda: next((c for c in s.server.server_state.connections if c.client == me), None), 60,
                          "the server to accept the connection")
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            def cut() -> bool:
                assert metric(s, "llm_requests_total", finish_reason="length") == 0, "it ran to the end uncut"
                return metric(s, "llm_requests_total", finish_reason="abort") == 1
            # generation must first fill the socket buffers (a few hundred KB): seconds, more on a busy machine
            wait_until(cut, 300, "the stalled stream's request to be aborted")
            assert s.wait_idle()  # its blocks are free, though the client is still connected
            generated = metric(s, "llm_generation_tokens_total")
            assert generated < 1000
            assert s.app.state.server.client.requests == {}  # forgotten at the cut: only its error waits
            sock.settimeout(30)
            received = b""
            while data := sock.recv(1 << 16):
                received += data
                if b"data: [DONE]" in received:
                    break
        finally:
            sock.close()
        events = [line[6:] for line in received.decode().split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "client_too_slow"
        assert len(events) - 2 < generated  # what it never read was dropped, not buffered
        assert completion(s).status_code == 200  # a normal client is served as before


def test_a_stream_not_read_past_its_backlog_is_aborted_and_its_outputs_dropped(tiny_model):
    engine = make_engine(tiny_model)
    # the engine holds after its first token until the reader has it (else a busy machine may let the engine run 9
    # steps before the reader's first turn, and the cut comes first); then it runs free while the reader stops
    step, produced, read = engine.step, threading.Event(), threading.Event()

    def step_after_the_first_read():
        if produced.is_set():
            assert read.wait(60), "the reader never took its first output"
        rows = step()
        if any(row[1] for row in rows):
            produced.set()
        return rows
    engine.step = step_after_the_first_read

    async def main():
        async with Linked(engine, stream_backlog=8) as link:
            stream = link.generate([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True))
            first = await anext(stream)  # then stop reading, while the engine goes on
            read.set()
            while engine.has_unfinished():
                await asyncio.sleep(0.01)
            with pytest.raises(SlowReaderError, match="fell 8 chunks behind"):
                await anext(stream)
            return first, dict(link.client.requests)
    first, left = asyncio.run(main())
    # the first read may hold more than one token (deltas a lagging reader has not taken are merged into one)
    assert 1 <= first.num_output_tokens < 500 and not first.finished
    assert left == {}  # cut and forgotten; what it never read was dropped
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs


def test_many_concurrent_submitters_keep_the_counts_exact_and_one_id_wins(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=8)

    async def one(link, i: int) -> int:
        outs = [o async for o in link.generate([1 + i % 100, 2], SamplingParams(max_tokens=2, ignore_eos=True))]
        return outs[-1].num_output_tokens

    async def duplicate(link) -> str:
        try:
            outs = [o async for o in link.generate([5, 6], SamplingParams(max_tokens=30, ignore_eos=True),
                                                   request_id="same-id")]
            return outs[-1].finish_reason
        except InvalidRequestError as exc:
            return exc.param

    async def main():
        async with Linked(engine) as link:
            results = await asyncio.gather(*[duplicate(link) for _ in range(8)], *[one(link, i) for i in range(160)])
            return results, link.client.requests, link.client.pending
    results, requests, pending = asyncio.run(main())
    assert sorted(results[:8]) == ["length"] + ["request_id"] * 7  # one winner
    assert results[8:] == [2] * 160
    assert requests == {} and pending == {} and engine.num_waiting == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs


def test_an_admitted_request_never_read_runs_out_and_leaves_nothing_behind(tiny_model):
    """A request the engine admitted whose response never began reading (its route failed after submit) runs
    to its end and is forgotten: it holds no place in the queue, no stream and no blocks."""
    engine = make_engine(tiny_model, max_num_seqs=1)

    async def main():
        async with Linked(engine) as link:
            unread = [await link.submit([1, 2, 3], SamplingParams(max_tokens=2)) for _ in range(3)]
            del unread
            gc.collect()
            while link.client.requests or engine.has_unfinished():
                await asyncio.sleep(0.01)
            outs = [o async for o in link.generate([4, 5], SamplingParams(max_tokens=3, ignore_eos=True))]
            return outs, engine.num_waiting
    outs, waiting = asyncio.run(main())
    assert outs[-1].finished and waiting == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs
