"""A model's weights kept in the native CPU kernels' layouts (`cpu_kernels`): stored beside the module's own
arrays, looked up by name, and multiplied on the kernel of their layout."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

import cpu_kernels


def keep_packed(owner, name: str, w: np.ndarray, dtype: str, amx_passes: int | None, source: str | None = None,
                transposed: bool = False, isa: str = "") -> int:
    """Stores `owner`'s weight `name` (`w` `[K, N]`) in AMX tiles with `amx_passes` (`{name}_amx_hi`,
    `{name}_amx_lo`), else in the skinny kernel's panels (`{name}_panels`, `{name}_scales`); returns their bytes.

    `source`: the variable of `owner` that XLA's dot reads for products the skinny kernel does not take (`w`,
    or `w.T` when `transposed`). Panels narrower than float32 overwrite it with their own values
    (`cpu_kernels.unpack`), so a step's logits do not jump between the two products with its token count.
    """
    if amx_passes is None:
        p = cpu_kernels.pack(w, dtype, isa)
        setattr(owner, f"{name}_isa", isa)  # static: which of the skinny kernel's paths runs it
        setattr(owner, f"{name}_format", p.format)  # static: panels, or exact GGUF blocks
        setattr(owner, f"{name}_panels", nnx.Variable(p.panels))
        setattr(owner, f"{name}_scales", nnx.Variable(p.scales))
        if source is not None and dtype != "float32":
            var = getattr(owner, source)
            values = cpu_kernels.unpack(p)
            var[...] = (values.T if transposed else values).astype(var[...].dtype)
        return p.nbytes
    a = cpu_kernels.pack_amx(w, amx_passes)
    setattr(owner, f"{name}_amx_hi", nnx.Variable(a.hi))
    setattr(owner, f"{name}_amx_lo", nnx.Variable(a.lo))
    return a.nbytes


def packed_weight(owner, name: str, n: int) -> cpu_kernels.AmxWeight | cpu_kernels.PackedWeight | None:
    """`owner`'s weight `name` as `keep_packed` stored it (`n` output columns), or None where it did not."""
    if hasattr(owner, f"{name}_amx_hi"):
        return cpu_kernels.AmxWeight(getattr(owner, f"{name}_amx_hi")[...], getattr(owner, f"{name}_amx_lo")[...], n)
    if hasattr(owner, f"{name}_panels"):
        return cpu_kernels.PackedWeight(getattr(owner, f"{name}_panels")[...], getattr(owner, f"{name}_scales")[...], n,
                                        getattr(owner, f"{name}_isa"), getattr(owner, f"{name}_format"))
    return None


def packed_product(x: jax.Array, weight: cpu_kernels.AmxWeight | cpu_kernels.PackedWeight) -> jax.Array:
    """float32 x `[T, in]` @ a `packed_weight` on the kernel of its layout: AMX tiles or the skinny panels."""
    if isinstance(weight, cpu_kernels.AmxWeight):
        return cpu_kernels.amx_matmul(x, weight)
    return cpu_kernels.skinny_matmul(x, weight)
