"""FastAPI app factory: loads the engine in the background, wires routes, auth, errors and telemetry."""

import asyncio
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request

from service.api.arrival import ArrivalClock
from service.api.errors import APIError, install_handlers, unavailable
from service.api.middleware import HTTPMetrics
from service.engine import AsyncEngine, LLMEngine, RequestOutput, SamplingParams
from service.engine.errors import EngineDeadError
from service.engine.models import display_name
from service.settings import Settings
from service.telemetry.hub import Telemetry
from service.telemetry.tracing import traced

log = logging.getLogger(__name__)


class ServerState:
    """What the routes share: the engine facade once loaded, the settings, and whether we are draining."""

    def __init__(self, settings: Settings, telemetry: Telemetry):
        self.settings = settings
        self.telemetry = telemetry
        self.facade: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.fatal: str | None = None  # why the server must exit non-zero (a tensor-parallel rank died)

    @property
    def ready(self) -> bool:
        return self.facade is not None and self.facade.running and not self.draining

    @property
    def model_name(self) -> str:
        return self.settings.server.served_model_name or self.facade.engine.model_name

    @traced("model.load")
    def load(self, engine: LLMEngine | None = None) -> None:
        try:
            engine = engine or LLMEngine(self.settings.engine)
            engine.observer = self.telemetry.observer
            self.facade = AsyncEngine(engine).start()
            self.telemetry.model_loaded(str(engine.runner.dtype).removeprefix("torch."), engine.quantization,
                                        engine.config.block_size, engine.runner.num_blocks)
            if engine.parallel is not None:
                engine.parallel.on_failure = self.rank_failed
            log.info("model %s ready on %s", engine.model_name, engine.device)
        except BaseException as exc:  # keep serving /health; /ready reports the failure
            log.exception("model failed to load")
            self.load_error = exc

    def rank_failed(self, reason: str) -> None:
        """A tensor-parallel rank died: fail what is in flight, turn /ready 503, then exit non-zero (so an
        orchestrator restarts the whole server rather than leave it half alive)."""
        self.fatal = reason
        self.facade.fail(EngineDeadError(reason))
        os.kill(os.getpid(), signal.SIGTERM)  # the drain finishes at once: every stream has its error

    def check_model(self, name: str) -> None:
        if self.facade is None:
            raise unavailable("the model is still loading", retry_after=5)
        if name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           type="invalid_request_error", param="model", code="model_not_found")

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str, operation: str,
               arrival: float | None = None) -> AsyncIterator[RequestOutput]:
        """Admission control, then validation (400s are raised here, before any response starts).

        `operation` names the request's span (gen_ai.operation.name: chat, text_completion, generate);
        `arrival` is when the server received the request (service.api.arrival), the start of its clock.
        """
        if self.draining:
            raise unavailable("the server is shutting down", retry_after=5)
        if self.facade is None:
            raise unavailable("the model is still loading", retry_after=5)
        if self.facade.num_waiting >= self.settings.server.max_waiting:
            raise unavailable(f"too many requests waiting ({self.settings.server.max_waiting}); retry later")
        stream = self.facade.submit(prompt, params, request_id, arrival=arrival)
        tracing = self.telemetry.tracing
        if tracing.enabled:
            stream = tracing.generation(stream, request_id, operation, self.model_name, params, prompt,
                                        arrival=arrival)
        return stream


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def require_api_key(request: Request) -> None:
    key = request.app.state.server.settings.server.api_key
    if key and request.headers.get("authorization", "") != f"Bearer {key}":
        raise APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


async def collect(request: Request, stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    """Run a request to the end; if the client goes away first, abort it (which frees its blocks)."""
    outputs: list[RequestOutput] = []

    async def consume():
        async for out in stream:
            outputs.append(out)

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                raise APIError(499, "the client closed the request", type="client_closed_request")
        task.result()
        return outputs
    finally:
        task.cancel()  # a no-op when done; otherwise the stream's cleanup aborts the request


def create_app(settings: Settings | None = None, engine: LLMEngine | None = None) -> FastAPI:
    """Build the app; with `engine`, serve that engine instead of loading one from the settings."""
    settings = settings or Settings()
    model = settings.server.served_model_name or (engine.model_name if engine else display_name(settings.engine.model))
    telemetry = Telemetry(settings.telemetry, model)
    state = ServerState(settings, telemetry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        telemetry.start()
        loader = threading.Thread(target=state.load, args=(engine,), name="model-loader", daemon=True)
        loader.start()
        yield
        state.draining = True
        loader.join()
        if state.facade is not None:
            state.facade.shutdown()
            state.facade.engine.close()
        telemetry.shutdown()

    from service.api import native_routes, openai_routes

    app = FastAPI(title="llm-service", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    install_handlers(app)
    app.add_middleware(HTTPMetrics, counter=telemetry.metrics.http_requests, model=model)
    app.add_middleware(ArrivalClock)  # the last added runs first: every request's clock starts here
    if telemetry.tracing.enabled:
        from opentelemetry import trace
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        trace.set_tracer_provider(telemetry.tracing.provider)  # for @traced; a no-op after the first server
        FastAPIInstrumentor.instrument_app(app, tracer_provider=telemetry.tracing.provider,
                                           excluded_urls="/health,/ready,/metrics", exclude_spans=["receive", "send"])
    app.include_router(native_routes.public)
    app.include_router(native_routes.router, dependencies=[Depends(require_api_key)])
    app.include_router(openai_routes.router, dependencies=[Depends(require_api_key)])
    return app
