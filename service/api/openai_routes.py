"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

A request's choices are its prompts' samples, prompt-major (choice prompt_index * n + i); a stream's chunks
carry one choice each, the choices' chunks interleaved as their tokens come."""

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from service.api.arrival import arrival
from service.api.errors import bad_request, checked
from service.api.schemas import ChatCompletionRequest, CompletionRequest
from service.api.state import Choices, ServerState, collect, get_state
from service.api.streaming import chat_logprobs, completion_logprobs, prompt_text, sse, total_usage

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
    return {**head, "choices": [{
        "index": i, "text": (echoes[i // n] if echoes else "") + "".join(o.text_delta for o in mine),
        "finish_reason": mine[-1].finish_reason, "logprobs": logprobs(i, mine)} for i, mine in enumerate(outs)],
        "usage": total_usage(streams, n)}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: ServerState = Depends(get_state)):
    state.check_model(body.model)
    body.check()
    tokenizer = state.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # templates raise on roles or orders they do not accept
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.sampling_params(max_tokens, body.num_logprobs)
    rid, created, n = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.n
    choices = await state.submit_all([prompt], params, rid, "chat", arrival(request), body.stream, n)
    streams = choices.streams
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model}

    if body.stream:
        async def chunks() -> AsyncIterator[dict]:
            for i in range(n):
                yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            async for out in choices.outputs:
                i = choices.index(checked(out))
                delta = {"content": out.text_delta} if out.text_delta else {}
                logprobs = chat_logprobs(tokenizer, [out]) if body.logprobs else None
                yield {**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                            "finish_reason": out.finish_reason}]}
            if body.include_usage:
                yield {**head, "choices": [], "usage": total_usage(streams, n)}
        return sse(chunks())

    outs = await _by_choice(request, choices)
    return {**head, "object": "chat.completion", "choices": [{
        "index": i, "message": {"role": "assistant", "content": "".join(o.text_delta for o in mine)},
        "logprobs": chat_logprobs(tokenizer, mine) if body.logprobs else None,
        "finish_reason": mine[-1].finish_reason} for i, mine in enumerate(outs)],
        "usage": total_usage(streams, n)}
