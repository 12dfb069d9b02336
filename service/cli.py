"""One console entry point: `python -m service <command>` or `llm-service <command>`."""

import argparse
import importlib
import logging
import sys

# bench subcommands: name -> (module with a main(argv), what it does)
BENCHES = {"offline": ("service.bench.offline.offline", "offline throughput against transformers on the same weights"),
           "serve": ("service.bench.loadgen.serve", "load generator against any OpenAI-compatible server"),
           "capacity": ("service.bench.loadgen.capacity.command", "highest load a server sustains within its latency SLOs"),
           "mock-server": ("service.bench.loadgen.mock_server", "an OpenAI-compatible server with no model, streaming at a set pace"),
           "compare": ("service.bench.loadgen.results.compare", "compare two bench serve results; non-zero exit on a regression"),
           "run": ("service.bench.offline.run", "a matrix of engine configurations, every run into the results store"),
           "history": ("service.bench.regress.history", "list stored runs, newest first"),
           "export": ("service.bench.regress.export", "write stored runs, measurements and samples as CSV or JSON"),
           "regress": ("service.bench.regress.cli", "regression verdicts with bootstrap statistics; exit 1 on a regression"),
           "model": ("service.bench.model.cli", "forward/backward time across model sizes, with a memory calculator"),
           "kernel": ("service.bench.kernel.cli", "attention-kernel microbenchmark with a float64 correctness gate"),
           "soak": ("service.bench.soak", "hours of mixed traffic; fails if memory, fds, threads, tasks or blocks grow")}


def _usage() -> str:
    return ("usage: python -m service COMMAND [options]   (the installed script: llm-service COMMAND)\n\ncommands:\n"
            + "".join(f"  {name:9} {what}\n" for name, (_, what) in COMMANDS.items()) + "\n" + _bench_commands())


def _bench_commands() -> str:
    return "bench commands:\n" + "".join(f"  {name:12} {what}\n" for name, (_, what) in BENCHES.items())


def _bench_usage() -> str:
    return "usage: python -m service bench COMMAND [options]   (bench COMMAND --help: its options)\n\n" + \
        _bench_commands()


def generate_parser() -> argparse.ArgumentParser:
    from service.engine.config import DEFAULT_MODEL
    from service.settings import add_engine_argument

    ap = argparse.ArgumentParser(prog="service generate", description="Generate text offline with the engine: "
                                 "each prompt's continuation, printed in order.")
    ap.add_argument("prompt", nargs="+", help="the prompts, each generated on its own")
    add_engine_argument(ap, "model", DEFAULT_MODEL)
    add_engine_argument(ap, "device", "auto")
    ap.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per prompt (default %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature; 0 is greedy (default %(default)s)")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    return ap


def _generate(argv: list[str]) -> None:
    args = generate_parser().parse_args(argv)  # before the engine's imports: --help answers at once
    from service.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device))
    prompts = args.prompt
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True) for p in prompts]
    for out in engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)):
        print(out["text"])


def _serve(argv: list[str]) -> None:
    from service import settings

    parsed = settings.parse(argv)  # before the server's imports: --help and usage errors answer at once
    from service.api.server import serve

    serve(parsed)


def _bench(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(_bench_usage(), end="")
        return
    if not argv or argv[0] not in BENCHES:
        print(_bench_usage(), end="", file=sys.stderr)
        sys.exit(2)
    importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:])


# commands: name -> (what runs it with the arguments after the name, what it does)
COMMANDS = {"serve": (_serve, "the HTTP server, OpenAI-compatible (serve --help: every option, its variable and "
                              "default)"),
            "generate": (_generate, "generate text offline with the engine"),
            "bench": (_bench, "benchmarks and load generation (bench COMMAND --help)")}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv[:1] in (["-h"], ["--help"]):
        print(_usage(), end="")
        return
    if not argv or argv[0] not in COMMANDS:
        print(_usage(), end="", file=sys.stderr)
        sys.exit(2)
    COMMANDS[argv[0]][0](argv[1:])
