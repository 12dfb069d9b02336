"""How much host memory a tensor-parallel rank needs to load its shard of a checkpoint: each rank's load in a process
of its own (the engine's own code: load_model with the rank's shard_model), every weight then read once (a
checkpoint's slices may stay memory-mapped until first read), against the same process loading the whole checkpoint
and slicing it. Prints each one's peak resident memory (VmHWM) over its resident memory before loading, and the
checkpoint's size. Runs on a CPU; no GPU needed.

    python3 tests/gpu/engine/shard_memory.py FOLDER --ranks 2 4
"""

import argparse
import multiprocessing
from pathlib import Path


def resident() -> float:
    """(VmHWM, VmRSS) in MiB."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmHWM", "VmRSS")))
    return int(fields["VmHWM"].split()[0]) / 1024


def load(folder: str, world: int, rank: int, whole: bool, out) -> None:
    import torch

    from service.engine import models
    from service.engine.parallel import shard_model
    before = resident()
    cpu = torch.device("cpu")
    if whole:
        model = models.load_model(folder, torch.float32, cpu).model
        shard_model(model, world, rank)
    else:
        model = models.load_model(folder, torch.float32, cpu, shard=lambda m: shard_model(m, world, rank)).model
    total = sum(float(p.float().sum()) for p in model.parameters())  # every weight read once
    out.put((before, resident(), sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20, total))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    args = ap.parse_args()
    size = sum(p.stat().st_size for p in Path(args.folder).glob("*.safetensors")) / 2**20
    print(f"checkpoint: {size:.0f} MiB of safetensors")
    ctx = multiprocessing.get_context("spawn")
    for world in args.ranks:
        for whole in (False, True):
            for rank in range(world):
                out = ctx.Queue()
                proc = ctx.Process(target=load, args=(args.folder, world, rank, whole, out))
                proc.start()
                before, peak, kept, _ = out.get()
                proc.join()
                how = "whole, then sliced" if whole else "its slices only"
                print(f"N={world} rank {rank}, {how}: peak {peak:.0f} MiB resident, {peak - before:.0f} MiB over the "
                      f"{before:.0f} before loading; it keeps {kept:.0f} MiB of weights", flush=True)


if __name__ == "__main__":
    main()
