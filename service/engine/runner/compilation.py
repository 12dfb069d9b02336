"""torch.compile of the decoder layers, tried once at start-up, and its undoing.

Paged attention stays outside the compiled graphs (it is marked so), and the model's own code is untouched.
"""

import logging

import torch

from service.engine.runner.kv_cache import dry_run

log = logging.getLogger(__name__)


def compile_layers(runner) -> bool:
    """Compile each decoder layer (fusing norms, rotary embeddings, activations, residual adds).

    A model that torch.compile cannot handle fails here, at start-up, and runs eager.
    """
    layers = max((m for m in runner.model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    for layer in layers:
        layer.compile(dynamic=True)
    try:
        dry_run(runner, 2 * runner.block_size)
    except Exception:
        log.warning("torch.compile failed for this model; running it eagerly", exc_info=True)
        uncompile(runner.model)
        return False
    log.info("compiled %d decoder layers with torch.compile", len(layers))
    return True


def uncompile(model: torch.nn.Module) -> None:
    """Give the model back as it was loaded."""
    for module in model.modules():
        module._compiled_call_impl = None
