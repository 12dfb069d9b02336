"""cuDNN's fused attention (its Hopper kernel, the one PyTorch's dense SDPA runs) over this project's paged cache:
`bench kernel`'s `cudnn-paged`, where the cuDNN frontend's Python package (`nvidia-cudnn-frontend`) is installed.

cuDNN reads the engine's CUDA cache as it lies in memory: a container of pages [pages, KV heads, page, head dim]
(heads outside tokens), one page table per sequence, the queries and the output packed [tokens, heads, head dim]
with an offset per sequence (cuDNN's "ragged" layout), a padding mask from each sequence's query and context
lengths, and the causal diagonal aligned to the last key (bottom right), so that a chunk after cached tokens sees
them all.

Not the engine's kernel (docs/log/2026-11.md, H100): with 128-wide heads its prefill is 1.3-1.6x faster than ours,
with 64-wide heads no faster, and over a step of prompts and decode tokens 1.9-3.0x slower; a graph is built for
each shape (sequences, longest query, longest context), 50-100 ms, 0.5-1.1 s where a kernel compiles.
"""

import functools
from typing import Callable

import torch

from service.engine.runner.attention import AttentionMetadata

_DTYPES = {torch.float16: "HALF", torch.bfloat16: "BFLOAT16"}


@functools.cache
def _cudnn():
    """The cuDNN frontend module, or None where it is not installed or cuDNN is older than 9.8 (paged keys and
    values with packed queries)."""
    try:
        import cudnn
    except ImportError:
        return None
    return cudnn if cudnn.backend_version() >= 90800 else None


def unsupported(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why cuDNN cannot run this attention here (one line), or None where it can."""
    if q.device.type != "cuda":
        return "cudnn-paged: needs a CUDA GPU"
    if _cudnn() is None:
        return "cudnn-paged: the cuDNN frontend (nvidia-cudnn-frontend) is not installed, or cuDNN is older than 9.8"
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype:
        return f"cudnn-paged: queries and cache in float16 or bfloat16 only, not {q.dtype} over {k_cache.dtype}"
    return None


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> Callable[[], torch.Tensor]:
    """Build cuDNN's graph for this batch and return a call that runs it: the attention of the packed queries q
    [tokens, heads, head dim] over the cache (indexed [pages, page, KV heads, head dim] as the engine's), as
    triton_paged_attention computes it, into a new [tokens, heads, head dim]. Check `unsupported` first."""
    cudnn = _cudnn()
    io, i32 = getattr(cudnn.data_type, _DTYPES[q.dtype]), cudnn.data_type.INT32
    heads, head_dim = q.shape[1:]
    container_k, container_v = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # [pages, KV heads, page, dim]
    starts, b = meta.query_start_loc, meta.query_start_loc.shape[0] - 1
    inputs = {"offsets": (starts * (heads * head_dim)).view(b + 1, 1, 1, 1),  # in elements
              "len_q": (starts[1:] - starts[:-1]).view(b, 1, 1, 1), "len_kv": meta.seq_lens.view(b, 1, 1, 1),
              "table": meta.block_tables.view(b, 1, -1, 1), "k": container_k, "v": container_v}

    handle = cudnn.create_handle()
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    t = {name: g.tensor(name=name, dim=list(x.shape), stride=list(x.stride()),
                        data_type=io if x.is_floating_point() else i32) for name, x in inputs.items()}
    s_q = meta.max_query_len
    packed = dict(dim=[b, heads, s_q, head_dim], stride=[s_q * heads * head_dim, head_dim, heads * head_dim, 1])
    t["q"] = g.tensor(name="q", data_type=io, ragged_offset=t["offsets"], **packed)
    o, _ = g.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=False, attn_scale=scale,
                  use_padding_mask=True, seq_len_q=t["len_q"], seq_len_kv=t["len_kv"],
                  use_causal_mask_bottom_right=True, paged_attention_k_table=t["table"],
                  paged_attention_v_table=t["table"], paged_attention_max_seq_len_kv=meta.max_seq_len)
    o.set_output(True).set_data_type(io).set_dim(packed["dim"]).set_stride(packed["stride"])
    o.set_ragged_offset(t["offsets"])
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=q.device)
    q = q.contiguous()

    def run() -> torch.Tensor:
        out = torch.empty_like(q)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        g.execute({t["q"]: q, o: out, **{t[name]: x for name, x in inputs.items()}}, workspace, handle=handle)
        return out
    return run
