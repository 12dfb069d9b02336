"""Triton kernels for the 8-bit linear layers on CUDA (engine/quant/w8a8.py).

`int8_scaled_mm`: the matmul of int8 weights, one scale per output channel, rescaled in the kernel's epilogue:

- int8-w8a8: int8 activation codes times int8 weights, summed exactly in int32 on the tensor cores, then
  rescaled by token scale times channel scale in float32 (cuBLAS's int8 matmul, `torch._int_mm`, is no faster
  than bf16 on the H100 and leaves the rescale to another pass over an int32 product twice the output's size);
- weight-only int8: activations in bfloat16, float16 or float32, each weight tile widened to their dtype in
  registers (exactly: int8 fits every one), summed in float32, then rescaled by the channel scale. torch.compile
  sees one opaque op, so it never tunes an int8 matmul per prefill size (what stalled torchao's int8 under it).

One program computes one BLOCK_M x BLOCK_N tile of the output; programs are grouped along M so that tiles
sharing weight columns run together and reuse them from L2. Both operands are K-major (the codes [M, K] and the
weight [N, K] row-major), which Hopper's 8-bit tensor-core instructions require. Tile sizes come from a fixed
table by output size (no autotuning: it would time kernels inside a CUDA graph capture).

`silu_mul_quantize`: a W8A8 MLP's down-projection input, silu(gate) x up quantized per row, in one pass over the
gate and up halves of the fused projection's output (inductor made it two: a row maximum, then the codes).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from service.engine import pdl


@triton.jit
def _int8_scaled_mm_kernel(
    A, B, C, scale_a, scale_b, M, N, K,
    stride_am, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WEIGHT_ONLY: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # the kernel before has finished and its writes are visible (engine/pdl.py)
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_ptr = B + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N
    if WEIGHT_ONLY:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk < K - k * BLOCK_K
        a = tl.load(a_ptr, mask=m_ok & k_ok[None, :], other=0)
        b = tl.load(b_ptr, mask=n_ok & k_ok[:, None], other=0)
        if WEIGHT_ONLY:
            acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    sb = tl.load(scale_b + rn, mask=rn < N, other=0.0)
    out = acc.to(tl.float32)
    if not WEIGHT_ONLY:
        sa = tl.load(scale_a + rm, mask=rm < M, other=0.0)
        out = out * sa[:, None]
    out = out * sb[None, :]
    c_ptr = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptr, out.to(C.dtype.element_ty), mask=m_ok & n_ok)


WAVE = 128  # output tiles that keep an H100's 132 SMs busy once
FEW = 16  # the most rows that one tile's height holds: a decode step of a few sequences
SMALL = 64  # the most rows that get a tile of their own height


def tile_for(rows: int, n: int, weight_only: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for an output of rows x n, from sweeps on the H100
    (tests/gpu/kernels/int8_gemm.py --sweep, tests/gpu/kernels/int8_rows.py --sweep; docs/log/2026-11.md): up to 16
    rows, narrow tiles (32 outputs), so that even a 2,048-wide layer spreads its weights over 64 programs and more;
    up to 64 rows, tiles of their height and long steps along K; many rows, 128 x 128 tiles where those fill the
    GPU, 64 x 64 where they would not. Weight-only tiles past 16 rows take half the steps along K (their activations
    are twice the bytes)."""
    if rows <= FEW:
        return 16, 32, 256, 4, (4 if weight_only else 5)
    k_div = 2 if weight_only else 1
    if rows <= SMALL:
        return max(16, triton.next_power_of_2(rows)), 64, 256 // k_div, 4, 3
    if triton.cdiv(rows, 128) * triton.cdiv(n, 128) >= WAVE:
        return 128, 128, 128 // k_div, 8, 3
    return 64, 64, 256 // k_div, 4, 3


def int8_scaled_mm(codes: torch.Tensor, scale: torch.Tensor | None, weight: torch.Tensor,
                   weight_scale: torch.Tensor, out_dtype: torch.dtype,
                   tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """(codes [M, K] * scale [M, 1]) @ (weight [N, K] int8 * weight_scale [1, N]).T in out_dtype.

    int8 codes: the sums exact in int32, the rescale in float32. Activations in a float dtype with scale None
    (weight-only): the sums in float32 (float32 activations in full precision, not TF32). `tile` overrides the
    table (for measuring)."""
    rows, k = codes.shape
    n = weight.shape[0]
    assert codes.stride(1) == 1 and weight.stride(1) == 1, "both operands K-major"
    weight_only = codes.dtype != torch.int8
    assert weight_only == (scale is None), "int8 codes come with their scales, float activations without"
    out = torch.empty(rows, n, dtype=out_dtype, device=codes.device)
    if rows == 0:
        return out
    block_m, block_n, block_k, warps, stages = tile or tile_for(rows, n, weight_only)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)
    _int8_scaled_mm_kernel[grid](
        codes, weight, out, weight_scale if scale is None else scale, weight_scale, rows, n, k,
        codes.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, WEIGHT_ONLY=weight_only,
        PRECISION="ieee" if codes.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
        **pdl.launch())
    return out


MAX_ROW = 16384  # the widest row silu_mul_quantize holds in registers; wider rows take the caller's fallback


@triton.jit
def _silu_mul_quantize_kernel(H, Q, S, N, stride_h, stride_q, BLOCK: tl.constexpr, INT8: tl.constexpr,
                              USE_PDL: tl.constexpr):
    if USE_PDL:  # the kernel before has finished and its writes are visible (engine/pdl.py)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(H + row * stride_h + cols, mask=ok, other=0.0)
    up = tl.load(H + row * stride_h + N + cols, mask=ok, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # as eager code rounds: silu in float32 (expf and an IEEE division, as torch's kernel), rounded to the
    # activations' dtype, times up, rounded again
    g = gate.to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)).to(gate.dtype)
    x = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)
    if INT8:
        scale = amax * (1 / 127)
        inverse = (1.0 / scale.to(tl.float64)).to(tl.float32)
        codes = tl.minimum(tl.maximum(libdevice.rint(x * inverse), -127.0), 127.0).to(tl.int8)
    else:
        scale = amax * (1 / 448)
        inverse = (1.0 / scale.to(tl.float64)).to(tl.float32)
        codes = tl.minimum(tl.maximum(x * inverse, -448.0), 448.0).to(tl.float8e4nv)
    tl.store(Q + row * stride_q + cols, codes, mask=ok)
    tl.store(S + row, scale)


def silu_mul_quantize(h: torch.Tensor, codes_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, 2N] (gate, then up) -> (codes [M, N] of silu(gate) * up in codes_dtype, float32 scales [M, 1]), rounded
    as `w8a8.quantize_rows` rounds. N at most MAX_ROW."""
    rows, width = h.shape
    n = width // 2
    assert n <= MAX_ROW and h.stride(1) == 1
    codes = torch.empty(rows, n, dtype=codes_dtype, device=h.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=h.device)
    if rows:
        block = triton.next_power_of_2(n)
        _silu_mul_quantize_kernel[(rows,)](h, codes, scale, n, h.stride(0), codes.stride(0), BLOCK=block,
                                           INT8=codes_dtype == torch.int8, num_warps=min(16, max(4, block // 512)),
                                           **pdl.launch())
    return codes, scale
