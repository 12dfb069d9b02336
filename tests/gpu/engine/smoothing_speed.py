"""Smoothing costs nothing per step: the same W8A8 model with and without SmoothQuant's factors folded in, one engine
each, alternating, 256 x 128/128 (as `bench offline` runs them). Random weights are never smoothed when they load,
so here smoothing is applied by hand, calibrated on the tokenizer's text like a checkpoint's; the folded weights
then take the same kernels, the same number of them. Prints one JSON line per run and the medians' ratio.

    python tests/gpu/engine/smoothing_speed.py --model random:llama-1b --tokenizer $LLM_TEST_TOKENIZER
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from penalties import run  # noqa: E402  (the same timing of all requests at once)

from service.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from service.engine.models import load_model  # noqa: E402
from service.engine.quant import quantization, smoothing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-1b")
    ap.add_argument("--tokenizer", required=True, help="a tokenizer folder (the calibration text is text)")
    ap.add_argument("--quantization", default="int8-w8a8", choices=quantization.W8A8_MODES)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile the layers (a slower start)")
    args = ap.parse_args()
    device = torch.device("cuda")
    engines = {}
    for smoothed in (False, True):
        loaded = load_model(args.model, torch.bfloat16, device, tokenizer=args.tokenizer)
        if smoothed:
            chosen = smoothing.smooth(loaded.model, loaded.tokenizer, args.quantization)
            print(json.dumps({"places_smoothed": sum(c["alpha"] is not None for c in chosen),
                              "places": len(chosen)}), flush=True)
        quantization.quantize(loaded.model, args.quantization, device)
        loaded.quantization = args.quantization
        engines[smoothed] = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization,
                                                   max_num_seqs=args.requests, num_blocks=4400,
                                                   compile=args.compile), loaded=loaded)
    prompts = [[(7 * i + j) % 30000 + 5 for j in range(128)] for i in range(args.requests)]
    params = [SamplingParams(max_tokens=128, min_tokens=128, ignore_eos=True, temperature=0)] * args.requests
    for engine in engines.values():
        run(engine, prompts, params)  # warm-up
    figures = {False: [], True: []}
    for r in range(args.rounds):
        for smoothed, engine in engines.items():
            figures[smoothed].append(run(engine, prompts, params))
            print(json.dumps({"round": r + 1, "smoothed": smoothed, "output_tok_s": round(figures[smoothed][-1])}),
                  flush=True)
    medians = {k: statistics.median(v) for k, v in figures.items()}
    print(json.dumps({"model": args.model, "quantization": args.quantization, "plain_tok_s": round(medians[False]),
                      "smoothed_tok_s": round(medians[True]), "ratio": round(medians[True] / medians[False], 3)}))


if __name__ == "__main__":
    main()
