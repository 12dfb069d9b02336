"""CUDA graphs: captured once at start-up for a ladder of sizes, replayed with fresh inputs.

Decode-only steps replay graphs captured per batch size (DecodeGraphs), each with its rows' argmax. A replay uploads
the step's token ids, positions, slots, sequence lengths and tile order as one whole (small) buffer through
double-buffered pinned memory, and only the block-table rows that changed; padding rows are token 0 at position 0 in
scratch block 0.

Steps that carry prefill chunks (alone or beside decode tokens) replay graphs captured per number of tokens
(MixedGraphs), up to MIXED_MAX_TOKENS: the step's tokens are padded to the next size of the ladder and its
sequences to a fixed count, so that the attention kernel's grid is fixed too (tiles beyond the step's own point
at an empty sequence and do nothing). Outside the graphs such a step costs the host 10-17 ms on an H100 whatever
its size (the compiled layers' wrappers and guards, about 0.6 ms a layer): the whole cost of a lone prompt's
first token. Larger steps run outside the graphs, where the device's time exceeds the host's.
"""

import gc
import itertools
import logging
import operator

import numpy as np
import torch

from service.engine.runner.attention import AttentionMetadata, ForwardContext, forward_context
from service.engine.runner.input_packing import HostInputs, block_m_for, build_tiles, host_inputs
from service.engine.runner.logit_edits import mask_rows
from service.engine.runner.pinned_upload import PinnedUpload, to_device
from service.engine.scheduler import ScheduledBatch
from service.engine.sequence import Sequence, Status

log = logging.getLogger(__name__)

MIXED_MAX_TOKENS = 4096  # the largest step of prefill chunks replayed from a graph (at most max_num_batched_tokens)


def capture(runner, meta: AttentionMetadata, ids: torch.Tensor, positions: torch.Tensor, keep, pool, then=None,
            before=None):
    """One forward pass of the runner's model over the static inputs (ids, positions, the attention metadata) in
    a CUDA graph sharing `pool`, after `before()` if given; returns the graph and its logits at the rows `keep`
    names (0: every row), or what `then` makes of them in the same graph."""
    then = then or (lambda logits: logits)

    def run():
        if before is not None:
            before()
        return then(runner.model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                                 logits_to_keep=keep).logits[0])

    with forward_context(ForwardContext(runner.kv_caches, meta, runner.backend)):
        with torch.inference_mode():
            run()  # compile kernels and settle allocations outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # no garbage collection mid-capture (torch.cuda.graph no longer collects first): freeing an unreachable
            # engine's CUDA or pinned memory there can invalidate the capture
            collecting = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    out = run()
            finally:
                if collecting:
                    gc.enable()
    return graph, out


def capture_call(call) -> tuple[torch.cuda.CUDAGraph, object]:
    """`call()` (kernels over static tensors) run once, then captured in a CUDA graph of its own pool: the graph, and
    what the captured call returned."""
    with torch.inference_mode():
        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()  # (as `capture`)
        gc.disable()
        try:
            with torch.cuda.graph(graph):
                out = call()
        finally:
            if collecting:
                gc.enable()
    return graph, out


def replay(runner, ladder, size: int, tables: tuple[int, int, int]) -> None:
    """Replay graph `size` of `ladder` (its inputs filled); under tensor parallelism, send those inputs to the other
    ranks first (parallel.py: `tables` names the block-table rows the step changed), and count the pass's time."""
    group = runner.parallel
    if group is not None:
        group.send_replay(ladder.KIND, size, tables, ladder.mirrored(size, tables))
    ladder.graphs[size][0].replay()
    if group is not None:
        group.forward_done()


class DecodeGraphs:
    """The runner's decode graphs (`graphs`: batch size -> (graph, its logits)) and their input buffers.

    Each graph also takes its rows' argmax (`argmax`: batch size -> (row maxima, tokens); the sampler's greedy
    kernels, runner/triton_sampling.py), so that a step whose rows are all plain greedy launches no sampler at all:
    a few microseconds of the device's time in a step that samples otherwise, against the host's launches of it."""

    KIND = 0  # which ladder a tensor-parallel replay names (parallel.Replay)

    def __init__(self, runner, pool=None):
        self.runner = runner
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.argmax: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pool = pool
        # `masked_max`'s graphs (batch size -> (graph, (row maxima, tokens))) and buffers, made at first use
        self.masked: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.g_mask_rows = self.g_bitmask = self._masked_key = None
        # `masks_behind`'s stream, and its events: the masks copied, the masks read by the step's sampler
        self._copies = self._copied = self._read = None
        self._capture_graphs()

    def _graph_sizes(self) -> list[int]:
        return decode_sizes(self.runner.config.max_num_seqs)

    def _capture_graphs(self) -> None:
        from service.engine.runner import triton_sampling  # (Triton: CUDA only)

        r = self.runner
        dev, max_batch = r.device, max(self._graph_sizes())
        # one upload a step: ids, positions, slots, then context lengths, the tiles' order (a graph of size n runs
        # sequence tile_seq[i] i-th) and each sequence's row of the block table, which the graph casts to int32 itself
        self.g_inputs = torch.zeros(6, max_batch, dtype=torch.long, device=dev)
        self.g_ids, self.g_pos, self.g_slots = self.g_inputs[:3]
        self.g_ints = torch.ones(3, max_batch, dtype=torch.int32, device=dev)
        self.g_seq_lens, self.g_tile_seq, self.g_table_rows = self.g_ints
        self.tables = TableRows(2 * max_batch + 1, r.max_blocks_per_seq)
        self.g_tables = torch.zeros(self.tables.host.shape, dtype=torch.int32, device=dev)
        # an upload for each step of two launches in flight (decode_steps; a launch changes tables in two at most)
        steps = r.config.decode_steps
        self.up_inputs = PinnedUpload(6 * max_batch, torch.long, 2 * steps)
        self.up_tables = PinnedUpload(self.tables.host.size, torch.int32, 2 if steps == 1 else 4)
        self.keep_inputs = steps > 1  # a launch may replay its batch again (decode_steps): keep each replay's inputs
        self._previous = None  # then: the last replay's batch, its sequences' table rows and its inputs (a host copy)
        self.g_starts = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.g_tile_qstart = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.g_inputs[3].fill_(1)
        self.g_inputs[4].copy_(torch.arange(max_batch))
        pool = self.pool

        def then(logits):
            return logits, *triton_sampling.row_max(logits)

        for size in reversed(self._graph_sizes()):
            meta = AttentionMetadata(
                slot_mapping=self.g_slots[:size], block_tables=self.g_tables, seq_lens=self.g_seq_lens[:size],
                query_start_loc=self.g_starts[:size + 1], max_query_len=1, max_seq_len=r.max_model_len,
                tile_seq=self.g_tile_seq[:size], tile_qstart=self.g_tile_qstart[:size],
                block_m=block_m_for(r.group, True), table_rows=self.g_table_rows[:size])
            graph, (out, *argmax) = capture(r, meta, self.g_ids[:size], self.g_pos[:size], 0, pool, then,
                                            lambda: self.g_ints.copy_(self.g_inputs[3:]))
            pool = graph.pool()
            self.graphs[size], self.argmax[size] = (graph, out), argmax
        self.pool = pool
        self.graph_sizes = sorted(self.graphs)
        log.info("captured CUDA graphs for decode batch sizes %s", sorted(self.graphs))

    def replay(self, batch: ScheduledBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], np.ndarray]:
        """Replay the step: its logits, their rows' (maxima, argmax), and its sequences' table rows. The next step of
        a launch of several (the same batch again, each sequence a token on, that token on the device) takes the
        step before's inputs one position on, with no pass over the sequences but for their tables' lengths."""
        seqs, n = batch.seqs, len(batch.seqs)
        size = next(s for s in self.graph_sizes if s >= n)
        block_size = self.runner.block_size
        previous, self._previous = self._previous, None
        again = previous is not None and previous[0] is batch
        if again:
            rows, changed = previous[1], self.tables.grow(seqs, previous[1])
        else:
            rows, changed = self.tables.update(seqs)
        tables = (0, 0, 0)
        if changed is not None:
            first, last, width = tables = changed
            up_t, up = self.up_tables.take((last - first, width))
            up[:] = self.tables.host[first:last, :width]
            self.up_tables.send(up_t, self.g_tables[first:last, :width])
        # whole buffers go up (a few KB), so padding rows are always token 0 at position 0 in scratch block 0 (row 0
        # of the table), with context 1
        inputs_t, inputs = self.up_inputs.take((6, len(self.g_ids)))
        if again:  # (the tiles' order, longest first, stays as it was)
            inputs[:] = previous[2]
            pos = inputs[1, :n]
            pos += 1
            inputs[3, :n] += 1
        else:
            pos = np.fromiter(map(_computed, seqs), np.int64, n)
            inputs[:3].fill(0)
            pending = np.fromiter(map(_pending, seqs), np.int64, n)
            known = np.flatnonzero(pending == 0)  # the rest: _feed_back's
            if len(known):
                inputs[0, known] = [seqs[i].token_ids[p] for i, p in zip(known.tolist(), pos[known].tolist())]
            inputs[1, :n] = pos
            inputs[3].fill(1)
            inputs[3, :n] = pos + 1
            inputs[4, :size] = np.argsort(-inputs[3, :size], kind="stable")  # longest first, as build_tiles orders
            inputs[5].fill(0)
            inputs[5, :n] = rows
        inputs[2, :n] = self.tables.host[rows, pos // block_size] * block_size + pos % block_size
        if self.keep_inputs:
            self._previous = (batch, rows, inputs.copy())
        self.up_inputs.send(inputs_t, self.g_inputs)
        # (launched again, the batch is the step before's: steady decode, which needs no pairing of rows)
        self.runner._feed_back(self.g_ids, batch, None if again else (rows, pending))
        replay(self.runner, self, size, tables)
        top, tokens = self.argmax[size]
        return self.graphs[size][1][:n], (top[:n], tokens[:n]), rows

    def masked_max(self, n: int, rows: list[int], bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last replay's (`n` rows) row maxima and argmax with the grammars' masks applied (`rows`, the masked rows;
        `bitmask`, [rows, words] int32 in pinned host memory or on the device), for a step whose rows are all plain
        greedy but for their masks: `triton_sampling.row_max` in a graph of its own for the replay's size
        (`masked_graph`), over that graph's logits (a launch instead of the kernels' two and their tensors: the
        sampler's launch took 0.24 ms against 0.41 on an H200 machine's host). The masks go into a buffer of the
        graph's; the rows' map to them only when it changes."""
        size = self.masked_graph(n, bitmask.shape[1])
        if self._masked_key != (rows, size):
            self.g_mask_rows[:size].copy_(to_device(mask_rows(rows, size), torch.long, self.runner.device))
            self._masked_key = (rows, size)
        if bitmask.data_ptr() != self.g_bitmask.data_ptr():  # (not there yet: `masks_behind` copied them there)
            self.g_bitmask[:len(rows)].copy_(bitmask, non_blocking=True)
        graph, (top, tokens) = self.masked[size]
        graph.replay()
        return top[:n], tokens[:n]

    def masked_graph(self, n: int, words: int) -> int:
        """The size of `masked_max`'s graph for `n` rows (masks of `words` words a row), captured now if it was not
        yet: before the device waits for the masks (runner/host_gate.py), as a capture waits for the device."""
        size = next(s for s in self.graph_sizes if s >= n)
        if size in self.masked:
            return size
        self._mask_buffers(words)
        from service.engine.runner import triton_sampling  # (Triton: CUDA only)

        logits = self.graphs[size][1]
        self.masked[size] = capture_call(
            lambda: triton_sampling.row_max(logits, None, (self.g_mask_rows[:size], self.g_bitmask)))
        return size

    def masks_behind(self, gate, ticket: int, host: torch.Tensor) -> torch.Tensor:
        """The grammars' masks `host` ([rows, words] int32, pinned), copied into `masked_max`'s buffer on a stream of
        their own behind the `gate`'s wait for `ticket` (runner/host_gate.py): the copy runs beside the forward pass as
        soon as the host has filled them, and the compute stream waits for the copy only (at 256 rows of a 49,152-token
        vocabulary, 1.5 MB). Returns the buffer's rows, for the sampler; `masks_read` once it is launched."""
        self._mask_buffers(host.shape[1])
        if self._copies is None:
            self._copies, self._copied, self._read = torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event()
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(self._copies):
            self._copies.wait_event(self._read)  # (the step before's sampler has read the buffer)
            gate.wait(ticket)
            self.g_bitmask[:len(host)].copy_(host, non_blocking=True)
            self._copied.record()
        compute.wait_event(self._copied)
        return self.g_bitmask[:len(host)]

    def masks_read(self) -> None:
        """The sampler that reads `masks_behind`'s buffer is launched: the next copy waits for it."""
        self._read.record()

    def _mask_buffers(self, words: int) -> None:
        if self.g_mask_rows is None:
            max_batch = max(self.graph_sizes)
            self.g_mask_rows = torch.full((max_batch,), -1, dtype=torch.long, device=self.runner.device)
            self.g_bitmask = torch.zeros(max_batch, words, dtype=torch.int32, device=self.runner.device)

    def mirrored(self, size: int, tables: tuple[int, int, int]) -> list[torch.Tensor]:
        """The input buffers a replay fills (padding included), and the block-table rows it changed."""
        start, end, width = tables
        return [self.g_inputs, self.g_tables[start:end, :width]]


class TableRows:
    """The decode graphs' block table: a row for each sequence that runs in them, which it keeps while it runs
    (`Sequence.graph_row`), so that a row changes only when its sequence gains a block (one in block_size tokens) or
    a new sequence takes it, not whenever the batch's order moves (every sequence behind one that ends). Row 0 is
    all zeros (block 0, the scratch block): the padding rows'. A sequence that has ended or was preempted gives its
    row up when one is needed (its table list is no longer the one the row holds)."""

    def __init__(self, rows: int, width: int):
        self.host = np.zeros((rows, width), dtype=np.int32)  # what the device's copy holds, once uploaded
        self.owners: list[Sequence | None] = [None] * rows
        self.lists: list[list[int] | None] = [None] * rows  # the block table (list) each row holds (kept alive)
        self.list_ids = np.zeros(rows, dtype=np.int64)  # its id: 0 for none, so row 0 matches no sequence
        self.widths = np.zeros(rows, dtype=np.int64)  # how many of its blocks the row holds
        self.free = list(range(rows - 1, 0, -1))  # the lowest first

    def update(self, seqs: list[Sequence]) -> tuple[np.ndarray, tuple[int, int, int] | None]:
        """Each sequence's row (taking rows for those without one) and the host rows brought up to date: the rows'
        numbers, and the range that changed ([first, last) rows, columns [0, width)), None if none did."""
        n = len(seqs)
        rows = np.fromiter(map(_graph_row, seqs), np.int64, n)
        tables = list(map(_table, seqs))
        ids = np.fromiter(map(id, tables), np.int64, n)
        for i in np.flatnonzero(self.list_ids[rows] != ids).tolist():  # new, re-admitted, or its row was taken
            rows[i] = self._take(seqs[i], tables[i], int(ids[i]))
        return rows, self._grown(rows, tables)

    def grow(self, seqs: list[Sequence], rows: np.ndarray) -> tuple[int, int, int] | None:
        """`update` for sequences that hold their `rows` already (the same batch again): only blocks they gained."""
        return self._grown(rows, list(map(_table, seqs)))

    def _grown(self, rows: np.ndarray, tables: list[list[int]]) -> tuple[int, int, int] | None:
        n = len(rows)
        widths = np.fromiter(map(len, tables), np.int64, n)
        grown = np.flatnonzero(self.widths[rows] != widths)
        if not len(grown):
            return None
        at, lengths = rows[grown], widths[grown]
        flat = np.fromiter(itertools.chain.from_iterable([tables[i] for i in grown.tolist()]), np.int32,
                           int(lengths.sum()))
        block = np.zeros((len(at), int(lengths.max())), dtype=np.int32)
        block[np.arange(block.shape[1]) < lengths[:, None]] = flat  # each row's first `length` places, in order
        self.host[at, :block.shape[1]] = block
        self.widths[at] = lengths
        first, last = int(at.min()), int(at.max()) + 1
        return first, last, int(self.widths[first:last].max())

    def _take(self, seq: Sequence, table: list[int], table_id: int) -> int:
        if not self.free:
            self._reclaim()
        row = self.free.pop()
        seq.graph_row = row
        self.owners[row], self.lists[row], self.list_ids[row], self.widths[row] = seq, table, table_id, 0
        return row

    def _reclaim(self) -> None:
        """Free the rows of sequences that no longer run with the table their row holds (at least half the rows:
        there are twice as many as sequences that run at once)."""
        for row in range(1, len(self.owners)):
            seq = self.owners[row]
            if seq is not None and (seq.status is not Status.RUNNING or seq.block_table is not self.lists[row]):
                self.owners[row] = self.lists[row] = None
                self.list_ids[row] = self.widths[row] = 0
                self.free.append(row)
        self.free.sort(reverse=True)


_computed, _pending, _table, _graph_row = (operator.attrgetter(name) for name in
                                           ("num_computed_tokens", "num_pending_tokens", "block_table", "graph_row"))


def decode_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes decode graphs are captured for: 1, 2, 4, 8, then every 16 up to max_num_seqs."""
    cap = max_num_seqs
    return sorted({s for s in [1, 2, 4, 8, *range(16, cap + 1, 16), cap] if s <= cap})


def logits_rows_held(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Rows of logits the captured graphs keep for good (each graph's output stays allocated): one per sequence
    of every decode graph and of every mixed graph."""
    mixed = mixed_sizes(min(MIXED_MAX_TOKENS, max_num_batched_tokens))
    return sum(decode_sizes(max_num_seqs)) + sum(seq_capacity(s, max_num_seqs) for s in mixed)


def mixed_sizes(max_tokens: int) -> list[int]:
    """The token counts mixed graphs are captured for: 16, 32, 48, 64, 96, 128, ... (powers of two and the
    halfway points between them, so that padding adds at most a third), up to max_tokens, which is always one."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes += [size, size * 3 // 2] if size >= 32 else [size]
        size *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def seq_capacity(tokens: int, max_num_seqs: int) -> int:
    """How many sequences a mixed graph of `tokens` tokens holds: each has one token at least."""
    return min(tokens, max_num_seqs)


def tile_capacity(tokens: int, max_num_seqs: int, tokens_per_tile: int) -> int:
    """Attention tiles a mixed graph launches: each sequence's last tile may be partly empty."""
    return -(-tokens // tokens_per_tile) + seq_capacity(tokens, max_num_seqs)


def padded_metadata(host: HostInputs, tokens: int, max_num_seqs: int, tokens_per_tile: int) -> np.ndarray:
    """The step's per-sequence and per-tile metadata padded to a mixed graph of `tokens` tokens, as one int32
    array [4, width]: context lengths, query offsets, tile sequences and tile first tokens (rows in that order).

    The graph's sequence `seqs` (its capacity) is empty: context 0, no query tokens, where every tile beyond the
    step's own points; sequences between the step's and the capacity are empty too.
    """
    seqs = seq_capacity(tokens, max_num_seqs)
    tiles = tile_capacity(tokens, max_num_seqs, tokens_per_tile)
    out = np.zeros((4, max(seqs + 2, tiles)), dtype=np.int32)
    n, real = len(host.q_lens), host.starts[-1]
    out[0, :n] = host.seq_lens
    out[1, :n + 1] = host.starts
    out[1, n + 1:seqs + 2] = real
    tile_seq, tile_qstart = build_tiles(host.q_lens, tokens_per_tile, host.seq_lens - host.q_lens)
    out[2, :len(tile_seq)] = tile_seq
    out[2, len(tile_seq):tiles] = seqs
    out[3, :len(tile_qstart)] = tile_qstart
    return out


class MixedGraphs:
    """The runner's graphs for steps with prefill chunks: `graphs`, tokens -> (graph, its logits [sequences,
    vocabulary]), logits at each sequence's last token of the step (the rows `keep` names)."""

    KIND = 1

    def __init__(self, runner):
        self.runner = runner
        r = runner
        self.sizes = mixed_sizes(min(MIXED_MAX_TOKENS, r.config.max_num_batched_tokens))
        self.max_tokens = self.sizes[-1]
        self.block_m = block_m_for(r.group, False)
        self.tokens_per_tile = max(1, self.block_m // r.group)
        self.max_num_seqs = r.config.max_num_seqs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        self._capture()

    def _capture(self) -> None:
        r, dev, top = self.runner, self.runner.device, self.max_tokens
        seqs = seq_capacity(top, self.max_num_seqs)
        width = max(seqs + 2, tile_capacity(top, self.max_num_seqs, self.tokens_per_tile))
        self.g_long = torch.zeros(4, top, dtype=torch.long, device=dev)  # ids, positions, slots, sampled rows
        self.g_int = torch.zeros(4, width, dtype=torch.int32, device=dev)  # padded_metadata's rows
        self.g_tables = torch.zeros(seqs + 1, r.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.up_long = PinnedUpload(4 * top, torch.long)
        self.up_int = PinnedUpload(4 * width, torch.int32)
        self.up_tables = PinnedUpload(seqs * r.max_blocks_per_seq, torch.int32)
        g_ids, g_pos, g_slots, g_keep = self.g_long
        g_lens, g_starts, g_tile_seq, g_tile_qstart = self.g_int
        empty = HostInputs([], np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 1), np.int32),
                           np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(1, np.int32))
        pool = None
        for size in reversed(self.sizes):  # the largest first, so that the smaller ones fit in its memory pool
            seqs = seq_capacity(size, self.max_num_seqs)
            tiles = tile_capacity(size, self.max_num_seqs, self.tokens_per_tile)
            metadata = padded_metadata(empty, size, self.max_num_seqs, self.tokens_per_tile)
            self.g_int.zero_()
            self.g_int[:, :metadata.shape[1]].copy_(torch.from_numpy(metadata))
            meta = AttentionMetadata(
                slot_mapping=g_slots[:size], block_tables=self.g_tables[:seqs + 1], seq_lens=g_lens[:seqs + 1],
                query_start_loc=g_starts[:seqs + 2], max_query_len=size, max_seq_len=r.max_model_len,
                tile_seq=g_tile_seq[:tiles], tile_qstart=g_tile_qstart[:tiles], block_m=self.block_m)
            graph, out = capture(r, meta, g_ids[:size], g_pos[:size], g_keep[:seqs], pool)
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        self.pool = pool
        log.info("captured CUDA graphs for steps with prefill chunks of %s tokens", self.sizes)

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def replay(self, batch: ScheduledBatch, sample_rows: list[int]) -> torch.Tensor:
        """Run the step from the graph of the next size up; the logits [len(sample_rows), vocabulary] at the
        packed rows `sample_rows`."""
        r = self.runner
        host = host_inputs(batch, r.block_size)
        n = len(host.ids)
        size = next(s for s in self.sizes if s >= n)
        long_t, long = self.up_long.take((4, self.max_tokens))
        long.fill(0)
        long[0, :n] = host.ids
        long[1, :n] = host.positions
        long[2, :n] = host.slots
        long[3, :len(sample_rows)] = sample_rows
        metadata = padded_metadata(host, size, self.max_num_seqs, self.tokens_per_tile)
        int_t, ints = self.up_int.take(tuple(self.g_int.shape))
        ints.fill(0)
        ints[:, :metadata.shape[1]] = metadata
        rows, width = host.tables.shape
        tables_t, tables = self.up_tables.take((rows, width))
        tables[:] = host.tables
        self.up_long.send(long_t, self.g_long)
        self.up_int.send(int_t, self.g_int)
        self.up_tables.send(tables_t, self.g_tables[:rows, :width])
        r._feed_back(self.g_long[0], batch)
        replay(r, self, size, (0, rows, width))
        self.replays += 1
        return self.graphs[size][1][:len(sample_rows)]

    def mirrored(self, size: int, tables: tuple[int, int, int]) -> list[torch.Tensor]:
        """The input buffers a replay of graph `size` reads, and the block-table rows it filled."""
        _, rows, width = tables
        return [self.g_long[:, :size], self.g_int, self.g_tables[:rows, :width]]
