"""An LLM inference service that measures itself."""

from service.notices import quiet_known_notices

__version__ = "0.1.0"

# Every process of ours imports this package first (the CLI, the engine and front-end processes, tensor-parallel
# ranks, `python -m service.bench...` scripts), so the filters for known third-party notices go on here, once,
# before anything imports torch or transformers
quiet_known_notices()
