"""Where the host's time goes in each engine step: the workload all at once, overlap as served, each
engine call timed with perf_counter (no profiler): scheduling, the launch (input preparation, graph replay),
the sampler's launch, the wait for the step's tokens, and the read-back's own work; per decode step of the timed runs;
and the garbage collector's time per run. With --as-served the engine runs as the engine process runs it (bare
output rows, text left to the front ends), and each step's rows are also encoded as the message a front end gets
("encode").

Usage (on a CUDA machine; on the CPU it runs random:tiny):
  python3 tests/gpu/engine/host_steps.py [--model random:llama-1b] [--num-requests 256] [--input-len 128] [--output-len 128]
      [--max-num-seqs 256] [--num-blocks N] [--decode-steps K] [--as-served]
"""

import argparse
import collections
import gc
import statistics
import time

import torch

from service.bench.offline.lengths import Lengths
from service.bench.offline.offline import random_prompts, sync
from service.engine import EngineConfig, LLMEngine, SamplingParams
from service.engine import messages
from service.engine.detokenizer import Detokenizer
from service.engine.runner import sampler as sampler_module


def timed(owner, name: str, spent: collections.Counter, key: str) -> None:
    """Wrap `owner`'s method `name` (in place) so that each call adds its seconds to spent[key]; on an instance,
    `delattr(owner, name)` takes the wrapper off again."""
    method = getattr(owner, name)

    def wrapper(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - begin
    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-1b" if torch.cuda.is_available() else "random:tiny")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--overlap", choices=["on", "off"], default=None, help="default: the engine's")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: the engine's)")
    ap.add_argument("--decode-steps", type=int, default=1, help="decode steps a launch (the engine's decode_steps)")
    ap.add_argument("--as-served", action="store_true", help="bare output rows, no text, each step's message encoded "
                                                             "(as the engine process)")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192,
                                    gpu_memory_utilization=0.5, enable_prefix_caching=False,
                                    num_blocks=args.num_blocks, decode_steps=args.decode_steps))
    if args.overlap:
        engine.overlap = args.overlap == "on"
    telemetry = None
    if args.as_served:  # as EngineCore sets it up, and the server's telemetry watching each step
        from service.settings import TelemetrySettings
        from service.telemetry.hub import Telemetry

        engine.rows, engine.detokenizer = True, Detokenizer(None)
        telemetry = Telemetry(TelemetrySettings(), engine.model_name)
        telemetry.start()
        engine.observer = telemetry.observer
    prompts = random_prompts(args.num_requests, Lengths(args.input_len, args.input_len),
                             engine.runner.model.config.vocab_size, 1)
    spent, call = collections.Counter(), collections.Counter()  # over the run's decode steps; in this step() call
    decode = [0]

    launch = engine._launch

    def launch_logged(batch, *rest):  # a step counts when it is a decode step
        decode[0] += batch.phase == "decode"
        return launch(batch, *rest)

    engine._launch = launch_logged
    timed(engine.scheduler, "schedule", call, "schedule")
    timed(engine.runner, "forward", call, "launch")
    timed(engine.runner, "sample", call, "sample")
    timed(engine, "_read_back", call, "read back")
    timed(engine.scheduler, "postprocess", call, "postprocess")  # inside "read back"
    if engine.observer is not None:
        timed(engine, "observer", call, "observe")  # inside "read back"
    timed(sampler_module.SampleResult, "read", call, "wait")  # inside "read back"
    if torch.cuda.is_available():  # the graph launch alone (cudaGraphLaunch), inside "launch"
        timed(torch.cuda.CUDAGraph, "replay", call, "graph launch")
    gcs = collections.Counter()
    gc_start = [0.0]

    def gc_timer(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gcs[info["generation"]] += 1
            gcs["seconds"] += time.perf_counter() - gc_start[0]

    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True, temperature=0)
    rows = collections.defaultdict(list)
    for run in range(args.runs + 1):
        spent.clear()
        gcs.clear()
        steps = 0
        if run == 1:
            gc.collect()
            gc.callbacks.append(gc_timer)
        for p in prompts:
            engine.add_request(p, params)
        start = time.perf_counter()
        decode_steps = 0
        while engine.has_unfinished():
            decode[0] = 0  # a step() call counts when it launches decode steps (several with --decode-steps)
            call.clear()
            t = time.perf_counter()
            out = engine.step()
            if args.as_served and out:
                begin = time.perf_counter()
                messages.encode(messages.Step(out, engine.num_waiting))
                call["encode"] += time.perf_counter() - begin
            if decode[0]:
                decode_steps += decode[0]
                call["step"] += time.perf_counter() - t
                spent.update(call)
            steps += 1
        sync(engine.device)
        seconds = time.perf_counter() - start
        if run == 0:
            continue  # the warm-up: every shape compiled and captured
        per = {k: 1e3 * v / decode_steps for k, v in spent.items()}
        per["read back less wait"] = per["read back"] - per["wait"]
        per["host, all but the wait"] = per["step"] - per["wait"]
        per["tok/s"] = args.num_requests * args.output_len / seconds
        per["gc ms per run"] = 1e3 * gcs["seconds"]
        per["gc collections by generation"] = {g: gcs[g] for g in (0, 1, 2)}
        for k, v in per.items():
            rows[k].append(v)
    print(f"{args.model}, {args.num_requests} x {args.input_len}/{args.output_len}, overlap {engine.overlap}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}: ms per decode step, median of "
          f"{args.runs} runs ({decode_steps} decode steps of {steps})")
    for k, v in rows.items():
        if isinstance(v[0], dict):
            print(f"  {k}: {v}")
        else:
            print(f"  {k}: {statistics.median(v):,.3f}  (runs: {', '.join(f'{x:,.3f}' for x in v)})")
    engine.close()
    if telemetry is not None:
        telemetry.shutdown()


if __name__ == "__main__":
    main()
