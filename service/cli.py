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


def _generate(argv: list[str]) -> None:
    from service.engine import EngineConfig, LLMEngine, SamplingParams

    ap = argparse.ArgumentParser(prog="service generate", description="Generate text offline with the engine.")
    ap.add_argument("prompt", nargs="+")
    ap.add_argument("--model", default=EngineConfig.model)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    args = ap.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device))
    prompts = args.prompt
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True) for p in prompts]
    for out in engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)):
        print(out["text"])


def _serve(argv: list[str]) -> None:
    from service import settings
    from service.api.server import serve

    serve(settings.parse(argv))


def _bench(argv: list[str]) -> None:
    if not argv or argv[0] not in BENCHES:
        print("usage: python -m service bench {%s} [options]\n%s" % (
            ",".join(BENCHES), "\n".join(f"  {k:8} {what}" for k, (_, what) in BENCHES.items())), file=sys.stderr)
        sys.exit(2)
    importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"serve": _serve, "generate": _generate, "bench": _bench}
    if not argv or argv[0] not in commands:
        print("usage: python -m service {serve,generate,bench} ...\n"
              "  serve [--model M --port P ...]   the HTTP server (see serve --help)\n"
              "  generate PROMPT...               generate text offline\n"
              "  bench {%s}   benchmarks and load generation" % ",".join(BENCHES), file=sys.stderr)
        sys.exit(2)
    commands[argv[0]](argv[1:])
