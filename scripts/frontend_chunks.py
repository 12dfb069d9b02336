"""A front end's CPU time per streamed chunk of /v1/completions (n = 1, no logprobs): RequestStream.feed of each
engine row, the route's chunk generator and the SSE body's JSON, over a stub engine link (no sockets, no HTTP).

At one front end the streaming figures are bound by this time, so it is the measure of a change to that path.
Against an older commit, alternating (time nothing else on the machine meanwhile):
    rm -rf .base && mkdir .base && git archive COMMIT service | tar -x -C .base
    python scripts/frontend_chunks.py 7; PYTHONPATH=$PWD/.base python -P scripts/frontend_chunks.py 7
Prints the microseconds per chunk of the fastest of ROUNDS rounds (200 requests x 128 tokens each) and the median.
"""
import asyncio, sys, time, types
from service.api import openai_routes, client as cl
from service.api.schemas import CompletionRequest
from service.engine.sampling import SamplingParams

TOKENS, REQUESTS = 128, 200

class FakeClient:
    tokenizer = None; stream_interval = 1; stream_backlog = 10**9; recorder = None
    def abort(self, *a): pass
    def finished(self, *a): pass

fc = FakeClient()
streams = []

class State:
    tokenizer = None
    settings = types.SimpleNamespace(server=types.SimpleNamespace(max_waiting=10**6))
    def check_model(self, m): pass
    def _stream(self, rid):
        s = cl.RequestStream(fc, rid, [1, 2, 3], SamplingParams(max_tokens=TOKENS), time.perf_counter(), True)
        streams.append(s); return s
    async def submit(self, prompt, params, rid, op, arrival, streaming):
        return aiter(self._stream(rid))
    async def submit_all(self, prompts, params, rid, op, arrival, streaming, n=1):
        from service.api.state import Choices
        s = self._stream(rid)
        return Choices([s], aiter(s), n)

async def one(state):
    body = CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=TOKENS, stream=True)
    req = types.SimpleNamespace(scope={}, headers={}, state=types.SimpleNamespace())
    resp = await openai_routes.completions(body, req, state)
    return resp.body_iterator

async def main(rounds):
    state = State()
    best = []
    for r in range(rounds):
        streams.clear()
        bodies = [await one(state) for _ in range(REQUESTS)]
        start = time.perf_counter()
        for t in range(TOKENS):  # each engine step: one row per request fed, then every body drained of its chunk
            reason = "length" if t == TOKENS - 1 else None
            for s in streams:
                s.feed([s.request_id, [t + 5], reason, None, (0.0, 0, None) if t == 0 else None], 0.0)
            for b in bodies:
                await b.__anext__()
        per = (time.perf_counter() - start) / (TOKENS * REQUESTS) * 1e6
        best.append(per)
    print(f"{min(best):.2f} us per chunk (min of {rounds}), median {sorted(best)[len(best)//2]:.2f}")

asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
