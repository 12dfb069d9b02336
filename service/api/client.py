"""A front end's link to the engine process: requests out over ZeroMQ, each step's tokens back, text made here.

`submit` validates and tokenizes a request, sends it, and returns once the engine has admitted it (a full
waiting queue raises a 503 before any response starts); `submit_all` does the same for several prompts with n
samples each (one Add per prompt), all admitted or none. Each sample's `RequestStream` turns token ids into text
(one incremental decode step per token, the `tokenizers` library's DecodeStream), matches stop strings (a
match ends the request here and aborts it in the engine; later tokens are dropped and not counted) and shapes
output: a non-streaming reader wakes once, at the finish, and decodes once; a streaming reader gets every
`stream_interval` tokens (the first and the finish at once) merged into one output, however far it lags; one
that falls `stream_backlog` tokens behind is cut (its request aborted). If the engine process dies, every
request ends at once with EngineDeadError. `merge` reads several streams as one (an HTTP request's choices).
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator

import zmq

from service.api.errors import unavailable
from service.engine import messages
from service.engine.errors import EngineDeadError, InvalidRequestError, SlowReaderError
from service.engine.messages import Abort, Add, Admitted, Dead, FrontendGone, Hello, Step, sample_id
from service.engine.results import RequestOutput, Timings
from service.engine.sampling import SamplingParams, check_request, tokenize
from service.processes import freeze_heap

log = logging.getLogger(__name__)
_CONTEXT = 5  # prompt tokens decoded before the output, so that the first token's leading space comes out right


def load_tokenizer(source: str | None):
    if source is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


class RequestStream:
    """One request's state in the front end, read as an async iterator of merged RequestOutputs."""

    def __init__(self, client: "EngineClient", request_id: str, prompt_ids: list[int], params: SamplingParams,
                 arrival: float, streaming: bool, operation: str = "generate"):
        self.client, self.request_id, self.prompt_ids, self.params = client, request_id, prompt_ids, params
        self.streaming = streaming
        self.operation = operation  # chat, text_completion or generate (gen_ai.operation.name)
        self.timings = Timings(arrival=arrival)
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.num_cached_tokens = 0
        self.prompt_logprobs: list | None = None  # with the first output, when asked for (params.prompt_logprobs)
        self.counts_prompt = True  # its prompt counts in the metrics (False: a later sample of the same prompt)
        self.text, self.emitted, self.taken = "", 0, 0
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.wake = asyncio.Event()
        self.group: _Group | None = None  # read together with other streams (merge): signal there instead
        self.queued = False  # in its group's queue, not yet taken
        self.stops = params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # text kept back while a stop may complete
        tokenizer = client.tokenizer
        # text as tokens arrive only where someone reads it as it comes (or must search it); else decode once
        self.decoder = None
        self._context = prompt_ids[-_CONTEXT:]
        if tokenizer is not None and (streaming or self.stops):
            self.decoder = _Decoder(tokenizer, self._context, params.skip_special_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def feed(self, row: list, now: float) -> int:
        """Take one engine row; returns how many of its tokens were kept (after a stop string, none are)."""
        if self.finished:
            return 0
        tokens, reason, logprobs, first = row[1], row[2], row[3], row[4]
        t = self.timings
        if first is not None:
            t.first_scheduled, self.num_cached_tokens, self.prompt_logprobs = first
        kept = 0
        for i, token in enumerate(tokens):
            self.token_ids.append(token)
            t.token_times.append(now)
            kept += 1
            if logprobs:
                self.logprobs.append(logprobs[i])
            if self.decoder is not None:
                before = len(self.text)
                self.text += self.decoder.step(token)
                if self.stops and len(self.token_ids) >= self.params.min_tokens and self._match(before):
                    reason = "stop"
                    self.client.abort(self.request_id)  # the engine may run a step or two more: dropped
                    break
        if kept and t.first_token is None:
            t.first_token = now
        if reason is not None:
            self._finish(reason, now)
        elif not self.streaming:
            return kept
        elif self.taken == 0 or len(self.token_ids) - self.taken >= self.client.stream_interval:
            if len(self.token_ids) - self.taken > self.client.stream_backlog:
                self._cut()
            self._signal()
        return kept

    def _signal(self) -> None:
        """Something is ready to take: wake this stream's reader (or its group's)."""
        group = self.group
        if group is None:
            self.wake.set()
        elif not self.queued:
            self.queued = True
            group.queue.append(self)
            group.wake.set()

    def _match(self, before: int) -> bool:
        text = self.text
        for stop in self.stops:
            at = text.find(stop, max(0, before - len(stop) + 1))
            if at != -1:
                self.text = text[:at]
                return True
        return False

    def _finish(self, reason: str, now: float) -> None:
        self.finish_reason = reason
        self.timings.finished = now
        if self.decoder is None and self.client.tokenizer is not None:
            self.text = _decode_once(self.client.tokenizer, self._context, self.token_ids,
                                     self.params.skip_special_tokens)
        self.client.finished(self)
        self._signal()

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.error = error
            self.timings.finished = time.perf_counter()
            self._signal()

    def abandoned(self) -> None:
        """Its reader left before the end (the engine was told to abort it): record it as aborted."""
        self.finish_reason = "abort"
        self.timings.finished = time.perf_counter()
        self.client.finished(self)

    def _cut(self) -> None:
        backlog = self.client.stream_backlog
        log.warning("request %s: the client fell %d tokens behind; aborting it", self.request_id, backlog)
        self.client.abort(self.request_id)
        self.fail(SlowReaderError(f"the client fell {backlog} chunks behind the stream; the request was aborted"))
        self.client.finished(self, "abort")

    def take(self) -> RequestOutput:
        """Everything not yet handed out, as one output (the text of a possible stop string kept back)."""
        end = len(self.text)
        if self.finish_reason is None and self.stops:
            end = max(self.emitted, end - self.hold)
        delta, self.emitted = self.text[self.emitted:end], end
        ids, self.taken = self.token_ids[self.taken:], len(self.token_ids)
        logprobs = self.logprobs[len(self.logprobs) - len(ids):] if self.logprobs else []
        return RequestOutput(self.request_id, ids, delta, self.finish_reason is not None, self.finish_reason,
                             len(self.prompt_ids), len(self.token_ids), self.num_cached_tokens, logprobs,
                             self.timings)

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                if self.error is not None:
                    raise self.error
                out = self.take()
                yield out
                if out.finished:
                    return
        finally:
            if not self.finished:  # the reader left early (client gone, task cancelled): free its blocks
                self.client.abort(self.request_id)
                self.abandoned()


class _Group:
    """Streams read by one reader: a stream with something to take queues itself here and wakes the reader."""

    def __init__(self, streams: list[RequestStream]):
        self.streams, self.queue, self.wake = streams, deque(), asyncio.Event()
        for stream in streams:
            stream.group = self
            if stream.wake.is_set():  # it signalled before it joined
                stream.wake.clear()
                stream._signal()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        live = len(self.streams)
        try:
            while live:
                await self.wake.wait()
                self.wake.clear()
                queue = self.queue
                while queue:
                    stream = queue.popleft()
                    stream.queued = False
                    if stream.error is not None:
                        raise stream.error
                    out = stream.take()
                    yield out
                    if out.finished:
                        live -= 1
        finally:
            left = [s for s in self.streams if not s.finished]
            if left:  # the reader left early, or one stream failed: abort every other sample at once
                left[0].client.abort(*(s.request_id for s in left))
                for stream in left:
                    stream.abandoned()


def merge(streams: list[RequestStream]) -> AsyncIterator[RequestOutput]:
    """Several streams' outputs as they come (each stream's in order, the streams' interleaved), by one reader;
    a reader that leaves early (or a stream that fails) aborts every stream not yet finished."""
    return _Group(streams).outputs()


class _Decoder:
    """Incremental detokenization: one decode step per token (DecodeStream), or two decodes for a slow tokenizer."""

    def __init__(self, tokenizer, context: list[int], skip_special_tokens: bool):
        fast = getattr(tokenizer, "_tokenizer", None)
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        if fast is not None:
            from tokenizers.decoders import DecodeStream

            self.fast, self.stream = fast, DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        else:
            self.fast, self.ids, self.offset = None, list(context), len(context)

    def step(self, token: int) -> str:
        if self.fast is not None:
            return self.stream.step(self.fast, token) or ""
        self.ids.append(token)
        full = _decode_once(self.tokenizer, self.ids[:self.offset], self.ids[self.offset:], self.skip)
        if full.endswith("\ufffd"):
            return ""
        self.offset = len(self.ids)
        return full


def _decode_once(tokenizer, context: list[int], ids: list[int], skip: bool) -> str:
    prefix = tokenizer.decode(context, skip_special_tokens=skip)
    return tokenizer.decode(context + ids, skip_special_tokens=skip)[len(prefix):]


class EngineClient:
    """The front end's side of the engine process's sockets: submit, abort, and the receiving task."""

    def __init__(self, folder: str, frontend: int = 0, stream_backlog: int = 512, stream_interval: int = 1,
                 recorder=None, frontend_gone=None, freeze: bool = False):
        self.folder, self.frontend = folder, frontend
        self.freeze = freeze  # a front-end process of its own: freeze its heap once the engine's hello is handled
        self.stream_backlog, self.stream_interval = stream_backlog, max(1, stream_interval)
        self.recorder = recorder  # telemetry.recorder.RequestRecorder, or None
        self.frontend_gone = frontend_gone  # called with another front end's index once it has died, or None
        self.info: Hello | None = None
        self.tokenizer = None
        self.error: BaseException | None = None  # why the engine is gone (then only a restart helps)
        self.requests: dict[str, RequestStream] = {}
        self.pending: dict[str, asyncio.Future] = {}  # sent, not yet admitted
        self.loaded = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    def start(self) -> "EngineClient":
        # plain sockets, read from the event loop's own reader callback: zmq.asyncio's futures and event polling per
        # message cost the front end more than handling the message did. Sending never blocks (no high-water mark).
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(messages.inbox(self.folder))
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.connect(messages.outbox(self.folder, self.frontend))
        self._loop = loop = asyncio.get_running_loop()
        loop.add_reader(self.pull.getsockopt(zmq.FD), self._receive)
        loop.call_soon(self._receive)  # what came before the reader was added (the FD signals only changes)
        return self

    def watch(self, alive) -> None:
        """End everything at once when the engine process's end of the `alive` pipe closes (it died)."""
        loop = asyncio.get_running_loop()

        def gone():
            loop.remove_reader(alive.fileno())
            self.fail(EngineDeadError("the engine process died"))
        loop.add_reader(alive.fileno(), gone)

    async def close(self) -> None:
        self._stop_receiving()
        while self._tasks:
            task = self._tasks.pop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()

    @property
    def running(self) -> bool:
        return self.info is not None and self.error is None

    @property
    def num_backlog(self) -> int:
        return len(self.pending)

    # -- requests ----------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize(self.tokenizer, prompt)

    async def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str, arrival: float,
                     streaming: bool, traceparent: str | None = None, operation: str = "generate") -> RequestStream:
        """Validate (InvalidRequestError), send, and wait for the engine to admit it (503 when it does not)."""
        streams = await self.submit_all([prompt], params, request_id, arrival, streaming, traceparent, operation)
        return streams[0]

    async def submit_all(self, prompts: list[str | list[int]], params: SamplingParams, request_id: str,
                         arrival: float, streaming: bool, traceparent: str | None = None,
                         operation: str = "generate", n: int = 1) -> list[RequestStream]:
        """Validate every prompt (InvalidRequestError), send one Add per prompt with its `n` samples, and wait for
        the engine to admit them all; returns the streams prompt-major (prompt j's sample i at j * n + i).

        The Add's id is `request_id` for one prompt, f"{request_id}-p{j}" for several; its samples are
        messages.sample_id of it. If the engine refuses any Add, the others' samples are aborted: 503."""
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        adds = [(request_id, *self._checked(prompts[0], params))] if len(prompts) == 1 else [
            (f"{request_id}-p{j}", *self._checked(prompt, dataclasses.replace(params), j))  # max_tokens per prompt
            for j, prompt in enumerate(prompts)]
        if any(rid in self.pending or sample_id(rid, 0, n) in self.requests for rid, _, _ in adds):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        loop, streams, waits = asyncio.get_running_loop(), [], []
        for rid, ids, p in adds:
            samples = [RequestStream(self, sample_id(rid, i, n), ids, p, arrival, streaming, operation)
                       for i in range(n)]
            for later in samples[1:]:
                later.counts_prompt = False
            # known before it is sent: its first step's message may be read before this coroutine resumes
            self.pending[rid] = admitted = loop.create_future()
            submitted = time.perf_counter()
            for stream in samples:
                stream.timings.submitted = submitted
                self.requests[stream.request_id] = stream
            self.push.send(messages.encode(Add(rid, self.frontend, ids, p, arrival, traceparent, n)))
            streams += samples
            waits.append(admitted)
        try:
            refused = [why for why in [await admitted for admitted in waits] if why is not None]
        except BaseException:
            self._drop(streams, admitted=True)
            raise
        finally:
            for rid, _, _ in adds:
                self.pending.pop(rid, None)
        if refused:
            self._drop(streams, admitted=len(refused) < len(adds))
            why = refused[0]
            raise unavailable(why, retry_after=1 if "waiting" in why else 5)
        if self.recorder is not None:
            self.recorder.received(len(streams))
        return streams

    def _checked(self, prompt: str | list[int], params: SamplingParams, index: int | None = None
                 ) -> tuple[list[int], SamplingParams]:
        """A prompt's token ids, checked against the model with its params (which it may complete)."""
        try:
            ids = self.tokenize(prompt)
            check_request(ids, params, self.info.max_model_len, self.info.vocab_size, self.tokenizer is not None)
        except InvalidRequestError as exc:
            if index is None:
                raise
            raise InvalidRequestError(f"prompt {index}: {exc.message}", param=exc.param) from None
        return ids, params

    def _drop(self, streams: list[RequestStream], admitted: bool) -> None:
        """Forget streams that will never be read; those the engine may hold are aborted there."""
        if admitted and self.error is None:
            self.abort(*(s.request_id for s in streams))
        for stream in streams:
            self.requests.pop(stream.request_id, None)

    def abort(self, *request_ids: str) -> None:
        if self.error is None and not self._closed:  # (a stream finalized after close() has nothing to abort)
            self.push.send(messages.encode(Abort(list(request_ids))))

    def finished(self, stream: RequestStream, reason: str | None = None) -> None:
        """A request left (finished, stopped, cut or abandoned): forget it and record its end once."""
        if self.requests.pop(stream.request_id, None) is not None and self.recorder is not None:
            self.recorder.finished(stream, reason or stream.finish_reason)

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            log.error("%s: failing %d request(s) in flight", error, len(self.requests) + len(self.pending))
        self.error = error
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(error)
        for stream in list(self.requests.values()):
            stream.fail(error)
            self.finished(stream, "error")

    # -- receiving, on the event loop's reader callback ------------------------------------------------------
    def _receive(self) -> None:
        """Handle every message waiting on the engine's socket (the loop calls this when its FD signals)."""
        if self._closed:
            return
        pull = self.pull
        decode, recv, events = messages.frontend_decoder.decode, pull.recv, pull.getsockopt
        try:
            while events(zmq.EVENTS) & zmq.POLLIN:  # (reading the events also rearms the FD)
                msg = decode(recv(zmq.NOBLOCK, copy=False))
                if isinstance(msg, Step):
                    self._step(msg)
                elif isinstance(msg, Admitted):
                    for rid in msg.accepted:
                        if (fut := self.pending.get(rid)) is not None and not fut.done():
                            fut.set_result(None)
                    for rid, why in msg.rejected:
                        if (fut := self.pending.get(rid)) is not None and not fut.done():
                            fut.set_result(why)
                elif isinstance(msg, Hello):
                    self._spawn(self._hello(msg))
                elif isinstance(msg, FrontendGone):
                    if self.frontend_gone is not None:
                        self.frontend_gone(msg.frontend)
                elif isinstance(msg, Dead):
                    self.fail(EngineDeadError(msg.reason))
                    self.loaded.set()
        except Exception as exc:  # a bug here would leave every request hanging: fail them all, loudly
            log.exception("the front end's receiver died")
            self._stop_receiving()
            self.fail(EngineDeadError(f"the front end lost the engine: {exc!r}"))

    async def _hello(self, msg: Hello) -> None:
        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, msg.tokenizer)
        except Exception as exc:
            log.exception("the front end could not load the engine's tokenizer")
            self.fail(EngineDeadError(f"the front end could not load the tokenizer: {exc!r}"))
            self.loaded.set()
            return
        self.info = msg
        if self.freeze:
            freeze_heap()  # all this front end keeps for its life is loaded
        self.loaded.set()
        log.info("linked to the engine process %d: %s", msg.pid, msg.model_name)

    def _spawn(self, coro) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _stop_receiving(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self.pull.getsockopt(zmq.FD))

    def _step(self, msg: Step) -> None:
        now = time.perf_counter()
        requests, recorder = self.requests, self.recorder
        gaps: list[float] = []
        tokens = 0
        for row in msg.rows:
            stream = requests.get(row[0])
            if stream is None:
                continue  # it left already (aborted, stopped): tokens still in flight are dropped
            times = stream.timings.token_times
            previous = times[-1] if times else None
            kept = stream.feed(row, now)
            if recorder is not None and kept:
                if previous is None:
                    recorder.first_token(stream)
                else:
                    gaps.append(now - previous)
                if kept > 1:  # tokens of one row (decode_steps) reach the client together: no gap between them
                    gaps += [0.0] * (kept - 1)
                tokens += kept
        if recorder is not None and tokens:
            recorder.tokens(tokens)
            if gaps:
                recorder.gaps(Counter(gaps))
