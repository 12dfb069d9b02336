"""The bounded soak: a few seconds of mixed traffic (streams, clients leaving, timeouts, hostile bodies, two overload
bursts) against a live server, which must end idle with nothing left behind. `bench soak` runs it for hours.

Every kind of request comes up in the first turns of the soak's schedule and the first burst starts after
`burst_every` seconds however slow the machine is, so a short soak meets them all; what it checks is the state
the server is left in, not how much it got through."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

from service.bench.loadgen.send.request import RequestResult
from service.bench.loadgen.workload.mix import Mix
from service.bench.soak import Soak, verdict
from tests.conftest import LiveServer


def test_mixed_traffic_with_overload_bursts_leaves_nothing_behind(default_model):
    # 4 running slots and 4 waiting ones: the bursts of 16 must meet backpressure (503s)
    with LiveServer(default_model, {"max_num_seqs": 4, "num_blocks": 256}, max_waiting=4) as s:
        soak = Soak(s.url, api_key=None, metrics_token=None, seed=1)

        async def run():
            # here the soak's client shares the server's process (bench soak runs it in its own): its executor (the
            # load's relay from the workers, httpx's address look-ups) is held to one thread, started before the
            # first sample, so that the thread count the verdict compares is the server's. Unbounded, it grew by as
            # many threads as calls happened to overlap, and the check failed when that passed 2
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
            return await soak.run(duration=12, concurrency=4, sample_every=1, burst_every=4, burst_size=16, warmup=2)
        rows = asyncio.run(run())
    result = verdict(rows, soak.tally, rss_growth_mib=64)
    assert result["passed"], (result["checks"], result["unexpected"])
    seen = soak.tally.counts
    for kind in ("stream", "complete", "chat", "leave_stream", "time_out", "burst", "burst 503"):
        assert seen.get(kind, 0) > 0, (kind, seen)
    assert any(k.startswith("hostile") for k in seen), seen
    assert rows[-1]["kv_blocks_used"] == 0 and rows[-1]["running"] == rows[-1]["waiting"] == 0


def row(t: float, phase: str, rss_mib: float, fds: int = 20, threads: int = 10, tasks: int = 5, blocks: int = 0):
    return {"t": t, "phase": phase, "rss_bytes": rss_mib * 2**20, "open_fds": fds, "threads": threads,
            "asyncio_tasks": tasks, "kv_blocks_used": blocks, "running": 0, "waiting": 0, "requests": 0}


def test_the_soak_verdict_fails_on_anything_left_behind_or_growing():
    from service.bench.soak import Tally
    flat = [row(0, "idle", 500)] + [row(t, "load", 520) for t in range(1, 51)] + [row(51, "idle", 510)]
    assert verdict(flat, Tally(), rss_growth_mib=64)["passed"]
    leaky = [row(0, "idle", 500)] + [row(t, "load", 500 + 4 * t) for t in range(1, 51)]
    leaky.append(row(51, "idle", 700, fds=30, threads=13, tasks=9, blocks=2))
    tally = Tally()
    tally.add("unexpected complete: 500", False, "internal error")
    result = verdict(leaky, tally, rss_growth_mib=64)
    assert not result["passed"] and not any(result["checks"].values())


def test_each_request_is_judged_by_the_answers_its_kind_may_get():
    mix = Mix(seed=1)
    first = {mix.request(i)[1]: i for i in range(6) if mix.request(i)[2] == 200}  # the first turns: one of each kind

    def answer(name, status, error=None):
        return mix.outcome(RequestResult(first[name], 0, 0, status=status, error=error))

    assert answer("stream", 200) == ("stream", True)
    assert answer("stream", 200, "truncated_stream") == ("unexpected stream: truncated_stream", False)
    assert answer("leave_stream", 200, "client_left") == ("leave_stream", True)
    assert answer("complete", 200, "client_left") == ("unexpected complete: client_left", False)
    assert answer("time_out", 200, "timeout") == answer("time_out", None, "timeout") == ("time_out", True)
    assert answer("chat", 503, "http_503") == ("chat 503", True)
    assert answer("chat", 500, "http_500") == ("unexpected chat: http_500", False)
    # a hostile body must get exactly its status: served (200) instead of refused is unexpected
    i = next(i for i in range(1000) if mix.request(i)[2] == 400)
    name = mix.request(i)[1]
    assert mix.outcome(RequestResult(i, 0, 0, status=400, error="http_400")) == (name, True)
    assert mix.outcome(RequestResult(i, 0, 0, status=200)) == (f"unexpected {name}: 200", False)
