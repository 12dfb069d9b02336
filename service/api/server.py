"""Run the app under uvicorn; SIGTERM/SIGINT drain: new requests get 503, in-flight ones finish."""

import logging
import sys

import uvicorn

from service.api.app import create_app
from service.settings import Settings

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        if not self.state.draining:
            log.info("signal %s: draining (up to %.0f s for in-flight requests)", sig,
                     self.config.timeout_graceful_shutdown or 0)
        self.state.draining = True
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after its shutdown; a finished drain is a clean exit (status 0)
        self._captured_signals.clear()


def serve(settings: Settings) -> None:
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.server.host, port=settings.server.port,
                            log_level=settings.server.log_level.lower(),
                            timeout_graceful_shutdown=settings.server.drain_timeout)
    state = app.state.server
    DrainingServer(config, state).run()
    if state.fatal:
        log.error("exiting: %s", state.fatal)
        sys.exit(1)
