"""Ragged paged attention as one Pallas kernel (Triton on GPU, interpret on CPU).

Same contract as `pallas_kernels.reference.ragged_paged_attention_reference`:
a flattened ragged batch of query tokens grouped by sequence (decode tokens,
chunked-prefill chunks and speculative verify windows alike), each sequence
reading its KV through its row of the block table, causal relative to its own
KV length, grouped-query attention.

Design
------
* **Query tiles.** The wrapper (plain jnp, inside the caller's jit) cuts every
  sequence's query tokens into tiles of `BQ` consecutive tokens and builds a
  static-length map `tile -> (sequence, first query token)` with
  `NT = min(T // BQ + S, T)` entries, a bound on `sum_s ceil(q_len_s / BQ)`.
  Unused tiles get `n_valid = 0`: their KV loop runs zero times and they write
  zeros that nobody reads.
* **Grid** `(NT, K)`: one program per (query tile, KV head). The program holds
  all `G` query heads of that KV head (GQA), so each K/V block is loaded once
  for the whole group. Rows are token-major: row `r` is token `r // Gp`, head
  `r % Gp` of the tile.
* **Triton shape rules** (kept in interpret mode too): `G` is padded to the
  next power of two `Gp` (zero query heads, sliced off afterwards) and `BQ` is a
  power of two with `BQ * Gp >= 16`, so the query tile `[R = BQ*Gp, D]` is a
  power of two >= 16 rows. The KV step is `BK = nblk * B` tokens with
  `nblk = max(1, kv_step // B)` (power of two, `kv_step >= 16`): with block size
  8 every step loads **two** pool blocks at once through a vector gather of two
  block-table entries (`k_ref[layer, blocks[nblk], :, h, :]`), so no dot has a
  dimension below 16. `D` must be a power of two; for `D < 16` (tiny test
  models) the two products are broadcast-multiply-reduce in float32 instead
  of `tl.dot`, which has no minimum size.
* **KV loop.** `fori_loop` over the sequence's block-table columns up to the
  causal limit of the tile's last valid token (`cdiv(pos0 + n_valid, BK)`
  steps), online softmax in float32 (FlashAttention-2: running max `m`, sum
  `l`, unnormalised accumulator, one division at the end). K/V are read straight
  from the `[L, P, B, K, D]` pool (the whole pool is the kernel operand; the
  layer is a runtime scalar, so all layers share one compiled kernel and no
  layer slice is copied). Masking uses a finite mask value plus an explicit
  `where(mask, p, 0)`, so fully masked rows never produce NaN; V rows past the
  limit are zeroed so stale non-finite pool contents cannot leak.
* **Output** is written per tile (`[NT, K, R, D]`, no two programs write the same
  rows, so no masked stores are needed) and gathered back to `[T, H, D]`;
  padding tokens (`t >= query_start_loc[S]`) get zeros.
* bf16 K/V: bf16 dots with float32 accumulation (`p` is cast to bf16 for the
  `p @ V` product); float32 K/V: float32 dots with tf32 disabled.

Limitations
-----------
* No split-KV ("flash-decoding") partitioning: parallelism is `NT * K`
  programs, so one long decode sequence uses only `K` programs on GPU.
* `BQ` is static per (T, S) bucket; in a mixed batch every decode token still
  occupies a full `BQ`-token tile (wasted rows, not extra KV traffic).
* CI checks the GPU path only as far as lowering (the Triton module is built
  and verified on CPU). It was compiled and run once on an H200 (jax 0.11.2,
  2026-12-04): equal to the reference on random trees, causal and tree
  windows timed (`benchmarks/tree_attention_check.py`, `benchmarks/RESULTS.md`).
* Interpret mode on CPU with a bf16 pool: XLA:CPU keeps the interpreted grid
  loop's pool operands in float32 and converts the whole `[L, P, B, K, D]` pool
  once per call, so CPU cost grows with the pool size (float32 pools do not).

Token-tree masks (Medusa / EAGLE)
--------------------------------
With `tree_mask` (int32 `[T]`, per query token a bitmask over the first 32
step tokens of its sequence; `reference.tree_visible` is the rule) the
wrapper gathers each row's mask into a per-tile `[NT, R]` operand beside the
query tile and passes each tile's window start (`seq_len - q_len`). Inside the
kernel the causal test is AND-ed with the tree test for KV positions in the
window; the tile map, grid and KV loop do not change (the causal limit stays an
upper bound of what a tree token can see). Without it the kernel is the causal
one, operand for operand.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.reference import TREE_WINDOW

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

__all__ = ["ragged_paged_attention", "tile_layout", "choose_block_q"]


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def choose_block_q(num_tokens: int, num_seqs: int, group: int, max_rows: int = 64) -> int:
    """Query tokens per tile: a power of two, `>= 16 / Gp` (16 rows minimum).

    The static average query length `T // S` is the proxy: decode-sized buckets
    get the smallest tile, prefill-sized ones up to `max_rows` rows.
    """
    gp = _next_pow2(group)
    lo = max(1, 16 // gp)
    hi = max(lo, max_rows // gp)
    avg = _next_pow2(max(1, num_tokens // max(1, num_seqs)))
    return int(min(max(avg, lo), hi))


def tile_layout(query_start_loc: jax.Array, seq_lens: jax.Array, block_q: int, num_tokens: int):
    """Static-size map of query tiles (jnp, traceable).

    Returns (tile_seq, tile_first, tile_pos0, tile_nq), each int32 `[NT]` with
    `NT = min(T // BQ + S, T)`: the sequence of each tile, its first query
    token (index into the flattened batch), the KV position of that token, and
    the number of valid query tokens in the tile (0 for unused tiles).
    """
    S = seq_lens.shape[0]
    NT = max(1, min(num_tokens // block_q + S, num_tokens))
    qsl = query_start_loc.astype(jnp.int32)
    q_lens = qsl[1:] - qsl[:-1]
    n_tiles = (q_lens + block_q - 1) // block_q
    cum = jnp.cumsum(n_tiles).astype(jnp.int32)
    first_tile = cum - n_tiles
    j = jnp.arange(NT, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cum, j, side="right"), 0, S - 1).astype(jnp.int32)
    i0 = (j - first_tile[seq]) * block_q
    used = j < cum[-1]
    nq = jnp.where(used, jnp.clip(q_lens[seq] - i0, 0, block_q), 0).astype(jnp.int32)
    pos0 = (seq_lens.astype(jnp.int32)[seq] - q_lens[seq] + i0).astype(jnp.int32)
    first = (qsl[seq] + i0).astype(jnp.int32)
    return seq, first, pos0, nq


def _kernel(layer_ref, sliding_ref, tile_seq_ref, tile_pos0_ref, tile_nq_ref, bt_ref, q_ref, k_ref, v_ref, *rest,
            scale: float, softcap: float, gp: int, block_size: int, nblk: int, precision):
    tree = len(rest) == 3  # (window start per tile, tree mask per row, out) or (out,)
    o_ref = rest[-1]
    j = pl.program_id(0)
    h = pl.program_id(1)
    R, D = q_ref.shape
    BK = nblk * block_size
    layer = layer_ref[0]
    small_d = D < 16
    s_idx = tile_seq_ref[j]
    pos0 = tile_pos0_ref[j]
    nq = tile_nq_ref[j]
    # KV tokens visible to the tile's last valid token (0 for an unused tile).
    limit = jnp.where(nq > 0, pos0 + nq, 0)
    n_steps = (limit + BK - 1) // BK
    # With a sliding window W, the first KV position the tile's first token sees, and the step holding it.
    sliding = sliding_ref[0]
    first_step = jnp.where(sliding > 0, jnp.maximum(pos0 - sliding + 1, 0), 0) // BK

    q = q_ref[...]  # [R, D]
    row_pos = pos0 + lax.broadcasted_iota(jnp.int32, (R,), 0) // gp  # [R]
    if tree:
        window = rest[0][j]  # KV position of the sequence's first step token
        row_bits = rest[1][...]  # [R]

    def load(ref, c):
        if nblk == 1:
            blk = bt_ref[s_idx, c]
            x = ref[layer, blk, :, h, :]  # [B, D]
        else:
            blocks = bt_ref[s_idx, pl.ds(c * nblk, nblk)]  # [nblk]
            x = ref[layer, blocks, :, h, :].reshape(BK, D)  # [nblk*B, D]
        return x

    def body(c, carry):
        m, l, acc = carry
        k = load(k_ref, c)
        if small_d:  # D < 16: no tl.dot; broadcast-multiply-reduce in float32
            s = jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=2) * scale
        else:
            s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [R, BK] f32
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        kv_pos = c * BK + lax.broadcasted_iota(jnp.int32, (BK,), 0)
        mask = kv_pos[None, :] <= row_pos[:, None]
        mask &= (sliding <= 0) | (row_pos[:, None] - kv_pos[None, :] < sliding)
        if tree:  # reference.tree_visible, for KV positions in the window
            rel = kv_pos - window
            bit = jnp.right_shift(row_bits[:, None], jnp.clip(rel, 0, TREE_WINDOW - 1)[None, :]) & 1
            mask &= ((rel < 0) | (rel >= TREE_WINDOW))[None, :] | (bit == 1)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        l_new = l * alpha + jnp.sum(p, axis=1)
        v = load(v_ref, c)
        v = jnp.where((kv_pos < limit)[:, None], v, jnp.zeros_like(v))
        if small_d:
            pv = jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)
        else:
            pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)
        acc_new = acc * alpha[:, None] + pv
        return m_new, l_new, acc_new

    m0 = jnp.full((R,), MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((R,), jnp.float32)
    acc0 = jnp.zeros((R, D), jnp.float32)
    _, l, acc = lax.fori_loop(jnp.minimum(first_step, n_steps), n_steps, body, (m0, l0, acc0))
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    o_ref[...] = out.astype(o_ref.dtype)


def _use_interpret(backend: str | None) -> bool:
    backend = backend or jax.default_backend()
    return backend not in ("gpu", "cuda", "rocm")


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    layer,
    *,
    sm_scale: float | None = None,
    softcap: float = 0.0,
    sliding_window: int | jax.Array = 0,
    block_q: int | None = None,
    kv_step: int = 32,
    backend: str | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    tree_mask: jax.Array | None = None,
) -> jax.Array:
    """Causal (or token-tree) ragged paged attention (Pallas); semantics of the jnp reference.

    Args:
      q: `[T, H, D]` queries (float32 or bfloat16); `D` a power of two.
      k_pages, v_pages: `[L, P, B, K, D]` KV pool, `H % K == 0`; `B` a power of two.
      block_tables: int32 `[S, max_blocks]`.
      seq_lens: int32 `[S]`, KV length per sequence including this step's tokens.
      query_start_loc: int32 `[S+1]` cumulative query lengths (padded sequences
        have query length 0; tokens at or past `query_start_loc[S]` get zeros).
      layer: layer index, Python int or int32 scalar (passed to the kernel as data).
      sm_scale: softmax scale, default `1/sqrt(D)`.
      softcap: scores -> `softcap * tanh(scores / softcap)` (Gemma 2); 0 = none.
      sliding_window: int or int32 scalar W (a token at p sees p-W+1..p); 0 = global.
      block_q: query tokens per tile (power of two); default `choose_block_q`.
      kv_step: KV tokens per inner-loop step (power of two >= 16); rounded up to
        the block size, i.e. `max(1, kv_step // B)` blocks per step.
      backend: None = `jax.default_backend()`; "gpu"/"cuda"/"rocm" lower through
        Triton (pinned with `plgpu.CompilerParams`), anything else runs the
        same kernel in Pallas interpret mode. Pass "cuda" to lower the GPU path
        on a CPU-only machine (`.lower(lowering_platforms=("cuda",))`).
      num_warps, num_stages: Triton compiler parameters.
      tree_mask: optional int32 `[T]` token-tree masks (`reference.tree_visible`); None = causal.
    Returns:
      `[T, H, D]` in `q.dtype`.
    """
    T, H, D = q.shape
    L, P, B, K, Dk = k_pages.shape
    S, max_blocks = block_tables.shape
    if H % K or Dk != D or v_pages.shape != k_pages.shape:
        raise ValueError(f"bad shapes q={q.shape} k={k_pages.shape} v={v_pages.shape}")
    if D & (D - 1) or B & (B - 1):
        raise ValueError(f"head dim ({D}) and block size ({B}) must be powers of two")
    G = H // K
    Gp = _next_pow2(G)
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(D)
    BQ = block_q or choose_block_q(T, S, G)
    if BQ & (BQ - 1) or BQ * Gp < 16:
        raise ValueError(f"block_q={BQ} must be a power of two with block_q * {Gp} >= 16")
    R = BQ * Gp
    nblk = max(1, _next_pow2(kv_step) // B)

    seq_lens = seq_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    tile_seq, tile_first, tile_pos0, tile_nq = tile_layout(query_start_loc, seq_lens, BQ, T)
    NT = tile_seq.shape[0]

    # Block table: pad columns to a multiple of nblk, clamp ids into the pool
    # (entries past a sequence's length are never unmasked but are still read).
    n_cols = -(-max_blocks // nblk) * nblk
    bt = jnp.clip(jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, n_cols - max_blocks))), 0, P - 1)

    # Query tiles [NT, K, BQ*Gp, D] (a gather of q only; KV is never copied).
    qg = q.reshape(T, K, G, D)
    if Gp != G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    tok = jnp.clip(tile_first[:, None] + jnp.arange(BQ, dtype=jnp.int32)[None, :], 0, T - 1)  # [NT, BQ]
    q_tiles = qg[tok].transpose(0, 2, 1, 3, 4).reshape(NT, K, R, D)

    interpret = _use_interpret(backend)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, scale=scale, softcap=float(softcap), gp=Gp, block_size=B, nblk=nblk, precision=precision)
    whole = pl.BlockSpec()  # no block shape: the kernel sees the whole array (pointer + strides on Triton)
    tile_spec = pl.BlockSpec((None, None, R, D), lambda j, h: (j, h, 0, 0))
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(sliding_window, jnp.int32).reshape(1), tile_seq, tile_pos0, tile_nq, bt, q_tiles, k_pages, v_pages]
    in_specs = [whole, whole, whole, whole, whole, whole, tile_spec, whole, whole]
    if tree_mask is not None:
        window = tile_pos0 - (tile_first - query_start_loc[tile_seq])
        bits = jnp.repeat(tree_mask.astype(jnp.int32)[tok], Gp, axis=1)  # [NT, R], rows token-major
        operands += [window, bits]
        in_specs += [whole, pl.BlockSpec((None, R), lambda j, h: (j, 0))]
    out_tiles = pl.pallas_call(
        kernel,
        grid=(NT, K),
        in_specs=in_specs,
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct((NT, K, R, D), q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="ragged_paged_attention",
    )(*operands)

    # Back to [T, H, D]: token t is row (t - first token of its sequence) of its sequence's tiles.
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(query_start_loc[1:], t, side="right"), 0, S - 1)
    i = t - query_start_loc[seq]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    first_tile = jnp.cumsum((q_lens + BQ - 1) // BQ) - (q_lens + BQ - 1) // BQ
    tile = jnp.clip(first_tile[seq] + i // BQ, 0, NT - 1)
    out = out_tiles.reshape(NT, K, BQ, Gp, D)[tile, :, i % BQ]  # [T, K, Gp, D]
    out = out[:, :, :G].reshape(T, H, D)
    valid = t < query_start_loc[S]
    return jnp.where(valid[:, None, None], out, jnp.zeros_like(out))
