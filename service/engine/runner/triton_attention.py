"""Triton kernel for attention over the paged KV cache, for any mix of prefill chunks and decode tokens.

One program handles one tile: up to BLOCK_M (query token, head) rows of one sequence that share a
KV head (grouped-query heads are packed into the rows, so a decode token still fills the matrix
units), and walks that sequence's context through its block table with an online softmax. The keys every row of
the tile sees (for a decode token, all but the last tile's) need no mask and go WIDE_N at a time; the rest,
masked, BLOCK_N at a time. The tiles come longest first (input_packing.build_tiles).

Decode steps split each sequence's context into up to SPLITS parts, one program each (a third grid dimension),
as flash-decoding does: one program per (sequence, KV head) is too few programs to fill the GPU at small batches,
and at large ones a mix of short and long contexts leaves the SMs that drew long ones working alone at the end.
Each part writes its normalised output and log-sum-exp and counts itself done (an atomic counter per sequence and
KV head); the last of a sequence's parts to finish combines them all, as split-K GEMMs do, where a second kernel
used to (2.3 us a layer for one sequence on an H100). A sequence short enough for one part writes its output
directly.

A step's new keys and values go into the cache first, one small kernel for both (two index_copy_ took 6.3 us a
layer at 256 tokens on the H100, this 1.9).
"""

import functools

import torch
import triton
import triton.language as tl

from service.engine import pdl
from service.engine.runner.attention import AttentionMetadata, cache_limit
from service.engine.runner.input_packing import LONG_PREFILL_ROWS


@triton.jit
def _attend_keys(acc, m_i, l_i, q, K, V, table, start, kv_end, q_pos, head_offset, stride_kb, stride_ks, d, d_ok,
                 scale, softcap, window, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys from `start` into the online softmax (acc, running max m_i, running sum l_i). Unless
    MASKED, every key of the tile is in the context and visible to every row."""
    n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = n < kv_end
        page = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        kv_ok = n_ok[:, None] & d_ok[None, :]
    else:
        page = tl.load(table + n // PAGE).to(tl.int64)
        kv_ok = d_ok[None, :]
    offs = page * stride_kb + (n % PAGE) * stride_ks + head_offset
    k = tl.load(K + offs[:, None] + d[None, :], mask=kv_ok, other=0.0).to(q.dtype)
    v = tl.load(V + offs[:, None] + d[None, :], mask=kv_ok, other=0.0).to(q.dtype)
    qk = _log2_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), scale, softcap, USE_SOFTCAP)
    if MASKED:
        ok = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            ok = ok & (n[None, :] > q_pos[:, None] - window)
        qk = tl.where(ok, qk, float("-inf"))
    return _online_softmax(acc, m_i, l_i, qk, v, PRECISION, True)


@triton.jit
def _log2_scores(qk, scale, softcap, USE_SOFTCAP: tl.constexpr):
    """Raw scores scaled (and softcapped) into the log2 domain: exp2 instead of exp."""
    if USE_SOFTCAP:
        qk = qk * scale / softcap
        qk = softcap * (2.0 * tl.sigmoid(2.0 * qk) - 1.0) * 1.4426950408889634
    else:
        qk = qk * (scale * 1.4426950408889634)
    return qk


@triton.jit
def _online_softmax(acc, m_i, l_i, qk, v, PRECISION: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """Scores qk (log2 domain) and their values into acc, the running maximum m_i and sum l_i. EMPTY_ROWS: a row may
    have seen no key yet (its maximum -inf), whose exponentials are then taken against 0."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if EMPTY_ROWS:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _kv_offsets(table, start, head_offset, stride_kb, stride_ks, PAGE: tl.constexpr, N: tl.constexpr):
    """Offsets into the caches of keys start .. start + N - 1 (all in the context), through the block table."""
    n = start + tl.arange(0, N)
    page = tl.load(table + n // PAGE).to(tl.int64)
    return page * stride_kb + (n % PAGE) * stride_ks + head_offset


@triton.jit
def _rotated(x, at, cos_at, sin_at, d, ok, HEAD_DIM: tl.constexpr):
    """x, loaded from the pointers `at` (each element's place, d its index in the head), turned by the rotary
    embedding: x * cos + rotate_half(x) * sin in float32, rotate_half's element d the one HEAD_DIM / 2 away, negated
    in the first half (Llama's apply_rotary_pos_emb). cos_at, sin_at: the pointers to each element's cosine and sine."""
    HALF: tl.constexpr = HEAD_DIM // 2
    partner = tl.load(at + tl.where(d < HALF, HALF, -HALF), mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_at, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_at, mask=ok, other=0.0).to(tl.float32)
    return x.to(tl.float32) * cos + tl.where(d < HALF, -partner, partner) * sin


@triton.jit
def _attend_keys_pipelined(acc, m_i, l_i, q, K, V, table, kv_start, kv_stop, head_offset, stride_kb, stride_ks, d,
                           d_ok, scale, softcap, PAGE: tl.constexpr, N: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                           PRECISION: tl.constexpr):
    """The unmasked tiles of keys [kv_start, kv_stop), N at a time, as _attend_keys reads them, but each tile's scores
    issued before the softmax of the tile before, so that the matrix units work while that softmax runs."""
    if kv_start < kv_stop:
        offs = _kv_offsets(table, kv_start, head_offset, stride_kb, stride_ks, PAGE, N)
        k = tl.load(K + offs[:, None] + d[None, :], mask=d_ok[None, :], other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        for start in range(kv_start + N, kv_stop, N):
            offs_next = _kv_offsets(table, start, head_offset, stride_kb, stride_ks, PAGE, N)
            k = tl.load(K + offs_next[:, None] + d[None, :], mask=d_ok[None, :], other=0.0).to(q.dtype)
            qk_next = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            v = tl.load(V + offs[:, None] + d[None, :], mask=d_ok[None, :], other=0.0).to(q.dtype)
            acc, m_i, l_i = _online_softmax(acc, m_i, l_i, _log2_scores(qk, scale, softcap, USE_SOFTCAP), v,
                                            PRECISION, False)
            qk, offs = qk_next, offs_next
        v = tl.load(V + offs[:, None] + d[None, :], mask=d_ok[None, :], other=0.0).to(q.dtype)
        acc, m_i, l_i = _online_softmax(acc, m_i, l_i, _log2_scores(qk, scale, softcap, USE_SOFTCAP), v, PRECISION,
                                        False)
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(
    Q, K, V, O, block_tables, table_rows, seq_lens, query_start_loc, tile_seq, tile_qstart,
    scale, softcap, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr,
    PART_O, PART_LSE, NUM_PARTS, COUNTS, SPLITS: tl.constexpr, MIN_TILES: tl.constexpr, USE_PDL: tl.constexpr,
    PIPELINE: tl.constexpr, TABLE_ROWS: tl.constexpr, COS, SIN, stride_rt, ROTARY: tl.constexpr,
):
    if USE_PDL:  # the kernel before has finished and its writes are visible (engine/pdl.py)
        tl.extra.cuda.gdc_wait()
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
    q_at = Q + (q_begin + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_at, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if ROTARY:  # the queries come unturned: turned here, rounded to their dtype as the model's own turn rounds them
        rot_at = (q_begin + tok)[:, None] * stride_rt + d[None, :]
        q = _rotated(q, q_at, COS + rot_at, SIN + rot_at, d[None, :], row_ok[:, None] & d_ok[None, :],
                     HEAD_DIM).to(Q.dtype.element_ty)
    if FP16_DOTS:  # an 8-bit cache: keys and values widen to float16 (one conversion), and queries with them
        q = q.to(tl.float16)
    q_pos = context + tok

    last_tok = tl.minimum(q_first + TOKENS, q_len) - 1
    kv_end = context + last_tok + 1
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context + q_first - window + 1, 0)
        kv_start = (kv_start // BLOCK_N) * BLOCK_N
    parts, split = 1, 0
    if SPLITS > 1:  # decode: this program's part of the context, whole tiles of keys, at least MIN_TILES each
        split = tl.program_id(2)
        tiles = tl.cdiv(kv_end - kv_start, BLOCK_N)
        per_part = tl.maximum(tl.cdiv(tiles, SPLITS), MIN_TILES)
        parts = tl.cdiv(tiles, per_part)
        if split >= parts:
            return
        if (split == 0) & (kv_head == 0):
            tl.store(NUM_PARTS + seq, parts)
        kv_start = kv_start + split * per_part * BLOCK_N
        kv_end = tl.minimum(kv_start + per_part * BLOCK_N, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys before the tile's first query token are visible to all its rows: whole tiles of them need no mask, and
    # go WIDE_N at a time (fewer, larger loads), the rest BLOCK_N at a time
    table_row = seq
    if TABLE_ROWS:  # (the decode graphs': each sequence keeps a row of the table while it runs)
        table_row = tl.load(table_rows + seq)
    table, head_offset = block_tables + table_row * stride_bt, kv_head * stride_kh
    visible = 0
    if not USE_WINDOW:
        visible = tl.maximum(tl.minimum(context + q_first + 1, kv_end) - kv_start, 0)
    wide_end = kv_start + visible // WIDE_N * WIDE_N
    full_end = kv_start + visible // BLOCK_N * BLOCK_N
    if PIPELINE:
        acc, m_i, l_i = _attend_keys_pipelined(acc, m_i, l_i, q, K, V, table, kv_start, wide_end, head_offset,
                                               stride_kb, stride_ks, d, d_ok, scale, softcap, PAGE, WIDE_N,
                                               USE_SOFTCAP, PRECISION)
    else:
        for start in range(kv_start, wide_end, WIDE_N):
            acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, K, V, table, start, kv_end, q_pos, head_offset,
                                         stride_kb, stride_ks, d, d_ok, scale, softcap, window, PAGE, WIDE_N, False,
                                         USE_WINDOW, USE_SOFTCAP, PRECISION)
    for start in range(wide_end, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, K, V, table, start, kv_end, q_pos, head_offset, stride_kb,
                                     stride_ks, d, d_ok, scale, softcap, window, PAGE, BLOCK_N, False, USE_WINDOW,
                                     USE_SOFTCAP, PRECISION)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, K, V, table, start, kv_end, q_pos, head_offset, stride_kb,
                                     stride_ks, d, d_ok, scale, softcap, window, PAGE, BLOCK_N, True, USE_WINDOW,
                                     USE_SOFTCAP, PRECISION)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ok = row_ok[:, None] & d_ok[None, :]
    last = parts == 1
    if parts > 1:  # (decode: token = sequence) a part in float32; the last part to finish combines them all
        base = (seq * tl.num_programs(1) * GROUP + head) * SPLITS
        tl.store(PART_O + (base + split)[:, None] * HEAD_DIM + d[None, :], out, mask=out_ok)
        tl.store(PART_LSE + base + split, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_i)), mask=row_ok)
        tl.debug_barrier()  # every thread's share of the part is written before the count says it is
        count = COUNTS + seq * tl.num_programs(1) + kv_head
        last = tl.atomic_add(count, 1, sem="acq_rel") == parts - 1
        if last:
            tl.store(count, 0)  # zero again for the next call
            out = _combine_parts(PART_O, PART_LSE, base, parts, row_ok, d, d_ok, HEAD_DIM, SPLITS, BLOCK_M, BLOCK_D)
    if last:
        tl.store(O + (q_begin + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=out_ok)


@triton.jit
def _combine_parts(PART_O, PART_LSE, base, parts, row_ok, d, d_ok, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rows' output from their parts, weighted by their log-sum-exps (log2 domain). The parts come from other
    programs, through L2 (.cg: never a stale line of this SM's L1)."""
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(PART_LSE + base + s, mask=row_ok & (s < parts), other=float("-inf"),
                                      cache_modifier=".cg"))
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for s in tl.static_range(SPLITS):
        ok = row_ok & (s < parts)
        w = tl.exp2(tl.load(PART_LSE + base + s, mask=ok, other=float("-inf"), cache_modifier=".cg") - top)
        w = tl.where(ok, w, 0.0)
        acc += w[:, None] * tl.load(PART_O + (base + s)[:, None] * HEAD_DIM + d[None, :],
                                    mask=ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
        total += w
    return acc / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit
def _write_kv_kernel(K, V, K_CACHE, V_CACHE, slots, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, COS, SIN, stride_rt,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, CLAMP: tl.constexpr, USE_PDL: tl.constexpr, ROTARY: tl.constexpr):
    """One token's keys and values (every KV head) into its cache slot, cast to the cache's dtype (clamped to
    +-CLAMP first unless it is 0: attention.cache_limit); with ROTARY, the keys turned by the rotary embedding
    first (rounded to their dtype, as the model's own turn rounds them)."""
    if USE_PDL:  # the kernel before has finished and its writes are visible (engine/pdl.py)
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < KV_HEADS) & (d < HEAD_DIM)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + h * stride_ch + d
    k_at = K + t * stride_kt + h * stride_kh + d
    k = tl.load(k_at, mask=ok)
    if ROTARY:
        rot_at = t * stride_rt + d + 0 * h  # (each head's row of pointers: a load's mask takes its pointers' shape)
        k = _rotated(k, k_at, COS + rot_at, SIN + rot_at, d, ok, HEAD_DIM).to(K.dtype.element_ty)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=ok)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if CLAMP > 0:
        k = tl.clamp(k.to(tl.float32), -CLAMP, CLAMP)
        v = tl.clamp(v.to(tl.float32), -CLAMP, CLAMP)
    tl.store(K_CACHE + dst, k.to(K_CACHE.dtype.element_ty), mask=ok)
    tl.store(V_CACHE + dst, v.to(V_CACHE.dtype.element_ty), mask=ok)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write keys and values [tokens, KV heads, head dim] into the caches' slots (token t into slots[t]); the
    caches in any layout whose head dim is contiguous (kv_cache.cache_tensor), both the same. `rotary`: (cos, sin)
    [tokens, head dim], which turn the keys first."""
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    cos, sin = _rotary_rows(rotary, k)
    page, kv_heads, head_dim = k_cache.shape[1:]
    _write_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos, sin, cos.stride(0), KV_HEADS=kv_heads,
        HEAD_DIM=head_dim, PAGE=page, BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), CLAMP=cache_limit(k_cache.dtype), ROTARY=rotary is not None,
        num_warps=2, **pdl.launch())


def _rotary_rows(rotary: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor):
    """The rotary embedding's (cos, sin) [tokens, head dim] as the kernels read them (each row contiguous, one stride
    for both); without one, x twice (pointers the kernels do not read)."""
    if rotary is None:
        return x, x
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in rotary)
    if cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def launch_config(block_m: int, head_dim: int, itemsize: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_N, WIDE_N, warps, stages) for a tile of block_m rows: keys per iteration (WIDE_N where no key of the
    iteration needs a mask), and the launch's warps and pipeline stages.

    tests/gpu/kernels/attention_sweep.py on the H100 (2026-11-27): prefill tiles took 2-6% less time with 64 keys an
    iteration than with 32 on six of eight packed-prompt shapes (1-3% more on 14 prompts of 188-991 tokens), and
    more with 128; decode with 128 keys took 4-8% less over the mixed workload's contexts (64-wide heads) but 6%
    more over 128/128's short ones, whose masked last tile is then most of the work: so decode reads the unmasked
    keys 128 at a time and the rest 64 (against the code before: 5-7% less over the mixed contexts, 2% more at
    128/128). Long prefill tiles (input_packing.block_m_for) take 128 keys an iteration with 8 warps, and pipeline
    their scores; of `itemsize`-byte queries: in float32, 64 keys and one stage (128 and two are over the shared
    memory)."""
    if block_m >= LONG_PREFILL_ROWS:
        return (128, 128, 8, 2) if itemsize <= 2 else (64, 64, 8, 1)
    return (64, 128, 4, 2) if block_m <= 16 else (64, 64, 4, 2)


# Decode splits (tests/gpu/kernels/decode_split_sweep.py on the H100, 2026-11-27, bf16, heads 32/8, 64 wide): 16 sequences
# over 1,500-2,040 tokens took 50.7 us unsplit and 29.9 us in 4 parts, one request over 600 tokens 11.6 and 7.4 us
# in 8; 128 sequences over 600-1,700 tokens 124.7 and 119.3 us in 4 (noise-sized); from 64 sequences over
# 900-2,000 tokens up no split was faster, and 256 over 100-1,100 tokens took 128.3 us unsplit, 137.2 us in 4
MAX_SPLITS, PROGRAMS_PER_SM, MIN_TILES = 8, 3, 2


_COUNTS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def _part_counts(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counters, zero, on `device`: how many parts of each (sequence, KV head) have finished. The
    last part sets its counter back to zero, so one buffer serves every call. A buffer outgrown stays allocated:
    a CUDA graph captured with it keeps using it."""
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < n:
        if counts is not None:
            _OUTGROWN.append(counts)
        counts = _COUNTS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return counts


@functools.cache
def _sm_count(device: int) -> int:
    """The device's streaming multiprocessors (asked once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_seqs: int, kv_heads: int) -> int:
    """Parts each sequence's context is split into at a decode step of num_seqs sequences: the fewest (a power of
    two, at most MAX_SPLITS) that give PROGRAMS_PER_SM programs per SM. A CUDA graph captured for a batch size
    keeps its choice; a sequence shorter than MIN_TILES tiles of keys per part uses fewer parts."""
    enough = PROGRAMS_PER_SM * _sm_count(torch.cuda.current_device())
    splits = 1
    while splits < MAX_SPLITS and num_seqs * kv_heads * splits < enough:
        splits *= 2
    return splits


def triton_paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None,
                           new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                           config: tuple[int, ...] | None = None, parts_out: list | None = None,
                           rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of the packed queries q [tokens, heads, head dim] over the paged cache, after writing `new_kv`
    into it, the queries and new keys turned by `rotary` where given (as attention.torch_paged_attention: there
    in passes of their own, here as the kernels read the queries and write the keys). `config` overrides
    launch_config and, for decode, the split:
    (BLOCK_N, WIDE_N, warps, stages[, splits, min tiles per part]). A list passed as `parts_out` receives the
    number of parts of each decode sequence's context (a tensor; tests)."""
    if new_kv is not None:
        write_kv(*new_kv, k_cache, v_cache, meta.slot_mapping, rotary)
    cos, sin = _rotary_rows(rotary, q)
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    num_seqs = meta.seq_lens.shape[0]
    out = torch.empty_like(q)
    config = config or launch_config(meta.block_m, head_dim, q.element_size())
    block_n, wide_n, warps, stages = config[:4]
    # decode: one token a sequence, token i of sequence i (a mixed graph of one token also holds an empty sequence)
    decode = meta.max_query_len == 1 and num_tokens == num_seqs
    splits, min_tiles = 1, MIN_TILES
    if decode:
        splits, min_tiles = config[4:6] if len(config) > 4 else (decode_splits(num_seqs, kv_heads), MIN_TILES)
    if splits > 1:
        part_o = torch.empty(num_seqs * num_heads * splits * head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs * num_heads * splits, dtype=torch.float32, device=q.device)
        num_parts = torch.empty(num_seqs, dtype=torch.int32, device=q.device)
        counts = _part_counts(q.device, num_seqs * kv_heads)
        if parts_out is not None:
            parts_out.append(num_parts)
    else:  # unused by the kernel without a split, but pointers all the same
        part_o = part_lse = num_parts = counts = out
    grid = (meta.tile_seq.shape[0], kv_heads, splits)
    block_d = triton.next_power_of_2(head_dim)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables,
        meta.table_rows if meta.table_rows is not None else meta.seq_lens,  # (unread without TABLE_ROWS)
        meta.seq_lens, meta.query_start_loc,
        meta.tile_seq, meta.tile_qstart,
        scale, float(softcap or 1.0), int(sliding_window or 0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=k_cache.shape[1],
        BLOCK_M=meta.block_m, BLOCK_N=block_n, WIDE_N=wide_n,
        USE_WINDOW=bool(sliding_window), USE_SOFTCAP=bool(softcap),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP16_DOTS=k_cache.element_size() == 1 and q.dtype != torch.float32,
        PART_O=part_o, PART_LSE=part_lse, NUM_PARTS=num_parts, COUNTS=counts, SPLITS=splits, MIN_TILES=min_tiles,
        PIPELINE=meta.block_m >= LONG_PREFILL_ROWS, TABLE_ROWS=meta.table_rows is not None, COS=cos, SIN=sin,
        stride_rt=cos.stride(0), ROTARY=rotary is not None, num_warps=warps,
        num_stages=stages, **pdl.launch(),
    )
    return out
