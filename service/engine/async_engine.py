"""Async facade for the server: the engine loop runs on its own thread and never blocks the event loop.

`generate` validates a request, submits it, and yields its outputs as the loop produces them. Leaving
the iterator early (client gone, task cancelled) aborts the request and frees its blocks. A stream whose
reader falls `stream_backlog` outputs behind is cut: its request is aborted and its backlog dropped.
"""

import asyncio
import contextlib
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from service.engine.errors import EngineDeadError, InvalidRequestError, SlowReaderError
from service.engine.llm_engine import LLMEngine, RequestOutput
from service.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    cut: bool = False  # set on the event loop once the reader fell too far behind
    started: bool = False  # its reader began iterating: the request went to the engine's inbox


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stream_backlog: int = 512):
        self.engine = engine
        self.stream_backlog = stream_backlog
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # _streams and _queued are shared by the event loop(s) and the engine thread: only under _lock
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._queued = 0  # adds in the inbox, not yet handed to the engine
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self.error: BaseException | None = None

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
        with self._lock:
            return self.engine.num_waiting + self._queued

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None, arrival: float | None = None) -> AsyncIterator[RequestOutput]:
        """Validate now (raises InvalidRequestError), then stream outputs once iterated.

        `arrival` (time.perf_counter) starts the request's clock earlier than now: when the server received it.
        """
        if not self.running:
            raise EngineDeadError("the engine loop is not running")
        seq = self.engine.make_sequence(prompt, params, request_id, arrival)
        stream = _Stream(seq.request_id, asyncio.get_running_loop())
        with self._lock:  # counted as waiting from now: admission checks num_waiting before the next submit
            self._check_unused(seq.request_id)
            self._streams[seq.request_id] = stream
            self._queued += 1
        outputs = self._stream(seq, stream)
        weakref.finalize(outputs, self._forget, stream)  # never iterated (its response never began): give it back
        return outputs

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        async for out in self.submit(prompt, params, request_id):
            yield out

    def _check_unused(self, request_id: str) -> None:
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")

    def _forget(self, stream: _Stream) -> None:
        with self._lock:
            if not stream.started and self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
                self._queued -= 1

    async def _stream(self, seq, stream: _Stream) -> AsyncIterator[RequestOutput]:
        rid = seq.request_id
        with self._lock:
            stream.started = True
        self._inbox.put(("add", seq))
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await stream.outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            with self._lock:
                if self._streams.get(rid) is stream:
                    del self._streams[rid]
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def _put(self, stream: _Stream, item) -> None:
        """On the stream's event loop: queue an output, or cut a reader that fell too far behind."""
        if stream.cut:
            return
        if isinstance(item, RequestOutput) and stream.outputs.qsize() >= self.stream_backlog:
            stream.cut = True
            while not stream.outputs.empty():  # what it never read is dropped: that is the memory bound
                stream.outputs.get_nowait()
            log.warning("request %s: the client fell %d chunks behind; aborting it", stream.request_id,
                        self.stream_backlog)
            item = SlowReaderError(f"the client fell {self.stream_backlog} chunks behind the stream; "
                                   "the request was aborted")
            self.abort(stream.request_id)
        stream.outputs.put_nowait(item)

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
            dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine loop died: {exc!r}")
            self.fail(dead, cause=exc)
        finally:
            self._stop = True

    def fail(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        """Stop for good: every stream ends with `error`, and no new request is accepted (from any thread).
        `error` (what clients see) is kept as `self.error` unless a `cause` says more."""
        self.error = cause if cause is not None else error
        self._stop = True
        self._wake.set()
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            with contextlib.suppress(RuntimeError):  # a stream whose event loop has closed
                stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                with self._lock:
                    self._queued -= 1
                    wanted = self._streams.get(item.request_id) is not None
                if wanted:  # else its reader left before it started
                    self.engine.add_sequence(item)
            else:
                out = self.engine.abort(item)
                if out is not None:
                    self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.request_id)
        if stream is not None:
            with contextlib.suppress(RuntimeError):  # its event loop closed meanwhile: nobody is left to tell
                stream.loop.call_soon_threadsafe(self._put, stream, out)
