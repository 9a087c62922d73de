"""Token-tree attention: the jnp reference against a dense float64 oracle, the Pallas kernel (interpret mode on
CPU) and the native kernel against the reference, on random trees beside ragged prefill and decode rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpu_kernels as ck
from engine.spec.tree_verify import tree_masks
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import causal_tree_mask, ragged_paged_attention_reference
from scheduler.packing import _ancestor_masks
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
    """The oracle of the tree masks: node i's mask has bit j set iff j is i or an ancestor of i, found by
    walking its parents up to the root."""
    masks = []
    for i in range(len(parents)):
        bits, j = 0, i
        while j >= 0:
            bits |= 1 << j
            j = parents[j]
        masks.append(bits)
    return np.asarray(masks, np.uint32).view(np.int32)


def tree_batch(seed, rows, *, heads=6, kv_heads=2, head_dim=16, block_size=8, dtype=jnp.float32, pad_tokens=1):
    """A ragged batch and its tree masks. rows: per sequence ("tree", context, parents) or
    ("causal", context, query length); tree rows get `ancestor_masks`, causal rows `causal_tree_mask`."""
    q_lens = [len(r[2]) if r[0] == "tree" else r[2] for r in rows]
    kv_lens = [r[1] + n for r, n in zip(rows, q_lens)]
    args = make_batch(seed, q_lens, kv_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block_size, pad_tokens=pad_tokens, dtype=dtype)
    masks = [ancestor_masks(r[2]) if r[0] == "tree"
             else np.asarray(causal_tree_mask(np.arange(n))) for r, n in zip(rows, q_lens)]
    masks.append(np.zeros(pad_tokens, np.int32))
    return args, jnp.asarray(np.concatenate(masks).astype(np.int32))


def dense_oracle(args, tree_mask, layer):
    """float64, one token at a time: softmax over the cached prefix and the window tokens its mask allows (bit j
    of its mask for window token j < 32; causality alone from the 33rd on)."""
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
            bits = int(tree_mask[t]) & 0xFFFFFFFF
            seen = np.asarray([p < window or (p <= window + i and (p - window >= 32 or bits >> (p - window) & 1))
                               for p in pos], bool)
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


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
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


def test_packed_and_engine_masks_are_the_ancestor_sets():
    """The masks the packer (`scheduler.packing`) and the engine (`tree_masks`, with depths) build equal the
    oracle's on random trees, chains and stars of up to 32 nodes."""
    rng = np.random.default_rng(0)
    trees = [random_tree(rng, int(rng.integers(1, 12)), int(rng.integers(1, 5))) for _ in range(40)]
    trees += [list(range(-1, 31)), [-1] + [0] * 31]
    for parents in trees:
        want = ancestor_masks(parents)
        np.testing.assert_array_equal(_ancestor_masks(np.asarray(parents)).view(np.int32), want)
        masks, depth = tree_masks(jnp.asarray([parents], jnp.int32))
        np.testing.assert_array_equal(np.asarray(masks)[0], want)
        np.testing.assert_array_equal(np.asarray(depth)[0], [bin(int(m) & 0xFFFFFFFF).count("1") - 1 for m in want])


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


# ---- through the model: a tree window, then the accepted path moved into place ------------------------


def _batch(tokens, positions, slots, seq_len, table):
    """A one-sequence StepBatch (greedy; only the model's inputs matter here)."""
    from engine.step import StepBatch
    T = len(tokens)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return StepBatch(token_ids=i32(tokens), positions=i32(positions), slot_mapping=i32(slots),
                     query_start_loc=i32([0, T]), seq_lens=i32([seq_len]), block_tables=i32(table[None]),
                     logits_indices=i32([T - 1]), temperature=jnp.zeros(1), top_k=i32([0]), top_p=jnp.ones(1),
                     min_p=jnp.zeros(1), seeds=jnp.zeros(1, jnp.uint32), want_logprobs=jnp.zeros(1, bool))


@pytest.mark.parametrize("attention", ["reference", "native", "pallas"])
def test_tree_window_through_the_model_equals_each_path_as_a_chain(attention):
    """tiny-llama, block size 4 over a shuffled block table: after a 13-token prefill, a 10-node tree window
    (root = the prompt's last token, RoPE position = root + depth, KV at root + node index, tree masks) gives at
    every node the dense forward's logits for the root-to-node path; after `move_path_kv` puts an accepted path
    (nodes 2, 7) at consecutive positions, a decode step equals the dense forward of prompt + path + token."""
    from flax import nnx

    from engine.step import KVPool, cpu_paged_attention, paged_attend
    from engine.spec.tree_verify import move_path_kv
    from model.config import get_preset
    from model.llama import Llama

    attend_fn = {"reference": ragged_paged_attention_reference, "native": cpu_paged_attention,
                 "pallas": ragged_paged_attention}[attention]
    cfg = get_preset("tiny-llama")
    model = Llama(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, 14).tolist()
    parents = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
    nodes = rng.integers(3, cfg.vocab_size, len(parents)).tolist()
    nodes[0] = prompt[-1]
    B, table = 4, np.asarray([5, 2, 7, 0, 3, 6, 1, 4], np.int32)
    slot = lambda pos: table[pos // B] * B + pos % B  # noqa: E731
    pool = KVPool.zeros(cfg, 8, B)

    def run(pool, batch, mask=None):
        hidden, pool = model(batch.token_ids, batch.positions, paged_attend(batch, attend_fn, mask), pool)
        return np.asarray(model.logits(hidden)), pool

    root = len(prompt) - 1
    _, pool = run(pool, _batch(prompt[:-1], range(root), [slot(p) for p in range(root)], root, table))
    masks, depth = tree_masks(jnp.asarray([parents], jnp.int32))
    window = range(root, root + len(nodes))
    logits, pool = run(pool, _batch(nodes, root + np.asarray(depth[0]), [slot(p) for p in window],
                                    root + len(nodes), table), masks[0])
    for i in range(len(nodes)):
        path, j = [], i
        while j > 0:
            path.insert(0, nodes[j])
            j = parents[j]
        dense = np.asarray(model.dense_logits(jnp.asarray([prompt + path]))[0, -1])
        np.testing.assert_allclose(logits[i], dense, atol=2e-5, rtol=0, err_msg=f"node {i}")

    accepted = jnp.asarray([[2, 7] + [-1] * 8], jnp.int32)
    pool = KVPool(*(move_path_kv(x, jnp.asarray(table[None]), jnp.asarray([root], jnp.int32), accepted)
                    for x in (pool.k, pool.v)))
    nxt = root + 3
    logits, _ = run(pool, _batch([11], [nxt], [slot(nxt)], nxt + 1, table))
    dense = np.asarray(model.dense_logits(jnp.asarray([prompt + [nodes[2], nodes[7], 11]]))[0, -1])
    np.testing.assert_allclose(logits[0], dense, atol=2e-5, rtol=0)
