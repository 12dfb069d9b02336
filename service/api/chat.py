"""Chat messages to a prompt, through the model's chat template (or --chat-template), with the request's tools.

A template that mentions tools gets them (apply_chat_template's `tools`), and the history's tool calls and
results as OpenAI sends them. Any other template (the default model's ignores tools) gets plain text, Hermes
style: the tools and how to call them in the system message, earlier calls as <tool_call> blocks in the
assistant's text, tool results as a user message of <tool_response> blocks.
"""

import json

from service.api.errors import bad_request
from service.api.tools import CLOSE, OPEN

HERMES_SYSTEM = """You can call functions. Each one is described below as JSON: its name, what it does and the JSON \
Schema of its arguments.
<tools>
{tools}
</tools>
To call a function, answer with a JSON object of its name and arguments inside <tool_call></tool_call> tags, one \
block per call:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def takes_tools(template: str) -> bool:
    return "tools" in template


def render(tokenizer, template: str | None, messages: list, tools: list[dict] | None) -> str:
    """The prompt of these ChatMessages; `template` overrides the tokenizer's, `tools` (None: none offered) as
    OpenAI sends them."""
    source = template or getattr(tokenizer, "chat_template", None)
    if not source:
        raise bad_request("this model has no chat template; use /v1/completions (or serve it with "
                          "--chat-template)", "messages")
    if takes_tools(source):
        conversation, extra = [_as_openai(m) for m in messages], {"tools": tools} if tools else {}
    else:
        conversation, extra = _as_text(messages, tools), {}
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                             chat_template=template, **extra)
    except Exception as exc:  # templates raise on roles or orders they do not accept
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None


def _arguments(text: str):
    """A call's arguments for a template: the object (templates write it with tojson), or the text if not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _as_openai(m) -> dict:
    message = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
    if m.role == "tool":
        message.update(tool_call_id=m.tool_call_id, **({"name": m.name} if m.name else {}))
    return message


def _block(call) -> str:
    text = json.dumps({"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                      ensure_ascii=False)
    return f"{OPEN}\n{text}\n{CLOSE}"


def _as_text(messages: list, tools: list[dict] | None) -> list[dict]:
    out = []
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("results"):  # one user message for consecutive results
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "results": True})
        elif m.tool_calls:
            blocks = [_block(c) for c in m.tool_calls]
            out.append({"role": m.role, "content": "\n".join(filter(None, [m.text(), *blocks]))})
        else:
            out.append({"role": m.role, "content": m.text()})
    for message in out:
        message.pop("results", None)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = HERMES_SYSTEM.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] += "\n\n" + system
        else:
            out.insert(0, {"role": "system", "content": system})
    return out
