"""Each request's clock starts when the server receives it: front-end work (chat template, tokenization) is inside
TTFT, queue time and end-to-end latency, visible on its own, and rejected requests stay out of every histogram.

A deliberately slow chat template and tokenizer make the front end take at least DELAY each; the assertions are
lower bounds that those sleeps guarantee, never a bound on how fast this machine is.
"""

import json
import threading
import time

import httpx
from http.client import HTTPConnection
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import web
from tests.conftest import LiveServer

MODEL = "SmolLM2-135M-Instruct"
DELAY = 0.25  # seconds each slow front-end step sleeps
HISTOGRAMS = ["llm_time_to_first_token_seconds", "llm_request_queue_seconds", "llm_request_duration_seconds",
              "llm_request_frontend_seconds"]


def slowed(fn):
    def slow(*args, **kwargs):
        time.sleep(DELAY)
        return fn(*args, **kwargs)
    return slow


def histograms(server) -> dict[str, float]:
    """`<name>_sum` and `<name>_count` of the latency histograms, from GET /metrics."""
    text = web.get(server.url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.removesuffix("_sum").removesuffix("_count") in HISTOGRAMS and not s.name.endswith("_bucket")}


@pytest.fixture(scope="module")
def server(default_model):
    with LiveServer(default_model) as s:
        yield s


def test_a_slow_tokenizer_is_inside_the_native_timings(server, monkeypatch):
    tokenizer = server.app.state.server.tokenizer
    monkeypatch.setattr(tokenizer, "encode", slowed(tokenizer.encode))
    sent = time.perf_counter()
    t = web.post(server.url + "/generate", json={"prompt": "Hello", "max_tokens": 3}, timeout=60).json()["timings"]
    client_total = time.perf_counter() - sent
    assert DELAY <= t["frontend"] <= t["queue"] <= t["ttft"] == t["token_times"][0] <= t["total"]
    assert t["total"] <= client_total  # the server's clock runs inside the client's: it never starts earlier


def test_the_clock_starts_when_the_request_is_read_not_when_its_handler_first_runs(server, monkeypatch):
    """Requests read in one turn of the event loop each wait there for the handlers before theirs: that wait is the
    server's too (StampingHttpTools starts the clock as a request is parsed). "first" holds the loop until "second"
    and "third" are in the server's socket buffers; then "second"'s handler takes DELAY before "third"'s first runs,
    and "third"'s TTFT holds that DELAY (a clock started by the handler's middleware would not)."""
    tokenizer = server.app.state.server.tokenizer
    encode, holding, sent = tokenizer.encode, threading.Event(), threading.Event()

    def slow(text, *args, **kwargs):
        if text == "first":
            holding.set()
            sent.wait(60)  # the loop stops here while the other two connect and send
        elif text == "second":
            time.sleep(DELAY)
        return encode(text, *args, **kwargs)
    monkeypatch.setattr(tokenizer, "encode", slow)
    host, port = server.host.split(":")

    def connection() -> HTTPConnection:
        """A keep-alive connection the server has accepted and read from already: its next request is read as
        soon as the loop runs."""
        c = HTTPConnection(host, int(port), timeout=60)
        c.request("GET", "/health")
        c.getresponse().read()
        return c

    def generate(c: HTTPConnection, prompt: str) -> None:
        c.request("POST", "/generate", json.dumps({"prompt": prompt, "max_tokens": 1}),
                  {"Content-Type": "application/json"})

    first, second, third = connection(), connection(), connection()
    generate(first, "first")
    assert holding.wait(60)
    generate(second, "second")
    generate(third, "third")
    sent.set()
    ttft = [json.loads(c.getresponse().read())["timings"]["ttft"] for c in (first, second, third)]
    assert ttft[1] >= DELAY
    assert ttft[2] >= DELAY  # it waited for "second"'s handler, after it was read


def test_chat_template_and_tokenizer_time_is_inside_ttft_and_shown_on_its_own(server, monkeypatch):
    tokenizer = server.app.state.server.tokenizer
    monkeypatch.setattr(tokenizer, "apply_chat_template", slowed(tokenizer.apply_chat_template))
    monkeypatch.setattr(tokenizer, "encode", slowed(tokenizer.encode))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    before = histograms(server)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        sent = time.perf_counter()
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        client_total = time.perf_counter() - sent
        # rejected after the slow chat template, and while draining: in no latency histogram
        assert c.post("/v1/chat/completions", json={**chat, "max_tokens": 100000}).status_code == 400
        with monkeypatch.context() as m:
            m.setattr(server.app.state.server, "draining", True)
            assert c.post("/v1/chat/completions", json=chat).status_code == 503
    after = histograms(server)
    d = {name: after[name] - before.get(name, 0.0) for name in after}
    assert all(d[name + "_count"] == 1 for name in HISTOGRAMS), d
    frontend = d["llm_request_frontend_seconds_sum"]
    assert frontend >= 2 * DELAY  # the chat template (in the route) and the tokenizer (in the engine's validation)
    assert d["llm_request_queue_seconds_sum"] >= frontend and d["llm_time_to_first_token_seconds_sum"] >= frontend
    assert frontend <= d["llm_request_duration_seconds_sum"] <= client_total
