"""The runner (device programs), the engine loop, the offline API and the command-line apps; serving in `engine.serving`."""

from engine.config import EngineConfig
from engine.engine import Engine
from engine.llm import LLM
from engine.outputs import RequestOutput
from scheduler.request import InvalidRequestError, SamplingParams

__all__ = ["Engine", "EngineConfig", "InvalidRequestError", "LLM", "RequestOutput", "SamplingParams"]
