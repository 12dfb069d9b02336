"""Async facade for the server: the engine loop runs on its own thread and never blocks the event loop.

`generate` validates a request, submits it, and yields its outputs as the loop produces them. Leaving
the iterator early (client gone, task cancelled) aborts the request and frees its blocks.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from service.engine.errors import EngineDeadError
from service.engine.llm_engine import LLMEngine, RequestOutput
from service.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self.error: BaseException | None = None
        self._queued = 0  # adds in the inbox, not yet handed to the engine

    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet running: the engine's waiting queue plus those still in the inbox."""
        return self.engine.num_waiting + self._queued

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None, arrival: float | None = None) -> AsyncIterator[RequestOutput]:
        """Validate now (raises InvalidRequestError), then stream outputs once iterated.

        `arrival` (time.perf_counter) starts the request's clock earlier than now: when the server received it.
        """
        if not self.running:
            raise EngineDeadError("the engine loop is not running")
        return self._stream(self.engine.make_sequence(prompt, params, request_id, arrival))

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        async for out in self.submit(prompt, params, request_id):
            yield out

    async def _stream(self, seq) -> AsyncIterator[RequestOutput]:
        rid = seq.request_id
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), outputs)
        self._queued += 1
        self._inbox.put(("add", seq))
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # -- engine thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                self._drain_inbox()
                if not engine.has_unfinished():
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                for out in outputs:
                    self._deliver(out)
        except BaseException as exc:  # a bug in the loop, or a lost rank: fail every waiting client instead of hanging
            log.exception("engine loop died")
            self.fail(EngineDeadError(str(exc) if isinstance(exc, EngineDeadError) else f"engine loop died: {exc!r}"))
        finally:
            self._stop = True

    def fail(self, error: EngineDeadError) -> None:
        """Stop for good: every stream ends with `error`, and no new request is accepted (from any thread)."""
        self.error = error
        self._stop = True
        self._wake.set()
        for loop, q in list(self._streams.values()):
            loop.call_soon_threadsafe(q.put_nowait, error)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._queued -= 1
                if item.request_id in self._streams:
                    self.engine.add_sequence(item)
            else:
                out = self.engine.abort(item)
                if out is not None:
                    self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, out)
