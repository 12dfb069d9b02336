"""On the H100 (device tool): the decode step's matrix products in CUDA graphs, with a cold L2 as in the engine (16
distinct weights a shape, one per layer), through cuBLAS and cuBLASLt and through a plain Triton kernel at its best
of a few tile configurations, for the 1B shape's rows 1 to 256 and the 8B shape's 256. (Inductor's max-autotune
tables favour Triton at these sizes, but they time each kernel alone with its launch and a warm L2.)

    source tests/gpu/env.sh; python3 tests/gpu/matmul_graphs.py
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

dev = torch.device("cuda")


@triton.jit
def _mm(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    xp = X + rm[:, None] * stride_xm + rk[None, :]
    wp = W + rn[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(xp, mask=rm[:, None] < M, other=0.0)
        w = tl.load(wp, mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        xp += BLOCK_K
        wp += BLOCK_K
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_linear(x, w, cfg):
    bm, bn, bk, gm, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _mm[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
              GROUP_M=gm, num_warps=warps, num_stages=stages)
    return y


CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages
    (16, 32, 256, 8, 4, 4), (16, 64, 128, 8, 4, 4), (16, 64, 256, 8, 4, 3), (16, 128, 128, 8, 4, 4),
    (32, 64, 128, 8, 4, 4), (32, 128, 128, 8, 4, 4),
    (64, 64, 128, 8, 4, 5), (64, 128, 128, 8, 4, 4), (64, 128, 64, 8, 4, 3), (64, 256, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 5), (128, 128, 64, 8, 4, 3), (128, 256, 64, 8, 8, 3),
]
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048)}
SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def graph_us(fn, copies):
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


print("1B shapes (16 layers)")
run(SHAPES, (1, 16, 64, 144, 256), 16)
print("8B shapes (32 layers; no head)")
run(SHAPES_8B, (256,), 32)
