"""Device programs, the engine loop and the user-facing APIs."""

from engine.engine import Engine, EngineConfig, RequestOutput
try:
    from engine.llm import LLM
except ImportError:  # TEMP
    LLM = None
from scheduler.request import InvalidRequestError, SamplingParams

__all__ = ["Engine", "EngineConfig", "InvalidRequestError", "LLM", "RequestOutput", "SamplingParams"]
