"""Continuous-batching generation over a paged KV cache."""

from service.engine.async_engine import AsyncEngine
from service.engine.config import DEFAULT_MODEL, EngineConfig
from service.engine.errors import EngineDeadError, EngineError, InvalidRequestError
from service.engine.llm_engine import LLMEngine, RequestOutput, StepObserver, StepStats
from service.engine.sampling import SamplingParams

__all__ = ["AsyncEngine", "DEFAULT_MODEL", "EngineConfig", "EngineDeadError", "EngineError", "InvalidRequestError",
           "LLMEngine", "RequestOutput", "SamplingParams", "StepObserver", "StepStats"]
