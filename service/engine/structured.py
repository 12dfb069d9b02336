"""Output that must match a grammar: any JSON object, or a JSON Schema. xgrammar does the work.

What a request asks for is a `StructuredOutput` in its SamplingParams; `check` validates it where the request
arrives (a front end: a 400 that says why, before the engine sees it). The engine process compiles each distinct
grammar against the tokenizer's vocabulary once, in a thread beside its loop, and keeps it in xgrammar's cache
(`Grammars`); a request waits for its grammar outside the scheduler, so the batch never does. Each constrained
sequence then has a matcher that takes each token it samples and fills its row of a token bitmask for the next
sample; the sampler's LogitEdits applies the bitmask (runner/logit_edits.py). With overlap the matchers of a step take
the step before's tokens and fill their masks in a thread of their own (xgrammar's batch calls let go of the GIL)
while the device runs the step's forward pass and the engine's thread reads the step before back; on CUDA the sampler
is launched at once and waits on the device for the masks (runner/host_gate.py). A grammar that is complete allows
nothing but a stop token: the sequence samples one, and ends there.
"""

import json
import logging
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema")
MAX_SCHEMA_BYTES = 32 * 1024  # a schema's JSON text, at most
MAX_SCHEMA_DEPTH = 24  # objects and arrays nested in a schema, at most
# an array's minItems, at most: above it xgrammar's matcher (0.2.9) takes longer for each token the further the array
# has gone (on the 2-core CPU, minItems 129: 0.5 us a token throughout; 256: 105 us a token by the 1,500th item; 1,000:
# 269 us), where maxItems costs the same at any size
MAX_MIN_ITEMS = 128
# how often a `pattern` may repeat a part of itself through its quantifiers ({n}, {n,}, {n,m}; nested ones multiply),
# at most: past 128 xgrammar 0.2.9 stops unrolling a repetition and checks the whole vocabulary at each token inside it
# (`.{0,129}`: 10.6 ms a token, against 10 us for `.{0,128}`; on the 2-core CPU), which a batch waits for; and nested
# ones unroll into their product at compile time (`(.{0,10}){0,100}` compiled for over 100 s). maxLength costs neither
MAX_PATTERN_COUNT = 128
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
COMPILE_TIMEOUT_S = 10.0  # a grammar not compiled by then fails its request (it goes on compiling, then is cached)
SEPARATORS = (",", ":")  # compact JSON: a small model cannot wander in whitespace
# seconds: the GIL switch interval of an engine that fills masks beside its read-back (overlap). The fill's thread needs
# the GIL for moments between its C++ calls (which let go of it), while the engine's thread reads back a step: by
# default Python hands the GIL over only after 5 ms
SWITCH_INTERVAL = 5e-5


@dataclass
class StructuredOutput:
    """What a request's output must be: `json_object`, any JSON object; `json_schema`, an instance of `schema` (a
    JSON Schema as JSON text; properties in the order the schema lists them, no others unless it allows them)."""

    kind: str
    schema: str | None = None

    @property
    def key(self) -> tuple[str, str | None]:
        return self.kind, self.schema


def check(structured: StructuredOutput, param: str = "response_format") -> None:
    """Raise InvalidRequestError (naming `param`) unless `structured` is a grammar the engine can compile: a known
    kind, a schema that parses as JSON, within the size, nesting and count limits, that xgrammar turns into a
    grammar."""
    def bad(message: str):
        raise InvalidRequestError(message, param=param)

    if structured.kind not in KINDS:
        bad(f"unknown structured output kind {structured.kind!r}; kinds: {', '.join(KINDS)}")
    if structured.kind == "json_object":
        return
    text = structured.schema
    if not isinstance(text, str):
        bad("json_schema needs a schema")
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        bad(f"the JSON schema is {len(text.encode())} bytes; at most {MAX_SCHEMA_BYTES} are allowed")
    try:
        schema = json.loads(text)
    except ValueError as exc:
        bad(f"the JSON schema is not JSON: {exc}")
    if not isinstance(schema, (dict, bool)):
        bad("a JSON schema is an object (or true or false)")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        bad(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    counts = [n for n in _under(schema, "minItems") if isinstance(n, (int, float)) and not isinstance(n, bool)]
    if (most := max(counts, default=0)) > MAX_MIN_ITEMS:
        bad(f"minItems is {most:g}; at most {MAX_MIN_ITEMS} is allowed (a larger one slows every token of "
            "the array: bound its length with maxItems instead)")
    for pattern in (p for p in _under(schema, "pattern") if isinstance(p, str)):
        if (count := _largest_count(pattern)) > MAX_PATTERN_COUNT:
            bad(f"the pattern {pattern[:40]!r} repeats a part of itself {count} times (nested counts multiply); at "
                f"most {MAX_PATTERN_COUNT} is allowed, as more would slow every token of the string, or its compile "
                "(bound a string's length with maxLength instead)")
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(text, any_whitespace=False, separators=SEPARATORS)
    except Exception as exc:  # xgrammar says what it cannot take (an unknown type, a bad $ref, a bad pattern)
        bad(f"invalid JSON schema: {_reason(exc)}")


def _depth(value, level: int = 0) -> int:
    if level > MAX_SCHEMA_DEPTH:  # stop early: a hostile schema may be deep enough to exhaust the stack
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


def _under(value, key: str):
    """Every value under `key` anywhere in a schema (in the instances it holds, `const` or `enum`, too: simpler, and
    no schema needs such an instance)."""
    if isinstance(value, list):
        for item in value:
            yield from _under(item, key)
    elif isinstance(value, dict):
        for k, item in value.items():
            if k == key:
                yield item
            yield from _under(item, key)


def _largest_count(pattern: str) -> int:
    """The most times `pattern` repeats any part of itself through counted quantifiers: a count's larger bound (n of
    {n} and {n,}), times the counts of the groups around it. (`*`, `+` and `?` count once: a loop is not unrolled.)"""
    best, last, i = [1], 1, 0  # best: the largest count inside each open group; last: the atom just read, its own
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":  # an escaped character: one atom
            i, last = i + 2, 1
        elif c == "[":  # a class: one atom ("]" right after "[" or "[^" is one of its characters)
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i, last = j + 1, 1
        elif c == "(":
            best.append(1)
            i, last = i + 1, 1
        elif c == ")":
            last = best.pop() if len(best) > 1 else 1
            best[-1] = max(best[-1], last)
            i += 1
        elif match := _COUNT.match(pattern, i):
            best[-1] = max(best[-1], last * max(int(match[1]), int(match[2] or 0)))
            i, last = match.end(), 1
        else:
            i, last = i + 1, 1
    return max(best)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location ("[time] file.cc:123: message")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    head, sep, tail = text.partition(": ")
    return tail if sep and ".cc:" in head else text


@dataclass
class Fill:
    """The token masks of a step's constrained rows, filling (`Grammars.fill`)."""

    rows: list[int]  # the step's rows that have a mask, in the masks' order
    host: "torch.Tensor"  # [rows, words] int32, one bit per token, 1 where allowed (pinned, on CUDA)
    ticket: int | None  # the gate's ticket that the fill opens (runner/host_gate.py), if any
    done: Future  # the fill's seconds, the sequences that took tokens ahead and their grammars' verdicts


class Grammars:
    """The engine process's side: a compiler over the tokenizer's vocabulary (built at first use), compiles in
    threads beside the engine loop, the compiled grammars of recent requests (at most CACHE_ENTRIES), and the step's
    token masks. A request's grammar is a Future on its sequence until the engine admits it (`poll`)."""

    CACHE_ENTRIES = 256
    WORKERS = 4  # a compile that never ends holds one; the others serve the rest

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, max_rows: int,
                 timeout: float = COMPILE_TIMEOUT_S):
        self.vocab_size, self.timeout = vocab_size, timeout
        self._pool = ThreadPoolExecutor(self.WORKERS, thread_name_prefix="grammar")
        self._compiler = self._pool.submit(self._new_compiler, tokenizer, vocab_size, sorted(stop_token_ids))
        self._cache: dict[tuple, Future] = {}  # insertion-ordered: the oldest is dropped first
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="masks")
        self.stops: frozenset[int] | None = None  # the tokenizer's stop tokens, as the matchers know them
        self._buffers = None  # two [max_rows, words] int32 masks, built with the first constrained step
        self._turn = 0
        self._max_rows = max_rows
        self._batch = None  # xgrammar's batch matcher, made at the first step that needs it
        self._last = None  # the last constrained step's sequences, their constrained rows and matchers (`_rows`)

    @staticmethod
    def _new_compiler(tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar

        # xgrammar's calls go through tvm-ffi, which lets go of the GIL in every call by default: a matcher's own
        # `accept_token` (a microsecond or less, for a token no step took ahead) keeps it, so that another thread
        # that waits for it cannot take it between two rows (with a busy Python thread beside it, 256 rows took
        # 1.35 s instead of 0.2 ms on the H200 machine's host); the batch calls still let go of it
        from xgrammar.tvm_ffi_binding._ffi_api import GrammarMatcher

        for method in GrammarMatcher.__tvm_ffi_type_info__.methods:
            if method.name == "accept_token":
                method.func.release_gil = False
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_token_ids or None)
        # one thread per compile: the pool runs several at once
        return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._filler.shutdown(wait=True)

    def start(self, seq) -> bool:
        """Begin compiling `seq`'s grammar (or find it); True when it was compiled (or compiling) already."""
        key = seq.params.structured.key
        future = self._cache.pop(key, None)
        hit = future is not None and not (future.done() and future.exception() is not None)
        if not hit:
            future = self._pool.submit(self._compile, seq.params.structured)
        self._cache[key] = future  # now the newest
        while len(self._cache) > self.CACHE_ENTRIES:
            del self._cache[next(iter(self._cache))]
        seq.grammar, seq.grammar_since = future, time.perf_counter()
        return hit

    def _compile(self, structured: StructuredOutput):
        compiler = self._compiler.result()
        if structured.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=SEPARATORS)
        return compiler.compile_json_schema(structured.schema, any_whitespace=False, separators=SEPARATORS)

    def poll(self, seq, now: float) -> str | None:
        """None while `seq`'s grammar compiles; "" once it is ready (the sequence gets its matcher: xgrammar's own
        handle, whose calls skip the wrapper's); else why it failed (an error from xgrammar, or the time limit)."""
        future = seq.grammar
        if not future.done():
            if now - seq.grammar_since > self.timeout:
                return f"its grammar took more than {self.timeout:g} s to compile"
            return None
        if future.exception() is not None:
            return f"its grammar failed to compile: {_reason(future.exception())}"
        import xgrammar

        seq.matcher = xgrammar.GrammarMatcher(future.result())._handle
        seq.grammar = None
        if self.stops is None:  # (every matcher has the tokenizer's: read once)
            self.stops = frozenset(seq.matcher.stop_token_ids())
        return ""

    @staticmethod
    def accept(matcher, token: int) -> bool:
        """A sequence's `matcher` takes a token the host read back (no step took it ahead): whether its grammar
        allows it."""
        return matcher.accept_token(token, False)

    def _rows(self, seqs: list) -> tuple[list[int], list, list]:
        """The constrained rows of a step that samples `seqs`, their sequences and their matchers (the last step's
        again when it sampled the same sequences: steady decode)."""
        if self._last is None or self._last[0] != seqs:
            rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
            owners = [seqs[i] for i in rows]
            self._last = seqs, rows, owners, [s.matcher for s in owners]
        return self._last[1:]

    def forget(self) -> None:
        """Let go of the last step's sequences (`_rows`): a step without constrained rows ran."""
        self._last = None

    def _matcher(self):
        """xgrammar's batch matcher, on one thread: a row's mask takes a microsecond or two, and xgrammar starts its
        threads for each call (256 rows in an array of integers on the H200 machine's host: 0.44 ms on one thread,
        0.79 on two, 0.89 on four; 32 rows: 0.02 against 0.13-0.17 ms)."""
        if self._batch is None:
            import xgrammar

            self._batch = xgrammar.BatchGrammarMatcher(max_threads=1)
        return self._batch

    def fill(self, seqs: list, device, taken: "tuple[list, object] | None" = None, gate=None, failure=None,
             inline: bool = False) -> Fill:
        """Start filling the token masks of the constrained rows of a step about to sample `seqs` (it has some), in
        the masks' thread, or here with `inline`.
        `taken`: (the sequences of the step before, its SampleResult), whose tokens the host has not handed to them
        yet: in the same thread, their grammars take them first, as soon as they are on the host (`wait(failure)`;
        a sequence that finished since drops its token). A row whose grammar takes a stop token gets a mask that
        allows every token (its sequence ends at the read-back; its token will be dropped).
        `gate` (runner/host_gate.py: CUDA, with overlap): the fill opens its ticket once the masks are in `host`, and
        the device waits for that before it copies them; without one, the caller waits for `done` before the sampler
        reads them. Until the step is read back (`ready`), no matcher of `seqs` or `taken` may be used."""
        rows, owners, matchers = self._rows(seqs)
        take, pick = (), None  # the matchers that take tokens first, and which rows of the step before are theirs
        if taken is not None:
            before, source = taken
            if before == seqs:  # (steady decode: the same rows)
                take, pick = matchers, None if len(rows) == len(seqs) else rows
            else:
                pick = [i for i, s in enumerate(before) if s.matcher is not None and not s.is_finished]
                owners = [before[i] for i in pick]
                take = [s.matcher for s in owners]
        import xgrammar

        if self._buffers is None:  # two, used in turn: a step's masks may still be uploading while the next fills
            self._buffers = [xgrammar.allocate_token_bitmask(self._max_rows, self.vocab_size) for _ in range(2)]
            if device.type == "cuda":
                self._buffers = [b.pin_memory() for b in self._buffers]
        self._turn ^= 1
        host = self._buffers[self._turn][:len(rows)]
        ticket = gate.ticket() if gate is not None else None
        # xgrammar's own calls (its wrappers make a list of handles, and read a list of verdicts an element a call)
        batch, accept_all = self._matcher()._handle, xgrammar.matcher._core.BatchGrammarMatcher.batch_accept_token
        stops, write = self.stops, self._write

        def work():  # (the thread takes the GIL as little as it can: the engine's thread beside it needs it)
            try:
                tokens = verdicts = None
                if take:
                    try:
                        source.wait(failure)  # (without the GIL)
                        tokens = source.token_array().tolist()
                    except Exception:  # a device fault: that step fails at its read-back (as with NaN logits)
                        pass
                begin = time.perf_counter()
                indices, fill = None, matchers
                if tokens is not None:
                    tokens = tokens if pick is None else [tokens[i] for i in pick]
                    verdicts = accept_all(take, tokens, False)  # (each C++ call lets go of the GIL)
                    if not stops.isdisjoint(tokens):  # a grammar ends (once a request): every token allowed
                        ended = {id(m) for m, t in zip(take, tokens) if t in stops}
                        indices = [j for j, m in enumerate(matchers) if id(m) not in ended]
                        fill = [matchers[j] for j in indices]
                        host.fill_(-1)
                write(batch, fill, host, indices)
                return time.perf_counter() - begin, owners, verdicts
            finally:
                if gate is not None:
                    gate.open(ticket)
        if inline:
            future = Future()
            try:
                future.set_result(work())
            except Exception as exc:  # (raised by `ready`, as from the thread)
                future.set_exception(exc)
        else:
            future = self._filler.submit(work)
        return Fill(rows, host, ticket, future)

    @staticmethod
    def _write(batch, matchers: list, host: "torch.Tensor", indices: list[int] | None) -> None:
        """The matchers' masks into `host` (rows `indices`, or the first ones in order)."""
        batch.batch_fill_next_token_bitmask(matchers, host, indices, False)

    @staticmethod
    def ready(fill: Fill) -> tuple[float, list]:
        """Once the step that `fill` masked is on the host: the seconds the fill took, and the sequences whose grammar
        refused the token they took ahead. Raises what the fill raised."""
        seconds, owners, verdicts = fill.done.result()
        # the verdicts are read here, not in the fill's thread: reading them takes the GIL (`in` is one call)
        refused = [s for s, ok in zip(owners, verdicts) if not ok] if verdicts is not None and 0 in verdicts else []
        return seconds, refused
