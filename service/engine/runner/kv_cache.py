"""The paged KV cache's shape and size: how many blocks fit in the GPU memory left after a peak forward pass.

On CUDA the budget is gpu_memory_utilization of the device's memory, less the peak of a forward pass over
max_num_batched_tokens tokens (measured by running one into a throwaway cache), less what the CUDA graphs keep,
and less other processes' use.
"""

import logging

import torch

from service.engine.config import dtype_name
from service.engine.runner.attention import ForwardContext, forward_context
from service.engine.scheduler import ScheduledBatch
from service.engine.sequence import Sequence

log = logging.getLogger(__name__)


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config."""
    config = config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def cache_tensor(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """One layer's zeroed keys or values, indexed [block, token in block, KV head, head dim].

    On CUDA the heads lie outside the tokens in memory ([block, KV head, token, dim], transposed), so one head's
    page is one contiguous piece for the Triton kernel, which reads the cache through its strides: decode attention
    with 64-wide heads took 1-8% less time so (tests/gpu/kernels/decode_split_sweep.py, H100). On CPU it is contiguous."""
    if device.type != "cuda":
        return torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    return torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=dtype, device=device).transpose(1, 2)


def new_kv_caches(runner, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (keys, values) of `num_blocks` blocks for each of the runner's layers."""
    r = runner
    return [tuple(cache_tensor(num_blocks, r.block_size, r.kv_heads, r.head_dim, r.kv_dtype, r.device) for _ in "kv")
            for _ in range(r.layers)]


def blocks_that_fit(runner) -> int:
    r = runner
    if r.device.type != "cuda":
        return 1024
    per_block = r.kv_block_bytes
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    peak = profile_peak_memory(r)
    total = torch.cuda.get_device_properties(r.device).total_memory
    free_now, _ = torch.cuda.mem_get_info(r.device)
    other = total - free_now - torch.cuda.memory_reserved(r.device)  # other processes
    budget = total * r.config.gpu_memory_utilization - peak - other
    blocks = int(budget // per_block)
    if r.config.tensor_parallel_size > 1:  # every rank's cache holds the same blocks: the fewest that fit on any GPU
        fewest = torch.tensor([blocks], dtype=torch.int64, device=r.device)  # (each rank's runner asks the same)
        torch.distributed.all_reduce(fewest, op=torch.distributed.ReduceOp.MIN)
        blocks = int(fewest)
    if blocks < 2:
        raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB)")
    log.info("KV cache: %d blocks of %d tokens (%.1f GiB, %s)", blocks, r.block_size, blocks * per_block / 2**30,
             dtype_name(r.kv_dtype))
    return blocks


def profile_peak_memory(runner) -> int:
    """Peak memory of a forward pass over max_num_batched_tokens tokens, plus, with CUDA graphs, what the graphs
    keep: their memory pool (a forward pass over the largest step captured, cuda_graphs.MIXED_MAX_TOKENS) and
    every graph's logits (cuda_graphs.logits_rows_held rows of the vocabulary)."""
    from service.engine.runner.cuda_graphs import MIXED_MAX_TOKENS, logits_rows_held

    base = torch.cuda.memory_allocated(runner.device)
    dry_run(runner, runner.config.max_num_batched_tokens)
    peak = torch.cuda.max_memory_allocated(runner.device)
    pool = 0
    if runner.config.cuda_graphs:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        dry_run(runner, min(MIXED_MAX_TOKENS, runner.config.max_num_batched_tokens))
        pool = torch.cuda.max_memory_allocated(runner.device) - base
        vocab = runner.model.config.get_text_config().vocab_size
        c = runner.config
        pool += logits_rows_held(c.max_num_seqs, c.max_num_batched_tokens) * vocab * runner.dtype.itemsize
    torch.cuda.empty_cache()
    return peak + pool + 2**30  # headroom for sampling over many rows


@torch.inference_mode()
def dry_run(runner, tokens: int) -> None:
    """One forward pass of a `tokens`-long prompt into a throwaway cache."""
    r = runner
    blocks = -(-tokens // r.block_size) + 1
    caches = new_kv_caches(r, blocks)
    seq = Sequence("dry-run", [0] * tokens, params=None)
    seq.block_table = list(range(1, blocks))
    ids, pos, meta = r.pack_inputs(ScheduledBatch([seq], [tokens], []), decode_only=False)
    with forward_context(ForwardContext(caches, meta, r.backend)):
        logits = r.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1).logits
        logits.float().softmax(-1)
    if r.device.type == "cuda":
        torch.cuda.synchronize()
