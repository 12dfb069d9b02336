"""The HTTP API against real uvicorn servers on loopback, through the official openai client."""

import asyncio
import json
import os

import httpx
import openai
import pytest

from tests import web
from tests.conftest import LiveServer

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(default_model):
    with LiveServer(default_model, {"max_num_seqs": 64}) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_completion_sync_and_streaming_give_the_same_greedy_text(client, server):
    full = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(server.engine.tokenizer.encode("The capital of France is"))
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert server.wait_idle()


def test_chat_sync_and_streaming(client):
    messages = [{"role": "user", "content": "Name a color."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == text


def test_async_client_streams(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused")
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        full = await client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, temperature=0)
        await client.close()
        return chunks, full
    chunks, full = asyncio.run(main())
    assert chunks[-1].usage.completion_tokens == 5
    assert full.usage.prompt_tokens == 3 and full.usage.completion_tokens == 4


def test_64_concurrent_streaming_clients_all_complete(server):
    async def one(client, i):
        stream = await client.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens, chunks[-2].choices[0].finish_reason

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        results = await asyncio.gather(*[one(client, i) for i in range(64)])
        await client.close()
        return results
    results = asyncio.run(main())
    assert all(n == 8 or reason == "stop" for n, reason in results) and len(results) == 64
    assert server.wait_idle()


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].token == content[0].top_logprobs[0].token


def test_models_route(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_native_generate_returns_timings(server):
    r = web.post(server.url + "/generate", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0}).json()
    t = r["timings"]
    assert len(r["token_ids"]) == 5 and len(t["token_times"]) == 5 and len(t["inter_token"]) == 4
    assert 0 <= t["queue"] <= t["ttft"] == t["token_times"][0] <= t["total"]
    assert t["token_times"] == sorted(t["token_times"])
    with web.stream("POST", server.url + "/generate",
                    json={"token_ids": [1, 2, 3], "max_tokens": 4, "stream": True}) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 4
    assert len(last["timings"]["token_times"]) == 4


@pytest.mark.parametrize("route, body, status, param", [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hello " * 9000}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-5", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/generate", {"max_tokens": 3}, 400, "prompt"),
    ("/generate", {"token_ids": [1, 10**9]}, 400, "prompt"),
])
def test_invalid_requests_get_openai_errors(server, route, body, status, param):
    r = web.post(server.url + route, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"] == param or error["param"].startswith(param)
    assert web.get(server.url + "/ready").status_code == 200


def test_over_long_prompt_error_names_the_limit(server):
    r = web.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hello " * 9000})
    assert "maximum context length is 8176 tokens" in r.json()["error"]["message"]


def test_malformed_json_is_a_400_not_a_500(server):
    for raw in [b"{bad json", b"", b"[1, 2]", b'{"model": 3, "prompt": {}}']:
        r = web.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_disconnect_frees_kv_blocks(server):
    with web.stream("POST", server.url + "/v1/completions",
                    json={"model": MODEL, "prompt": "Tell a long story", "max_tokens": 2000, "ignore_eos": True,
                          "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break
        assert server.engine.has_unfinished()
    assert server.wait_idle()  # the abort freed every block

    async def leave_non_streaming():
        async with httpx.AsyncClient() as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(server.url + "/v1/completions", timeout=1.0,
                             json={"model": MODEL, "prompt": "Go on", "max_tokens": 2000, "ignore_eos": True})
    asyncio.run(leave_non_streaming())
    assert server.wait_idle()


def test_health_answers_quickly_while_the_engine_is_saturated(server):
    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            load = [asyncio.create_task(c.post(server.url + "/v1/completions", json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}))
                for _ in range(16)]
            while server.engine.num_running < 16:
                await asyncio.sleep(0.02)
            for _ in range(10):
                assert (await c.get(server.url + "/health")).status_code == 200
            still_running = server.engine.num_running
            for request in load:  # the clients leave; the server aborts their requests
                request.cancel()
            await asyncio.gather(*load, return_exceptions=True)
            return still_running
    # the bound comes from the load, not the machine: had /health waited behind the engine (the loop thread
    # holding the GIL for whole steps), the 400 steps of the batch would have ended first, however fast they ran
    assert asyncio.run(main()) == 16
    assert server.wait_idle()


def test_full_queue_gets_503_with_retry_after_and_recovers(default_model):
    with LiveServer(default_model, {"max_num_seqs": 1}, max_waiting=1) as s:
        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"model": MODEL, "prompt": "Hi", "max_tokens": 30, "ignore_eos": True}
                running = asyncio.create_task(c.post(s.url + "/v1/completions", json=body))
                while not s.engine.num_running:
                    await asyncio.sleep(0.02)
                waiting = asyncio.create_task(c.post(s.url + "/v1/completions", json=body))
                while not s.engine.num_waiting:
                    await asyncio.sleep(0.02)
                rejected = await c.post(s.url + "/v1/completions", json=body)
                done = await asyncio.gather(running, waiting)
                after = await c.post(s.url + "/v1/completions", json={**body, "max_tokens": 2})
                return rejected, done, after
        rejected, done, after = asyncio.run(main())
        assert rejected.status_code == 503 and int(rejected.headers["retry-after"]) >= 1
        assert rejected.json()["error"]["type"] == "service_unavailable"
        assert [r.status_code for r in done] == [200, 200] and after.status_code == 200
        assert s.wait_idle()


def test_api_key_is_required_when_configured(default_model):
    with LiveServer(default_model, api_key="sekret") as s:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert web.post(s.url + "/generate", json={"prompt": "x"}).status_code == 401
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret")
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1
        assert web.get(s.url + "/health").status_code == 200  # probes need no key
        folder = s.app.state.server.folder
        assert os.path.exists(os.path.join(folder, "engine"))
    assert not os.path.exists(folder)  # the engine's socket folder goes with the server
