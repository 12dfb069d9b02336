"""Split decode attention (flash-decoding) on the GPU: the Triton kernel's decode launch with each sequence's
context in 1, 2, 4, 8 or 16 parts (and at least 1, 2 or 4 tiles of keys a part), timed inside a CUDA graph on
batches whose contexts vary as the serving workloads' do, against the policy's choice
(triton_attention.decode_splits) and the unsplit kernel. Bandwidth counts the KV read plus the queries and
outputs, as `bench kernel` does. Each configuration's output is checked against the float32 PyTorch oracle.

  python3 tests/gpu/kernels/decode_split_sweep.py
"""

import argparse
import itertools
import random

import torch
import triton
from triton.testing import do_bench_cudagraph

from service.bench.kernel import roofline
from service.bench.kernel.ops import scattered_batch
from service.engine.runner import triton_attention
from service.engine.runner.attention import torch_paged_attention
from service.engine.runner.input_packing import pack_inputs

# (name, batch, lowest context, highest context): the mixed workload's decode steps from first (256 sequences
# over [100, 1024] prompts) to its tail (few sequences, long contexts), 128/128's, and one request's
CASES = [("mixed-start", 256, 100, 1100), ("mixed-middle", 128, 600, 1700), ("mixed-late", 64, 900, 2000),
         ("mixed-tail", 16, 1500, 2040), ("uniform-1024", 256, 1024, 1024), ("128/128", 256, 129, 255),
         ("one-request", 1, 600, 600)]


def batch_of(batch: int, low: int, high: int, kv_heads: int, head_dim: int, rng: random.Random, layout: str):
    """A decode batch (one new token a sequence, contexts uniform in [low, high], pages shuffled) and its key and
    value caches, random, in `layout`: nhd or hnd (heads outside tokens), -fp8 for float8 e4m3 values."""
    contexts = [rng.randint(low, high) for _ in range(batch)]
    sched, pages = scattered_batch([(c - 1, 1) for c in contexts], rng)
    dtype = torch.float8_e4m3fn if "fp8" in layout else torch.bfloat16
    if "hnd" in layout:  # heads outside tokens in memory: one head's 16 tokens of a page are contiguous
        k, v = (torch.randn(pages, kv_heads, 16, head_dim, device="cuda").to(dtype).transpose(1, 2)
                for _ in range(2))
    else:
        k, v = (torch.randn(pages, 16, kv_heads, head_dim, device="cuda").to(dtype) for _ in range(2))
    return sched, k, v, contexts


def main():
    """Time each configuration for every case, head dim and layout; one line each."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--layouts", default="nhd,hnd,nhd-fp8,hnd-fp8")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    ap.add_argument("--full", action="store_true", help="every split configuration (else unsplit and the policy's)")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    _, peak_bw = roofline.device_peak(name, "bf16")
    print(name, "torch", torch.__version__, "triton", triton.__version__, "peak GB/s", peak_bw)
    for head_dim, (case, batch, low, high), layout in itertools.product(
            map(int, args.head_dims.split(",")), CASES, args.layouts.split(",")):
        if case not in args.cases.split(","):
            continue
        heads, kv_heads = 32, 8
        rng = random.Random(f"{head_dim} {case}")  # every layout of a case gets the same contexts and pages
        sched, k_cache, v_cache, contexts = batch_of(batch, low, high, kv_heads, head_dim, rng, layout)
        meta = pack_inputs(sched, True, block_size=16, backend_name="triton", group=heads // kv_heads,
                           device=torch.device("cuda"))[2]
        ref_meta = pack_inputs(sched, True, block_size=16, backend_name="torch", group=heads // kv_heads,
                               device=torch.device("cuda"))[2]
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        scale = head_dim ** -0.5
        expected = torch_paged_attention(q.float(), k_cache.float(), v_cache.float(), ref_meta, scale)
        scale_err = expected.abs().max().item()
        nbytes = 2 * 2 * batch * heads * head_dim + k_cache.element_size() * 2 * kv_heads * head_dim * sum(contexts)
        block_n, wide_n, warps, stages = triton_attention.launch_config(meta.block_m, head_dim)
        policy = (triton_attention.decode_splits(batch, kv_heads), triton_attention.MIN_TILES)
        results = {}
        candidates = [(bn, max(bn, wide_n), warps, stages, splits, min_tiles) for splits, min_tiles, bn in
                      itertools.product((1, 2, 4, 8, 16), (1, 2, 4), (32, 64))] if args.full else \
            [(block_n, wide_n, warps, stages, 1, 1), (block_n, wide_n, warps, stages, *policy)]
        candidates += [(bn, bn, w, st, 1, 1) for bn, w, st in itertools.product((64, 128), (4, 8), (2, 3))]
        for config in candidates:
            if config[4] == 1 and config[5] > 1 or config in results:
                continue
            run = lambda: triton_attention.triton_paged_attention(q, k_cache, v_cache, meta, scale, config=config)
            error = (run().float() - expected).abs().max().item()
            if not error < 2e-2 * max(1.0, scale_err):
                print(f"WRONG {config}: error {error:.3g}")
                continue
            results[config] = do_bench_cudagraph(run, rep=30) / 1e3
        ranked = sorted(results, key=results.get)
        share = lambda c: nbytes / results[c] / 1e9 / peak_bw
        unsplit = (block_n, wide_n, warps, stages, 1, 1)
        chosen = (block_n, wide_n, warps, stages, *policy) if policy[0] > 1 else unsplit
        print(f"{layout} dim {head_dim} {case} (batch {batch}, contexts {low}-{high}): "
              f"unsplit {results[unsplit] * 1e6:.1f} us "
              f"({share(unsplit):.0%} BW); policy {policy} {results[chosen] * 1e6:.1f} us ({share(chosen):.0%}); "
              f"best {ranked[0]} {results[ranked[0]] * 1e6:.1f} us ({share(ranked[0]):.0%}); next "
              + ", ".join(f"{c} {results[c] * 1e6:.1f}" for c in ranked[1:4]), flush=True)


if __name__ == "__main__":
    main()
