"""Structured output in the engine: grammars compiled beside the loop, masks on the logits, outputs that match and
end with their grammar, batched and overlapped like any request, and nothing left behind."""

import dataclasses
import gc
import itertools
import json
import threading
import weakref

import pytest
import torch

from service.engine import SamplingParams
from service.engine.errors import InvalidRequestError
from service.engine.models import load_model
from service.engine.runner.logit_edits import LogitEdits
from service.engine.sequence import Sequence
from service.engine.structured import (MAX_MIN_ITEMS, MAX_PATTERN_COUNT, MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, Grammars,
                                      StructuredOutput, check)
from tests.conftest import make_engine, tokenizer_folder

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def schema(value: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(value))


@pytest.fixture(scope="module")
def worded_tiny():
    """Random weights with the default model's tokenizer: text, and grammars over a real vocabulary."""
    return load_model("random:tiny", torch.float32, torch.device("cpu"), tokenizer=tokenizer_folder())


def chat(engine, question: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                add_generation_prompt=True)
    return engine.tokenize(text)


def test_the_default_models_answer_matches_the_schema_and_ends_with_it(default_model):
    import jsonschema  # (here: the GPU machine's CUDA tests import this file, and it has no jsonschema)
    engine = make_engine(default_model)
    out = engine.generate([chat(engine, "Describe a person who lives in Rome, as JSON.")],
                          SamplingParams(max_tokens=80, temperature=0, structured=schema(PERSON)))[0]
    jsonschema.validate(json.loads(out["text"]), PERSON)
    assert out["finish_reason"] == "stop" and out["text"].endswith("}")
    assert ", " not in out["text"] and '": ' not in out["text"]  # compact: no whitespace between tokens of JSON
    free = engine.generate([chat(engine, "Describe a person who lives in Rome, as JSON.")],
                           SamplingParams(max_tokens=80, temperature=0))[0]
    assert free["text"] != out["text"]  # the grammar changed the answer


def test_json_object_gives_an_object_at_any_temperature(worded_tiny):
    engine = make_engine(worded_tiny)
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=s, structured=StructuredOutput("json_object"),
                             presence_penalty=0.5, logit_bias={90: 5.0}) for s in range(4)]
    for out in engine.generate(["an object, please"] * 4, params):
        if out["finish_reason"] == "stop":  # random weights may wander for longer than max_tokens
            assert isinstance(json.loads(out["text"]), dict)
        else:
            assert out["text"].startswith("{")


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_rows_give_the_same_tokens_alone_batched_and_preempted(worded_tiny, overlap):
    import jsonschema
    ps = ["a", "tell me about a person", "b c d e f g", "x " * 30]
    params = [SamplingParams(max_tokens=40, temperature=0, structured=schema(PERSON)),
              SamplingParams(max_tokens=40, temperature=0.8, seed=3, structured=schema(PERSON)),
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),  # unconstrained, in the same batch
              SamplingParams(max_tokens=40, temperature=0.8, seed=5, structured=StructuredOutput("json_object"))]
    alone = [make_engine(worded_tiny, overlap=overlap).generate([p], sp)[0] for p, sp in zip(ps, params)]
    batched = make_engine(worded_tiny, overlap=overlap)
    assert [o["token_ids"] for o in batched.generate(ps, params)] == [o["token_ids"] for o in alone]
    tight = make_engine(worded_tiny, overlap=overlap, num_blocks=8)  # 7 usable blocks of 16: some are preempted
    # its grammars compiled first, so that all four run at once (a busy machine may compile one late, when the
    # others have ended, and nothing is preempted)
    tight.generate(ps, [dataclasses.replace(p, max_tokens=1) for p in params])
    assert tight.scheduler.num_preemptions == 0
    assert [o["token_ids"] for o in tight.generate(ps, params)] == [o["token_ids"] for o in alone]
    assert tight.scheduler.num_preemptions > 0
    for engine in (batched, tight):
        while engine.has_unfinished():  # with overlap a last step may still be in flight (its tokens all dropped)
            assert not engine.step()
        assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs
        assert not engine._compiling and not engine.has_unfinished()
    for out in alone[:2]:
        if out["finish_reason"] == "stop":
            jsonschema.validate(json.loads(out["text"]), PERSON)


@pytest.mark.parametrize("overlap", [False, True])
def test_finished_constrained_requests_are_let_go(worded_tiny, overlap):
    """Once the engine is idle, or runs a step without constrained rows, nothing keeps the sequences of finished
    constrained requests (nor their matchers with them)."""
    engine = make_engine(worded_tiny, overlap=overlap)
    params = SamplingParams(max_tokens=10, temperature=0, structured=StructuredOutput("json_object"))
    for plain in (None, "c"):  # idle once they finish; then beside a longer unconstrained request
        ids = [engine.add_request(prompt, params) for prompt in ("a", "b")]
        if plain:
            engine.add_request(plain, SamplingParams(max_tokens=30, ignore_eos=True))
        gone = [weakref.ref(engine.seqs[i]) for i in ids]
        while any(i in engine.seqs for i in ids) or not plain and engine.has_unfinished():
            engine.step()
        engine.step()  # (with overlap, one more to read back the last step of theirs, dropped)
        gc.collect()
        assert not any(ref() for ref in gone) and engine.has_unfinished() == bool(plain)
        while engine.has_unfinished():
            engine.step()
    engine.close()


def test_the_engine_process_takes_constrained_rows_as_single_checks_do(worded_tiny, monkeypatch, caplog):
    """As the engine process runs them (bare rows, overlap), a constrained row whose grammar took its token ahead,
    while the next step's masks filled, goes on without a stop check unless the token is a stop token (which a
    complete grammar forces); a row not taken ahead is checked in full. Alone, batched and preempted, every request
    gets the tokens and end that it gets from the checks of every row, and nothing is left held. A token that breaks
    its grammar (masks that allow every token) ends its request with an error, whether taken ahead or not."""
    from tests.engine.test_engine_decode_steps import served_rows

    ps = ["a", "tell me about a person", "b c d e f g", "x " * 30, "q"]
    params = [SamplingParams(max_tokens=40, temperature=0, structured=schema(PERSON)),
              SamplingParams(max_tokens=40, temperature=0.8, seed=3, structured=schema(PERSON)),
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=5, structured=StructuredOutput("json_object")),
              SamplingParams(max_tokens=40, temperature=0.8, seed=7,  # complete after its first digit
                             structured=schema({"type": "integer", "minimum": 0, "maximum": 9}))]
    single = make_engine(worded_tiny, overlap=False)
    prompts = [single.tokenize(p) for p in ps]
    alone = [served_rows(single, [(p, sp)])[0] for p, sp in zip(prompts, params)]
    assert alone[4][1] == "stop" and len(alone[4][0]) == 2 and alone[4][0][1] in single.eos_token_ids  # (forced)
    for blocks in (512, 8):  # 7 usable blocks of 16: some are preempted
        engine = make_engine(worded_tiny, overlap=True, num_blocks=blocks)
        served_rows(engine, [(p, dataclasses.replace(sp, max_tokens=1)) for p, sp in zip(prompts, params)])
        checked, check = [], engine._check_stop
        engine._check_stop = lambda seq, token: checked.append(seq.matcher is not None) or check(seq, token)
        assert served_rows(engine, list(zip(prompts, params))) == alone
        assert sum(checked) < 40  # (four constrained requests, most of their rows not checked)
        assert (engine.scheduler.num_preemptions > 0) == (blocks == 8)
        while engine.has_unfinished():
            assert not engine.step()
        assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs
        engine.close()
    # masks that allow every token: the first token that breaks the grammar ends its request
    monkeypatch.setattr(Grammars, "_write", staticmethod(lambda batch, matchers, host, indices: host.fill_(-1)))
    for engine in (single, make_engine(worded_tiny, overlap=True)):
        caplog.clear()
        tokens, end, _ = served_rows(engine, [(prompts[0], params[0])])[0]
        assert end == "error" and len(tokens) < 40 and "breaks its grammar" in caplog.text
        engine.close()


class HostGate:
    """runner/host_gate.py's gate, played on the host: `wait` blocks until its ticket is opened (a ticket never opened
    is noted after a minute, and passes, so that the test fails rather than hangs)."""

    def __init__(self):
        self.opened, self.last, self.never, self.tickets = 0, 0, set(), itertools.count(1)
        self.changed = threading.Condition()

    def ticket(self) -> int:
        self.last = next(self.tickets)
        return self.last

    def wait(self, ticket: int) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: self.opened >= ticket, 60):
                self.never.add(ticket)

    def open(self, ticket: int) -> None:
        with self.changed:
            self.opened = ticket
            self.changed.notify_all()

    def close(self) -> None:
        self.open(self.last)


def test_the_sampler_waits_at_a_gate_that_the_masks_fill_opens(worded_tiny):
    """With a gate (CUDA), the engine's thread launches a constrained step's sampler without waiting for its masks;
    the sampler waits at the gate (the device's wait, played on the host here), which the masks' thread opens once
    they are filled. The requests get the tokens they get without a gate, and every ticket is opened."""
    ps = ["a", "tell me about a person", "b c d e f g"]
    params = [SamplingParams(max_tokens=30, temperature=0, structured=schema(PERSON)),
              SamplingParams(max_tokens=30, temperature=0.8, seed=3, structured=StructuredOutput("json_object")),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
    plain = make_engine(worded_tiny, overlap=True)
    gated = make_engine(worded_tiny, overlap=True)
    gated.runner.gate = gate = HostGate()
    assert [o["token_ids"] for o in gated.generate(ps, params)] == [o["token_ids"] for o in plain.generate(ps, params)]
    while gated.has_unfinished():
        assert not gated.step()
    assert gate.opened == gate.last > 10 and not gate.never
    assert gated.blocks.num_free_blocks == gated.blocks.num_usable_blocks and not gated.seqs
    for engine in (plain, gated):
        engine.close()


@pytest.mark.parametrize("gated", [False, True])
def test_a_fill_that_raises_fails_its_step_and_the_engine_serves_on(worded_tiny, monkeypatch, gated):
    engine = make_engine(worded_tiny, overlap=True)
    if gated:
        engine.runner.gate = gate = HostGate()
    a_fill_that_raises_fails_its_step(engine, monkeypatch)
    assert not gated or gate.opened == gate.last > 3 and not gate.never
    engine.close()


def a_fill_that_raises_fails_its_step(engine, monkeypatch) -> None:
    """With overlap the masks fill in their own thread; one that raises there fails the requests of its step (an
    error finish) at its read-back, frees their blocks, and the next requests run as usual. With a gate it opens its
    ticket all the same (the device, waiting there, would wait for good)."""
    write, calls = Grammars._write, []

    def broken(*args):
        calls.append(args)
        if len(calls) == 3:  # a step well into the run
            raise RuntimeError("a fill that failed")
        write(*args)
    monkeypatch.setattr(Grammars, "_write", staticmethod(broken))
    params = SamplingParams(max_tokens=20, temperature=0, structured=schema(PERSON))
    outs = engine.generate(["a", "b"], params)  # (one grammar: they join the batch together)
    assert [o["finish_reason"] for o in outs] == ["error", "error"]
    while engine.has_unfinished():
        assert not engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs
    again = engine.generate(["a"], params)[0]
    assert again["finish_reason"] in ("stop", "length") and len(calls) > 3


def test_matchers_keep_the_gil_and_their_batch_calls_let_go_of_it(worded_tiny):
    """A matcher's own accept keeps the GIL (another thread cannot take it between two rows); the batch calls, which
    the masks' thread makes beside the engine's thread, let go of it."""
    from xgrammar.tvm_ffi_binding._ffi_api import BatchGrammarMatcher, GrammarMatcher

    engine = make_engine(worded_tiny, overlap=True)
    engine.generate(["a"], SamplingParams(max_tokens=2, temperature=0, structured=schema(PERSON)))
    release = {m.name: m.func.release_gil for m in GrammarMatcher.__tvm_ffi_type_info__.methods}
    assert not release["accept_token"]
    batch = {m.name: m.func.release_gil for m in BatchGrammarMatcher.__tvm_ffi_type_info__.methods}
    assert batch["batch_fill_next_token_bitmask"] and batch["batch_accept_token"]
    engine.close()


def test_a_grammar_is_compiled_once_and_counted(worded_tiny):
    engine = make_engine(worded_tiny)
    reports = []
    engine.observer = reports.append
    engine.generate(["a", "b", "c"], SamplingParams(max_tokens=5, temperature=0, structured=schema(PERSON)))
    engine.generate(["d"], SamplingParams(max_tokens=5, temperature=0, structured=schema(PERSON)))
    assert sum(r.grammar_hits for r in reports) == 3  # the first of the four compiled it
    assert len([w for r in reports for w in r.grammar_waits]) == 4
    assert sum(r.mask_seconds for r in reports) > 0
    workers = [t for t in threading.enumerate() if t.name.startswith("grammar")]
    assert 0 < len(workers) <= engine.grammars.WORKERS
    engine.close()


def test_a_grammar_that_does_not_compile_in_time_fails_its_request_only(worded_tiny):
    engine = make_engine(worded_tiny)
    plain = engine.add_request("a", SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("b", SamplingParams(max_tokens=3, temperature=0, structured=schema(PERSON)),
                       request_id="late")
    engine.grammars.timeout = -1.0  # every wait is past it
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {plain: "length", "late": "error"}
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs
    engine.grammars.timeout = 10.0
    out = engine.generate(["b"], SamplingParams(max_tokens=3, temperature=0, structured=schema(PERSON)))[0]
    assert out["finish_reason"] in ("stop", "length") and out["text"].startswith("{")


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(worded_tiny):
    engine = make_engine(worded_tiny)
    engine.add_request("b", SamplingParams(max_tokens=3, structured=schema(PERSON)), request_id="gone")
    assert engine.num_waiting == 1
    out = engine.abort("gone")
    assert out.finish_reason == "abort" and not engine._compiling and not engine.has_unfinished()


def test_min_tokens_does_not_hold_a_complete_grammar(worded_tiny):
    engine = make_engine(worded_tiny)
    out = engine.generate(["a"], SamplingParams(max_tokens=60, min_tokens=60, temperature=0,
                                                structured=schema({"enum": ["yes", "no"]})))[0]
    assert out["text"] in ('"yes"', '"no"') and out["finish_reason"] == "stop"


def test_masks_keep_only_allowed_tokens_in_their_rows():
    edits = LogitEdits(torch.device("cpu"), capacity=2)
    seqs = [Sequence(str(i), [1], SamplingParams()) for i in range(3)]
    logits = torch.randn(3, 70)
    before = logits.clone()
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5
    bitmask[0, 2] = -2**31  # bit 31 of word 2: token 95, outside the 70 logits
    bitmask[0, 1] = (1 << 3) | (1 << 30)  # tokens 35 and 62
    edits.apply(logits, seqs, [], [], ([1], bitmask))
    finite = logits[1].isfinite().nonzero().flatten().tolist()
    assert finite == [5, 35, 62] and torch.equal(logits[1, finite], before[1, finite])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])


@pytest.mark.parametrize("bad, says", [
    (StructuredOutput("xml"), "unknown structured output kind"),
    (StructuredOutput("json_schema", "{not json"), "not JSON"),
    (StructuredOutput("json_schema", '"a string"'), "is an object"),
    (StructuredOutput("json_schema", '{"type": "objekt"}'), "objekt"),
    (StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": "(unclosed"})), "invalid JSON schema"),
    (StructuredOutput("json_schema", json.dumps({"enum": ["x" * MAX_SCHEMA_BYTES]})), "bytes"),
    (StructuredOutput("json_schema", '{"items": ' * (MAX_SCHEMA_DEPTH + 1) + "{}" + "}" * (MAX_SCHEMA_DEPTH + 1)),
     "deeper"),
    (StructuredOutput("json_schema", '[' * 100_000 + ']' * 100_000), "bytes"),
    (StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {
        "type": "array", "minItems": MAX_MIN_ITEMS + 1}}})), f"minItems is {MAX_MIN_ITEMS + 1};"),
    *((StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {
        "type": "string", "pattern": pattern}}})), f"repeats a part of itself {count} times")
      for pattern, count in [("^.{0,%d}$" % (MAX_PATTERN_COUNT + 1), MAX_PATTERN_COUNT + 1),
                             ("^[a-z]{%d}$" % (MAX_PATTERN_COUNT + 1), MAX_PATTERN_COUNT + 1),
                             ("^x(ab){1000,}$", 1000), ("^(.{0,10}){0,100}$", 1000), ("^([]{]{2,9}){0,100}$", 900)]),
])
def test_bad_schemas_are_refused_with_a_reason(bad, says):
    with pytest.raises(InvalidRequestError) as err:
        check(bad)
    assert says in err.value.message and err.value.param == "response_format"
    assert ".cc:" not in err.value.message  # xgrammar's source location is cut off


def test_counts_up_to_the_limits_pass():
    """minItems up to its limit and maxItems of any size; pattern counts up to theirs, nested ones multiplied, and
    braces that are not a quantifier (escaped); maxLength of any size."""
    array = {"type": "array", "items": {"type": "integer"}, "minItems": MAX_MIN_ITEMS, "maxItems": 100_000}
    text = {"type": "string", "pattern": "^[a-z]{2,%d}\\{1000\\}$" % MAX_PATTERN_COUNT, "maxLength": 100_000}
    address = {"type": "string", "pattern": "^(\\d{1,3}\\.){3}\\d{1,3}$"}  # nested counts: 3 x 3
    check(StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {
        "a": array, "b": text, "c": address}})))


def test_a_model_without_tokenizer_refuses_structured_output(tiny_model):
    engine = make_engine(tiny_model)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.add_request([1, 2], SamplingParams(structured=StructuredOutput("json_object")))


def test_the_grammar_cache_keeps_the_newest_and_no_more(worded_tiny, monkeypatch):
    from service.engine.structured import Grammars
    monkeypatch.setattr(Grammars, "CACHE_ENTRIES", 16)  # the rule, at a size that compiles in a moment
    grammars = Grammars(worded_tiny.tokenizer, 49152, worded_tiny.eos_token_ids, 4)
    seqs = [Sequence(str(i), [1], SamplingParams(structured=schema({"enum": [i]})))
            for i in range(Grammars.CACHE_ENTRIES + 8)]
    for seq in seqs:
        assert not grammars.start(seq)
    assert len(grammars._cache) == Grammars.CACHE_ENTRIES
    seqs[-1].grammar.result()
    assert grammars.start(seqs[-1]) and not grammars.start(seqs[0])  # the newest is kept, the oldest was dropped
    grammars.close()


def test_the_paired_benchmark_runs_this_code_against_an_older_copy_in_one_process(tmp_path):
    """tests/gpu/engine/paired.py (benchmarks.md's paired figures) on the CPU, with a copy of this service/ as the
    older code: both engines in one process, each from its own package, every kind's figures for each."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shutil.copytree(root / "service", tmp_path / "service", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [sys.executable, "tests/gpu/engine/paired.py", "--base", str(tmp_path), "--model", "random:tiny",
         "--tokenizer", str(tokenizer_folder()), "--requests", "4", "--some", "2", "--input-len", "4",
         "--output-len", "8", "--rounds", "2"], cwd=root, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    summary = rows[-1]
    assert len(rows) == 3 and summary["engines"] == {"new": "service.engine.llm_engine",
                                                     "base": "base_service.engine.llm_engine"}
    for key in ("new_some_ratio", "new_all_ratio", "base_some_ratio", "base_all_ratio", "new_over_base_plain",
                "new_over_base_all"):
        assert summary[key] > 0, key

