"""What the routes share (the engine facade once loaded, settings, telemetry, draining) and how they run
a request; the routes and the app factory both import it, and it imports neither."""

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator

from fastapi import Request

from service.api.errors import APIError, unavailable
from service.engine import AsyncEngine, LLMEngine, RequestOutput, SamplingParams
from service.engine.errors import EngineDeadError
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
    def engine_error(self) -> BaseException | None:
        """Why the engine loop died, once it has (the process then needs a restart)."""
        return self.facade.error if self.facade is not None else None

    @property
    def model_name(self) -> str:
        return self.settings.server.served_model_name or self.facade.engine.model_name

    @traced("model.load")
    def load(self, engine: LLMEngine | None = None) -> None:
        try:
            engine = engine or LLMEngine(self.settings.engine)
            engine.observer = self.telemetry.observer
            self.facade = AsyncEngine(engine, stream_backlog=self.settings.server.stream_backlog).start()
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


async def get_state(request: Request) -> ServerState:  # async: FastAPI runs a sync one on a worker thread
    return request.app.state.server


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
