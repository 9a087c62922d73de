"""The runner (device programs), the engine loop, the offline API and the command-line apps; serving in `engine.serving`."""

import os

# XLA:CPU's loop emitters compile a step program ~30% faster than its MLIR fusion emitters, and it runs as fast
# (its products, attention and sampling are native kernels): BUILD.md. Read when JAX starts its backend.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()

__all__ = ["Engine", "EngineConfig", "InvalidRequestError", "LLM", "RequestOutput", "SamplingParams"]
_HOMES = {"Engine": "engine.engine", "EngineConfig": "engine.config", "InvalidRequestError": "scheduler.request",
          "LLM": "engine.llm", "RequestOutput": "engine.outputs", "SamplingParams": "scheduler.request"}


def __getattr__(name: str):
    # Loaded on first use: a process that needs only `engine.batch`'s formats (a Ray worker that pins its cores
    # before XLA starts) does not import jax.
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
