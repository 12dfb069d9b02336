"""Triton kernel for attention over the paged KV cache, for any mix of prefill chunks and decode tokens.

One program handles one tile: up to BLOCK_M (query token, head) rows of one sequence that share a
KV head (grouped-query heads are packed into the rows, so a decode token still fills the matrix
units), and walks that sequence's context through its block table with an online softmax.
"""

import torch
import triton
import triton.language as tl

from service.engine.runner.attention import AttentionMetadata


@triton.jit
def _paged_attention_kernel(
    Q, K, V, O, block_tables, seq_lens, query_start_loc, tile_seq, tile_qstart,
    scale, softcap, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq + tile)
    q_first = tl.load(tile_qstart + tile)
    q_begin = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_begin
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len  # position of the sequence's first query token

    TOKENS: tl.constexpr = BLOCK_M // GROUP
    rows = tl.arange(0, BLOCK_M)
    tok = q_first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + (q_begin + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context + tok

    last_tok = tl.minimum(q_first + TOKENS, q_len) - 1
    kv_end = context + last_tok + 1
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context + q_first - window + 1, 0)
        kv_start = (kv_start // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 instead of exp
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        page = tl.load(block_tables + seq * stride_bt + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        offs = page * stride_kb + (n % PAGE) * stride_ks + kv_head * stride_kh
        k = tl.load(K + offs[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + offs[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if USE_SOFTCAP:
            qk = qk * scale / softcap
            qk = softcap * (2.0 * tl.sigmoid(2.0 * qk) - 1.0) * 1.4426950408889634
        else:
            qk = qk * qk_scale
        ok = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            ok = ok & (n[None, :] > q_pos[:, None] - window)
        qk = tl.where(ok, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + (q_begin + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def launch_config(block_m: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages) for a tile of block_m rows: keys per iteration, and the launch's warps and
    pipeline stages.

    A sweep on the H100 (tests/gpu/attention_sweep.py, 2026-11-26) found decode tiles of 64-wide heads 5-8% faster
    alone with 32 keys, 2 warps and 3 stages at batch 256 over 512-2,048 tokens, but the engine ran 128/128 x 256
    slower with them (59,821 and 52,880 output tok/s against 72,324 in one call, one run each), so these stay."""
    return (64 if block_m <= 16 else 32), 4, 2


def triton_paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None,
                           config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Attention of the packed queries q [tokens, heads, head dim] over the paged cache; `config` overrides
    launch_config (for a sweep)."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    grid = (meta.tile_seq.shape[0], kv_heads)
    block_n, warps, stages = config or launch_config(meta.block_m, head_dim)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        meta.tile_seq, meta.tile_qstart,
        scale, float(softcap or 1.0), int(sliding_window or 0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), PAGE=k_cache.shape[1],
        BLOCK_M=meta.block_m, BLOCK_N=block_n,
        USE_WINDOW=bool(sliding_window), USE_SOFTCAP=bool(softcap),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )
    return out
