"""What the logit bias and the penalties cost: the same requests with and without them, on one engine, alternating.

As `bench offline` runs the engine (all requests at once, greedy, ignore_eos, timed from submission to the last
token), --requests x --input-len/--output-len; the edited requests each carry frequency_penalty and
presence_penalty 0.5 and --bias-entries logit_bias entries (random token ids, biases in [-5, 5]). Prints one JSON
line per run and a last one with each kind's median and their ratio.

    python tests/gpu/engine/penalties.py --model random:llama-1b --requests 256 --rounds 5
"""

import argparse
import json
import random
import statistics
import time

import torch

from service.engine import EngineConfig, LLMEngine, SamplingParams


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> float:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    while engine.has_unfinished():
        engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return sum(sp.max_tokens for sp in params) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-1b", help="the model (random weights: no download)")
    ap.add_argument("--requests", type=int, default=256, help="requests of each run, all at once")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens of each request")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens of each request")
    ap.add_argument("--bias-entries", type=int, default=10, help="logit_bias entries of each edited request")
    ap.add_argument("--rounds", type=int, default=5, help="runs of each kind, alternating")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.requests))
    rng = random.Random(0)
    vocab = min(engine.vocab_size, 30000)
    prompts = [[rng.randrange(5, vocab) for _ in range(args.input_len)] for _ in range(args.requests)]
    base = dict(max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True, temperature=0)
    plain = [SamplingParams(**base) for _ in prompts]
    edited = [SamplingParams(**base, frequency_penalty=0.5, presence_penalty=0.5,
                             logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(args.bias_entries)})
              for _ in prompts]
    run(engine, prompts, plain)  # warm-up: compiles and first launches out of the figures
    run(engine, prompts, edited)
    figures = {"plain": [], "edited": []}
    for r in range(args.rounds):
        for kind, params in (("plain", plain), ("edited", edited)):
            figures[kind].append(run(engine, prompts, params))
            print(json.dumps({"round": r + 1, "kind": kind, "output_tok_s": round(figures[kind][-1], 1)}), flush=True)
    medians = {k: statistics.median(v) for k, v in figures.items()}
    print(json.dumps({"model": args.model, "requests": args.requests, "bias_entries": args.bias_entries,
                      **{f"{k}_median_tok_s": round(v, 1) for k, v in medians.items()},
                      "ratio": round(medians["edited"] / medians["plain"], 3)}))
    engine.close()


if __name__ == "__main__":
    main()
