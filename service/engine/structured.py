"""Output that must match a grammar: any JSON object, or a JSON Schema. xgrammar does the work.

What a request asks for is a `StructuredOutput` in its SamplingParams; `check` validates it where the request
arrives (a front end: a 400 that says why, before the engine sees it). The engine process compiles each distinct
grammar against the tokenizer's vocabulary once, in a thread beside its loop, and keeps it in xgrammar's cache
(`Grammars`); a request waits for its grammar outside the scheduler, so the batch never does. Each constrained
sequence then has a matcher that takes its tokens as the host reads them back and fills its row of a token
bitmask for the next sample; the sampler's LogitEdits applies the bitmask (runner/logit_edits.py).
"""

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from service.engine.errors import InvalidRequestError

log = logging.getLogger(__name__)

KINDS = ("json_object", "json_schema")
MAX_SCHEMA_BYTES = 32 * 1024  # a schema's JSON text, at most
MAX_SCHEMA_DEPTH = 24  # objects and arrays nested in a schema, at most
COMPILE_TIMEOUT_S = 10.0  # a grammar not compiled by then fails its request (it goes on compiling, then is cached)
SEPARATORS = (",", ":")  # compact JSON: a small model cannot wander in whitespace


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
    kind, a schema that parses as JSON, within the size and nesting limits, that xgrammar turns into a grammar."""
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


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location ("[time] file.cc:123: message")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    head, sep, tail = text.partition(": ")
    return tail if sep and ".cc:" in head else text
