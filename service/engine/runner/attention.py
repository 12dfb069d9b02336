"""Attention over the paged KV cache, plugged into unchanged transformers models.

The runner packs every token of a step into one row ([1, T]) and sets a forward context; the
registered attention function hands the chosen backend the queries and the new keys and values: the backend
writes the keys and values into the cache slots of that row and attends each sequence's queries to its own
cached context through its block table.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.models.llama import modeling_llama as llama

ATTN_IMPLEMENTATION = "service_paged"


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: context length of each sequence after this step
    query_start_loc: torch.Tensor  # [S + 1] int32: offsets of each sequence's tokens in the row
    max_query_len: int
    max_seq_len: int
    # torch backend: padded query layout
    query_index: torch.Tensor | None = None  # [S, max_query_len] int64 into the row (0 where padded)
    query_valid: torch.Tensor | None = None  # [S, max_query_len] bool
    query_pos: torch.Tensor | None = None  # [S, max_query_len] int64 absolute positions
    # triton backend: work tiles
    tile_seq: torch.Tensor | None = None  # [num_tiles] int32
    tile_qstart: torch.Tensor | None = None  # [num_tiles] int32
    block_m: int = 16
    table_rows: torch.Tensor | None = None  # [S] int32: each sequence's row of block_tables (None: row i; triton)


@dataclass
class ForwardContext:
    # per layer, indexed [num_blocks, block_size, kv_heads, head_dim] (in memory: kv_cache.cache_tensor)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata
    backend: Callable


_context: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext):
    global _context
    _context, previous = ctx, _context
    try:
        yield
    finally:
        _context = previous


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, rotary=None, **kwargs):
    """transformers attention interface: query [1, H, T, D], key/value [1, KVH, T, D] -> [1, T, H, D].

    `rotary`: (cos, sin) [T, D] when the queries and keys come unturned (engine/fusion.py): the backend turns them
    by the rotary embedding as it reads the queries and writes the keys (rotate_half's convention), instead of a
    pass of their own over both.
    Inside a compiled decoder layer it is one custom op (below), so that dynamo traces the layer as one graph."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cos, sin = rotary if rotary is not None else (None, None)
    if torch.compiler.is_compiling():
        out = paged_attention(query, key, value, module.paged_layer, scale, sliding_window or 0, softcap or 0.0,
                              cos, sin)
    else:
        out = _attend(module.layer_idx, query, key, value, scale, sliding_window, softcap, rotary)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def _attend(layer: int, query, key, value, scale, sliding_window, softcap, rotary=None) -> torch.Tensor:
    """The step's keys and values into layer `layer`'s cache, and its queries' attention: [T, H, D]."""
    ctx = _context
    k_cache, v_cache = ctx.kv_caches[layer]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    return ctx.backend(q, k_cache, v_cache, ctx.meta, scale, sliding_window, softcap, new_kv=(k, v), rotary=rotary)


@torch.library.custom_op("llm_service::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor, scale: float,
                    sliding_window: int, softcap: float, cos: torch.Tensor | None,
                    sin: torch.Tensor | None) -> torch.Tensor:
    """Paged attention as compiled layers see it: an opaque op, whose cache and metadata it finds in the forward
    context when it runs (as vLLM's attention op does), so that its writes into the cache are not the graph's
    business. The layer comes as a 0-d CPU tensor (runner/compilation.py gives each attention module its own,
    `paged_layer`): dynamo would make an int attribute a constant and compile the same layer once per index."""
    # contiguous, as the fake below says (the backends' output has the queries' layout, which the graph chose)
    rotary = (cos, sin) if cos is not None else None
    return _attend(int(layer), query, key, value, scale, sliding_window or None, softcap or None, rotary).contiguous()


@paged_attention.register_fake
def _(query, key, value, layer, scale, sliding_window, softcap, cos, sin):
    return query.new_empty(query.shape[2], query.shape[1], value.shape[-1])


def cache_limit(dtype: torch.dtype) -> float:
    """The largest magnitude a cache of this dtype takes, keys and values beyond it clamped to it: an 8-bit float
    type's range (a plain cast stores what lies beyond as inf in e5m2, and may as NaN in e4m3, which has no inf);
    0.0 for wider types, which are cast as they are."""
    return torch.finfo(dtype).max if dtype.itemsize == 1 else 0.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values in the cache's dtype (clamped to cache_limit)."""
    if top := cache_limit(dtype):
        x = x.clamp(-top, top)
    return x.to(dtype)


def torch_paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                          sliding_window: int | None = None, softcap: float | None = None,
                          new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                          rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Reference backend in plain PyTorch: gather each sequence's context, pad, one masked SDPA call.

    Every backend takes the same arguments: `new_kv`, this step's keys and values [tokens, KV heads, head dim],
    goes into the cache at meta.slot_mapping before the queries attend (here by indexing, whatever the cache's
    layout in memory: kv_cache.cache_tensor); `rotary`, (cos, sin) [tokens, head dim], turns the queries and the
    new keys first (paged_attention_forward; it comes with new_kv)."""
    if rotary is not None:  # [T, heads, D] against [T, D]: the Llama family's own operations, in q's dtype
        q, k = llama.apply_rotary_pos_emb(q, new_kv[0], *rotary, unsqueeze_dim=1)
        new_kv = (k, new_kv[1])
    if new_kv is not None:
        blocks, offsets = meta.slot_mapping // k_cache.shape[1], meta.slot_mapping % k_cache.shape[1]
        for cache, new in zip((k_cache, v_cache), new_kv):
            cache[blocks, offsets] = to_cache_dtype(new, cache.dtype)
    num_seqs = meta.seq_lens.shape[0]
    num_heads, kv_heads, head_dim = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    block_size, length = k_cache.shape[1], meta.max_seq_len
    nblocks = -(-length // block_size)
    tables = meta.block_tables[:, :nblocks].long()
    keys, values = (cache[tables].reshape(num_seqs, nblocks * block_size, kv_heads, head_dim)[:, :length]
                    .transpose(1, 2).to(q.dtype) for cache in (k_cache, v_cache))  # an 8-bit cache widens here
    queries = q[meta.query_index].transpose(1, 2)  # [S, H, Q, D]

    key_pos = torch.arange(length, device=q.device)
    qpos = meta.query_pos[:, :, None]
    mask = key_pos <= qpos
    if sliding_window:
        mask &= key_pos > qpos - sliding_window
    mask[:, :, 0] |= ~meta.query_valid  # padded rows attend to something, and are dropped below
    mask = mask[:, None]

    if softcap:
        group = num_heads // kv_heads
        scores = queries.float() @ keys.float().repeat_interleave(group, 1).transpose(-1, -2) * scale
        scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out = (probs @ values.float().repeat_interleave(group, 1)).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=num_heads != kv_heads)
    return out.transpose(1, 2)[meta.query_valid]
