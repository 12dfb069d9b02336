"""The fused q, k, v projection and the fused gate and up projection: the same logits as the model's own attention,
for every fused family, with transformers' attention and KV cache and with the engine's paged attention;
quantized weights are left alone."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from service.engine import SamplingParams
from service.engine.fusion import fuse_gate_up, fuse_qkv, unfuse_gate_up, unfuse_qkv
from service.engine.models import LoadedModel
from service.engine.runner.attention import ATTN_IMPLEMENTATION
from tests.conftest import make_engine

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL),
    "llama-bias": lambda: LlamaConfig(**SMALL, attention_bias=True),
    "mistral-window": lambda: MistralConfig(**SMALL, sliding_window=8),
    "qwen2-bias": lambda: Qwen2Config(**SMALL),  # Qwen2 has biases on q, k and v
    "qwen3-norms": lambda: Qwen3Config(**SMALL, head_dim=16),  # RMSNorm over each head of q and k
}


def model_for(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="sdpa").eval()
    for p in model.parameters():  # random biases: zero-initialised ones would not show a misplaced bias
        torch.nn.init.normal_(p, std=0.2)
    return model


def greedy_generate(model, ids: torch.Tensor, n: int = 6) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_attention_gives_the_models_own_logits_and_unfusing_restores_it(name):
    model = model_for(name)
    ids = torch.randint(5, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        tokens = greedy_generate(model, ids)
        assert fuse_qkv(model) == 2
        attn = model.model.layers[0].self_attn
        assert not hasattr(attn, "q_proj") and attn.qkv_proj.weight.shape[0] == 4 * 16 + 2 * 2 * 16
        torch.testing.assert_close(model(ids).logits, before, atol=1e-5, rtol=1e-5)
        assert torch.equal(greedy_generate(model, ids), tokens)  # through transformers' own KV cache
        assert fuse_qkv(model) == 0  # nothing left to fuse
        unfuse_qkv(model)
        assert "forward" not in vars(attn) and attn.q_proj.weight.shape == (64, 64)
        assert torch.equal(model(ids).logits, before)  # the very weights and code path it was loaded with


@pytest.mark.parametrize("name", ["qwen3-norms", "mistral-window", "llama-bias"])
def test_the_engine_runs_a_fused_model_like_transformers(name):
    """The paged path, with Qwen3's norms, Mistral's sliding window (8 tokens, prompts up to 37) and Llama's biases:
    the engine's greedy output on the fused model equals transformers' on the unfused one, token for token; but
    for Qwen3 (its norms come first), the paged attention turns the queries and keys by the rotary embedding."""
    model = model_for(name)
    prompts = [[7, 8, 9, 10, 11], list(range(20, 57))]
    ids = [greedy_generate(model, torch.tensor([p]), 8)[0, len(p):].tolist() for p in prompts]
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    loaded = LoadedModel(model=model, tokenizer=None, name=name, max_model_len=256, eos_token_ids=frozenset())
    engine = make_engine(loaded)
    assert engine.runner.fused_layers == 2 and engine.runner.fused_mlps == 2
    assert model.model.layers[0].self_attn.fused_rotary == (name != "qwen3-norms")
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o["token_ids"] for o in outs] == ids


def test_quantized_or_odd_projections_are_not_fused():
    model = model_for("llama")
    attn = model.model.layers[0].self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.to(torch.int8), requires_grad=False)
    assert fuse_qkv(model) == 1  # the other layer only
    assert hasattr(attn, "k_proj") and "forward" not in vars(attn)


@pytest.mark.parametrize("name", ["llama", "qwen2-bias"])
def test_w8a8_projections_fuse_into_one_that_rounds_as_the_three_did(name):
    """int8-w8a8 q, k and v (one mode, one input) become one W8A8 layer, gate and up another: stacked codes and
    per-channel scales, the input quantized once, the same logits bit for bit; unfusing gives the layers back."""
    from service.engine.quant import w8a8

    model = model_for(name)
    w8a8.quantize(model, "int8-w8a8", skip=model.lm_head)
    ids = torch.randint(5, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        assert fuse_qkv(model) == 2 and fuse_gate_up(model) == 2
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.qkv_proj, w8a8.W8A8Linear) and attn.qkv_proj.weight.dtype == torch.int8
        assert attn.qkv_proj.weight_scale.shape == (1, 4 * 16 + 2 * 2 * 16)
        assert isinstance(model.model.layers[0].mlp.gate_up_proj, w8a8.W8A8Linear)
        assert model.model.layers[0].mlp.silu_codes  # the down projection's codes in one op (silu_mul_quantize)
        assert torch.equal(model(ids).logits, before)
        unfuse_qkv(model)
        unfuse_gate_up(model)
        assert isinstance(attn.k_proj, w8a8.W8A8Linear) and attn.k_proj.weight.shape == (32, 64)
        assert torch.equal(model(ids).logits, before)
    attn.k_proj = w8a8.W8A8Linear(torch.nn.Linear(64, 32, bias=name != "llama"), "fp8-w8a8", simulate=True)
    assert fuse_qkv(model) == 1  # modes differ in layer 0: only layer 1 fuses


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_gate_up_gives_the_models_own_logits_and_unfusing_restores_it(name):
    model = model_for(name)
    ids = torch.randint(5, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
        assert fuse_gate_up(model) == 2
        mlp = model.model.layers[0].mlp
        assert not hasattr(mlp, "gate_proj") and mlp.gate_up_proj.weight.shape == (2 * 128, 64)
        torch.testing.assert_close(model(ids).logits, before, atol=1e-5, rtol=1e-5)
        assert fuse_gate_up(model) == 0
        unfuse_gate_up(model)
        assert "forward" not in vars(mlp) and mlp.gate_proj.weight.shape == (128, 64)
        assert torch.equal(model(ids).logits, before)
