"""Long prompts through one engine on CUDA with the long prefill tiles (input_packing.block_m_for) on and off,
alternating, and the tile rows each eager step's attention ran with (docs/log/2026-11.md, long prefill
tiles). Off is LONG_PREFILL_CONTEXT out of reach, so every step takes the tiles it took before.

  python3 tests/gpu/engine/long_prefill.py --model random:llama-8b --num-requests 2 --input-len 32768
"""

import argparse
import collections
import time

import torch

from service.bench.offline.lengths import Lengths
from service.bench.offline.offline import random_prompts
from service.engine import LLMEngine, SamplingParams
from service.engine.config import EngineConfig
from service.engine.runner import input_packing


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-8b")
    ap.add_argument("--num-requests", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, device="cuda", gpu_memory_utilization=0.7,
                                    enable_prefix_caching=False))
    rows, backend = collections.Counter(), engine.runner.backend

    def spy(q, k, v, meta, *rest, **kw):  # eager steps only: the graphs replay without Python
        rows[meta.block_m] += 1
        return backend(q, k, v, meta, *rest, **kw)

    engine.runner.backend = spy
    prompts = random_prompts(args.num_requests, Lengths.parse(args.input_len), engine.runner.model.config.vocab_size, 1)
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    engine.generate(prompts, params)  # warm-up: every shape compiled
    context, times = input_packing.LONG_PREFILL_CONTEXT, collections.defaultdict(list)
    for _ in range(args.repeats):
        for mode in ("on", "off"):
            input_packing.LONG_PREFILL_CONTEXT = context if mode == "on" else 1 << 40
            rows.clear()
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.generate(prompts, params)
            torch.cuda.synchronize()
            times[mode].append(time.perf_counter() - start)
            print(f"{mode}: {times[mode][-1]:.3f} s; attention calls by tile rows {dict(rows)}", flush=True)
    print({mode: [round(t, 3) for t in sorted(ts)] for mode, ts in times.items()})
    engine.close()


if __name__ == "__main__":
    main()
