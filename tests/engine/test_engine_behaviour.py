"""Sampling, stop conditions, aborts, bad input and the async facade of the engine."""

import asyncio

import pytest
import torch

from service.engine import InvalidRequestError, SamplingParams
from service.engine.runner.sampler import Sampler
from tests.conftest import Linked, make_engine

PROMPT = "<|im_start|>user\nTell me a short story about a cat.<|im_end|>\n<|im_start|>assistant\n"
SHORT = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"  # its greedy answer ends in a few tokens


@pytest.fixture(scope="module")
def engine(default_model):
    return make_engine(default_model, max_num_seqs=16)


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = engine.generate([PROMPT], params)[0]["token_ids"]
    crowd = [SamplingParams(max_tokens=16, temperature=1.0) for _ in range(5)]
    batched = engine.generate([PROMPT] * 3 + [PROMPT], crowd[:3] + [params])[3]["token_ids"]
    other_seed = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99))
    assert alone == batched
    assert other_seed[0]["token_ids"] != alone


def test_stop_string_across_token_boundary_is_cut_from_the_text(engine):
    full = engine.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0))[0]
    tokenizer = engine.tokenizer
    ids = full["token_ids"]
    # a stop string made of the end of one token and the start of the next
    pieces = [tokenizer.decode(ids[i:i + 1]) for i in range(len(ids))]
    i = next(i for i in range(3, len(ids) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    expected = full["text"][:full["text"].index(stop)]

    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=40, temperature=0, stop=["never-appears", stop]))
    deltas, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                deltas.append(out.text_delta)
                last = out
    assert last.finish_reason == "stop"
    assert "".join(deltas) == expected
    assert stop not in "".join(deltas)


def test_stop_token_ids_and_min_tokens(engine):
    full = engine.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0))[0]["token_ids"]
    stop_at = full[4]
    out = engine.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out["finish_reason"] == "stop" and out["token_ids"] == full[:full.index(stop_at) + 1]
    # a prompt whose greedy answer ends early: min_tokens must hold its end-of-sequence back
    natural = engine.generate([SHORT], SamplingParams(max_tokens=60, temperature=0))[0]["token_ids"]
    assert natural[-1] in engine.eos_token_ids  # ended by end-of-sequence, before max_tokens
    n = len(natural) + 5
    out = engine.generate([SHORT], SamplingParams(max_tokens=n + 20, min_tokens=n, temperature=0))[0]["token_ids"]
    assert len(out) >= n and not set(out[:n]) & engine.eos_token_ids
    assert out[:len(natural) - 1] == natural[:-1]  # the same answer up to where it would have ended


def test_eos_finishes_unless_ignored(engine):
    out = engine.generate([SHORT], SamplingParams(max_tokens=200, temperature=0))[0]
    assert out["finish_reason"] == "stop" and out["token_ids"][-1] in engine.eos_token_ids
    assert "<|im_end|>" not in out["text"]
    n = len(out["token_ids"])
    ignored = engine.generate([SHORT], SamplingParams(max_tokens=n + 5, ignore_eos=True, temperature=0))[0]
    assert ignored["finish_reason"] == "length" and len(ignored["token_ids"]) == n + 5
    assert ignored["token_ids"][n - 1] in engine.eos_token_ids  # generated, and generation went on past it


def test_abort_mid_generation_frees_blocks(engine):
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=100, temperature=0))
    for _ in range(5):
        engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_usable_blocks
    out = engine.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    assert not engine.has_unfinished() and not engine.seqs


@pytest.mark.parametrize("prompt, params, param", [
    ("", SamplingParams(), "prompt"),
    ([], SamplingParams(), "prompt"),
    ([1, 2, 10**9], SamplingParams(), "prompt"),
    ("hello " * 9000, SamplingParams(), "prompt"),
    ("hello", SamplingParams(max_tokens=9000), "max_tokens"),
    ("hello", SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
])
def test_bad_requests_raise_typed_errors_and_engine_keeps_serving(engine, prompt, params, param):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(prompt, params)
    assert err.value.param == param and err.value.message
    assert engine.generate(["Hi"], SamplingParams(max_tokens=2))[0]["finish_reason"] == "length"


def test_over_long_prompt_message_names_the_limit(engine):
    assert engine.max_model_len == 511 * 16  # the model allows 8192, the test's 511-block cache less
    with pytest.raises(InvalidRequestError, match="maximum context length is 8176 tokens.*9001 tokens"):
        engine.add_request("hello " * 9000)


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_tokens=-1), "max_tokens"), (dict(stop=[1]), "stop"),
    (dict(stop=[""]), "stop"), (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=50), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(seed="x"), "seed"), (dict(seed=2**64), "seed"), (dict(seed=-2**63 - 1), "seed"), (dict(top_k=2**31), "top_k"),
    (dict(min_tokens=2**31, max_tokens=None), "min_tokens"), (dict(temperature=float("nan")), "temperature"),
])
def test_invalid_sampling_values_are_rejected(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]] * 200)
    kept = Sampler._top_k_top_p(logits.clone(), [2] * 200, [1.0] * 200)
    assert torch.isinf(kept[:, 2:]).all() and not torch.isinf(kept[:, :2]).any()
    probs = logits[0].softmax(-1)  # [0.64, 0.23, ...]: top_p 0.8 keeps two tokens, 0.5 keeps one
    assert (~torch.isinf(Sampler._top_k_top_p(logits[:1].clone(), [0], [0.8]))).sum() == 2
    assert (~torch.isinf(Sampler._top_k_top_p(logits[:1].clone(), [0], [0.5]))).sum() == 1
    assert probs[0] > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_takes_the_first_maximum_and_fails_on_one_nan_logit(dtype):
    from service.engine.runner.sampler import NonFiniteLogitsError
    from service.engine.sequence import Sequence
    seqs = [Sequence(f"r{i}", [1], SamplingParams(temperature=0, max_tokens=4)) for i in range(3)]
    assert all(s.plain for s in seqs)  # nothing to edit: the plain path
    logits = torch.randn(3, 1000).to(dtype)
    logits[1, [7, 500]] = 99.0  # a tie: argmax's first index
    assert Sampler(torch.device("cpu"))(logits, seqs).read()[0] == logits.argmax(-1).tolist()
    assert Sampler(torch.device("cpu"))(logits, seqs).read()[0][1] == 7
    logits[2, 321] = float("nan")  # one NaN among finite logits still fails the step
    with pytest.raises(NonFiniteLogitsError, match="NaN logits for 3 sequences"):
        Sampler(torch.device("cpu"))(logits, seqs).read()


def test_logprobs_are_returned_for_the_sampled_token(engine):
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0, logprobs=2))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    for out in outs:
        (chosen, top), = out.new_logprobs
        assert top[0][0] == out.new_token_ids[0] and chosen == pytest.approx(top[0][1])
        assert len(top) == 2 and top[0][1] >= top[1][1]


def test_a_stop_wakes_an_idle_engine_core_and_is_harmless_once_it_has_ended(tiny_model, idle_engine_core):
    async def main():
        async with Linked(make_engine(tiny_model)) as link:  # its exit calls stop(), then waits up to 60 s
            assert await asyncio.to_thread(idle_engine_core.wait, 60)  # the loop is (about to be) blocked idle
        return link
    link = asyncio.run(main())
    assert not link.thread.is_alive()  # woken by the stop, not by the poll's time limit
    link.core.stop()  # its context is closed: nothing to wake, no error


def test_the_engine_core_streams_and_abort_on_early_exit_frees_blocks(default_model):
    engine = make_engine(default_model)

    async def collect(link, prompt, n):
        text, outs = "", []
        async for out in link.generate(prompt, SamplingParams(max_tokens=n, temperature=0)):
            text += out.text_delta
            outs.append(out)
        return text, outs

    async def leave_early(link):
        async for out in link.generate(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True)):
            if out.num_output_tokens == 3:
                break

    async def main():
        async with Linked(engine) as link:
            results = await asyncio.gather(*[collect(link, PROMPT, 10) for _ in range(4)], leave_early(link))
            for _ in range(1200):  # the early leaver's abort reaches the engine (within a minute, however busy)
                if not engine.has_unfinished():
                    break
                await asyncio.sleep(0.05)
            return results

    results = asyncio.run(main())
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    expected = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0))[0]["text"]
    for text, outs in results[:4]:
        assert text == expected and outs[-1].finished and outs[-1].num_output_tokens == 10
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    assert not engine.seqs


def test_a_request_is_plain_for_the_sampler_only_with_nothing_to_edit_ban_or_report():
    from service.engine.sequence import Sequence
    plain = lambda eos=frozenset(), **p: Sequence("r", [1], SamplingParams(max_tokens=4, **p), eos_token_ids=eos).plain
    assert plain(temperature=0) and plain(top_k=1) and plain(temperature=0, min_tokens=2, ignore_eos=True)
    assert plain(temperature=0, min_tokens=2)  # no EOS to ban
    assert not plain(temperature=0, min_tokens=2, eos=frozenset({2}))  # EOS banned before min_tokens
    assert not plain(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[3])
    assert not plain(temperature=1.0) and not plain(temperature=0, logprobs=1)
    assert not plain(temperature=0, logit_bias={5: 1.0}) and not plain(temperature=0, presence_penalty=0.5)


def test_rows_left_unchecked_for_a_stop_are_rows_that_would_go_on(engine):
    """The engine process (text left to the front ends) checks only the rows `_may_stop` marks: every row that a full
    check would stop is among them, for requests of every kind of stop."""
    from service.engine.detokenizer import Detokenizer
    eos = min(engine.eos_token_ids)
    kinds = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, ignore_eos=True),
             SamplingParams(max_tokens=5, min_tokens=2), SamplingParams(max_tokens=4, stop_token_ids=[7]),
             SamplingParams(max_tokens=engine.max_model_len)]  # ends at the context's length
    seqs = [engine.new_sequence(f"s{i}", [5] * (engine.max_model_len - 4 if p.max_tokens > 10 else 4), p, 0.0)
            for i, p in enumerate(kinds)]
    assert [s.length_at >= 0 for s in seqs] == [True, True, True, False, True]  # stop token ids: always checked
    text, engine.detokenizer = engine.detokenizer, Detokenizer(None)
    try:
        for _ in range(5):  # each output length up to past max_tokens, each kind of token
            for token in (eos, 7, 9):
                marked = engine._may_stop(seqs, [token] * len(seqs))
                for seq, mark in zip(seqs, marked):
                    seq.token_ids.append(token)
                    if engine._check_stop(seq, token):
                        assert mark, (seq.params, len(seq.output_token_ids), token)
                    seq.token_ids.pop()
            for seq in seqs:
                seq.token_ids.append(9)
        assert engine._may_stop(seqs, [9] * len(seqs)).tolist() == [  # 9 is neither EOS nor a stop token
            s.length_at < 0 or len(s.token_ids) + 1 >= s.length_at for s in seqs]
    finally:
        engine.detokenizer = text
    assert engine._may_stop(seqs, [9] * len(seqs)) is None  # with text made here, every row goes to the detokenizer
