"""Plain-jnp reference of ragged paged attention.

The same contract as the Pallas kernel: a flattened batch of query tokens
grouped by sequence, each sequence reading its KV through its row of the block
table. It never materialises a sequence's whole context at once: it walks the
context in chunks of blocks with an online softmax (Milakov & Gimelshein 2018;
Dao et al. 2022, FlashAttention §3.1), for as many chunks as the longest
sequence needs (a dynamic trip count, so no context-length bucket is needed).
The step's own tokens are handled apart, as one dense block, so a fresh
prefill costs one [T, T] product instead of T gathers of its context.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def token_layout(query_start_loc: jax.Array, seq_lens: jax.Array, num_tokens: int):
    """Per-token sequence index, absolute position and validity.

    Args:
      query_start_loc: int32 `[S+1]`, cumulative query lengths; padded
        sequences repeat the last value (query length 0).
      seq_lens: int32 `[S]`, KV length of each sequence including this step's tokens.
      num_tokens: static `T`.
    Returns:
      (seq_ids int32 `[T]`, positions int32 `[T]`, valid bool `[T]`).
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    S = seq_lens.shape[0]
    seq_ids = jnp.clip(jnp.searchsorted(query_start_loc[1:], t, side="right"), 0, S - 1).astype(jnp.int32)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    positions = seq_lens[seq_ids] - q_lens[seq_ids] + (t - query_start_loc[seq_ids])
    valid = t < query_start_loc[S]
    return seq_ids, positions, valid


def _softcap(s: jax.Array, cap: float) -> jax.Array:
    return cap * jnp.tanh(s / cap) if cap else s


TREE_WINDOW = 32  # step tokens of a sequence that a tree mask covers (one int32 word)


def tree_visible(tree_mask: jax.Array, index: jax.Array) -> jax.Array:
    """Whether a query token with bitmask `tree_mask` may see its sequence's step token number `index`.

    The rule every attention kernel applies on top of causality: bit `index`
    of the mask for `index < 32`; step tokens from the 33rd on are not gated
    (a tree window holds at most 32 tokens; longer runs are prefill chunks).
    A chain is the causal case (`causal_tree_mask`). Broadcasting int32 arrays;
    returns bool.
    """
    bit = jnp.right_shift(tree_mask, jnp.clip(index, 0, TREE_WINDOW - 1)) & 1
    return (index >= TREE_WINDOW) | (bit == 1)


def causal_tree_mask(index: jax.Array) -> jax.Array:
    """int32 mask of the step token number `index` that sees exactly the causal ones (0..index)."""
    index = jnp.asarray(index, jnp.int32)
    ones = jnp.left_shift(jnp.int32(1), jnp.clip(index + 1, 0, TREE_WINDOW - 1)) - 1
    return jnp.where(index >= TREE_WINDOW - 1, jnp.int32(-1), ones)


def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    layer: jax.Array,
    *,
    sm_scale: float | None = None,
    softcap: float = 0.0,
    sliding_window: int | jax.Array = 0,
    tree_mask: jax.Array | None = None,
) -> jax.Array:
    """Causal (or token-tree) attention of ragged query tokens over a paged KV pool.

    Query token `i` of sequence `s` (with query length `n_s` and KV length
    `seq_lens[s]`) sits at position `seq_lens[s] - n_s + i` and attends to KV
    positions `0..` that position: the cached prefix plus its own earlier
    tokens. Serves decode (n_s = 1), chunked prefill and verify windows alike.
    With `tree_mask`, a verify window is a token tree (SpecInfer, Miao et al.
    2024, §4.2 "tree-based parallel decoding"): its tokens still see the whole
    cached prefix, but of the step's own tokens only those `tree_visible` allows.
    With a sliding window W (Mistral, Gemma 2/3; Beltagy et al. 2020, Longformer
    §3.1), the token at position p sees positions p-W+1..p only.

    Args:
      q: `[T, H, D]` queries (float32 or bfloat16).
      k_pages, v_pages: `[L, P, B, K, D]` the KV pool; `H % K == 0` (GQA).
      block_tables: int32 `[S, max_blocks]`, block ids of each sequence's KV in order.
      seq_lens: int32 `[S]`, KV length per sequence (0 for padded sequences).
      query_start_loc: int32 `[S+1]`, cumulative query lengths; tokens at or past
        `query_start_loc[S]` are padding and get zeros.
      layer: int32 scalar, the layer to read (the pool is not sliced, so no
        layer-sized copy is made).
      sm_scale: softmax scale, default `1/sqrt(D)`.
      softcap: scores become `softcap * tanh(scores / softcap)` after scaling
        (Gemma 2); 0 = none.
      sliding_window: int or int32 scalar W, 0 = global attention.
      tree_mask: optional int32 `[T]`, per query token a bitmask over its
        sequence's first 32 step tokens (see `tree_visible`); None = causal.
    Returns:
      `[T, H, D]` in `q.dtype`; accumulation and softmax are float32. A token
      that sees no position at all gets zeros.
    """
    T, H, D = q.shape
    _, _, B, K, _ = k_pages.shape
    G = H // K
    S, max_blocks = block_tables.shape
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    # Blocks per loop step: up to 64 tokens for decode, fewer for wide prefill,
    # so the per-step gather [T, chunk*B, K, D] stays bounded.
    chunk = max(1, min(max_blocks, min(64, 65536 // T) // B))
    chunk = 1 << (chunk.bit_length() - 1)
    n_cols = -(-max_blocks // chunk) * chunk
    tables = jnp.pad(block_tables, ((0, 0), (0, n_cols - max_blocks)))

    seq_ids, positions, valid = token_layout(query_start_loc, seq_lens, T)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    qf = q.reshape(T, K, G, D).astype(jnp.float32) * scale

    # (1) The step's own tokens, as one dense [T, T] block: each token sees the
    # earlier tokens of its sequence in this step. Their KV is read back from
    # the pool at the slots the block table gives. Heads lead, so the two
    # products need no transposes; the mask is an additive [T, T] bias.
    slots = block_tables[seq_ids, positions // B] * B + positions % B
    k_new = k_pages[layer].reshape(-1, K, D)[slots].astype(jnp.float32)  # [T, K, D]
    v_new = v_pages[layer].reshape(-1, K, D)[slots].astype(jnp.float32)
    qh = qf.transpose(1, 2, 0, 3)  # [K, G, T, D]
    s = _softcap(jnp.einsum("kgtd,ukd->kgtu", qh, k_new), softcap)
    mask = (seq_ids[:, None] == seq_ids[None, :]) & (positions[None, :] <= positions[:, None])
    mask &= valid[:, None] & valid[None, :]
    mask &= (sliding_window <= 0) | (positions[:, None] - positions[None, :] < sliding_window)
    if tree_mask is not None:
        index = jnp.arange(T, dtype=jnp.int32) - query_start_loc[seq_ids]  # each token's index in its window
        mask &= tree_visible(tree_mask[:, None], index[None, :])
    s = s + jnp.where(mask, 0.0, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    acc = jnp.einsum("kgtu,ukd->kgtd", p, v_new)
    init = (m.transpose(2, 0, 1), jnp.sum(p, axis=-1).transpose(2, 0, 1), acc.transpose(2, 0, 1, 3))

    # (2) The cached context before the step, walked chunk by chunk through the
    # block table with an online softmax.
    ctx_len = jnp.where(valid, seq_lens[seq_ids] - q_lens[seq_ids], 0)  # [T]
    # The first context position each token sees (its window's start), and the first chunk any token needs.
    ctx_start = jnp.where(sliding_window > 0, jnp.maximum(positions - sliding_window + 1, 0), 0)
    needed = valid & (ctx_start < ctx_len)
    first_chunk = jnp.min(jnp.where(needed, ctx_start, jnp.iinfo(jnp.int32).max)) // (chunk * B)
    num_chunks = (jnp.max(ctx_len) + chunk * B - 1) // (chunk * B)

    def body(c, state):
        m, l, acc = state
        cols = jax.lax.dynamic_slice_in_dim(tables, c * chunk, chunk, axis=1)  # [S, chunk]
        blocks = cols[seq_ids]  # [T, chunk]
        k = k_pages[layer, blocks].reshape(T, chunk * B, K, D).astype(jnp.float32)
        v = v_pages[layer, blocks].reshape(T, chunk * B, K, D).astype(jnp.float32)
        # Broadcast-multiply-reduce on the gathered layout [T, C, K, G]: XLA:CPU
        # fuses it, unlike T tiny batched dots, and nothing is transposed.
        s = _softcap(jnp.sum(qf[:, None] * k[:, :, :, None, :], axis=-1), softcap)  # [T, C, K, G]
        kv_pos = c * chunk * B + jnp.arange(chunk * B)
        seen = (kv_pos[None, :] < ctx_len[:, None]) & (kv_pos[None, :] >= ctx_start[:, None])
        s = s + jnp.where(seen, 0.0, -jnp.inf)[:, :, None, None]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[:, None])
        correction = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        l = l * correction + jnp.sum(p, axis=1)
        acc = acc * correction[..., None] + jnp.sum(p[..., None] * v[:, :, :, None, :], axis=1)
        return m_new, l, acc

    _, l, acc = jax.lax.fori_loop(jnp.minimum(first_chunk, num_chunks), num_chunks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(T, H, D).astype(q.dtype)
