"""On the H100 (device tool): the 1B decode step's matrix products at a few rows, 16 layers of them one after another
in one CUDA graph (distinct weights, so the L2 cache holds none from the step before), as cuBLAS runs them in bf16
and as the project's Triton GEMM (quant/triton_w8a8.py) runs them under programmatic dependent launch, with and
without asking the L2 cache for each launch's weights before it waits for the kernel before (PREFETCH_WEIGHTS):
bf16 weights (its weight-only path, unit scales), int8 weights with bf16 activations, and int8 x int8 (W8A8).
Each Triton output is checked bitwise against the same kernel without the prefetch first.

    source tests/gpu/env.sh; python3 tests/gpu/prefetch_chain.py [--rows 1,4,16]
"""

import argparse

import torch
import torch.nn.functional as F

from service.engine.quant import triton_w8a8
from service.engine.quant.w8a8 import quantize_rows

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
LAYERS = 16
dev = torch.device("cuda")


def step_us(calls) -> float:
    """Microseconds one pass over calls takes inside one CUDA graph, median of 5 timings of 20 replays."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 20)
    return sorted(times)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [{name: torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for name, (n, k) in SHAPES.items()}
              for _ in range(LAYERS)]
    quantized = [{name: quantize_rows(w, torch.int8) for name, w in layer.items()} for layer in layers]
    ones = {name: torch.ones(n, dtype=torch.float32, device=dev) for name, (n, _) in SHAPES.items()}
    bf16_bytes = sum(w.numel() * 2 for layer in layers for w in layer.values())
    for rows in map(int, args.rows.split(",")):
        xs = {name: torch.randn(rows, k, dtype=torch.bfloat16, device=dev) for name, (_, k) in SHAPES.items()}
        codes = {name: quantize_rows(x, torch.int8) for name, x in xs.items()}
        variants = {
            "cuBLAS bf16": lambda i, name: F.linear(xs[name], layers[i][name]),
            "Triton bf16 weights": lambda i, name: triton_w8a8.int8_scaled_mm(
                xs[name], None, layers[i][name], ones[name], torch.bfloat16),
            "Triton int8 weights, bf16 activations": lambda i, name: triton_w8a8.int8_scaled_mm(
                xs[name], None, quantized[i][name][0], quantized[i][name][1].view(-1), torch.bfloat16),
            "Triton W8A8": lambda i, name: triton_w8a8.int8_scaled_mm(
                codes[name][0], codes[name][1], quantized[i][name][0], quantized[i][name][1].view(-1),
                torch.bfloat16),
        }
        print(f"rows {rows}: 16 layers x (qkv, o, gate_up, down) in one graph; bf16 weights {bf16_bytes / 1e6:.0f} MB")
        for label, fn in variants.items():
            calls = [lambda i=i, name=name: fn(i, name) for i in range(LAYERS) for name in SHAPES]
            if label.startswith("cuBLAS"):
                print(f"  {label:40s} {step_us(calls):8.1f} us")
                continue
            results = {}
            for prefetch in (False, True, False, True):
                triton_w8a8.PREFETCH_WEIGHTS = prefetch
                out = [c() for c in calls[:4]]
                ref = results.setdefault("out", out)
                assert all(torch.equal(a, b) for a, b in zip(out, ref)), f"{label}: prefetch changed the output"
                results.setdefault(prefetch, []).append(step_us(calls))
            print(f"  {label:40s} {' '.join(f'{t:8.1f}' for t in results[False])} us without prefetch,"
                  f" {' '.join(f'{t:8.1f}' for t in results[True])} with")
        triton_w8a8.PREFETCH_WEIGHTS = True


if __name__ == "__main__":
    main()
