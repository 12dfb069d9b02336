"""The logit bias and the penalties: against a plain reference of each rule, batched like any request, through
preemption and overlap, and on the default model's own answers."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine import SamplingParams
from service.engine.runner.logit_edits import LogitEdits, mask_rows
from service.engine.sequence import Sequence
from tests.conftest import make_engine

VOCAB = 40


def reference(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """The rules as the API documents them, one token at a time: bias, then repetition (prompt and output), then
    frequency and presence (output)."""
    out = []
    for token, x in enumerate(logits):
        x += (params.logit_bias or {}).get(token, 0.0)
        if token in prompt or token in output:
            r = params.repetition_penalty
            x = x / r if x > 0 else x * r
        count = output.count(token)
        x -= params.frequency_penalty * count + (params.presence_penalty if count else 0.0)
        out.append(x)
    return out


request = st.fixed_dictionaries({
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-150, 150), max_size=6)),
    "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
    "output": st.lists(st.integers(0, VOCAB - 1), max_size=12),
})


@settings(max_examples=25, deadline=None)
@given(st.lists(request, min_size=1, max_size=5), st.integers(0, 2**31))
def test_edits_equal_the_reference_of_each_rule(requests, seed):
    gen = torch.Generator().manual_seed(seed)
    edits = LogitEdits(torch.device("cpu"), capacity=3)  # fewer slots than rows over the steps: slots are reused
    for step in range(2):
        seqs = []
        for r in requests:
            seq = Sequence(f"r{len(seqs)}", r["prompt"], SamplingParams(**{k: v for k, v in r.items()
                                                                          if k not in ("prompt", "output")}))
            seq.token_ids += r["output"]
            seqs.append(seq)
        for seq in seqs[3:]:
            seq.status = seq.status.__class__.FINISHED if step else seq.status
        logits = torch.randn(len(seqs), VOCAB, generator=gen) * 5
        expected = [reference(row.tolist(), s.params, s.prompt_token_ids, s.output_token_ids)
                    for row, s in zip(logits, seqs)]
        rows = [i for i, s in enumerate(seqs) if s.edits_logits]
        if len(rows) > edits.capacity:
            edits = LogitEdits(torch.device("cpu"), capacity=len(rows))
        edits.apply(logits, seqs, rows, [])
        for i, (got, want) in enumerate(zip(logits.tolist(), expected)):
            if i in rows:
                assert got == pytest.approx(want, rel=1e-5, abs=1e-4)


def test_counts_follow_the_sampled_tokens_on_the_device():
    edits = LogitEdits(torch.device("cpu"), capacity=2)
    seq = Sequence("a", [1, 2], SamplingParams(frequency_penalty=1.0))
    for token in (7, 7, 3):  # what record adds, apply subtracts at the next step (the host has not read it yet)
        logits = torch.zeros(1, VOCAB)
        recorded = edits.apply(logits, [seq], [0], [])
        edits.record(torch.tensor([token]), recorded)
    logits = torch.zeros(1, VOCAB)
    edits.apply(logits, [seq], [0], [])
    assert logits[0, 7] == -2.0 and logits[0, 3] == -1.0 and logits[0, 1] == 0.0


def test_a_step_without_edits_allocates_nothing(tiny_model):
    engine = make_engine(tiny_model)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.8, logprobs=2))
    assert engine.runner.sampler.edits.vocab == 0  # no slot tensors were ever made


PENALIZED = [
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=1.8, logit_bias={9: 3.0}),
    SamplingParams(max_tokens=14, temperature=0.9, seed=4, ignore_eos=True, frequency_penalty=-0.7,
                   logit_bias={11: -100, 12: 5.0}),
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),  # no edits, in the same batch
]


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.choice([3, 20, 40]))] for _ in range(count)]


def outputs(engine, ps, params) -> list[list[int]]:
    return [o["token_ids"] for o in engine.generate(ps, params)]


@pytest.mark.parametrize("overlap", [False, True])
def test_penalized_requests_give_the_same_tokens_alone_batched_and_preempted(tiny_model, overlap):
    ps = prompts(8)
    params = [PENALIZED[i % len(PENALIZED)] for i in range(len(ps))]
    alone = [outputs(make_engine(tiny_model, overlap=overlap), [p], [sp])[0] for p, sp in zip(ps, params)]
    batched = make_engine(tiny_model, overlap=overlap, max_num_seqs=4)  # 4 slots for 8 requests: slots reused
    assert outputs(batched, ps, params) == alone
    # 9 usable blocks of 16 cannot hold 8 sequences of up to 54 tokens: preempted ones recompute, counts rebuilt
    tight = make_engine(tiny_model, overlap=overlap, num_blocks=10)
    assert outputs(tight, ps, params) == alone
    assert tight.scheduler.num_preemptions > 0
    assert tight.blocks.num_free_blocks == tight.blocks.num_usable_blocks
    # the penalties changed the answers: the same requests without them answer otherwise
    plain = [SamplingParams(max_tokens=14, temperature=sp.temperature, seed=sp.seed, ignore_eos=True) for sp in params]
    assert outputs(make_engine(tiny_model, overlap=overlap), ps[:3], plain[:3]) != alone[:3]


def test_default_models_greedy_answer_follows_logit_bias(default_model):
    engine = make_engine(default_model)
    prompt = engine.tokenize("The capital of France is")
    greedy = dict(max_tokens=6, temperature=0)
    answer = outputs(engine, [prompt], SamplingParams(**greedy))[0]
    banned = outputs(engine, [prompt], SamplingParams(**greedy, logit_bias={answer[0]: -100}))[0]
    assert banned[0] != answer[0]
    token = engine.tokenize(" Paris")[0]
    forced = outputs(engine, [prompt], SamplingParams(**greedy, logit_bias={token: 100}))[0]
    assert forced == [token] * 6


def test_bias_values_are_clamped_and_bad_ones_refused():
    from service.engine.errors import InvalidRequestError
    assert SamplingParams(logit_bias={1: 1e9, 2: -math.inf}).logit_bias == {1: 100.0, 2: -100.0}
    for bad in ({-1: 1.0}, {1: float("nan")}, {i: 1.0 for i in range(1025)}):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(logit_bias=bad)
        assert err.value.param == "logit_bias"


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """[rows, n] bool as [rows, ceil(n / 32)] int32 words, flag t in bit t % 32 of word t // 32: xgrammar's token
    bitmask layout, which the grammar masks use (1: allowed)."""
    rows, n = flags.shape
    padded = torch.zeros(rows, -(-n // 32) * 32, dtype=torch.int32, device=flags.device)
    padded[:, :n] = flags
    bits = padded.view(rows, -1, 32)
    low = (bits[..., :31] << torch.arange(31, dtype=torch.int32, device=flags.device)).sum(-1, dtype=torch.int32)
    return low | (bits[..., 31] * torch.iinfo(torch.int32).min)  # bit 31: the sign bit


def unpack_bits(words: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_bits: [rows, words] int32 as [rows, n] bool."""
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> bits) & 1).bool().view(words.shape[0], -1)[:, :n]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 100), st.data())
def test_bits_pack_and_unpack_in_xgrammars_layout(rows, n, data):
    flags = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=rows,
                                            max_size=rows)))
    words = pack_bits(flags)
    assert words.dtype == torch.int32 and words.shape == (rows, -(-n // 32))
    assert torch.equal(unpack_bits(words, n), flags)
    for r, t in flags.nonzero().tolist():  # token t: bit t % 32 of word t // 32, as xgrammar fills its masks
        assert (words[r, t // 32].item() >> (t % 32)) & 1


def test_mask_rows_maps_each_row_to_its_row_of_the_bitmask():
    """What row_max and the decode graphs' masked maxima take: a masked row's row of the bitmask, -1 elsewhere."""
    assert mask_rows([3, 1], 5).tolist() == [-1, 1, -1, 0, -1]
    assert mask_rows([], 2).tolist() == [-1, -1]
