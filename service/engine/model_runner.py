"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples.

Every token of a step goes into one packed row; logits are computed only where a sequence samples.
On CUDA, decode-only steps replay CUDA graphs captured for a ladder of batch sizes.
"""

import logging

import numpy as np
import torch

from service.engine.attention import AttentionMetadata, ForwardContext, forward_context, torch_paged_attention
from service.engine.config import EngineConfig
from service.engine.sampler import SampleResult, Sampler, to_device
from service.engine.scheduler import ScheduledBatch
from service.engine.sequence import Sequence

log = logging.getLogger(__name__)


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config."""
    config = config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


class PinnedUpload:
    """A pinned host buffer for one kind of upload, in two halves used in turn.

    The host fills one half for the next step while the other's copy may still wait behind the step in
    flight; an event recorded after each copy says when its half may be written again.
    """

    def __init__(self, numel: int, dtype: torch.dtype):
        self.halves = [torch.empty(numel, dtype=dtype, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.used = [False, False]
        self.turn = 0

    def take(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
        """The next half as a tensor of `shape` and a numpy view of it to fill."""
        i = self.turn
        if self.used[i]:
            self.events[i].synchronize()  # its copy ran long ago unless the device is far behind
        t = self.halves[i][:int(np.prod(shape))].view(shape)
        return t, t.numpy()

    def send(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        self.events[self.turn].record()
        self.used[self.turn] = True
        self.turn ^= 1


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, device: torch.device, max_model_len: int):
        self.model = model
        self.config = config
        self.device = device
        self.block_size = config.block_size
        self.layers, self.kv_heads, self.head_dim = kv_shape(model.config)
        self.group = model.config.get_text_config().num_attention_heads // self.kv_heads
        self.dtype = next(model.parameters()).dtype
        self.sampler = Sampler(device, config.seed)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        self.backend_name = backend
        if backend == "triton":
            from service.engine import triton_attention
            self._triton = triton_attention
            self.backend = triton_attention.triton_paged_attention
        elif backend == "torch":
            self.backend = torch_paged_attention
        else:
            raise ValueError(f"unknown attention backend {backend!r}: use auto, torch or triton")
        self.compiled = device.type == "cuda" and config.compile and self._compile()
        self.num_blocks = config.num_blocks or self._blocks_that_fit()
        self.max_model_len = min(max_model_len, (self.num_blocks - 1) * self.block_size)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.kv_caches = [
            (torch.zeros(self.num_blocks, self.block_size, self.kv_heads, self.head_dim, dtype=self.dtype, device=device),
             torch.zeros(self.num_blocks, self.block_size, self.kv_heads, self.head_dim, dtype=self.dtype, device=device))
            for _ in range(self.layers)]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._fed: tuple[torch.Tensor, dict[Sequence, int]] | None = None  # last launch's samples, by sequence
        if device.type == "cuda" and config.cuda_graphs:
            self._capture_graphs()

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.layers * self.num_blocks * self.block_size * self.kv_heads * self.head_dim * self.dtype.itemsize

    # -- a step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SampleResult | None]:
        """Launch one forward pass and its sampling; return the sequences that sample and their samples.

        Nothing waits for the device: the samples stay there until the caller reads them, and a token that
        the previous launch sampled and the host has not read back yet is fed to this step on the device.
        """
        sample_rows, sample_seqs, offset = [], [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            offset += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                sample_rows.append(offset - 1)
                sample_seqs.append(seq)
        decode_only = offset == len(batch.seqs)
        if decode_only and self.graphs and offset <= max(self.graphs):
            logits = self._replay(batch)
        else:
            ids, positions, meta = self._prepare(batch, decode_only)
            self._feed_back(ids[0], batch)
            with forward_context(ForwardContext(self.kv_caches, meta, self.backend)):
                if not sample_rows:
                    self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1)
                    self._fed = None
                    return [], None
                keep = to_device(sample_rows, torch.long, self.device)
                logits = self.model(input_ids=ids, position_ids=positions, use_cache=False,
                                    logits_to_keep=keep).logits[0]
            sample_rows = list(range(len(sample_rows)))
        if not sample_seqs:
            self._fed = None
            return [], None
        if sample_rows != list(range(len(sample_rows))):  # a decode-only step with a one-token prefill chunk
            logits = logits.index_select(0, to_device(sample_rows, torch.long, self.device))
        result = self.sampler(logits[:len(sample_seqs)], sample_seqs)
        self._fed = (result.token_ids, {seq: row for row, seq in enumerate(sample_seqs)})
        return sample_seqs, result

    def _feed_back(self, ids: torch.Tensor, batch: ScheduledBatch) -> None:
        """Write into the packed `ids` the tokens the previous launch sampled that the host has not read yet."""
        dst, src, offset = [], [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            offset += n
            if seq.num_pending_tokens:  # its one pending token is its last input: it sampled last step
                dst.append(offset - 1)
                src.append(self._fed[1][seq])
        if dst and dst == src == list(range(len(dst))):  # steady decode: the same sequences in the same rows
            ids[:len(dst)] = self._fed[0][:len(dst)]
        elif dst:
            ids[to_device(dst, torch.long, self.device)] = self._fed[0][to_device(src, torch.long, self.device)]

    def _prepare(self, batch: ScheduledBatch, decode_only: bool):
        bs = self.block_size
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
            slots.append(table[pos // bs] * bs + pos % bs)
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
        dev = self.device
        up = lambda array: to_device(array, None, dev)
        meta = AttentionMetadata(
            slot_mapping=up(np.concatenate(slots)), block_tables=up(table_arr), seq_lens=up(seq_lens_arr),
            query_start_loc=up(starts), max_query_len=int(q_lens_arr.max()), max_seq_len=int(seq_lens_arr.max()))
        if self.backend_name == "torch":
            qr = np.arange(meta.max_query_len)
            meta.query_index = up(np.minimum(starts[:-1, None] + qr, starts[-1] - 1))
            meta.query_valid = up(qr < q_lens_arr[:, None])
            meta.query_pos = up((seq_lens_arr - q_lens_arr)[:, None] + qr)
        else:
            meta.block_m = self._triton.block_m_for(self.group, decode_only)
            tile_seq, tile_qstart = self._triton.build_tiles(q_lens_arr, max(1, meta.block_m // self.group))
            meta.tile_seq = up(tile_seq)
            meta.tile_qstart = up(tile_qstart)
        ids_t = to_device(ids, torch.long, dev).unsqueeze(0)
        pos_t = up(np.concatenate(positions)).unsqueeze(0)
        return ids_t, pos_t, meta

    # -- CUDA graphs for decode ---------------------------------------------------------------------
    def _graph_sizes(self) -> list[int]:
        cap = self.config.max_num_seqs
        return sorted({s for s in [1, 2, 4, 8, *range(16, cap + 1, 16), cap] if s <= cap})

    def _capture_graphs(self) -> None:
        dev, max_bs = self.device, max(self._graph_sizes())
        self.g_inputs = torch.zeros(3, max_bs, dtype=torch.long, device=dev)  # one upload: ids, positions, slots
        self.g_ids, self.g_pos, self.g_slots = self.g_inputs
        self.g_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        # the host's copy of g_tables, and per row the block table (list) it holds and how many of its blocks,
        # so that a step uploads only the rows whose blocks changed
        self.table_rows = np.zeros((max_bs, self.max_blocks_per_seq), dtype=np.int32)
        self.table_owners: list[tuple[list[int] | None, int]] = [(None, 0)] * max_bs
        self.up_inputs = PinnedUpload(3 * max_bs, torch.long)
        self.up_lens = PinnedUpload(max_bs, torch.int32)
        self.up_tables = PinnedUpload(max_bs * self.max_blocks_per_seq, torch.int32)
        self.g_seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.g_starts = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.g_tile_seq = torch.arange(max_bs, dtype=torch.int32, device=dev)
        self.g_tile_qstart = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        pool = None
        for size in reversed(self._graph_sizes()):
            meta = AttentionMetadata(
                slot_mapping=self.g_slots[:size], block_tables=self.g_tables[:size], seq_lens=self.g_seq_lens[:size],
                query_start_loc=self.g_starts[:size + 1], max_query_len=1, max_seq_len=self.max_model_len,
                tile_seq=self.g_tile_seq[:size], tile_qstart=self.g_tile_qstart[:size],
                block_m=self._triton.block_m_for(self.group, True) if self.backend_name == "triton" else 16)
            if self.backend_name == "torch":
                raise ValueError("CUDA graphs need the triton attention backend")
            with forward_context(ForwardContext(self.kv_caches, meta, self.backend)):
                run = lambda: self.model(input_ids=self.g_ids[None, :size], position_ids=self.g_pos[None, :size],
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

    def _replay(self, batch: ScheduledBatch) -> torch.Tensor:
        seqs, n = batch.seqs, len(batch.seqs)
        size = next(s for s in self.graph_sizes if s >= n)
        bs = self.block_size
        self._update_tables(seqs)
        pos = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, n)
        # whole buffers go up (a few KB), so padding rows are always token 0 at position 0 in scratch block 0
        inputs_t, inputs = self.up_inputs.take((3, len(self.g_ids)))
        inputs.fill(0)
        inputs[0, :n] = [0 if s.num_pending_tokens else s.token_ids[p] for s, p in zip(seqs, pos.tolist())]
        inputs[1, :n] = pos
        inputs[2, :n] = self.table_rows[np.arange(n), pos // bs] * bs + pos % bs
        lens_t, lens = self.up_lens.take((len(self.g_ids),))
        lens.fill(1)
        lens[:n] = pos + 1
        self.up_inputs.send(inputs_t, self.g_inputs)
        self.up_lens.send(lens_t, self.g_seq_lens)
        self._feed_back(self.g_ids, batch)
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

    # -- sizing ---------------------------------------------------------------------------------------
    def _blocks_that_fit(self) -> int:
        if self.device.type != "cuda":
            return 1024
        per_block = 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * self.dtype.itemsize
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        peak = self._profile_peak_memory()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_now, _ = torch.cuda.mem_get_info(self.device)
        other = total - free_now - torch.cuda.memory_reserved(self.device)  # other processes
        budget = total * self.config.gpu_memory_utilization - peak - other
        blocks = int(budget // per_block)
        if blocks < 2:
            raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB)")
        log.info("KV cache: %d blocks of %d tokens (%.1f GiB)", blocks, self.block_size, blocks * per_block / 2**30)
        return blocks

    def _profile_peak_memory(self) -> int:
        """Peak memory of a forward pass over max_num_batched_tokens tokens."""
        self._dry_run(self.config.max_num_batched_tokens)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak + 2**30  # headroom for sampling over many rows and for CUDA graphs

    @torch.inference_mode()
    def _dry_run(self, tokens: int) -> None:
        """One forward pass of a `tokens`-long prompt into a throwaway cache."""
        blocks = -(-tokens // self.block_size) + 1
        caches = [(torch.zeros(blocks, self.block_size, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device),
                   torch.zeros(blocks, self.block_size, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device))
                  for _ in range(self.layers)]
        seq = Sequence("dry-run", [0] * tokens, params=None)
        seq.block_table = list(range(1, blocks))
        ids, pos, meta = self._prepare(ScheduledBatch([seq], [tokens], []), decode_only=False)
        with forward_context(ForwardContext(caches, meta, self.backend)):
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1).logits
            logits.float().softmax(-1)
        torch.cuda.synchronize()

    # -- torch.compile ------------------------------------------------------------------------------
    def _compile(self) -> bool:
        """Compile each decoder layer (fusing norms, rotary embeddings, activations, residual adds).

        Paged attention stays outside the compiled graphs (it is marked so), and the model's own code is
        untouched. A model that torch.compile cannot handle fails here, at start-up, and runs eager.
        """
        layers = max((m for m in self.model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
        for layer in layers:
            layer.compile(dynamic=True)
        try:
            self._dry_run(2 * self.block_size)
        except Exception:
            log.warning("torch.compile failed for this model; running it eagerly", exc_info=True)
            self.uncompile()
            return False
        log.info("compiled %d decoder layers with torch.compile", len(layers))
        return True

    def uncompile(self) -> None:
        """Give the model back as it was loaded (for others that run it, such as the benchmark's peers)."""
        for module in self.model.modules():
            module._compiled_call_impl = None
        self.compiled = False
