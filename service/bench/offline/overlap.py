"""Overlap scheduling on and off in one process: offline throughput, and where a decode step's time goes.

One engine (one compiled model, one set of CUDA graphs) runs the offline workload alternately with
`engine.overlap` on and off; then a short torch.profiler window over decode steps gives, for each mode,
the device's busy time per step; a plain window of as many steps gives the wall and host time per step
(the host's waits for the device excluded), and the device's idle time per step is their difference.

    python -m service.bench.offline.overlap --runs 7 --json overlap.json --trace-dir traces
"""

import argparse
import json
import statistics
import time

import torch

from service.bench.offline.lengths import Lengths, lengths_arg
from service.bench.offline.offline import random_prompts, run_engine, sync
from service.bench.offline.steps import busy_union
from service.bench.store import add_db_argument, open_store_or_exit
from service.engine import EngineConfig, LLMEngine, SamplingParams
from service.engine.runner import sampler as sampler_module


def profile_decode(engine: LLMEngine, prompts: list[list[int]], steps: int, trace: str | None) -> dict:
    """Time `steps` decode steps of the full batch, then profile as many more.

    Host time per step is the engine thread's time less its waits for the device (plain window); the
    device's busy time per step is the union of its kernels and copies (profiled window); the device's idle
    time per step is the plain window's wall time per step less that busy time.
    """
    from torch.profiler import ProfilerActivity, profile

    waited = [0.0]
    read = sampler_module.SampleResult.read

    def timed_read(result):
        start = time.perf_counter()
        try:
            return read(result)
        finally:
            waited[0] += time.perf_counter() - start

    params = SamplingParams(max_tokens=2 * steps + 64, ignore_eos=True, temperature=0)
    for p in prompts:
        engine.add_request(p, params)
    while not all(s.num_output_tokens for s in engine.seqs.values()):  # until every prompt is in
        engine.step()
    for _ in range(4):  # settle into full decode steps
        engine.step()
    sync(engine.device)
    sampler_module.SampleResult.read = timed_read
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.device)
        wall = time.perf_counter() - start
        host = wall - waited[0]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            sync(engine.device)
    finally:
        sampler_module.SampleResult.read = read
        for rid in list(engine.seqs):
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    gpu = [(e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = busy_union(gpu) / 1e6  # microseconds -> seconds
    if trace:
        prof.export_chrome_trace(trace)
    return {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps, "host_ms_per_step": 1e3 * host / steps,
            "gpu_busy_ms_per_step": 1e3 * busy / steps, "gpu_idle_ms_per_step": 1e3 * (wall - busy) / steps}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m service.bench.offline.overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-1b", help="the model, as serve --model takes it (default "
                    "%(default)s)")
    ap.add_argument("--num-requests", type=int, default=256, help="requests, all submitted at once (default "
                    "%(default)s)")
    ap.add_argument("--input-len", type=lengths_arg, default=Lengths(128, 128), help="a count or uniform:LOW-HIGH")
    ap.add_argument("--output-len", type=lengths_arg, default=Lengths(128, 128), help="a count or uniform:LOW-HIGH")
    ap.add_argument("--seed", type=int, default=1, help="seeds the prompts and their lengths, as bench offline does")
    ap.add_argument("--runs", type=int, default=7, help="timed runs of each mode, alternating")
    ap.add_argument("--profile-steps", type=int, default=30, help="0: no profile")
    ap.add_argument("--trace-dir", default=None, help="write a Chrome trace of each mode's profiled steps here")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the result here as JSON")
    ap.add_argument("--label", default=None, help="a name for this run in the results store")
    add_db_argument(ap)
    args = ap.parse_args(argv)
    store = open_store_or_exit(args.db)

    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=256, max_num_batched_tokens=8192,
                                    gpu_memory_utilization=0.5, enable_prefix_caching=False))
    prompts = random_prompts(args.num_requests, args.input_len, engine.runner.model.config.vocab_size, args.seed)
    output_lens = args.output_len.sample(args.num_requests, args.seed + 1)
    runs = {True: [], False: []}
    for _ in range(args.runs):
        for overlap in (True, False):
            engine.overlap = overlap
            runs[overlap].append(run_engine(engine, prompts, output_lens)["seconds"])
    tokens = sum(output_lens)
    result = {"model": args.model, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "num_requests": args.num_requests, "input_len": str(args.input_len), "output_len": str(args.output_len),
              "modes": {}}
    print(f"{args.model}, {args.num_requests} requests x {args.input_len} in / {args.output_len} out, {result['device']}")
    print("| overlap | median s | output tok/s | runs (s) | decode step: wall ms | GPU busy ms | GPU idle ms | host ms |")
    print("|---|---|---|---|---|---|---|---|")
    for overlap in (True, False):
        engine.overlap = overlap
        trace = f"{args.trace_dir}/decode_overlap_{'on' if overlap else 'off'}.json" if args.trace_dir else None
        prof = profile_decode(engine, prompts[:256], args.profile_steps, trace) if args.profile_steps else \
            dict.fromkeys(["wall_ms_per_step", "gpu_busy_ms_per_step", "gpu_idle_ms_per_step", "host_ms_per_step"], 0.0)
        median = statistics.median(runs[overlap])
        result["modes"]["on" if overlap else "off"] = {"runs": runs[overlap], "median_seconds": median, "tokens": tokens,
                                                        "tokens_per_second": tokens / median, "profile": prof}
        print(f"| {'on' if overlap else 'off'} | {median:.3f} | {tokens / median:,.0f} | "
              f"{', '.join(f'{r:.3f}' for r in runs[overlap])} | {prof['wall_ms_per_step']:.2f} | "
              f"{prof['gpu_busy_ms_per_step']:.2f} | {prof['gpu_idle_ms_per_step']:.2f} | "
              f"{prof['host_ms_per_step']:.2f} |", flush=True)
    record(store, args.label, {"model": args.model, "num_requests": args.num_requests, "input_len": str(args.input_len),
                               "output_len": str(args.output_len), "seed": args.seed,
                               "profile_steps": args.profile_steps}, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def record(store, label: str | None, config: dict, result: dict) -> int:
    """One stored run: each timed run of each mode, and each mode's decode-step profile."""
    with store.run(kind="overlap", config=config, label=label, name=f"overlap-{config['model']}") as run:
        for mode, m in result["modes"].items():
            for i, seconds in enumerate(m["runs"]):
                run.measure(f"overlap_{mode}_wall_seconds", seconds, unit="s", iteration=i)
                run.measure(f"overlap_{mode}_output_tokens_per_second", m["tokens"] / seconds, unit="tok/s", iteration=i)
            if config["profile_steps"]:
                for key in ("wall", "gpu_busy", "gpu_idle", "host"):
                    run.measure(f"overlap_{mode}_decode_step_{key}_seconds", m["profile"][f"{key}_ms_per_step"] / 1e3,
                                unit="s")
    print(f"stored as run {run.id} in {store.url}")
    return run.id


if __name__ == "__main__":
    main()
