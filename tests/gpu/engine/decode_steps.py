"""Where a decode step's time goes on the GPU: the engine's own step durations by phase, the decode
step against its roofline, and a profile of decode steps (host time per op, GPU busy time per step).

The step duration is what `llm_engine_step_seconds` observes (StepStats.duration: with overlap, read-back to
read-back). The roofline of a decode step is max(FLOPs / the bf16 peak, (weight bytes + KV bytes read) / the
memory bandwidth), with the device's data-sheet figures (`bench kernel`'s table: an H200's 989 TFLOP/s dense bf16
and 4.8 TB/s).

Usage (on a CUDA machine; `bash tests/gpu/run.sh decode` runs it):
  python3 tests/gpu/engine/decode_steps.py --model random:llama-1b --num-requests 1 --input-len 128 --output-len 512
"""

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-1b")
    ap.add_argument("--num-requests", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--profile-steps", type=int, default=40, help="decode steps profiled after the timed run")
    ap.add_argument("--profile-batch", type=int, default=1, help="requests decoding in the profiled steps")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--no-fuse-qkv", action="store_true", help="three multiplies for q, k, v (transformers' way)")
    ap.add_argument("--quantization", default="none", help="a --quantization mode (compare the step sums by phase)")
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script, not a figure")
    ap.add_argument("--trace", help="write the profiled steps' trace here (Chrome's JSON), and print its kernels per "
                                    "step with the gaps between them")
    args = ap.parse_args()

    from service.bench.offline.roofline import peaks
    from service.engine.config import EngineConfig
    from service.engine.llm_engine import LLMEngine
    from service.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_num_seqs=max(args.num_requests, 1),
                                    max_num_batched_tokens=8192, gpu_memory_utilization=args.gpu_memory_utilization,
                                    cuda_graphs=not args.no_cuda_graphs, fuse_qkv=not args.no_fuse_qkv,
                                    quantization=args.quantization))
    model = engine.runner.model
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    tflops, gbs = peaks(name, args.quantization, model.dtype)
    if tflops is None or gbs is None:  # a device without data-sheet figures (the CPU): the H200's, for the check
        tflops, gbs = 989.0, 4800.0
    peak_flops, peak_bytes = tflops * 1e12, gbs * 1e9
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.tensor([], dtype=model.dtype).element_size()
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s on {name} ({tflops:g} TFLOP/s, {gbs:g} GB/s): "
          f"{n_params / 1e9:.2f} B parameters, {weight_bytes / 1e9:.2f} GB, KV {kv_per_token} B/token, q/k/v fused in "
          f"{engine.runner.fused_layers} layers",
          flush=True)

    steps = []  # (phase, duration, sequences, context tokens read)

    def observe(stats):
        if stats.phase is not None:
            context = sum(o.num_prompt_tokens + o.num_output_tokens for o in stats.outputs)
            steps.append((stats.phase, stats.duration, stats.num_seqs, context))

    engine.observer = observe
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(args.input_len)] for i in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    engine.generate(prompts[:1], SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))  # warm-up
    steps.clear()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    out_tokens = args.num_requests * args.output_len
    print(f"{args.num_requests} x {args.input_len}/{args.output_len}: {wall:.3f} s, "
          f"{out_tokens / wall:,.0f} output tok/s, {len(steps)} steps")
    for phase in ("prefill", "mixed", "decode"):
        d = sorted(s[1] for s in steps if s[0] == phase)
        if d:
            print(f"{phase:8s} steps {len(d):5d}: p50 {1e3 * statistics.median(d):.3f} ms, "
                  f"p90 {1e3 * d[int(0.9 * (len(d) - 1))]:.3f} ms, sum {sum(d):.3f} s")
    decode = [s for s in steps if s[0] == "decode"]
    if decode:
        batch = max(s[2] for s in decode)
        full = [s for s in decode if s[2] == batch]
        compute = 2 * n_params * batch / peak_flops
        roof = [max(compute, (weight_bytes + ctx * kv_per_token) / peak_bytes) for _, _, _, ctx in full]
        measured = statistics.median(s[1] for s in full)
        print(f"decode at batch {batch} ({len(full)} steps): p50 {1e3 * measured:.3f} ms, roofline p50 "
              f"{1e3 * statistics.median(roof):.3f} ms (compute {1e3 * compute:.3f} ms, "
              f"weights {1e3 * weight_bytes / peak_bytes:.3f} ms, KV at median context "
              f"{1e3 * statistics.median(c for *_, c in full) * kv_per_token / peak_bytes:.3f} ms): "
              f"{measured / statistics.median(roof):.2f}x the roofline", flush=True)

    if args.profile_steps:  # decode steps only, at --profile-batch requests, after their prefill
        from torch.profiler import ProfilerActivity, profile
        seqs = [engine.make_sequence(p, SamplingParams(max_tokens=args.profile_steps + 20, ignore_eos=True,
                                                       temperature=0.0)) for p in prompts[:args.profile_batch]]
        for seq in seqs:
            engine.add_sequence(seq)
        for _ in range(15):
            engine.step()
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(args.profile_steps):
                engine.step()
            sync()
            per_step = (time.perf_counter() - t0) / args.profile_steps
        while not all(seq.is_finished for seq in seqs):
            engine.step()
        if args.trace:
            prof.export_chrome_trace(args.trace)
            kernel_table(args.trace, args.profile_steps)
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 1e3 / args.profile_steps
        print(f"profiled {args.profile_steps} decode steps at batch {len(seqs)}: {1e3 * per_step:.3f} ms a step under "
              f"the profiler, GPU busy {gpu:.3f} ms a step")
        print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


def kernel_table(path: str, steps: int, gap_us: float = 20.0) -> None:
    """Per step, from a trace of `steps` steps: how many kernels ran, the time the GPU ran at least one (busy), the
    time from a first kernel to a last one, the idle time between kernels (gaps under gap_us: inside a step, not
    between steps), and each kernel's time, count and mean. Under programmatic dependent launch (engine/pdl.py) a
    kernel starts before the one before it ends and its time includes that wait, so the kernels' own times add up
    to more than the busy time."""
    import collections
    import json

    from service.bench.offline.steps import busy_union

    with open(path) as f:
        kernels = sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        print("no GPU kernels in the trace")
        return
    total, count = collections.defaultdict(float), collections.Counter()
    busy = busy_union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    idle, end = [], kernels[0]["ts"]
    for e in kernels:
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
        if end < e["ts"] < end + gap_us:
            idle.append(e["ts"] - end)
        end = max(end, e["ts"] + e["dur"])
    span = end - kernels[0]["ts"]
    print(f"kernels a step {len(kernels) / steps:.1f}, busy {busy / steps:.1f} us (the kernels' own times "
          f"{sum(total.values()) / steps:.1f} us), first to last kernel {span / steps:.1f} us, idle between kernels "
          f"{sum(idle) / steps:.1f} us ({len(idle) / steps:.1f} gaps under {gap_us:.0f} us)")
    for name, us in sorted(total.items(), key=lambda item: -item[1]):
        print(f"{us / steps:9.1f} us a step {count[name] / steps:6.1f} a step {us / count[name]:8.2f} us each  "
              f"{name[:90]}")

if __name__ == "__main__":
    main()
