"""int8-w8a8's matmul on the GPU: the Triton kernel (service/engine/quant/triton_w8a8.py) against cuBLAS's
int8 matmul plus its rescale (the path before), bf16 and fp8-w8a8's `torch._scaled_mm`, on the linear layers of
random:llama-1b and random:llama-8b, each timed inside a CUDA graph (triton.testing.do_bench_cudagraph); and the
same kernel's weight-only int8 path (bf16 activations).

  python3 tests/gpu/kernels/int8_gemm.py            # the kernel's tile table against the others, and exactness
  python3 tests/gpu/kernels/int8_gemm.py --sweep    # also every candidate tile per row count: the table's source
  python3 tests/gpu/kernels/int8_gemm.py --fp8      # fp8-w8a8's `torch._scaled_mm`, sums carried in float32 or kept in the
                                            # tensor cores' accumulator (use_fast_accum), and how far each lies
                                            # from the float64 sum of the same codes

The activations' quantization is not in these times (it is the same for both int8 paths; fp8's is alike).
"""

import argparse
import itertools
import time

import torch
import triton
from triton.testing import do_bench_cudagraph

from service.engine.quant import triton_w8a8
from service.engine.quant.w8a8 import int8_mm, quantize_rows

SHAPES = {  # name: (K, N) of x [M, K] @ W.T, W [N, K]: the engine's layers (q, k, v fused; gate, up fused)
    "1b qkv": (2048, 3072), "1b o": (2048, 2048), "1b gate_up": (2048, 16384), "1b down": (8192, 2048),
    "8b qkv": (4096, 6144), "8b o": (4096, 4096), "8b gate_up": (4096, 28672), "8b down": (14336, 4096),
}
ROWS = [1, 16, 64, 256, 1024, 4096, 8192]
SWEPT = tuple(SHAPES)


def bench(fn) -> float:
    return do_bench_cudagraph(fn, rep=30) * 1000  # microseconds


def operands(rows: int, k: int, n: int, codes_dtype: torch.dtype):
    """x [rows, k] and w [n, k] in bf16, and each quantized per row (codes, scales; w's scales as [1, n])."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    wcodes, wscale = quantize_rows(w, codes_dtype)
    return x, w, quantize_rows(x, codes_dtype), (wcodes, wscale.reshape(1, -1).contiguous())


def candidates(rows):
    ms = [m for m in (16, 32, 64, 128) if m <= max(16, triton.next_power_of_2(rows))][-2:]
    return itertools.product(ms, (64, 128, 256), (128, 256), (4, 8), (3, 4))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-seconds", type=float, default=300)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of row counts")
    parser.add_argument("--fp8", action="store_true", help="only the fp8 accumulation table")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.fp8:
        return fp8_table([int(r) for r in args.rows.split(",")])
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print("| layer | rows | bf16 us | cuBLAS int8 + rescale us | Triton int8 us | fp8 us | Triton vs bf16 | exact "
          "| weight-only int8 us | vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    best = {}
    deadline = time.monotonic() + args.sweep_seconds
    rows_list = [int(r) for r in args.rows.split(",")]
    for (name, (k, n)), rows in itertools.product(SHAPES.items(), rows_list):
        x, w, (codes, scale), (wcodes, wscale) = operands(rows, k, n, torch.int8)
        exact = (int8_mm(codes, wcodes).float() * scale * wscale)
        ours = triton_w8a8.int8_scaled_mm(codes, scale, wcodes, wscale, torch.float32)
        same = torch.equal(ours, exact) and torch.equal(
            triton_w8a8.int8_scaled_mm(codes, scale, wcodes, wscale, torch.bfloat16), exact.bfloat16())
        t_bf16 = bench(lambda: x @ w.t())
        t_cublas = bench(lambda: (int8_mm(codes, wcodes).float() * scale * wscale).bfloat16())
        t_ours = bench(lambda: triton_w8a8.int8_scaled_mm(codes, scale, wcodes, wscale, torch.bfloat16))
        f8, f8s = quantize_rows(x, torch.float8_e4m3fn)
        w8, w8s = quantize_rows(w, torch.float8_e4m3fn)
        w8s = w8s.reshape(1, -1).contiguous()
        t_fp8 = bench(lambda: torch._scaled_mm(f8, w8.t(), scale_a=f8s, scale_b=w8s, out_dtype=torch.bfloat16)) \
            if rows > 0 else float("nan")
        t_wo = bench(lambda: triton_w8a8.int8_scaled_mm(x, None, wcodes, wscale, torch.bfloat16))
        print(f"| {name} | {rows} | {t_bf16:.1f} | {t_cublas:.1f} | {t_ours:.1f} | {t_fp8:.1f} | "
              f"{t_bf16 / t_ours:.2f}x | {same} | {t_wo:.1f} | {t_bf16 / t_wo:.2f}x |", flush=True)
        if args.sweep and name in SWEPT and time.monotonic() < deadline:
            timed = []
            for tile in candidates(rows):
                try:
                    timed.append((bench(lambda: triton_w8a8.int8_scaled_mm(
                        codes, scale, wcodes, wscale, torch.bfloat16, tile=tile)), tile))
                except Exception as error:  # noqa: BLE001 - tiles that exceed shared memory are skipped
                    if "OutOfResources" not in type(error).__name__ and "shared memory" not in str(error):
                        raise
            timed.sort()
            best[name, rows] = timed[:3]
            print(f"    sweep: best {[(round(t, 1), tile) for t, tile in timed[:3]]}", flush=True)
    if best:
        print("\nbest tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per row count, over the layers swept:")
        for rows in rows_list:
            tops = [(name, timed[0]) for (name, r), timed in best.items() if r == rows]
            for name, (t, tile) in tops:
                print(f"  rows {rows:5d} {name:12s} {t:8.1f} us {tile}")


def fp8_table(rows_list):
    """fp8 `_scaled_mm` with and without use_fast_accum: time, and the error against the float64 sum of the same
    codes, as a share of the sum of |terms| (what error_bound scales) and normwise (||out - exact|| / ||exact||)."""
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("| layer | rows | bf16 us | fp8 us | fp8 fast-accum us | fast vs fp8 | fast vs bf16 | max err / sum|terms|"
          " fp8, fast | normwise err fp8, fast |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, (k, n)), rows in itertools.product(SHAPES.items(), rows_list):
        x, w, (f8, f8s), (w8, w8s) = operands(rows, k, n, torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        exact = f8.double() @ w8.double().t()
        magnitude = f8.double().abs() @ w8.double().abs().t()
        errors = []
        for fast in (False, True):
            summed = torch._scaled_mm(f8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                      use_fast_accum=fast).double()
            errors.append(((summed - exact).abs() / magnitude).max().item())
            errors.append(((summed - exact).norm() / exact.norm()).item())
        t_bf16 = bench(lambda: x @ w.t())
        t_fp8, t_fast = (bench(lambda: torch._scaled_mm(f8, w8.t(), scale_a=f8s, scale_b=w8s, out_dtype=torch.bfloat16,
                                                        use_fast_accum=fast)) for fast in (False, True))
        print(f"| {name} | {rows} | {t_bf16:.1f} | {t_fp8:.1f} | {t_fast:.1f} | {t_fp8 / t_fast:.2f}x | "
              f"{t_bf16 / t_fast:.2f}x | {errors[0]:.1e}, {errors[2]:.1e} | {errors[1]:.1e}, {errors[3]:.1e} |",
              flush=True)


if __name__ == "__main__":
    main()
