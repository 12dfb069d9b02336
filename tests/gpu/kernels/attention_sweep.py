"""The Triton paged-attention kernel on the engine's shapes, three questions at once, each launch timed
inside a CUDA graph after its output is checked against the float32 PyTorch oracle:
  - launch configurations (BLOCK_M for prefill, BLOCK_N, WIDE_N, warps, stages) around
    triton_attention.launch_config's;
  - tiles longest first (input_packing.build_tiles given the contexts, as the engine runs them) against sequence
    order;
  - this code's kernel against the code before's (--base: its triton_attention.py, from a copy of its service/),
    each with its own launch_config.
Decode cases are batches whose contexts vary as the serving workloads' do, prefill cases packed prompts (and, for
equal lengths, cuDNN's dense SDPA on the same shape: the fastest kernel measured there). Bandwidth and FLOPs as
`bench kernel` counts them; one line per case, every timing in --json.

  python3 tests/gpu/kernels/attention_sweep.py --base .base/service/engine/runner/triton_attention.py --json out.json
  python3 tests/gpu/kernels/attention_sweep.py --current-only --base ...   # only the configuration in use: an A/B
"""

import argparse
import dataclasses
import importlib.util
import itertools
import json
import random

import numpy as np
import torch
import triton
from triton.testing import do_bench_cudagraph

from service.bench.kernel import ops, roofline
from service.engine.runner import triton_attention
from service.engine.runner.attention import torch_paged_attention
from service.engine.runner.input_packing import block_m_for, build_tiles, pack_inputs
from service.engine.runner.kv_cache import cache_tensor

HEADS, KV_HEADS = 32, 8
# decode: (name, batch, lowest context, highest context); prefill: (name, [(cached, new) per sequence])
DECODE = [("mixed-start", 256, 100, 1100), ("mixed-middle", 128, 600, 1700), ("uniform-1024", 256, 1024, 1024),
          ("128/128", 256, 129, 255)]
rng0 = random.Random(0)
PREFILL = [("4x1024", [(0, 1024)] * 4), ("4x4096", [(0, 4096)] * 4),
           ("14 of 188-991", [(0, rng0.randint(188, 991)) for _ in range(14)]),
           ("4x2048", [(0, 2048)] * 4), ("8,192 after 8,192", [(8192, 8192)]),
           ("mixed step: 7,000 prompt tokens + 138 decodes",
            [(0, 1000)] * 7 + [(rng0.randint(100, 1500), 1) for _ in range(138)])]


def load_base(path: str):
    spec = importlib.util.spec_from_file_location("base_triton_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case_inputs(shapes, head_dim: int, seed: str):
    """(scheduled batch, key cache, value cache, queries) for sequences of (cached, new) tokens, cache pages
    scattered, laid out as the engine's."""
    batch, pages = ops.scattered_batch(shapes, random.Random(seed))
    k, v = (cache_tensor(pages, 16, KV_HEADS, head_dim, torch.bfloat16, torch.device("cuda")) for _ in "kv")
    k.normal_(), v.normal_()
    tokens = sum(new for _, new in shapes)
    return batch, k, v, torch.randn(tokens, HEADS, head_dim, device="cuda", dtype=torch.bfloat16)


def with_tiles(meta, batch, block_m: int, longest_first: bool):
    q_lens = np.asarray(batch.num_new_tokens, np.int32)
    contexts = np.asarray([s.num_computed_tokens for s in batch.seqs], np.int32) if longest_first else None
    tile_seq, tile_qstart = build_tiles(q_lens, max(1, block_m // (HEADS // KV_HEADS)), contexts)
    return dataclasses.replace(meta, block_m=block_m, tile_seq=torch.from_numpy(tile_seq).cuda(),
                               tile_qstart=torch.from_numpy(tile_qstart).cuda())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="", help="the code before's triton_attention.py")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--phases", default="decode,prefill")
    ap.add_argument("--json", default="")
    ap.add_argument("--current-only", action="store_true", help="only the configuration in use (with --base: A/B)")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    peak_flops, peak_bw = roofline.device_peak(name, "bf16")
    print(name, "torch", torch.__version__, "triton", triton.__version__, flush=True)
    codes = {"new": triton_attention}
    if args.base:
        codes["base"] = load_base(args.base)
    records = []
    for phase, head_dim in itertools.product(args.phases.split(","), map(int, args.head_dims.split(","))):
        cases = [(c, [(rng.randint(lo, hi) - 1, 1) for _ in range(b)]) for c, b, lo, hi in DECODE
                 for rng in [random.Random(c)]] if phase == "decode" else PREFILL
        for case, shapes in cases:
            batch, k_cache, v_cache, q = case_inputs(shapes, head_dim, f"{case} {head_dim}")
            decode = phase == "decode"
            meta = pack_inputs(batch, decode, block_size=16, backend_name="triton", group=HEADS // KV_HEADS,
                               device=torch.device("cuda"), head_dim=head_dim)[2]
            ref_meta = pack_inputs(batch, decode, block_size=16, backend_name="torch", group=HEADS // KV_HEADS,
                                   device=torch.device("cuda"))[2]
            scale = head_dim ** -0.5
            expected = torch_paged_attention(q.float(), k_cache.float(), v_cache.float(), ref_meta, scale)
            kv_tokens = sum(c + n for c, n in shapes)
            nbytes = 2 * 2 * q.numel() + 2 * 2 * KV_HEADS * head_dim * kv_tokens
            flops = sum(4 * HEADS * head_dim * n * (c + (n + 1) / 2) for c, n in shapes)
            default_m = meta.block_m
            current = (default_m, *triton_attention.launch_config(default_m, head_dim))
            # (BLOCK_M, BLOCK_N, WIDE_N, warps, stages)
            configs = [current] if args.current_only else [current] + ([(16, bn, wn, w, st) for bn, wn, w, st in [
                (64, 64, 4, 2), (64, 128, 4, 2), (128, 128, 4, 2), (64, 128, 2, 2), (32, 128, 4, 2), (64, 128, 4, 3),
                (64, 64, 2, 2), (32, 32, 2, 3)]] if decode else
                [(bm, bn, bn, w, st) for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))])
            results = {}
            for code, config, longest in itertools.product(codes, configs, (False, True)):
                if code == "base" and config != current or (code, config, longest) in results:
                    continue
                # the code before as the engine ran it: its own tile rows (no long prefill tiles) and launch
                module, block_m = codes[code], config[0] if code == "new" else block_m_for(HEADS // KV_HEADS, decode)
                launch = tuple(config[1:]) if code == "new" else module.launch_config(block_m, head_dim)
                m = with_tiles(meta, batch, block_m, longest)
                run = lambda: module.triton_paged_attention(q, k_cache, v_cache, m, scale,
                                                            config=(*launch, 1, 1) if decode else launch)
                try:
                    error = (run().float() - expected).abs().max().item()
                    if not error < 2e-2:
                        print(f"  WRONG {code} {config} longest-first {longest}: error {error:.3g}", flush=True)
                        continue
                    results[(code, config, longest)] = t = do_bench_cudagraph(run, rep=30) / 1e3
                except Exception as exc:  # noqa: BLE001 - configurations over the shared memory or registers
                    if "OutOfResources" not in type(exc).__name__ and "shared memory" not in str(exc):
                        raise
                    continue
                records.append(dict(phase=phase, head_dim=head_dim, case=case, code=code, config=config,
                                    launch=launch, longest_first=longest, seconds=t))
            share = (lambda t: f"{nbytes / t / 1e9 / peak_bw:.0%} BW") if decode else \
                (lambda t: f"{flops / t / 1e12 / peak_flops:.0%} FLOPs")
            show = lambda key: f"{results[key] * 1e6:.1f} us ({share(results[key])})" if key in results else "-"
            line = f"{phase} dim {head_dim} {case}: current {current} seq-order: new {show(('new', current, False))}"
            line += f", base {show(('base', current, False))}; longest-first: new {show(('new', current, True))}"
            line += f", base {show(('base', current, True))}"
            ranked = sorted((k for k in results if k[0] == "new"), key=results.get)
            line += "; best " + ", ".join(f"{k[1]}{' LF' if k[2] else ''} {show(k)}" for k in ranked[:3])
            # equal prompts from scratch: cuDNN's dense SDPA on the same problem (a cached prefix would not be)
            if shapes.count(shapes[0]) == len(shapes) and not decode and shapes[0][0] == 0:
                shape = ops.Shape("prefill", len(shapes), HEADS, KV_HEADS, head_dim, shapes[0][1], "bf16")
                dq, dk, dv = ops.make_inputs(shape, torch.device("cuda"))
                t = do_bench_cudagraph(ops._sdpa("CUDNN_ATTENTION")(shape, dq, dk, dv), rep=30) / 1e3
                line += f"; cuDNN dense {t * 1e6:.1f} us ({share(t)}), best / cuDNN {results[ranked[0]] / t:.2f}x"
                records.append(dict(phase=phase, head_dim=head_dim, case=case, code="cudnn-sdpa", seconds=t))
            print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
