"""Overlap scheduling on and off in one process: offline throughput, and where a decode step's time goes.

One engine (one compiled model, one set of CUDA graphs) runs the offline workload alternately with
`engine.overlap` on and off; then a short torch.profiler window over decode steps gives, for each mode,
the device's idle time between steps and the host's own time per step (its waits for the device excluded).

    python -m service.bench.offline.overlap --runs 7 --json overlap.json --trace-dir traces
"""

import argparse
import json
import statistics
import time

import torch

from service.bench.offline.offline import run_engine
from service.engine import EngineConfig, LLMEngine, SamplingParams
from service.engine import sampler as sampler_module


def _busy_union(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def profile_decode(engine: LLMEngine, prompts: list[list[int]], steps: int, trace: str | None) -> dict:
    """Profile `steps` decode steps of the full batch: device idle between steps and host time per step."""
    from torch.profiler import ProfilerActivity, profile

    waited = [0.0]
    read = sampler_module.SampleResult.read

    def timed_read(result):  # the host's waits for the device, kept out of its own time
        start = time.perf_counter()
        try:
            return read(result)
        finally:
            waited[0] += time.perf_counter() - start

    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True, temperature=0)
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(8):  # prefill and settle into full decode steps
        engine.step()
    torch.cuda.synchronize()
    sampler_module.SampleResult.read = timed_read
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        sampler_module.SampleResult.read = read
        for rid in list(engine.seqs):
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    gpu = [(e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = _busy_union(gpu) / 1e6  # microseconds -> seconds
    span = (max(b for _, b in gpu) - min(a for a, _ in gpu)) / 1e6
    if trace:
        prof.export_chrome_trace(trace)
    return {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps, "gpu_busy_ms_per_step": 1e3 * busy / steps,
            "gpu_idle_ms_per_step": 1e3 * (span - busy) / steps,
            "host_ms_per_step": 1e3 * (wall - waited[0]) / steps}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m service.bench.offline.overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-1b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=7, help="timed runs of each mode, alternating")
    ap.add_argument("--profile-steps", type=int, default=30)
    ap.add_argument("--trace-dir", default=None, help="write a Chrome trace of each mode's profiled steps here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=256, max_num_batched_tokens=8192,
                                    gpu_memory_utilization=0.5, enable_prefix_caching=False))
    vocab = engine.runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, min(vocab, 32000), (args.num_requests, args.input_len), generator=gen).tolist()
    runs = {True: [], False: []}
    for _ in range(args.runs):
        for overlap in (True, False):
            engine.overlap = overlap
            runs[overlap].append(run_engine(engine, prompts, args.output_len)["seconds"])
    tokens = args.num_requests * args.output_len
    result = {"model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
              "modes": {}}
    print(f"{args.model}, {args.num_requests} x {args.input_len}/{args.output_len}, {result['device']}")
    print("| overlap | median s | output tok/s | runs (s) | GPU idle ms/step | host ms/step | wall ms/step |")
    print("|---|---|---|---|---|---|---|")
    for overlap in (True, False):
        engine.overlap = overlap
        trace = f"{args.trace_dir}/decode_overlap_{'on' if overlap else 'off'}.json" if args.trace_dir else None
        prof = profile_decode(engine, prompts, args.profile_steps, trace)
        median = statistics.median(runs[overlap])
        result["modes"]["on" if overlap else "off"] = {"runs": runs[overlap], "median_seconds": median,
                                                        "tokens_per_second": tokens / median, "profile": prof}
        print(f"| {'on' if overlap else 'off'} | {median:.3f} | {tokens / median:,.0f} | "
              f"{', '.join(f'{r:.3f}' for r in runs[overlap])} | {prof['gpu_idle_ms_per_step']:.2f} | "
              f"{prof['host_ms_per_step']:.2f} | {prof['wall_ms_per_step']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
