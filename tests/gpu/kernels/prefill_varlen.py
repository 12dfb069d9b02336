"""What PyTorch offers for prefill attention over packed sequences of different lengths
(flash and cuDNN through their varlen entry points, cuDNN's dense SDPA where the lengths are equal) against our
paged kernel, each checked against a float32 reference; then the KV cache writes, two index_copy_ against
triton_attention.write_kv, inside CUDA graphs.

    python3 tests/gpu/kernels/prefill_varlen.py
"""

import inspect

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from service.bench.kernel.ops import Shape, paged_inputs
from service.engine.runner.triton_attention import triton_paged_attention, write_kv

dev = torch.device("cuda")
print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), "triton", triton.__version__)
for name in ("_cudnn_attention_forward", "_flash_attention_forward"):
    print(getattr(torch.ops.aten, name).default._schema)
try:  # the public entry point (causal through window_size); below, the kernels it chooses between, called directly
    from torch.nn.attention import varlen
    print("varlen_attn", inspect.signature(varlen.varlen_attn))
except ImportError as exc:
    print("no varlen_attn:", exc)


def us(fn):
    return do_bench(fn, warmup=10, rep=60) * 1000


def attention_case(lengths, heads, kv_heads, dim, context=0):
    """Prefill chunks of `lengths` tokens each over `context` cached tokens before them: each kernel's time and its
    largest error against the reference (printed, not a gate: a wrong kernel shows as a large error)."""
    gen = torch.Generator().manual_seed(0)
    group = heads // kv_heads
    qs = [torch.randn(n, heads, dim, generator=gen) for n in lengths]
    ks = [torch.randn(n + context, kv_heads, dim, generator=gen) for n in lengths]
    vs = [torch.randn(n + context, kv_heads, dim, generator=gen) for n in lengths]
    q = torch.cat(qs).to(dev, torch.bfloat16)
    k = torch.cat(ks).to(dev, torch.bfloat16)
    v = torch.cat(vs).to(dev, torch.bfloat16)
    cu_q = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + list((torch.tensor(lengths) + context).cumsum(0)), dtype=torch.int32, device=dev)
    mq, mk = max(lengths), max(lengths) + context
    scale = dim ** -0.5
    # reference: per sequence, float32, causal bottom-right
    refs = []
    for i, n in enumerate(lengths):
        qi = q[cu_q[i]:cu_q[i + 1]].float().transpose(0, 1)
        ki = k[cu_k[i]:cu_k[i + 1]].float().transpose(0, 1).repeat_interleave(group, 0)
        vi = v[cu_k[i]:cu_k[i + 1]].float().transpose(0, 1).repeat_interleave(group, 0)
        keep = torch.arange(n + context, device=dev) <= torch.arange(context, context + n, device=dev)[:, None]
        s = (qi @ ki.transpose(-1, -2)) * scale
        refs.append((s.masked_fill(~keep, float("-inf")).softmax(-1) @ vi).transpose(0, 1))
    ref = torch.cat(refs)
    flops = sum(4 * n * (context + (n + 1) / 2) * heads * dim for n in lengths)
    label = f"lens {lengths[0]}..{lengths[-1]} x{len(lengths)} ctx {context} heads {heads}/{kv_heads} d{dim}"

    def attempt(name, fn):
        try:
            out = fn()
            err = (out.float() - ref).abs().max().item()
            t = us(fn)
            print(f"  {name:28s} {t:9.1f} us  {flops / t / 1e6:6.0f} TFLOP/s  err {err:.3g}")
        except Exception as exc:  # noqa: BLE001
            print(f"  {name:28s} failed: {str(exc).strip().splitlines()[0][:150]}")

    print(label)
    attempt("flash varlen (gqa)", lambda: torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, mq, mk, 0.0, True, False, scale=scale)[0])
    attempt("cudnn varlen (gqa)", lambda: torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, mq, mk, False, 0.0, True, False, scale=scale)[0])

    def cudnn_rep():
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return torch.ops.aten._cudnn_attention_forward(q, kr, vr, None, cu_q, cu_k, mq, mk, False, 0.0, True, False,
                                                       scale=scale)[0]
    attempt("cudnn varlen (kv repeated)", cudnn_rep)
    if len(set(lengths)) == 1 and context == 0:
        b, n = len(lengths), lengths[0]
        qd = q.view(b, n, heads, dim).transpose(1, 2)
        kd = k.view(b, n, kv_heads, dim).transpose(1, 2)
        vd = v.view(b, n, kv_heads, dim).transpose(1, 2)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def dense():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True).transpose(1, 2)\
                    .reshape(b * n, heads, dim)
        attempt("sdpa cudnn dense", dense)
        shape = Shape("prefill", b, heads, kv_heads, dim, n, "bf16")
        packed, kc, vc, meta, _ = paged_inputs(shape, qd, kd, vd, "triton")
        attempt("ours (triton paged)", lambda: triton_paged_attention(packed, kc, vc, meta, scale))


for dim in (64, 128):
    attention_case([1024] * 4, 32, 8, dim)
    attention_case([4096] * 4, 32, 8, dim)
    attention_case([128] * 64, 32, 8, dim)
    attention_case([1024] * 4, 32, 8, dim, context=3072)
g = torch.Generator().manual_seed(1)
attention_case(sorted(torch.randint(100, 1025, (14,), generator=g).tolist()), 32, 8, 64)

# -- KV writes: two index_copy_ against one kernel ---------------------------------------------------------------


print("KV writes (one layer)")
for tokens in (1, 144, 256, 8192):
    for dim in (64, 128):
        kvh = 8
        kc = torch.zeros(20000, 16, kvh, dim, dtype=torch.bfloat16, device=dev)
        vc = torch.zeros_like(kc)
        key = torch.randn(1, kvh, tokens, dim, dtype=torch.bfloat16, device=dev)
        val = torch.randn_like(key)
        k, v = key[0].transpose(0, 1), val[0].transpose(0, 1)
        slots = torch.randperm(20000 * 16, device=dev)[:tokens]

        def two():
            kc.view(-1, kvh, dim).index_copy_(0, slots, k)
            vc.view(-1, kvh, dim).index_copy_(0, slots, v)

        def one():
            write_kv(k, v, kc, vc, slots)
        two()
        a = kc.clone()
        kc.zero_()
        one()
        assert torch.equal(a, kc)
        # graph-replayed, as decode steps run
        times = []
        for fn in (two, one):
            g_ = torch.cuda.CUDAGraph()
            fn()
            with torch.cuda.graph(g_):
                for _ in range(16):
                    fn()
            times.append(us(g_.replay) / 16)
        print(f"  tokens {tokens:5d} d{dim}: two index_copy_ {times[0]:6.2f} us, one kernel {times[1]:6.2f} us")
