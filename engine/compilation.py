"""Counts XLA compilations and enables JAX's persistent compilation cache."""

from __future__ import annotations

import os
import threading

import jax
from jax import monitoring

# Recorded once per program lowered to XLA, whether the executable then comes
# from the backend compiler or from the persistent cache.
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lock = threading.Lock()
_count = 0


def _on_event(event: str, duration: float, **_) -> None:
    global _count
    if event == _LOWERING_EVENT:
        with _lock:
            _count += 1


monitoring.register_event_duration_secs_listener(_on_event)


def compilation_count() -> int:
    """Programs compiled in this process so far (all jitted functions)."""
    return _count


def enable_persistent_cache() -> str:
    """Points JAX's persistent compilation cache at `$JAX_COMPILATION_CACHE_DIR`
    (default `~/.cache/jax-spec-engine/xla`) unless one is configured; returns the directory."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jax-spec-engine", "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path
