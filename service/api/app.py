"""FastAPI app factory: loads the engine in the background, wires routes, auth, guards, errors and telemetry."""

from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from service.api import dashboard_routes, native_routes, openai_routes
from service.api.arrival import ArrivalClock
from service.api.auth import load_api_keys, require_api_key
from service.api.errors import install_handlers
from service.api.guards import BodyLimit, ContainErrors
from service.api.middleware import HTTPMetrics
from service.api.state import ServerState
from service.engine import messages
from service.engine.config import display_name
from service.settings import Settings
from service.telemetry.hub import Telemetry
from service.telemetry.otlp import server_resource


def create_app(settings: Settings | None = None, engine: "LLMEngine | None" = None, folder: str | None = None,
               frontend: int = 0, alive=None, processes: tuple[str, ...] = ()) -> FastAPI:
    """Build a front end's app. In a served process, `folder` holds the engine process's sockets, `alive` is its
    pipe, and `processes` names the server's other processes (their metrics are gathered at /metrics). Without
    `folder` the engine runs on a thread of this process: `engine` if given, else one loaded from the settings.
    """
    settings = settings or Settings()
    model = settings.server.served_model_name or (engine.model_name if engine else display_name(settings.engine.model))
    process = messages.frontend_name(frontend)
    resource = server_resource(settings, process, model) if settings.telemetry.otlp_metrics else None
    telemetry = Telemetry(settings.telemetry, model, process, folder, tuple(p for p in processes if p != process),
                          resource)
    state = ServerState(settings, telemetry, frontend)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if folder is None:
            telemetry.start()
            if settings.telemetry.dashboard:
                telemetry.keep_history()
            state.run_engine_here(engine)
        else:
            state.connect(folder, alive, freeze=True)
        telemetry.watch_runtime(lambda: state.client.num_backlog if state.client else 0,
                                lambda: state.open_connections())
        yield
        state.draining = True
        await state.stop()
        telemetry.shutdown()

    # FastAPI's own telemetry (0.165 on) off: the request spans and HTTP metrics are ours (FastAPIInstrumentor below,
    # HTTPMetrics), and it would look up the OpenTelemetry providers on every request (2% of a front end's CPU)
    app = FastAPI(title="llm-service", version="0.1.0", lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.server = state
    app.state.api_keys = load_api_keys(settings.server)
    app.state.metrics_token = [settings.server.metrics_token.encode()] if settings.server.metrics_token else []
    install_handlers(app)
    # the last added runs first: ContainErrors, then HTTPMetrics (which so counts 413s and 500s), then BodyLimit
    app.add_middleware(BodyLimit, max_bytes=settings.server.max_request_bytes)
    app.add_middleware(HTTPMetrics, counter=telemetry.metrics.http_requests, model=model)
    app.add_middleware(ContainErrors)
    app.add_middleware(ArrivalClock)  # the last added runs first: every request's clock starts here
    if telemetry.tracing.enabled:
        from opentelemetry import trace
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        trace.set_tracer_provider(telemetry.tracing.provider)  # for @traced; a no-op after the first server
        FastAPIInstrumentor.instrument_app(app, tracer_provider=telemetry.tracing.provider,
                                           excluded_urls="/health,/ready,/metrics,/dashboard",
                                           exclude_spans=["receive", "send"])
    app.include_router(native_routes.public)
    if settings.telemetry.dashboard:
        app.include_router(dashboard_routes.router)
        app.mount("/dashboard/static", dashboard_routes.static_files())
    app.include_router(native_routes.router, dependencies=[Depends(require_api_key)])
    app.include_router(openai_routes.router, dependencies=[Depends(require_api_key)])
    return app
