"""/dashboard: the live page (static files shipped in the package, no build step, no CDN) and its data, the history
that service.telemetry.dashboard keeps. The page is open; its data is guarded like /metrics (--metrics-token)."""

from importlib import resources

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from service.api.auth import require_metrics_token
from service.api.errors import unavailable
from service.api.state import ServerState, get_state

STATIC = resources.files("service.api").joinpath("static")
router = APIRouter()
NO_CACHE = {"Cache-Control": "no-store"}


def static_files() -> StaticFiles:
    """The page's script, style and chart library, mounted at /dashboard/static."""
    return StaticFiles(directory=str(STATIC))


def status(state: ServerState) -> str:
    """The service as the page's banner names it: up, starting, draining, engine down or failed to load."""
    if state.engine_error is not None:
        return "engine down"
    if state.load_error is not None:
        return "failed to load"
    if state.draining:
        return "draining"
    return "up" if state.loaded else "starting"


@router.get("/dashboard", include_in_schema=False)
async def page():
    return FileResponse(STATIC.joinpath("dashboard.html"), headers=NO_CACHE)


@router.get("/dashboard/data", include_in_schema=False, dependencies=[Depends(require_metrics_token)])
async def data(since: float | None = None, state: ServerState = Depends(get_state)):
    """The points after `since` (the whole history without it), the totals, the slowest requests, the thresholds."""
    body = await state.telemetry.dashboard(since, status(state))
    if body is None:
        raise unavailable("the dashboard's history did not answer", retry_after=2)
    return Response(body, media_type="application/json", headers=NO_CACHE)
