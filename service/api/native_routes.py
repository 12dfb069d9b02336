"""Native routes: /generate (with the request's own timings), /health, /ready and /metrics."""

import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from service.api.app import ServerState, collect, get_state
from service.api.arrival import arrival
from service.api.errors import checked
from service.api.schemas import GenerateRequest
from service.api.streaming import sse, timings, usage

public = APIRouter()  # no API key: probes and scrapers
router = APIRouter()


@public.get("/health")
async def health():
    """The process is alive and its event loop answers."""
    return {"status": "ok"}


@public.get("/ready")
async def ready(state: ServerState = Depends(get_state)):
    """The model is loaded and the engine loop runs (and the server is not draining)."""
    if state.ready:
        return {"status": "ready", "model": state.model_name}
    reason = ("draining" if state.draining else "failed: " + repr(state.load_error) if state.load_error
              else "engine stopped" if state.facade is not None else "loading")
    return JSONResponse({"status": "not ready", "reason": reason}, status_code=503, headers={"Retry-After": "5"})


@public.get("/metrics", include_in_schema=False)
async def metrics(request: Request, state: ServerState = Depends(get_state)):
    """Prometheus metrics; OpenMetrics (with exemplars) when the scraper asks for it."""
    body, content_type = state.telemetry.render(request.headers.get("accept"))
    return Response(body, media_type=content_type)


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, state: ServerState = Depends(get_state)):
    rid = f"gen-{uuid.uuid4().hex}"
    stream = state.submit(body.single_prompt(), body.sampling_params(body.max_tokens, body.logprobs), rid,
                          "generate", arrival(request))

    def final(out) -> dict:
        return {"id": rid, "finish_reason": out.finish_reason, "usage": usage(out), "timings": timings(out.timings)}

    if body.stream:
        async def events():
            async for out in stream:
                checked(out)
                event = {"text": out.text_delta, "token_ids": out.new_token_ids}
                yield {**event, **final(out)} if out.finished else event
        return sse(events())

    outs = await collect(request, stream)
    last = checked(outs[-1])
    return {"text": "".join(o.text_delta for o in outs), "token_ids": [t for o in outs for t in o.new_token_ids],
            **final(last)}
