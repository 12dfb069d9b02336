"""Packs a scheduled batch into the model's inputs: one row of token ids and positions, and attention metadata.

Every token of a step goes into one packed row; the metadata says where each token's keys and values go in the
paged cache (slot mapping), which blocks each sequence reads (block tables), and each sequence's query and
context lengths, plus what the chosen attention backend needs on top (query gather indices, or Triton tiles).
"""

import numpy as np
import torch

from service.engine.attention import AttentionMetadata
from service.engine.sampler import to_device
from service.engine.scheduler import ScheduledBatch


def pack_inputs(batch: ScheduledBatch, decode_only: bool, *, block_size: int, backend_name: str, group: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(token ids [1, tokens], positions [1, tokens], attention metadata) of a batch, on `device`.

    `backend_name` is torch or triton, `group` the query heads per KV head. A token still on the device (sampled
    by the previous launch, not read back) gets id 0 here: the runner's feed-back writes it.
    """
    ids, positions, slots, tables = [], [], [], []
    q_lens, seq_lens = [], []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        known = seq.token_ids[start:end]
        ids.extend(known)
        ids.extend([0] * (n - len(known)))  # a token still on the device: _feed_back writes it
        pos = np.arange(start, end)
        positions.append(pos)
        table = np.asarray(seq.block_table, dtype=np.int64)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        tables.append(seq.block_table)
        q_lens.append(n)
        seq_lens.append(end)
    num_seqs, width = len(tables), max(len(t) for t in tables)
    table_arr = np.zeros((num_seqs, width), dtype=np.int32)
    for i, t in enumerate(tables):
        table_arr[i, :len(t)] = t
    q_lens_arr = np.asarray(q_lens, dtype=np.int32)
    seq_lens_arr = np.asarray(seq_lens, dtype=np.int32)
    starts = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(q_lens_arr, out=starts[1:])
    dev = device
    up = lambda array: to_device(array, None, dev)
    meta = AttentionMetadata(
        slot_mapping=up(np.concatenate(slots)), block_tables=up(table_arr), seq_lens=up(seq_lens_arr),
        query_start_loc=up(starts), max_query_len=int(q_lens_arr.max()), max_seq_len=int(seq_lens_arr.max()))
    if backend_name == "torch":
        qr = np.arange(meta.max_query_len)
        meta.query_index = up(np.minimum(starts[:-1, None] + qr, starts[-1] - 1))
        meta.query_valid = up(qr < q_lens_arr[:, None])
        meta.query_pos = up((seq_lens_arr - q_lens_arr)[:, None] + qr)
    else:
        from service.engine import triton_attention

        meta.block_m = triton_attention.block_m_for(group, decode_only)
        tile_seq, tile_qstart = triton_attention.build_tiles(q_lens_arr, max(1, meta.block_m // group))
        meta.tile_seq = up(tile_seq)
        meta.tile_qstart = up(tile_qstart)
    ids_t = to_device(ids, torch.long, dev).unsqueeze(0)
    pos_t = up(np.concatenate(positions)).unsqueeze(0)
    return ids_t, pos_t, meta
