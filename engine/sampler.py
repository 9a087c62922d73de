"""On-device sampling with per-request settings, one program for all values.

Temperature, then top-k, top-p (Holtzman et al. 2020, §3.1) and min-p
(Nguyen et al. 2024) are applied as a threshold on the logits, and the token
is drawn by inverting the CDF with one uniform per row. Each row's
randomness comes from `fold_in(key(seed), position)`, and its exps and sums
are batch-invariant (`model.numerics`), so a seeded request's tokens do not
depend on the rest of the batch.

No full-vocabulary sort: on the CPU backend a sort of 49,152 logits costs
12 ms a row, more than a decode step. The top-k and top-p thresholds come
from the `CANDIDATES` largest logits (`lax.top_k`) whenever they lie among
them (the usual case), and otherwise from an exact bisection over the
float32 order; the inverse CDF reads a cumulative sum by blocks. Both give
the same kept set as sorting the row.

On XLA:CPU both passes (`filter_logits`, the inverse CDF in `draw`) run in
the native kernel (`cpu_kernels.filter_logits` / `draw`, the same contract,
one thread per row): as XLA they were ~60 kernels of every step program, half
of what each compiled. `xla_filter_logits` and `xla_draw` are what other
backends run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import cpu_kernels
from model import numerics

# Largest logits read to settle top-k and top-p without a sort.
CANDIDATES = 256
# Tokens per block of the two-level inverse CDF.
_BLOCK = 128


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys with the order of float32 `x` (no NaN; -0.0 is taken as 0.0)."""
    i = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    i = jnp.where(i < 0, i ^ jnp.int32(0x7FFF_FFFF), i)
    return jax.lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x8000_0000)


def _bisect_threshold(scaled: jax.Array, row_max: jax.Array, total: jax.Array, k: jax.Array,
                      top_p: jax.Array) -> jax.Array:
    """The smallest kept logit under top-k and top-p, `[S]`, by bisection on the float order.

    A token is kept when fewer than `k` tokens and less than `top_p` of the
    mass lie strictly above it: the sorted definition, without the sort.
    """
    keys = _order_keys(scaled)
    probs = numerics.exp(scaled - row_max[:, None]) / total[:, None]

    def keeps(t):  # does a token with key t survive? Monotone in t.
        above = keys > t[:, None]
        count = jnp.sum(above, axis=-1)
        mass = numerics.row_sum(jnp.where(above, probs, 0.0))
        return (count < k) & ((top_p >= 1) | (mass < top_p))

    def body(_, bounds):  # invariant: keeps(hi), not keeps(lo)
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = keeps(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    lo = jnp.min(keys, axis=-1) - 1  # keeps nothing below every token
    hi = jnp.max(keys, axis=-1)
    _, hi = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return jnp.min(jnp.where(keys >= hi[:, None], scaled, jnp.inf), axis=-1)


def _native() -> bool:
    return jax.default_backend() == "cpu" and cpu_kernels.available()


@jax.jit  # called eagerly too: its conds would otherwise compile anew on every call
def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array) -> jax.Array:
    """Scaled and truncated logits; dropped tokens get -inf.

    The kept set is the sorted definition: top-k keeps every token at least
    as large as the k-th largest; top-p keeps a token while the mass of the
    tokens ranked before it is below `top_p` (the first always stays); min-p
    keeps `p >= min_p * p_max`. Ties at a threshold are all kept.

    Args:
      logits: float32 `[S, V]`.
      temperature: float32 `[S]`, > 0 (greedy rows are handled by the caller).
      top_k: int32 `[S]`, 0 disables.
      top_p: float32 `[S]` in (0, 1], 1 disables.
      min_p: float32 `[S]` in [0, 1], 0 disables.
    Returns:
      float32 `[S, V]`; softmax of it is the distribution a token is drawn from.
    """
    if _native():
        return cpu_kernels.filter_logits(logits, temperature, top_k, top_p, min_p)
    return xla_filter_logits(logits, temperature, top_k, top_p, min_p)


@jax.jit
def xla_filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                      min_p: jax.Array) -> jax.Array:
    """`filter_logits` in XLA (any backend)."""
    S, V = logits.shape
    scaled = logits / temperature[:, None]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    row_max = jnp.max(scaled, axis=-1)
    total = numerics.row_sum(numerics.exp(scaled - row_max[:, None]))  # softmax's denominator, over e^max
    C = min(CANDIDATES, V)

    def from_candidates():
        vals = jax.lax.top_k(scaled, C)[0]  # [S, C], descending
        probs = numerics.exp(vals - row_max[:, None]) / total[:, None]
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        n_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
        pth = jnp.where(top_p < 1, jnp.take_along_axis(vals, (n_keep - 1)[:, None], axis=-1)[:, 0], -jnp.inf)
        kth = jnp.take_along_axis(vals, (jnp.minimum(k, C) - 1)[:, None], axis=-1)[:, 0]
        kth = jnp.where(k < V, kth, -jnp.inf)
        covered = ((k == V) | (k <= C)) & ((top_p >= 1) | (numerics.row_sum(probs) >= top_p))
        return jnp.maximum(kth, pth), jnp.all(covered)

    def truncated():
        threshold, covered = from_candidates()
        return jax.lax.cond(covered, lambda: threshold, lambda: _bisect_threshold(scaled, row_max, total, k, top_p))

    truncates = jnp.any((k < V) | (top_p < 1))
    threshold = jax.lax.cond(truncates, truncated, lambda: jnp.full((S,), -jnp.inf, jnp.float32))
    # min-p: p >= min_p * p_max  <=>  logit >= max + log(min_p)
    mth = jnp.where(min_p > 0, row_max + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
    threshold = jnp.maximum(threshold, mth)
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def draw(scores: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row from `softmax(scores)`, by the inverse CDF of one uniform.

    The cumulative sum runs over blocks of `_BLOCK` tokens, then inside the
    chosen block. The token returned always has a finite score: a boundary
    lands on the first token whose running sum passes the uniform, and
    rounding past the end falls back to the last token with weight.

    Args:
      scores: float32 `[S, V]`, log-weights; -inf excludes a token; each row
        has at least one finite score.
      keys: `[S]` PRNG keys, one uniform drawn from each.
    Returns:
      int32 `[S]` token ids.
    """
    u = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
    return cpu_kernels.draw(scores, u) if _native() else xla_draw(scores, u)


def xla_draw(scores: jax.Array, u: jax.Array) -> jax.Array:
    """`draw`'s inverse CDF in XLA (any backend), for float32 uniforms `u` `[S]` in [0, 1)."""
    S, V = scores.shape
    nb = -(-V // _BLOCK)
    w = numerics.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    w = jnp.pad(w, ((0, 0), (0, nb * _BLOCK - V))).reshape(S, nb, _BLOCK)

    def first_past(cum, r, weights):  # first index whose running sum exceeds r, else the last with weight
        n = cum.shape[-1]
        idx = jnp.sum(cum <= r[:, None], axis=-1)
        last = n - 1 - jnp.argmax((weights > 0)[:, ::-1], axis=-1)
        return jnp.minimum(idx, last).astype(jnp.int32)

    block_mass = numerics.row_sum(w)  # [S, nb]
    block_cum = jnp.cumsum(block_mass, axis=-1)
    r = u * block_cum[:, -1]
    b = first_past(block_cum, r, block_mass)
    rows = jnp.arange(S)
    in_block = w[rows, b]  # [S, _BLOCK]
    r_in = r - (block_cum[rows, b] - block_mass[rows, b])
    j = first_past(jnp.cumsum(in_block, axis=-1), r_in, in_block)
    return b * _BLOCK + j


def argmax(logits: jax.Array) -> jax.Array:
    """int32 `[...]`: the argmax over the last axis of float32 `logits` `[..., V]`, the lowest index among equal
    maxima. On an AVX-512 CPU the native log-softmax kernel's (`cpu_kernels.log_softmax_gather`: one threaded
    pass, 0.11 ms for 16 x 49,152 logits where XLA's reduction takes 1.2 ms), else `jnp.argmax`."""
    if jax.default_backend() == "cpu" and cpu_kernels.cpu_features() == "avx512":
        rows = logits.reshape(-1, logits.shape[-1])
        return cpu_kernels.log_softmax_gather(rows, jnp.zeros(rows.shape[0], jnp.int32))[1].reshape(logits.shape[:-1])
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


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
    greedy = argmax(logits)

    def stochastic():
        t = jnp.where(temperature > 0, temperature, 1.0)
        filtered = filter_logits(logits, t, top_k, top_p, min_p)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
        return jnp.where(temperature > 0, draw(filtered, keys), greedy)

    # Skip the filtering when every row is greedy.
    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda: greedy)
