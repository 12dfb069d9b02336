"""Quantization of a loaded model's linear layers, and the refusals of what a device cannot run.

Weight-only modes (torchao): int8 (per output channel), int4 (groups of weights sharing a scale and zero point),
fp8 (e4m3, per output channel); activations keep the model's dtype. On CUDA int8 runs engine/quant/w8a8.py's layer
(our Triton kernel) instead of torchao's, which torch.compile stalled on. W8A8 modes (engine/quant/w8a8.py): int8-w8a8
and fp8-w8a8 quantize the activations too, per token, so the matmul runs in 8 bits. The embedding keeps the model's
dtype, and so does the output projection but in int8-w8a8 on CUDA (`_quantizes_head`); the KV cache keeps it unless
--kv-cache-dtype says fp8 (config.resolve_kv_dtype).
"""

import importlib.util
import logging

import torch

from service.engine.config import QUANTIZATIONS, dtype_name, resolve_dtype, resolve_kv_dtype
from service.engine.quant import w8a8

log = logging.getLogger(__name__)
if not torch.cuda.is_available():
    # torchao (imported by transformers too) warns that its CUDA-only extensions do not load on a CPU build of
    # torch; nothing here uses them, and the warnings would open every CPU start-up log
    logging.getLogger("torchao").setLevel(logging.ERROR)

MODES = QUANTIZATIONS  # named once, beside the option that offers them
W8A8_MODES = ("int8-w8a8", "fp8-w8a8")
# what each mode stores and computes in: shown by /v1/models and stored with a benchmark's configuration
SCHEMES = {
    "none": "weights and activations in the model's dtype",
    "int8": "weights int8, one scale per output channel; activations in the model's dtype (weight-only)",
    "int4": "weights int4, a scale and zero point per group of input channels; activations bfloat16 (weight-only)",
    "fp8": "weights float8 e4m3, one scale per output channel; activations in the model's dtype (weight-only)",
    "int8-w8a8": "weights int8, one scale per output channel; activations int8, one scale per token (dynamic)",
    "fp8-w8a8": "weights float8 e4m3, one scale per output channel; activations float8 e4m3, one scale per token "
                "(dynamic)",
}
CPU_INT4_GROUP = 32  # SmolLM2's hidden size (576) is not a multiple of 128; 32 also keeps its greedy output close
CUDA_INT4_GROUP = 128  # tinygemm's usual group; it pads the input features to a multiple of 1024 anyway


def describe(mode: str) -> str:
    """What a mode stores and computes in; a pre-quantized checkpoint's method is described by its name only."""
    return SCHEMES.get(mode, f"as the checkpoint was saved ({mode})")


def check(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, in one line, a mode this device or dtype cannot run (before anything is loaded)."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}: use {', '.join(MODES)}")
    torchao = mode not in ("none", *W8A8_MODES) and not _own_kernel(mode, device)
    if torchao and importlib.util.find_spec("torchao") is None:
        raise ValueError(f"{mode} weights need torchao, which is not installed here: pip install torchao")
    if mode == "fp8" and device.type != "cuda":
        raise ValueError("fp8 weights need a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         f"this device is {device.type}: use int8 or int4")
    if mode == "fp8-w8a8" and device.type != "cuda":
        raise ValueError("fp8-w8a8 needs a CUDA GPU of compute capability 8.9 or newer (fp8 tensor cores: Ada, "
                         f"Hopper); this device is {device.type}: use int8-w8a8")
    if mode == "fp8-w8a8" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"fp8-w8a8 needs a GPU of compute capability 8.9 or newer (fp8 tensor cores: Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}: use int8-w8a8")
    if mode == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"fp8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}: use int8 or int4")
    if mode == "int4" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        raise ValueError("int4 on CUDA needs compute capability 8.0 or newer (the tinygemm kernel)")
    if mode == "int4" and dtype != torch.bfloat16:
        # on CPU torchao's float32 path is a fallback ~50x slower than its bfloat16 kernel (measured)
        raise ValueError(f"int4 weights run in bfloat16 (the tinygemm kernels): use --dtype bfloat16 or auto, "
                         f"not {dtype_name(dtype)}")
    if mode != "none" and device.type not in ("cpu", "cuda"):
        raise ValueError(f"quantization {mode} runs on cpu or cuda, not {device.type}")


def check_config(config) -> None:
    """`check` for an EngineConfig, so that a server refuses a bad mode before it starts loading."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" \
        else torch.device(config.device)
    dtype = resolve_dtype(config.dtype, device, config.quantization)
    check(config.quantization, device, dtype)
    kv = resolve_kv_dtype(config.kv_cache_dtype, dtype)
    if kv.itemsize == 1 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("an 8-bit KV cache needs a GPU of compute capability 8.9 or newer (Ada, Hopper) for the "
                         "attention kernel's float8 loads: use --kv-cache-dtype auto")
    if config.quantization != "none" and config.tensor_parallel_size > 1:
        raise ValueError("quantization does not work with tensor parallelism yet: use --tensor-parallel-size 1")


def checkpoint_method(config) -> str | None:
    """The quantization a checkpoint was saved with (its transformers config's quant_method), or None."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


def quantize(model: torch.nn.Module, mode: str, device: torch.device, simulate: bool = False,
             tokenizer=None) -> None:
    """Replace the weights of every linear layer but the output projection by quantized tensors, in place. With a
    `tokenizer`, a W8A8 mode first smooths the model on its calibration text (engine/quant/smoothing.py).

    The output projection stays but in int8-w8a8 on CUDA (`_quantizes_head`): it is usually tied to the embedding,
    and a quantized copy adds memory instead of saving it (vLLM leaves it alone). `simulate` (W8A8 modes only, for
    measurements): the layers run the scheme's float32 reference instead of its kernels, so fp8-w8a8 runs on a CPU.
    """
    if mode == "none":
        return
    output = model.get_output_embeddings()
    if mode in W8A8_MODES and tokenizer is not None:
        from service.engine.quant import smoothing
        smoothing.smooth(model, tokenizer, mode)
    if mode in W8A8_MODES or _own_kernel(mode, device):
        head = _quantizes_head(mode, device, simulate)
        count = w8a8.quantize(model, mode, simulate, skip=None if head else output)
        if count:  # (none left where the layers were quantized as they were drawn)
            log.info("quantized %d linear layers%s to %s%s", count, " with the output projection" if head else "",
                     mode, " (float32 simulation)" if simulate else "")
        return
    if simulate:
        raise ValueError(f"only the W8A8 modes have a float32 simulation, not {mode}")
    from torchao.quantization import quantize_

    quantize_(model, _config(mode, device),
              filter_fn=lambda module, _name: isinstance(module, torch.nn.Linear) and module is not output)
    log.info("quantized %d linear layers to %s weights", _count_quantized(model), mode)


def _quantizes_head(mode: str, device: torch.device, simulate: bool) -> bool:
    """Whether the output projection is quantized too: in int8-w8a8 on CUDA, where it is the largest product of a
    decode step, and our kernel over its int8 weights and activations took 88-167 us against cuBLAS's 188-247 in
    bf16 at 1 to 256 rows (a 1B Llama's 128,256 x 2,048 head on the H100). A tied embedding keeps its weights, so
    the int8 copy adds half the head's bf16 bytes. Weight-only int8 leaves it: its kernel, widening the weights,
    took 320-347 us at 144-256 rows. On the CPU it stays too (not measured there)."""
    return mode == "int8-w8a8" and device.type == "cuda" and not simulate


def _own_kernel(mode: str, device: torch.device) -> bool:
    """Weight-only int8 on CUDA runs our Triton kernel (engine/quant/w8a8.py), not torchao's: torch.compile tuned
    torchao's int8 matmul at every new prefill size, a stall of minutes. On the CPU torchao's int8 kernel stays."""
    return mode in w8a8.WEIGHT_ONLY and device.type == "cuda"


def _config(mode: str, device: torch.device):
    from torchao.quantization import Float8WeightOnlyConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig

    # set_inductor_config=False: torchao would otherwise change torch.compile's global settings for the
    # whole process (slower compiles), and the engine compiles every mode alike
    if mode == "int8":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if mode == "fp8":
        return Float8WeightOnlyConfig(set_inductor_config=False)
    if device.type == "cuda":
        return Int4WeightOnlyConfig(group_size=CUDA_INT4_GROUP, int4_packing_format="tile_packed_to_4d",
                                    set_inductor_config=False)
    # torchao's CPU int4 weight-only layout (packed for aten's _weight_int4pack_mm_for_cpu); its stable
    # Int4WeightOnlyConfig has CUDA layouts only
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    return PrototypeInt4WeightOnlyConfig(group_size=CPU_INT4_GROUP, set_inductor_config=False)


def _count_quantized(model: torch.nn.Module) -> int:
    return sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear) and _is_subclass(m.weight))


def _is_subclass(t: torch.Tensor) -> bool:
    return type(t) not in (torch.Tensor, torch.nn.Parameter)


def _storages(t: torch.Tensor):
    """The plain tensors that hold a tensor's data (a quantized tensor holds several: codes, scales...)."""
    if _is_subclass(t) and hasattr(t, "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            yield from _storages(getattr(t, name))
    else:
        yield t


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a (possibly quantized) tensor's storages hold: its codes, scales..."""
    return sum(s.numel() * s.element_size() for s in _storages(t))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters really occupy, each storage counted once (tied weights)."""
    seen, total = set(), 0
    for t in model.parameters():
        for s in _storages(t):
            key = (s.device, s.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total += s.untyped_storage().nbytes()
    return total
