"""CUDA graphs for decode-only steps: captured once for a ladder of batch sizes, replayed with fresh inputs.

A replay uploads the step's token ids, positions, slots and sequence lengths as whole (small) buffers through
double-buffered pinned memory, and only the block-table rows that changed; padding rows are token 0 at position
0 in scratch block 0.
"""

import logging

import numpy as np
import torch

from service.engine.attention import AttentionMetadata, ForwardContext, forward_context
from service.engine.pinned_upload import PinnedUpload
from service.engine.scheduler import ScheduledBatch
from service.engine.sequence import Sequence

log = logging.getLogger(__name__)


class DecodeGraphs:
    """The runner's decode graphs (`graphs`: batch size -> (graph, its logits)) and their input buffers."""

    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture_graphs()

    def _graph_sizes(self) -> list[int]:
        cap = self.runner.config.max_num_seqs
        return sorted({s for s in [1, 2, 4, 8, *range(16, cap + 1, 16), cap] if s <= cap})

    def _capture_graphs(self) -> None:
        r = self.runner
        dev, max_batch = r.device, max(self._graph_sizes())
        self.g_inputs = torch.zeros(3, max_batch, dtype=torch.long, device=dev)  # one upload: ids, positions, slots
        self.g_ids, self.g_pos, self.g_slots = self.g_inputs
        self.g_tables = torch.zeros(max_batch, r.max_blocks_per_seq, dtype=torch.int32, device=dev)
        # the host's copy of g_tables, and per row the block table (list) it holds and how many of its blocks,
        # so that a step uploads only the rows whose blocks changed
        self.table_rows = np.zeros((max_batch, r.max_blocks_per_seq), dtype=np.int32)
        self.table_owners: list[tuple[list[int] | None, int]] = [(None, 0)] * max_batch
        self.up_inputs = PinnedUpload(3 * max_batch, torch.long)
        self.up_lens = PinnedUpload(max_batch, torch.int32)
        self.up_tables = PinnedUpload(max_batch * r.max_blocks_per_seq, torch.int32)
        self.g_seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.g_starts = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.g_tile_seq = torch.arange(max_batch, dtype=torch.int32, device=dev)
        self.g_tile_qstart = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        pool = None
        for size in reversed(self._graph_sizes()):
            meta = AttentionMetadata(
                slot_mapping=self.g_slots[:size], block_tables=self.g_tables[:size], seq_lens=self.g_seq_lens[:size],
                query_start_loc=self.g_starts[:size + 1], max_query_len=1, max_seq_len=r.max_model_len,
                tile_seq=self.g_tile_seq[:size], tile_qstart=self.g_tile_qstart[:size],
                block_m=r._triton.block_m_for(r.group, True) if r.backend_name == "triton" else 16)
            if r.backend_name == "torch":
                raise ValueError("CUDA graphs need the triton attention backend")
            with forward_context(ForwardContext(r.kv_caches, meta, r.backend)):
                run = lambda: r.model(input_ids=self.g_ids[None, :size], position_ids=self.g_pos[None, :size],
                                      use_cache=False, logits_to_keep=0).logits[0]
                with torch.inference_mode():
                    run()  # compile kernels and settle allocations outside the graph
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = run()
            pool = graph.pool()
            self.graphs[size] = (graph, out)
        self.graph_sizes = sorted(self.graphs)
        log.info("captured CUDA graphs for decode batch sizes %s", sorted(self.graphs))

    def replay(self, batch: ScheduledBatch) -> torch.Tensor:
        seqs, n = batch.seqs, len(batch.seqs)
        size = next(s for s in self.graph_sizes if s >= n)
        block_size = self.runner.block_size
        self._update_tables(seqs)
        pos = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, n)
        # whole buffers go up (a few KB), so padding rows are always token 0 at position 0 in scratch block 0
        inputs_t, inputs = self.up_inputs.take((3, len(self.g_ids)))
        inputs.fill(0)
        inputs[0, :n] = [0 if s.num_pending_tokens else s.token_ids[p] for s, p in zip(seqs, pos.tolist())]
        inputs[1, :n] = pos
        inputs[2, :n] = self.table_rows[np.arange(n), pos // block_size] * block_size + pos % block_size
        lens_t, lens = self.up_lens.take((len(self.g_ids),))
        lens.fill(1)
        lens[:n] = pos + 1
        self.up_inputs.send(inputs_t, self.g_inputs)
        self.up_lens.send(lens_t, self.g_seq_lens)
        self.runner._feed_back(self.g_ids, batch)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]

    def _update_tables(self, seqs: list[Sequence]) -> None:
        """Bring g_tables up to date with the batch, uploading only the rows whose blocks changed.

        Decode steps keep the running sequences in the same rows, and a sequence gains a block every
        block_size tokens, so most steps upload a few rows instead of rebuilding the whole table.
        """
        host, owners = self.table_rows, self.table_owners
        first, last, width = len(seqs), -1, 0
        for i, seq in enumerate(seqs):
            table = seq.block_table
            owner, written = owners[i]
            if owner is table and written == len(table):
                continue
            start = written if owner is table else 0  # tables only grow; a freed sequence gets a new list
            host[i, start:len(table)] = table[start:]
            owners[i] = (table, len(table))
            first, last, width = min(first, i), i, max(width, len(table))
        if last >= 0:
            rows_t, rows = self.up_tables.take((last + 1 - first, width))
            rows[:] = host[first:last + 1, :width]
            self.up_tables.send(rows_t, self.g_tables[first:last + 1, :width])
