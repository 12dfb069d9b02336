"""The Triton paged-attention kernel's launch configurations on the GPU (issue 26): for decode at batch 256 over
contexts of 512 to 2,048 and for prefill, every (BLOCK_M, BLOCK_N, warps, stages) candidate timed inside a CUDA
graph, against the kernel's current choice (triton_attention.launch_config) and, for prefill, PyTorch's SDPA
kernels on the same dense shapes. Bandwidth and FLOPs as `bench kernel` counts them (service/bench/kernel).

  python3 tests/gpu/attention_sweep.py                      # both phases, the 1B and 8B heads
  python3 tests/gpu/attention_sweep.py --phases decode --contexts 1024
"""

import argparse
import dataclasses
import itertools

import numpy as np
import torch
import triton
from triton.testing import do_bench_cudagraph

from service.bench.kernel import ops, roofline
from service.engine.runner import triton_attention
from service.engine.runner.input_packing import block_m_for, build_tiles


def with_block_m(meta, batch, block_m: int, group: int):
    """The same metadata with tiles of block_m rows."""
    tile_seq, tile_qstart = build_tiles(np.asarray(batch.num_new_tokens, np.int32), max(1, block_m // group))
    return dataclasses.replace(meta, block_m=block_m, tile_seq=torch.from_numpy(tile_seq).cuda(),
                               tile_qstart=torch.from_numpy(tile_qstart).cuda())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", default="decode,prefill")
    ap.add_argument("--contexts", default="")
    ap.add_argument("--head-dims", default="64,128")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    print(name, "torch", torch.__version__, "triton", triton.__version__)
    for phase, head_dim in itertools.product(args.phases.split(","), map(int, args.head_dims.split(","))):
        batch = 256 if phase == "decode" else 4
        contexts = [int(c) for c in args.contexts.split(",") if c] or \
            ([512, 1024, 2048] if phase == "decode" else [1024, 4096])
        for context in contexts:
            shape = ops.Shape(phase, batch, 32, 8, head_dim, context, "bf16")
            q, k, v = ops.make_inputs(shape, torch.device("cuda"))
            packed, k_cache, v_cache, meta, sched = ops.paged_inputs(shape, q, k, v, "triton")
            expected = ops.reference(q.float(), k.float(), v.float(), phase == "prefill")
            expected = expected.transpose(1, 2).reshape(packed.shape)
            group, scale = 4, head_dim ** -0.5
            default_m = block_m_for(group, phase == "decode")
            current = (default_m, *triton_attention.launch_config(default_m, head_dim))
            ms = (16,) if phase == "decode" else (64, 128)  # decode: 4 heads of one token fill the smallest MMA
            results = []
            for block_m, block_n, warps, stages in itertools.product(ms, (32, 64, 128), (2, 4, 8), (1, 2, 3)):
                m = with_block_m(meta, sched, block_m, group)
                run = lambda: triton_attention.triton_paged_attention(packed, k_cache, v_cache, m, scale,
                                                                      config=(block_n, warps, stages))
                try:
                    out = run()
                    error = (out.float() - expected).abs().max().item()
                    if not error < 2e-2:
                        print(f"  wrong: {(block_m, block_n, warps, stages)} error {error:.3g}")
                        continue
                    t = do_bench_cudagraph(run, rep=20) / 1e3
                except Exception as exc:  # noqa: BLE001 - configurations that exceed shared memory or registers
                    if "OutOfResources" not in type(exc).__name__ and "shared memory" not in str(exc):
                        raise
                    continue
                results.append((t, (block_m, block_n, warps, stages)))
            results.sort()
            by_config = {c: t for t, c in results}
            gbps = lambda t: roofline.attention_bytes(shape) / t / 1e9
            tflops = lambda t: roofline.attention_flops(shape) / t / 1e12
            peak_flops, peak_bw = roofline.device_peak(name, "bf16")
            line = f"{phase} batch {batch} heads 32/8 dim {head_dim} context {context}: "
            if current in by_config:
                t = by_config[current]
                line += f"current {current} {t * 1e6:.1f} us ({gbps(t) / peak_bw:.0%} BW, {tflops(t) / peak_flops:.0%} FLOPs)"
            best_t, best = results[0]
            line += f"; best {best} {best_t * 1e6:.1f} us ({gbps(best_t) / peak_bw:.0%} BW, " \
                f"{tflops(best_t) / peak_flops:.0%} FLOPs); next {[(c, round(t * 1e6, 1)) for t, c in results[1:4]]}"
            if phase == "prefill":
                for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
                    try:
                        fn = ops._sdpa(backend)(shape, q, k, v)
                        line += f"; sdpa {backend.split('_')[0].lower()} {do_bench_cudagraph(fn, rep=20) * 1e3:.1f} us"
                    except ops.Unsupported:
                        pass
            print(line, flush=True)


if __name__ == "__main__":
    main()
