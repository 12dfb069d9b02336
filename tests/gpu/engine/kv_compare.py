"""Offline throughput with the KV cache in the model's dtype and in 8 bits (--kv-cache-dtype), one engine each in
one process, runs alternating so that drift hits both alike: the median of each and of the per-round ratios.

    python3 tests/gpu/engine/kv_compare.py --input-len uniform:100-1024 --output-len uniform:100-1024 --runs 5
"""

import argparse
import statistics

import torch

from service.bench.offline.lengths import Lengths, lengths_arg
from service.bench.offline.offline import random_prompts, run_engine
from service.engine import EngineConfig, LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:llama-1b")
    ap.add_argument("--kv", default="auto,fp8", help="comma list of --kv-cache-dtype values; the first is the base")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=lengths_arg, default=Lengths(128, 128))
    ap.add_argument("--output-len", type=lengths_arg, default=Lengths(128, 128))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script, not a figure")
    ap.add_argument("--num-blocks", type=int, default=33000, help="the same for each (room for every sequence)")
    args = ap.parse_args()
    kvs = args.kv.split(",")
    # each engine compiles the same decoder-layer code: keep torch.dynamo's cache from running out between them
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(kvs))
    engines = {kv: LLMEngine(EngineConfig(model=args.model, device=args.device, kv_cache_dtype=kv,
                                          num_blocks=args.num_blocks, enable_prefix_caching=False)) for kv in kvs}
    base = engines[kvs[0]]
    prompts = random_prompts(args.num_requests, args.input_len, base.runner.model.config.vocab_size, 1)
    output_lens = args.output_len.sample(args.num_requests, 2)
    tokens = sum(output_lens)
    seconds = {kv: [] for kv in kvs}
    for r in range(args.runs):
        for kv in kvs:
            seconds[kv].append(run_engine(engines[kv], prompts, output_lens)["seconds"])
        print(f"round {r}: " + ", ".join(f"{kv} {tokens / seconds[kv][-1]:,.0f} tok/s" for kv in kvs), flush=True)
    print(f"{args.model}, {args.num_requests} x {args.input_len} / {args.output_len}, {tokens} output tokens, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}")
    for kv in kvs:
        ratios = [b / s for b, s in zip(seconds[kvs[0]], seconds[kv])]
        print(f"| {kv} | {engines[kv].runner.kv_dtype} | {tokens / statistics.median(seconds[kv]):,.0f} tok/s (median "
              f"of {args.runs}) | {statistics.median(ratios):.3f}x (per-round {min(ratios):.3f}-{max(ratios):.3f}) |")


if __name__ == "__main__":
    main()
