"""The greedy sampler's row maximum on the GPU: PyTorch's reduction against triton_sampling.row_max, for a
128,256-token vocabulary in bf16, inside CUDA graphs (the GPU's time, not the host's launches; do_bench_cudagraph
does not flush the L2 cache, so the logits of a few rows stay in it); and the output projection of a 1B Llama
(128,256 x 2,048, weights larger than the L2) in bf16 (cuBLAS) against int8 weights (our kernel, weight-only and
W8A8)."""
import torch
import triton

from service.engine.quant.triton_w8a8 import int8_scaled_mm
from service.engine.quant.w8a8 import quantize_rows
from service.engine.runner.triton_sampling import row_max

for rows in (1, 4, 16, 64, 256):
    x = torch.randn(rows, 128256, device="cuda").bfloat16()
    a, b = x.max(-1), row_max(x)
    assert torch.equal(a[0].float(), b[0]) and torch.equal(a[1], b[1])
    one = triton.testing.do_bench_cudagraph(lambda: x.max(-1), rep=100)
    two = triton.testing.do_bench_cudagraph(lambda: row_max(x), rep=100)
    print(f"row max, rows {rows:3d}: torch {1e3 * one:6.1f} us, row_max {1e3 * two:6.1f} us")

weight = torch.randn(128256, 2048, device="cuda").bfloat16() * 0.02
codes, scale = quantize_rows(weight, torch.int8)
scale = scale.reshape(1, -1).contiguous()
for rows in (1, 16, 64, 144, 256):
    h = torch.randn(rows, 2048, device="cuda").bfloat16()
    a_codes, a_scale = quantize_rows(h, torch.int8)
    bf16 = triton.testing.do_bench_cudagraph(lambda: h @ weight.t(), rep=100)
    wo = triton.testing.do_bench_cudagraph(lambda: int8_scaled_mm(h, None, codes, scale, torch.bfloat16), rep=100)
    w8 = triton.testing.do_bench_cudagraph(
        lambda: int8_scaled_mm(a_codes, a_scale, codes, scale, torch.bfloat16), rep=100)
    print(f"head, rows {rows:3d}: bf16 {1e3 * bf16:6.1f} us, int8 weight-only {1e3 * wo:6.1f} us, "
          f"int8-w8a8 {1e3 * w8:6.1f} us")
