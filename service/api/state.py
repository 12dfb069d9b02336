"""What the routes share (the link to the engine, settings, telemetry, draining) and how they run a request;
the routes and the app factory both import it, and it imports neither.

In a served front end the engine is another process (service.api.server starts both). Without one (tests, an
app built around an engine object) the engine's loop runs on a thread of this process behind the same sockets,
so every path a request takes is the one it takes in production.
"""

import asyncio
import logging
import shutil
import threading
import time
from collections.abc import AsyncIterator

from fastapi import Request

from service.api.client import EngineClient, RequestStream, merge
from service.api.errors import APIError, bad_request, unavailable
from service.api.streaming import total_usage
from service.engine import RequestOutput, SamplingParams, messages
from service.engine.errors import EngineDeadError
from service.settings import Settings, load_template
from service.telemetry.hub import Telemetry
from service.telemetry.tracing import traced

log = logging.getLogger(__name__)


class ServerState:
    """What the routes share: the engine client once connected, the settings, and whether we are draining."""

    def __init__(self, settings: Settings, telemetry: Telemetry, frontend: int = 0):
        self.settings = settings
        self.telemetry = telemetry
        self.frontend = frontend
        self.client: EngineClient | None = None
        self.engine = None  # the LLMEngine, when its loop runs on a thread of this process
        self.engine_thread: threading.Thread | None = None
        self.core = None  # its EngineCore, once the model is loaded
        self.folder: str | None = None  # the sockets' folder when this process made it (the engine runs here)
        self.load_error: BaseException | None = None
        self.draining = False
        self.open_connections = lambda: 0  # the server's count (DrainingServer sets it): llm_http_connections
        self.fatal: str | None = None  # why the server must exit non-zero (the engine died)
        self.chat_template = load_template(settings.server.chat_template)  # --chat-template, read once

    @property
    def loaded(self) -> bool:
        return self.client is not None and self.client.info is not None

    @property
    def ready(self) -> bool:
        return self.loaded and self.client.error is None and not self.draining

    @property
    def engine_error(self) -> BaseException | None:
        """Why the engine died, once it has (the process then needs a restart)."""
        return self.client.error if self.client is not None else None

    @property
    def info(self) -> messages.Hello:
        return self.client.info

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def model_name(self) -> str:
        return self.settings.server.served_model_name or self.client.info.model_name

    def connect(self, folder: str, alive=None, freeze: bool = False) -> None:
        """Link to the engine's sockets in `folder` (call on the event loop); `alive` is the engine's pipe; `freeze`:
        this is a front-end process of its own, whose heap is frozen once linked (service.processes.freeze_heap)."""
        s = self.settings.server
        self.client = EngineClient(folder, self.frontend, s.stream_backlog, s.stream_interval,
                                   self.telemetry.requests,
                                   lambda i: self.telemetry.forget(messages.frontend_name(i)), freeze).start()
        if alive is not None:
            self.client.watch(alive)

    def run_engine_here(self, engine=None) -> None:
        """Load the engine (unless given) and run its loop on a thread of this process, behind the sockets."""
        from service.engine.core import EngineCore

        self.folder = folder = messages.private_dir()
        self.connect(folder)

        def run():
            try:
                self.engine = self._load(engine)
                self.core = core = EngineCore(self.engine, folder, 1, self.settings.server.max_waiting,
                                              self.telemetry.tracing)
            except BaseException as exc:  # keep serving /health; /ready reports the failure
                log.exception("model failed to load")
                self.load_error = exc
                return
            try:
                core.run()
            except BaseException:
                log.exception("engine loop died")
        self.engine_thread = threading.Thread(target=run, name="engine-loop", daemon=True)
        self.engine_thread.start()

    @traced("model.load")
    def _load(self, engine):
        from service.engine.llm_engine import LLMEngine

        engine = engine or LLMEngine(self.settings.engine)
        self.telemetry.engine_loaded(engine)
        log.info("model %s ready on %s", engine.model_name, engine.device)
        return engine

    async def stop(self) -> None:
        if self.engine_thread is not None:
            if self.core is not None:
                self.core.stop()
            await asyncio.to_thread(self.engine_thread.join, 30)
            if self.engine is not None:
                self.engine.close()
        if self.client is not None:
            await self.client.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def count_structured(self, constraint: str) -> None:
        """A request whose output a grammar constrains (or whose tool calls are parsed): json_object, json_schema
        or tools."""
        if self.telemetry.requests is not None:  # None with --no-metrics
            m = self.telemetry.requests.m
            m.structured_requests.labels(m.model, constraint).inc()

    def count_tool_calls(self, count: int) -> None:
        if count and self.telemetry.requests is not None:
            m = self.telemetry.requests.m
            m.tool_calls.labels(m.model).inc(count)

    def check_model(self, name: str) -> None:
        if not self.loaded:
            if self.load_error is not None or self.engine_error is not None:
                raise EngineDeadError(f"the model failed to load: {self.load_error or self.engine_error}")
            raise unavailable("the model is still loading", retry_after=5)
        if name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           type="invalid_request_error", param="model", code="model_not_found")

    async def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str, operation: str,
                     arrival: float | None, streaming: bool) -> AsyncIterator[RequestOutput]:
        """One prompt, one sample: its outputs (see submit_all)."""
        return (await self.submit_all([prompt], params, request_id, operation, arrival, streaming)).outputs

    async def submit_all(self, prompts: list[str | list[int]], params: SamplingParams, request_id: str,
                         operation: str, arrival: float | None, streaming: bool, n: int = 1) -> "Choices":
        """Validation (400s), then admission by the engine of every sample (503s), before any response starts.

        `operation` names the request's span (gen_ai.operation.name: chat, text_completion, generate), one span
        for the HTTP request whatever its prompts and n; `arrival` is when the server received the request
        (service.api.arrival), the start of its clock.
        """
        if self.draining:
            raise unavailable("the server is shutting down", retry_after=5)
        if not self.loaded:
            raise unavailable("the model is still loading", retry_after=5)
        limit = self.settings.server.max_waiting
        if len(prompts) * n > limit:  # the engine admits a request's samples all at once or not at all
            raise bad_request(f"{len(prompts)} prompt(s) x n={n} make {len(prompts) * n} samples, more than the "
                              f"{limit} this server lets wait (--max-waiting): they could never be admitted",
                              "n" if n > 1 else "prompt")
        arrival = time.perf_counter() if arrival is None else arrival
        tracing = self.telemetry.tracing
        span = tracing.request_span(request_id, operation, self.model_name, params,
                                    prompts[0] if len(prompts) == 1 else prompts, arrival) \
            if tracing.enabled else None
        traceparent = tracing.traceparent(span) if span else None
        try:
            if len(prompts) == 1 and n == 1:  # the common case
                streams = [await self.client.submit(prompts[0], params, request_id, arrival, streaming, traceparent,
                                                    operation)]
            else:
                streams = await self.client.submit_all(prompts, params, request_id, arrival, streaming, traceparent,
                                                       operation, n)
        except BaseException as exc:
            if span is not None:
                tracing.fail(span, exc)
            raise
        outputs = aiter(streams[0]) if len(streams) == 1 else merge(streams)
        if span is not None:
            outputs = tracing.generation(outputs, span, self.model_name,
                                         None if len(streams) == 1 else lambda: _summary(streams, n))
        return Choices(streams, outputs, n)


def _summary(streams: list[RequestStream], n: int) -> tuple:
    """A request's samples for its span: their finish reasons, and usage as the API counts it."""
    usage = total_usage(streams, n)
    return ([s.finish_reason or "abort" for s in streams], usage["prompt_tokens"], usage["completion_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"])


class Choices:
    """An HTTP request's samples: their streams prompt-major (choice index = prompt j * n + sample i) and their
    outputs, merged, as they come (read them once; the streams then hold each sample's final state)."""

    def __init__(self, streams: list[RequestStream], outputs: AsyncIterator[RequestOutput], n: int):
        self.streams, self.outputs, self.n = streams, outputs, n
        self._index = {s.request_id: i for i, s in enumerate(streams)} if len(streams) > 1 else None

    def index(self, out: RequestOutput) -> int:
        return 0 if self._index is None else self._index[out.request_id]


async def get_state(request: Request) -> ServerState:  # async: FastAPI runs a sync one on a worker thread
    return request.app.state.server


async def collect(request: Request, stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    """Run a request to the end; if the client goes away first, abort it (which frees its blocks).

    The client's leaving is heard from the server (the ASGI receive channel's http.disconnect), not polled."""
    outputs: list[RequestOutput] = []

    async def consume():
        async for out in stream:
            outputs.append(out)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise APIError(499, "the client closed the request", type="client_closed_request")
        task.result()
        return outputs
    finally:
        gone.cancel()
        task.cancel()  # a no-op when done; otherwise the stream's cleanup aborts the request
