"""n samples of each prompt against as many distinct prompts, on the engine alone: what sharing the prompt saves.

Each round runs two batches on one engine, all requests added at once: PROMPTS prompts with n samples each
(Add.n, the samples after the first sharing its prompt blocks), then PROMPTS * n distinct prompts. Every prompt is
fresh random tokens (nothing cached from an earlier batch). Prints one JSON line per batch: prompt tokens computed
and cached (the engine's own counters), output tokens per second over the batch's wall time, TTFT p50 and p90
(from each request's arrival, the moment it was added). The two kinds alternate over --rounds.

    python tests/gpu/engine/shared_prompts.py --model random:llama-1b --prompts 64 --n 4 --input-len 2048 \\
        --output-len 128 --rounds 2
"""

import argparse
import json
import random
import statistics
import time

from service.engine import EngineConfig, LLMEngine, SamplingParams


def batch(engine: LLMEngine, prompts: list[list[int]], n: int, output_len: int) -> dict:
    steps = []
    engine.observer = steps.append
    params = SamplingParams(max_tokens=output_len, temperature=1.0, ignore_eos=True)
    start = time.perf_counter()
    seqs = []
    for i, prompt in enumerate(prompts):
        seqs += engine.new_samples(f"r{time.monotonic_ns()}-{i}", prompt, params, start, n)
    for seq in seqs:
        engine.add_sequence(seq)
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    engine.observer = None
    ttft = sorted(s.timings.first_token - s.timings.arrival for s in seqs)
    out = sum(s.num_output_tokens for s in seqs)
    return {"prompts": len(prompts), "n": n, "requests": len(seqs),
            "prompt_tokens_computed": sum(s.prompt_tokens_computed for s in steps),
            "prompt_tokens_cached": sum(s.prompt_tokens_cached for s in steps),
            "output_tokens": out, "seconds": round(wall, 3), "output_tok_s": round(out / wall, 1),
            "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
            "ttft_p90_ms": round(1000 * ttft[int(0.9 * (len(ttft) - 1))], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-1b", help="the model (random weights: no download)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts of the shared batch")
    ap.add_argument("--n", type=int, default=4, help="samples of each prompt (the distinct batch has prompts x n)")
    ap.add_argument("--input-len", type=int, default=2048, help="tokens of every prompt")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens of every request (EOS ignored)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the engine's batch cap")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the two batches, alternating")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs))
    rng = random.Random(0)
    vocab = min(engine.vocab_size, 30000)
    fresh = lambda count: [[rng.randrange(5, vocab) for _ in range(args.input_len)] for _ in range(count)]
    batch(engine, fresh(8), 2, 8)  # warm-up: compiles and first launches out of the figures
    for r in range(args.rounds):
        for kind, prompts, n in (("shared", fresh(args.prompts), args.n),
                                 ("distinct", fresh(args.prompts * args.n), 1)):
            print(json.dumps({"round": r + 1, "kind": kind, "model": args.model, **batch(engine, prompts, n,
                                                                                            args.output_len)}),
                  flush=True)
    engine.close()


if __name__ == "__main__":
    main()
