"""Token-tree attention: the jnp reference against a dense float64 oracle, the Pallas kernel (interpret mode on
CPU) and the native kernel against the reference, on random trees beside ragged prefill and decode rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpu_kernels as ck
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import causal_tree_mask, ragged_paged_attention_reference, tree_visible
from tests.test_pallas_attention import TOL, make_batch


def random_tree(rng, depth, width):
    """Parent index per node (-1 for the root, node 0), parents before children: `depth` levels under the
    root, 1..`width` nodes each, each node's parent drawn from the level above; at most 32 nodes."""
    parents, level = [-1], [0]
    for _ in range(depth):
        nxt = []
        for _ in range(int(rng.integers(1, width + 1))):
            if len(parents) == 32:
                break
            nxt.append(len(parents))
            parents.append(int(rng.choice(level)))
        level = nxt or level
    return parents


def ancestor_masks(parents):
    """int32 mask per node: bits of its ancestors and itself."""
    masks = []
    for i, p in enumerate(parents):
        masks.append((masks[p] if p >= 0 else 0) | (1 << i))
    return np.array(masks, np.uint32).view(np.int32)


def tree_batch(seed, rows, *, heads=6, kv_heads=2, head_dim=16, block_size=8, dtype=jnp.float32, pad_tokens=1):
    """A ragged batch and its tree masks. rows: per sequence ("tree", context, parents) or
    ("causal", context, query length); causal rows get `causal_tree_mask`."""
    q_lens = [len(r[2]) if r[0] == "tree" else r[2] for r in rows]
    kv_lens = [r[1] + n for r, n in zip(rows, q_lens)]
    args = make_batch(seed, q_lens, kv_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block_size, pad_tokens=pad_tokens, dtype=dtype)
    masks = [ancestor_masks(r[2]) if r[0] == "tree" else np.asarray(causal_tree_mask(np.arange(n)))
             for r, n in zip(rows, q_lens)]
    masks.append(np.zeros(pad_tokens, np.int32))
    return args, jnp.asarray(np.concatenate(masks).astype(np.int32))


def dense_oracle(args, tree_mask, layer):
    """float64, one token at a time: softmax over the cached prefix and the window tokens its mask allows."""
    q, k, v, bt, sl, qsl = (np.asarray(a, np.float64) if i < 3 else np.asarray(a) for i, a in enumerate(args))
    T, H, D = q.shape
    B, K = k.shape[2], k.shape[3]
    out = np.zeros((T, H, D))
    for s in range(len(sl)):
        n, length = qsl[s + 1] - qsl[s], sl[s]
        if n == 0:
            continue
        pos = np.arange(length)
        slots = bt[s, pos // B], pos % B
        ks, vs = k[layer][slots], v[layer][slots]  # [len, K, D]
        for i in range(n):
            t, window = qsl[s] + i, length - n
            seen = (pos < window) | ((pos <= window + i) &
                                     np.asarray(tree_visible(tree_mask[t], jnp.asarray(pos - window))))
            if not seen.any():
                continue
            for h in range(H):
                logits = ks[seen, h // (H // K)] @ q[t, h] / np.sqrt(D)
                p = np.exp(logits - logits.max())
                out[t, h] = p @ vs[seen, h // (H // K)] / p.sum()
    return out


@st.composite
def tree_rows(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        rows.append(("tree", draw(st.integers(0, 70)),
                     random_tree(rng, draw(st.integers(1, 8)), draw(st.integers(1, 4)))))
    for _ in range(draw(st.integers(0, 2))):  # chunked prefill (past the 32-token window too) and decode rows
        rows.append(("causal", draw(st.integers(0, 40)), draw(st.sampled_from([1, 5, 33, 48]))))
    order = draw(st.permutations(range(len(rows))))
    return [rows[i] for i in order], draw(st.sampled_from([jnp.float32, jnp.bfloat16]))


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(tree_rows())
def test_tree_kernels_equal_reference_and_reference_equals_oracle(case):
    """Random trees (depths 1..8, widths 1..4, up to 32 nodes, after 0..70 cached tokens) beside prefill chunks
    and decode rows: reference = float64 oracle (f32 pool), Pallas and native kernels = reference."""
    rows, dtype = case
    args, tree = tree_batch(len(rows), rows, dtype=dtype)
    want = np.asarray(ragged_paged_attention_reference(*args, 1, tree_mask=tree), np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(want, dense_oracle(args, tree, 1), atol=1e-5, rtol=1e-5)
    pallas = jax.jit(lambda *a: ragged_paged_attention(*a, 1, tree_mask=tree))(*args)
    np.testing.assert_allclose(np.asarray(pallas, np.float32), want, atol=TOL[dtype], rtol=TOL[dtype])
    native = jax.jit(lambda *a: ck.paged_attention(*a, jnp.int32(1), tree_mask=tree))(*args)
    np.testing.assert_allclose(np.asarray(native, np.float32), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("D,dtype", [(64, jnp.bfloat16), (64, jnp.float32), (128, jnp.bfloat16)])
def test_native_tree_paths_equal_reference(D, dtype):
    """Every native path with trees: 12 sequences of short tiles (one item over all KV heads), a 4-token tile,
    a prefill chunk of 16-token tiles holding a 20-node tree's window; SmolLM2's 9 heads over 3, f32 q."""
    rng = np.random.default_rng(D)
    rows = [("tree", int(rng.integers(0, 90)), random_tree(rng, 3, 2)) for _ in range(12)]
    rows += [("causal", 30, 1), ("tree", 0, random_tree(rng, 8, 4)), ("causal", 20, 40)]
    args, tree = tree_batch(5, rows, heads=9, kv_heads=3, head_dim=D, block_size=16)
    args = (args[0], args[1].astype(dtype), args[2].astype(dtype), *args[3:])
    want = np.asarray(ragged_paged_attention_reference(*args, 1, tree_mask=tree))
    got = np.asarray(jax.jit(lambda *a: ck.paged_attention(*a, jnp.int32(1), tree_mask=tree))(*args))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_chain_tree_is_causal_attention():
    """A chain (one child per node) gives the causal masks, and every kernel's output with them is its causal
    output, bit for bit."""
    chain = list(range(-1, 7))
    np.testing.assert_array_equal(ancestor_masks(chain), np.asarray(causal_tree_mask(np.arange(8))))
    assert int(causal_tree_mask(31)) == -1 and int(causal_tree_mask(40)) == -1
    rows = [("tree", 37, chain), ("causal", 3, 40), ("causal", 20, 1)]
    args, tree = tree_batch(2, rows)
    kernels = {
        "reference": lambda *a, **kw: ragged_paged_attention_reference(*a, 1, **kw),
        "pallas": lambda *a, **kw: ragged_paged_attention(*a, 1, **kw),
        "native": lambda *a, **kw: ck.paged_attention(*a, jnp.int32(1), **kw),
    }
    for name, f in kernels.items():
        causal = np.asarray(jax.jit(f)(*args))
        treed = np.asarray(jax.jit(lambda *a: f(*a, tree_mask=tree))(*args))
        np.testing.assert_array_equal(treed, causal, err_msg=name)


def test_token_that_sees_nothing_gets_zeros():
    """A window token whose mask hides every step token (its own too) and that has no cached prefix gets
    zeros from every kernel; its neighbours are unaffected."""
    rows = [("tree", 0, [-1, 0, 0])]
    args, tree = tree_batch(3, rows, pad_tokens=0)
    tree = tree.at[2].set(0)
    want = np.asarray(ragged_paged_attention_reference(*args, 1, tree_mask=tree))
    assert np.all(want[2] == 0) and np.all(np.isfinite(want))
    np.testing.assert_allclose(want[:2], dense_oracle(args, tree, 1)[:2], atol=1e-5)
    for got in (ragged_paged_attention(*args, 1, tree_mask=tree),
                ck.paged_attention(*args, jnp.int32(1), tree_mask=tree)):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
