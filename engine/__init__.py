"""The runner (device programs), the engine loop, the offline API and the command-line apps; serving in `engine.serving`."""

import os

# XLA:CPU's loop emitters compile a step program ~30% faster than its MLIR fusion emitters, and it runs as fast
# (its products, attention and sampling are native kernels): BUILD.md. Read when JAX starts its backend.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()

from engine.config import EngineConfig
from engine.engine import Engine
from engine.llm import LLM
from engine.outputs import RequestOutput
from scheduler.request import InvalidRequestError, SamplingParams

__all__ = ["Engine", "EngineConfig", "InvalidRequestError", "LLM", "RequestOutput", "SamplingParams"]
