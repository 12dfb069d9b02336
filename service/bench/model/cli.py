"""`python -m service bench model`: forward / backward / training-step time across model sizes and contexts,
each next to the memory calculator's prediction and the measured peak.

A configuration the calculator says cannot fit, or that runs out of memory, is reported in the table and
the run goes on; `--calc-only` prints the calculator alone, allocating nothing.
"""

import argparse
import gc
import itertools
import sys

import torch

from service.bench import flags
from service.bench.model import memory
from service.bench.model.measure import PeakMemory, available_bytes, pin_mmap_threshold, release_free_memory, rss_bytes
from service.bench.model.steps import PHASES, Case, build_model, model_config, run_case, summary
from service.bench.offline.quantization import scheme_entry
from service.settings import add_engine_argument
from service.engine.quant import quantization

FIT_SHARE = 0.9  # leave a tenth of the memory to the allocator's slack (and, on a shared CPU box, to others)


def _list(text: str, kind=str) -> list:
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="service bench model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="small", help="comma list of presets (small, medium, large, xl, 2.7b, tiny, "
                    "llama-1b, llama-8b) or local model folders; random weights (default %(default)s)")
    ap.add_argument("--context", default="128", help="comma list of context lengths (default %(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (default %(default)s)")
    ap.add_argument("--modes", default="fwd,fwd+bwd,train", help="comma list of fwd, fwd+bwd, train")
    ap.add_argument("--precision", default="fp32", help="comma list of fp32, bf16 (autocast)")
    ap.add_argument("--compile", default="off", metavar="on|off,...",
                    help="comma list of off, on (torch.compile of the whole model)")
    ap.add_argument("--quantization", default="none", help="comma list of none, int8, int4, fp8 (weight-only), "
                    "int8-w8a8, fp8-w8a8, as the engine serves them; forward only (int4 with bf16, fp8 modes on CUDA 8.9+)")
    ap.add_argument("--attention", default="sdpa", choices=memory.ATTENTIONS,
                    help="transformers attention implementation (eager materializes the scores)")
    flags.add_warmup(ap, 5, "warm-up steps, not measured")
    # dest "steps": the name the stored configuration has always used
    flags.deprecated_alias(ap, "--steps", flags.add_iterations(ap, 10, "measured steps", dest="steps"))
    add_engine_argument(ap, "device", "auto")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's own choice; "
                    "on a busy machine 1 is steadier)")
    ap.add_argument("--calc-only", action="store_true", help="print the calculator's table; allocate nothing "
                    "(--device cuda without a GPU predicts for one: AdamW's foreach step there)")
    ap.add_argument("--breakdown", action="store_true", help="print the calculator's full breakdown of each case")
    ap.add_argument("--memory-snapshot", metavar="DIR", help="CUDA: PyTorch memory history of the measured steps, "
                    "a pickle per case for https://pytorch.org/memory_viz")
    ap.add_argument("--profile", metavar="DIR", help="one extra step under torch.profiler, a Chrome trace per case")
    flags.add_json(ap, "write every row here (times in seconds, bytes)")
    ap.add_argument("--label", default=None, help="label stored with each run")
    from service.bench.store import add_db_argument
    add_db_argument(ap)
    args = ap.parse_args(argv)
    try:
        args.sizes = _list(args.sizes)
        args.context = _list(args.context, int)
        args.modes = _list(args.modes)
        args.precision = _list(args.precision)
        args.compile = [{"on": True, "off": False}[c] for c in _list(args.compile)]
        args.quantization = _list(args.quantization)
    except (ValueError, KeyError) as exc:
        ap.error(f"bad list: {exc}")
    for name, values, allowed in (("mode", args.modes, memory.MODES), ("precision", args.precision, memory.PRECISIONS),
                                  ("quantization", args.quantization, quantization.MODES)):
        if not values or any(v not in allowed for v in values):
            ap.error(f"--{name} takes a comma list of {', '.join(allowed)}")
    if args.batch < 1 or args.steps < 1 or args.warmup < 0 or any(c < 1 for c in args.context) or not args.context:
        ap.error("--batch, --iterations and every --context must be positive, --warmup not negative")
    if args.calc_only and args.quantization != ["none"]:
        ap.error("--calc-only predicts unquantized models: a quantized model's weights are measured after quantizing")
    return args


def _device(name: str, calc_only: bool = False) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available() and not calc_only:
        raise ValueError("--device cuda: no CUDA device here")
    return device


def calculator_table(rows: list[dict]) -> str:
    out = ["| size | parameters | context | mode | precision | parameters GiB | gradients GiB | AdamW GiB "
           "| activations GiB | peak GiB | peak at |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["estimate"]
        acts = memory.activation_bytes(e) if e.mode != "fwd" else 0
        grads = 4 * e.parameters if e.mode != "fwd" else 0
        adam = 8 * e.parameters if e.mode == "train" else 0
        out.append(f"| {r['case'].size} | {e.parameters:,} | {e.context} | {e.mode} | {e.precision} "
                   f"| {4 * e.parameters / memory.GIB:.2f} | {grads / memory.GIB:.2f} | {adam / memory.GIB:.2f} "
                   f"| {acts / memory.GIB:.2f} | {e.peak / memory.GIB:.2f} | {e.peak_at} |")
    return "\n".join(out)


def results_table(rows: list[dict]) -> str:
    """One line per case; quantization and weight memory columns only when a case is quantized."""
    quantized = any(r["case"].quantization != "none" for r in rows)
    extra = " quantization | weight MiB |" if quantized else ""
    out = [f"| size | context | mode | precision | compile |{extra} forward ms | backward ms | optimizer ms | step ms "
           "| predicted GiB | measured GiB | error |", "|---" * (12 + 2 * quantized) + "|"]
    for r in rows:
        c, e = r["case"], r["estimate"]
        weights = f" {r['weight_bytes'] / 2**20:.1f} |" if "weight_bytes" in r else " - |"
        extra = f" {c.quantization} |{weights}" if quantized else ""
        cells = []
        for phase in PHASES:
            s = r.get("stats", {}).get(phase)
            cells.append(f"{s['mean'] * 1e3:.1f} ± {s['std'] * 1e3:.1f}" if s else "-")
        step = r.get("stats", {}).get("step")
        if r["status"] == "ok":
            measured, err = r["peak_bytes"] / memory.GIB, f"{r['peak_bytes'] / e.peak - 1:+.1%}"
            tail = f"{step['mean'] * 1e3:.1f} | {e.peak / memory.GIB:.2f} | {measured:.2f} | {err}"
        else:
            tail = f"{r['status']} | {e.peak / memory.GIB:.2f} | - | -"
        out.append(f"| {c.size} | {c.context} | {c.mode} | {c.precision} | {'on' if c.compile else 'off'} |{extra}"
                   f" {' | '.join(cells)} | {tail} |")
    return "\n".join(out)


def _record(store, row: dict, args, device: torch.device) -> None:
    """One stored run per case: per-step phase times, predicted and measured peak; failed with the reason."""
    c, e = row["case"], row["estimate"]
    config = {"size": c.size, "context": c.context, "batch": c.batch, "mode": c.mode, "precision": c.precision,
              "compile": c.compile, "attention": args.attention, "device": device.type,
              "warmup": args.warmup, "steps": args.steps}
    if c.quantization != "none":  # only then: configurations stored before this dimension keep their hash
        config["quantization"] = c.quantization
        config |= scheme_entry(c.quantization)
    if row["status"].startswith("skipped"):  # a combination that cannot run is not a run
        print(f"{c.key}: {row['status']}", file=sys.stderr, flush=True)
        return
    try:
        with store.run(kind="model", config=config, label=args.label) as run:
            run.measure("predicted_memory_bytes", e.peak, unit="bytes")
            if "weight_bytes" in row:
                run.measure("weight_bytes", row["weight_bytes"], unit="bytes")
            for phase, values in row.get("times", {}).items():
                for i, v in enumerate(values):
                    run.measure(f"{phase}_seconds", v, unit="s", iteration=i)
            if row["status"] != "ok":
                raise RuntimeError(row["status"])
            run.measure("peak_memory_bytes", row["peak_bytes"], unit="bytes")
    except RuntimeError:
        pass  # stored as failed with the reason; the table already says it
    row["run_id"] = run.id
    print(f"{c.key}: {row['status']}, stored as run {run.id}", file=sys.stderr, flush=True)


def run(args, record=lambda row: None) -> list[dict]:
    """Every case of every size; `record(row)` is called as each case ends (run or not)."""
    device = _device(args.device, args.calc_only)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_snapshot and device.type != "cuda":
        raise ValueError("--memory-snapshot needs a CUDA device (it records the CUDA caching allocator)")
    if device.type == "cpu" and not args.calc_only:
        pin_mmap_threshold()
    rows = []
    for size in args.sizes:
        config = model_config(size)
        shape = memory.Shape.from_config(config)
        cases = [Case(size, ctx, args.batch, mode, prec, comp, quant) for quant, ctx, prec, comp, mode in
                 itertools.product(args.quantization, args.context, args.precision, args.compile, args.modes)]
        size_rows = [{"case": c, "estimate": memory.estimate(shape, c.batch, c.context, c.precision, c.mode,
                                                              args.attention, foreach_adamw=device.type == "cuda"),
                      "status": _cannot_run(c, device)} for c in cases]
        rows += size_rows
        if args.calc_only:
            continue
        release_free_memory(device)
        budget = FIT_SHARE * available_bytes(device)
        for r in size_rows:
            if r["status"] == "not run" and r["estimate"].peak > budget:  # quantized: the unquantized estimate
                r["status"] = f"does not fit ({r['estimate'].peak / memory.GIB:.1f} > {budget / memory.GIB:.1f} GiB)"
        todo = [r for r in size_rows if r["status"] == "not run"]
        for r in size_rows:
            if r["status"] != "not run":
                record(r)
        for weights in dict.fromkeys(r["case"].weights for r in todo):  # one model per kind of weights, in order
            _run_on_one_model(config, [r for r in todo if r["case"].weights == weights], device, args, record)
    return rows


def _cannot_run(case: Case, device: torch.device) -> str:
    """"not run" for a case that can run, else why not ("skipped: ...")."""
    if case.quantization == "none":
        return "not run"
    if case.mode != "fwd":
        return "skipped: quantized weights run forward only (--modes fwd)"
    try:
        quantization.check(case.quantization, device, case.weights[1])
    except ValueError as exc:
        return f"skipped: {exc}"
    return "not run"


def _run_on_one_model(config, rows: list[dict], device: torch.device, args, record) -> None:
    baseline = rss_bytes()
    quant, dtype = rows[0]["case"].weights
    try:
        model = build_model(config, device, args.attention, quant, dtype)
    except torch.OutOfMemoryError:  # the calculator's margin was not enough for the weights themselves
        for r in rows:
            r["status"] = "out of memory"
            record(r)
        release_free_memory(device)
        return
    try:
        if quant != "none":  # predicted with the weights as they are stored, measured once quantized
            stored = quantization.weight_bytes(model)
            for r in rows:
                r["weight_bytes"], r["estimate"] = stored, memory.with_weights(r["estimate"], stored, quant)
        for r in rows:
            _run_one(model, r, device, args, PeakMemory(device, baseline))
            record(r)
    finally:
        del model
        release_free_memory(device)


def _run_one(model, row: dict, device: torch.device, args, peak: PeakMemory) -> None:
    case = row["case"]
    print(f"running {case.key} ...", file=sys.stderr, flush=True)
    try:
        result = run_case(model, case, device, args.warmup, args.steps, peak, args.profile, args.memory_snapshot)
    except torch.OutOfMemoryError:
        row["status"] = "out of memory"
        gc.collect()
        return
    steps = [sum(t) for t in zip(*result.times.values())]
    row.update(status="ok", times=result.times, peak_bytes=result.peak_bytes,
               stats={**{p: summary(v) for p, v in result.times.items()}, "step": summary(steps)})


def to_json(row: dict) -> dict:
    """A row as plain data: the case, its status, predicted and measured peak bytes, per-step phase times."""
    e = row["estimate"]
    return {**row["case"].__dict__, "status": row["status"], "predicted_bytes": e.peak, "peak_at": e.peak_at,
            "predicted": e.bytes, "peak_bytes": row.get("peak_bytes"), "weight_bytes": row.get("weight_bytes"), "seconds": row.get("times", {}),
            "stats": row.get("stats", {})}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    from service.bench.store import StoreError, open_store
    try:
        device = _device(args.device, args.calc_only)
        store = None if args.calc_only else open_store(args.db)
        rows = run(args, record=lambda row: store and _record(store, row, args, device))
    except (ValueError, StoreError) as exc:
        sys.exit(f"bench model: {exc}")
    if args.breakdown or (args.calc_only and len(rows) == 1):
        for r in rows:
            print(memory.format_breakdown(r["estimate"], r["case"].size) + "\n")
    print(calculator_table(rows) if args.calc_only else results_table(rows))
    if args.json:
        import json
        try:
            with open(args.json, "w") as f:
                json.dump([to_json(r) for r in rows], f, indent=1)
        except OSError as exc:  # the runs are stored already: say which file could not be written
            sys.exit(f"bench model: cannot write {args.json}: {exc.strerror or exc}")
    return rows
