"""The decode step's matrix products in CUDA graphs, with a cold L2 as in the engine (16
distinct weights a shape, one per layer), through cuBLAS and cuBLASLt and through the project's Triton GEMM
(quant/triton_w8a8.py, bf16 weights, unit scales; the figures in docs/log/2026-11.md came from a plain copy of its
loop without the scales) at its best of a few tile configurations, for the 1B shape's rows 1 to 256 and the 8B
shape's 256. (Inductor's max-autotune tables favour Triton at these sizes, but they time each kernel alone with
its launch and a warm L2.)

    python3 tests/gpu/kernels/matmul_graphs.py
"""

import functools

import torch
import torch.nn.functional as F
import triton

from service.engine.quant.triton_w8a8 import int8_scaled_mm

dev = torch.device("cuda")


def triton_linear(x, w, tile):
    """x @ w.T through the project's Triton GEMM (quant/triton_w8a8.py) in its weight-only path with unit scales."""
    return int8_scaled_mm(x, None, w, ones(w.shape[0]), x.dtype, tile=tile)


@functools.cache
def ones(n):
    return torch.ones(n, dtype=torch.float32, device=dev)


CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages (GROUP_M 8)
    (16, 32, 256, 4, 4), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4),
    (32, 64, 128, 4, 4), (32, 128, 128, 4, 4),
    (64, 64, 128, 4, 5), (64, 128, 128, 4, 4), (64, 128, 64, 4, 3), (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 5), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3),
]
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048)}
SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def graph_us(fn, copies):
    """Microseconds a call of fn(i), i over range(copies), takes inside one CUDA graph (also tests/gpu/kernels/int8_rows.py)."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / 20 / copies


def run(shapes, ms, layers):
    for m in ms:
        totals = {"cublas": 0.0, "cublaslt": 0.0, "triton": 0.0}
        for name, (n, k) in shapes.items():
            copies = 2 if name == "lm_head" else 16
            count = 1 if name == "lm_head" else layers
            ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            ref = F.linear(x, ws[0]).float()
            row = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                row[lib] = graph_us(lambda i: F.linear(x, ws[i]), copies)
            torch.backends.cuda.preferred_blas_library("cublas")
            best = (float("inf"), None)
            for cfg in CONFIGS:
                if cfg[0] > max(16, triton.next_power_of_2(m)) * 2 or k % cfg[2]:
                    continue
                try:
                    err = (triton_linear(x, ws[0], cfg).float() - ref).abs().max().item()
                    assert err < 0.05, err
                    t = graph_us(lambda i: triton_linear(x, ws[i], cfg), copies)
                except Exception as exc:  # noqa: BLE001
                    print(f"    {cfg} failed: {str(exc).splitlines()[0][:100]}")
                    continue
                best = min(best, (t, cfg))
            row["triton"] = best[0]
            for key in totals:
                totals[key] += row[key] * count
            gb = n * k * 2 / 1e9
            print(f"  M {m:4d} {name:8s} cuBLAS {row['cublas']:7.1f} us ({gb / row['cublas'] * 1e3:4.2f} TB/s)  "
                  f"cuBLASLt {row['cublaslt']:7.1f}  triton {best[0]:7.1f} ({gb / best[0] * 1e3:4.2f} TB/s) {best[1]}")
            del ws
        print(f"  M {m:4d} step's products: " + ", ".join(f"{key} {v / 1000:.3f} ms" for key, v in totals.items()))


if __name__ == "__main__":
    print("1B shapes (16 layers)")
    run(SHAPES, (1, 16, 64, 144, 256), 16)
    print("8B shapes (32 layers; no head)")
    run(SHAPES_8B, (256,), 32)
