"""Native routes: /generate (with the request's own timings), /health, /ready and /metrics."""

import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from service.api.arrival import arrival
from service.api.auth import require_metrics_token
from service.api.errors import checked
from service.api.schemas import GenerateRequest
from service.api.state import ServerState, collect, get_state
from service.api.streaming import json_response, sse, timings, usage

public = APIRouter()  # no API key: probes and scrapers
router = APIRouter()


@public.get("/health")
async def health(state: ServerState = Depends(get_state)):
    """The process is alive: its event loop answers and the engine has not died (after that only a restart
    helps, so a liveness probe must fail)."""
    if state.engine_error is not None:
        return JSONResponse({"status": "engine dead", "error": repr(state.engine_error)}, status_code=503)
    return {"status": "ok"}


@public.get("/ready")
async def ready(state: ServerState = Depends(get_state)):
    """The model is loaded and the engine runs (and the server is not draining)."""
    if state.ready:
        return {"status": "ready", "model": state.model_name}
    error = state.load_error or state.engine_error
    reason = "draining" if state.draining else "failed: " + repr(error) if error else "loading"
    return JSONResponse({"status": "not ready", "reason": reason}, status_code=503, headers={"Retry-After": "5"})


@public.get("/metrics", include_in_schema=False, dependencies=[Depends(require_metrics_token)])
async def metrics(request: Request, state: ServerState = Depends(get_state)):
    """Prometheus metrics; OpenMetrics (with exemplars) when the scraper asks for it."""
    body, content_type = await state.telemetry.render(request.headers.get("accept"))
    return Response(body, media_type=content_type)


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, state: ServerState = Depends(get_state)):
    rid = f"gen-{uuid.uuid4().hex}"
    params = body.sampling_params(body.max_tokens, body.logprobs)
    stream = await state.submit(body.single_prompt(), params, rid, "generate", arrival(request), body.stream)
    if params.structured is not None:
        state.count_structured(params.structured.kind)

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
    return json_response({"text": "".join(o.text_delta for o in outs),
                          "token_ids": [t for o in outs for t in o.new_token_ids], **final(last)})
