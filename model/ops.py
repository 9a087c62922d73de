"""The forward pass's functional pieces, shared by every family: RoPE (with Llama 3 scaling and Gemma 3's local
base), RMSNorm, soft-capping, the per-layer attention description (`LayerAttention`) and the attention function
contract (`AttendFn`), and the dense causal attention the paged kernels are tested against.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model import numerics
from model.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies, float32 `[D/2]`, with Llama-3 scaling if configured; `local`: those of
    windowed layers with base `cfg.rope_local_theta` (Gemma 3), unscaled.

    Source: Su et al. 2021 (RoFormer) §3.4; Llama-3 scaling as in Meta's
    reference `apply_scaling` (Llama 3.1 release).
    """
    D = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    s = None if local else cfg.rope_scaling
    if s is not None:
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_table(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """cos and sin of every position's RoPE angles, float32 `[max_position_embeddings, 2, D/2]`.

    The angle is the float32 product `position * inv_freq` and its cos and sin
    are rounded from float64, as a float32 libm gives them. A table rather than
    sin/cos in the step: XLA fuses them into each layer's rotation of q and of
    k and evaluates them per head there (4% of a batch job's time on CPU).
    """
    angles = np.arange(cfg.max_position_embeddings, dtype=np.float32)[:, None] * rope_inv_freq(cfg, local)[None, :]
    return np.stack([np.cos(angles.astype(np.float64)), np.sin(angles.astype(np.float64))], axis=1).astype(np.float32)


def rope_angles(positions: jax.Array, table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of `positions [T]` (int32, below the table's length) from `rope_table`, each float32
    `[T, 1, D/2]`."""
    rows = jnp.take(table, positions, axis=0, mode="clip")
    return rows[:, 0, None, :], rows[:, 1, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates `x [T, N, D]` by the angles of `rope_angles` (half-split layout, as HF Llama)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis, in float32, scaled by `offset + weight` (Gemma's
    checkpoints store w - 1: offset 1)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(numerics.row_sum(xf * xf)[..., None] / xf.shape[-1] + eps)
    return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def softcap(x: jax.Array, cap: float) -> jax.Array:
    """`cap * tanh(x / cap)` (Gemma 2's logit soft-capping), x itself for cap 0."""
    return cap * jnp.tanh(x / cap) if cap else x


class LayerAttention(NamedTuple):
    """What one layer's attention needs beside q, k and v: its sliding window W (int, or int32 `[]` inside a
    scan over layers; a token at position p sees p-W+1..p; 0 = global), the score scale (`sm_scale`) and the
    scores' soft-cap (0 = none)."""

    window: int | jax.Array
    sm_scale: float
    softcap: float


# attend(q [T,H,D], k [T,K,D], v [T,K,D], layer, cache, LayerAttention) -> (out [T,H,D], cache)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, object, LayerAttention], tuple[jax.Array, object]]


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, segments: jax.Array,
                    spec: LayerAttention | None = None) -> jax.Array:
    """Causal attention over `[T, *, D]` tokens, masked to the same segment and to `spec`'s sliding window,
    scores scaled and soft-capped as `spec` says (default: 1/sqrt(D), global, no cap)."""
    T, H, D = q.shape
    G = H // k.shape[1]
    spec = spec or LayerAttention(0, 1.0 / math.sqrt(D), 0.0)
    qg = q.reshape(T, k.shape[1], G, D).astype(jnp.float32)
    s = softcap(jnp.einsum("tkgd,ukd->kgtu", qg, k.astype(jnp.float32)) * spec.sm_scale, spec.softcap)
    mask = (segments[:, None] == segments[None, :]) & (positions[None, :] <= positions[:, None])
    mask &= (spec.window <= 0) | (positions[:, None] - positions[None, :] < spec.window)
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("kgtu,ukd->tkgd", p, v.astype(jnp.float32)).reshape(T, H, D).astype(q.dtype)
