"""Counts XLA compilations."""

from __future__ import annotations

import threading

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
