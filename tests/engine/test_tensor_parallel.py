"""Tensor parallelism on CPU: two gloo ranks give the same greedy tokens as one; the model split and its weights drawn
or read per rank. Faults and the ranks' lifecycle: test_tensor_parallel_faults.py."""

import copy

import pytest

from service.engine import EngineConfig, LLMEngine, SamplingParams
from service.engine.parallel import head_ranges
from tests.conftest import load_cpu, make_engine

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_kv_heads_are_split_by_whole_groups():
    config = load_cpu("random:tiny").model.config  # 4 heads, 2 KV heads
    assert [head_ranges(config, 2, r) for r in (0, 1)] == [((0, 2), (0, 1)), ((2, 4), (1, 2))]
    config.num_attention_heads, config.num_key_value_heads = 9, 3  # the default model's shape: 2 + 1 KV heads
    assert [head_ranges(config, 2, r) for r in (0, 1)] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    with pytest.raises(ValueError, match="needs at least 4 KV heads; this model has 3"):
        head_ranges(config, 4, 0)


@pytest.mark.parametrize("preset, world", [("tiny", 2), ("small", 3)])
def test_each_rank_draws_its_own_slices_of_the_one_random_model(preset, world):
    """Random weights are drawn in seeded blocks: the ranks' slices, put together, are the weights one rank draws
    (small over 3 ranks: 4 of 12 heads and a third of the MLP each)."""
    import torch

    from service.engine.models import load_model
    from service.engine.parallel import shard_model
    cpu = torch.device("cpu")
    whole = load_model(f"random:{preset}", torch.float32, cpu).model.state_dict()
    parts = [load_model(f"random:{preset}", torch.float32, cpu,
                        shard=lambda model, r=r: shard_model(model, world, r)).model.state_dict() for r in range(world)]
    sliced = 0
    for name, full in whole.items():
        pieces = [part[name] for part in parts]
        if pieces[0].shape == full.shape:  # kept whole: embeddings, norms, the LM head
            assert all(torch.equal(p, full) for p in pieces), name
            continue
        dim = 0 if pieces[0].shape[1:] == full.shape[1:] else 1
        assert torch.equal(torch.cat(pieces, dim), full), name
        sliced += 1
    assert sliced == 7 * len(load_cpu(f"random:{preset}").model.model.layers)


@pytest.mark.parametrize("piece", [(1, 5000, 17000, 20000), (0, 100, 300, 400), (1, 0, 20000, 20000)])
def test_a_slice_across_tiles_holds_the_numbers_of_the_whole_weight(piece):
    """Slices that start inside a tile and span several, by columns (past 8,192) and by rows."""
    import torch

    from service.engine import weights
    draw = weights.Random(3, torch.device("cpu"), 0.02)
    full = (400, 20000)
    whole = draw("w", torch.empty(full, device="meta"), None)
    dim, start, end, _ = piece
    shape = list(full)
    shape[dim] = end - start
    assert torch.equal(draw("w", torch.empty(shape, device="meta"), piece), whole.narrow(dim, start, end - start))


def test_random_weights_too_big_for_the_gpu_are_refused_before_any_is_drawn():
    import torch

    from service.engine.models import load_model
    limit = int(0.85 * 141 * 2**30)  # an H200's share at the default --gpu-memory-utilization
    with pytest.raises(ValueError, match=r"random:llama-70b needs 131\.4 GiB .* --tensor-parallel-size"):
        load_model("random:llama-70b", torch.bfloat16, torch.device("cpu"), memory_limit=limit)
    # a tied output projection counts once: the 1B shape's 1,235.8 million parameters, 2.30 GiB in bf16
    with pytest.raises(ValueError, match=r"random:llama-1b needs 2\.3 GiB"):
        load_model("random:llama-1b", torch.bfloat16, torch.device("cpu"), memory_limit=2 * 2**30)


def test_w8a8_random_weights_are_quantized_layer_by_layer_as_drawn():
    """The same codes as quantizing the drawn model afterwards: no unquantized copy of the model is needed."""
    import torch

    from service.engine.models import load_model
    from service.engine.quant import w8a8
    cpu = torch.device("cpu")
    layered = load_model("random:tiny", torch.float32, cpu, quantization="int8-w8a8").model
    after = load_model("random:tiny", torch.float32, cpu).model
    w8a8.quantize(after, "int8-w8a8", skip=after.get_output_embeddings())  # (as load_model does on a CPU)
    mine, theirs = layered.state_dict(), after.state_dict()
    assert mine.keys() == theirs.keys() and any(t.dtype == torch.int8 for t in mine.values())
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_each_rank_reads_only_its_slices_from_the_checkpoint_files(tmp_path, monkeypatch):
    """A checkpoint folder's safetensors are read a slice at a time (never loaded whole), and each rank holds what
    loading the whole model and slicing it gives (small over 3 ranks; tied embeddings kept whole)."""
    import torch

    from service.engine import models
    from service.engine.parallel import shard_model
    from tests.conftest import tokenizer_folder
    cpu = torch.device("cpu")
    whole = models.load_model("random:small", torch.float32, cpu, tokenizer=tokenizer_folder())
    whole.model.save_pretrained(tmp_path)
    whole.tokenizer.save_pretrained(tmp_path)

    def loaded_whole(*args, **kwargs):
        raise AssertionError("a rank loads the whole checkpoint")
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", loaded_whole)
    for rank in range(3):
        mine = models.load_model(str(tmp_path), torch.float32, cpu, shard=lambda m: shard_model(m, 3, rank))
        expected = copy.deepcopy(whole.model)
        shard_model(expected, 3, rank)
        got, want = mine.model.state_dict(), expected.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in got)
        assert mine.eos_token_ids == whole.eos_token_ids


def test_a_layer_quantized_as_drawn_frees_its_float_weights_before_the_next_is_drawn():
    """So that a model which only fits quantized (the 70B shape in fp8 on one GPU) never holds its float weights."""
    import weakref

    import torch

    from service.engine import weights
    from service.engine.quant import w8a8
    from transformers import AutoModelForCausalLM, LlamaConfig

    from service.engine.models import PRESETS
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**PRESETS["tiny"]), dtype=torch.float32)
    drawn = []

    def quantize(layer):
        assert all(ref() is None for ref in drawn), "the layer before still holds float weights"
        drawn.extend(weakref.ref(m.weight) for m in layer.modules() if type(m) is torch.nn.Linear)
        w8a8.quantize(layer, "int8-w8a8")
    weights.fill(model, weights.Random(0, torch.device("cpu"), 0.02), torch.device("cpu"), {}, quantize)
    assert len(drawn) == 7 * 2 and all(ref() is None for ref in drawn)


def _generate(engine: LLMEngine, prompts, params: SamplingParams = GREEDY) -> tuple[list[list[int]], int]:
    preempted = []
    engine.observer = lambda step: preempted.extend(step.preempted)
    outputs = [o["token_ids"] for o in engine.generate(prompts, params)]
    engine.observer = None
    return outputs, len(preempted)


def test_two_ranks_equal_one_rank_with_chunked_prefill_and_preemption(tiny_model, monkeypatch):
    import torch.distributed as dist

    def pickled(*args, **kwargs):
        raise AssertionError("a step's inputs travel as tensors, not as pickled objects")
    monkeypatch.setattr(dist, "broadcast_object_list", pickled)
    prompts = [list(range(1, 40)), list(range(50, 70)), list(range(100, 133)), [7, 8, 9]]
    # 8 blocks of 16 tokens cannot hold all four sequences: the engine preempts; 16-token steps chunk prefills
    settings = dict(num_blocks=8, max_num_batched_tokens=16)
    scored = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)  # rank 0 scores the prompt alone
    one = make_engine(tiny_model, **settings)
    expected, _ = _generate(one, prompts)
    expected_scores = [o["prompt_logprobs"] for o in one.generate(prompts[:2], scored, n=2)]
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", tensor_parallel_size=2, **settings))
    try:
        assert engine.runner.kv_caches[0][0].shape[2] == 1  # rank 0 keeps one of the two KV heads
        got, preemptions = _generate(engine, prompts)
        scores = [o["prompt_logprobs"] for o in engine.generate(prompts[:2], scored, n=2)]
        engine.config.decode_steps = 4  # launches of four decode steps, each a step for the other ranks (on the CPU no
        # buffer is sized by it)
        more = engine._more_steps
        passes = []
        engine._more_steps = lambda *a: passes.append(more(*a)) or passes[-1]
        assert engine.generate(prompts[1:], GREEDY) == one.generate(prompts[1:], GREEDY)
        assert max(passes) == 3
    finally:
        engine.close()
    assert preemptions > 0
    assert got == expected
    for mine, theirs in zip(scores, expected_scores):
        assert [lp for lp, _ in mine] == pytest.approx([lp for lp, _ in theirs], abs=1e-4)


def first_layers(loaded, layers: int, folder):
    """A checkpoint of a loaded model's first `layers` decoder layers: its weights, config and tokenizer."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(loaded.model.config)
    config.num_hidden_layers = layers
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.model.state_dict(), strict=False)  # the layers past `layers` are left out
    model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return str(folder)


def test_default_models_layers_over_two_ranks_with_uneven_heads_equal_one_rank(default_model, tmp_path):
    # the default model's heads (9 over 3 KV heads: 6 and 3 over 2 and 1 a rank), weights and tokenizer, loaded from
    # a folder by each rank; two of its 30 layers, as a step over two gloo ranks costs this machine about 0.7 s
    # with all of them (60 all-reduces)
    folder = first_layers(default_model, 2, tmp_path / "two-layers")
    prompts = ["The capital of France is", "Once upon a time, in a small village,"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    one = load_cpu(folder)
    expected, _ = _generate(make_engine(one, max_num_batched_tokens=8), prompts, params)
    engine = LLMEngine(EngineConfig(model=folder, device="cpu", num_blocks=512, tensor_parallel_size=2,
                                    max_num_batched_tokens=8))
    try:
        assert engine.runner.kv_caches[0][0].shape[2] == 2  # rank 0 keeps two of the three KV heads
        got, _ = _generate(engine, prompts, params)
    finally:
        engine.close()
    assert got == expected


def test_each_ranks_forward_time_is_counted_by_rank():
    from prometheus_client import CollectorRegistry

    from service.engine.llm_engine import StepStats
    from service.telemetry.metrics import Metrics
    from service.telemetry.recorder import EngineRecorder

    registry = CollectorRegistry()
    recorder = EngineRecorder(Metrics("m", registry))
    for seconds in ([0.5, 0.25], [0.5, 0.25], [1.5, 2.0]):  # gathered totals; the same totals again add nothing
        recorder(StepStats("decode", 1, 1, 0.01, [], [], [], [], [], 1, 0, 0.1, seconds))
    value = lambda rank: registry.get_sample_value("llm_tensor_parallel_forward_seconds_total",
                                                   {"model": "m", "rank": rank})
    assert (value("0"), value("1")) == (1.5, 2.0)
