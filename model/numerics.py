"""Batch-invariant exp and row sums: a row's result is bitwise the same whatever rows share its array.

XLA:CPU picks its loop and vector shapes from the whole array, and its reductions and its exp round
differently with them: a row of 256 values sums to a different float in a `[4, 256]` array than in a
`[32, 256]` one, and `exp(x - max)` differs by an ulp. A seeded request would then sample another token
now and then depending on its batch mates (the inverse CDF moves by ~1e-7 at each of V boundaries). These
use only additions, multiplications and bit operations, each correctly rounded per element, in an order
fixed by the row's length alone (the approach of batch-invariant kernels, He et al. 2025, "Defeating
Nondeterminism in LLM Inference", Thinking Machines Lab).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 in two parts: n * _LN2_HI is exact
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)
_EXP_MIN, _EXP_MAX = -87.33654, 88.37626  # e^x is a normal float32 in between
LOG_MIN = 1.17549435e-38  # the smallest normal float32: the bottom of `log`'s domain


def row_sum(x: jax.Array) -> jax.Array:
    """float32 `[...]`: the sum over the last axis of `x` `[..., n]`, by pairwise halving (the first half
    plus the second; an odd element carries to the next level)."""
    while x.shape[-1] > 1:
        n, h = x.shape[-1], x.shape[-1] // 2
        y = x[..., :h] + x[..., h:2 * h]
        x = jnp.concatenate([y, x[..., 2 * h:]], axis=-1) if n % 2 else y
    return x[..., 0]


def exp(x: jax.Array) -> jax.Array:
    """float32 e^x elementwise, within 2 ulp (Cephes' expf: e^x = 2^n e^r, r = x - n ln 2, a degree-6
    polynomial for e^r). Below -87.34 it gives exactly 0 (also for -inf); above 88.38, about 2.4e38."""
    x = x.astype(jnp.float32)
    c = jnp.clip(x, _EXP_MIN, _EXP_MAX)
    n = jnp.round(c * _LOG2E)
    r = c - n * _LN2_HI
    r = r - n * _LN2_LO
    p = jnp.float32(_EXP_POLY[0])
    for coef in _EXP_POLY[1:]:
        p = p * r + coef
    p = p * (r * r) + (r + 1.0)
    scale = jax.lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)  # 2^n
    return jnp.where(x < _EXP_MIN, 0.0, p * scale)


_LOG_POLY = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
             -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)


def log(x: jax.Array) -> jax.Array:
    """float32 ln x elementwise for float32 x >= `LOG_MIN` (normal), within 2 ulp (Cephes' logf: x = m 2^e with m in
    [sqrt(1/2), sqrt(2)), a degree-8 polynomial for ln m); not for 0, denormals, inf or NaN."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    e = (bits >> 23) - 126  # x = m 2^e, m in [1/2, 1)
    m = jax.lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F000000, jnp.float32)
    small = m < 0.707106781186547524
    e = (e - small.astype(jnp.int32)).astype(jnp.float32)
    f = jnp.where(small, m + m, m) - 1.0
    z = f * f
    p = jnp.float32(_LOG_POLY[0])
    for coef in _LOG_POLY[1:]:
        p = p * f + coef
    y = p * f * z + e * _LN2_LO - 0.5 * z
    return f + y + e * _LN2_HI


def softmax(x: jax.Array) -> jax.Array:
    """float32 softmax over the last axis of `x` `[..., n]` (-inf entries get 0; each row needs a finite one)."""
    e = exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / row_sum(e)[..., None]


def silu(x: jax.Array) -> jax.Array:
    """x * sigmoid(x) elementwise with `exp` above; x's dtype."""
    xf = x.astype(jnp.float32)
    return (xf / (1.0 + exp(-xf))).astype(x.dtype)
