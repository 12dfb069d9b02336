"""The attention operations `bench kernel` compares, their inputs, and the float64 oracle.

Every operation gets the same dense q [B, H, Q, D], k and v [B, KVH, K, D] (prefill: Q = K, causal; decode:
one query per sequence over K cached tokens) and returns [B, H, Q, D]; its own layout (a paged cache,
packed tokens) is built before the clock starts. An operation that cannot run a shape raises Unsupported.
"""

import itertools
import random
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BLOCK_SIZE = 16  # tokens per KV-cache block, as the engine's default


class Unsupported(Exception):
    """This operation cannot run this shape here; the message says why (one line)."""


@dataclass(frozen=True)
class Shape:
    phase: str  # prefill or decode
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    dtype: str

    @property
    def queries(self) -> int:
        return self.context if self.phase == "prefill" else 1

    def check(self) -> None:
        if self.phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be prefill or decode, got {self.phase!r}")
        if min(self.batch, self.heads, self.kv_heads, self.head_dim, self.context) < 1:
            raise ValueError(f"every dimension must be positive: {self}")
        if self.heads % self.kv_heads:
            raise ValueError(f"query heads ({self.heads}) must be a multiple of KV heads ({self.kv_heads})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


def make_inputs(shape: Shape, device: torch.device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dt = DTYPES[shape.dtype]

    def rand(heads, length):
        return torch.randn(shape.batch, heads, length, shape.head_dim, generator=gen).to(device=device, dtype=dt)

    return rand(shape.heads, shape.queries), rand(shape.kv_heads, shape.context), rand(shape.kv_heads, shape.context)


def reference(q, k, v, causal: bool) -> torch.Tensor:
    """Plain attention in the inputs' dtype: scores, mask, softmax, weighted sum (the float64 oracle too)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:  # query i sits at position K - Q + i
        qlen, klen = q.shape[2], k.shape[2]
        keep = torch.arange(klen, device=q.device) <= torch.arange(klen - qlen, klen, device=q.device)[:, None]
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v


def oracle(q, k, v, causal: bool) -> torch.Tensor:
    """float64 attention, one sequence at a time (a long context's float64 scores are large)."""
    return torch.cat([reference(q[i:i + 1].double(), k[i:i + 1].double(), v[i:i + 1].double(), causal)
                      for i in range(q.shape[0])])


def _sdpa(backend_name: str):
    def build(shape: Shape, q, k, v) -> Callable:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = getattr(SDPBackend, backend_name)
        causal, gqa = shape.phase == "prefill", shape.heads != shape.kv_heads

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        try:
            run()
        except RuntimeError as exc:  # no kernel of this backend for this device, dtype or head dim
            raise Unsupported(f"{backend_name}: " + str(exc).strip().splitlines()[0].split(". ")[0][:160]) from None
        return run
    return build


FLEX_ON_CPU = False  # set when flex is asked for by name: on CPU, inductor takes minutes to compile each shape
_flex_compiled = None


def _flex(shape: Shape, q, k, v) -> Callable:
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if q.device.type != "cuda" and not FLEX_ON_CPU:
        raise Unsupported("compiling flex_attention on CPU takes minutes per shape; ask for it with --ops flex")
    _flex_compiled = _flex_compiled or torch.compile(flex_attention)  # as PyTorch's docs use it
    offset = shape.context - shape.queries
    block_mask = create_block_mask(lambda b, h, qi, ki: qi + offset >= ki, B=None, H=None, Q_LEN=shape.queries,
                                   KV_LEN=shape.context, device=q.device.type)
    gqa = shape.heads != shape.kv_heads
    try:
        _flex_compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    except Exception as exc:  # inductor refuses a shape (head dim, tiny query length) with many error types
        raise Unsupported(f"flex_attention: {str(exc).strip().splitlines()[0][:200]}") from None
    return lambda: _flex_compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def scattered_batch(shapes: list[tuple[int, int]], rng: random.Random, block_size: int = BLOCK_SIZE):
    """A scheduled batch of sequences, each (tokens already cached, new tokens), whose pages of `block_size` tokens
    are drawn from a shuffled cache, as a long-running cache has them; page 0 stays unused (the engine's scratch
    page). Returns the batch and the number of pages its cache needs (page 0 included)."""
    from service.engine.sampling import SamplingParams
    from service.engine.scheduler import ScheduledBatch
    from service.engine.sequence import Sequence

    pages = [-(-(context + new) // block_size) for context, new in shapes]
    free = list(range(1, sum(pages) + 1))
    rng.shuffle(free)
    seqs = []
    for i, ((context, new), n) in enumerate(zip(shapes, pages)):
        seq = Sequence(f"s{i}", [0] * (context + new), SamplingParams())
        seq.num_computed_tokens, seq.block_table = context, [free.pop() for _ in range(n)]
        seqs.append(seq)
    return ScheduledBatch(seqs, [new for _, new in shapes], []), sum(pages) + 1


def paged_inputs(shape: Shape, q, k, v, backend: str):
    """A dense shape in this project's layout: (packed queries [tokens, heads, head dim], key cache, value cache,
    the attention metadata for `backend` (torch or triton), the scheduled batch), the cache's pages scattered and
    laid out in memory as the engine's on this device."""
    from service.engine.runner.input_packing import pack_inputs
    from service.engine.runner.kv_cache import cache_tensor

    device, b, qlen, klen = q.device, shape.batch, shape.queries, shape.context
    batch, num_pages = scattered_batch([(klen - qlen, qlen)] * b, random.Random(0))
    k_cache, v_cache = (cache_tensor(num_pages, BLOCK_SIZE, shape.kv_heads, shape.head_dim, q.dtype, device)
                        for _ in "kv")
    pos = torch.arange(klen, device=device)
    for i, seq in enumerate(batch.seqs):
        pages = torch.tensor(seq.block_table, device=device)[pos // BLOCK_SIZE]
        k_cache[pages, pos % BLOCK_SIZE] = k[i].transpose(0, 1)
        v_cache[pages, pos % BLOCK_SIZE] = v[i].transpose(0, 1)
    meta = pack_inputs(batch, shape.phase == "decode", block_size=BLOCK_SIZE, backend_name=backend,
                       group=shape.heads // shape.kv_heads, device=device, head_dim=shape.head_dim)[2]
    packed = q.transpose(1, 2).reshape(b * qlen, shape.heads, shape.head_dim).contiguous()
    return packed, k_cache, v_cache, meta, batch


def _dense(shape: Shape, out: torch.Tensor) -> torch.Tensor:
    """A paged operation's packed output [tokens, heads, head dim] as the dense operations' [B, H, Q, D]."""
    return out.view(shape.batch, shape.queries, shape.heads, -1).transpose(1, 2)


def _paged(shape: Shape, q, k, v) -> Callable:
    """This project's paged attention: Triton on CUDA, the PyTorch reference backend on CPU."""
    if q.device.type == "cuda":
        from service.engine.runner import triton_attention
        backend, kernel = "triton", triton_attention.triton_paged_attention
    else:
        from service.engine.runner.attention import torch_paged_attention
        backend, kernel = "torch", torch_paged_attention
    packed, k_cache, v_cache, meta, _ = paged_inputs(shape, q, k, v, backend)
    scale = shape.head_dim ** -0.5
    return lambda: _dense(shape, kernel(packed, k_cache, v_cache, meta, scale))


def _cudnn_paged(shape: Shape, q, k, v) -> Callable:
    """cuDNN's fused attention over the same paged cache as `paged` (kernel/cudnn_paged.py), prefill only: where
    the cuDNN frontend is installed."""
    from service.bench.kernel import cudnn_paged
    if shape.phase != "prefill":
        raise Unsupported("cudnn-paged: prefill only")
    if why := cudnn_paged.unsupported(q, k):
        raise Unsupported(why)
    packed, k_cache, v_cache, meta, _ = paged_inputs(shape, q, k, v, "triton")
    try:
        run = cudnn_paged.paged_prefill(packed, k_cache, v_cache, meta, shape.head_dim ** -0.5)
        run()
    except Exception as exc:  # noqa: BLE001 - cuDNN has no engine for this shape here
        raise Unsupported(f"cudnn-paged: {str(exc).strip().splitlines()[0][:300]}") from None
    return lambda: _dense(shape, run())


def _flashinfer(backend: str):
    """FlashInfer's kernels over the same paged cache as `paged` (FlashInfer's "HND" layout is the engine's CUDA
    cache, heads outside tokens). `backend` "auto": its batch prefill (FlashAttention-3's kernels on Hopper) and its
    batch decode kernel; "fa2": its FlashAttention-2 prefill kernel in both phases (at decode, one query at the end
    of each context: what its decode wrapper runs with tensor cores). Runs where flashinfer-python is installed
    (tests/gpu/kernels/flashinfer_wheels.sh); its kernels compile on first use, with the machine's nvcc."""
    def build(shape: Shape, q, k, v) -> Callable:
        if q.device.type != "cuda":
            raise Unsupported("flashinfer: needs a CUDA GPU")
        try:
            import flashinfer
        except ImportError:
            raise Unsupported("flashinfer: not installed (tests/gpu/kernels/flashinfer_wheels.sh)") from None
        packed, k_cache, v_cache, _, batch = paged_inputs(shape, q, k, v, "triton")
        device, b, qlen = q.device, shape.batch, shape.queries
        tables = [seq.block_table for seq in batch.seqs]
        as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=device)
        pages = (as_int([0, *itertools.accumulate(len(t) for t in tables)]), as_int([p for t in tables for p in t]),
                 as_int([(shape.context - 1) % BLOCK_SIZE + 1] * b))  # indptr, page indices, last page's length
        layout = (shape.heads, shape.kv_heads, shape.head_dim, BLOCK_SIZE)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        cache = (k_cache.transpose(1, 2), v_cache.transpose(1, 2))  # [pages, KV heads, page, head dim]
        try:
            if shape.phase == "decode" and backend == "auto":
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
                wrapper.plan(*pages, *layout, q_data_type=q.dtype, kv_data_type=q.dtype)
            else:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND", backend=backend)
                wrapper.plan(as_int([i * qlen for i in range(b + 1)]), *pages, *layout, causal=True,
                             q_data_type=q.dtype, kv_data_type=q.dtype)
            wrapper.run(packed, cache)
        except Exception as exc:  # noqa: BLE001 - no kernel for this dtype or head dim, or its build failed
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            why = next((line for line in lines if "error" in line.lower()), lines[0])  # a failed build's first error
            raise Unsupported(f"flashinfer {backend}: {why.strip()[:300]}") from None
        return lambda: _dense(shape, wrapper.run(packed, cache))
    return build


def _plain(shape: Shape, q, k, v) -> Callable:
    return lambda: reference(q, k, v, shape.phase == "prefill")


OPS: dict[str, Callable] = {
    "paged": _paged,
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    "sdpa-efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-math": _sdpa("MATH"),
    "flex": _flex,
    "cudnn-paged": _cudnn_paged,
    "flashinfer": _flashinfer("auto"),
    "flashinfer-fa2": _flashinfer("fa2"),
    "reference": _plain,
}

