"""Where the engine process's loop spends its time, from py-spy's collapsed stacks (`serving.sh profile` writes them:
py-spy record --subprocesses --idle --format raw): the samples under `EngineCore.run`, by the part of the step they
fall in (the first rule below whose frame a stack holds), as shares of the loop's samples.

    python3 tests/gpu/serving/stacks.py gpu-results/serving-.../profile.txt
"""

import collections
import sys

# (part, a frame's function name that puts a sample in it), the first match wins: the device wait before the
# host work that contains it
PARTS = [
    ("waiting for the device (the step's tokens)", "Event.synchronize"),
    ("forward: eager steps (prefill chunks past the graphs)", "ModelRunner._eager"),
    ("forward: decode graph inputs and replay", "DecodeGraphs.replay"),
    ("forward: mixed graph inputs and replay", "MixedGraphs.replay"),
    ("forward: the rest (rows that sample)", "ModelRunner.forward"),
    ("sampler launch", "ModelRunner.sample"),
    ("masks of constrained rows", "Grammars."),
    ("read-back: postprocess (tokens, blocks, stops)", "Scheduler.postprocess"),
    ("read-back: the rest (outputs, metrics)", "LLMEngine._read_back"),
    ("scheduling", "Scheduler.schedule"),
    ("the step's other work", "LLMEngine.step"),
    ("front ends: receiving", "EngineCore._drain"),
    ("front ends: sending", "EngineCore._publish"),
    ("idle (waiting for requests)", "EngineCore._idle"),
    ("the loop itself", "EngineCore.run"),
]


def main() -> None:
    parts = collections.Counter()
    for line in open(sys.argv[1]):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = [f.split(" (")[0] for f in stack.split(";")]
        if "EngineCore.run" not in frames:
            continue
        part = next(name for name, fn in PARTS if any(f.startswith(fn) for f in frames))
        parts[part] += int(count)
    total = sum(parts.values())
    print(f"{total} samples of the engine loop")
    for name, _ in PARTS:
        if parts[name]:
            print(f"{100 * parts[name] / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
