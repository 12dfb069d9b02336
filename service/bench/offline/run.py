"""`bench run`: a matrix of engine configurations, each measured over warm-up and timed iterations into the store.

Every configuration runs --repeats times (3 by default), each repeat a stored run with a new engine, in rounds (the
whole matrix once, then again), so that the repeats are spread over time. They share the process and its loaded
weights, so their spread is only a floor for the noise: `bench regress` judges against the drift between
invocations (a label run twice, the second time with --force).

Per measured iteration: wall time, process CPU time, output and total tokens/s, TTFT and inter-token times from the
engine's own per-request timings, steps and peak memory, and on CPU the machine's own speed just then
(`service/bench/machine_speed.py`: `bench regress` judges times per unit of it); a device sampler records CPU/RSS/GPU
readings meanwhile. A configuration's repeats already stored for this commit, machine and label are not run again
(a killed matrix resumes); --force runs them all again.
"""

import argparse
import gc
import sys
import time

import numpy as np
import psutil
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from service.bench import flags
from service.bench.machine_speed import METRIC as MACHINE_REFERENCE
from service.bench.machine_speed import reference_seconds
from service.bench.offline import matrix
from service.bench.offline.lengths import Lengths
from service.bench.offline.offline import random_prompts
from service.bench.store import StoreError, add_db_argument, open_store
from service.bench.store.sampler import DeviceSampler
from service.engine import EngineConfig, LLMEngine, SamplingParams
from service.engine.config import resolve_dtype
from service.engine.models import load_model

UNITS = {"wall_seconds": "s", "cpu_seconds": "s", "output_tokens_per_second": "tok/s",
         "total_tokens_per_second": "tok/s", "ttft_median_seconds": "s", "ttft_p90_seconds": "s",
         "itl_median_seconds": "s", "itl_p90_seconds": "s", "steps": "count", "peak_memory_bytes": "B",
         MACHINE_REFERENCE: "s"}


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="service bench run", description=__doc__)
    ap.add_argument("matrix", nargs="?", help="YAML file: dimensions (lists) and/or configs (a list of settings)")
    g = ap.add_argument_group("dimensions (comma lists; zipped unless --cross-product)")
    for d in matrix.DIMENSIONS:
        g.add_argument("--" + d.key.replace("_", "-"), dest=d.key, default=None, help=f"{d.help} (default {d.default})")
    ap.add_argument("--cross-product", action="store_true", default=None, help="every combination of the dimensions")
    flags.add_warmup(ap, None, "warm-up iterations per configuration (default 3)")
    flags.add_iterations(ap, None, "measured iterations per configuration (default 10)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="stored runs per configuration, in rounds over the matrix (default 3; their spread is only the "
                         "noise within one invocation: bench regress judges against the drift between invocations)")
    ap.add_argument("--seed", type=int, default=None, help="seeds prompts and lengths (default 0)")
    ap.add_argument("--sample-interval", type=float, default=0.1, help="device sampler period in s (default %(default)s)")
    ap.add_argument("--label", default=None, help="a name for these runs (bench regress can pick them by it)")
    ap.add_argument("--force", action="store_true",
                    help="run again configurations already stored for this commit, machine and label (a second "
                         "invocation under the label: bench regress needs two to know the drift between them)")
    ap.add_argument("--dry-run", action="store_true", help="list the configurations and exit")
    flags.add_progress(ap)
    for key in ("commit", "branch", "subject"):
        ap.add_argument(f"--{key}", default=None, help=f"record this git {key} instead of the working tree's")
    add_db_argument(ap)
    return ap.parse_args(argv)


def plan(args) -> tuple[list[dict], dict]:
    """The configurations and the run settings (flags beat the YAML file beat the defaults)."""
    doc = matrix.load_yaml(args.matrix) if args.matrix else {}
    dims = {k: matrix.parse_values(k, v) for k, v in (doc.get("dimensions") or {}).items()}
    dims |= {d.key: matrix.parse_values(d.key, getattr(args, d.key)) for d in matrix.DIMENSIONS
             if getattr(args, d.key) is not None}
    pick = lambda flag, key, default: flag if flag is not None else doc.get(key, default)  # noqa: E731
    settings = {"warmup": pick(args.warmup, "warmup", 3), "iterations": pick(args.iterations, "iterations", 10),
                "repeats": pick(args.repeats, "repeats", 3), "seed": pick(args.seed, "seed", 0),
                "cross_product": bool(pick(args.cross_product, "cross_product", False))}
    if settings["iterations"] < 1 or settings["warmup"] < 0 or settings["repeats"] < 1:
        raise ValueError("--iterations and --repeats must be >= 1 and --warmup >= 0")
    configs = matrix.build(dims, doc.get("configs") or [], settings["cross_product"], torch.cuda.is_available(),
                           {"seed": settings["seed"]})
    return configs, settings


class Models:
    """Loaded weights shared by the configurations that use the same model, dtype and device."""

    def __init__(self):
        self.loaded = {}

    def engine(self, c: dict) -> LLMEngine:
        quantization = c.get("quantization", "none")
        lengths = [Lengths.parse(c[k]).high for k in ("input_len", "output_len")]
        # on CPU the KV cache is a block count: enough for the whole batch, so nothing is preempted
        blocks = -(-c["batch_size"] * (sum(lengths) + 16) // 16) + 16 if c["device"] == "cpu" else None
        config = EngineConfig(model=c["model"], device=c["device"], dtype=c["dtype"], max_num_seqs=c["max_num_seqs"],
                              attention_backend=c["attention_backend"], compile=c["compile"],
                              cuda_graphs=c["cuda_graphs"], num_blocks=blocks, enable_prefix_caching=False,
                              tensor_parallel_size=c["tensor_parallel_size"], quantization=quantization,
                              kv_cache_dtype=c.get("kv_cache_dtype", "auto"))
        key = (c["model"], c["dtype"], c["device"], quantization)
        if key not in self.loaded or config.tensor_parallel_size > 1:
            self.loaded.clear()
            gc.collect()
        if config.tensor_parallel_size > 1:
            return LLMEngine(config)  # every rank loads its own shard: the whole model is never needed here
        if key not in self.loaded:
            device = torch.device(c["device"])
            self.loaded[key] = load_model(c["model"], resolve_dtype(c["dtype"], device), device,
                                          quantization=quantization)
        return LLMEngine(config, loaded=self.loaded[key])


def iteration(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int]) -> dict[str, float]:
    """All prompts at once; the engine's own per-request clock readings give TTFT and inter-token times."""
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    seqs = [engine.make_sequence(p, SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0))
            for p, n in zip(prompts, output_lens)]
    for seq in seqs:
        engine.add_sequence(seq)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    if cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    ttft = [s.timings.first_token - s.timings.arrival for s in seqs]
    itl = np.concatenate([np.diff(s.timings.token_times) for s in seqs])
    out_tokens = sum(output_lens)
    # CPU time of this process (all its threads): on a shared machine it moves far less with the neighbours' load
    return {"wall_seconds": wall, "cpu_seconds": cpu, "output_tokens_per_second": out_tokens / wall,
            "total_tokens_per_second": (out_tokens + sum(map(len, prompts))) / wall,
            "ttft_median_seconds": float(np.median(ttft)), "ttft_p90_seconds": float(np.percentile(ttft, 90)),
            "itl_median_seconds": float(np.median(itl)) if itl.size else float("nan"),
            "itl_p90_seconds": float(np.percentile(itl, 90)) if itl.size else float("nan"),
            "steps": steps,
            "peak_memory_bytes": float(torch.cuda.max_memory_allocated() if cuda else psutil.Process().memory_info().rss)}


def measure(run, c: dict, settings: dict, models: Models, advance) -> dict[str, list[float]]:
    engine = models.engine(c)
    try:
        vocab = engine.runner.model.config.get_text_config().vocab_size
        prompts = random_prompts(c["batch_size"], Lengths.parse(c["input_len"]), vocab, settings["seed"])
        output_lens = Lengths.parse(c["output_len"]).sample(c["batch_size"], settings["seed"] + 1)
        values: dict[str, list[float]] = {}
        on_cpu = engine.device.type == "cpu"
        before = reference_seconds() if on_cpu else None
        for i in range(settings["warmup"] + settings["iterations"]):
            result = iteration(engine, prompts, output_lens)
            if on_cpu:  # the machine's speed just before and just after (the next iteration's "before")
                after = reference_seconds()
                result[MACHINE_REFERENCE] = (before * after) ** 0.5
                before = after
            if i >= settings["warmup"]:
                for metric, value in result.items():
                    if value == value:  # NaN: no inter-token gaps when every request makes one token
                        run.measure(metric, value, unit=UNITS[metric], iteration=i - settings["warmup"])
                        values.setdefault(metric, []).append(value)
            advance()
        return values
    finally:
        engine.runner.uncompile()  # the shared weights go to the next configuration as loaded
        engine.close()


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = Console() if Console().is_terminal else Console(width=140)
    try:
        configs, settings = plan(args)
        store = None if args.dry_run else open_store(args.db, {"commit": args.commit, "branch": args.branch,
                                                               "subject": args.subject})
    except (ValueError, OSError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    repeats = settings["repeats"]
    for c in configs:
        c["done"] = store.find_done("run", c["hash"], args.label) if c["skip"] is None and store and not args.force else []
        c["to_run"], c["run_ids"], c["values"] = 0 if c["skip"] else max(0, repeats - len(c["done"])), [], {}
    todo = [c for c in configs if c["to_run"]]
    console.print(f"bench run: {len(configs)} configurations, {len(todo)} to run, {repeats} runs each "
                  f"({settings['warmup']} warm-up + {settings['iterations']} measured iterations a run)"
                  + (f"; results in {store.url}" if store else ""))
    for c in configs:
        why = c["skip"] or (f"already stored as runs {', '.join(map(str, c['done'][:repeats]))} (--force reruns)"
                            if c["skip"] is None and not c["to_run"] else None)
        if why or args.dry_run:
            console.print(f"  {c['name']} (hash {c['hash']})" + (f": skipped, {why}" if why else ""), markup=False)
    if args.dry_run:
        return configs
    per_run = settings["warmup"] + settings["iterations"]
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("ETA"), TimeRemainingColumn(), console=console, disable=not args.progress)
    with bar:
        task = bar.add_task("iterations", total=sum(c["to_run"] for c in todo) * per_run)
        for round_ in range(max((c["to_run"] for c in todo), default=0)):  # rounds spread each one's repeats in time
            for c in (c for c in todo if c["to_run"] > round_ and not c.get("error")):
                bar.update(task, description=f"{c['name']} ({round_ + 1}/{c['to_run']})")
                try:
                    with store.run(kind="run", config=c["config"], label=args.label, name=c["name"]) as run, \
                            DeviceSampler(run, args.sample_interval):
                        c["run_ids"].append(run.id)
                        values = measure(run, c["config"], settings, Models.shared, lambda: bar.advance(task))
                    for metric, v in values.items():
                        c["values"].setdefault(metric, []).append(v)
                except StoreError as exc:  # the database went away: nothing more can be kept
                    print(f"error: {exc}", file=sys.stderr)
                    sys.exit(2)
                except Exception as exc:  # stored as failed by the store; the matrix goes on without this one
                    c["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                    console.print(f"[red]{c['name']} failed:[/red] {c['error']}")
                    bar.advance(task, (c["to_run"] - round_ - 1) * per_run)  # its later repeats will not run
    summary(console, configs)
    return configs


Models.shared = Models()


def summary(console: Console, configs: list[dict]) -> None:
    table = Table(title="bench run: medians over the measured iterations of every run", title_justify="left")
    for col in ("configuration", "hash", "runs", "wall s", "wall: runs apart", "output tok/s", "TTFT ms", "ITL ms",
                "status"):
        table.add_column(col, justify="left" if col in ("configuration", "runs", "status") else "right")
    for c in configs:
        v = c.get("values") or {}
        med = lambda k, scale=1.0: f"{np.median(np.concatenate(v[k])) * scale:,.2f}" if k in v else "-"  # noqa: E731
        walls = [np.median(w) for w in v.get("wall_seconds", [])]
        spread = f"{max(walls) / min(walls) - 1:.1%}" if len(walls) > 1 else "-"  # largest over smallest run median
        status = c["skip"] and "skipped" or c.get("error") and "failed" or ("ok" if c["run_ids"] else "stored earlier")
        ids = c["run_ids"] or c["done"]
        table.add_row(c["name"], c["hash"], ",".join(map(str, ids)) or "-", med("wall_seconds"), spread,
                      med("output_tokens_per_second"), med("ttft_median_seconds", 1e3), med("itl_median_seconds", 1e3),
                      status)
    console.print(table)
