"""How fast a `bench offline` workload could run on the device at best: its roofline time.

The workload is every request at once, `max_num_seqs` at a time, prompts in steps of `max_num_batched_tokens`. An
ideal engine spends on each step the larger of its FLOPs at the device's peak and its bytes at the memory's
bandwidth, and runs full steps: prompts in ceil(prompt tokens / max_num_batched_tokens) steps, the other output
tokens in ceil(those tokens / concurrency) decode steps. Prefill and decode are added, each at its own bound:

- FLOPs: 2 per weight of the decoder layers for each token computed; the output projection (2 x hidden x vocabulary)
  for each output token (logits only where a sequence samples); attention, 4 x head dim x query heads per layer for
  each (query, key) pair a token attends to (causal within its prompt, its whole context in decode).
- Bytes: the weights once a step (every parameter but an input embedding that the output projection does not
  share: a step reads only its tokens' rows of it); the KV cache once per decode token over its context, and each
  token's keys and values written once.

The peak is the matrix product's in the weights' compute type (fp8 and int8 for the W8A8 modes, else the model's
dtype), from the vendors' data sheets (`bench kernel`'s table, bench/kernel/roofline.py).
"""

from dataclasses import dataclass

import torch

from service.bench.kernel.ops import DTYPES
from service.bench.kernel.roofline import device_peak

COMPUTE = {"fp8-w8a8": "fp8", "int8-w8a8": "int8"}  # the W8A8 modes multiply in 8 bits; the rest in the dtype


@dataclass
class ModelShape:
    layer_weights: int  # elements of the decoder layers' matrices: each computed token goes through all of them
    head_weights: int  # the output projection's (hidden x vocabulary), at each sampled row
    weight_bytes: int  # read once a step
    layers: int
    query_heads: int
    head_dim: int
    kv_bytes_per_token: int  # keys and values of one token over every layer


def shape_of(model: torch.nn.Module, kv_dtype: torch.dtype) -> ModelShape:
    """The shape of a loaded (whole, not tensor-parallel) transformers model with a KV cache of `kv_dtype`."""
    from service.engine.quant.quantization import stored_bytes
    from service.engine.runner.compilation import decoder_layers
    from service.engine.runner.kv_cache import kv_shape

    config = model.config.get_text_config()
    layers, kv_heads, head_dim = kv_shape(config)
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    matrices = sum(p.numel() for layer in decoder_layers(model) for p in layer.parameters()
                   if p.dim() == 2 and min(p.shape) > 1)  # (not a W8A8 layer's [1, out] scales)
    weight_bytes = sum(map(stored_bytes, model.parameters()))  # (a quantized weight's codes and scales)
    if embedding is not None and head is not None and embedding.weight is not head.weight:
        weight_bytes -= stored_bytes(embedding.weight)
    return ModelShape(matrices, config.hidden_size * config.vocab_size, weight_bytes, layers,
                      config.num_attention_heads, head_dim, 2 * layers * kv_heads * head_dim * kv_dtype.itemsize)


def roofline_seconds(shape: ModelShape, input_lens: list[int], output_lens: list[int], max_num_seqs: int,
                     max_num_batched_tokens: int, peak_tflops: float, bandwidth_gbs: float) -> float:
    """The least time the device needs for the workload (module docstring)."""
    flops_per_s, bytes_per_s = peak_tflops * 1e12, bandwidth_gbs * 1e9
    attend = 4 * shape.head_dim * shape.query_heads * shape.layers  # FLOPs per (query, key) pair
    prompt_tokens = sum(input_lens)
    decode_tokens = sum(max(o - 1, 0) for o in output_lens)  # each request's first output comes from its prefill
    prefill_pairs = sum(n * (n + 1) // 2 for n in input_lens)
    # decode token t (1 .. o - 1) of a request attends to its prompt and the t outputs before it, itself included
    decode_pairs = sum((o - 1) * n + (o - 1) * o // 2 for n, o in zip(input_lens, output_lens) if o > 1)
    prefill_flops = (2 * shape.layer_weights * prompt_tokens + 2 * shape.head_weights * len(input_lens)
                     + attend * prefill_pairs)
    decode_flops = 2 * (shape.layer_weights + shape.head_weights) * decode_tokens + attend * decode_pairs
    prefill_steps = -(-prompt_tokens // max_num_batched_tokens)
    decode_steps = -(-decode_tokens // max(min(max_num_seqs, len(input_lens)), 1))
    prefill_bytes = prefill_steps * shape.weight_bytes + prompt_tokens * shape.kv_bytes_per_token
    decode_bytes = (decode_steps * shape.weight_bytes
                    + (decode_pairs + decode_tokens) * shape.kv_bytes_per_token)  # context read, each token written
    return (max(prefill_flops / flops_per_s, prefill_bytes / bytes_per_s)
            + max(decode_flops / flops_per_s, decode_bytes / bytes_per_s))


def peaks(device_name: str, quantization: str, dtype: torch.dtype) -> tuple[float | None, float | None]:
    """(peak TFLOP/s of the matrix products, memory GB/s) for the run, or Nones where the device is unknown."""
    name = COMPUTE.get(quantization) or next((k for k, t in DTYPES.items() if t == dtype), "")
    return device_peak(device_name, name)
