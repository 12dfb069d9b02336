"""Continuous-batching generation over a paged KV cache.

The hand-over types, sampling parameters, errors and the configuration are imported here at once (none loads
torch); `LLMEngine` loads the model runner and torch, so it is imported on first use.
"""

from service.engine.config import DEFAULT_MODEL, EngineConfig
from service.engine.errors import EngineDeadError, EngineError, InvalidRequestError
from service.engine.results import RequestOutput, StepObserver, StepStats, Timings
from service.engine.sampling import SamplingParams

_LAZY = {"LLMEngine": "service.engine.llm_engine"}

__all__ = ["DEFAULT_MODEL", "EngineConfig", "EngineDeadError", "EngineError", "InvalidRequestError",
           "LLMEngine", "RequestOutput", "SamplingParams", "StepObserver", "StepStats", "Timings"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
