"""One model at several tensor-parallel sizes, one engine at a time, CUDA graphs and compiled layers on: set-up time,
one request's decode step (p50 of the engine's step durations), output tok/s of N requests at once (median of
rounds) and the time to the first token of one long prompt (median), each with its floor where it has one: one
request's step against reading each rank's weights once at the GPU's bandwidth.

    python3 tests/gpu/engine/tensor_parallel.py --model random:llama-8b --sizes 1 2
    python3 tests/gpu/engine/tensor_parallel.py --model random:llama-70b --sizes 1 --quantization fp8-w8a8

One JSON line per size, after the lines of its measurements.
"""

import argparse
import json
import statistics
import time

import torch

BANDWIDTH = 4.8e12  # bytes/s, the H200's data-sheet memory bandwidth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-8b")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes, in this order")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=1024, help="the long prompt whose first token is timed")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args = ap.parse_args()

    from service.engine import EngineConfig, LLMEngine, SamplingParams

    prompts = [[(7 * i + j) % 30000 + 10 for j in range(args.input_len)] for i in range(args.requests)]
    for size in args.sizes:
        start = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=args.model, tensor_parallel_size=size, quantization=args.quantization,
                                        max_num_seqs=args.max_num_seqs))
        row = {"model": args.model, "tensor_parallel_size": size, "quantization": args.quantization,
               "setup_seconds": round(time.perf_counter() - start, 1),
               "weight_bytes_per_rank": sum(p.numel() * p.element_size() for p in engine.runner.model.parameters()),
               "kv_blocks": engine.runner.num_blocks}
        row["weight_read_ms"] = row["weight_bytes_per_rank"] / BANDWIDTH * 1e3
        print(f"tp{size}: ready in {row['setup_seconds']} s, {row['weight_bytes_per_rank'] / 1e9:.1f} GB of weights "
              f"a rank (read once: {row['weight_read_ms']:.2f} ms)", flush=True)
        steps = []
        engine.observer = lambda s: steps.append(s.duration) if s.phase == "decode" else None
        one = SamplingParams(max_tokens=256, min_tokens=256, ignore_eos=True, temperature=0)
        step_p50 = []
        for _ in range(2):  # the first warms up
            steps.clear()
            engine.generate(prompts[:1], one)
            step_p50.append(statistics.median(steps[8:]))
        row["one_request_step_ms"] = step_p50[-1] * 1e3
        print(f"tp{size}: one request's decode step p50 {row['one_request_step_ms']:.2f} ms "
              f"({row['one_request_step_ms'] / row['weight_read_ms']:.2f}x the weight read)", flush=True)
        engine.observer = None
        params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True, temperature=0)
        rates = []
        for r in range(args.rounds + 1):  # the first warms up
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.generate(prompts, params)
            torch.cuda.synchronize()
            rates.append(args.requests * args.output_len / (time.perf_counter() - t))
        row["output_tok_s_rounds"] = [round(x) for x in rates[1:]]
        row["output_tok_s"] = statistics.median(rates[1:])
        print(f"tp{size}: {args.requests} x {args.input_len}/{args.output_len}: {row['output_tok_s']:,.0f} output "
              f"tok/s (median of {row['output_tok_s_rounds']})", flush=True)
        first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
        ttft = []
        for k in range(6):  # the first warms up; each prompt its own (no cached prefix)
            long = [[(11 * j + 97 * k + 1000 * size) % 30000 + 10 for j in range(args.prompt_len)]]
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.generate(long, first)
            ttft.append(time.perf_counter() - t)
        row["ttft_ms"] = statistics.median(ttft[1:]) * 1e3
        print(f"tp{size}: first token of a {args.prompt_len}-token prompt: {row['ttft_ms']:.1f} ms", flush=True)
        if engine.parallel is not None:
            torch.cuda.synchronize()
            row["rank_seconds"] = engine.parallel.rank_seconds
        row["eager_steps"] = engine.runner.eager_steps
        engine.close()
        del engine
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
