"""Counts XLA compilations and keeps the process within its memory-map limit.

XLA:CPU's JIT gives each kernel of a program its own code, read-only and
data mappings: a step program of the real model holds about 600 memory maps,
and Linux allows a process `vm.max_map_count` (65530 by default), so one
process holds about 100 step programs. Past that LLVM fails with "Cannot
allocate memory" and the process crashes. `release_if_near_limit` drops every
compiled program (they compile again on demand) before that happens.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

import jax
from jax import monitoring

log = logging.getLogger(__name__)

MAPS_PER_PROGRAM = 450  # measured ~370 per real-model step program (layers in one scan), rounded up
MAP_MARGIN = 0.1  # the share of the limit kept free

# Recorded once per program lowered to XLA, whether the executable then comes
# from the backend compiler or from the persistent cache.
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lock = threading.Lock()
_count = 0
_executable_dir: str | None = None  # where `engine.programs` keeps executables (set by `use_persistent_cache`)
_holders: "weakref.WeakSet" = weakref.WeakSet()  # holders of compiled programs outside JAX's caches


def _on_event(event: str, duration: float, **_) -> None:
    global _count
    if event == _LOWERING_EVENT:
        with _lock:
            _count += 1


monitoring.register_event_duration_secs_listener(_on_event)


def use_persistent_cache(path: str | None = None) -> str:
    """Keeps the engine's compiled programs (its step, Score and block programs) at `path` (default
    `$JAX_COMPILATION_CACHE_DIR`, else `~/.cache/jax-spec-engine/xla`) as serialized executables in
    `<path>/executables` (`engine.programs`), so a restarted process loads them without tracing, lowering or
    compiling; returns the folder. Call before the first compilation. The key covers the programs' settings
    and source, jax/jaxlib and the backend, so a changed model or engine compiles afresh. Loading is counted
    by `compilation_count` too.

    JAX's own persistent cache is turned off in this process: an executable it hands back, serialized again,
    loads but fails to run on XLA:CPU (jax 0.10.2: `NOT_FOUND: Function ... not found`). The few small
    programs outside the engine's (weight staging) compile on each start.
    """
    from checkpoints.resolve import cache_dir

    path = path or os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(cache_dir(), "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", False)
    global _executable_dir
    _executable_dir = os.path.join(path, "executables")
    return path


def executable_dir() -> str | None:
    """Where the engine's step programs are kept as serialized executables (`engine.programs`), or None."""
    return _executable_dir


def count_loaded() -> None:
    """A program was loaded from `executable_dir` (counted like a compilation: it is a first use)."""
    global _count
    with _lock:
        _count += 1


def hold(holder) -> None:
    """`holder.release()` drops compiled programs that `release_if_near_limit` must free too (held weakly)."""
    _holders.add(holder)


def compilation_count() -> int:
    """Programs compiled in this process so far (all jitted functions)."""
    return _count


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, `vm.max_map_count`), or None where /proc does not tell (not Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return None


def maps_left(programs: int) -> bool:
    """Whether `programs` more step programs fit under the memory-map limit (True where it is unknown)."""
    maps = memory_maps()
    return maps is None or maps[0] + programs * MAPS_PER_PROGRAM <= (1 - MAP_MARGIN) * maps[1]


def release_if_near_limit(programs: int) -> bool:
    """Drops every compiled program (`jax.clear_caches`) when fewer than `programs` more fit; True if it did.

    Called after a step that compiled, so a long-running engine that meets more shapes than a process can
    hold recompiles some later instead of crashing.
    """
    if maps_left(programs):
        return False
    used, limit = memory_maps()
    log.warning("%d of %d memory maps in use (vm.max_map_count): dropping the compiled programs, which compile "
                "again on demand; raise vm.max_map_count to keep them (BUILD.md)", used, limit)
    release_all()
    return True


def release_all() -> None:
    """Drops every compiled program: JAX's caches and the engines' (`hold`)."""
    jax.clear_caches()
    for holder in list(_holders):
        holder.release()
