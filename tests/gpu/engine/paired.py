"""This checkout's engine against an older commit's, both in one process, their runs alternating and paired: the
batches of the grammars benchmark (grammars.py), by kind (plain, some, all, all-16).

Where the host bounds a step (constrained steps), runs in separate processes moved with the host by more than a
change's effect: one call ran the same code at 1.275x and 1.154x, the code before it at 1.301x and 1.044x. Here each
round runs every kind on both engines back to back (the engines' order and the kinds' reversed every other round),
and each figure is a median over the rounds: a kind's step time over the same engine's plain run of that round, and
this code's step time over the older's, kind by kind (the step time as grammars.py takes it: the median over the
steps with every request running).

The older code is a copy of its service/ in .base, as for `tests/gpu/run.sh ab` (made where git is); it is imported
as `base_service`: a copy with its imports renamed and the names it registers for the whole process (the attention
implementation, the torch custom ops) prefixed. What belongs to the process and not to a package stays shared: Python's
switch interval (an engine lowers it once grammars are in use) and tvm-ffi's GIL settings on xgrammar's functions
(whichever code builds its compiler last sets them). Each engine's KV cache holds its batch and little more.

    rm -rf .base && mkdir .base && git archive COMMIT service | tar -x -C .base
    python tests/gpu/engine/paired.py --model random:llama-1b --tokenizer $LLM_TEST_TOKENIZER [--kinds plain,all]
"""

import argparse
import importlib
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from grammars import kinds, run  # noqa: E402

BASE = "base_service"  # the older code's package name here


def base_package(base: Path, into: Path) -> None:
    """`base`/service copied into `into` as BASE, its imports and process-wide names changed to its own."""
    shutil.copytree(base / "service", into / BASE, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for path in (into / BASE).rglob("*.py"):
        text = re.sub(r"\b(from|import) service([. ])", rf"\1 {BASE}\2", path.read_text())
        text = text.replace('"service.', f'"{BASE}.').replace('"service_paged"', f'"{BASE}_paged"')
        path.write_text(text.replace('"llm_service::', f'"{BASE}::'))


def engine(package: str, args, blocks: int):
    """An engine of `package` (service or BASE) as the engine process runs it (bare rows, no text), and its
    modules."""
    code = importlib.import_module(f"{package}.engine")
    detokenizer = importlib.import_module(f"{package}.engine.detokenizer")
    structured = importlib.import_module(f"{package}.engine.structured")
    e = code.LLMEngine(code.EngineConfig(model=args.model, tokenizer=args.tokenizer, max_num_seqs=args.requests,
                                         num_blocks=blocks))
    e.rows, e.detokenizer = True, detokenizer.Detokenizer(None)
    return e, kinds(args.requests, args.some, args.output_len, code.SamplingParams, structured.StructuredOutput)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=".base", help="the folder holding the older code's service/")
    ap.add_argument("--model", default="random:llama-1b", help="the model (random weights need --tokenizer)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder for random: weights")
    ap.add_argument("--kinds", default="plain,some,all", help="the kinds to run, plain first (of plain, some, all, "
                                                              "all-16)")
    ap.add_argument("--requests", type=int, default=256, help="requests of each run, all at once")
    ap.add_argument("--some", type=int, default=32, help="constrained requests of the 'some' kind")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens of each request")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens of each request")
    ap.add_argument("--rounds", type=int, default=10, help="rounds, each every kind on both engines")
    args = ap.parse_args()
    names = args.kinds.split(",")
    if names[0] != "plain":
        ap.error("--kinds starts with plain: the other kinds are figured against it")
    with tempfile.TemporaryDirectory() as folder:  # (the older code's modules load from it until the end)
        base_package(Path(args.base), Path(folder))
        sys.path.insert(0, folder)
        print(json.dumps(compare(args, names)))


def compare(args, names: list[str]) -> dict:
    block_size = importlib.import_module("service.engine").EngineConfig().block_size
    blocks = args.requests * -(-(args.input_len + args.output_len + 1) // block_size) + 64
    engines = {"new": engine("service", args, blocks), "base": engine(BASE, args, blocks)}
    rng = random.Random(0)
    vocab = engines["new"][0].vocab_size
    prompts = [[rng.randrange(100, min(vocab, 30000)) for _ in range(args.input_len)] for _ in range(args.requests)]
    for e, by_kind in engines.values():  # warm-up: compiles, graphs and grammars out of the figures
        for kind in names:
            run(e, prompts, by_kind[kind])
    steps = {(code, kind): [] for code in engines for kind in names}
    masks = {(code, kind): [] for code in engines for kind in names}
    for r in range(args.rounds):
        for code in list(engines)[::1 if r % 2 == 0 else -1]:
            e, by_kind = engines[code]
            for kind in names[::1 if r % 2 == 0 else -1]:
                out = run(e, prompts, by_kind[kind])
                steps[code, kind].append(out["step_ms"])
                masks[code, kind].append(out["mask_ms"])
        print(json.dumps({"round": r + 1, **{f"{code}_{kind}_ms": round(v[-1], 3) for (code, kind), v in steps.items()
                                             if v[-1] is not None}}), flush=True)
    summary = {"model": args.model, "requests": args.requests, "rounds": args.rounds,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "engines": {code: type(e).__module__ for code, (e, _) in engines.items()}}

    def median(values) -> float | None:
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None
    for code in engines:
        summary[f"{code}_plain_ms"] = median(steps[code, "plain"])
        for kind in names[1:]:
            ratios = [x / p for x, p in zip(steps[code, kind], steps[code, "plain"]) if x and p]
            summary[f"{code}_{kind}_ratio"] = median(ratios)
            summary[f"{code}_{kind}_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None
            summary[f"{code}_{kind}_mask_ms"] = median(masks[code, kind])
    for kind in names:
        summary[f"new_over_base_{kind}"] = median(x / b for x, b in zip(steps["new", kind], steps["base", kind])
                                                  if x and b)
    for e, _ in engines.values():
        e.close()
    return summary


if __name__ == "__main__":
    main()
