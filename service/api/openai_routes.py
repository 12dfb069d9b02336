"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

A request's choices are its prompts' samples, prompt-major (choice prompt_index * n + i); a stream's chunks
carry one choice each, the choices' chunks interleaved as their tokens come."""

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from service.api import tools
from service.api.arrival import arrival
from service.api.chat import render
from service.api.errors import bad_request, checked
from service.api.schemas import ChatCompletionRequest, CompletionRequest
from service.api.state import Choices, ServerState, collect, get_state
from service.api.streaming import (chat_logprobs, completion_logprobs, json_response, prompt_text, sse,
                                   total_usage)

router = APIRouter()


@router.get("/v1/models")
async def models(state: ServerState = Depends(get_state)):
    state.check_model(state.model_name if state.loaded else "")
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "llm-service",
        "max_model_len": state.info.max_model_len, "quantization": state.info.quantization,
        "quantization_scheme": state.info.quantization_scheme}]}


async def _by_choice(request: Request, choices: Choices) -> list[list]:
    """Run every sample to its end (non-streaming): each choice's outputs, in choice order."""
    outs = [[] for _ in choices.streams]
    for out in await collect(request, choices.outputs):
        outs[choices.index(out)].append(checked(out))
    return outs


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerState = Depends(get_state)):
    state.check_model(body.model)
    prompts, params = body.prompts(), body.completion_params()
    rid, created, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.n
    choices = await state.submit_all(prompts, params, rid, "text_completion", arrival(request), body.stream, n)
    _count(state, params, None)
    tokenizer, streams = state.tokenizer, choices.streams
    echoes = [prompt_text(tokenizer, p) for p in prompts] if body.echo else None
    head = {"id": rid, "object": "text_completion", "created": created, "model": body.model}

    def logprobs(i: int, outs: list, offset: int = 0, first: bool = True) -> dict | None:
        if body.logprobs is None:
            return None
        echoed = (streams[i].prompt_ids, streams[i].prompt_logprobs) if echoes and first else None
        return completion_logprobs(tokenizer, outs, offset, echoed)

    if body.stream:
        async def chunks() -> AsyncIterator[dict]:
            offsets, started = [0] * len(streams), [False] * len(streams)
            async for out in choices.outputs:
                i = choices.index(checked(out))
                text, first = out.text_delta, not started[i]
                if first and echoes:
                    text = echoes[i // n] + text  # the prompt comes with each choice's first chunk
                started[i] = True
                lp = logprobs(i, [out], offsets[i], first)
                if lp is not None:
                    offsets[i] += sum(len(t) for t in lp["tokens"])
                yield {**head, "choices": [{"index": i, "text": text, "logprobs": lp,
                                            "finish_reason": out.finish_reason}]}
            if body.include_usage:
                yield {**head, "choices": [], "usage": total_usage(streams, n)}
        return sse(chunks())

    outs = await _by_choice(request, choices)
    return json_response({**head, "choices": [{
        "index": i, "text": (echoes[i // n] if echoes else "") + "".join(o.text_delta for o in mine),
        "finish_reason": mine[-1].finish_reason, "logprobs": logprobs(i, mine)} for i, mine in enumerate(outs)],
        "usage": total_usage(streams, n)})


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: ServerState = Depends(get_state)):
    state.check_model(body.model)
    body.check()
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise bad_request("this model has no tokenizer, so no chat template; use /v1/completions", "messages")
    tool_plan = body.tool_plan(state.settings.server.tool_call_parser)
    prompt = render(tokenizer, state.chat_template, body.messages, tool_plan.tools if tool_plan else None)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.sampling_params(max_tokens, body.num_logprobs)
    if tool_plan is not None and tool_plan.structured is not None:
        params.structured = tool_plan.structured
    rid, created, n = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.n
    choices = await state.submit_all([prompt], params, rid, "chat", arrival(request), body.stream, n)
    _count(state, params, tool_plan)
    streams = choices.streams
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model}
    parsers = [tool_plan.new_parser() for _ in range(n)] if tool_plan else None

    if body.stream:
        async def chunks() -> AsyncIterator[dict]:
            for i in range(n):
                yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            async for out in choices.outputs:
                i = choices.index(checked(out))
                logprobs = chat_logprobs(tokenizer, [out]) if body.logprobs else None
                if parsers is None:
                    deltas, reason = [{"content": out.text_delta}] if out.text_delta else [{}], out.finish_reason
                else:
                    deltas, reason = _tool_deltas(state, parsers[i], out)
                    if not deltas and reason is None and logprobs is None:
                        continue  # text held back (a call not yet named, a tag not yet closed)
                    deltas = deltas or [{}]
                for k, delta in enumerate(deltas):  # a chunk each: content, a call's start, its arguments
                    last = k == len(deltas) - 1
                    yield {**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                                "finish_reason": reason if last else None}]}
            if body.include_usage:
                yield {**head, "choices": [], "usage": total_usage(streams, n)}
        return sse(chunks())

    outs = await _by_choice(request, choices)
    answers = []
    for i, mine in enumerate(outs):
        text, reason = "".join(o.text_delta for o in mine), mine[-1].finish_reason
        message = {"role": "assistant", "content": text}
        if parsers is not None:
            message, reason = _tool_answer(state, parsers[i], text, reason)
        answers.append({"index": i, "message": message, "finish_reason": reason,
                        "logprobs": chat_logprobs(tokenizer, mine) if body.logprobs else None})
    return json_response({**head, "object": "chat.completion", "choices": answers, "usage": total_usage(streams, n)})


def _tool_deltas(state: ServerState, parser: tools.Parser, out) -> tuple[list[dict], str | None]:
    """A streamed output through its choice's tool-call parser: its deltas and finish reason."""
    events = parser.feed(out.text_delta) + (parser.finish() if out.finished else [])
    state.count_tool_calls(sum(e[0] == "call" for e in events))
    return tools.deltas(parser, events), parser.finish_reason(out.finish_reason)


def _tool_answer(state: ServerState, parser: tools.Parser, text: str, reason: str) -> tuple[dict, str]:
    """A whole answer through its choice's tool-call parser: the message and finish reason."""
    parser.feed(text)
    parser.finish()
    state.count_tool_calls(len(parser.calls))
    return parser.message(), parser.finish_reason(reason)


def _count(state: ServerState, params, tool_plan) -> None:
    """llm_structured_requests: tools when they are on (tool_choice not none), else response_format's kind."""
    if tool_plan is not None:
        state.count_structured("tools")
    elif params.structured is not None:
        state.count_structured(params.structured.kind)
