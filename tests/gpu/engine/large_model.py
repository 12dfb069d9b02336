"""A model near one GPU's size: its memory at load (allocated, reserved, used on the device) and before the KV cache
is sized, then output tok/s for N requests all at once (three runs; the first carries the warm-up) and one request's
time per token.

    python3 tests/gpu/engine/large_model.py --model random:llama-70b --quantization fp8-w8a8
"""

import argparse
import random
import time

import torch

import service.engine.runner.kv_cache as kv_cache
from service.engine import EngineConfig, LLMEngine, SamplingParams


def stats(where: str) -> None:
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    print(f"{where}: allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB, reserved {reserved / 2**30:.1f}, "
          f"used on the device {(total - free) / 2**30:.1f}, not PyTorch's {(total - free - reserved) / 2**30:.1f}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-70b")
    ap.add_argument("--quantization", default="fp8-w8a8")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    profile = kv_cache.profile_peak_memory

    def profiled(runner):
        stats("loaded, before the dry runs that size the KV cache")
        return profile(runner)
    kv_cache.profile_peak_memory = profiled
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization))
    stats(f"engine ready after {time.perf_counter() - start:.0f} s")
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 30000) for _ in range(args.input_len)] for _ in range(args.requests)]
    for r in range(3):
        params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True, temperature=0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        rate = args.requests * args.output_len / (time.perf_counter() - t)
        print(f"run {r + 1}: {rate:.0f} output tok/s", flush=True)
    one = SamplingParams(max_tokens=256, min_tokens=256, ignore_eos=True, temperature=0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.generate(prompts[:1], one)
    torch.cuda.synchronize()
    print(f"one request, {args.input_len} in / 256 out: {(time.perf_counter() - t) / 256 * 1000:.2f} ms per token")
    engine.close()


if __name__ == "__main__":
    main()
