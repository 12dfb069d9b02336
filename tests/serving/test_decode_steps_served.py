"""Several decode steps a launch, served (`serve --decode-steps 4`): the engine process sends a request's tokens of a
launch in one row, its front end streams them together, and the inter-token histogram counts every gap (0 inside a
row), with real processes."""

import json

import httpx

from tests.conftest import make_engine, wait_until
from tests.served import MODEL, Served, sample


def streamed(url: str, max_tokens: int) -> list[list[int]]:
    """The token ids of each event of one streamed /generate request."""
    body = {"model": MODEL, "token_ids": [5, 6, 7, 8], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = []
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/generate", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:])["token_ids"])
    return events


def test_a_launch_of_four_steps_streams_the_same_tokens_and_counts_every_gap(tiny_model):
    from service.engine import SamplingParams

    single = make_engine(tiny_model).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=21, temperature=0,
                                                                             ignore_eos=True))[0]["token_ids"]
    with Served("--decode-steps", "4") as s:
        events = streamed(s.url, 21)
        text = wait_until(lambda: next((m for m in [s.metrics()] if sample(m, "llm_requests_total") == 1), None),
                          30, "the request in the metrics")
    assert [t for e in events for t in e] == single  # the same weights (random:tiny, seed 0), one step at a time
    assert max(map(len, events)) >= 4
    # the prefill's token, then five launches of four: a gap before every token but the first, three of 0 a launch
    assert sample(text, "llm_time_per_output_token_seconds_count") == 20
    assert sample(text, "llm_time_per_output_token_seconds_bucket", le="0.001") >= 15
    assert sample(text, "llm_engine_step_seconds_count", phase="decode") == 20
