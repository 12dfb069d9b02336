"""An LLM inference service that measures itself."""

__version__ = "0.1.0"
