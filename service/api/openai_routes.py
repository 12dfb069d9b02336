"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from service.api.arrival import arrival
from service.api.errors import bad_request, checked
from service.api.schemas import ChatCompletionRequest, CompletionRequest
from service.api.state import ServerState, collect, get_state
from service.api.streaming import chat_logprobs, completion_logprobs, sse, usage

router = APIRouter()


@router.get("/v1/models")
async def models(state: ServerState = Depends(get_state)):
    state.check_model(state.model_name if state.loaded else "")
    return {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "llm-service",
        "max_model_len": state.info.max_model_len, "quantization": state.info.quantization,
        "quantization_scheme": state.info.quantization_scheme}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerState = Depends(get_state)):
    state.check_model(body.model)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    stream = await state.submit(body.single_prompt(), body.sampling_params(body.max_tokens, body.logprobs), rid,
                                "text_completion", arrival(request), body.stream)
    tokenizer = state.tokenizer
    head = {"id": rid, "object": "text_completion", "created": created, "model": body.model}

    if body.stream:
        async def chunks() -> AsyncIterator[dict]:
            offset, last = 0, None
            async for out in stream:
                last = checked(out)
                logprobs = completion_logprobs(tokenizer, [out], offset) if body.logprobs is not None else None
                offset += sum(len(t) for t in (logprobs or {}).get("tokens", []))
                yield {**head, "choices": [{"index": 0, "text": out.text_delta, "logprobs": logprobs,
                                            "finish_reason": out.finish_reason}]}
            if body.include_usage and last is not None:
                yield {**head, "choices": [], "usage": usage(last)}
        return sse(chunks())

    outs = await collect(request, stream)
    last = checked(outs[-1])
    return {**head, "choices": [{
        "index": 0, "text": "".join(o.text_delta for o in outs), "finish_reason": last.finish_reason,
        "logprobs": completion_logprobs(tokenizer, outs) if body.logprobs is not None else None}],
        "usage": usage(last)}


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
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    stream = await state.submit(prompt, body.sampling_params(max_tokens, body.num_logprobs), rid, "chat",
                                arrival(request), body.stream)
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model}

    if body.stream:
        async def chunks() -> AsyncIterator[dict]:
            yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
            last = None
            async for out in stream:
                last = checked(out)
                delta = {"content": out.text_delta} if out.text_delta else {}
                logprobs = chat_logprobs(tokenizer, [out]) if body.logprobs else None
                yield {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                            "finish_reason": out.finish_reason}]}
            if body.include_usage and last is not None:
                yield {**head, "choices": [], "usage": usage(last)}
        return sse(chunks())

    outs = await collect(request, stream)
    last = checked(outs[-1])
    return {**head, "object": "chat.completion", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": "".join(o.text_delta for o in outs)},
        "logprobs": chat_logprobs(tokenizer, outs) if body.logprobs else None,
        "finish_reason": last.finish_reason}], "usage": usage(last)}
