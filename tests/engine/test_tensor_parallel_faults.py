"""Tensor parallelism's faults and lifecycle on CPU (gloo), and over NCCL with graphs where two GPUs are: a killed or hung
rank fails the requests in flight and ends the server; an idle engine keeps its ranks; a step that fails on rank 0
ends the engine."""

import contextlib
import os
import signal
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.engine import EngineConfig, LLMEngine, SamplingParams
from tests import web
from tests.conftest import free_port, make_engine, wait_until
from tests.served import sample

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _tokens(engine: LLMEngine, prompts) -> list[list[int]]:
    return [o["token_ids"] for o in engine.generate(prompts, GREEDY)]


def test_an_engine_idle_past_the_collectives_timeout_still_serves(tiny_model, monkeypatch):
    """The other ranks wait for rank 0's next message on a semaphore, not in a collective: an engine left idle longer
    than the collectives' timeout (3 s here, 60 s in use) keeps its ranks."""
    import time
    from datetime import timedelta

    from service.engine import parallel
    monkeypatch.setattr(parallel, "COLLECTIVE_TIMEOUT", timedelta(seconds=3))  # (the group hands it to the ranks)
    prompts = [list(range(1, 20)), [7, 8, 9]]
    expected = _tokens(make_engine(tiny_model), prompts)
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", tensor_parallel_size=2, num_blocks=64))
    try:
        first = _tokens(engine, prompts)
        time.sleep(4.5)  # idle: what is tested is wall-clock time past the timeout
        second = _tokens(engine, prompts)
        assert engine.parallel.failure is None
    finally:
        engine.close()
    assert first == second == expected


def test_a_step_that_fails_on_rank_0_ends_a_tensor_parallel_engine(monkeypatch):
    """The other ranks may have run part of it: rather than go on out of step, the engine is dead."""
    from service.engine.errors import EngineDeadError
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", tensor_parallel_size=2, num_blocks=64))
    try:
        engine.add_request([1, 2, 3], GREEDY)
        engine.step()
        monkeypatch.setattr(engine.runner, "forward", lambda batch: 1 / 0)
        with pytest.raises(EngineDeadError, match="ZeroDivisionError.*out of step"):
            engine.step()
    finally:
        engine.close()
    assert all(not p.is_alive() for p in engine.parallel.procs)


def _spawned(pid: int) -> list[int]:
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    return [int(c) for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]


def _rank_processes(pid: int) -> list[int]:
    """The tensor-parallel ranks: spawned by the engine process (rank 0), itself spawned by the supervisor (not
    multiprocessing's resource tracker, nor the front ends, which spawn nothing)."""
    return [rank for child in _spawned(pid) for rank in _spawned(child)]


def _gpus() -> int:
    import torch
    return torch.cuda.device_count()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    _gpus() < 2, reason="needs two CUDA GPUs: graphs and compiled layers, NCCL"))])
@pytest.mark.parametrize("sig, reason", [
    (signal.SIGKILL, "tensor-parallel rank 1 exited with code -9"),
    # a hung rank (stopped: alive, silent) is found by its progress, not by the collectives' 60 s timeout
    (signal.SIGSTOP, "tensor-parallel rank 1 finished no forward pass in 2 s (hung); it is stopped")])
def test_killed_or_hung_rank_fails_in_flight_requests_and_the_server_exits_non_zero(tmp_path, sig, reason, device):
    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--model", "random:tiny", "--port", str(port),
                             "--device", device, "--tensor-parallel-size", "2", "--num-blocks", "64",
                             "--tensor-parallel-hang-timeout", "2"], stdout=log, stderr=subprocess.STDOUT)
    base, ranks = f"http://127.0.0.1:{port}", []
    try:
        wait_until(lambda: web.get(base + "/ready").status_code == 200, 240, "the server to be ready")
        ranks = _rank_processes(proc.pid)
        assert len(ranks) == 1
        # each rank's forward time (gathered every 16 passes), and on CUDA both GPUs' readings, on /metrics
        web.post(base + "/v1/completions", json={"model": "random:tiny", "prompt": [1, 2], "max_tokens": 40,
                                                 "ignore_eos": True}, timeout=60).raise_for_status()
        metrics = wait_until(lambda: (text := web.get(base + "/metrics").text) and 'rank="1"' in text and text,
                             30, "each rank's forward time on /metrics")
        for rank in "01":
            assert sample(metrics, "llm_tensor_parallel_forward_seconds_total", model="random:tiny", rank=rank) > 0
        if device == "cuda":
            assert {("gpu", "0"), ("gpu", "1")} <= {label for family in text_string_to_metric_families(metrics)
                                                    if family.name == "llm_gpu_memory_used_bytes"
                                                    for s in family.samples for label in s.labels.items()}
        body = {"model": "random:tiny", "prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": True, "stream": True}
        events = []
        with web.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                events.append(line)
                if len(events) == 5:
                    os.kill(ranks[0], sig)
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        for rank in ranks:  # (a stopped rank that outlived the test)
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGKILL)
    error = [e for e in events if '"error"' in e]
    assert error and reason in error[0]
    log.seek(0)
    text = log.read()  # the engine process fails its requests with the reason, exits 1, and so does the service
    assert f"{reason}: failing 1 request(s) in flight" in text
    assert "the engine process exited (status 1)" in text
