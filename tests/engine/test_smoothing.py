"""SmoothQuant's folding (engine/quant/smoothing.py): it changes nothing in float32, and what it does not apply to
keeps today's path. Its effect on the default model's quality is tested with the other modes, in
test_quantization.py (which loads them once)."""

import pytest
import torch

from service.engine.models import load_model
from service.engine.quant import smoothing
from tests.conftest import tokenizer_folder

CPU = torch.device("cpu")


@torch.inference_mode()
def logits(model, ids: list[int]) -> torch.Tensor:
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")  # transformers' own attention (an engine may have set the paged one)
    try:
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits
    finally:
        model.set_attn_implementation(previous)


@pytest.mark.parametrize("mode", ["int8-w8a8", "fp8-w8a8"])  # the strengths' errors: int8 codes, fp8 codes
def test_folding_the_factors_changes_nothing_in_float32(mode):
    """Random weights with a real tokenizer (two of them: one folded, one as drawn) and grouped-query heads: each
    place's factors go where they belong, or the output changes."""
    plain, folded = (load_model("random:tiny", torch.float32, CPU, tokenizer=tokenizer_folder()) for _ in range(2))
    for loaded in (plain, folded):  # the same outlier channels in both, at the input of every place
        for layer in loaded.model.model.layers:
            with torch.no_grad():
                for weight in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                               layer.mlp.up_proj.weight, layer.self_attn.v_proj.weight):
                    weight[3] *= 40.0
    config = plain.model.config
    assert config.num_attention_heads > config.num_key_value_heads  # o after v: factors tied over each group
    chosen = smoothing.smooth(folded.model, folded.tokenizer, mode)
    assert len(chosen) == 4 * config.num_hidden_layers and any(c["alpha"] is not None for c in chosen)
    assert {c["place"] for c in chosen if c["alpha"] is not None} == {"qkv", "gate_up", "down", "o"}
    assert all(c["smoothed_error"] <= c["error"] for c in chosen)
    ids = plain.tokenizer.encode("The harbour was quiet when the ferry came in.", add_special_tokens=False)
    torch.testing.assert_close(logits(folded.model, ids), logits(plain.model, ids), rtol=1e-4, atol=1e-4)
    assert not torch.equal(folded.model.model.layers[0].input_layernorm.weight,
                           plain.model.model.layers[0].input_layernorm.weight)


def test_random_weights_and_other_shapes_are_not_smoothed(monkeypatch):
    monkeypatch.setattr(smoothing, "smooth", lambda *a: pytest.fail("random weights were calibrated"))
    load_model("random:tiny", torch.float32, CPU, quantization="int8-w8a8", tokenizer=tokenizer_folder())
    monkeypatch.undo()
    assert smoothing.foldable(torch.nn.Sequential(torch.nn.Linear(4, 4))) == []
    assert smoothing.smooth(torch.nn.Sequential(torch.nn.Linear(4, 4)), None, "int8-w8a8") == []
