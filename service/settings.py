"""The one settings object: every server and engine option, as a CLI flag and an environment variable.

Each field `foo_bar` is the flag `--foo-bar` and the variable `LLM_FOO_BAR`; a flag beats the variable,
the variable beats the default. Each field's one-line description and choices live beside it (`option`);
`serve --help` and the docs' option tables (`python -m service.settings --markdown`) are made from them.
"""

import argparse
import dataclasses
import os
import re
import sys
import typing
from pathlib import Path

from service.engine.config import EngineConfig, option

# OTLP metrics options: a flag's value, else its standard OTEL_* variable (telemetry/otlp.py reads them here)
OTLP_PROTOCOLS = ("http/protobuf", "grpc")
OTLP_TEMPORALITIES = ("cumulative", "delta", "lowmemory")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
TOOL_CALL_PARSERS = ("hermes", "json")  # service/api/tools.py


@dataclasses.dataclass
class ServerSettings:
    host: str = option("127.0.0.1", "the address to listen on (0.0.0.0: every interface)")
    port: int = option(8000, "the port to listen on")
    api_key: str | None = option(None, "when set, every /v1 and /generate request needs the header Authorization: "
                                 "Bearer KEY; several keys: separate them with commas", shown="none (no key asked)")
    api_key_file: str | None = option(None, "a file of API keys, one a line (# starts a comment), taken with "
                                      "--api-key", shown="none")
    # off by default, as scrapers expect; Prometheus sends it with `authorization: {credentials: ...}`
    metrics_token: str | None = option(None, "when set, /metrics and the dashboard's data need the header "
                                       "Authorization: Bearer TOKEN",
                                       shown="none (/metrics is open)")
    # 8 MiB holds a 128k-token prompt even as JSON-escaped text (~24 bytes a token) or as token ids (~8 bytes)
    max_request_bytes: int = option(8 * 1024 * 1024, "request bodies larger than this get 413, unread",
                                    shown="8388608 (8 MiB)")
    # docs/serving.md#choosing---api-servers says how many
    api_servers: int = option(1, "front-end processes (HTTP, JSON, text) on the one port, all feeding one engine "
                              "process")
    stream_interval: int = option(1, "streamed deltas go out every this many tokens (the first and the last at once)")
    # a reader that stopped reading must not make the server buffer without bound
    stream_backlog: int = option(512, "a streaming client that falls this many tokens behind is cut off (its "
                                 "request aborted, its KV cache blocks freed)")
    served_model_name: str | None = option(None, "the model name clients send and /v1/models lists",
                                           shown="the model's own name")
    max_waiting: int = option(256, "requests waiting for a slot beyond this get 503 with Retry-After (one limit, "
                              "counted by the engine across every front end)")
    drain_timeout: float = option(30.0, "seconds SIGTERM waits for in-flight requests before the server exits")
    log_level: str = option("info", "the least severe log records printed", LOG_LEVELS)
    access_log: bool = option(True, "a log line for each HTTP request (uvicorn's access log, at info)")
    # docs/api.md#tools says how tools reach the model and how calls are found
    chat_template: str | None = option(None, "a Jinja chat template (a file's path, or the template itself) used "
                                       "instead of the tokenizer's, e.g. one that renders tools",
                                       shown="the tokenizer's own")
    tool_call_parser: str = option("hermes", "how a chat answer's tool calls are found with tool_choice auto: "
                                   "hermes, <tool_call>{...}</tool_call> blocks in the text; json, the whole answer "
                                   "a call or a list of calls", TOOL_CALL_PARSERS)


@dataclasses.dataclass
class TelemetrySettings:
    """Metrics are always served at /metrics, and pushed over OTLP with --otlp-metrics; traces go out over OTLP
    when OTEL_EXPORTER_OTLP_ENDPOINT is set."""

    metrics: bool = option(True, "record request and engine metrics (off: /metrics has process metrics only, and "
                           "nothing is pushed)")
    trace_sample_ratio: float = option(1.0, "share of new traces kept; a sampled incoming traceparent is always kept")
    trace_engine_steps: bool = option(True, "a span for each engine step that changes the batch, linked to its "
                                      "requests")
    trace_text: bool = option(False, "put prompt and output text in request spans")
    gpu_sample_interval: float = option(5.0, "seconds between NVML readings of the GPUs; 0: no GPU metrics")
    # docs/telemetry.md#the-dashboard-page says what each chart shows and where its numbers come from
    dashboard: bool = option(True, "serve a live page of the service's own numbers at /dashboard (its data guarded "
                             "like /metrics)")
    trace_url: str | None = option(None, "a link to a trace in your trace viewer, {trace_id} standing for the id "
                                   "(the dashboard links its slowest requests' traces), e.g. "
                                   "http://localhost:3000/explore?left=...{trace_id}...", shown="none (no links)")
    # the GenAI server instruments and the engine's state (docs/telemetry.md); each option below left unset reads
    # its standard OTEL_* variable
    otlp_metrics: bool = option(False, "also push metrics over OTLP, from every process")
    otlp_metrics_endpoint: str | None = option(
        None, "where OTLP metrics go; over HTTP the full URL, e.g. http://prometheus:9090/api/v1/otlp/v1/metrics",
        shown="$OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, else $OTEL_EXPORTER_OTLP_ENDPOINT (+ /v1/metrics over HTTP)")
    otlp_metrics_protocol: str | None = option(
        None, "the OTLP metrics transport", OTLP_PROTOCOLS,
        shown="$OTEL_EXPORTER_OTLP_METRICS_PROTOCOL, else $OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf")
    otlp_metrics_headers: str | None = option(
        None, "headers sent with each export, key=value,... (a backend's API key)",
        shown="$OTEL_EXPORTER_OTLP_METRICS_HEADERS, else $OTEL_EXPORTER_OTLP_HEADERS")
    otlp_metrics_interval: float | None = option(None, "seconds between exports",
                                                 shown="$OTEL_METRIC_EXPORT_INTERVAL (in ms), else 60")
    # the OTEL_* variable in seconds, as the Python SDK reads it
    otlp_metrics_timeout: float | None = option(
        None, "seconds one export may take",
        shown="$OTEL_EXPORTER_OTLP_METRICS_TIMEOUT, else $OTEL_EXPORTER_OTLP_TIMEOUT, else 10")
    otlp_metrics_temporality: str | None = option(
        None, "how pushed sums count: cumulative (what Prometheus takes), delta or lowmemory", OTLP_TEMPORALITIES,
        shown="$OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE, else cumulative")


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
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


# ---------------------------------------------------------------- one option: its flag, variable, value and help

def env_name(f: dataclasses.Field) -> str:
    return ENV_PREFIX + f.name.upper()


def flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _kind(f: dataclasses.Field, hints: dict) -> type:
    """bool, int, float or str: the field's type without its None."""
    return next(a for a in typing.get_args(hints[f.name]) or [hints[f.name]] if a is not type(None))


def _tristate(f: dataclasses.Field, hints: dict) -> bool:
    """A bool that may be None (the device decides): its variable also takes auto."""
    return type(None) in typing.get_args(hints[f.name])


def one_of(f: dataclasses.Field):
    """The text -> name function of a field with choices: `text` lower-cased if it is one of its choices or aliases
    (a choice ending in ":N" takes that prefix and a number, as cuda:1); else ArgumentTypeError, which argparse
    reports as a usage error."""
    taken = f.metadata["choices"] + f.metadata.get("aliases", ())

    def parse(text: str) -> str:
        name = text.strip().lower()
        if name in taken or any(c.endswith(":N") and name.startswith(c[:-1]) and name[len(c) - 1:].isdigit()
                                for c in taken):
            return name
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(taken)}")
    return parse


def choices_metavar(f: dataclasses.Field) -> str:
    """{auto,cpu,cuda,cuda:N}: how a usage line shows a field's choices."""
    return "{%s}" % ",".join(f.metadata["choices"])


def converter(f: dataclasses.Field, kind: type):
    """The text -> value function of a flag or variable (a bool's variable: `_parse_bool`); a bad value raises
    ArgumentTypeError, which argparse reports as a usage error."""
    if f.metadata.get("choices"):
        return one_of(f)

    def convert(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
    return convert


def _parse_bool(text: str, tristate: bool = False) -> bool | None:
    word = text.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    if tristate and word == "auto":
        return None
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (use {'/'.join(TRUE)} or {'/'.join(FALSE)}"
                                     f"{' or auto' if tristate else ''})")


def shown_default(f: dataclasses.Field) -> str:
    """The default as help and the docs show it."""
    if f.metadata.get("shown"):
        return f.metadata["shown"]
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    if f.default is None:
        return "none"
    return str(f.default)


def describe(f: dataclasses.Field) -> str:
    """The option's description as --help shows it, with the other names it takes (its usage lists its choices)."""
    text = f.metadata["help"]
    if f.metadata.get("aliases"):
        text += f" (also {', '.join(f.metadata['aliases'])})"
    return text


def fields() -> list[tuple[str, dataclasses.Field, dict]]:
    """Every option in order: (section name, field, the section's type hints)."""
    out = []
    for name, section in SECTIONS.items():
        hints = typing.get_type_hints(section)
        out += [(name, f, hints) for f in dataclasses.fields(section)]
    return out


# ---------------------------------------------------------------- the parser

EPILOG = ("Every option is also an environment variable: LLM_ and its name in capitals, dashes as underscores "
          "(--max-num-seqs: LLM_MAX_NUM_SEQS). A flag beats its variable, a variable beats the default. "
          "On/off options are flags with a negation (--compile, --no-compile); their variables take "
          f"{'/'.join(TRUE)} or {'/'.join(FALSE)}. An option with choices takes only those, from its flag or its "
          "variable alike.")
GROUPS = {"server": "the HTTP server",
          "telemetry": "metrics (always at /metrics; also pushed over OTLP with --otlp-metrics) and traces (over "
                       "OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set)",
          "engine": "the engine and the model"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option, its default taken from its LLM_* variable where that is set (a bad value: a usage error)."""
    groups = {name: parser.add_argument_group(name, GROUPS[name]) for name in SECTIONS}
    for section, f, hints in fields():
        kind, env = _kind(f, hints), env_name(f)
        default = f.default
        if env in os.environ:
            try:
                default = (_parse_bool(os.environ[env], _tristate(f, hints)) if kind is bool
                           else converter(f, kind)(os.environ[env]))
            except argparse.ArgumentTypeError as exc:
                parser.error(f"{env}: {exc}")
        help = f"{describe(f)} (env {env}; default: {shown_default(f)})".replace("%", "%%")
        if kind is bool:
            action = groups[section].add_argument(flag(f), dest=f.name, default=default,
                                                  action=argparse.BooleanOptionalAction)
            action.help = help  # set after: BooleanOptionalAction would append its own "(default: ...)"
        else:
            choices = f.metadata.get("choices")
            groups[section].add_argument(flag(f), dest=f.name, type=converter(f, kind), default=default, help=help,
                                         metavar=choices_metavar(f) if choices else f.name.upper())


def add_engine_argument(parser: argparse.ArgumentParser, name: str, default, **kwargs) -> argparse.Action:
    """Another command's option for what the EngineConfig field `name` sets (bench offline --dtype): the field's
    description, and its choices, checked, where it has them; `default` is the command's own (None: the field's
    shown default)."""
    f = EngineConfig.__dataclass_fields__[name]
    shown = f.metadata["shown"] if default is None and f.metadata.get("shown") else "%(default)s"
    if f.metadata.get("choices"):
        kwargs.update(type=one_of(f), metavar=choices_metavar(f))
    return parser.add_argument(flag(f), default=default, help=f"{f.metadata['help']} (default {shown})", **kwargs)


def build_parser(prog: str = "service serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, usage="%(prog)s [options]   (--help: every option)",
                                     description="Serve a model over HTTP (OpenAI-compatible).", epilog=EPILOG)
    add_arguments(parser)
    return parser


def from_namespace(args: argparse.Namespace) -> Settings:
    pick = lambda cls: cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
    return Settings(**{name: pick(cls) for name, cls in SECTIONS.items()})


def load_template(value: str | None) -> str | None:
    """--chat-template: a file's path, or the Jinja text itself."""
    if not value or "{%" in value or "{{" in value:
        return value or None
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return path.read_text()


def parse(argv: list[str] | None = None, prog: str = "service serve") -> Settings:
    parser = build_parser(prog)
    settings = from_namespace(parser.parse_args(argv))
    from service.engine.config import check
    from service.engine.quant.quantization import check_config
    try:
        check(settings.engine)
        check_config(settings.engine)
        check_otlp(settings.telemetry)
        load_template(settings.server.chat_template)
    except ValueError as exc:  # refused at start, in one line, before the model loads
        parser.exit(2, f"{prog}: error: {exc}\n")
    return settings


# ---------------------------------------------------------------- option tables for the docs

ROOT = Path(__file__).resolve().parent.parent
# <!-- options: model device port --> (or `all`), then the table, then <!-- /options -->
BLOCK = re.compile(r"<!-- options: *(.*?) *-->(.*?)<!-- /options -->", re.DOTALL)


def markdown(names: list[str] | None = None) -> str:
    """A Markdown table of the serve options named (flags without their dashes, e.g. max-num-seqs), in that order;
    all of them when `names` is empty or ["all"]. An unknown name raises ValueError."""
    by_name = {f.name.replace("_", "-"): (f, hints) for _, f, hints in fields()}
    if not names or names == ["all"]:
        names = list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"no serve option named {', '.join(unknown)}")
    cell = lambda text: text.replace("|", "\\|")
    rows = ["| Option | Variable | Default | Description |", "|---|---|---|---|"]
    for name in names:
        f, hints = by_name[name]
        shown = f"`--{name}`, `--no-{name}`" if _kind(f, hints) is bool else f"`--{name}`"
        default = f.metadata.get("shown") or f"`{shown_default(f)}`"
        choices, aliases = f.metadata.get("choices"), f.metadata.get("aliases")
        text = f.metadata["help"] + (f"; one of {', '.join(f'`{c}`' for c in choices)}" if choices else "")
        text += f" (or {', '.join(f'`{a}`' for a in aliases)})" if aliases else ""
        rows.append(f"| {shown} | `{env_name(f)}` | {cell(default)} | {cell(text[0].upper() + text[1:])} |")
    return "\n".join(rows)


def fill_blocks(text: str) -> str:
    """The text with every options block holding the table its marker names (ValueError for an unknown name)."""
    return BLOCK.sub(lambda m: f"<!-- options: {m.group(1)} -->\n{markdown(m.group(1).split())}\n<!-- /options -->",
                     text)


def doc_pages() -> list[Path]:
    """The pages whose option blocks are kept current: README.md and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m service.settings",
                                 description="Markdown tables of the serve options, made from their descriptions.")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--markdown", nargs="*", metavar="NAME",
                      help="print the table of the options named (e.g. model device port), or of all of them")
    what.add_argument("--write", nargs="*", type=Path, metavar="PAGE", help="rewrite every options block of "
                      "README.md and docs/*.md (or of the pages named) with the table its marker names")
    what.add_argument("--check", nargs="*", type=Path, metavar="PAGE",
                      help="as --write, but change nothing: exit 1, naming the pages, where a block is not current")
    args = ap.parse_args(argv)
    try:
        if args.markdown is not None:
            print(markdown(args.markdown))
            return 0
        stale = [page for page in (args.write or args.check or doc_pages())
                 if fill_blocks(page.read_text()) != page.read_text()]
    except ValueError as exc:
        ap.error(str(exc))
    for page in stale:
        if args.write is not None:
            page.write_text(fill_blocks(page.read_text()))
        print(f"{'rewrote' if args.write is not None else 'not current'}: {page}", file=sys.stderr)
    return 1 if stale and args.check is not None else 0


if __name__ == "__main__":
    sys.exit(main())
