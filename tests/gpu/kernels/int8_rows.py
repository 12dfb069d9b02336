"""The 8-bit kernel at few rows on the GPU (one request's and small batches' decode steps): the tiled
Triton kernel (quant/triton_w8a8.py) in its weight-only int8 and int8-w8a8 paths against cuBLAS bf16, on the linear
layers of random:llama-1b and random:llama-8b. Each product is timed in a CUDA graph over 16 distinct weights (one
per layer: the L2 cache holds none of them, as in the engine; `int8_gemm.py` times one weight, warm in L2).

  python3 tests/gpu/kernels/int8_rows.py [--sweep] [--rows 1,4,16,64] [--json rows.json]

--sweep times every candidate tile per row count (the source of `tile_for`'s few-row entries).
"""

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from matmul_graphs import graph_us  # a sibling script: python3 puts this folder on the path
from service.engine.quant import triton_w8a8
from service.engine.quant.w8a8 import quantize_rows

SHAPES = {  # name: (N, K) of x [M, K] @ W.T, W [N, K]: the engine's layers (q, k, v fused; gate, up fused)
    "1b qkv": (3072, 2048), "1b o": (2048, 2048), "1b gate_up": (16384, 2048), "1b down": (2048, 8192),
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
}
LAYERS = {"1b": 16, "8b": 32}
COPIES = 16


def candidates(rows):
    block_m = max(16, triton.next_power_of_2(rows))
    return [(block_m, n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (2, 4), (3, 4, 5))]


def timed(run, ref, tile) -> float:
    """run(i, tile)'s time, after checking its result against ref; inf for a tile over the GPU's resources."""
    try:
        out = run(0, tile).float()
        assert (out - ref).abs().max().item() <= 2e-2 * ref.abs().max().item(), f"wrong result with {tile}"
        return graph_us(lambda i: run(i, tile), COPIES)
    except Exception as error:  # noqa: BLE001
        if "OutOfResources" in type(error).__name__ or "shared memory" in str(error):
            return float("inf")
        raise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", help="write every timing here")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    record, totals = [], {}
    for (name, (n, k)), rows in itertools.product(SHAPES.items(), [int(r) for r in args.rows.split(",")]):
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(COPIES)]
        qs = [quantize_rows(w, torch.int8) for w in ws]
        qs = [(c, s.reshape(1, -1).contiguous()) for c, s in qs]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        codes, scale = quantize_rows(x, torch.int8)
        paths = {  # path: (run(i, tile), its reference)
            "weight-only": (lambda i, tile: triton_w8a8.int8_scaled_mm(x, None, *qs[i], torch.bfloat16, tile=tile),
                            x.float() @ (qs[0][0].float() * qs[0][1].t()).t()),
            "w8a8": (lambda i, tile: triton_w8a8.int8_scaled_mm(codes, scale, *qs[i], torch.bfloat16, tile=tile),
                     (codes.float() * scale) @ (qs[0][0].float() * qs[0][1].t()).t()),
        }
        t_bf16 = graph_us(lambda i: F.linear(x, ws[i]), COPIES)
        line = f"{name:11s} rows {rows:3d}: bf16 {t_bf16:6.1f} us ({2 * n * k / t_bf16 / 1e6:4.2f} TB/s)"
        sums = totals.setdefault((name.split()[0], rows), {})
        sums["bf16"] = sums.get("bf16", 0.0) + t_bf16 * LAYERS[name.split()[0]]
        for path, (run, ref) in paths.items():
            table = triton_w8a8.tile_for(rows, n, weight_only=path == "weight-only")
            t_table = timed(run, ref, table)
            line += f"  {path} {t_table:6.1f} ({n * k / t_table / 1e6:4.2f})"
            sums[path] = sums.get(path, 0.0) + t_table * LAYERS[name.split()[0]]
            entry = {"shape": name, "rows": rows, "path": path, "table": [t_table, table], "bf16": t_bf16}
            if args.sweep:
                entry["sweep"] = sorted((timed(run, ref, tile), tile) for tile in candidates(rows))
                best = entry["sweep"][0]
                line += f" best {best[0]:6.1f} {best[1]}"
                sums[path + " best"] = sums.get(path + " best", 0.0) + best[0] * LAYERS[name.split()[0]]
            record.append(entry)
        print(line, flush=True)
        del ws, qs
    print("\nthe step's linear layers (no output projection), ms:")
    for (model, rows), sums in totals.items():
        print(f"  {model} rows {rows:3d}: " + ", ".join(f"{key} {v / 1000:.3f}" for key, v in sums.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
