"""The engine core: the engine's loop behind ZeroMQ sockets, in a process of its own (or a thread, in tests).

It takes requests already tokenized and validated by the front ends, and sends each front end one message per
step with every new token id and finish of that front end's requests. It never touches HTTP, JSON or text: stop
strings are the front ends' (a match comes back as an abort). It blocks while idle and never sleeps while busy.
Admission is counted here, so `--max-waiting` is one limit across every front end: a request that finds the
waiting queue full is rejected in the `Admitted` reply, and its front end answers 503. A request of n samples
(`Add.n`) is n engine requests, admitted all or none, each counting against the limit.
"""

import logging
import os

import zmq

from service.engine import messages
from service.engine.config import dtype_name
from service.engine.detokenizer import Detokenizer
from service.engine.errors import EngineDeadError
from service.engine.messages import Abort, Add, Admitted, Dead, FrontendGone, Hello, Step

log = logging.getLogger(__name__)


class EngineCore:
    IDLE_LOOK_MS = 1000  # how often a loop blocked idle looks again (stop and fail wake it at once)

    def __init__(self, engine, folder: str, num_frontends: int, max_waiting: int, tracing=None):
        self.engine = engine
        engine.rows = True  # bare rows out, no RequestOutput objects
        engine.detokenizer = Detokenizer(None)  # text is the front ends' work
        self.max_waiting = max_waiting
        self.tracing = tracing  # telemetry.tracing.Tracing, for the engine-side request spans
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.address = messages.inbox(folder)
        self.inbox.bind(self.address)
        self.outboxes = []
        for i in range(num_frontends):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a slow front end (a dead one is aborted)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.bind(messages.outbox(folder, i))
            self.outboxes.append(sock)
        self.owner: dict[str, int] = {}  # request id -> the front end that sent it
        self.stopping = False
        self.failure: str | None = None  # set by fail(), from another thread
        if engine.parallel is not None:
            engine.parallel.on_failure = self.fail  # called from its watching thread

    def stop(self) -> None:
        """Stop once no request is left (from any thread, or a signal handler)."""
        self.stopping = True
        self._wake()

    def fail(self, reason: str) -> None:
        """End the loop as dead with `reason` (a lost tensor-parallel rank), from any thread."""
        self.failure = reason
        self._wake()

    def _wake(self) -> None:
        """An empty Abort through the inbox: a loop blocked idle looks at `stopping` and `failure` now, not at its next
        look a second later. Safe from any thread and from a signal handler."""
        try:
            sock = self.ctx.socket(zmq.PUSH)
        except zmq.ZMQError:  # the loop has ended and closed its context
            return
        try:
            sock.connect(self.address)
            sock.send(messages.encode(Abort([])), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
            sock.close(linger=1000)  # sent even after this close; a context closing meanwhile waits a second at most

    def hello(self) -> Hello:
        # here: the supervisor imports this module, without torch
        from service.engine.quant.quantization import describe

        e = self.engine
        return Hello(os.getpid(), e.model_name, e.max_model_len, e.vocab_size, sorted(e.eos_token_ids),
                     e.tokenizer_source if e.tokenizer is not None else None, e.quantization,
                     describe(e.quantization), dtype_name(e.runner.dtype), e.config.block_size, e.runner.num_blocks)

    def run(self) -> None:
        """Serve until stopped and idle; on a failure, tell every front end (Dead) and raise."""
        hello, unhelloed = messages.encode(self.hello()), set(range(len(self.outboxes)))
        engine = self.engine
        try:
            while not (self.stopping and not engine.has_unfinished()):
                if self.failure:
                    raise EngineDeadError(self.failure)
                for i in list(unhelloed):  # a front end not yet connected gets it on a later turn
                    if self._send(i, hello):
                        unhelloed.discard(i)
                if not engine.has_unfinished() and not self._idle(100 if unhelloed else self.IDLE_LOOK_MS):
                    continue
                self._drain()
                if engine.has_unfinished():
                    self._publish(engine.step())
        except BaseException as exc:
            reason = str(exc) if isinstance(exc, EngineDeadError) else f"engine loop died: {exc!r}"
            dead = messages.encode(Dead(reason))
            for i in range(len(self.outboxes)):
                self._send(i, dead)
            raise
        finally:
            self.close()

    def _idle(self, timeout_ms: int) -> bool:
        """Blocks until a message comes (a stop sends one) or it is time to look again; True if one came."""
        return bool(self.inbox.poll(timeout_ms))

    def close(self) -> None:
        self.engine.rows, self.engine.detokenizer = False, Detokenizer(self.engine.tokenizer)  # usable offline again
        self.inbox.close(0)
        for sock in self.outboxes:
            sock.close()
        self.ctx.term()

    def _drain(self) -> None:
        engine, replies = self.engine, {}
        while True:
            try:
                msg = messages.engine_decoder.decode(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if isinstance(msg, Add):
                accepted, rejected = replies.setdefault(msg.frontend, ([], []))
                if engine.num_waiting + msg.n > self.max_waiting or self.stopping:
                    rejected.append((msg.request_id, f"too many requests waiting ({self.max_waiting}); retry later"
                                     if not self.stopping else "the server is shutting down"))
                    continue
                self._add(msg)
                accepted.append(msg.request_id)
            elif isinstance(msg, Abort):
                for rid in msg.request_ids:
                    if self.owner.pop(rid, None) is not None:
                        engine.abort(rid)
            elif isinstance(msg, FrontendGone):
                gone = [rid for rid, fe in self.owner.items() if fe == msg.frontend]
                for rid in gone:
                    del self.owner[rid]
                    engine.abort(rid)
                log.error("front end %d is gone: aborted its %d request(s)", msg.frontend, len(gone))
                told = messages.encode(msg)  # the others stop asking it for its metrics
                for other in range(len(self.outboxes)):
                    if other != msg.frontend:
                        self._send(other, told)
        for frontend, (accepted, rejected) in replies.items():
            self._send(frontend, messages.encode(Admitted(accepted, rejected)))

    def _add(self, msg: Add) -> None:
        params = msg.params
        params.stop = []  # stop strings are matched by the front end, which aborts the request on a match
        for seq in self.engine.new_samples(msg.request_id, msg.prompt_token_ids, params, msg.arrival, msg.n):
            if self.tracing is not None and msg.traceparent:
                self.tracing.engine_request(seq.request_id, msg.traceparent)
            self.owner[seq.request_id] = msg.frontend
            self.engine.add_sequence(seq)

    def _publish(self, rows: list) -> None:
        if not rows:
            return
        owner = self.owner
        if len(self.outboxes) == 1:
            for row in rows:
                if row[2] is not None:
                    owner.pop(row[0], None)
            per = [rows]
        else:
            per = [[] for _ in self.outboxes]
            for row in rows:
                fe = owner.pop(row[0], None) if row[2] is not None else owner.get(row[0])
                if fe is not None:
                    per[fe].append(row)
        waiting = self.engine.num_waiting
        for i, mine in enumerate(per):
            if mine:
                self._send(i, messages.encode(Step(mine, waiting)))

    def _send(self, frontend: int, data: bytes) -> bool:
        """Never blocks: a PUSH socket whose front end is gone (or not yet connected) would block the loop for
        good. What a dead front end misses is dropped; the supervisor's FrontendGone aborts its requests."""
        try:
            self.outboxes[frontend].send(data, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False
