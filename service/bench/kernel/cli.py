"""`python -m service bench kernel`: attention operations over a cross product of shapes.

Each (operation, shape) is first checked against a float64 reference; a wrong result is reported with its
error and never timed. Then warm-ups and timed repeats, statistics, TFLOP/s and GB/s from formulas, the
share of the device's peak and the speed relative to a baseline operation; a console table per shape
sorted by time, a CSV, one plot and one stored run per row.
"""

import argparse
import csv
import itertools
import sys

import torch

from service.bench import flags
from service.bench.kernel import ops
from service.bench.kernel.roofline import statistics, throughput
from service.bench.kernel.timing import clock_report, time_calls
from service.settings import add_engine_argument

TOLERANCE = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 4e-2}  # max |error| against float64; outputs are O(1)
CSV_FIELDS = ["op", "phase", "batch", "heads", "kv_heads", "head_dim", "context", "dtype", "status", "max_abs_error",
              "mean_ms", "median_ms", "std_ms", "min_ms", "max_ms", "p5_ms", "p95_ms", "tflops", "gbps",
              "flops_share", "bandwidth_share", "relative_to_baseline"]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# --preset serving: the shapes the engine runs under load on a GPU, with Llama-3.2-1B's heads (32 over 8 KV heads,
# 64 wide) and Llama-3.1-8B's (32 over 8, 128 wide): decode at batch 256 over long contexts (a full batch of
# mixed lengths) and prefill at batch 4 (a step's chunks)
PRESETS = {"serving": [("decode", 256, context) for context in (512, 1024, 2048)]
                      + [("prefill", 4, context) for context in (1024, 4096)]}
PRESET_HEADS = [(32, 8, 64), (32, 8, 128)]


def parse_args(argv):
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog="service bench kernel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=None, help=f"comma list of {', '.join(ops.OPS)} (default: all; on CPU flex "
                    "only when named, as compiling it takes minutes per shape)")
    ap.add_argument("--baseline", default="reference", help="the operation others are compared with")
    ap.add_argument("--phases", default="prefill,decode", help="comma list of prefill, decode (default %(default)s)")
    ap.add_argument("--batch", default="4" if cuda else "1",
                    help="comma list of batch sizes (default here %(default)s: 4 on CUDA, 1 on CPU)")
    # defaults: Llama-3.2-1B (32 heads over 8 KV heads of 64) and the 2.7b preset (32 heads of 80)
    ap.add_argument("--heads", default="32", help="comma list of query head counts (default %(default)s)")
    ap.add_argument("--kv-heads", default="8,32", help="comma list of key/value head counts (default %(default)s)")
    ap.add_argument("--head-dim", default="64,80", help="comma list of head sizes (default %(default)s)")
    ap.add_argument("--context", default="512,1024,2048,4096" if cuda else "128,512",
                    help="comma list of context lengths in tokens (default here %(default)s; 512,1024,2048,4096 on "
                         "CUDA, 128,512 on CPU)")
    ap.add_argument("--dtype", default="bf16" if cuda else "fp32", help="comma list of fp32, fp16, bf16")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="serving: decode at batch 256 over 512-2,048 tokens and prefill at batch 4 over 1,024 and "
                    "4,096, with the 1B and 8B shapes' heads (in place of --phases, --batch, --heads, --kv-heads, "
                    "--head-dim, --context, which it refuses beside it; --dtype still applies)")
    flags.add_warmup(ap, 10)
    # dests "repeats" and "flush_l2": the names the stored configuration has always used
    flags.deprecated_alias(ap, "--repeats", flags.add_iterations(ap, 64, "timed repeats of each case", dest="repeats"))
    flush = flags.add_switch(ap, "flush-l2", True, "CUDA: flush the L2 cache before each repeat")
    flags.deprecated_alias(ap, "--no-flush", flush, value=False)
    add_engine_argument(ap, "device", "auto")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's own choice)")
    flags.add_csv(ap, "write every row here")
    ap.add_argument("--plot", default=None, help="write a PNG of median time against context, per operation")
    ap.add_argument("--label", default=None, help="a name for this run in the results store")
    from service.bench.store import add_db_argument
    add_db_argument(ap)
    args = ap.parse_args(argv)
    try:
        ops.FLEX_ON_CPU = args.ops is not None and "flex" in args.ops.split(",")
        args.ops = [o for o in (args.ops or ",".join(ops.OPS)).split(",") if o]
        unknown = [o for o in args.ops + [args.baseline] if o not in ops.OPS]
        if unknown:
            raise ValueError(f"unknown operation {unknown[0]!r}: use {', '.join(ops.OPS)}")
        if args.baseline not in args.ops:
            args.ops.append(args.baseline)
        if args.preset:
            given = [f"--{name.replace('_', '-')}" for name in ("phases", "batch", "heads", "kv_heads", "head_dim",
                                                                 "context") if getattr(args, name) != ap.get_default(name)]
            if given:
                raise ValueError(f"--preset names the shapes itself: drop {', '.join(given)}")
            args.shapes = [ops.Shape(phase, batch, heads, kv_heads, head_dim, context, dtype)
                           for (heads, kv_heads, head_dim), (phase, batch, context), dtype in itertools.product(
                               PRESET_HEADS, PRESETS[args.preset], args.dtype.split(","))]
        else:
            args.shapes = [ops.Shape(*combo) for combo in itertools.product(
                args.phases.split(","), _ints(args.batch), _ints(args.heads), _ints(args.kv_heads),
                _ints(args.head_dim), _ints(args.context), args.dtype.split(","))]
        if args.warmup < 0 or args.repeats < 1:
            raise ValueError("--warmup must be >= 0 and --iterations >= 1")
    except ValueError as exc:
        ap.error(str(exc))
    return args


def prepare(shape: ops.Shape, device: torch.device):
    """Inputs and the float64 answer of a shape, once for all operations; ValueError / Unsupported when it cannot be."""
    shape.check()
    if _dtype_missing(shape, device):
        raise ops.Unsupported(f"{shape.dtype} is not supported on this {device.type}")
    q, k, v = ops.make_inputs(shape, device)
    return q, k, v, ops.oracle(q, k, v, shape.phase == "prefill")


def measure(name: str, shape: ops.Shape, device: torch.device, warmup: int, repeats: int, flush: bool,
            prepared=None) -> dict:
    """One row: the correctness gate, then (only if it passes) the timings. Status ok, wrong or skipped."""
    row = {"op": name, **shape.__dict__, "status": "ok"}
    try:
        q, k, v, expected = prepared or prepare(shape, device)
        fn = ops.OPS[name](shape, q, k, v)
        error = (fn().double() - expected).abs().max().item()
    except (ops.Unsupported, ValueError) as exc:
        return {**row, "status": f"skipped: {exc}"}
    except torch.OutOfMemoryError:
        return {**row, "status": "skipped: out of memory"}
    row["max_abs_error"] = error
    if not error <= TOLERANCE[shape.dtype]:  # NaN fails too
        return {**row, "status": f"wrong: max abs error {error:.3g} > {TOLERANCE[shape.dtype]:g}, not timed"}
    row["seconds"] = time_calls(fn, device, warmup, repeats, flush)
    row.update(statistics(row["seconds"]))
    return row


def _dtype_missing(shape: ops.Shape, device: torch.device) -> bool:
    return device.type == "cuda" and shape.dtype == "bf16" and not torch.cuda.is_bf16_supported()


def add_relative(rows: list[dict], baseline: str, device_name: str) -> None:
    """Throughput and speed relative to the baseline op of the same shape (baseline median / this median)."""
    base = {_shape_key(r): r["median"] for r in rows if r["op"] == baseline and r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok":
            r.update(throughput(ops.Shape(*_shape_key(r)), r["median"], device_name))
            r["relative_to_baseline"] = base[_shape_key(r)] / r["median"] if _shape_key(r) in base else None


def _shape_key(r: dict) -> tuple:
    return tuple(r[f] for f in ("phase", "batch", "heads", "kv_heads", "head_dim", "context", "dtype"))


def _fmt(x, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def table(rows: list[dict], baseline: str) -> str:
    out = []
    for key, group in itertools.groupby(rows, key=_shape_key):
        phase, b, h, kvh, d, ctx, dt = key
        out.append(f"\n{phase}: batch {b}, heads {h}/{kvh} KV, head dim {d}, context {ctx}, {dt}")
        out.append("| op | median ms | mean ± std ms | min ms | p5 / p95 ms | TFLOP/s | GB/s | % peak FLOP/s "
                   f"| % peak GB/s | vs {baseline} | max abs error |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        group = sorted(group, key=lambda r: r.get("median", float("inf")))
        for r in group:
            if r["status"] != "ok":
                out.append(f"| {r['op']} | {r['status']} |" + " |" * 8 + f" {_fmt(r.get('max_abs_error'), '.2e')} |")
                continue
            out.append(f"| {r['op']} | {r['median'] * 1e3:.3f} | {r['mean'] * 1e3:.3f} ± {r['std'] * 1e3:.3f} "
                       f"| {r['min'] * 1e3:.3f} | {r['p5'] * 1e3:.3f} / {r['p95'] * 1e3:.3f} | {r['tflops']:.3f} "
                       f"| {r['gbps']:.1f} | {_fmt(r['flops_share'], '.1%')} | {_fmt(r['bandwidth_share'], '.1%')} "
                       f"| {_fmt(r['relative_to_baseline'], '.2f')}x | {r['max_abs_error']:.2e} |")
    return "\n".join(out)


def write_csv(rows: list[dict], path: str) -> None:
    """One line per row; times in milliseconds; empty cells where a row was skipped or wrong."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k[:-3]] * 1e3 if k.endswith("_ms") and k[:-3] in r else r.get(k) for k in CSV_FIELDS})


def plot(rows: list[dict], path: str, title: str) -> None:
    """Median time against context length: one panel per phase, one line per operation and other dimensions."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    phases = sorted({r["phase"] for r in ok}, reverse=True)
    op_names = sorted({r["op"] for r in ok})
    combos = sorted({(r["heads"], r["kv_heads"], r["head_dim"], r["batch"], r["dtype"]) for r in ok})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, max(1, len(phases)), figsize=(6.5 * max(1, len(phases)), 4.8), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        for r_op, combo in itertools.product(op_names, combos):
            pts = sorted((r["context"], r["median"] * 1e3) for r in ok if r["phase"] == phase and r["op"] == r_op
                         and (r["heads"], r["kv_heads"], r["head_dim"], r["batch"], r["dtype"]) == combo)
            if pts:  # colour: the operation; line style: the head layout, batch and dtype
                h, kvh, d, b, dt = combo
                ax.plot(*zip(*pts), marker="o", color=f"C{op_names.index(r_op)}",
                        linestyle=styles[combos.index(combo) % len(styles)], label=f"{r_op} {h}/{kvh}x{d} b{b} {dt}")
        contexts = sorted({r["context"] for r in ok})
        ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="median ms per call", title=phase)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def store_row(store, row: dict, args, device: torch.device) -> None:
    """One stored run per (operation, shape) row: its configuration, timings and throughput."""
    config = {k: row[k] for k in ("op", "phase", "batch", "heads", "kv_heads", "head_dim", "context", "dtype")}
    config.update(device=device.type, warmup=args.warmup, repeats=args.repeats, flush_l2=args.flush_l2)
    try:
        with store.run(kind="kernel", config=config, label=args.label) as run:
            if "max_abs_error" in row:
                run.measure("max_abs_error", row["max_abs_error"])
            for i, s in enumerate(row.get("seconds", [])):
                run.measure("kernel_seconds", s, unit="s", iteration=i)
            if row["status"] != "ok":
                raise RuntimeError(row["status"])
    except RuntimeError:
        pass  # stored as failed with its reason
    row["run_id"] = run.id


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    from service.bench.store import StoreError, open_store
    try:
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              "cpu" if args.device == "auto" else args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device here")
        store = open_store(args.db)
    except (ValueError, RuntimeError, StoreError) as exc:
        sys.exit(f"bench kernel: {exc}")
    if args.threads:
        torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}; {clock_report(device)}", flush=True)
    try:
        rows = _sweep(args, device, name, store)
    except StoreError as exc:
        sys.exit(f"bench kernel: {exc}")
    print(table(rows, args.baseline))
    try:
        if args.csv:
            write_csv(rows, args.csv)
        if args.plot:
            plot(rows, args.plot, f"attention kernels on {name}")
    except OSError as exc:  # the rows are stored already: say which file could not be written
        sys.exit(f"bench kernel: cannot write {exc.filename or args.plot}: {exc.strerror or exc}")
    return rows


def _sweep(args, device: torch.device, name: str, store) -> list[dict]:
    rows = []
    for shape in args.shapes:
        group = []
        try:
            prepared = prepare(shape, device)
        except (ops.Unsupported, ValueError, torch.OutOfMemoryError):
            prepared = None  # each row then says why
        for op in args.ops:
            group.append(measure(op, shape, device, args.warmup, args.repeats, args.flush_l2, prepared))
            print(f"{op} {shape}: {group[-1]['status']}", file=sys.stderr, flush=True)
        add_relative(group, args.baseline, name)
        for r in group:  # stored shape by shape, so an interrupted sweep keeps what it measured
            store_row(store, r, args, device)
        rows += group
    return rows
