"""The engine's side of what OpenAI clients send: n samples of one prompt that compute it once, prompt logprobs
equal to transformers' own log-softmax, and max_tokens 0 (the prompt only, which may fill the context)."""

import random

import pytest

from service.engine import SamplingParams
from service.engine.errors import InvalidRequestError
from tests.conftest import make_engine, reference_logprobs


def prompt_of(loaded, length: int, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    vocab = min(loaded.model.config.vocab_size, 30000)
    return [rng.randrange(5, vocab) for _ in range(length)]


def run(engine, prompts, params, n=1):
    steps = []
    engine.observer = steps.append
    outs = engine.generate(prompts, params, n=n)
    computed = sum(s.prompt_tokens_computed for s in steps)
    cached = sum(s.prompt_tokens_cached for s in steps)
    return outs, computed, cached


def all_free(engine) -> bool:
    return engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs


@pytest.mark.parametrize("model", ["tiny", "default"])
@pytest.mark.parametrize("chunk", [None, 32])  # the whole prompt in one step, or in chunks of 32 tokens
def test_prompt_logprobs_equal_transformers_log_softmax(model, chunk, tiny_model, default_model):
    loaded = tiny_model if model == "tiny" else default_model
    prompt = prompt_of(loaded, 70)
    engine = make_engine(loaded, **({"max_num_batched_tokens": chunk} if chunk else {}))
    # the same prompt served once before: its blocks are in the prefix cache, and must not be read for logprobs
    run(engine, [prompt], SamplingParams(max_tokens=1, temperature=0))
    out, computed, cached = run(engine, [prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=5))
    assert (computed, cached) == (70, 0)
    ref = reference_logprobs(loaded, prompt)
    got = out[0]["prompt_logprobs"]
    assert len(got) == len(prompt) - 1
    for p, (logprob, top) in enumerate(got):
        assert logprob == pytest.approx(ref[p, prompt[p + 1]].item(), abs=1e-3)
        values, ids = ref[p].topk(5)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-3)
    assert len(out[0]["token_ids"]) == 2
    assert all_free(engine)


def test_prompt_logprobs_survive_preemption(tiny_model):
    # 8 usable blocks of 16 tokens for 3 prompts of 40 (3 blocks each, and growing): someone is preempted
    engine = make_engine(tiny_model, num_blocks=9, max_num_batched_tokens=16)
    prompts = [prompt_of(tiny_model, 40, seed=s) for s in range(3)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0))
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        ref = reference_logprobs(tiny_model, prompt)
        assert [lp for lp, _ in out["prompt_logprobs"]] == pytest.approx(
            [ref[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)], abs=1e-4)
        assert all(top == [] for _, top in out["prompt_logprobs"])
    assert all_free(engine)


def test_max_tokens_0_returns_the_prompt_only_and_may_fill_the_context(tiny_model):
    engine = make_engine(tiny_model, num_blocks=9)  # 8 usable blocks of 16: a context of 128 tokens
    assert engine.max_model_len == 128
    full = prompt_of(tiny_model, 128)
    out = engine.generate([full], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert (out["token_ids"], out["finish_reason"], len(out["prompt_logprobs"])) == ([], "length", 127)
    assert all_free(engine)
    with pytest.raises(InvalidRequestError, match="128 tokens, but the prompt has 129"):
        engine.generate([full + [7]], SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError, match="at least one token must be left"):
        engine.generate([full], SamplingParams(max_tokens=1))


def test_n_samples_compute_their_prompt_once(tiny_model):
    prompt = prompt_of(tiny_model, 100)  # 6 full blocks of 16 and 4 tokens
    engine = make_engine(tiny_model, max_num_batched_tokens=48)  # the prompt takes three steps
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    outs, computed, cached = run(engine, [prompt], params, n=4)
    assert computed == 100 + 3 * 4 and cached == 3 * 96
    assert all_free(engine)
    texts = [o["token_ids"] for o in outs]
    assert len({tuple(t) for t in texts}) > 1  # sampled with their own seeds
    # sample 0 is the request with n = 1; every sample reproduces (a fresh engine: nothing cached)
    again, _, _ = run(make_engine(tiny_model), [prompt], params, n=4)
    assert [o["token_ids"] for o in again] == texts
    alone, _, _ = run(make_engine(tiny_model), [prompt], params)
    assert alone[0]["token_ids"] == texts[0]


def test_waiting_samples_do_not_hold_back_other_requests(tiny_model):
    engine = make_engine(tiny_model, max_num_batched_tokens=64)
    first, second, short = (prompt_of(tiny_model, n, seed=s) for n, s in ((200, 1), (200, 2), (8, 3)))
    engine.add_request(first, SamplingParams(max_tokens=2), request_id="a")
    for seq in engine.new_samples("b", second, SamplingParams(max_tokens=2), 0.0, 3):
        engine.add_sequence(seq)
    engine.add_request(short, SamplingParams(max_tokens=2), request_id="c")
    admitted = []
    engine.observer = lambda step: admitted.extend(step.admitted)
    while engine.has_unfinished():
        engine.step()
    # c, behind b's samples 1 and 2, is admitted while they wait for b-0's prompt blocks
    assert admitted.index("c") < admitted.index("b-1")
    assert all_free(engine)


def test_without_prefix_caching_every_sample_computes_its_prompt(tiny_model):
    engine = make_engine(tiny_model, enable_prefix_caching=False)
    prompt = prompt_of(tiny_model, 50)
    outs, computed, cached = run(engine, [prompt], SamplingParams(max_tokens=3, temperature=0), n=3)
    assert (computed, cached) == (150, 0)
    assert len({tuple(o["token_ids"]) for o in outs}) == 1  # greedy: the same three answers
    assert all_free(engine)


def test_a_failed_step_leaves_nothing_in_the_prefix_cache(tiny_model, monkeypatch):
    engine = make_engine(tiny_model)
    prompt = prompt_of(tiny_model, 64)
    seq = engine.make_sequence(prompt, SamplingParams(max_tokens=3))
    engine.add_sequence(seq)
    real = engine.runner.sampler.__class__.__call__

    def fail(self, logits, seqs, *rest):
        result = real(self, logits, seqs, *rest)
        result.read = lambda *args: (_ for _ in ()).throw(RuntimeError("device fault"))
        return result
    monkeypatch.setattr(type(engine.runner.sampler), "__call__", fail)
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["error"]
    assert not engine.blocks.cached  # the prompt's blocks were registered at launch, and taken back
    assert all_free(engine)
