"""Triton kernels of the sampler on CUDA (engine/runner/sampler.py): the greedy row maximum, the logit edits, and
the grammars' token masks.

`logits.max(-1)` gives each row to one block of 512 threads: a decode step of one sequence reads its 128,256 logits
on one SM, 28-41 us on the H100 (a step there takes 1.2-1.5 ms). Here each row is cut into CHUNK-wide chunks, one
program each, which write their maximum and its first index; a second kernel reduces each row's few chunk maxima.
In a greedy step whose rows carry a bias or penalties, or grammars' token masks, the same two kernels apply them as
they read the logits and count the chosen tokens (`row_max(logits, edits, masks)`): no launch of their own, and the
edited logits are never stored.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from service.engine import pdl

CHUNK = 4096  # logits per program


@triton.jit
def _edited(x, cols, ok, slot, COUNTS, stride_c, IN_PROMPT, stride_p, VALUES, BIAS_IDS, BIAS_VALUES, stride_b, width,
            PENALTIES: tl.constexpr, REPETITION: tl.constexpr):
    """A row's logits `x` (float32, at `cols`) after its slot's bias entries, then the repetition penalty on tokens of
    its prompt or output, then frequency and presence over its output counts (engine/runner/logit_edits.py's torch
    rules, fused). A -inf logit stays -inf."""
    for j in range(width):  # padding entries are token 0 with bias 0
        token = tl.load(BIAS_IDS + slot * stride_b + j)
        x = tl.where(cols == token, x + tl.load(BIAS_VALUES + slot * stride_b + j), x)
    if PENALTIES:
        c = tl.load(COUNTS + slot * stride_c + cols, mask=ok, other=0).to(tl.float32)
        seen = c > 0
        if REPETITION:
            repetition = tl.load(VALUES + slot * 3 + 2)
            mine = seen | (tl.load(IN_PROMPT + slot * stride_p + cols, mask=ok, other=0) != 0)
            scale = tl.where(mine, repetition, 1.0)
            x = tl.where(x > 0, x / scale, x * scale)
        x = x - tl.load(VALUES + slot * 3 + 1) * c - tl.where(seen, tl.load(VALUES + slot * 3), 0.0)
    return x


@triton.jit
def _chunk_max_kernel(X, VALUES, INDICES, n, stride_x, SLOTS, COUNTS, stride_c, IN_PROMPT, stride_p, EDIT_VALUES,
                      BIAS_IDS, BIAS_VALUES, stride_b, width, MASK_ROWS, MASK, words, BLOCK: tl.constexpr,
                      USE_PDL: tl.constexpr, EDITS: tl.constexpr, PENALTIES: tl.constexpr, REPETITION: tl.constexpr,
                      MASKED: tl.constexpr):
    """Each chunk's maximum and its first index; with EDITS, of the logits as edited for rows whose slot
    (SLOTS[row]) is not -1; with MASKED, -inf where the bitmask row MASK_ROWS[row] (unless -1) has a 0 bit."""
    if USE_PDL:  # the kernel before has finished and its writes are visible (engine/pdl.py)
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    if EDITS:
        slot = tl.load(SLOTS + row)
        if slot >= 0:
            x = _edited(x, cols, cols < n, slot, COUNTS, stride_c, IN_PROMPT, stride_p, EDIT_VALUES, BIAS_IDS,
                        BIAS_VALUES, stride_b, width, PENALTIES, REPETITION)
    if MASKED:  # (after the edits: they keep -inf as it is, so the order makes no difference)
        m = tl.load(MASK_ROWS + row)
        if m >= 0:
            word = tl.load(MASK + m * words + cols // 32, mask=cols < n, other=0)
            x = tl.where(((word >> (cols % 32)) & 1) == 0, float("-inf"), x)
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
def _pick_kernel(VALUES, INDICES, TOP, TOKENS, chunks, SLOTS, COUNTS, stride_c, BLOCK: tl.constexpr,
                 USE_PDL: tl.constexpr, RECORD: tl.constexpr):
    """A row's maximum over its chunks' maxima (NaN if one is NaN) and the first index of it; with RECORD, that
    token joins the output counts of the row's slot (SLOTS[row], -1 for none)."""
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
    token = tl.sum(tl.where(c == which, i, 0), axis=0)
    tl.store(TOP + row, tl.where(nan, float("nan"), top))
    tl.store(TOKENS + row, token)
    if RECORD:
        slot = tl.load(SLOTS + row)
        tl.atomic_add(COUNTS + slot * stride_c + token, 1, mask=slot >= 0)


class Fused(NamedTuple):
    """What `row_max` needs to edit rows as it reads them (engine/runner/logit_edits.py's slots): each row's slot or
    -1 (`slots`, [rows] int64), the slots' state, the most bias entries of a row (`width`), whether any row has
    penalties (and then the chosen tokens are counted) and whether any has a repetition penalty."""
    slots: torch.Tensor
    counts: torch.Tensor
    in_prompt: torch.Tensor
    values: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    width: int
    penalties: bool
    repetition: bool


def row_max(logits: torch.Tensor, edits: Fused | None = None,
            masks: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As `logits.max(-1)` for a [rows, vocab] CUDA tensor: each row's maximum (NaN if the row holds one), as float32,
    and the first index of it. Two kernels: the chunks' maxima, then each row's over them. With `edits`, of the
    logits as their rows' bias and penalties edit them (computed in float32, `logits` left as they are), and the
    chosen tokens of penalized rows counted. With `masks` (each row's row of the bitmask or -1, [rows] int64; the
    grammars' bitmask, [masked rows, words] int32), of the logits with -inf where the row's bits are 0, as `mask`
    would leave them (a NaN there is not seen)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "each row contiguous"
    chunks = triton.cdiv(vocab, CHUNK)
    values = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    top = torch.empty(rows, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        if edits is None:  # unused pointers: any tensor
            slots = counts = in_prompt = edit_values = bias_ids = bias_values = values
            stride_c = stride_p = stride_b = width = 0
            record = False
        else:
            slots, counts, in_prompt, edit_values, bias_ids, bias_values = edits[:6]
            assert counts.stride(1) == in_prompt.stride(1) == 1 and edit_values.is_contiguous() and len(slots) == rows
            assert bias_ids.stride() == bias_values.stride()
            stride_c, stride_p, stride_b, width = counts.stride(0), in_prompt.stride(0), bias_ids.stride(0), edits.width
            record = edits.penalties
        mask_rows, bitmask = masks if masks is not None else (values, values)
        if masks is not None:
            assert len(mask_rows) == rows and bitmask.is_contiguous() and bitmask.dtype == torch.int32
        _chunk_max_kernel[(rows, chunks)](
            logits, values, indices, vocab, logits.stride(0), slots, counts, stride_c, in_prompt, stride_p,
            edit_values, bias_ids, bias_values, stride_b, width, mask_rows, bitmask, bitmask.shape[1], BLOCK=CHUNK,
            num_warps=8, EDITS=edits is not None, PENALTIES=record, REPETITION=edits is not None and edits.repetition,
            MASKED=masks is not None, **pdl.launch())
        _pick_kernel[(rows,)](values, indices, top, tokens, chunks, slots, counts, stride_c,
                              BLOCK=triton.next_power_of_2(chunks), num_warps=1, RECORD=record, **pdl.launch())
    return top, tokens


EDIT_BLOCK = 2048  # logits per program of the edit kernel


@triton.jit
def _edit_kernel(LOGITS, stride_l, ROWS, SLOTS, COUNTS, stride_c, IN_PROMPT, stride_p, VALUES, BIAS_IDS, BIAS_VALUES,
                 stride_b, width, n, BLOCK: tl.constexpr, PENALTIES: tl.constexpr, REPETITION: tl.constexpr):
    """One pass over a row's logits, written back edited (`_edited`)."""
    i = tl.program_id(0)
    row = tl.load(ROWS + i)
    slot = tl.load(SLOTS + i)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(LOGITS + row * stride_l + cols, mask=ok, other=0.0).to(tl.float32)
    x = _edited(x, cols, ok, slot, COUNTS, stride_c, IN_PROMPT, stride_p, VALUES, BIAS_IDS, BIAS_VALUES, stride_b,
                width, PENALTIES, REPETITION)
    tl.store(LOGITS + row * stride_l + cols, x.to(LOGITS.dtype.element_ty), mask=ok)


def edit(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
         in_prompt: torch.Tensor, values: torch.Tensor, bias_ids: torch.Tensor, bias_values: torch.Tensor,
         width: int, penalties: bool, repetition: bool) -> None:
    """In place on `logits` [batch, vocab] (float32, or the model's dtype for greedy rows; computed in float32) at
    `rows`, each with its slot's state: the first `width` bias
    entries (`bias_ids`, `bias_values`), and with `penalties` the output `counts`, prompt tokens `in_prompt` and
    (presence, frequency, repetition) `values`."""
    vocab = logits.shape[1]
    assert logits.stride(1) == counts.stride(1) == in_prompt.stride(1) == 1 and values.is_contiguous()
    assert bias_ids.stride() == bias_values.stride()
    if len(rows):
        _edit_kernel[(len(rows), triton.cdiv(vocab, EDIT_BLOCK))](
            logits, logits.stride(0), rows, slots, counts, counts.stride(0), in_prompt, in_prompt.stride(0), values,
            bias_ids, bias_values, bias_ids.stride(0), width, vocab, BLOCK=EDIT_BLOCK, PENALTIES=penalties,
            REPETITION=repetition, num_warps=4)


@triton.jit
def _record_kernel(TOKENS, ROWS, SLOTS, COUNTS, stride_c, rows, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ok = i < rows
    slot = tl.load(SLOTS + i, mask=ok, other=0)
    token = tl.load(TOKENS + tl.load(ROWS + i, mask=ok, other=0), mask=ok, other=0)
    tl.atomic_add(COUNTS + slot * stride_c + token, 1, mask=ok)


def record(tokens: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor) -> None:
    """The sampled `tokens` of `rows` join their slots' output `counts`, in one launch (torch's gather and index_add
    are two, and twice the host time)."""
    if len(rows):
        _record_kernel[(1,)](tokens, rows, slots, counts, counts.stride(0), len(rows),
                             BLOCK=max(16, triton.next_power_of_2(len(rows))), num_warps=4)


MASK_BLOCK = 4096  # logits per program of the mask kernel


@triton.jit
def _mask_kernel(LOGITS, stride_l, ROWS, MASK, words, n, BLOCK: tl.constexpr):
    """-inf where a row's bitmask has a 0 bit (bit t of word t // 32: token t); other logits are not even read."""
    i = tl.program_id(0)
    row = tl.load(ROWS + i)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    word = tl.load(MASK + i * words + cols // 32, mask=ok, other=-1)
    banned = ((word >> (cols % 32)) & 1) == 0
    tl.store(LOGITS + row * stride_l + cols, tl.full([BLOCK], float("-inf"), LOGITS.dtype.element_ty),
             mask=ok & banned)


def mask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on `logits` [batch, vocab]: row rows[i] keeps only the tokens whose bit is set in bitmask[i] (int32
    words, 32 tokens each, as xgrammar fills them)."""
    vocab = logits.shape[1]
    assert logits.stride(1) == 1 and bitmask.is_contiguous() and bitmask.dtype == torch.int32
    if len(rows):
        _mask_kernel[(len(rows), triton.cdiv(vocab, MASK_BLOCK))](
            logits, logits.stride(0), rows, bitmask, bitmask.shape[1], vocab, BLOCK=MASK_BLOCK, num_warps=4)
