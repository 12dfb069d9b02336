"""Tool calls in a chat answer: what a request's tools and tool_choice ask of the model, and the parsers that find
the calls in its output, fed delta by delta so that a stream sends each call as it comes.

tool_choice `required` constrains the output to a JSON array of calls and a named function to that function's
arguments (engine/structured.py: compact JSON, properties in schema order); `auto` leaves the model free and
parses what it writes (--tool-call-parser). A parser turns text into events: ("content", text), ("call", i) when
call i's id and name are known, ("arguments", i, fragment). The fragments of a call joined are its final
arguments string, so a stream's deltas and the whole answer agree.
"""

import json
import re
import secrets
from dataclasses import dataclass, field

from service.api.errors import bad_request
from service.engine.structured import StructuredOutput, check

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128  # OpenAI's cap
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Call:
    name: str
    arguments: str = ""
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolPlan:
    """What a request's tools ask for: `choice` is auto, required or function (then `function` names it); `tools` go
    to the prompt (as OpenAI sends them); `structured` is the grammar of required and of a named function."""

    choice: str
    tools: list[dict]
    parallel: bool
    parser: str
    structured: StructuredOutput | None = None
    function: str | None = None

    def new_parser(self) -> "Parser":
        names = {t["function"]["name"] for t in self.tools}
        if self.choice == "required":
            return ArrayParser(names, self.parallel)
        if self.choice == "auto":
            return (JSONParser if self.parser == "json" else HermesParser)(names, self.parallel)
        return ArgumentsParser(self.function)


def plan(tools: list[dict] | None, tool_choice, parallel: bool, parser: str) -> ToolPlan | None:
    """The request's ToolPlan (None: tools are off, no tools or tool_choice none); a 400 names what is wrong."""
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    if not tools:
        if named or tool_choice == "required":
            raise bad_request("tool_choice names a function or requires a call, but the request has no tools",
                              "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    functions = [t["function"] for t in tools]
    names = [f["name"] for f in functions]
    for f in functions:
        if not NAME.fullmatch(f["name"]):
            raise bad_request(f"tool name {f['name'][:80]!r} must be 1 to 64 letters, digits, _ or -", "tools")
        if not f.get("parameters"):  # none, or {}: no arguments
            f["parameters"] = {"type": "object", "properties": {}}
        elif f["parameters"].get("type") != "object":
            raise bad_request(f"the parameters of tool {f['name']!r} must be a JSON schema of type object", "tools")
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", "tools")
    if tool_choice in (None, "auto"):
        return ToolPlan("auto", tools, parallel, parser)
    if tool_choice == "none":
        return None
    if named is not None:
        if named not in names:
            raise bad_request(f"tool_choice names {named[:80]!r}, which is not among the tools", "tool_choice")
        schema = functions[names.index(named)]["parameters"]
    else:
        schema = required_schema(functions, parallel)
    structured = StructuredOutput("json_schema", _dumps(schema))
    check(structured, "tools")  # a 400 that names tools, before check_request would name response_format
    return ToolPlan("function" if named else "required", tools, parallel, parser, structured, named)


def required_schema(functions: list[dict], parallel: bool) -> dict:
    """tool_choice required: an array of one or more calls, each the name of a tool and its arguments."""
    call = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
             "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _dumps(schema) -> str:
    try:
        return json.dumps(schema)
    except (RecursionError, ValueError):  # nested deeper than json can write: far past any limit
        raise bad_request("the tools' parameters nest too deeply", "tools") from None


# -- parsers ----------------------------------------------------------------------------------------------------

class Parser:
    """Output text in, events out (see the module's docstring); `calls` and `content` hold the whole answer."""

    def __init__(self, names: set[str] = frozenset(), parallel: bool = True):
        self.names, self.parallel = names, parallel
        self.calls: list[Call] = []
        self.content = ""
        self._events: list = []
        self._space, self._started = "", False  # content's held trailing whitespace; whether content began

    def feed(self, text: str) -> list:
        raise NotImplementedError

    def finish(self) -> list:
        return self._take()

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def message(self) -> dict:
        message = {"role": "assistant", "content": self.content or None}
        if self.calls:
            message["tool_calls"] = [c.as_dict() for c in self.calls]
        return message

    def _take(self) -> list:
        events, self._events = self._events, []
        return events

    def _call(self, name: str, arguments: str | None = None) -> int | None:
        """Start a call (None: a function not among the tools, or a second call where only one is allowed)."""
        if name not in self.names or (self.calls and not self.parallel):
            return None
        self.calls.append(Call(name))
        self._events.append(("call", len(self.calls) - 1))
        if arguments is not None:
            self._arguments(len(self.calls) - 1, arguments)
        return len(self.calls) - 1

    def _arguments(self, index: int, fragment: str) -> None:
        if fragment:
            self.calls[index].arguments += fragment
            self._events.append(("arguments", index, fragment))

    def _content(self, text: str, final: bool = False) -> None:
        """Content, stripped at its two ends: trailing whitespace waits until more text follows it."""
        text = self._space + text
        if not self._started:
            text = text.lstrip()
        kept = text.rstrip()
        self._space = "" if final else text[len(kept):]
        if kept:
            self._started = True
            self.content += kept
            self._events.append(("content", kept))


class ArgumentsParser(Parser):
    """A named function: the whole output is its arguments."""

    def __init__(self, name: str):
        super().__init__({name})
        self._call(name)

    def feed(self, text: str) -> list:
        self._arguments(0, text)
        return self._take()

    def finish_reason(self, reason: str | None) -> str | None:
        return reason  # OpenAI answers a named tool_choice with stop


class ArrayParser(Parser):
    """tool_choice required: the JSON array the grammar forces, [{"name":"f","arguments":{...}},...], compact and
    name first, so a call starts when its arguments object opens and each character inside is a fragment."""

    def __init__(self, names: set[str], parallel: bool = True):
        super().__init__(names, parallel)
        self._depth, self._string, self._escape = 0, False, False
        self._head = ""  # the current element's text before its arguments
        self._index = None  # the call whose arguments are being read
        self._skip = False  # the current element is not a call we keep

    def feed(self, text: str) -> list:
        start = 0
        for at, ch in enumerate(text):
            opens = closes = False
            if self._string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._string = False
            elif ch == '"':
                self._string = True
            elif ch in "{[":
                self._depth += 1
                opens = True
            elif ch in "}]":
                self._depth -= 1
                closes = True
            if self._index is not None:
                if closes and self._depth == 2:  # the arguments object closed
                    self._arguments(self._index, text[start:at + 1])
                    self._index = None
            elif opens and self._depth == 3 and not self._skip:  # a value opens inside an element: the arguments
                self._index = self._call(_name(self._head))
                self._skip = self._index is None
                start = at
            elif self._depth >= 2:
                self._head += ch
            if closes and self._depth == 1:  # an element ended
                self._head, self._skip = "", False
        if self._index is not None:
            self._arguments(self._index, text[start:])
        return self._take()


def _name(head: str) -> str:
    """The name in an element's text before its arguments, {"name":"f","arguments": ("" if it is not that)."""
    try:
        value = json.loads(head + "0}")
    except ValueError:
        return ""
    return value.get("name") if isinstance(value, dict) and isinstance(value.get("name"), str) else ""


def _as_call(value) -> tuple[str, str] | None:
    """{"name": ..., "arguments": {...}} as (name, arguments JSON), or None if it is not that shape."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class HermesParser(Parser):
    """tool_choice auto, Hermes style: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks in free text.
    Text that could be the start of a tag is held back; a block is sent once it closes (or the output ends), and
    one that does not hold a call of a known tool is content, as written."""

    def __init__(self, names: set[str], parallel: bool = True):
        super().__init__(names, parallel)
        self._buffer, self._in_block = "", False

    def feed(self, text: str) -> list:
        # a block's text grows delta by delta: look for its end only where it could newly be
        since = max(0, len(self._buffer) - len(CLOSE))
        self._buffer += text
        while True:
            tag = CLOSE if self._in_block else OPEN
            at = self._buffer.find(tag, since)
            since = 0
            if at < 0:
                break
            before, self._buffer = self._buffer[:at], self._buffer[at + len(tag):]
            if self._in_block:
                self._block(before, closed=True)
            else:
                self._content(before)
            self._in_block = not self._in_block
        if not self._in_block:  # send all but what could still become <tool_call>
            keep = next((k for k in range(min(len(OPEN) - 1, len(self._buffer)), 0, -1)
                         if OPEN.startswith(self._buffer[-k:])), 0)
            self._content(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
        return self._take()

    def finish(self) -> list:
        if self._in_block:
            self._block(self._buffer, closed=False)  # the output ended inside a block
        else:
            self._content(self._buffer, final=True)
        self._buffer, self._in_block = "", False
        self._content("", final=True)
        return self._take()

    def _block(self, body: str, closed: bool) -> None:
        try:
            call = _as_call(json.loads(body))
        except ValueError:
            call = None
        if call is None or call[0] not in self.names:
            self._content(OPEN + body + (CLOSE if closed else ""))
        else:
            self._call(*call)  # a second call where parallel_tool_calls is false is dropped


class JSONParser(Parser):
    """tool_choice auto, the whole output a call {"name": ..., "arguments": {...}} or a list of them. Output that
    opens with { or [ is held to its end; if it is not calls, it is content."""

    def __init__(self, names: set[str], parallel: bool = True):
        super().__init__(names, parallel)
        self._state, self._held = "start", ""  # start: nothing but whitespace yet; then held or text

    def feed(self, text: str) -> list:
        if self._state == "start" and text.strip():
            self._state = "held" if text.lstrip()[0] in "{[" else "text"
        if self._state == "held":
            self._held += text
        elif self._state == "text":
            self._content(text)
        return self._take()

    def finish(self) -> list:
        if self._held:
            try:
                value = json.loads(self._held)
            except ValueError:
                value = None
            values = value if isinstance(value, list) else [value]
            calls = [_as_call(v) for v in values]
            if values and all(c is not None and c[0] in self.names for c in calls):
                for call in calls:
                    self._call(*call)
            else:
                self._content(self._held)
        self._content("", final=True)
        return self._take()


def deltas(parser: Parser, events: list) -> list[dict]:
    """A stream's chat deltas for these events: content; a call's first delta (its id and name, arguments ""); its
    argument fragments. Consecutive events of one kind (and one call) share a delta."""
    out = []
    for event in events:
        kind, index = event[0], event[1] if len(event) > 1 else None
        last = out[-1] if out else None
        if kind == "content":
            if last is not None and "content" in last:
                last["content"] += event[1]
            else:
                out.append({"content": event[1]})
        elif kind == "call":
            call = parser.calls[index]
            out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
        else:
            entry = last["tool_calls"][0] if last is not None and "tool_calls" in last else None
            if entry is not None and entry["index"] == index and "id" not in entry:
                entry["function"]["arguments"] += event[2]
            else:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": event[2]}}]})
    return out
