"""torch.compile of the decoder layers and the modules around them, tried once at start-up, and its undoing.

Paged attention is one custom op inside each layer's graph (runner/attention.py), so each layer is one graph and
every layer runs the same one; the model's own code is untouched. On Hopper, inductor's kernels launch with
programmatic dependent launch, as ours do (engine/pdl.py).
"""

import logging
from typing import Callable

import torch
import torch._inductor.config

from service.engine import pdl
from service.engine.runner.kv_cache import dry_run

log = logging.getLogger(__name__)


def compile_layers(runner, backend: str | Callable = "inductor") -> bool:
    """Compile each decoder layer (fusing norms, rotary embeddings, activations, residual adds), and the modules
    around them that run once a step: the rotary embedding's cosines and sines, the last norm and the output
    projection (some 20 small kernels a step in eager code, among them the int8-w8a8 projection's quantization).

    A model that torch.compile cannot handle fails here, at start-up, and runs eager (under tensor parallelism
    start-up fails instead, each rank having run part of a pass: `--compile off` then).
    """
    model = runner.model
    layers = decoder_layers(model)
    ends = [getattr(model.get_decoder(), name, None) for name in ("rotary_emb", "norm")]
    ends = [m for m in ends + [model.get_output_embeddings()] if isinstance(m, torch.nn.Module)]
    if runner.device.type == "cuda" and pdl.enabled(runner.device.index):  # inductor's kernels, as ours (engine/pdl.py)
        torch._inductor.config.triton.enable_pdl = True
    for layer in layers:
        for module in layer.modules():
            if hasattr(module, "layer_idx"):  # the attention op's argument (runner/attention.py)
                module.paged_layer = torch.tensor(module.layer_idx)
        layer.compile(backend=backend, dynamic=True)
    for module in ends:
        module.compile(backend=backend, dynamic=True)
    try:
        dry_run(runner, 2 * runner.block_size)
    except Exception:
        if runner.config.tensor_parallel_size > 1:  # the ranks could not agree on falling back: start-up fails
            raise
        log.warning("torch.compile failed for this model; running it eagerly", exc_info=True)
        uncompile(runner.model)
        return False
    log.info("compiled %d decoder layers and %d modules around them with torch.compile", len(layers), len(ends))
    return True


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's longest ModuleList: its decoder layers."""
    return max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)


def uncompile(model: torch.nn.Module) -> None:
    """Give the model back as it was loaded."""
    for module in model.modules():
        module._compiled_call_impl = None
