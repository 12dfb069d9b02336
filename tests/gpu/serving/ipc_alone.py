"""The engine process alone, driven over its ZeroMQ sockets by a bare client: no HTTP, no text.

    python tests/gpu/serving/ipc_alone.py --model random:llama-1b --requests 1024 --max-num-seqs 256 --rounds 3
        [--concurrency 256]

Starts the engine process exactly as `serve` does (service.api.server.run_engine), sends every request at
once (the engine runs --max-num-seqs of them at a time, as `bench offline` does), or with --concurrency C keeps C
in flight (closed loop: a new request for each that finishes, as HTTP clients do), and counts output tokens from
the first send to the last finish. Prints one JSON line per round, with the engine process's CPU share and its
steps per phase over the round (`llm_engine_step_seconds` and `llm_engine_step_host_seconds`, the step less its
wait for the device, from the engine process's metrics socket).
"""

import argparse
import json
import multiprocessing as mp
import random
import time

import msgspec
import psutil
import zmq

from service.engine import messages
from service.engine.messages import Add, Admitted, Dead, Hello, Step
from service.engine.sampling import SamplingParams
from service.settings import Settings
from service.telemetry import gather
from step_times import phases, totals  # (this folder's: the script's own, first on sys.path)


def steps(metrics) -> dict:
    """The engine process's step totals now (step_times.totals), from its metrics socket."""
    metrics.send(b"")
    families = msgspec.msgpack.decode(metrics.recv())[0]
    return totals((sample[0], sample[1], sample[2]) for family in families for sample in family[4])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-1b")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=0, help="requests in flight (default: all at once)")
    args = ap.parse_args()
    settings = Settings()
    settings.engine.model, settings.engine.max_num_seqs = args.model, args.max_num_seqs
    settings.server.max_waiting = args.requests * 2
    settings.telemetry.gpu_sample_interval = 0
    folder = messages.private_dir()
    ctx = mp.get_context("spawn")
    alive_r, alive_w = ctx.Pipe(duplex=False)
    from service.api.server import run_engine

    engine = ctx.Process(target=run_engine, args=(settings, folder, 1, alive_w))
    engine.start()
    z = zmq.Context()
    push, pull = z.socket(zmq.PUSH), z.socket(zmq.PULL)
    push.connect(messages.inbox(folder))
    pull.connect(messages.outbox(folder, 0))
    decode = messages.frontend_decoder.decode
    hello = decode(pull.recv())
    assert isinstance(hello, Hello), hello
    metrics = z.socket(zmq.REQ)
    metrics.connect(gather.address(folder, "engine"))
    rng = random.Random(1)
    proc = psutil.Process(engine.pid)
    for rnd in range(args.rounds):
        prompts = [[rng.randrange(100, hello.vocab_size - 1) for _ in range(args.input_len)]
                   for _ in range(args.requests)]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
        sent = 0

        def send(count: int) -> None:
            nonlocal sent
            for _ in range(min(count, args.requests - sent)):
                push.send(messages.encode(Add(f"r{rnd}-{sent}", 0, prompts[sent], params, time.perf_counter())))
                sent += 1
        before = steps(metrics)
        t0, cpu0 = time.perf_counter(), sum(proc.cpu_times()[:2])
        send(args.concurrency or args.requests)
        done, tokens = 0, 0
        while done < args.requests:
            msg = decode(pull.recv())
            if isinstance(msg, Step):
                finished = 0
                for row in msg.rows:
                    tokens += len(row[1])
                    finished += row[2] is not None
                done += finished
                if args.concurrency:
                    send(finished)
            elif isinstance(msg, Admitted):
                assert not msg.rejected, msg.rejected[:3]
            elif isinstance(msg, Dead):
                raise SystemExit(msg.reason)
        wall = time.perf_counter() - t0
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        print(json.dumps({"round": rnd, "requests": args.requests, "concurrency": args.concurrency or args.requests,
                          "output_tokens": tokens, "output_tok_s": round(tokens / wall, 1), "wall_s": round(wall, 3),
                          "engine_cpu_share": round(cpu / wall, 3), "phases": phases(before, steps(metrics))}),
              flush=True)
    engine.terminate()
    engine.join(60)


if __name__ == "__main__":
    main()
