"""Native XLA:CPU kernels (XLA FFI custom calls), the CPU counterparts of `pallas_kernels/`.

`skinny_matmul(x, w)`: y float32 `[T, N]` = x `[T, K]` @ W `[K, N]` for small
T (decode steps, verify windows, small batches), with W packed once by
`pack(w)` into panels of 16 output columns (`PackedWeight`, layout
`[ceil(N / 16), K, 16]`, zero padded). Each call streams every panel from
memory once and keeps `rows x 16` accumulators in vector registers
(`skinny_matmul.cc`); threads split the panels. Weights may be float32,
bfloat16 (half the bytes) or int8 with a per-output-column scale (a quarter);
accumulation is float32. `skinny_matmul_reference` is the plain-jnp reference.

The library is compiled with the machine's C++ compiler on first use (a few
seconds) into the cache directory and reused while its source and jaxlib are
unchanged. When it cannot be built or loaded, or the CPU has neither
AVX-512F nor AVX2+FMA, `available()` is False, one warning is logged, and
callers keep XLA's dot.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

PANEL = 16  # output columns per panel (the kernel's vector width)
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "skinny_matmul.cc")
_TARGET = "jse_skinny_matmul"
_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "int8": np.int8}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A `[K, N]` weight in the kernel's panel layout.

    panels: `[ceil(N / 16), K, 16]` float32, bfloat16 or int8.
    scales: float32 `[ceil(N / 16) * 16]` for int8 (W ~= panels * scales per
      column), else `[0]`.
    n: N, the real number of output columns (static).
    """

    panels: jax.Array
    scales: jax.Array
    n: int = dataclasses.field(metadata={"static": True})

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes + self.scales.nbytes


def pack(w, dtype: str = "float32") -> PackedWeight:
    """Packs W `[K, N]` (any float array) into panels of `dtype` ("float32", "bfloat16" or "int8").

    int8 uses symmetric per-column scales: q = round(W / s), s = max|W[:, n]| / 127.
    Raises ValueError for another dtype or a non-2-D weight.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"packed weight dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"pack wants a [K, N] weight, got shape {w.shape}")
    K, N = w.shape
    n_pad = -(-N // PANEL) * PANEL
    w = np.pad(w, ((0, 0), (0, n_pad - N)))
    scales = np.zeros(0, np.float32)
    if dtype == "int8":
        scales = np.maximum(np.abs(w).max(axis=0), 1e-30).astype(np.float32) / 127.0
        w = np.clip(np.rint(w / scales), -127, 127)
    panels = w.reshape(K, n_pad // PANEL, PANEL).transpose(1, 0, 2)
    return PackedWeight(jnp.asarray(np.ascontiguousarray(panels).astype(_DTYPES[dtype])), jnp.asarray(scales), N)


def unpack(p: PackedWeight) -> jax.Array:
    """The float32 `[K, N]` weight a packed one stands for (dequantized for int8)."""
    panels = p.panels.astype(jnp.float32)
    w = jnp.transpose(panels, (1, 0, 2)).reshape(panels.shape[1], -1)
    if p.scales.size:
        w = w * p.scales[None, :]
    return w[:, :p.n]


def skinny_matmul_reference(x: jax.Array, p: PackedWeight) -> jax.Array:
    """float32 `[T, N]` = x @ unpack(p), by `jnp.dot` at highest precision."""
    return jnp.dot(x.astype(jnp.float32), unpack(p), precision=jax.lax.Precision.HIGHEST)


def skinny_matmul(x: jax.Array, p: PackedWeight) -> jax.Array:
    """float32 `[T, N]` = x `[T, K]` @ W through the native kernel; requires `available()`."""
    T = x.shape[0]
    scales = p.scales if p.scales.size else jnp.zeros(0, jnp.float32)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((T, p.n), jnp.float32))
    return call(x.astype(jnp.float32), p.panels, scales)


@functools.cache
def available() -> bool:
    """Builds, loads and registers the kernel library once; False (and one warning) if that fails."""
    try:
        lib = ctypes.CDLL(_build())
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("CPU kernels unavailable (%s); using XLA's dot", e)
        return False
    if lib.jse_cpu_features() == 0:
        log.warning("this CPU has neither AVX-512F nor AVX2+FMA; using XLA's dot")
        return False
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JseSkinnyMatmul), platform="cpu")
    return True


def cpu_features() -> str:
    """The instruction set the kernel runs with: "avx512", "avx2" or "none"."""
    if not available():
        return "none"
    return {2: "avx512", 1: "avx2"}[ctypes.CDLL(_build()).jse_cpu_features()]


def _build() -> str:
    """Path of the compiled library, compiling it if its source or jaxlib changed."""
    with open(_SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + jax.ffi.include_dir().encode() + jax.__version__.encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jax-spec-engine",
                         "cpu_kernels")
    path = os.path.join(cache, f"libjse_cpu_kernels-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    cxx = os.environ.get("CXX", "g++")
    cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", _SOURCE, "-o", tmp]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(tmp, path)  # atomic: a concurrent build never sees half a library
    except FileNotFoundError as e:
        raise OSError(f"no C++ compiler ({cxx})") from e
    except subprocess.CalledProcessError as e:
        raise OSError(f"{cxx} failed: {e.stderr[-500:]}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
