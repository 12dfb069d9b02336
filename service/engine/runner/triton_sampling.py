"""Triton kernel for the greedy sampler's row maximum on CUDA (engine/runner/sampler.py).

`logits.max(-1)` gives each row to one block of 512 threads: a decode step of one sequence reads its 128,256 logits
on one SM, 28-41 us on the H100 (a step there takes 1.2-1.5 ms). Here each row is cut into CHUNK-wide chunks, one
program each, which write their maximum and its first index; a second kernel reduces each row's few chunk maxima.
"""

import torch
import triton
import triton.language as tl

from service.engine import pdl

CHUNK = 4096  # logits per program


@triton.jit
def _chunk_max_kernel(X, VALUES, INDICES, n, stride_x, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the kernel before has finished and its writes are visible (engine/pdl.py)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    top, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    # tl.max skips NaN, where torch's max returns it; and a row of NaN would leave its index undefined, which the
    # next step, launched before the NaN is read back, would take as a token id: the chunk's first column instead
    nan = tl.sum((x != x).to(tl.int32), axis=0) > 0
    out = row * tl.num_programs(1) + chunk
    tl.store(VALUES + out, tl.where(nan, float("nan"), top))
    tl.store(INDICES + out, chunk * BLOCK + tl.where(nan, 0, index).to(tl.int64))


@triton.jit
def _pick_kernel(VALUES, INDICES, TOP, TOKENS, chunks, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """A row's maximum over its chunks' maxima (NaN if one is NaN) and the first index of it."""
    if USE_PDL:  # the kernel before has finished and its writes are visible (engine/pdl.py)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < chunks
    v = tl.load(VALUES + row * chunks + c, mask=ok, other=float("-inf"))
    i = tl.load(INDICES + row * chunks + c, mask=ok, other=0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    nan = tl.sum((v != v).to(tl.int32), axis=0) > 0
    # chunks come in column order and each holds its first maximum, so the first chunk with the row's maximum
    # holds the row's first; a NaN row takes its first NaN chunk's index, which lies inside the vocabulary
    top, which = tl.max(tl.where(v != v, float("-inf"), v), axis=0, return_indices=True,
                        return_indices_tie_break_left=True)
    first_nan = tl.min(tl.where(v != v, c, BLOCK), axis=0)
    which = tl.where(nan, first_nan, which)
    tl.store(TOP + row, tl.where(nan, float("nan"), top))
    tl.store(TOKENS + row, tl.sum(tl.where(c == which, i, 0), axis=0))


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As `logits.max(-1)` for a [rows, vocab] CUDA tensor: each row's maximum (NaN if the row holds one), as float32,
    and the first index of it. Two kernels: the chunks' maxima, then each row's over them."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "each row contiguous"
    chunks = triton.cdiv(vocab, CHUNK)
    values = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    top = torch.empty(rows, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _chunk_max_kernel[(rows, chunks)](logits, values, indices, vocab, logits.stride(0), BLOCK=CHUNK,
                                          num_warps=8, **pdl.launch())
        _pick_kernel[(rows,)](values, indices, top, tokens, chunks, BLOCK=triton.next_power_of_2(chunks),
                              num_warps=1, **pdl.launch())
    return top, tokens
