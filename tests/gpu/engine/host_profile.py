"""Which functions the engine's host time goes to: the workload all at once (as host_steps.py runs it), one warm-up
run, then one run under cProfile; prints the functions with the most time of their own, and with the most time
under them. cProfile slows every Python call, so read shares, not milliseconds.

Usage (on a CUDA machine; on the CPU it runs random:tiny):
  python3 tests/gpu/engine/host_profile.py [--model random:llama-1b] [--num-requests 256] [--top 35]
"""

import argparse
import cProfile
import pstats

import torch

from service.bench.offline.lengths import Lengths
from service.bench.offline.offline import random_prompts
from service.engine import EngineConfig, LLMEngine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-1b" if torch.cuda.is_available() else "random:tiny")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--rows", action="store_true", help="bare rows, as in the engine process (else RequestOutputs)")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=256, max_num_batched_tokens=8192,
                                    gpu_memory_utilization=0.5))
    engine.rows = args.rows
    prompts = random_prompts(args.num_requests, Lengths(args.input_len, args.input_len),
                             engine.runner.model.config.vocab_size, 1)

    def run() -> None:
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
    run()
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    stats = pstats.Stats(profile)
    for key in ("tottime", "cumtime"):
        print(f"== by {key}")
        stats.sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
