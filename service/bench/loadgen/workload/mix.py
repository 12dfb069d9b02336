"""bench soak's traffic: request i's kind (stream, complete, chat, a client that leaves or gives up, a hostile body,
an overload burst), its shape, and which answers it may get.

Drawn from (seed, i) alone, so the load generator's worker processes all agree on it (a module of its own: each
spawned worker imports it, and nothing heavier).
"""

import math
import random

from service.bench.loadgen.send.request import CHAT, RequestResult
from service.bench.loadgen.workload.datasets import Sample, estimate_tokens

PROMPTS = ["Tell me about the sea.", "Count from one to twenty:", "Write a haiku about autumn.",
           "Explain what a hash table is.", "List three colors.", "Once upon a time"]
# the kinds of request, by share of the load in percent
MIX = {"stream": 35, "complete": 20, "chat": 15, "leave_stream": 12, "time_out": 8, "hostile": 10}
# bodies no server should answer with a 5xx; each must get exactly this status
HOSTILE = [({"seed": 2**80}, 400), ({"top_k": 2**80}, 400), ({"max_tokens": -1}, 400), ({"min_tokens": 10**12}, 400),
           ({"temperature": 1e-30}, 200), ({"stop_token_ids": [2**70]}, 400), ({"logprobs": 10**9}, 400)]
TIME_OUT_S = 0.3  # a time_out client gives up on its 200 tokens after this long
# the error kind that is the point of a kind of request: the client leaves, or gives up
INTENDED = {"leave_stream": "client_left", "time_out": "timeout"}


class Mix:
    """The soak's requests: request i's kind and shape, drawn from (seed, i), so every worker process agrees.

    The mix comes in a seeded order that starts with one of each kind, so that even a short soak meets them all;
    a burst's requests are all of one kind (small, not streamed)."""

    def __init__(self, seed: int, burst: bool = False):
        self.seed = seed
        rest = [kind for kind, share in MIX.items() for _ in range(share - 1)]
        random.Random(seed).shuffle(rest)
        # the kinds whose point is a failure first: sent at once, before any burst can answer them with a 503
        first = sorted(MIX, key=lambda kind: kind not in INTENDED)
        self.order = ["burst"] if burst else first + rest

    def request(self, i: int) -> tuple[Sample, str, int]:
        """Request i: its shape, its name in the tally, and the status it must get (besides a 503)."""
        kind, rng = self.order[i % len(self.order)], random.Random(f"{self.seed}:{i}")
        prompt = rng.choice(PROMPTS)
        temperature = {"temperature": rng.choice([0.0, 0.8])}
        shape = lambda max_tokens, **how: Sample(prompt, max_tokens, estimate_tokens(prompt), **how)
        if kind in ("stream", "leave_stream"):
            leave = rng.randint(1, 4) if kind == "leave_stream" else None  # then the server must abort it
            return shape(rng.randint(8, 64), extra=temperature, leave_after=leave), kind, 200
        if kind == "complete":
            return shape(rng.randint(4, 48), stream=False, extra=temperature), kind, 200
        if kind == "chat":
            return shape(rng.randint(4, 32), endpoint=CHAT, stream=False), kind, 200
        if kind == "time_out":
            return shape(200, stream=False, extra={**temperature, "ignore_eos": True}, timeout=TIME_OUT_S), kind, 200
        if kind == "hostile":
            extra, status = rng.choice(HOSTILE)
            return shape(4, stream=False, extra={**temperature, **extra}), f"hostile {next(iter(extra))}", status
        return shape(4, stream=False), kind, 200

    def sample(self, i: int) -> Sample:
        return self.request(i)[0]

    def outcome(self, r: RequestResult) -> tuple[str, bool]:
        """What request r's answer counts as in the tally, and whether it was an answer it may get."""
        _, name, want = self.request(r.index)
        if r.status == 503:  # backpressure, part of the contract under load
            return f"{name} 503", True
        if (r.ok if want == 200 else r.status == want) or (name in INTENDED and r.error == INTENDED[name]):
            return name, True
        return f"unexpected {name}: {r.error or r.status}", False


def burst_times(duration: float, every: float, size: int) -> tuple[float, ...]:
    """Overload: `size` requests at once every `every` seconds of the load, the first after `every`."""
    return tuple(k * every for k in range(1, math.ceil(duration / every)) for _ in range(size))
