"""Server-sent events and the token-level details (logprobs, timings) that responses carry."""

from collections.abc import AsyncIterator

import msgspec
from fastapi.responses import Response, StreamingResponse

from service.api.errors import to_api_error
from service.engine import RequestOutput
from service.engine.sequence import Timings


def json_response(body: dict) -> Response:
    """A whole (non-streaming) answer, encoded as a streamed chunk is (msgspec: compact, UTF-8; a NaN or an infinity
    becomes null). FastAPI's own path for a returned dict walks it with jsonable_encoder and then encodes it with the
    standard library: 8% of a front end's CPU samples under non-streaming load, against 0.6% for this."""
    return Response(msgspec.json.encode(body), media_type="application/json")


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Each event as `data: <json>`, then `data: [DONE]`; an error mid-stream becomes an error event. The JSON is
    msgspec's (compact, UTF-8): a streamed chunk is a front end's most frequent work, and the standard library's
    encoder took about a third of it."""
    encode = msgspec.json.encode

    async def body():
        try:
            async for event in events:
                yield b"data: " + encode(event) + b"\n\n"
        except Exception as exc:
            yield b"data: " + encode(to_api_error(exc).body()) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def completion_logprobs(tokenizer, outs: list[RequestOutput], offset: int = 0,
                        prompt: tuple[list[int], list | None] | None = None) -> dict:
    """OpenAI completions shape: tokens, token_logprobs, top_logprobs, text_offset. With `prompt` (echo: its
    token ids and the engine's prompt logprobs) the prompt's tokens come first, the first one's entries null."""
    result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(token_id: int, logprob: float | None, top: list | None) -> None:
        nonlocal offset
        text = token_text(tokenizer, token_id)
        result["tokens"].append(text)
        result["token_logprobs"].append(logprob)
        result["top_logprobs"].append(None if top is None else {token_text(tokenizer, t): lp for t, lp in top})
        result["text_offset"].append(offset)
        offset += len(text)

    if prompt is not None:
        ids, logprobs = prompt
        add(ids[0], None, None)  # nothing comes before the first token to predict it
        for token_id, (logprob, top) in zip(ids[1:], logprobs or [(None, None)] * (len(ids) - 1)):
            add(token_id, logprob, top)
    for out in outs:
        for token_id, (logprob, top) in zip(out.new_token_ids, out.new_logprobs):
            add(token_id, logprob, top)
    return result


def prompt_text(tokenizer, prompt: str | list[int]) -> str:
    """What echo puts before the completion: the prompt as sent, token ids decoded ("" without a tokenizer)."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt) if tokenizer is not None else ""


def chat_logprobs(tokenizer, outs: list[RequestOutput]) -> dict:
    """OpenAI chat shape: content = [{token, logprob, bytes, top_logprobs: [...]}]."""

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for out in outs:
        for token_id, (logprob, top) in zip(out.new_token_ids, out.new_logprobs):
            content.append({**entry(token_id, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]})
    return {"content": content}


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def usage(out: RequestOutput) -> dict:
    return _usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)


def total_usage(streams: list, n: int) -> dict:
    """Usage of a request's samples (RequestStreams, prompt-major, n per prompt): each prompt counted once (its
    cached tokens those of its sample 0), every sample's completion tokens."""
    firsts = streams[::n]
    return _usage(sum(len(s.prompt_ids) for s in firsts), sum(len(s.token_ids) for s in streams),
                  sum(s.num_cached_tokens for s in firsts))


def timings(t: Timings) -> dict:
    """The request's own clock, in seconds from its arrival (the moment the server received it)."""
    rel = lambda x: None if x is None else x - t.arrival
    times = [x - t.arrival for x in t.token_times]
    return {"frontend": rel(t.submitted), "queue": rel(t.first_scheduled), "ttft": rel(t.first_token),
            "token_times": times, "inter_token": [b - a for a, b in zip(times, times[1:])],
            "total": rel(t.finished if t.finished is not None else (t.token_times or [None])[-1])}
