"""Device programs, the engine loop and the user-facing APIs."""

from engine.engine import Engine, EngineConfig, RequestOutput
from engine.llm import LLM
from scheduler.request import InvalidRequestError, SamplingParams

__all__ = ["Engine", "EngineConfig", "InvalidRequestError", "LLM", "RequestOutput", "SamplingParams"]
