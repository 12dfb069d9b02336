"""How the engine's throughput depends on how requests arrive (the engine process alone over IPC once reached
0.63x of `bench offline` on the same 1,024 requests). The engine in this process, no IPC, no HTTP; per scenario the
wall time, output tok/s and the steps by phase (count, duration, tokens a step):

- `all`: every request added before the first step (what `bench offline` does);
- `trickle:K[:E]`: K new requests added before every E-th step (E = 1 by default) until all are in (requests
  reaching the engine over a socket while it runs: a drain finds what has arrived since the last step);
- `closed:C`: C requests in flight, a new one added for each that finished, before the next step (a closed-loop
  client with no latency).

Usage (on a CUDA machine):
  python3 tests/gpu/serving/arrivals.py --scenarios all,trickle:16,trickle:64,closed:256
"""

import argparse
import collections
import contextlib
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-1b")
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--scenarios", default="all,trickle:16,trickle:64,closed:256")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script, not a figure")
    ap.add_argument("--engine-args", default="", help="EngineConfig overrides, k=v,k=v (ints, floats, bools)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="then profile this many mixed steps: a full batch decoding while 4 requests arrive a step")
    args = ap.parse_args()

    from service.engine.config import EngineConfig
    from service.engine.llm_engine import LLMEngine
    from service.engine.sampling import SamplingParams

    overrides = {}
    for kv in filter(None, args.engine_args.split(",")):
        k, v = kv.split("=")
        try:
            overrides[k] = json.loads(v)  # ints, floats, true/false
        except ValueError:
            overrides[k] = v
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_num_seqs=args.max_num_seqs,
                                    **overrides))
    steps = []  # (phase, duration, tokens, seqs)
    engine.observer = lambda s: s.phase is not None and steps.append((s.phase, s.duration, s.num_tokens, s.num_seqs))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    counter = [0]

    def prompt():
        counter[0] += 1
        return [(7 * counter[0] + j) % (engine.vocab_size - 10) + 5 for j in range(args.input_len)]

    def add(n):
        for _ in range(n):
            engine.add_request(prompt(), params)

    def run(scenario: str) -> tuple[float, int]:
        kind, _, k = scenario.partition(":")
        k, _, every = k.partition(":")
        k, every, n_step = int(k or 0), int(every or 1), 0
        left, done = args.num_requests, 0
        if kind == "all":
            add(left)
            left = 0
        elif kind == "closed":
            add(min(k, left))
            left -= min(k, left)
        while engine.has_unfinished() or left:
            if kind == "trickle" and left and n_step % every == 0:
                add(min(k, left))
                left -= min(k, left)
            n_step += 1
            finished = sum(o.finished for o in engine.step())
            done += finished
            if kind == "closed" and left and finished:
                add(min(finished, left))
                left -= min(finished, left)
        return args.num_requests * args.output_len

    engine.generate([prompt() for _ in range(args.max_num_seqs)],
                    SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))  # compile the prefill shapes
    for scenario in args.scenarios.split(","):
        for rnd in range(args.rounds):
            steps.clear()
            sync()
            t0 = time.perf_counter()
            tokens = run(scenario)
            sync()
            wall = time.perf_counter() - t0
            line = [f"{scenario:12s} round {rnd}: {wall:.3f} s, {tokens / wall:,.0f} output tok/s, {len(steps)} steps"]
            for phase in ("prefill", "mixed", "decode"):
                mine = [s for s in steps if s[0] == phase]
                if mine:
                    line.append(f"{phase} {len(mine)} x {1e3 * statistics.median(s[1] for s in mine):.2f} ms p50 "
                                f"(sum {sum(s[1] for s in mine):.3f} s, {statistics.mean(s[2] for s in mine):.0f} "
                                f"tok, {statistics.mean(s[3] for s in mine):.0f} seqs)")
            print("; ".join(line), flush=True)

    if args.profile_steps:
        import cProfile
        import pstats

        from torch.profiler import ProfilerActivity, profile

        def mixed_steps(around_step) -> float:
            """A full batch decoding while 4 requests arrive a step: profile_steps such steps, each run inside
            `around_step` (a context manager factory); returns the mean wall time of one."""
            add(args.max_num_seqs - 4 * args.profile_steps)
            for _ in range(args.input_len // 8 + 8):  # every prompt in, decoding
                engine.step()
            sync()
            steps.clear()
            t0 = time.perf_counter()
            for _ in range(args.profile_steps):
                add(4)
                with around_step():
                    engine.step()
            sync()
            per_step = (time.perf_counter() - t0) / args.profile_steps
            print(f"{args.profile_steps} steps ({collections.Counter(s[0] for s in steps)}): {1e3 * per_step:.3f} ms "
                  f"a step under the profiler")
            while engine.has_unfinished():
                engine.step()
            return per_step

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        prof = profile(activities=activities)
        prof.start()
        mixed_steps(contextlib.nullcontext)
        prof.stop()
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 1e3 / args.profile_steps
        print(f"torch.profiler: GPU busy {gpu:.3f} ms a step")
        print(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70))
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))

        host = cProfile.Profile()
        mixed_steps(lambda: host)  # a cProfile.Profile is a context manager: enabled inside, disabled after
        print("cProfile of the host's side of those steps:")
        pstats.Stats(host).sort_stats("cumulative").print_stats(35)
        pstats.Stats(host).sort_stats("tottime").print_stats(25)

if __name__ == "__main__":
    main()
