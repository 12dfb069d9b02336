"""Metrics pushed over OTLP (--otlp-metrics): the SDK's MeterProvider, its exporter set from the flags or the
standard OTEL_* variables, and the watch that keeps a failing collector away from serving.

The SDK's periodic reader collects and exports on its own thread, one export at a time, each bounded by the
export timeout: nothing queues behind a slow collector but the next collection (the queue holds one batch),
and recording never waits on an export. A failed export is counted (llm_otlp_metric_export_failures_total, its
data points in llm_otlp_metric_points_dropped_total) and logged once per outage, with an info line when exports
succeed again; the SDK's own per-export error lines are kept out of the log meanwhile.
"""

import logging
import os
import socket
import threading
from contextlib import contextmanager

from service import __version__
from service.settings import Settings, TelemetrySettings, otlp_option, otlp_protocol, otlp_temporality
from service.telemetry.metrics import SEMCONV_VERSION, Metrics, OTLPMetrics

log = logging.getLogger(__name__)
SHUTDOWN_TIMEOUT_MS = 5000  # the last export at shutdown gets this long, then the process goes on exiting
_SDK_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.metric_exporter", "opentelemetry.exporter.otlp.common.http",
                "opentelemetry.exporter.otlp.proto.grpc.exporter",
                "opentelemetry.exporter.otlp.proto.grpc.metric_exporter")


def make_resource(process: str, model: str, quantization: str = "none", tensor_parallel_size: int = 1,
                  port: int | None = None):
    """Who pushes: the service (OTEL_SERVICE_NAME, else llm-service) and this process of it. service.instance.id is
    per process, `<host>:<port>/<process>` (or OTEL_RESOURCE_ATTRIBUTES' service.instance.id + `/<process>`), so a
    receiver keeps each process's series apart (Prometheus makes it the `instance` label)."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    given = OTELResourceDetector().detect().attributes  # OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
    instance = given.get("service.instance.id") or f"{socket.gethostname()}:{port or os.getpid()}"
    return Resource.create({"service.name": "llm-service", **given, "service.version": __version__,
                            "service.instance.id": f"{instance}/{process}", "llm.process": process,
                            "llm.model": model, "llm.quantization": quantization,
                            "llm.tensor_parallel_size": tensor_parallel_size})


def server_resource(settings: Settings, process: str, model: str):
    """make_resource for a process of a server run with `settings`."""
    return make_resource(process, model, settings.engine.quantization, settings.engine.tensor_parallel_size,
                         settings.server.port)


def _exporter(settings: TelemetrySettings):
    from opentelemetry.sdk.metrics import Counter, Histogram, ObservableCounter
    from opentelemetry.sdk.metrics.export import AggregationTemporality
    from opentelemetry.util.re import parse_env_headers

    if otlp_protocol(settings) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    # as the SDK reads OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE; spelt out so that the flag can set it
    delta = {"cumulative": (), "delta": (Counter, Histogram, ObservableCounter),
             "lowmemory": (Counter, Histogram)}[otlp_temporality(settings)]
    preferred = {kind: AggregationTemporality.DELTA if kind in delta else AggregationTemporality.CUMULATIVE
                 for kind in (Counter, Histogram, ObservableCounter)}
    headers = settings.otlp_metrics_headers
    watched = type("WatchedOTLPMetricExporter", (_Watched, OTLPMetricExporter), {})
    return watched(endpoint=settings.otlp_metrics_endpoint, timeout=settings.otlp_metrics_timeout,
                   headers=parse_env_headers(headers, liberal=True) if headers is not None else None,
                   preferred_temporality=preferred)


def start(settings: TelemetrySettings, metrics: Metrics, resource) -> tuple:
    """A MeterProvider exporting on its own thread, and the instruments its process records into."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    exporter = _exporter(settings)
    endpoint = otlp_option(settings.otlp_metrics_endpoint, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                           "OTEL_EXPORTER_OTLP_ENDPOINT") or "the SDK's default (localhost)"
    exporter.watch = Watch(metrics, f"{otlp_protocol(settings)} {endpoint}")
    interval = settings.otlp_metrics_interval
    if interval is None:
        interval = float(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL") or 60000) / 1000
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval * 1000)
    provider = MeterProvider([reader], resource=resource, shutdown_on_exit=False)
    log.info("OTLP metrics on: %s, to %s every %g s (GenAI semantic conventions v%s), as %s",
             otlp_temporality(settings), exporter.watch.endpoint, interval, SEMCONV_VERSION,
             resource.attributes["service.instance.id"])
    return provider, OTLPMetrics(provider.get_meter("service", __version__), metrics.model)


def shutdown(provider) -> None:
    """Export what is left, for at most SHUTDOWN_TIMEOUT_MS (a collector that hangs does not hold the exit)."""
    try:
        provider.shutdown(timeout_millis=SHUTDOWN_TIMEOUT_MS)
    except Exception as exc:  # the SDK raises when the deadline passes; the process exits all the same
        log.warning("OTLP metrics: shutdown did not finish: %s", exc)


class _Quiet(logging.Filter):
    """Keeps the SDK exporter's lines out of the log while a watched export runs on this thread (the watch logs
    once per outage instead); remembers the first one as the reason (it names the error; later ones say the
    retries ran out)."""

    def __init__(self):
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self.local, "on", False):
            self.local.reason = self.local.reason or record.getMessage()
            return False
        return True

    @contextmanager
    def exporting(self):
        self.local.on, self.local.reason = True, None
        try:
            yield
        finally:
            self.local.on = False


_quiet = _Quiet()
for _name in _SDK_LOGGERS:
    logging.getLogger(_name).addFilter(_quiet)


class Watch:
    """Counts failed exports and their data points; one warning when exports start failing, one line when they
    work again. Exports run one at a time (the reader's lock), so its state needs no lock of its own."""

    def __init__(self, metrics: Metrics, endpoint: str):
        self.metrics, self.endpoint = metrics, endpoint
        self.failures = 0  # in the outage going on (0: none)

    def failed(self, points: int, reason: str | None) -> None:
        self.metrics.otlp_export_failures.inc()
        self.metrics.otlp_points_dropped.inc(points)
        if self.failures == 0:
            log.warning("OTLP metrics: export to %s failed (%s); serving goes on, failed exports are counted in "
                        "llm_otlp_metric_export_failures_total; nothing more is logged until one succeeds",
                        self.endpoint, reason or "no reason given")
        self.failures += 1

    def succeeded(self) -> None:
        if self.failures:
            log.info("OTLP metrics: exports to %s work again after %d failed", self.endpoint, self.failures)
            self.failures = 0


class _Watched:
    """Mixed into the SDK's OTLP metric exporter (HTTP or gRPC): its export, watched."""

    watch: Watch

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
        from opentelemetry.sdk.metrics.export import MetricExportResult

        with _quiet.exporting():
            try:
                result = super().export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            except Exception as exc:  # the reader would log it at every export: count it as a failure instead
                result, _quiet.local.reason = MetricExportResult.FAILURE, repr(exc)
            reason = _quiet.local.reason
        if result is MetricExportResult.SUCCESS:
            self.watch.succeeded()
        else:
            self.watch.failed(sum(len(m.data.data_points) for rm in metrics_data.resource_metrics
                                  for sm in rm.scope_metrics for m in sm.metrics), reason)
        return result
