"""Several decode steps launched together (decode_steps): the host schedules, reads back and reports once for them,
and nothing changes for clients but when their tokens arrive.

On the CPU the engine runs the same code as on CUDA (each step fed the one before's tokens on the device, read back
together); the decode graphs' part of it runs in the CUDA suite (tests/cuda).
"""

import pytest

from service.engine import SamplingParams
from tests.conftest import make_engine
from tests.engine.test_engine_overlap import every_kind_of_end, greedy, stream_all, tiny_case  # noqa: F401 (a fixture)


def counted(engine):
    """The engine, with a count of its step() calls and its observed steps."""
    engine.calls, engine.stats = 0, []
    step = engine.step

    def counting():
        engine.calls += 1
        return step()
    engine.step = counting
    engine.observer = engine.stats.append
    return engine


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_greedy_and_seeded_outputs_equal_single_steps_in_fewer_host_passes(tiny_case, overlap):
    loaded, prompts, references = tiny_case
    sampled = SamplingParams(max_tokens=11, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    runs = {}
    for steps in (1, 4):
        engine = counted(make_engine(loaded, overlap=overlap, decode_steps=steps, max_num_seqs=32))
        outs = engine.generate(prompts, greedy())  # 12 tokens: not a multiple of 4 past the first
        assert [o["token_ids"] for o in outs] == references
        seeded = [o["token_ids"] for o in engine.generate(prompts[:8], sampled)]
        decode = [s for s in engine.stats if s.phase == "decode"]
        runs[steps] = (seeded, engine.calls, len(decode), sum(s.num_tokens for s in decode))
        assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs
        assert all(s.duration >= 0 and s.device_wait >= 0 for s in engine.stats)
    assert runs[4][0] == runs[1][0]
    assert runs[4][2:] == runs[1][2:]  # every decode step reported, as one step each
    assert runs[4][1] < runs[1][1] / 2  # in far fewer passes of the host


def test_streams_exactly_what_single_steps_stream(default_model):
    """Stop strings, stop tokens, min_tokens, EOS, max_tokens, logprobs and seeded sampling, in one batch; the
    stops fall inside a launch of four steps, whose later tokens are dropped. (With overlap, as on CUDA; without,
    the tiny model's tests above.)"""
    overlap = True
    requests = every_kind_of_end(default_model, logprobs_tokens=13)
    single = stream_all(make_engine(default_model, overlap=overlap), requests)
    engine = make_engine(default_model, overlap=overlap, decode_steps=4)
    assert stream_all(engine, requests) == single
    assert [o[-1][3] for o in single] == ["stop", "stop", "length", "stop", "length", "length"]
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs


@pytest.mark.parametrize("rows", [False, True], ids=["outputs", "engine-process-rows"])
def test_abort_between_launches_drops_the_tokens_in_flight_and_frees_blocks(tiny_case, rows):
    from service.engine.detokenizer import Detokenizer

    loaded, prompts, references = tiny_case
    engine = make_engine(loaded, overlap=True, decode_steps=4)
    if rows:  # as the engine process runs it: bare rows [request id, tokens, finish reason, ...]
        engine.rows, engine.detokenizer = True, Detokenizer(None)
    rid, tokens = (lambda o: o[0], lambda o: o[1]) if rows else (lambda o: o.request_id, lambda o: o.new_token_ids)
    keep = engine.add_request(prompts[0], greedy(40))
    gone = engine.add_request(prompts[1], greedy(100))
    before = [o for _ in range(3) for o in engine.step()]
    sent = sum(len(tokens(o)) for o in before if rid(o) == gone)
    assert sent > 3  # launches of several steps have been read back
    aborted = engine.abort(gone)
    assert (aborted[2] if rows else aborted.finish_reason) == "abort"
    assert rows or aborted.num_output_tokens == sent
    after = []
    while engine.has_unfinished():
        after += engine.step()
    assert gone not in {rid(o) for o in after}  # its tokens in flight at the abort are dropped
    single = make_engine(loaded).generate([prompts[0]], greedy(40))[0]["token_ids"]
    assert [t for o in before + after if rid(o) == keep for t in tokens(o)] == single
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs


def test_a_new_request_is_admitted_at_the_next_step(tiny_case):
    """Steps are launched together only while no request waits to be admitted (and the scheduler does not hold
    them): an arrival joins at the next call, as with single steps."""
    loaded, prompts, _ = tiny_case
    engine = make_engine(loaded, overlap=True, decode_steps=8)
    for p in prompts[:4]:
        engine.add_request(p, greedy(60))
    for _ in range(4):
        engine.step()
    late = engine.add_request(prompts[4], greedy(5))
    engine.step()
    assert engine.seqs[late] in engine.scheduler.running
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_held_request_waits_as_many_steps_as_with_single_steps(tiny_case, overlap):
    """The scheduler's hold (admission_wait_steps) counts every step of a launch: a request that arrives under load
    is admitted after the same number of decode steps, and every output is the same."""
    loaded, prompts, _ = tiny_case
    runs = {}
    for steps in (1, 3):
        engine = counted(make_engine(loaded, overlap=overlap, max_num_seqs=8, admission_wait_steps=5,
                                     decode_steps=steps))
        outputs, ids, held = {}, [], []
        for p in prompts[:6]:  # 6 of at most 8 running: under load
            ids.append(engine.add_request(p, greedy(40)))
        for _ in range(3):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        in_flight = engine._in_flight
        mark = len(engine.stats) + (1 + len(in_flight.then) if in_flight else 0)  # steps launched before it came
        late = engine.add_request(prompts[6], greedy())
        ids.append(late)
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            held.append(engine.scheduler.held_steps)
        assert max(held) <= 5
        admitted = next(i for i, s in enumerate(engine.stats) if late in s.admitted)
        waited = sum(1 for s in engine.stats[mark:admitted] if s.phase == "decode")
        runs[steps] = ([outputs[i] for i in ids], waited)
    assert runs[3] == runs[1] and runs[1][1] == 5


def test_no_step_runs_past_max_tokens_or_the_context(tiny_case):
    loaded, _, _ = tiny_case
    engine = counted(make_engine(loaded, decode_steps=8, max_model_len=64))
    long, short = list(range(5, 50)), [5, 6, 7]
    outs = engine.generate([long, short], [SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                                           SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)])
    assert len(long) + len(outs[0]["token_ids"]) == 64 and [len(o["token_ids"]) for o in outs] == [19, 14]
    computed = sum(s.num_tokens for s in engine.stats if s.phase)
    assert computed == sum(len(p) + len(o["token_ids"]) - 1 for p, o in zip([long, short], outs))
    assert engine.calls < 8


def test_the_engine_process_sends_a_requests_tokens_of_a_launch_in_one_row(tiny_case):
    from service.engine.detokenizer import Detokenizer

    loaded, prompts, references = tiny_case
    engine = make_engine(loaded, overlap=True, decode_steps=4)
    engine.rows, engine.detokenizer = True, Detokenizer(None)  # as the engine process runs it
    rid = engine.add_request(prompts[0], greedy(10))
    rows = []
    while engine.has_unfinished():
        rows += engine.step()
    assert [len(r[1]) for r in rows] == [1, 4, 4, 1]  # the prefill's token, two launches, the last token alone
    assert all(r[0] == rid for r in rows) and [r[2] for r in rows] == [None, None, None, "length"]
    assert [t for r in rows for t in r[1]] == references[0][:10]


def served_rows(engine, requests: list) -> list[tuple[list[int], str, int]]:
    """Run `requests` as the engine process does (bare rows, no text): each one's tokens, end and logprobs count."""
    from service.engine.detokenizer import Detokenizer

    engine.rows, engine.detokenizer = True, Detokenizer(None)
    ids = [engine.add_request(p, sp) for p, sp in requests]
    rows = []
    while engine.has_unfinished():
        rows += engine.step()
    return [([t for r in rows if r[0] == rid for t in r[1]], [r[2] for r in rows if r[0] == rid][-1],
             sum(len(r[3] or ()) for r in rows if r[0] == rid)) for rid in ids]


def as_rows(streamed: list) -> list[tuple[list[int], str, int]]:
    """stream_all's outputs, as served_rows gives them."""
    return [([t for o in outs for t in o[0]], outs[-1][3], sum(len(o[5]) for o in outs)) for outs in streamed]


def test_the_engine_process_rows_carry_what_single_steps_stream(default_model):
    """As the engine process runs it (bare rows), a launch's sequences that no token of it stops take their tokens
    at once; those that stop in it (stop token, min_tokens, EOS, max_tokens) go step by step, and so does every row
    of a launch while a row of it wants logprobs. Every request gets the same tokens, logprobs and end as in single
    steps; with prefix caching, the blocks they fill are registered; nothing is left held. (Single steps in the
    engine process: every served test.)"""
    requests = every_kind_of_end(default_model, logprobs_tokens=13)[1:]  # (stop strings are the front ends')
    alone = make_engine(default_model, overlap=True, enable_prefix_caching=True)
    single = as_rows(stream_all(alone, requests))
    engine = make_engine(default_model, overlap=True, decode_steps=4, enable_prefix_caching=True)
    step, size = engine.step, engine.blocks.block_size

    def registering():  # after every step each running sequence's full blocks whose tokens are known are registered
        out = step()
        assert all(s.num_hashed_blocks == min(s.num_computed_tokens, len(s.token_ids)) // size
                   for s in engine.scheduler.running)
        return out
    engine.step = registering
    assert served_rows(engine, requests) == single
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs
    assert engine.blocks.cached.keys() == alone.blocks.cached.keys()  # the same full blocks registered


@pytest.mark.parametrize("steps", [0, 9])
def test_decode_steps_out_of_range_are_refused(steps, capsys):
    from service.settings import parse

    with pytest.raises(SystemExit):
        parse(["--decode-steps", str(steps)])
    assert "decode_steps is" in capsys.readouterr().err
