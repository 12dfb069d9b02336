"""n samples, prompt lists, echo with prompt logprobs and max_tokens 0, through the official openai client against a
real uvicorn server on loopback (the default model, on CPU)."""

import asyncio
import math
from collections import defaultdict

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import web
from tests.conftest import LiveServer, wait_until

MODEL = "SmolLM2-135M-Instruct"
LONG = {"max_tokens": 2000, "ignore_eos": True}  # a request that runs until its client leaves


@pytest.fixture(scope="module")
def server(default_model):
    with LiveServer(default_model, {"max_num_seqs": 64}) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def encode(server, text: str) -> list[int]:
    return server.engine.tokenizer.encode(text, add_special_tokens=False)


def by_choice(chunks) -> dict[int, list]:
    """A stream's choices, each its chunks in order; every chunk carries exactly one choice."""
    choices = defaultdict(list)
    for chunk in chunks:
        if chunk.choices:
            assert len(chunk.choices) == 1
            choices[chunk.choices[0].index].append(chunk.choices[0])
    return choices


# -- n ----------------------------------------------------------------------------------------------------------
def test_n_completions_are_indexed_and_usage_counts_the_prompt_once(client, server):
    prompt = "Once upon a time"
    out = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.text for c in out.choices)
    assert out.usage.prompt_tokens == len(encode(server, prompt))
    assert out.usage.completion_tokens == 3 * 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 18
    assert server.wait_idle()


def test_n_streaming_completions_carry_one_choice_a_chunk(client, server):
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", n=4, max_tokens=5,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    choices = by_choice(chunks)
    assert sorted(choices) == [0, 1, 2, 3]
    for parts in choices.values():  # the finish comes with each choice's last chunk, and only there
        assert [p.finish_reason for p in parts] == [None] * (len(parts) - 1) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(encode(server, "Once upon a time"))
    assert server.wait_idle()


def test_seeded_n_samples_reproduce_and_differ(client):
    def texts(n: int) -> list[str]:
        out = client.completions.create(model=MODEL, prompt="My favourite animal is", n=n, max_tokens=12,
                                        temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
        return [c.text for c in out.choices]
    first, again = texts(4), texts(4)
    assert first == again
    assert len(set(first)) == 4


def test_n_chat_each_choice_opens_with_the_assistant_role(client):
    messages = [{"role": "user", "content": "Name a color."}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=6, seed=7,
                                                 stream=True, stream_options={"include_usage": True}))
    choices = by_choice(chunks)
    assert sorted(choices) == [0, 1, 2]
    for parts in choices.values():
        assert parts[0].delta.role == "assistant" and all(p.delta.role is None for p in parts[1:])
        assert parts[-1].finish_reason in ("stop", "length")
    streamed = ["".join(p.delta.content or "" for p in choices[i]) for i in range(3)]
    full = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=6, seed=7)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert [c.message.content for c in full.choices] == streamed
    assert full.usage.completion_tokens == chunks[-1].usage.completion_tokens
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


def test_best_of_equal_to_n_and_user_as_an_object_are_accepted(client):
    out = client.completions.create(model=MODEL, prompt="Hi", n=2, best_of=2, max_tokens=2,
                                    user="someone")
    assert len(out.choices) == 2
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"user": {"name": "Ada", "id": "u1", "email": "ada@example.com", "role": "user"},
                    "an_unknown_field": True})
    assert chat.choices[0].message.content is not None


# -- prompt lists --------------------------------------------------------------------------------------------------
def test_prompt_list_with_n_is_indexed_prompt_major(client, server):
    prompts = ["The sky is", "Water boils at"]
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, echo=True,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(prompts[c.index // 2]) for c in out.choices] == [True] * 4
    assert out.usage.prompt_tokens == sum(len(encode(server, p)) for p in prompts)
    assert out.usage.completion_tokens == 4 * 4

    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, echo=True, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    choices = by_choice(chunks)
    assert sorted(choices) == [0, 1, 2, 3]
    for i, parts in choices.items():  # the prompt comes with each choice's first chunk
        assert parts[0].text.startswith(prompts[i // 2]) and not any(p.text.startswith(prompts[i // 2])
                                                                      for p in parts[1:])
    assert chunks[-1].usage.model_dump() == out.usage.model_dump()
    assert server.wait_idle()


def test_token_id_prompt_lists_and_greedy_equals_one_prompt_at_a_time(client, server):
    prompts = [encode(server, "One, two, three,"), encode(server, "Paris is the capital of")]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == sum(map(len, prompts))
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
             for p in prompts]
    assert [c.text for c in out.choices] == alone


# -- echo, prompt logprobs, max_tokens 0 ---------------------------------------------------------------------------
def test_max_tokens_zero_returns_the_prompt_only(client, server):
    plain = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0)
    assert plain.choices[0].text == "" and plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 0
    echoed = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True)
    assert echoed.choices[0].text == "Hello there" and echoed.choices[0].finish_reason == "length"
    ids = encode(server, "Hello there")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True)
    assert by_ids.choices[0].text == server.engine.tokenizer.decode(ids)
    chunks = list(client.completions.create(model=MODEL, prompt="Hello there", max_tokens=0, echo=True, stream=True))
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks] == [("Hello there", "length")]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=0)
    assert chat.choices[0].message.content == "" and chat.usage.completion_tokens == 0
    assert server.wait_idle()


def test_prompt_logprobs_equal_transformers_log_softmax(client, server, default_model):
    from tests.conftest import reference_logprobs

    # lm-evaluation-harness's loglikelihood request: token-id prompts, echo, no new token, top 5
    prompts = [encode(server, "The quick brown fox jumps over the lazy dog."), encode(server, "1 + 1 = 2")]
    out = client.completions.create(model=MODEL, prompt=prompts, echo=True, max_tokens=0, logprobs=5,
                                    temperature=0)
    assert server.wait_idle()  # the reference borrows the server's model: nothing may run on it meanwhile
    for choice, ids in zip(out.choices, prompts):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
        reference = reference_logprobs(default_model, ids)
        for p in range(1, len(ids)):
            assert math.isclose(lp.token_logprobs[p], reference[p - 1, ids[p]].item(), abs_tol=1e-3)
            top = reference[p - 1].topk(5).values.tolist()
            assert len(lp.top_logprobs[p]) <= 5  # tokens of the same text share a key
            assert all(any(math.isclose(v, t, abs_tol=1e-3) for t in top) for v in lp.top_logprobs[p].values())


def test_lm_eval_loglikelihood_request(client, server, default_model):
    from tests.conftest import reference_logprobs

    # lm-evaluation-harness's local-completions: context + continuation as token ids, echo, one new token whose
    # logprob it drops; the continuation's logprob is the sum over its tokens, greedy if each was the top one
    context, continuation = encode(server, "The capital of France is"), encode(server, " Paris")
    out = client.completions.create(model=MODEL, prompt=[context + continuation], echo=True, max_tokens=1,
                                    logprobs=1, temperature=0, seed=1234).model_dump()
    assert server.wait_idle()
    lp = out["choices"][0]["logprobs"]
    ctxlen = len(context)
    got = sum(lp["token_logprobs"][ctxlen:-1])
    reference = reference_logprobs(default_model, context + continuation)
    expected = sum(reference[p - 1, t].item() for p, t in enumerate(continuation, ctxlen))
    assert math.isclose(got, expected, abs_tol=1e-3)
    greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:-1],
                                                           lp["top_logprobs"][ctxlen:-1]))
    assert greedy == all(reference[p - 1].argmax().item() == t for p, t in enumerate(continuation, ctxlen))


def test_echo_with_logprobs_puts_the_prompt_tokens_first(client, server):
    prompt = "Colors: red, green,"
    n_prompt = len(encode(server, prompt))
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=3, logprobs=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert out.choices[0].text.startswith(prompt) and "".join(lp.tokens) == out.choices[0].text
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert lp.tokens[n_prompt:] == plain.choices[0].logprobs.tokens
    assert all(math.isclose(a, b, abs_tol=1e-3)
               for a, b in zip(lp.token_logprobs[n_prompt:], plain.choices[0].logprobs.token_logprobs, strict=True))

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=3, logprobs=2,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_echo_without_a_tokenizer_is_empty(tiny_model):
    with LiveServer(tiny_model) as s:
        model = web.get(s.url + "/v1/models").json()["data"][0]["id"]
        out = web.post(s.url + "/v1/completions", json={"model": model, "prompt": [[1, 2, 3], [4, 5]], "echo": True,
                                                        "max_tokens": 2, "logprobs": 0, "ignore_eos": True}).json()
        assert [c["text"] for c in out["choices"]] == ["", ""]
        first = out["choices"][0]["logprobs"]
        assert first["tokens"][:3] == ["token_id:1", "token_id:2", "token_id:3"] and len(first["tokens"]) == 5
        assert first["token_logprobs"][0] is None and all(v is not None for v in first["token_logprobs"][1:])
        assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 4


# -- refusals and bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "the end"}, "suffix"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["x"] * 2049}, "prompt"),
    ({"prompt": ["x"] * 257}, "prompt"),  # more than --max-waiting (256): could never be admitted
    ({"prompt": ["x", "y", "z"], "n": 128}, "n"),
    ({"prompt": ["x", ""]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -2.01}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"one": 5}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 5}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"49152": 5}}, "logit_bias"),  # the vocabulary is 49,152 tokens
    ({"prompt": "x", "logit_bias": {str(t): 1 for t in range(1025)}}, "logit_bias"),
])
def test_bad_breadth_requests_are_400s_and_the_server_serves_on(client, server, body, param):
    r = web.post(server.url + "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_chat_n_out_of_range_is_a_400(server):
    r = web.post(server.url + "/v1/chat/completions",
                 json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 129})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# -- leaving, refusal and shared prompts ----------------------------------------------------------------------------
@pytest.mark.parametrize("body", [{"prompt": "Tell a long story", "n": 4},
                                  {"prompt": ["Tell a long story", "Sing a song"], "n": 2}])
def test_disconnect_aborts_every_sample(server, body):
    body = {"model": MODEL, **body, **LONG}
    with web.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break
        assert server.engine.has_unfinished(), line  # (the first event, should it be an error)
    assert server.wait_idle()  # every sample aborted: every block free

    async def leave_non_streaming():
        async with httpx.AsyncClient() as c:
            post = asyncio.create_task(c.post(server.url + "/v1/completions", json=body, timeout=120))
            await asyncio.to_thread(wait_until, lambda: server.engine.num_running >= 4, 60, "every sample running")
            post.cancel()  # the client leaves while every sample runs
            await asyncio.gather(post, return_exceptions=True)
    asyncio.run(leave_non_streaming())
    assert server.wait_idle()
    r = web.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_with_max_tokens_zero_a_prompt_may_fill_the_context(default_model):
    with LiveServer(default_model, {"max_model_len": 64}) as s:
        ids = list(range(1000, 1064))
        out = web.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": [ids], "max_tokens": 0,
                                                        "echo": True, "logprobs": 0}).json()
        assert out["usage"] == {"prompt_tokens": 64, "completion_tokens": 0, "total_tokens": 64,
                                "prompt_tokens_details": {"cached_tokens": 0}}
        assert len(out["choices"][0]["logprobs"]["tokens"]) == 64
        r = web.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert s.wait_idle()


def test_a_refused_prompt_gets_503_and_aborts_the_admitted_ones(default_model):
    with LiveServer(default_model, {"max_num_seqs": 1}, max_waiting=2) as s:
        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"model": MODEL, "prompt": "Hi", **LONG}
                running = asyncio.create_task(c.post(s.url + "/v1/completions", json=body))
                await asyncio.to_thread(wait_until, lambda: s.engine.num_running, 60, "the first one running")
                waiting = asyncio.create_task(c.post(s.url + "/v1/completions", json=body))
                await asyncio.to_thread(wait_until, lambda: s.engine.num_waiting, 60, "the second one waiting")
                # two prompts: the first fits in the queue (then two wait), the second does not; neither may stay
                refused = await c.post(s.url + "/v1/completions", json={**body, "prompt": ["a", "b"]})
                await asyncio.to_thread(wait_until, lambda: s.engine.num_waiting == 1, 60, "the first prompt's abort")
                for task in (running, waiting):  # their clients leave
                    task.cancel()
                await asyncio.gather(running, waiting, return_exceptions=True)
                return refused
        refused = asyncio.run(main())
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        assert s.wait_idle()


def metric(server, name: str) -> float:
    for family in text_string_to_metric_families(web.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


def test_n_samples_compute_their_shared_prompt_once(client, server):
    prompt = encode(server, "In a small village by the sea there lived an old fisherman who every morning walked "
                            "down to the harbour, mended his nets, and told the children stories about the storms "
                            "he had seen and the fish that got away. In the evenings he sat on the steps of his "
                            "small blue house, watched the boats come home one by one, and counted the gulls that "
                            "followed them, as his father had done before him.")
    assert len(prompt) > 64 and len(prompt) % 16
    assert server.wait_idle()
    before = metric(server, "llm_prompt_tokens_computed_total")
    out = client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=3, extra_body={"ignore_eos": True})
    assert server.wait_idle()
    computed = metric(server, "llm_prompt_tokens_computed_total") - before
    assert len(prompt) <= computed <= len(prompt) + 3 * 16  # the others recompute at most their last partial block
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # sample 0's: it computed the prompt
    again = client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=3)
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) // 16 * 16  # its full blocks, once


def test_penalties_and_logit_bias_on_every_route(client, server):
    """The official client's own fields reach the sampler on completions, chat and the native route."""
    bias = {"4649": 100}  # " France" in the default model's vocabulary, forced
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias=bias,
                                       presence_penalty=0.5, frequency_penalty=0.5)
    assert forced.choices[0].text == " France" * 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, logit_bias=bias, frequency_penalty=1.0)
    assert chat.choices[0].message.content == " France France"
    r = web.post(server.url + "/generate", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0,
                                                 "logit_bias": bias, "repetition_penalty": 1.2})
    assert r.status_code == 200 and r.json()["text"] == " France France"
