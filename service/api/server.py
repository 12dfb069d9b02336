"""`serve`: the supervisor of one engine process and N front-end processes on one port, and each process's entry
(`run_engine`, `run_frontend`): where settings, telemetry and the engine or the app are wired together.

The supervisor binds the port once per front end with SO_REUSEPORT and hands each front end its own socket (the
kernel spreads new connections evenly over them: `_bind`), starts the engine process, and then only watches:
- SIGTERM or SIGINT: drain. Front ends stop taking work (503) and finish what they admitted; once they have all
  exited, the engine is told to stop, and exits when idle. A clean drain exits 0.
- The engine process dies (killed, a CUDA error, a lost tensor-parallel rank): its front ends have already
  failed their requests (they read end-of-file on its pipe) and answer /ready with 503; they are stopped, and
  the supervisor exits 1 within seconds, so that an orchestrator restarts the service.
- A front end dies: the engine aborts its requests (no blocks leak) and the others serve on; the exit status
  is 1 when the service stops.
If the supervisor itself is killed, Linux kills its children with it (PR_SET_PDEATHSIG), as a container would.
"""

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import time

import uvicorn
import zmq

from service.engine import messages
from service.engine.config import display_name
from service.engine.core import EngineCore
from service.processes import die_with_parent, freeze_heap
from service.settings import Settings

log = logging.getLogger(__name__)
STOP_GRACE = 5.0  # seconds front ends get to exit once the engine is gone, before they are killed


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state
        state.open_connections = lambda: len(self.server_state.connections)  # llm_http_connections

    def handle_exit(self, sig, frame) -> None:
        if not self.state.draining:
            log.info("signal %s: draining (up to %.0f s for in-flight requests)", sig,
                     self.config.timeout_graceful_shutdown or 0)
        self.state.draining = True
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after its shutdown; a finished drain is a clean exit (status 0)
        self._captured_signals.clear()


def _tell(folder: str, num_frontends: int, msg) -> None:
    """Send one message to every front end (the engine's loop never started)."""
    with zmq.Context() as ctx:
        for i in range(num_frontends):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.bind(messages.outbox(folder, i))
            sock.send(messages.encode(msg))
            sock.close()


def run_engine(settings: Settings, folder: str, num_frontends: int, alive) -> None:
    """The engine process: load the model, then serve the front ends until the supervisor's SIGTERM.

    `alive` is the write end of a pipe that only this process holds: when it exits (or is killed), the front
    ends read end-of-file on their ends and fail their requests at once (it is only held, never used).
    """
    die_with_parent()
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s engine %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the supervisor leads
    from service.engine.llm_engine import LLMEngine
    from service.telemetry.hub import Telemetry
    from service.telemetry.otlp import server_resource

    model = settings.server.served_model_name or display_name(settings.engine.model)
    resource = server_resource(settings, "engine", model) if settings.telemetry.otlp_metrics else None
    telemetry = Telemetry(settings.telemetry, model, process="engine", folder=folder, resource=resource)
    telemetry.start()
    try:
        engine = LLMEngine(settings.engine)
    except BaseException as exc:
        log.exception("model failed to load")
        _tell(folder, num_frontends, messages.Dead(f"model failed to load: {exc!r}"))
        raise SystemExit(1)
    telemetry.engine_loaded(engine)
    core = EngineCore(engine, folder, num_frontends, settings.server.max_waiting, telemetry.tracing)
    freeze_heap()
    signal.signal(signal.SIGTERM, lambda *_: core.stop())
    log.info("model %s ready on %s; serving %d front end(s)", engine.model_name, engine.device, num_frontends)
    start = time.monotonic()
    try:
        core.run()
    except BaseException:
        log.exception("engine loop died after %.0f s", time.monotonic() - start)
        raise SystemExit(1)
    finally:
        engine.close()
        telemetry.shutdown()
        if engine.stuck:
            os._exit(1)  # a lost rank's collective may never end: leave without tearing NCCL and CUDA down


def run_frontend(settings: Settings, folder: str, index: int, processes: tuple[str, ...], sock: socket.socket,
                 alive) -> None:
    """A front-end process: FastAPI under uvicorn (uvloop, httptools) on its own socket of the port."""
    die_with_parent()
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {messages.frontend_name(index)} %(name)s: %(message)s")
    logging._srcfile = None  # no record here names its caller's file or line: skip the stack walk that finds them
    # (the logging HOWTO's "Optimization"), a quarter of each access-log line's cost
    from service.api.app import create_app
    from service.api.arrival import StampingHttpTools

    app = create_app(settings, folder=folder, frontend=index, alive=alive, processes=processes)
    config = uvicorn.Config(app, log_level=settings.server.log_level.lower(), loop="uvloop", http=StampingHttpTools,
                            timeout_graceful_shutdown=settings.server.drain_timeout,
                            access_log=settings.server.access_log)
    state = app.state.server
    DrainingServer(config, state).run(sockets=[sock])
    if state.engine_error is not None:
        sys.exit(1)


def _bind(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on one port, one per front end, each with SO_REUSEPORT: the kernel hashes each new
    connection (its addresses and ports) to one of them, so each front end gets its share of the connections
    whatever the client does. (One socket shared by all lets whichever process accepts first take a connection: 214
    of 256 opened at once went to one of four front ends.) A socket without the option is bound first and
    closed, so that a port already taken, even by another server's reuse-port sockets, is an error here and no
    second server can join ours: a socket without SO_REUSEPORT cannot share a port with ours."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]  # port 0: the one the kernel chose, for every socket
    socks = []
    for _ in range(count):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
        socks.append(sock)
    return socks


def serve(settings: Settings) -> None:
    n = settings.server.api_servers
    if n < 1:
        sys.exit(f"service serve: error: --api-servers must be at least 1, got {n}")
    folder = messages.private_dir()
    try:
        sys.exit(_supervise(settings, folder, n))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _supervise(settings: Settings, folder: str, n: int) -> int:
    socks = _bind(settings.server.host, settings.server.port, n)
    ctx = multiprocessing.get_context("spawn")
    alive_r, alive_w = ctx.Pipe(duplex=False)
    engine = ctx.Process(target=run_engine, args=(settings, folder, n, alive_w), name="engine")
    engine.start()
    alive_w.close()  # the engine holds the only write end: its death is end-of-file for every front end
    names = ("engine", *map(messages.frontend_name, range(n)))
    fronts = {}
    for i in range(n):
        fronts[i] = ctx.Process(target=run_frontend, args=(settings, folder, i, names, socks[i], alive_r),
                                name=names[i + 1])
        fronts[i].start()
    alive_r.close()
    for sock in socks:  # each front end holds its own: when one exits, the kernel stops sending connections there
        sock.close()
    log.info("serving on http://%s:%d: engine process %d, %d front end(s) %s", settings.server.host,
             settings.server.port, engine.pid, n, [p.pid for p in fronts.values()])
    gone: set[str] = set()  # processes that exited: the dashboard's history no longer asks them
    keeper, answers = _keep_history(settings, folder, names, gone) if settings.telemetry.dashboard else (None, None)
    zctx = zmq.Context()
    control = zctx.socket(zmq.PUSH)
    control.setsockopt(zmq.LINGER, 1000)
    control.connect(messages.inbox(folder))
    draining, status = False, 0

    def drain(sig, frame):
        nonlocal draining
        if not draining:
            log.info("signal %d: draining the front ends, then the engine", sig)
        draining = True
        for p in fronts.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    try:
        while fronts:
            multiprocessing.connection.wait([engine.sentinel, *(p.sentinel for p in fronts.values())], timeout=1.0)
            if not engine.is_alive():
                gone.add("engine")
                log.error("the engine process exited (status %s): stopping the front ends", engine.exitcode)
                status = 1
                _stop(list(fronts.values()))
                break
            for i, p in list(fronts.items()):
                if not p.is_alive():
                    del fronts[i]
                    gone.add(names[i + 1])
                    if not draining:
                        log.error("front end api-%d exited (status %s): its requests are aborted; %d serve on",
                                  i, p.exitcode, len(fronts))
                        status = 1
                        control.send(messages.encode(messages.FrontendGone(i)))
                    elif p.exitcode:
                        status = 1
        if engine.is_alive():  # every front end has finished: the engine stops when idle
            engine.terminate()
            engine.join(settings.server.drain_timeout + STOP_GRACE)
            if engine.is_alive():
                engine.kill()
            status = status or (1 if engine.exitcode else 0)
    finally:
        if keeper is not None:
            keeper.stop()
            answers.close()
        control.close(0)
        zctx.term()
    return status


def _keep_history(settings: Settings, folder: str, names: tuple[str, ...], gone: set[str]):
    """The dashboard's history, kept here: the supervisor sees every process and is on no request's path."""
    from service.telemetry import dashboard, gather

    model = settings.server.served_model_name or display_name(settings.engine.model)
    keeper = dashboard.Keeper(dashboard.asker(folder, lambda: [p for p in names if p not in gone]), model,
                              settings.telemetry.trace_url).start()
    return keeper, gather.Responder(keeper.answer, dashboard.address(folder), "dashboard-server")


def _stop(processes: list) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
