"""Where a workload's engine steps go: by kind of step, the wall time, the device's busy time, the host's time,
and the device's time by kind of kernel (attention, matrix products, the rest).

One engine runs the workload (all requests at once, as `bench offline`) four times:
1. a warm-up (every shape compiled and captured);
2. overlap as served (on, on CUDA): each step's wall time, grouped by the kind of step it launched;
3. overlap off: each step's wall time, host and device one after the other;
4. overlap off under torch.profiler: each step's kernels run inside its own step() call, so each is attributed
   to its step by time alone; the device's busy time is the union of its kernels and copies.
The host's time per step is run 3's wall time less run 4's busy time (the same steps: scheduling does not
depend on time). `--host-profile` adds a fifth run under cProfile.

A step's kind: decode (one token for each sequence), mixed (prompt chunks beside decodes) or prefill (prompt
chunks only), and whether it replayed a CUDA graph or ran eagerly.

    python -m service.bench.offline.steps --input-len uniform:100-1024 --output-len uniform:100-1024 --json steps.json
"""

import argparse
import collections
import contextlib
import json
import time
from typing import NamedTuple

import torch

from service.bench.offline.lengths import Lengths, lengths_arg
from service.bench.offline.offline import random_prompts, run_engine, sync
from service.bench.store import add_db_argument, open_store_or_exit
from service.engine import EngineConfig, LLMEngine, SamplingParams
from service.settings import add_engine_argument

# kernel name -> the kind of work it does; the first pattern that a (lower-case) name contains wins
KERNEL_KINDS = (
    ("attention", ("paged_attention", "flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "splitk", "scaled_mm", "int8_scaled_mm")),
    ("kv write", ("write_kv", "index_copy")),  # triton_attention.write_kv; index_copy_: the writes before it
    ("copy", ("memcpy", "memset")),
)


STEP = "LLMEngine.step"  # the profiler's name for a step() call (run_steps' annotation)


class Event(NamedTuple):
    """What `attribute` needs of a profiler event."""
    name: str
    gpu: bool  # on the device (a kernel, a copy, or a range the profiler draws there for an annotation)
    annotation: bool  # a range of a marked region (record_function, inductor's calls), not work itself
    stream: int
    start_ns: int
    end_ns: int


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, patterns in KERNEL_KINDS if any(p in low for p in patterns)), "other")


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """The time covered by at least one of the intervals."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def run_steps(engine: LLMEngine, prompts, output_lens, overlap: bool,
              annotate: bool = False) -> tuple[list[dict], float]:
    """All prompts at once (after `run_engine`'s warm-up), with overlap on or off: each launched step's kind,
    token and sequence counts, and the wall time of the step() call that launched it (with overlap that call
    also reads back the step before it: the time a served step takes). `annotate` marks each call for
    torch.profiler as `LLMEngine.step`."""
    runner, launch, steps = engine.runner, engine._launch, []

    def logged(batch, *rest):
        phase, eager = batch.phase, runner.eager_steps
        launched = launch(batch, *rest)
        steps.append({"kind": f"{phase}, {'eager' if runner.eager_steps > eager else 'graph'}",
                      "tokens": sum(batch.num_new_tokens), "seqs": len(batch.seqs)})
        return launched

    served, engine.overlap = engine.overlap, overlap
    params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0) for n in output_lens]
    engine._launch = logged
    try:
        sync(engine.device)
        start = time.perf_counter()
        for p, sp in zip(prompts, params):
            engine.add_request(p, sp)
        call = 0
        while engine.has_unfinished():
            n, t0 = len(steps), time.perf_counter()
            with torch.profiler.record_function(STEP) if annotate else contextlib.nullcontext():
                engine.step()
            if len(steps) > n:  # this call launched a step
                steps[-1].update(wall=time.perf_counter() - t0, call=call)
            call += 1
        sync(engine.device)
        seconds = time.perf_counter() - start
    finally:
        del engine._launch  # the bound method again
        engine.overlap = served
    return steps, seconds


def profile_steps(engine: LLMEngine, prompts, output_lens) -> list[dict]:
    """Overlap off under torch.profiler: each step's device busy time and kernel time by kind (`attribute`).
    The host's own time is better read from a run without the profiler, which slows it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        steps, _ = run_steps(engine, prompts, output_lens, overlap=False, annotate=True)
    # the raw events: torch's own post-processing of a run's hundreds of thousands of kernels takes minutes
    cuda = torch.autograd.DeviceType.CUDA
    events = [Event(e.name(), e.device_type() == cuda, e.is_user_annotation(), e.device_resource_id(),
                    e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()]
    attribute(steps, events)
    return steps


def attribute(steps: list[dict], events: list[Event]) -> None:
    """Give each step (in launch order, overlap off) the kernels and copies that started inside its step() call:
    its device busy time (their union) and their time by kernel and by kind of kernel.

    A marked call has a range on the host and, on CUDA, one on the device for each stream it used, from its first
    to its last piece of work there (Kineto's gpu_user_annotation). Where the stream every step used has one
    range a step, those bound the steps on the device's own clock; otherwise the host's ranges do (Kineto puts
    both on one clock). Annotation ranges are never counted as work (inductor marks each compiled call too)."""
    host, device, kernels = [], collections.defaultdict(list), []
    for e in events:
        if e.name == STEP:
            (device[e.stream] if e.gpu else host).append((e.start_ns, e.end_ns))
        elif e.gpu and not e.annotation:
            kernels.append((e.start_ns, e.end_ns, e.name))
    kernels.sort()
    ranges = [sorted(r) for r in device.values() if len(r) == len(steps)]
    if ranges:
        windows = min(ranges)  # the stream every step used, whose first range starts first: the compute stream
    else:
        host.sort()
        windows = [host[s["call"]] for s in steps]
    i = 0
    for s, (a, b) in zip(steps, windows):
        while i < len(kernels) and kernels[i][0] < a:
            i += 1
        mine = []
        while i < len(kernels) and kernels[i][0] < b:
            mine.append(kernels[i])
            i += 1
        s["busy"] = busy_union([(k0, k1) for k0, k1, _ in mine]) / 1e9
        s["by_kind"], s["by_kernel"] = collections.Counter(), collections.Counter()
        for k0, k1, name in mine:
            s["by_kind"][kernel_kind(name)] += (k1 - k0) / 1e9
            s["by_kernel"][name] += (k1 - k0) / 1e9


def top_kernels(profiled: list[dict], top: int) -> dict[str, list[tuple[str, str, float, float]]]:
    """Per kind of step, its `top` kernels by device time: (name, kind of kernel, ms per step, share of the
    kind's busy time)."""
    kernels, busy, steps = collections.defaultdict(collections.Counter), collections.Counter(), collections.Counter()
    for s in profiled:
        kernels[s["kind"]].update(s.get("by_kernel", {}))
        busy[s["kind"]] += s.get("busy", 0.0)
        steps[s["kind"]] += 1
    return {kind: [(name, kernel_kind(name), 1e3 * t / steps[kind], t / busy[kind] if busy[kind] else 0.0)
                   for name, t in counter.most_common(top)] for kind, counter in kernels.items()}


def host_profile(engine: LLMEngine, prompts, output_lens, overlap: bool, top: int) -> None:
    """The engine thread under cProfile (which slows Python about twofold: read the shares, not the times)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    steps, seconds = run_steps(engine, prompts, output_lens, overlap)
    prof.disable()
    print(f"host profile: {len(steps)} steps in {seconds:.3f} s under cProfile")
    for key in ("tottime", "cumtime"):  # each function's own time, then the time under it
        pstats.Stats(prof).sort_stats(key).print_stats(top)


def summarise(served: list[dict], plain: list[dict], profiled: list[dict]) -> list[dict]:
    """One row per kind of step, most served time first. Totals in seconds: `served` from the run with overlap
    on; `wall` from the run with overlap off; `busy` and each kind of kernel from the profiled run (overlap
    off). Per step: `served_ms`, `wall_ms`, `busy_ms`, and `host_ms` = wall_ms - busy_ms."""
    rows = collections.defaultdict(collections.Counter)
    for name, run, key in (("served", served, "wall"), ("wall", plain, "wall"), ("busy", profiled, "busy")):
        for s in run:
            r = rows[s["kind"]]
            r[f"{name} steps"] += 1
            r[name] += s.get(key, 0.0)
            if name == "wall":
                r["tokens"] += s["tokens"]
                r["seqs"] += s["seqs"]
            if name == "busy":
                r.update(s.get("by_kind", {}))
    out = []
    for kind, r in sorted(rows.items(), key=lambda kv: -kv[1]["served"]):
        per = {name: 1e3 * r[name] / r[f"{name} steps"] if r[f"{name} steps"] else 0.0
               for name in ("served", "wall", "busy")}
        n = max(r["wall steps"], 1)
        out.append({"kind": kind, **r, "tokens_per_step": r["tokens"] / n, "seqs_per_step": r["seqs"] / n,
                    **{f"{name}_ms": v for name, v in per.items()}, "host_ms": max(0.0, per["wall"] - per["busy"]),
                    "shares": {k: r[k] / r["busy"] for k in ("attention", "matmul", "kv write", "copy", "other")
                               if r["busy"]}})
    return out


def print_table(rows: list[dict]) -> None:
    print("| step kind | steps (served) | served s | served ms/step | tokens/step | seqs/step | overlap off: "
          "wall ms/step | device busy ms/step | host ms/step | attention | matmul | kv write | copies, other |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sh = r["shares"]
        share = (lambda k: f"{sh[k]:.0%}" if k in sh else "-")
        rest = f"{sh.get('copy', 0) + sh.get('other', 0):.0%}" if sh else "-"
        print(f"| {r['kind']} | {r['served steps']} | {r['served']:.3f} | {r['served_ms']:.2f} | "
              f"{r['tokens_per_step']:,.0f} | {r['seqs_per_step']:.0f} | {r['wall_ms']:.2f} | {r['busy_ms']:.2f} | "
              f"{r['host_ms']:.2f} | {share('attention')} | {share('matmul')} | {share('kv write')} | {rest} |",
              flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m service.bench.offline.steps", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the model, as serve --model takes it (default: random:llama-1b "
                    "on CUDA, random:tiny on CPU)")
    ap.add_argument("--num-requests", type=int, default=256, help="requests, all submitted at once (default "
                    "%(default)s)")
    ap.add_argument("--input-len", type=lengths_arg, default=Lengths.parse("uniform:100-1024"),
                    help="a count or uniform:LOW-HIGH")
    ap.add_argument("--output-len", type=lengths_arg, default=Lengths.parse("uniform:100-1024"),
                    help="a count or uniform:LOW-HIGH")
    ap.add_argument("--seed", type=int, default=1, help="seeds the prompts and their lengths, as bench offline does")
    add_engine_argument(ap, "max_num_seqs", 256, type=int)
    add_engine_argument(ap, "max_num_batched_tokens", 8192, type=int)
    add_engine_argument(ap, "num_blocks", None, type=int)
    add_engine_argument(ap, "kv_cache_dtype", "auto")
    add_engine_argument(ap, "quantization", "none")
    add_engine_argument(ap, "gpu_memory_utilization", 0.5, type=float)
    ap.add_argument("--overlap", choices=["on", "off"], default=None,
                    help="overlap in the served run (default: the engine's, on on CUDA)")
    ap.add_argument("--top-kernels", type=int, default=0, metavar="N",
                    help="print each kind of step's N costliest kernels (device time per step, share of its busy time)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="one more run (overlap as served) under cProfile: print the host's N costliest functions")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the result here as JSON")
    ap.add_argument("--label", default=None, help="a name for this run in the results store")
    add_db_argument(ap)
    args = ap.parse_args(argv)
    store = open_store_or_exit(args.db)
    cuda = torch.cuda.is_available()
    model = args.model or ("random:llama-1b" if cuda else "random:tiny")
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
                                    gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
                                    kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization))
    try:
        prompts = random_prompts(args.num_requests, args.input_len, engine.runner.model.config.vocab_size, args.seed)
        output_lens = args.output_len.sample(args.num_requests, args.seed + 1)
        overlap = engine.overlap if args.overlap is None else args.overlap == "on"
        run_engine(engine, prompts, output_lens)  # warm-up: every shape compiled and captured
        served, served_s = run_steps(engine, prompts, output_lens, overlap)
        plain, plain_s = run_steps(engine, prompts, output_lens, overlap=False)
        profiled = profile_steps(engine, prompts, output_lens)
        if args.host_profile:
            host_profile(engine, prompts, output_lens, overlap, args.host_profile)
    finally:
        engine.close()
    tokens = sum(output_lens)
    rows = summarise(served, plain, profiled)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    mode = "" if args.quantization == "none" else f" {args.quantization}"
    print(f"{model}{mode}, {args.num_requests} requests x {args.input_len} in / {args.output_len} out, {device}: "
          f"overlap {'on' if overlap else 'off'} {served_s:.3f} s ({tokens / served_s:,.0f} tok/s, "
          f"{len(served)} steps); "
          f"overlap off {plain_s:.3f} s ({tokens / plain_s:,.0f} tok/s, {len(plain)} steps)")
    print_table(rows)
    tops = top_kernels(profiled, args.top_kernels) if args.top_kernels else {}
    for kind, kernels in tops.items():
        print(f"{kind}: its {len(kernels)} costliest kernels")
        for name, what, ms, share in kernels:
            print(f"| {ms:8.3f} ms/step | {share:6.1%} | {what:9s} | {name[:110]} |")
    result = {"model": model, "device": device, "torch": torch.__version__, "num_requests": args.num_requests,
              "input_len": str(args.input_len), "output_len": str(args.output_len), "output_tokens": tokens,
              "overlap": overlap, "served_seconds": served_s, "overlap_off_seconds": plain_s, "kinds": rows,
              "top_kernels": tops}
    config = {"model": model, "num_requests": args.num_requests, "input_len": str(args.input_len),
              "output_len": str(args.output_len), "seed": args.seed}
    # runs stored before these options keep their configuration's hash
    for key, default in (("kv_cache_dtype", "auto"), ("quantization", "none"), ("gpu_memory_utilization", 0.5)):
        if getattr(args, key) != default:
            config[key] = getattr(args, key)
    with store.run(kind="steps", name=f"steps-{model}", label=args.label, config=config) as run:
        run.measure("output_tokens_per_second", tokens / served_s, unit="tok/s")
        run.measure("overlap_off_output_tokens_per_second", tokens / plain_s, unit="tok/s")
        for r in rows:
            kind = r["kind"].replace(", ", "_")
            for key in ("served", "wall", "busy", "host"):
                run.measure(f"step_{kind}_{key}_seconds", r[f"{key}_ms"] / 1e3, unit="s")
    print(f"stored as run {run.id} in {store.url}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
