"""The layouts the CUDA paths read, checked on the CPU: a mixed graph's padded metadata must cover each query token
of the step exactly once, in the tile it would have had unpadded, and give every padding tile nothing to do.

The Triton kernel (engine/runner/triton_attention.py) reads a tile as: sequence s = tile_seq[t], its tokens
query_start_loc[s] .. query_start_loc[s + 1], its context seq_lens[s] minus that count, and the tile's tokens
tile_qstart[t] .. + tokens_per_tile within them. `_tokens_of` reads the arrays the same way.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.runner.cuda_graphs import (TableRows, decode_sizes, logits_rows_held, mixed_sizes, padded_metadata,
                                               seq_capacity, tile_capacity)
from service.engine.runner.input_packing import block_m_for, build_tiles, host_inputs
from service.engine.sampling import SamplingParams
from service.engine.scheduler import ScheduledBatch
from service.engine.sequence import Sequence


def _tokens_of(metadata: np.ndarray, tile: int, tokens_per_tile: int) -> tuple[int, range, int]:
    """(sequence, the packed rows of its query tokens in this tile, the sequence's context before the step)."""
    seq_lens, starts, tile_seq, tile_qstart = metadata
    seq = int(tile_seq[tile])
    begin, q_len = int(starts[seq]), int(starts[seq + 1] - starts[seq])
    first = int(tile_qstart[tile])
    return seq, range(begin + first, begin + min(first + tokens_per_tile, q_len)), int(seq_lens[seq]) - q_len


@settings(max_examples=200, deadline=None)
@given(q_lens=st.lists(st.integers(1, 300), min_size=1, max_size=40), context=st.integers(0, 50),
       max_num_seqs=st.sampled_from([8, 40, 256]), group=st.sampled_from([1, 3, 4, 8]))
def test_padded_metadata_covers_every_query_token_once_and_padding_tiles_do_nothing(q_lens, context, max_num_seqs,
                                                                                      group):
    q_lens = q_lens[:max_num_seqs]
    total = sum(q_lens)
    sizes = mixed_sizes(max(total, 16))
    tokens = next(s for s in sizes if s >= total)
    seqs = []
    for i, n in enumerate(q_lens):
        seq = Sequence(f"s{i}", [1] * (context + i + n), SamplingParams())
        seq.num_computed_tokens = context + i
        seq.block_table = list(range(1, 2 + (context + i + n) // 16))
        seqs.append(seq)
    host = host_inputs(ScheduledBatch(seqs, q_lens, []), block_size=16)
    per_tile = max(1, block_m_for(group, False) // group)
    metadata = padded_metadata(host, tokens, max_num_seqs, per_tile)
    cap, tiles = seq_capacity(tokens, max_num_seqs), tile_capacity(tokens, max_num_seqs, per_tile)
    assert metadata.shape[1] >= max(cap + 2, tiles)
    covered = []
    for tile in range(tiles):  # the graph launches exactly `tiles` programs per KV head
        seq, rows, before = _tokens_of(metadata, tile, per_tile)
        if seq == cap:  # a padding tile: the empty sequence, nothing to attend or store
            assert len(rows) == 0 and metadata[0, cap] == 0
            continue
        assert seq < len(q_lens) and before == context + seq  # the sequence's own context
        covered += list(rows)
    assert sorted(covered) == list(range(total))  # each real query token exactly once
    unpadded_seq, unpadded_first = build_tiles(np.asarray(q_lens, np.int32), per_tile, host.seq_lens - host.q_lens)
    real = len(unpadded_seq)
    assert (metadata[2, :real] == unpadded_seq).all() and (metadata[3, :real] == unpadded_first).all()
    assert (metadata[2, real:tiles] == cap).all()
    assert (metadata[1, len(q_lens):cap + 2] == total).all()  # sequences past the step's hold no tokens


@settings(max_examples=100, deadline=None)
@given(q_lens=st.lists(st.integers(1, 300), min_size=1, max_size=40), data=st.data(),
       per_tile=st.sampled_from([1, 4, 16, 64]))
def test_tiles_come_longest_first_and_each_once(q_lens, data, per_tile):
    """Given the contexts, build_tiles returns the same tiles as in sequence order, ordered by the keys each reads
    (context + its last token), ties in sequence order."""
    q_lens = np.asarray(q_lens, np.int32)
    contexts = np.asarray(data.draw(st.lists(st.integers(0, 2000), min_size=len(q_lens), max_size=len(q_lens))),
                          np.int32)
    plain = list(zip(*build_tiles(q_lens, per_tile)))
    ordered = list(zip(*build_tiles(q_lens, per_tile, contexts)))
    assert sorted(ordered) == sorted(plain)
    keys = [contexts[s] + min(first + per_tile, q_lens[s]) for s, first in ordered]
    assert keys == sorted(keys, reverse=True)
    assert all(a < b for a, b, ka, kb in zip(ordered, ordered[1:], keys, keys[1:]) if ka == kb)


def test_mixed_sizes_pad_a_step_by_at_most_a_third_and_end_at_the_largest():
    sizes = mixed_sizes(4096)
    assert sizes[0] == 16 and sizes[-1] == 4096 and sizes == sorted(set(sizes))
    for tokens in range(17, 4097):
        padded = next(s for s in sizes if s >= tokens)
        assert padded <= max(32, tokens * 3 // 2 + 1)
    assert mixed_sizes(13) == [13] and mixed_sizes(100)[-1] == 100


def test_the_logits_the_graphs_keep_are_counted_row_by_row():
    """What the KV budget sets aside for the graphs' outputs (kv_cache.profile_peak_memory): with 256 sequences and
    8,192 batched tokens, 2,191 rows for the 20 decode graphs and 2,880 for the 16 mixed ones."""
    assert decode_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)] and sum(decode_sizes(256)) == 2191
    assert logits_rows_held(256, 8192) == 2191 + 16 + 32 + 48 + 64 + 96 + 128 + 192 + 256 * 9
    assert decode_sizes(20) == [1, 2, 4, 8, 16, 20] and logits_rows_held(20, 13) == 51 + 13


def test_the_cuda_cache_layout_holds_the_same_slots_and_attention_as_the_contiguous_one():
    """CUDA caches lie heads outside tokens in memory (kv_cache.cache_tensor), indexed as the contiguous CPU ones:
    the reference backend writes a step's keys and values into the same slots and attends the same over either."""
    import random

    import torch

    from service.bench.kernel.ops import scattered_batch
    from service.engine.runner.attention import torch_paged_attention
    from service.engine.runner.input_packing import pack_inputs

    torch.manual_seed(0)
    batch, blocks = scattered_batch([(0, 20), (33, 1), (15, 3)], random.Random(0))
    seqs, kv_heads, head_dim = batch.seqs, 2, 8
    contiguous = [torch.randn(blocks, 16, kv_heads, head_dim) for _ in "kv"]
    heads_outside = [torch.empty(blocks, kv_heads, 16, head_dim).transpose(1, 2).copy_(c) for c in contiguous]
    assert heads_outside[0].stride(2) == 16 * head_dim and torch.equal(heads_outside[0], contiguous[0])
    meta = pack_inputs(batch, False, block_size=16, backend_name="torch", group=2, device=torch.device("cpu"))[2]
    q = torch.randn(24, 4, head_dim)
    new_kv = tuple(torch.randn(24, kv_heads, head_dim) for _ in "kv")
    outs = [torch_paged_attention(q, *caches, meta, head_dim ** -0.5, new_kv=new_kv)
            for caches in (contiguous, heads_outside)]
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(contiguous, heads_outside))
    assert torch.equal(contiguous[0][seqs[1].block_table[2], 33 % 16], new_kv[0][20])  # s1's token 33: row 20


def test_long_prefill_steps_take_long_tiles_and_nothing_else_does():
    """Tiles of LONG_PREFILL_ROWS rows (triton_attention pipelines their scores) only for a step whose every sequence
    brings a whole tile of query tokens and ends at least LONG_PREFILL_CONTEXT tokens long, with heads as wide as
    measured (128); pack_inputs chooses them from the step, and its tiles then hold that many tokens each."""
    import random

    import torch

    from service.bench.kernel.ops import scattered_batch
    from service.engine.runner.input_packing import (LONG_PREFILL_CONTEXT, LONG_PREFILL_HEAD_DIM, LONG_PREFILL_ROWS,
                                                     pack_inputs)

    dim, context, whole = LONG_PREFILL_HEAD_DIM, LONG_PREFILL_CONTEXT, LONG_PREFILL_ROWS // 4
    assert block_m_for(4, False, dim, whole, context) == LONG_PREFILL_ROWS
    assert block_m_for(4, False, dim, whole - 1, context) == 64  # a tile less than whole: a decode token, say
    assert block_m_for(4, False, dim, whole, context - 1) == 64
    assert block_m_for(4, False, 64, whole, context) == 64  # 64-wide heads: long tiles measured slower
    assert block_m_for(4, False) == 64 and block_m_for(4, True, dim, 1, context) == 16
    assert block_m_for(8, False, dim, LONG_PREFILL_ROWS // 8, context) == LONG_PREFILL_ROWS

    def meta(shapes):
        batch, _ = scattered_batch(shapes, random.Random(0))
        return pack_inputs(batch, False, block_size=16, backend_name="triton", group=4, device=torch.device("cpu"),
                           head_dim=dim)[2]

    long = meta([(context - 100, 100), (0, context), (4000, whole)])
    assert long.block_m == LONG_PREFILL_ROWS
    assert long.tile_qstart.tolist().count(0) == 3 and len(long.tile_qstart) == 4 + context // whole + 1
    assert meta([(context - 100, 100), (0, context), (4000, 1)]).block_m == 64  # a decode token among them


def reference_host_inputs(batch: ScheduledBatch, block_size: int):
    """host_inputs written plainly, one sequence and one token at a time."""
    ids, positions, slots, tables, q_lens, seq_lens = [], [], [], [], [], []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            ids.append(seq.token_ids[pos] if pos < len(seq.token_ids) else 0)
            positions.append(pos)
            slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
        tables.append(seq.block_table)
        q_lens.append(n)
        seq_lens.append(seq.num_computed_tokens + n)
    width = max(map(len, tables))
    return ids, positions, slots, [t + [0] * (width - len(t)) for t in tables], q_lens, seq_lens, \
        [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), decode=st.booleans(), block_size=st.sampled_from([1, 16, 64]))
def test_host_inputs_equal_a_plain_per_token_reading(data, decode, block_size):
    seqs, counts = [], []
    for i in range(data.draw(st.integers(1, 24))):
        total = data.draw(st.integers(1, 200))
        computed = data.draw(st.integers(0, total - 1))
        n = 1 if decode else data.draw(st.integers(1, total - computed))
        on_device = data.draw(st.booleans()) and computed + n == total  # its last token not read back yet
        seq = Sequence(f"s{i}", list(range(7, 7 + total - on_device)), SamplingParams())
        seq.num_computed_tokens = computed
        seq.block_table = data.draw(st.lists(st.integers(1, 5000), min_size=-(-(computed + n) // block_size),
                                             max_size=-(-(computed + n) // block_size) + 2))
        seqs.append(seq)
        counts.append(n)
    host = host_inputs(ScheduledBatch(seqs, counts, []), block_size)
    expected = reference_host_inputs(ScheduledBatch(seqs, counts, []), block_size)
    got = (host.ids, host.positions, host.slots, host.tables, host.q_lens, host.seq_lens, host.starts)
    for name, a, b in zip(("ids", "positions", "slots", "tables", "q_lens", "seq_lens", "starts"), got, expected):
        assert np.asarray(a).tolist() == b, name
    assert host.positions.dtype == host.slots.dtype == np.int64
    assert host.tables.dtype == host.q_lens.dtype == host.seq_lens.dtype == host.starts.dtype == np.int32


def test_decode_graph_table_rows_change_only_when_a_sequence_gains_a_block_or_a_new_one_takes_a_row():
    from service.engine.sequence import Status

    def running(name, blocks):
        seq = Sequence(name, [1], SamplingParams())
        seq.status, seq.block_table = Status.RUNNING, list(blocks)
        return seq

    def check(rows, seqs):  # every sequence's row holds its table, and no two share a row
        assert len(set(rows.tolist())) == len(seqs) and 0 not in rows
        for row, seq in zip(rows.tolist(), seqs):
            assert seq.graph_row == row and table.host[row, :len(seq.block_table)].tolist() == seq.block_table

    table = TableRows(rows=7, width=4)  # three sequences at once at most: row 0 and twice three
    a, b, c = running("a", [5]), running("b", [6, 7]), running("c", [8])
    rows, changed = table.update([a, b, c])
    check(rows, [a, b, c])
    assert changed == (1, 4, 2)
    rows_again, changed = table.update([a, b, c])
    assert rows_again.tolist() == rows.tolist() and changed is None  # nothing new: nothing to upload
    a.status = Status.FINISHED  # a ends: those behind it keep their rows, and nothing is uploaded
    kept, changed = table.update([b, c])
    assert kept.tolist() == rows[1:].tolist() and changed is None
    b.block_table.append(9)  # b gains a block: its row alone is uploaded
    rows, changed = table.update([b, c])
    check(rows, [b, c])
    assert changed == (rows[0], rows[0] + 1, 3)
    c.block_table = [10]  # c was preempted and runs again with a new table: a row of its own again
    d, e, f = running("d", [11]), running("e", [12, 13, 14, 15]), running("f", [1])
    rows, _ = table.update([b, c, d, e, f])  # rows run out: a's and c's old rows are taken back
    check(rows, [b, c, d, e, f])
    assert (table.host[0] == 0).all()  # the padding rows' row
