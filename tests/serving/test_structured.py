"""Structured output (response_format) and tool calls (tools, tool_choice) through the official openai client against a
real uvicorn server on loopback (the default model, on CPU); the tool-call parsers and the prompt's rendering on
fixed texts."""

import json

import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from service.api import tools
from service.api.chat import HERMES_SYSTEM, render
from service.api.errors import APIError
from service.api.schemas import ChatMessage
from service.settings import load_template
from tests import web
from tests.conftest import LiveServer

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# bounded whatever is sampled: enums, a boolean, a short string
BOUNDED = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                            "word": {"type": "string", "maxLength": 12}},
           "required": ["color", "ok", "word"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(default_model):
    with LiveServer(default_model, {"max_num_seqs": 16}) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def parameters(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def metric(server, name: str, **labels) -> float:
    text = web.get(server.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def joined_calls(chunks) -> dict[int, dict]:
    """A chat stream's tool calls by index: the first delta gives id and name (arguments ""), later ones
    fragments of the arguments."""
    calls = {}
    for chunk in chunks:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call.id is not None:
                assert call.index not in calls and call.type == "function" and call.function.arguments == ""
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
    return calls


# -- response_format -----------------------------------------------------------------------------------------------
class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=130)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    out = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person: a name and an age."}],
        response_format=Person, temperature=0, max_tokens=60)
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 130
    assert out.choices[0].finish_reason == "stop"


def test_json_object_answers_a_json_object_in_compact_form(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}],
                                         response_format={"type": "json_object"}, temperature=0, max_tokens=80)
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


def test_json_schema_streamed_at_temperature_1_validates(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a color."}], temperature=1.0, max_tokens=60,
        stream=True, response_format={"type": "json_schema",
                                      "json_schema": {"name": "pick", "schema": BOUNDED, "strict": False}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), BOUNDED)
    assert ", " not in text and ": " not in text  # compact: the grammar leaves no whitespace to wander in


def test_response_format_on_completions_and_generate(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": BOUNDED}}
    out = client.completions.create(model=MODEL, prompt="A color as JSON:", max_tokens=60, temperature=0,
                                    extra_body={"response_format": fmt})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), BOUNDED)
    r = web.post(server.url + "/generate", json={"prompt": "A color as JSON:", "max_tokens": 60, "temperature": 0,
                                                 "response_format": fmt}, timeout=60)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["text"]), BOUNDED)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_tokens_the_grammar_rules_out_are_a_finite_floor(server, stream):
    """Where a grammar allows one token, the other top_logprobs have -inf logits: JSON cannot carry -inf (a
    non-streamed answer failed to encode, a 500; a streamed one sent -Infinity), so they come as -9999.0."""
    one_way = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "logprobs": True,
            "top_logprobs": 5, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "one_way", "schema": one_way}}}
    r = web.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text

    def strict(text: str):  # JSON as the standard has it: no NaN, no Infinity
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text[:200]}"))
    if stream:
        chunks = [strict(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        entries = [e for c in chunks for ch in c["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
    else:
        entries = strict(r.text)["choices"][0]["logprobs"]["content"]
    tops = [t["logprob"] for e in entries for t in e["top_logprobs"]]
    assert entries and len(tops) == 5 * len(entries)
    assert min(tops) == -9999.0  # a position with one way on: the other four are the floor
    assert all(-9999.0 <= e["logprob"] <= 0 for e in entries)


def test_structured_requests_are_counted_by_constraint(client, server):
    before = metric(server, "llm_structured_requests_total", constraint="json_object")
    client.completions.create(model=MODEL, prompt="{", max_tokens=2, extra_body={"response_format": {
        "type": "json_object"}})
    assert metric(server, "llm_structured_requests_total", constraint="json_object") == before + 1
    before = metric(server, "llm_structured_requests_total", constraint="tools")
    client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=2)
    client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert metric(server, "llm_structured_requests_total", constraint="tools") == before + 1


# -- invalid and hostile schemas -----------------------------------------------------------------------------------
def deep(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


BAD_FORMATS = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wizard"}}}, "Unsupported type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}, "Regex"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}}}, "bytes"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": deep(30)}}, "deeper"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "type"),
]


@pytest.mark.parametrize("fmt, reason", BAD_FORMATS, ids=lambda v: str(v)[:30])
def test_an_invalid_response_format_is_a_400_naming_it_with_a_reason(server, fmt, reason):
    for route, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "x"})):
        r = web.post(server.url + route, json={"model": MODEL, "response_format": fmt, **body}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"].startswith("response_format") and reason in error["message"], error


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "(a*)*b" * 200}}, "required": ["s"]},
    {"type": "object", "properties": {"s": {"type": "string", "pattern": "|".join(f"w{i}x" for i in range(3000))}}},
    {"type": "array", "minItems": 100000, "items": {"type": "integer"}},
    {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}}, "$ref": "#/$defs/a"},
], ids=["nested-stars", "long-alternation", "huge-minItems", "recursive-ref"])
def test_a_hostile_schema_gets_a_400_or_a_bounded_answer_and_the_server_serves_on(client, server, schema):
    r = web.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "response_format"
    else:
        assert r.json()["usage"]["completion_tokens"] <= 8
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
    assert plain.choices[0].message.content
    assert server.wait_idle()


# -- tools through the server --------------------------------------------------------------------------------------
def test_tool_choice_none_answers_text(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
                                         temperature=0)
    message = out.choices[0].message
    assert message.content and not message.tool_calls
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_parses_calls_if_the_model_makes_them(client, stream, server):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                                         stream=stream)
    if stream:
        chunks = list(out)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls, reason = list(joined_calls(chunks).values()), chunks[-1].choices[0].finish_reason
    else:
        message, reason = out.choices[0].message, out.choices[0].finish_reason
        content = message.content or ""
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in message.tool_calls or []]
    assert "<tool_call" not in content
    for call in calls:  # the small model may or may not call; what it calls must be well formed
        assert call["name"] in ("get_weather", "get_time") and call["id"].startswith("call_")
        assert isinstance(json.loads(call["arguments"]), dict)
    assert reason == ("tool_calls" if calls else reason)
    assert server.wait_idle()


def test_tool_choice_required_returns_valid_calls(client, server):
    before = metric(server, "llm_tool_calls_total")
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=80, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and len(call.id) == len("call_") + 24
        jsonschema.validate(json.loads(call.function.arguments), parameters(call.function.name))
    assert metric(server, "llm_tool_calls_total") == before + len(choice.message.tool_calls)


def test_tool_choice_required_streams_each_call_then_its_arguments(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 max_tokens=80, temperature=1.0, seed=7, stream=True))
    calls = joined_calls(chunks)
    assert sorted(calls) == list(range(len(calls))) and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), parameters(call["name"]))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    # after the role, no empty chunk for the text held back while a call is not yet named
    assert all(c.choices[0].delta.tool_calls or c.choices[0].finish_reason for c in chunks[1:])


def test_required_without_parallel_calls_makes_exactly_one(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=80, temperature=0)
    assert len(out.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_returns_one_call_of_that_function(client, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                         max_tokens=60, temperature=0, stream=stream)
    if stream:
        chunks = list(out)
        calls, reason = list(joined_calls(chunks).values()), chunks[-1].choices[0].finish_reason
    else:
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in out.choices[0].message.tool_calls]
        reason = out.choices[0].finish_reason
    assert [c["name"] for c in calls] == ["get_weather"] and reason == "stop"
    jsonschema.validate(json.loads(calls[0]["arguments"]), parameters("get_weather"))


def test_a_tool_round_trip_ends_in_a_plain_answer(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                         max_tokens=20, temperature=0)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


@pytest.mark.parametrize("body, param, reason", [
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "type object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "wizard"}}}}}], "tool_choice": "required"}, "tools", "Unsupported type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
])
def test_invalid_tools_are_400s_naming_the_field(server, body, param, reason):
    r = web.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and reason in error["message"], error


# -- the parsers, on fixed texts -----------------------------------------------------------------------------------
NAMES = {"get_weather", "get_time"}


def run(parser, text: str, step: int = 1) -> list:
    """Feed `text` `step` characters at a time, then finish: every event."""
    events = []
    for at in range(0, len(text), step):
        events += parser.feed(text[at:at + step])
    return events + parser.finish()


def content_of(events) -> str:
    return "".join(e[1] for e in events if e[0] == "content")


HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_hermes_finds_each_block_and_keeps_the_text_around_them(step):
    parser = tools.HermesParser(NAMES)
    events = run(parser, HERMES_TEXT, step)
    assert content_of(events) == parser.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"
    message = parser.message()
    assert message["content"] == "Let me look." and len(message["tool_calls"]) == 2


def test_hermes_never_sends_a_tag_prefix_as_content():
    parser = tools.HermesParser(NAMES)
    sent = ""
    for ch in 'Sure <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>':
        sent += content_of(parser.feed(ch))
        assert "<" not in sent
    assert content_of(parser.finish()) == "" and sent == "Sure" and len(parser.calls) == 1


def test_hermes_text_that_only_looks_like_a_tag_comes_out_at_the_end():
    parser = tools.HermesParser(NAMES)
    assert content_of(run(parser, "a < b and <tool")) == "a < b and <tool" and not parser.calls
    assert parser.message() == {"role": "assistant", "content": "a < b and <tool"}


def test_hermes_a_block_cut_off_by_the_end_of_output_is_still_a_call():
    parser = tools.HermesParser(NAMES)
    run(parser, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "PST"}}\n')
    assert [c.name for c in parser.calls] == ["get_time"] and parser.message()["content"] is None


@pytest.mark.parametrize("block", ['{"name": "get_time", "arguments": {"zone"', '{"name": "rm_rf", "arguments": {}}',
                                   '["not", "a", "call"]'])
def test_hermes_a_block_that_is_not_a_call_of_a_known_tool_stays_content(block):
    parser = tools.HermesParser(NAMES)
    text = f"<tool_call>{block}</tool_call>"
    assert content_of(run(parser, text)) == text and not parser.calls


def test_hermes_without_parallel_calls_keeps_the_first():
    parser = tools.HermesParser(NAMES, parallel=False)
    run(parser, HERMES_TEXT)
    assert [c.name for c in parser.calls] == ["get_weather"]


@pytest.mark.parametrize("text, names", [
    ('{"name": "get_time", "arguments": {"zone": "UTC"}}', ["get_time"]),
    (' [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": "{\\"city\\": '
     '\\"Oslo\\"}"}]', ["get_time", "get_weather"]),
    ("It is sunny.", []), ('{"answer": 42}', []), ('{"name": "get_time"', []),
])
def test_the_json_parser_takes_a_call_or_a_list_of_calls_else_text(text, names):
    parser = tools.JSONParser(NAMES)
    events = run(parser, text, 3)
    assert [c.name for c in parser.calls] == names
    assert content_of(events) == ("" if names else text.strip())


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_array_parser_streams_arguments_as_written(step):
    text = ('[{"name":"get_weather","arguments":{"city":"Pa}r\\"is{","unit":"celsius"}},'
            '{"name":"get_time","arguments":{"zone":"UTC"}}]')
    parser = tools.ArrayParser(NAMES)
    events = run(parser, text, step)
    assert [e for e in events if e[0] == "call"] == [("call", 0), ("call", 1)]
    fragments = {i: "".join(e[2] for e in events if e[0] == "arguments" and e[1] == i) for i in (0, 1)}
    assert fragments == {0: '{"city":"Pa}r\\"is{","unit":"celsius"}', 1: '{"zone":"UTC"}'}
    assert [c.arguments for c in parser.calls] == [fragments[0], fragments[1]]
    assert parser.message()["content"] is None and parser.finish_reason("stop") == "tool_calls"


def test_the_arguments_parser_makes_the_whole_output_one_call():
    parser = tools.ArgumentsParser("get_time")
    events = run(parser, '{"zone":"UTC"}', 4)
    assert events[0] == ("call", 0) and "".join(e[2] for e in events[1:]) == '{"zone":"UTC"}'
    assert parser.finish_reason("stop") == "stop"


def test_stream_deltas_give_a_call_its_id_and_name_first_then_its_arguments():
    parser = tools.HermesParser(NAMES)
    deltas = tools.deltas(parser, run(parser, HERMES_TEXT, 1000))
    first = parser.calls[0]
    assert deltas[0] == {"content": "Let me look."}
    assert deltas[1] == {"tool_calls": [{"index": 0, "id": first.id, "type": "function",
                                         "function": {"name": "get_weather", "arguments": ""}}]}
    assert deltas[2] == {"tool_calls": [{"index": 0, "function": {"arguments": first.arguments}}]}
    assert first.id.startswith("call_") and len(first.id) == 29


# -- plans and prompts ---------------------------------------------------------------------------------------------
def test_required_makes_an_array_schema_of_the_tools_calls():
    plan = tools.plan([json.loads(json.dumps(t)) for t in TOOLS], "required", False, "hermes")
    schema = json.loads(plan.structured.schema)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                            {"const": "get_time"}]
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"city": "Oslo", "unit": "celsius"}}], schema)


def test_a_function_named_like_a_tool_choice_is_still_that_function():
    auto = {"type": "function", "function": {"name": "auto", "parameters": {"type": "object", "properties": {}}}}
    plan = tools.plan([auto], {"type": "function", "function": {"name": "auto"}}, True, "hermes")
    assert isinstance(plan.new_parser(), tools.ArgumentsParser)


def test_a_tool_without_parameters_takes_an_empty_object():
    plan = tools.plan([{"type": "function", "function": {"name": "now"}}], {"type": "function", "function": {
        "name": "now"}}, True, "hermes")
    assert json.loads(plan.structured.schema) == {"type": "object", "properties": {}}
    plan = tools.plan([{"type": "function", "function": {"name": "now", "parameters": {}}}], "required", True, "json")
    assert json.loads(plan.structured.schema)["items"]["anyOf"][0]["properties"]["arguments"] == {
        "type": "object", "properties": {}}
    assert tools.plan([{"type": "function", "function": {"name": "now"}}], "none", True, "hermes") is None


class Tokenizer:
    """apply_chat_template's arguments, as text."""

    def __init__(self, template: str):
        self.chat_template = template

    def apply_chat_template(self, conversation, tokenize, add_generation_prompt, chat_template=None, **extra):
        return json.dumps({"conversation": conversation, "template": chat_template, **extra})


def messages(*dicts) -> list[ChatMessage]:
    return [ChatMessage(**d) for d in dicts]


def test_a_template_without_tools_gets_them_hermes_style_in_the_system_message():
    history = messages({"role": "system", "content": "Be brief."}, *ASK, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_2", "content": "13:00"})
    rendered = json.loads(render(Tokenizer("{{ messages }}"), None, history, TOOLS))
    system, user, assistant, result = rendered["conversation"]
    assert "tools" not in rendered
    assert system["content"].startswith("Be brief.\n\nYou can call functions.")
    assert json.dumps(WEATHER) in system["content"] and "<tool_call>" in system["content"]
    assert assistant == {"role": "assistant", "content": '<tool_call>\n{"name": "get_time", "arguments": '
                                                         '{"zone": "UTC"}}\n</tool_call>'}
    assert result == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>\n"
                                                 "<tool_response>\n13:00\n</tool_response>"}
    plain = json.loads(render(Tokenizer("{{ messages }}"), None, messages(*ASK), None))
    assert plain["conversation"] == ASK


def test_a_template_that_mentions_tools_gets_them_and_the_history_as_sent():
    history = messages(*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_time", "content": "12:00"})
    override = "{% for t in tools %}{{ t }}{% endfor %}"
    rendered = json.loads(render(Tokenizer("{{ messages }}"), override, history, TOOLS))
    assert rendered["tools"] == TOOLS and rendered["template"] == override
    assert rendered["conversation"][1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_time", "arguments": {"zone": "UTC"}}}]
    assert rendered["conversation"][2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1",
                                           "name": "get_time"}


def test_the_default_models_template_renders_a_tool_round_trip(server):
    history = messages(*ASK, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"})
    prompt = render(server.engine.tokenizer, None, history, TOOLS)
    assert prompt.startswith("<|im_start|>system\nYou can call functions.")
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert HERMES_SYSTEM.split("\n")[0] in prompt


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_template(str(path)) == load_template("{{ messages }}") == "{{ messages }}"
    assert load_template(None) is None
    with pytest.raises(ValueError, match="neither a file"):
        load_template(str(tmp_path / "missing.jinja"))


def test_serve_refuses_a_chat_template_that_is_neither_file_nor_template(tmp_path, capsys):
    from service import settings

    with pytest.raises(SystemExit) as exit:
        settings.parse(["--chat-template", str(tmp_path / "missing.jinja")])
    assert exit.value.code == 2 and "neither a file nor a Jinja template" in capsys.readouterr().err
    assert settings.parse(["--tool-call-parser", "json"]).server.tool_call_parser == "json"


def test_a_model_without_a_chat_template_is_told_so():
    with pytest.raises(APIError, match="no chat template"):
        render(Tokenizer(""), None, messages(*ASK), None)


def test_random_weights_with_a_tokenizer_serve_text_and_grammars():
    """--tokenizer: a random: model gets a real tokenizer (its vocabulary sized to it), so text, chat templates and
    grammars work on it (the GPU benchmarks of grammars run this way)."""
    import torch

    from service.engine.models import load_model
    from tests.conftest import tokenizer_folder
    loaded = load_model("random:tiny", torch.float32, torch.device("cpu"), tokenizer=tokenizer_folder())
    assert loaded.model.config.vocab_size == len(loaded.tokenizer) and loaded.tokenizer_source == tokenizer_folder()
    with LiveServer(loaded) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        out = c.chat.completions.create(model=s.engine.model_name, messages=ASK, max_tokens=40, temperature=0,
                                        response_format={"type": "json_schema", "json_schema": {
                                            "name": "b", "schema": BOUNDED}})
        jsonschema.validate(json.loads(out.choices[0].message.content), BOUNDED)
        text = c.completions.create(model=s.engine.model_name, prompt="Hello", max_tokens=5, temperature=0)
        assert text.usage.completion_tokens == 5 and isinstance(text.choices[0].text, str)
