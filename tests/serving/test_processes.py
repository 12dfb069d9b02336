"""The served layout with real processes: one engine process, N front ends on one port, and their faults.

Each test starts `python -m service serve` on random weights and waits on events (log lines, answers, exits),
never on fixed sleeps.
"""

import asyncio
import json
import os
import re
import signal
import subprocess

import httpx
import pytest

from tests import web
from tests.conftest import wait_until
from tests.served import MODEL, Served, sample


def body(**extra) -> dict:
    return {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True, **extra}


def open_streams(url: str, count: int, max_tokens: int) -> tuple[list, list]:
    """`count` streaming requests, each on its own connection, each read up to its first event."""
    clients, streams = [], []
    for _ in range(count):
        client = httpx.Client(timeout=60)
        stream = client.stream("POST", url + "/v1/completions", json=body(max_tokens=max_tokens, stream=True))
        response = stream.__enter__()
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        clients.append(client)
        streams.append((stream, lines))
    return clients, streams


def test_two_front_ends_one_metrics_truth_and_one_waiting_limit():
    with Served("--api-servers", "2", "--max-num-seqs", "1", "--max-waiting", "2") as s:
        with httpx.Client(timeout=60) as c:
            answers = [c.post(s.url + "/v1/completions", json=body()) for _ in range(12)]
        assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4 for r in answers)
        wait_until(lambda: s.log().count('"POST /v1/completions HTTP/1.1" 200') >= 12, 30,
                   "the access log (on by default) to name every request")
        # overload: at most two waiting (one more running once a step has taken the first); the rest are 503s with
        # Retry-After, never errors or hangs. At least two are served: arrivals that reach the engine in one batch
        # are all still waiting when the third is turned away, so "3" would depend on the scheduler's timing
        async def burst():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=40)) as ac:
                return await asyncio.gather(*[ac.post(s.url + "/v1/completions", json=body(max_tokens=40))
                                              for _ in range(40)])
        answers = asyncio.run(burst())
        statuses = [r.status_code for r in answers]
        assert set(statuses) <= {200, 503} and statuses.count(503) > 0 and statuses.count(200) >= 2
        assert all(r.headers["retry-after"] and "waiting" in r.json()["error"]["message"]
                   for r in answers if r.status_code == 503)
        ok = 12 + statuses.count(200)
        def settled():
            text = s.metrics()
            return text if sample(text, "llm_requests_total") == ok else None
        text = wait_until(settled, 60, "every finished request in the merged metrics")
        # counts exact across both front ends: each series once, summed
        assert sample(text, "llm_requests_total", finish_reason="length") == ok
        assert sample(text, "llm_time_to_first_token_seconds_count") == ok
        assert sample(text, "llm_generation_tokens_total") == 12 * 4 + (ok - 12) * 40
        assert len(re.findall(r"^llm_requests_total\{[^}]*finish_reason=\"length\"", text, re.M)) == 1
        # per-process series carry the process label: the engine and both front ends
        assert {m for m in re.findall(r'^llm_process_threads\{model="random:tiny",process="([^"]+)"\}', text, re.M)} == \
            {"engine", "api-0", "api-1"}
        assert re.search(r'^process_resident_memory_bytes\{model="random:tiny",process="engine"\}', text, re.M)
        # each process froze its heap once loaded, and times its garbage collections
        for p in ("engine", "api-0", "api-1"):
            assert sample(text, "llm_gc_frozen_objects", process=p) > 1000, p
            assert sample(text, "llm_gc_pause_seconds_count", process=p, generation="2") >= 1, p
        assert sample(text, "llm_engine_step_seconds_count") > 0 and sample(text, "llm_kv_cache_blocks_used") == 0
        # the dashboard's history, kept by the supervisor: every front end answers the same counts as /metrics
        expected = {"requests_received": ok, "requests_finished": ok, "requests_length": ok,
                    "rejected_503": statuses.count(503), "output_tokens": sample(text, "llm_generation_tokens_total")}
        data = lambda: web.get(s.url + "/dashboard/data", timeout=10).json()
        wait_until(lambda: {k: data()["totals"][k] for k in expected} == expected, 30, "the history to catch up")
        views = [data() for _ in range(8)]  # each on a new connection: the kernel spreads them over both
        assert all({k: v["totals"][k] for k in expected} == expected for v in views)
        assert all(v["processes"] == ["api-0", "api-1", "engine"] and v["status"] == "up" for v in views)
        slowest = views[-1]["slowest"]  # from both front ends, slowest first
        assert len(slowest) == 10 and {e["output_tokens"] for e in slowest} <= {4, 40}
        assert [e["e2e"] for e in slowest] == sorted((e["e2e"] for e in slowest), reverse=True)
        # front ends do HTTP, JSON and text; torch is the engine's alone (it would cost each one ~2 s and ~200 MB)
        for pid in s.frontend_pids:
            with open(f"/proc/{pid}/maps") as maps:
                assert "libtorch" not in maps.read(), f"front end {pid} loaded torch"


def test_a_dead_front_end_has_its_requests_aborted_and_the_others_serve_on():
    with Served("--api-servers", "2") as s:
        clients, streams = open_streams(s.url, 4, 900)
        # a front end holding one of the streams (the kernel spreads connections among the front ends)
        conns = subprocess.run(["ss", "-tnp"], capture_output=True, text=True).stdout
        holders = {int(p) for p in re.findall(rf":{s.port}\s.*pid=(\d+),", conns)} & set(s.frontend_pids)
        assert holders, conns
        victim = min(holders)
        gone = rf"front end {s.frontend_pids.index(victim)} is gone: aborted its (\d+) request"
        os.kill(victim, signal.SIGKILL)
        try:
            wait_until(lambda: re.search(gone, s.log()), 60, "the engine to abort the dead front end's requests")
        except AssertionError:
            raise AssertionError(s.log())
        for c in clients:
            c.close()
        assert int(re.search(gone, s.log()).group(1)) >= 1
        with httpx.Client(timeout=60) as c:
            assert all(c.post(s.url + "/v1/completions", json=body()).status_code == 200 for _ in range(5))
        # the other front end is told, and its scrapes no longer wait for the dead one's metrics
        wait_until(lambda: f"api-{s.frontend_pids.index(victim)} is gone" in s.log(), 60, "the survivor to be told")
        wait_until(lambda: sample(s.metrics(), "llm_kv_cache_blocks_used") == 0 and
                   sample(s.metrics(), "llm_requests_running") == 0, 60, "every KV block to be free again")
        assert "did not answer" not in s.log()
        assert s.proc.poll() is None  # the service goes on
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 1  # it lost a front end: not a clean exit


def test_a_killed_engine_ends_every_request_at_once_and_the_service_exits_non_zero():
    with Served() as s:
        clients, streams = open_streams(s.url, 3, 900)
        os.kill(s.engine_pid, signal.SIGSTOP)  # the requests are in flight and stay there
        os.kill(s.engine_pid, signal.SIGKILL)
        for (_, lines) in streams:
            events = [line[6:] for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["type"] == "service_unavailable" and "engine process died" in error["message"]
        for c in clients:
            c.close()
        assert s.proc.wait(60) == 1
        assert "the engine process exited" in s.log()


def test_sigterm_drains_every_front_end_then_stops_the_engine_with_status_0():
    with Served("--api-servers", "2", "--no-access-log") as s:
        clients, streams = open_streams(s.url, 4, 200)
        s.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: s.log().count("draining (up to") == 2, 60, "both front ends to begin their drain")
        with pytest.raises(httpx.HTTPError):  # no longer admitting: refused, or 503
            web.post(s.url + "/v1/completions", json=body(), timeout=30).raise_for_status()
        for (_, lines) in streams:
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            assert events[-1]["choices"][0]["finish_reason"] == "length"  # every admitted request finishes
        for c in clients:
            c.close()
        assert s.proc.wait(60) == 0
        assert "/v1/completions HTTP/1.1" not in s.log()  # --no-access-log


def test_connections_opened_at_once_spread_evenly_over_four_front_ends():
    """Each front end listens on its own SO_REUSEPORT socket of the port, so the kernel hashes new connections over
    them: 256 opened at once by one client land 64 +- 24 on each of 4 (a hash spreads them at random; +- 24 fails
    about once in 500 runs). llm_http_connections counts them per front end."""
    import socket

    with Served("--api-servers", "4") as s:
        conns = []
        try:
            for _ in range(256):  # a request that never ends its headers: the connection stays open, unanswered
                c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
                c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                conns.append(c)
            names = [f"api-{i}" for i in range(4)]
            counts = lambda: [sample(s.metrics(), "llm_http_connections", process=p) for p in names]
            seen = wait_until(lambda: (lambda c: c if sum(c) == 257 else None)(counts()), 60,
                              "every connection counted (and the scrape's own)")
            assert all(64 - 24 <= n <= 64 + 24 + 1 for n in seen), seen  # + 1: the scrape's connection is on one
        finally:
            for c in conns:
                c.close()
        wait_until(lambda: sum(counts()) == 1, 60, "the closed connections to leave the counts")
        assert s.ready()  # and the server serves on


def test_the_port_is_ours_alone_though_its_sockets_share_it():
    import socket

    from service.api.server import _bind
    socks = _bind("127.0.0.1", 0, 3)
    try:
        port = socks[0].getsockname()[1]
        assert {s.getsockname()[1] for s in socks} == {port}
        with pytest.raises(OSError):  # a second server on the port: refused, not let in beside ours
            _bind("127.0.0.1", port, 2)
    finally:
        for s in socks:
            s.close()
    with socket.socket() as plain:  # a port someone else listens on: refused
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        with pytest.raises(OSError):
            _bind("127.0.0.1", plain.getsockname()[1], 2)
