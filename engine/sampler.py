"""On-device sampling with per-request settings, one program for all values.

Temperature, then top-k, top-p (Holtzman et al. 2020, §3.1) and min-p
(Nguyen et al. 2024) are applied as masks on the logits, and the token is
drawn by the Gumbel-max trick. Each row's randomness comes from
`fold_in(key(seed), position)`, so a seeded request's tokens do not depend
on the rest of the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array) -> jax.Array:
    """Scaled and truncated logits; dropped tokens get -inf.

    Args:
      logits: float32 `[S, V]`.
      temperature: float32 `[S]`, > 0 (greedy rows are handled by the caller).
      top_k: int32 `[S]`, 0 disables.
      top_p: float32 `[S]` in (0, 1], 1 disables.
      min_p: float32 `[S]` in [0, 1], 0 disables.
    Returns:
      float32 `[S, V]`; softmax of it is the distribution a token is drawn from.
    """
    V = logits.shape[-1]
    scaled = logits / temperature[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [S, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [S, 1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep a sorted token while the mass before it is below top_p (the first always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    # min-p: p >= min_p * p_max  <=>  logit >= max + log(min_p)
    mth = sorted_desc[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    mth = jnp.where(min_p[:, None] > 0, mth, -jnp.inf)
    threshold = jnp.maximum(jnp.maximum(kth, pth), mth)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           min_p: jax.Array, seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """Draws one token per row.

    Args:
      logits: float32 `[S, V]`.
      temperature, top_k, top_p, min_p: `[S]` as in `filter_logits`; rows with
        temperature 0 take the argmax.
      seeds: uint32 `[S]`.
      positions: int32 `[S]`, the position of the token being drawn.
    Returns:
      int32 `[S]` token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic():
        t = jnp.where(temperature > 0, temperature, 1.0)
        filtered = filter_logits(logits, t, top_k, top_p, min_p)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:], jnp.float32))(keys)
        drawn = jnp.argmax(filtered + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    # Skip the sort when every row is greedy.
    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda: greedy)
