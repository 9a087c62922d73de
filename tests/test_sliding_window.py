"""Sliding-window attention in every paged attention kernel, and the KV blocks a window lets go.

The oracle is a dense per-sequence computation (numpy, float64) over the KV the block table names: a token at
position p sees positions p-W+1..p (transformers' `sliding_window_overlay`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels as ck
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from scheduler.block_manager import NULL_BLOCK, BlockManager
from tests.test_pallas_attention import make_batch


def dense_oracle(q, k, v, bt, sl, qsl, layer, window, scale=None, softcap=0.0, tree_mask=None):
    """float64 `[T, H, D]`: each sequence's KV gathered through its block table, masked causally, by window and
    by the tree bits of its step tokens."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    bt, sl, qsl = np.asarray(bt), np.asarray(sl), np.asarray(qsl)
    T, H, D = q.shape
    B, K = k.shape[2], k.shape[3]
    scale = scale or 1 / np.sqrt(D)
    out = np.zeros_like(q)
    for s in range(len(sl)):
        n, length = qsl[s + 1] - qsl[s], sl[s]
        if n == 0:
            continue
        pos = np.arange(length)
        kk = k[layer, bt[s, pos // B], pos % B]  # [len, K, D]
        vv = v[layer, bt[s, pos // B], pos % B]
        for i in range(n):
            t, p = qsl[s] + i, length - n + i
            seen = pos <= p
            if window:
                seen &= p - pos < window
            if tree_mask is not None:
                rel = pos - (length - n)
                bits = (int(tree_mask[t]) >> np.clip(rel, 0, 31)) & 1
                seen &= (rel < 0) | (rel >= 32) | (bits == 1)
            for h in range(H):
                scores = kk[:, h // (H // K)] @ q[t, h] * scale
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                w = np.where(seen, np.exp(scores - scores[seen].max()), 0.0)
                out[t, h] = w @ vv[:, h // (H // K)] / w.sum()
    return out


# Decode rows, verify windows and prefill chunks after cached context, around the window's edge and tile (32)
# and block boundaries; a padded token.
Q_LENS = [1, 1, 1, 4, 40, 3, 1]
KV_LENS = [1, 37, 100, 70, 140, 5, 64]


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("window", [1, 7, 33, 64])
@pytest.mark.parametrize("D,dtype", [(8, jnp.float32), (16, jnp.float32), (64, jnp.float32), (64, jnp.bfloat16),
                                     (128, jnp.float32)])
def test_native_and_reference_windows_equal_dense(window, D, dtype, softcap):
    """The native kernel (each of its paths on AVX-512: D 8 the AVX2 one, 16 transposed, 64 / 128 split; f32 and
    bf16 pools) and the jnp
    reference equal the dense oracle under windows narrower and wider than a tile, with and without Gemma 2's
    score soft-cap (a cap of 2 bends every score: they span about +-4 here); the window is traced (a scan over
    layers passes it as data)."""
    args = make_batch(3, Q_LENS, KV_LENS, heads=6, kv_heads=2, head_dim=D, block_size=16, pad_tokens=1, dtype=dtype)
    want = dense_oracle(*args, 1, window, softcap=softcap)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    ref = jax.jit(lambda *a: ragged_paged_attention_reference(*a[:-1], softcap=softcap, sliding_window=a[-1]))(
        *args, 1, jnp.int32(window))
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, atol=tol, rtol=tol)
    if ck.available():
        got = jax.jit(lambda *a: ck.paged_attention(*a[:-1], softcap=softcap, sliding_window=a[-1]))(
            *args, jnp.int32(1), jnp.int32(window))
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


def test_windows_with_tree_masks_scale_and_softcap():
    """A token tree in a verify window under a sliding window, Gemma's score scale and Gemma 2's soft-cap: the
    reference and the native kernel equal the oracle."""
    args = make_batch(5, [5, 1, 6], [40, 20, 90], heads=4, kv_heads=2, head_dim=64, block_size=16)
    tree = jnp.asarray([1, 3, 5, 9, 17, 1, 1, 3, 7, 9, 19, 35], jnp.int32)  # two trees and a decode row
    scale, cap, window = 0.2, 5.0, 9
    want = dense_oracle(*args, 1, window, scale, cap, tree_mask=tree)
    got = ragged_paged_attention_reference(*args, 1, sm_scale=scale, softcap=cap, sliding_window=window,
                                           tree_mask=tree)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    if ck.available():
        got = ck.paged_attention(*args, jnp.int32(1), sm_scale=scale, softcap=cap, sliding_window=window,
                                 tree_mask=tree)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [5, 40])
def test_pallas_window_and_softcap_equal_dense(window):
    """The Pallas kernel (interpret mode) under a window and a soft-cap."""
    args = make_batch(9, [1, 4, 20], [30, 50, 70], heads=4, kv_heads=2, head_dim=16, block_size=8, pad_tokens=1)
    got = jax.jit(lambda *a: ragged_paged_attention(*a[:-1], 1, softcap=3.0, sliding_window=a[-1]))(*args, window)
    np.testing.assert_allclose(np.asarray(got), dense_oracle(*args, 1, window, softcap=3.0), atol=1e-5, rtol=1e-5)


def test_blocks_a_window_passed_go_back_to_the_pool():
    """`release_before` gives back whole blocks before the position (cached ones only with the prefix cache on),
    leaves the null block in their place, and freeing the allocation later frees each block once."""
    bm = BlockManager(20, 4, enable_prefix_cache=False, watermark=0.0)
    a = bm.allocate(None, 22)  # 6 blocks
    blocks = a.block_ids
    assert bm.release_before(a, 9) == 2  # blocks 0 and 1 end at position 8
    assert a.block_ids == (NULL_BLOCK, NULL_BLOCK) + blocks[2:] and bm.num_free_blocks == 19 - 4
    assert bm.release_before(a, 9) == 0
    child = bm.fork(a)
    assert [bm.ref_count(b) for b in blocks] == [0, 0, 2, 2, 2, 2]
    bm.free(child)
    bm.free(a)
    assert bm.num_free_blocks == 19 and all(bm.ref_count(b) == 0 for b in blocks)

    cached = BlockManager(20, 4, enable_prefix_cache=True, watermark=0.0)
    a = cached.allocate(None, 22)
    blocks, tokens = a.block_ids, list(range(22))
    cached.cache_blocks(a, lambda i, j: tokens[i:j], 8)  # blocks 0 and 1 cached
    assert cached.release_before(a, 16) == 2  # block 2 holds positions 8..11 but is not cached yet
    assert cached.num_cached_blocks == 2 and cached.num_free_blocks == 19 - 4  # the two stay evictable
    hit, n = cached.match_prefix(tokens, 21)
    assert n == 8 and hit.block_ids == blocks[:2]  # the released blocks still serve prefix hits
