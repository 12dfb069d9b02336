"""Greedy output of the engine equals transformers' generate, token for token, under any batching."""

import random

import pytest

from service.engine import SamplingParams
from tests.conftest import load_cpu, make_engine, reference_greedy

MAX_TOKENS = 12


def mixed_prompts(loaded, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = min(loaded.model.config.vocab_size, 30000)
    lengths = [rng.choice([1, 3, 9, 16, 17, 31, 48, 70, 120]) for _ in range(count)]
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["tiny", "default"])
def case(request, tiny_model, default_model):
    # the default model's references come from transformers one prompt at a time, about 0.7 s each on CPU:
    # 16 of them (every batching path below still runs: preemption, chunks, batches of 1, 8 and all)
    loaded, count = (tiny_model, 32) if request.param == "tiny" else (default_model, 16)
    prompts = mixed_prompts(loaded, count, seed=7)
    references = [reference_greedy(loaded, p, MAX_TOKENS) for p in prompts]
    return loaded, prompts, references


def greedy(n=MAX_TOKENS):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("concurrency", [1, 8, None])  # None: all the case's prompts at once
def test_greedy_matches_transformers(case, concurrency):
    loaded, prompts, references = case
    engine = make_engine(loaded)
    outs = engine.generate(prompts[:concurrency], greedy())
    assert [o["token_ids"] for o in outs] == references[:concurrency]
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_greedy_matches_with_preemption(case):
    loaded, prompts, references = case
    # 12 usable blocks of 16 tokens cannot hold 16 or 32 sequences of up to 132 tokens: preemption must happen
    engine = make_engine(loaded, num_blocks=13, max_num_seqs=32)
    outs = engine.generate(prompts, greedy())
    assert engine.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in outs] == references
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_greedy_matches_with_chunked_prefill(case):
    loaded, prompts, references = case
    engine = make_engine(loaded, max_num_batched_tokens=29)
    partial_prefills = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        partial_prefills.extend(n for s, n in zip(batch.seqs, batch.num_new_tokens)
                                if s.num_computed_tokens + n < s.num_tokens)
        return batch

    engine.scheduler.schedule = spy
    outs = engine.generate(prompts, greedy())
    assert [o["token_ids"] for o in outs] == references
    assert partial_prefills  # some prompts really were split across steps


def test_prefix_cache_reuses_blocks_and_keeps_output(case):
    loaded, prompts, references = case
    engine = make_engine(loaded)
    long_prompt, reference = next((p, r) for p, r in zip(prompts, references) if len(p) >= 48)
    first = engine.generate([long_prompt], greedy())[0]
    rid = engine.add_request(long_prompt, greedy())
    seq = engine.seqs[rid]
    engine.step()
    assert seq.num_cached_tokens == (len(long_prompt) - 1) // 16 * 16 > 0
    while engine.has_unfinished():
        engine.step()
    assert first["token_ids"] == seq.output_token_ids == reference


def test_compiled_layers_are_one_graph_each_shared_by_every_layer():
    """Paged attention is one custom op inside the compiled layer (runner/attention.py), so dynamo traces each
    decoder layer whole, and every layer runs the same graph: one for prefill sizes, one for a single token (a
    size of 1 is specialized). With the layer's index as an int, dynamo would compile once per layer. aot_eager
    runs the op's fake (shapes and strides) as inductor would; the output stays token for token."""
    import torch
    from torch._dynamo import lookup_backend

    from service.engine.runner.compilation import compile_layers

    loaded = load_cpu("random:tiny")  # two layers: one graph, or one each
    prompts = mixed_prompts(loaded, 8, seed=3)
    references = [reference_greedy(loaded, p, 6) for p in prompts]
    engine = make_engine(loaded, max_num_seqs=4)
    graphs = []

    def backend(gm, example_inputs):  # what dynamo traced, then compiled through aot_eager
        graphs.append([node.target for node in gm.graph.nodes])
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    try:
        assert compile_layers(engine.runner, backend=backend)
        outs = engine.generate(prompts, greedy(6))
    finally:
        engine.runner.uncompile()
    assert [o["token_ids"] for o in outs] == references
    layers = [ops for ops in graphs if torch.ops.llm_service.paged_attention.default in ops]
    assert len(layers) == 2 and len(loaded.model.model.layers) == 2
    for ops in layers:  # the whole layer: its projections and the attention op between them
        assert ops.count(torch.ops.llm_service.paged_attention.default) == 1
        assert ops.count(torch._C._nn.linear) == 4  # q, k, v as one; o; gate and up as one; down
    # the rotary embedding's cosines and sines, and the last norm, once a step (the output projection too where
    # it is one of the engine's quantized layers: a plain nn.Linear's forward is torch's own, which dynamo skips)
    assert 2 <= len(graphs) - len(layers) <= 4
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
