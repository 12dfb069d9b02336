"""Prefill attention over the paged cache at several page sizes, cuDNN's fused attention
(bench kernel's `cudnn-paged`: kernel/cudnn_paged.py) and our Triton kernel, beside cuDNN's dense SDPA over
contiguous [B, H, S, D] tensors (bench kernel's `sdpa-cudnn`); median of 64 calls, L2 flushed before each (bench
kernel's clock), and the time of the first call, which builds cuDNN's graph. Then a step of prompts and decode
tokens. The two paged kernels' largest difference is printed (a wrong one shows as a large number).

    python3 tests/gpu/kernels/cudnn_pages.py [--pages 16,32,64,128]
"""

import argparse
import random
import statistics
import time

import torch

from service.bench.kernel import ops
from service.bench.kernel.cudnn_paged import paged_prefill
from service.bench.kernel.timing import time_calls
from service.engine.runner.input_packing import pack_inputs
from service.engine.runner.kv_cache import cache_tensor
from service.engine.runner.triton_attention import triton_paged_attention

ap = argparse.ArgumentParser()
ap.add_argument("--pages", default="16,32,64,128")
ap.add_argument("--batch", type=int, default=4)
args = ap.parse_args()
dev, dt, heads, kv_heads = torch.device("cuda"), torch.bfloat16, 32, 8


def ms(fn):
    return statistics.median(time_calls(fn, dev, warmup=8, repeats=64)) * 1e3


def paged_pair(shapes, q, page: int, seed: int):
    """Our kernel's and cuDNN's time over one cache of `page`-token pages for sequences of (cached, new) tokens and
    their packed queries q: (ours ms, cuDNN ms, their largest difference, cuDNN's first call in s)."""
    batch, pages = ops.scattered_batch(shapes, random.Random(seed), block_size=page)
    kc, vc = (cache_tensor(pages, page, kv_heads, q.shape[-1], dt, dev).normal_() for _ in "kv")
    meta = pack_inputs(batch, False, block_size=page, backend_name="triton", group=heads // kv_heads, device=dev)[2]
    scale = q.shape[-1] ** -0.5
    start = time.perf_counter()
    cudnn = paged_prefill(q, kc, vc, meta, scale)
    cudnn()
    torch.cuda.synchronize()
    build = time.perf_counter() - start
    ours = lambda: triton_paged_attention(q, kc, vc, meta, scale)
    return ms(ours), ms(cudnn), (ours().float() - cudnn().float()).abs().max().item(), build


for dim in (64, 128):
    for n in (1024, 4096):
        shape = ops.Shape("prefill", args.batch, heads, kv_heads, dim, n, "bf16")
        q, k, v = ops.make_inputs(shape, dev)
        dense = ms(ops.OPS["sdpa-cudnn"](shape, q, k, v))
        packed = q.transpose(1, 2).reshape(-1, heads, dim).contiguous()
        for page in (int(p) for p in args.pages.split(",")):
            ours, cud, diff, build = paged_pair([(0, n)] * args.batch, packed, page, seed=0)
            print(f"head {dim} tokens {n} page {page:3d}: dense cuDNN {dense:.3f} ms | cuDNN paged {cud:.3f} "
                  f"({cud / dense:.2f}x) | ours {ours:.3f} ({ours / dense:.2f}x) | max diff {diff:.1e} | "
                  f"first call (graph build) {build * 1e3:.0f} ms", flush=True)

# a mixed step of the mixed workload: 7 prompts of 1,000 tokens and 138 decode tokens over 100-1,500 cached
rng = random.Random(0)
shapes = [(0, 1000)] * 7 + [(rng.randint(100, 1500), 1) for _ in range(138)]
for dim in (64, 128):
    packed = torch.randn(sum(n for _, n in shapes), heads, dim, device=dev, dtype=dt)
    ours, cud, diff, _ = paged_pair(shapes, packed, 16, seed=1)
    print(f"head {dim} mixed step (7 x 1,000 prompt tokens, 138 decodes): cuDNN paged {cud:.3f} ms | ours "
          f"{ours:.3f} | max diff {diff:.1e}", flush=True)
