"""The one settings object: every server and engine option, as a CLI flag and an environment variable.

Each field `foo_bar` is the flag `--foo-bar` and the variable `LLM_FOO_BAR`; a flag beats the variable,
the variable beats the default.
"""

import argparse
import dataclasses
import os
import typing

from service.engine.config import EngineConfig


@dataclasses.dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, every /v1 and /generate request needs `Authorization: Bearer <key>`;
    # several keys: separate them with commas
    api_key_file: str | None = None  # a file of API keys, one per line (# comments), on top of api_key
    metrics_token: str | None = None  # when set, /metrics needs `Authorization: Bearer <token>` (Prometheus:
    # `authorization: {credentials: ...}` in its scrape config); off by default, as scrapers expect
    max_request_bytes: int = 8 * 1024 * 1024  # larger bodies get 413 unread; 8 MiB holds a 128k-token prompt
    # even as JSON-escaped text (~24 bytes a token) or as token ids (~8 bytes a token)
    api_servers: int = 1  # front-end processes (HTTP, JSON, text) on the one port, all feeding one engine
    # process; docs/serving.md says how to choose it (about one per 15,000-20,000 streamed tokens/s, cores allowing)
    stream_interval: int = 1  # streamed deltas go out every this many tokens (the first and the last at once)
    stream_backlog: int = 512  # a streaming client that falls this many tokens behind is cut off (its request
    # aborted, blocks freed): a reader that stopped reading must not make the server buffer without bound
    served_model_name: str | None = None  # the name clients send; None: the model's own name
    max_waiting: int = 256  # requests waiting for a slot beyond this get 503 + Retry-After (one limit, counted
    # by the engine across every front end)
    drain_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests before exiting
    log_level: str = "info"


@dataclasses.dataclass
class TelemetrySettings:
    """Metrics are always served at /metrics, and pushed over OTLP with --otlp-metrics; traces go out over OTLP
    when OTEL_EXPORTER_OTLP_ENDPOINT is set."""

    metrics: bool = True  # record request and engine metrics (off: /metrics has process metrics only)
    trace_sample_ratio: float = 1.0  # share of new traces kept; a sampled incoming traceparent is always kept
    trace_engine_steps: bool = True  # a span for each step that changes the batch, linked to those requests
    trace_text: bool = False  # put prompt and output text in request spans
    gpu_sample_interval: float = 5.0  # seconds between NVML readings; 0: no GPU metrics
    otlp_metrics: bool = False  # also push metrics over OTLP from every process: the GenAI server instruments
    # and the engine's state (docs/telemetry.md); each option below left unset reads its standard OTEL_* variable
    otlp_metrics_endpoint: str | None = None  # OTEL_EXPORTER_OTLP_METRICS_ENDPOINT (over HTTP the full URL, e.g.
    # http://prometheus:9090/api/v1/otlp/v1/metrics); else OTEL_EXPORTER_OTLP_ENDPOINT (+ /v1/metrics over HTTP)
    otlp_metrics_protocol: str | None = None  # http/protobuf or grpc; OTEL_EXPORTER_OTLP_METRICS_PROTOCOL, else
    # OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf
    otlp_metrics_headers: str | None = None  # "key=value,..." sent with each export (a backend's API key);
    # OTEL_EXPORTER_OTLP_METRICS_HEADERS, else OTEL_EXPORTER_OTLP_HEADERS
    otlp_metrics_interval: float | None = None  # seconds between exports; OTEL_METRIC_EXPORT_INTERVAL (in ms),
    # else 60
    otlp_metrics_timeout: float | None = None  # seconds one export may take; OTEL_EXPORTER_OTLP_METRICS_TIMEOUT
    # (seconds, as the Python SDK reads it), else OTEL_EXPORTER_OTLP_TIMEOUT, else 10
    otlp_metrics_temporality: str | None = None  # cumulative (what Prometheus takes), delta or lowmemory;
    # OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE, else cumulative


# OTLP metrics options: a flag's value, else its standard OTEL_* variable (telemetry/otlp.py reads them here)
OTLP_PROTOCOLS = ("http/protobuf", "grpc")
OTLP_TEMPORALITIES = ("cumulative", "delta", "lowmemory")


def otlp_option(value, *variables: str):
    """A flag's value, else the first standard variable that is set."""
    if value is not None:
        return value
    return next((os.environ[v] for v in variables if os.environ.get(v)), None)


def otlp_protocol(settings: TelemetrySettings) -> str:
    return otlp_option(settings.otlp_metrics_protocol, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
                       "OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"


def otlp_temporality(settings: TelemetrySettings) -> str:
    return (otlp_option(settings.otlp_metrics_temporality, "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE")
            or "cumulative").lower()


def check_otlp(settings: TelemetrySettings) -> None:
    """Refuse, at start, a protocol or temporality the exporter does not know (even with --otlp-metrics off, so a
    typo is not found only the day it is turned on)."""
    if otlp_protocol(settings) not in OTLP_PROTOCOLS:
        raise ValueError(f"OTLP metrics protocol {otlp_protocol(settings)!r} is not supported: use "
                         f"{' or '.join(OTLP_PROTOCOLS)}")
    if otlp_temporality(settings) not in OTLP_TEMPORALITIES:
        raise ValueError(f"OTLP metrics temporality {otlp_temporality(settings)!r} is not known: use "
                         f"{', '.join(OTLP_TEMPORALITIES)}")


@dataclasses.dataclass
class Settings:
    server: ServerSettings = dataclasses.field(default_factory=ServerSettings)
    telemetry: TelemetrySettings = dataclasses.field(default_factory=TelemetrySettings)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Settings)}  # name -> its dataclass
ENV_PREFIX = "LLM_"


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _converter(annotation):
    hints = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    kind = hints[0]
    if kind is bool:
        return _parse_bool
    return {int: int, float: float}.get(kind, str)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for section in SECTIONS.values():
        group = parser.add_argument_group(section.__name__)
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            convert = _converter(hints[f.name])
            env = ENV_PREFIX + f.name.upper()
            default = convert(os.environ[env]) if env in os.environ else f.default
            group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=convert, default=default,
                               metavar=f.name.upper(), help=f"(env {env}; default {f.default!r})")


def from_namespace(args: argparse.Namespace) -> Settings:
    pick = lambda cls: cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
    return Settings(**{name: pick(cls) for name, cls in SECTIONS.items()})


def parse(argv: list[str] | None = None, prog: str = "service serve") -> Settings:
    parser = argparse.ArgumentParser(prog=prog, description="Serve a model over HTTP (OpenAI-compatible).")
    add_arguments(parser)
    settings = from_namespace(parser.parse_args(argv))
    from service.engine.quant.quantization import check_config
    try:
        check_config(settings.engine)
        check_otlp(settings.telemetry)
    except ValueError as exc:  # refused at start, in one line, before the model loads
        parser.exit(2, f"{prog}: error: {exc}\n")
    return settings
