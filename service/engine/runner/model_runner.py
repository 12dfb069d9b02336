"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples.

Every token of a step goes into one packed row; logits are computed only where a sequence samples (and, for a
request that asks for prompt logprobs, at its prompt's positions: runner/prompt_logprobs.py).
On CUDA, steps replay CUDA graphs: decode-only steps from graphs captured for a ladder of batch sizes, steps
with prefill chunks up to cuda_graphs.MIXED_MAX_TOKENS tokens from graphs captured for a ladder of token counts.
Its parts, each in its own module: input_packing (batch -> tensors), cuda_graphs (capture and replay, over
pinned_upload's double-buffered uploads), kv_cache (the cache's shape and size) and compilation (torch.compile).
"""

import contextlib
import functools
import logging
import operator

import numpy as np
import torch

from service.engine import fusion
from service.engine.config import EngineConfig, resolve_kv_dtype
from service.engine.runner import compilation, prompt_logprobs
from service.engine.runner.attention import ForwardContext, forward_context, torch_paged_attention
from service.engine.runner.cuda_graphs import DecodeGraphs, MixedGraphs
from service.engine.runner.host_gate import HostGate
from service.engine.runner.input_packing import pack_inputs
from service.engine.runner.kv_cache import blocks_that_fit, kv_shape, new_kv_caches
from service.engine.runner.pinned_upload import to_device
from service.engine.runner.sampler import SampleResult, Sampler
from service.engine.scheduler import ScheduledBatch
from service.engine.sequence import Sequence

log = logging.getLogger(__name__)
_pending = operator.attrgetter("num_pending_tokens")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, device: torch.device, max_model_len: int):
        """`max_model_len`: the model's own (config.max_model_len may lower it, the KV cache's size too)."""
        self.model = model
        self.config = config
        self.device = device
        self.block_size = config.block_size
        self.layers, self.kv_heads, self.head_dim = kv_shape(model.config)
        self.group = model.config.get_text_config().num_attention_heads // self.kv_heads
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        self.sampler = Sampler(device, config.seed, config.max_num_seqs, config.decode_steps)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        self.backend_name = backend
        if backend == "triton":
            from service.engine.runner import triton_attention
            self.backend = triton_attention.triton_paged_attention
        elif backend == "torch":
            self.backend = torch_paged_attention
        else:
            raise ValueError(f"unknown attention backend {backend!r}: use auto, torch or triton")
        self.fused_layers, self.fused_mlps = fusion.fuse(model) if config.fuse_qkv else (0, 0)
        self.compiled = device.type == "cuda" and config.compile and compilation.compile_layers(self)
        self.num_blocks = config.num_blocks or blocks_that_fit(self)
        self.max_model_len = min(config.max_model_len or max_model_len, max_model_len,
                                 (self.num_blocks - 1) * self.block_size)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.kv_caches = new_kv_caches(self, self.num_blocks)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # decode batch size -> graph, logits
        # last launch's samples, whose they are, and (a decode graph's) their table rows
        self._fed: tuple[torch.Tensor, list[Sequence], np.ndarray | None] | None = None
        # the last forward pass's logits, their rows' (maxima, argmax) and table rows, when a decode graph took them
        self._argmax: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], np.ndarray] | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.eager_steps = 0  # steps run outside the CUDA graphs (all of them without graphs)
        self.parallel = None  # rank 0's tensor-parallel group, which sends each graph replay to the other ranks
        self.gate = _gate(device)  # where the device waits for the grammars' masks (None: the host waits)
        if device.type == "cuda" and config.cuda_graphs:
            if self.backend_name != "triton":
                raise ValueError("CUDA graphs need the triton attention backend")
            self.mixed_graphs = MixedGraphs(self)
            self.decode_graphs = DecodeGraphs(self, pool=self.mixed_graphs.pool)
            self.graphs = self.decode_graphs.graphs

    def release(self) -> None:
        """Give back the KV cache and the CUDA graphs now, not when a reference cycle is next collected (a
        process that makes engines one after another, such as `bench run`, would otherwise run out of GPU memory).
        The runner cannot run after this."""
        if self.gate is not None:
            self.gate.close()
        self.kv_caches, self.graphs, self._fed, self._argmax = [], {}, None, None
        self.decode_graphs = self.mixed_graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block of keys and values over every layer."""
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * self.kv_dtype.itemsize

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.kv_block_bytes

    # -- a step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None]:
        """Launch one forward pass: the sequences that sample in it, and their rows of logits (None if none).

        Nothing waits for the device: a token that the previous launch sampled and the host has not read back yet
        is fed to this step on the device, and `sample` leaves its samples there until the caller reads them."""
        argmax, scored, rows = None, [], None
        if batch.num_decode == len(batch.seqs):  # every row decodes: each samples, none scores its prompt
            offset = len(batch.seqs)
            sample_seqs, sample_rows = list(batch.seqs), range(offset)
        else:
            sample_rows, sample_seqs, offset = [], [], 0
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                if seq.prompt_logprobs is not None:
                    scored.append((seq, offset, n))
                offset += n
                if seq.num_computed_tokens + n == seq.num_tokens:
                    sample_rows.append(offset - 1)
                    sample_seqs.append(seq)
        decode_only = offset == len(batch.seqs)
        wanted = prompt_logprobs.Wanted(scored) if scored else None
        if wanted:  # prompt logprobs: every row's hidden state, outside the graphs
            logits = self._eager(batch, decode_only, sample_rows, wanted)
            sample_rows = range(len(sample_rows))
        elif decode_only and self.graphs and offset <= max(self.graphs):
            logits, argmax, rows = self.decode_graphs.replay(batch)
        elif self.mixed_graphs is not None and self.mixed_graphs.fits(offset):
            logits = self.mixed_graphs.replay(batch, sample_rows)
            sample_rows = range(len(sample_rows))
        else:
            logits = self._eager(batch, decode_only, sample_rows)
            sample_rows = range(len(sample_rows))
        self._argmax = None
        if not sample_seqs:
            return [], None
        if sample_rows[-1] != len(sample_rows) - 1:  # (rows ascend) a decode-only step with a one-token prefill chunk
            return sample_seqs, logits.index_select(0, to_device(sample_rows, torch.long, self.device))
        k = len(sample_seqs)  # (fewer than the graph's rows when its last row is a prompt chunk that does not sample)
        logits = logits[:k]
        if argmax is not None:  # the graph's own argmax of these logits, and its rows' table rows, for `sample`
            self._argmax = (logits, (argmax[0][:k], argmax[1][:k]), rows[:k])
        return sample_seqs, logits

    @torch.inference_mode()
    def sample(self, seqs: list[Sequence], logits: torch.Tensor | None,
               masks: "tuple[list[int], torch.Tensor, int | None] | None" = None) -> SampleResult | None:
        """Launch the sampling of a forward pass's `logits` for `seqs`, with the grammars' token `masks` where some
        are constrained: (rows, bitmask on the host, the `gate`'s ticket that says it is filled, or None when it is
        filled already); the next forward pass takes these samples as inputs on the device."""
        if not seqs:
            self._fed = None
            return None
        argmax, table_rows = (self._argmax[1:] if self._argmax is not None and self._argmax[0] is logits
                              else (None, None))
        self._argmax = None
        masked = None  # a decode graph's logits, masked: their maxima in a graph of their own
        behind = masks is not None and masks[2] is not None and self.decode_graphs is not None
        if masks is not None:
            rows, host, ticket = masks
            if argmax is not None:
                masked = functools.partial(self.decode_graphs.masked_max, len(seqs))
                self.decode_graphs.masked_graph(len(seqs), host.shape[1])
            if behind:  # copied beside the forward pass once the host has filled them (in pinned memory)
                host = self.decode_graphs.masks_behind(self.gate, ticket, host)
            elif ticket is not None:  # the device waits here until the host has filled them
                self.gate.wait(ticket)
            masks = rows, host  # (the device's copy behind the gate, or the host's buffer: the sampler copies that)
        result = self.sampler(logits, seqs, masks, argmax, masked)
        if behind:
            self.decode_graphs.masks_read()
        self._fed = (result.token_ids, seqs, table_rows)
        return result

    def forget(self) -> None:
        """Let go of the last launch's samples and sequences: nothing runs any more, so no token of it is pending."""
        self._fed = self._argmax = None

    def _eager(self, batch: ScheduledBatch, decode_only: bool, sample_rows: list[int],
               wanted: "prompt_logprobs.Wanted | None" = None) -> torch.Tensor | None:
        """The step outside the CUDA graphs: the logits at `sample_rows` (None when no row samples), and the
        prompt logprobs `wanted` on their sequences."""
        self.eager_steps += 1
        ids, positions, meta = self.pack_inputs(batch, decode_only)
        self._feed_back(ids[0], batch)
        keep = to_device(sample_rows, torch.long, self.device) if sample_rows else 1
        with forward_context(ForwardContext(self.kv_caches, meta, self.backend)), \
                prompt_logprobs.catch_hidden(self.model) if wanted else contextlib.nullcontext() as hidden:
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits[0]
        if wanted:
            prompt_logprobs.compute(self.model, hidden[-1][0], wanted)
        return logits if sample_rows else None

    def _feed_back(self, ids: torch.Tensor, batch: ScheduledBatch,
                   graph: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Write into the packed `ids` the tokens the previous launch sampled that the host has not read yet (a
        launch is read back whole: with overlap, every sequence of it that runs again; without, none). `graph`: a
        decode graph's step, its sequences' table rows and pending tokens."""
        if self._fed is None:
            return
        tokens, fed, fed_rows = self._fed
        seqs = batch.seqs
        if seqs == fed and batch.num_decode == len(seqs):  # steady decode: the same sequences in the same rows
            if seqs[0].num_pending_tokens:
                ids[:len(seqs)] = tokens
            return
        if graph is not None and fed_rows is not None:  # two decode graphs' steps: the table rows pair the sequences
            rows, pending = graph  # (a sequence keeps its row while it has a token pending)
            where = np.full(len(self.decode_graphs.tables.owners), -1, dtype=np.int64)
            where[fed_rows] = np.arange(len(fed_rows))
            src, dst = where[rows], np.arange(len(seqs))
        else:
            by_seq = {seq: row for row, seq in enumerate(fed)}
            src = np.fromiter((by_seq.get(seq, -1) for seq in seqs), np.int64, len(seqs))
            pending = np.fromiter(map(_pending, seqs), np.int64, len(seqs))
            dst = np.cumsum(batch.num_new_tokens) - 1  # its one pending token is its last input
        if (src[pending > 0] < 0).any():  # its token would be lost: a wrong input, not a quiet one
            raise RuntimeError("a sequence's pending token is not among the previous launch's samples")
        taken = (src >= 0) & (pending > 0)
        if taken.any():
            index = to_device(np.stack([dst[taken], src[taken]]), torch.long, self.device)
            ids[index[0]] = tokens[index[1]]

    def pack_inputs(self, batch: ScheduledBatch, decode_only: bool):
        """The batch as this runner's model inputs: (token ids, positions, attention metadata).

        Without a runner (the kernel benchmark), call input_packing.pack_inputs with the same layout."""
        return pack_inputs(batch, decode_only, block_size=self.block_size, backend_name=self.backend_name,
                           group=self.group, device=self.device, head_dim=self.head_dim)

    def uncompile(self) -> None:
        """Give the model back as it was loaded (for others that run it, such as the benchmark's peers)."""
        compilation.uncompile(self.model)
        fusion.unfuse(self.model)
        self.compiled, self.fused_layers, self.fused_mlps = False, 0, 0


def _gate(device: torch.device) -> HostGate | None:
    if device.type != "cuda":
        return None
    try:
        return HostGate(device)
    except (OSError, AttributeError, RuntimeError) as exc:  # (no such call in this driver)
        log.warning("the device cannot wait for the host (%s): a constrained step's sampler waits for its masks "
                    "on the host", exc)
        return None
