"""Compiled step programs, kept across restarts as serialized executables.

JAX's persistent compilation cache saves the backend compiler's work, but a
restarted process still traces and lowers every program to find its key:
on the real model that is ~90% of a warm start (118 programs, ~0.2 s of
Python each, one at a time under the GIL). `Programs` keys a program by what
determines it without tracing it — the engine's and the model's settings, the
abstract arguments, jax and the backend, this package's source — and keeps
its executable (`jax.experimental.serialize_executable`) in
`<compilation cache>/executables`, so a restart loads it in milliseconds.
The running engine calls the compiled executables directly too, so the first
step of each shape after warm-up does not trace again either.

Only processes that call `engine.compilation.use_persistent_cache` (the
server, the batch job) keep executables on disk; others keep them in memory.
An executable that JAX's own persistent cache handed back is never written:
on XLA:CPU (jax 0.10.2) such an executable, serialized again, loads but then
fails to run (`NOT_FOUND: Function ... not found`); `use_persistent_cache`
turns JAX's cache off for that reason.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import sys
import threading
from typing import Any, Callable

import jax
import jaxlib
from jax import monitoring
from jax.experimental import serialize_executable

from engine import compilation

log = logging.getLogger(__name__)

# The packages whose code is traced into programs (a change to any of them is a new program).
_PACKAGES = ("engine", "model", "pallas_kernels", "scheduler", "cpu_kernels", "checkpoints")
_from_jax_cache = threading.local()  # set when JAX's persistent cache served this thread's last compilation


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _from_jax_cache.hit = True


monitoring.register_event_listener(_on_event)


@functools.cache
def _environment() -> str:
    """jax, the backend, the CPU's features (XLA:CPU compiles for the host), XLA's flags and the source."""
    h = hashlib.sha256()
    devices = jax.devices()
    for part in (jax.__version__, jaxlib.__version__, jax.default_backend(), devices[0].device_kind, str(len(devices)),
                 os.environ.get("XLA_FLAGS", ""), _cpu_flags()):
        h.update(part.encode() + b"\0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for package in _PACKAGES:
        for folder, dirs, files in sorted(os.walk(os.path.join(root, package))):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".py", ".so", ".cc", ".h")):
                    with open(os.path.join(folder, name), "rb") as f:
                        h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return sys.platform


def _abstract(tree: Any) -> str:
    """The structure, shapes, dtypes and placements of a pytree of arrays."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        parts.append(f"{getattr(x, 'shape', ())}/{getattr(x, 'dtype', type(x).__name__)}/{sharding}")
    return "|".join(parts)


class Programs:
    """Compiled programs by key, from memory, from the executable folder, or compiled (and saved there).

    Args:
      settings: everything a program depends on that its arguments do not show (the model's config and
        graph, the engine's config, the proposer's settings, the attention kernel): its repr is hashed
        into every key.
    """

    def __init__(self, settings: Any):
        self._compiled: dict[Any, Any] = {}
        self.num_loaded = self.num_compiled = 0  # programs this engine loaded from disk / compiled
        compilation.hold(self)
        h = hashlib.sha256(repr(settings).encode())
        h.update(_environment().encode())
        self._fingerprint = h.hexdigest()

    def get(self, key: Any, fn: Callable, args: tuple):
        """The compiled `fn` for `args` (a `jax.stages.Compiled`); `key` names the program among this engine's
        (a program kind and shape: the same key must always mean the same `fn` and argument shapes)."""
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._load_or_compile(key, fn, args)
        return compiled

    def release(self) -> None:
        """Drops the compiled programs (they load or compile again on next use)."""
        self._compiled.clear()

    def _load_or_compile(self, key: Any, fn: Callable, args: tuple):
        folder = compilation.executable_dir()
        path = None
        if folder is not None:
            name = hashlib.sha256(f"{self._fingerprint}|{key!r}|{_abstract(args)}".encode()).hexdigest()
            path = os.path.join(folder, name[:40] + ".bin")
            try:
                with open(path, "rb") as f:
                    payload, in_tree, out_tree = pickle.load(f)
                compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
                compilation.count_loaded()
                self.num_loaded += 1
                return compiled
            except FileNotFoundError:
                pass
            except Exception as e:  # a torn or foreign file: compile afresh and replace it
                log.warning("executable %s did not load (%s): compiling it", path, e)
        _from_jax_cache.hit = False
        compiled = fn.lower(*args).compile()
        self.num_compiled += 1
        if path is not None and not _from_jax_cache.hit:
            try:
                os.makedirs(folder, exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    pickle.dump(serialize_executable.serialize(compiled), f)
                os.replace(tmp, path)  # whole or absent: another process may read it at once
            except Exception as e:
                log.warning("executable %s not saved (%s)", path, e)
        return compiled
