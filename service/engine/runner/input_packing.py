"""Packs a scheduled batch into the model's inputs: one row of token ids and positions, and attention metadata.

Every token of a step goes into one packed row; the metadata says where each token's keys and values go in the
paged cache (slot mapping), which blocks each sequence reads (block tables), and each sequence's query and
context lengths, plus what the chosen attention backend needs on top (query gather indices, or Triton tiles).
"""

import itertools
from typing import NamedTuple

import numpy as np
import torch

from service.engine.runner.attention import AttentionMetadata
from service.engine.runner.pinned_upload import to_device
from service.engine.scheduler import ScheduledBatch


# Long prefill: a step of prompt chunks only, over long contexts, with 128-wide heads, whose tiles are 128 rows and
# pipeline their scores (triton_attention._attend_keys_pipelined). H100, heads 32/8 (docs/log/2026-11.md): 8-17% less
# time from 2,048 tokens of context up (4 x 2,048, 1 x 8,192, 8,192 after 8,192, 32 tokens each after 4,064), but
# 2-12% more at 1,024 and below, and more still with 64-wide heads or with decode tokens in the step.
LONG_PREFILL_ROWS, LONG_PREFILL_HEAD_DIM, LONG_PREFILL_CONTEXT = 128, 128, 2048


def block_m_for(group: int, decode_only: bool, head_dim: int = 0, shortest_query: int = 0,
                shortest_context: int = 0) -> int:
    """Rows of (query token, head) pairs in one tile of the Triton attention kernel (engine/runner/triton_attention.py):
    a power of two, at least the query heads per KV head; LONG_PREFILL_ROWS for a long prefill (every sequence of
    the step brings a whole tile of query tokens and has at least LONG_PREFILL_CONTEXT tokens after the step)."""
    rows = max(16 if decode_only else 64, 1 << (group - 1).bit_length())
    if (head_dim == LONG_PREFILL_HEAD_DIM and rows < LONG_PREFILL_ROWS and shortest_query >= LONG_PREFILL_ROWS // group
            and shortest_context >= LONG_PREFILL_CONTEXT):
        return LONG_PREFILL_ROWS
    return rows


def build_tiles(query_lens: np.ndarray, tokens_per_tile: int,
                contexts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Split each sequence's query tokens into tiles: (sequence index, first query token) per tile.

    Given each sequence's tokens before the step (`contexts`), the tiles come longest first: a tile's program reads
    the keys up to its last token, the GPU starts programs about in grid order, and a long one started last would
    run alone at the end of the launch."""
    per_seq = -(-query_lens // tokens_per_tile)
    tile_seq = np.repeat(np.arange(len(query_lens), dtype=np.int32), per_seq)
    first = (np.arange(per_seq.sum(), dtype=np.int32) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) \
        * tokens_per_tile
    if contexts is not None:
        order = np.argsort(-(contexts[tile_seq] + np.minimum(first + tokens_per_tile, query_lens[tile_seq])),
                           kind="stable")
        tile_seq, first = tile_seq[order], first[order]
    return tile_seq, first.astype(np.int32)


class HostInputs(NamedTuple):
    """A batch's inputs on the host: per token (ids, positions, cache slots), per sequence (block tables, query
    lengths, context lengths after the step, offsets of each sequence's tokens in the packed row)."""
    ids: list[int]
    positions: np.ndarray  # [tokens] int64
    slots: np.ndarray  # [tokens] int64
    tables: np.ndarray  # [seqs, most blocks of any] int32
    q_lens: np.ndarray  # [seqs] int32
    seq_lens: np.ndarray  # [seqs] int32
    starts: np.ndarray  # [seqs + 1] int32


def host_inputs(batch: ScheduledBatch, block_size: int) -> HostInputs:
    """The batch's inputs as host arrays. A token still on the device (sampled by the previous launch, not read
    back) gets id 0 here: the runner's feed-back writes it.

    Per sequence only what Python must do (its token ids, its block table's numbers); the arithmetic is done for
    the whole batch at once: a 256-sequence decode step took a few numpy calls per sequence before."""
    seqs, counts = batch.seqs, batch.num_new_tokens
    num_seqs = len(seqs)
    computed = [seq.num_computed_tokens for seq in seqs]
    if all(n == 1 for n in counts):  # decode: one token each
        ids = [seq.token_ids[c] if c < len(seq.token_ids) else 0 for seq, c in zip(seqs, computed)]
    else:
        ids = []
        for seq, c, n in zip(seqs, computed, counts):
            known = seq.token_ids[c:c + n]
            ids.extend(known)
            ids.extend([0] * (n - len(known)))  # a token still on the device: _feed_back writes it
    tables = [seq.block_table for seq in seqs]
    widths = np.fromiter(map(len, tables), np.int64, num_seqs)
    table_arr = np.zeros((num_seqs, int(widths.max())), dtype=np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(widths.sum()))
    table_arr[np.arange(table_arr.shape[1]) < widths[:, None]] = flat  # each row's first `width` places, in order
    q_lens = np.asarray(counts, dtype=np.int32)
    starts = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(q_lens, out=starts[1:])
    first = np.asarray(computed, dtype=np.int64)
    owner = np.repeat(np.arange(num_seqs), q_lens)  # each token's sequence
    positions = first[owner] + (np.arange(int(starts[-1])) - starts[:-1][owner])
    slots = table_arr[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return HostInputs(ids, positions, slots, table_arr, q_lens, (first + q_lens).astype(np.int32), starts)


def pack_inputs(batch: ScheduledBatch, decode_only: bool, *, block_size: int, backend_name: str, group: int,
                device: torch.device, head_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(token ids [1, tokens], positions [1, tokens], attention metadata) of a batch, on `device`.

    `backend_name` is torch or triton, `group` the query heads per KV head, `head_dim` the heads' width (0: the
    tiles any width takes).
    """
    host = host_inputs(batch, block_size)
    q_lens_arr, seq_lens_arr, starts = host.q_lens, host.seq_lens, host.starts
    dev = device
    up = lambda array: to_device(array, None, dev)
    meta = AttentionMetadata(
        slot_mapping=up(host.slots), block_tables=up(host.tables), seq_lens=up(seq_lens_arr),
        query_start_loc=up(starts), max_query_len=int(q_lens_arr.max()), max_seq_len=int(seq_lens_arr.max()))
    if backend_name == "torch":
        qr = np.arange(meta.max_query_len)
        meta.query_index = up(np.minimum(starts[:-1, None] + qr, starts[-1] - 1))
        meta.query_valid = up(qr < q_lens_arr[:, None])
        meta.query_pos = up((seq_lens_arr - q_lens_arr)[:, None] + qr)
    else:
        meta.block_m = block_m_for(group, decode_only, head_dim, int(q_lens_arr.min()), int(seq_lens_arr.min()))
        tile_seq, tile_qstart = build_tiles(q_lens_arr, max(1, meta.block_m // group), seq_lens_arr - q_lens_arr)
        meta.tile_seq = up(tile_seq)
        meta.tile_qstart = up(tile_qstart)
    ids_t = to_device(host.ids, torch.long, dev).unsqueeze(0)
    pos_t = up(host.positions).unsqueeze(0)
    return ids_t, pos_t, meta
