"""Token-tree verification (engine/spec/tree_verify.py): masks and depths, greedy paths, the statistical exactness
of multi-candidate speculative sampling, the coupled verify of deterministic trees, and moving the accepted
path's KV into place.

The "tiny models" here are second-order Markov tables over a 4-token vocabulary (logits of the next token given
the last two), so the exact joint distribution of the first three emitted tokens is known in closed form.
Power: Pearson's chi-square at ALPHA = 0.001 on N = 60,000 rows over the 64-cell joint has power >= 0.99 against
any alternative at total-variation distance 0.02 (tests/test_verify.py's argument and `test_power_is_as_stated`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.sampler import filter_logits, sample
from engine.spec.tree_verify import move_path_kv, tree_masks, verify_tree, verify_tree_coupled
from tests.test_verify import ALPHA, N, _chi2_pvalue, _settings

V = 4
PREFIX = (1, 2)
# Root with 3 children, each with 2: the draft's i.i.d. candidates; node i's parent.
WIDE = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]


def _table(seed, scale):
    return np.random.default_rng(seed).normal(0, scale, (V, V, V)).astype(np.float32)


def _probs(logits, sp):
    """Filtered distributions of logits `[..., V]` under settings dict `sp` (float64)."""
    flat = jnp.asarray(logits.reshape(-1, V))
    out = jax.nn.softmax(filter_logits(flat, *_settings(flat.shape[0], **sp)), axis=-1)
    return np.asarray(out, np.float64).reshape(logits.shape)


def _exact_joint(target, sp):
    joint = np.zeros((V, V, V))
    q1 = _probs(target[PREFIX], sp)
    for a in range(V):
        q2 = _probs(target[PREFIX[1], a], sp)
        for b in range(V):
            joint[a, b] = q1[a] * q2[b] * _probs(target[a, b], sp)
    return joint


def _contexts(tokens, parents, prev):
    """Each node's last two tokens: (its parent's token, its own); the root's parent token is `prev`."""
    up = np.where(parents >= 0, parents, 0)
    before = np.take_along_axis(tokens, up, axis=1)
    return np.where(parents >= 0, before, prev[:, None]), tokens


def _first_three(target, draft, sp, shape, seed=0):
    """Runs N rows from PREFIX until each has emitted 3 tokens, a fresh tree of the draft's i.i.d. candidates
    per step (`shape`: parents), verified by `verify_tree`; returns int `[N, 3]`."""
    rng = np.random.default_rng(seed)
    parents = np.tile(np.asarray(shape, np.int32), (N, 1))
    M = parents.shape[1]
    out = np.tile(np.asarray(PREFIX), (N, 1)).tolist()
    seeds = jnp.arange(N, dtype=jnp.uint32) + jnp.uint32(7919 * seed)
    settings = _settings(N, **sp)
    while min(len(r) for r in out) < len(PREFIX) + 3:
        tokens = np.zeros((N, M), np.int64)
        tokens[:, 0] = [r[-1] for r in out]
        prev = np.asarray([r[-2] for r in out])
        for c in range(1, M):  # draw each candidate from p at its parent (parents come first)
            a, b = _contexts(tokens, parents, prev)
            p_parent = _probs(draft[a[:, parents[0, c]], b[:, parents[0, c]]], sp)
            tokens[:, c] = (rng.random(N)[:, None] > np.cumsum(p_parent, axis=1)).sum(axis=1).clip(0, V - 1)
        a, b = _contexts(tokens, parents, prev)
        target_logits = jnp.asarray(target[a, b])  # [N, M, V]
        draft_probs = jnp.asarray(_probs(draft[a, b], sp), jnp.float32)
        root = jnp.asarray([len(r) - 1 for r in out], jnp.int32)
        emitted, n, _ = verify_tree(target_logits, draft_probs, jnp.asarray(tokens, jnp.int32),
                                    jnp.asarray(parents), jnp.full(N, M, jnp.int32), *settings, seeds, root)
        emitted, n = np.asarray(emitted), np.asarray(n)
        for r in range(N):
            out[r].extend(emitted[r, :n[r]].tolist())
    return np.asarray([r[len(PREFIX):len(PREFIX) + 3] for r in out])


@pytest.mark.parametrize("sp", [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.0, top_p=0.9)],
                         ids=["t1", "t0.7", "top_p0.9"])
def test_first_three_tokens_follow_the_target_exactly(sp):
    """Trees of 3 + 6 i.i.d. draft candidates, an unrelated draft (many rejections at every sibling): the joint
    of the first three emitted tokens fits the target's exact joint (after filtering) at ALPHA. With the residual
    update between siblings removed, the same test gives p-values below 1e-30 at each setting."""
    target, draft = _table(0, 2.0), _table(1, 2.0)
    three = _first_three(target, draft, sp, WIDE, seed=1)
    cells = three[:, 0] * V * V + three[:, 1] * V + three[:, 2]
    assert _chi2_pvalue(cells, _exact_joint(target, sp)) > ALPHA


def test_draft_equal_to_target_accepts_every_first_candidate():
    """q == p: the first child at each node is always accepted, down to a leaf, then the bonus."""
    target = _table(2, 1.0)
    sp = dict(temperature=1.0)
    S = 500
    tokens = np.random.default_rng(0).integers(0, V, (S, len(WIDE)))
    parents = np.tile(np.asarray(WIDE, np.int32), (S, 1))
    a, b = _contexts(tokens, parents, np.zeros(S, np.int64))
    q = jnp.asarray(_probs(target[a, b], sp), jnp.float32)
    emitted, n, path = verify_tree(jnp.asarray(target[a, b]), q, jnp.asarray(tokens, jnp.int32), jnp.asarray(parents),
                                   jnp.full(S, len(WIDE), jnp.int32), *_settings(S, **sp),
                                   jnp.arange(S, dtype=jnp.uint32), jnp.full(S, 3, jnp.int32))
    np.testing.assert_array_equal(np.asarray(n), 3)
    np.testing.assert_array_equal(np.asarray(path)[:, :2], np.tile([1, 4], (S, 1)))
    np.testing.assert_array_equal(np.asarray(emitted)[:, :2], tokens[:, [1, 4]])


def test_tree_masks_and_depths():
    parents = jnp.asarray([WIDE, [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)
    masks, depth = tree_masks(parents)
    want = [0b1, 0b11, 0b101, 0b1001, 0b10011, 0b100011, 0b1000101, 0b10000101, 0b100001001, 0b1000001001]
    np.testing.assert_array_equal(np.asarray(masks)[0], want)
    np.testing.assert_array_equal(np.asarray(masks)[1], [(1 << (i + 1)) - 1 for i in range(10)])  # a chain
    np.testing.assert_array_equal(np.asarray(depth), [[0, 1, 1, 1, 2, 2, 2, 2, 2, 2], list(range(10))])
    with pytest.raises(ValueError, match="at most 32"):
        tree_masks(jnp.full((1, 33), -1, jnp.int32))


def test_greedy_follows_the_argmax_path():
    """Greedy rows: the child holding the target's argmax at each node, past siblings that do not; a row
    whose children all miss emits the argmax alone; nodes past num_nodes are ignored."""
    S, M = 3, len(WIDE)
    logits = np.zeros((S, M, V), np.float32)
    tokens = np.zeros((S, M), np.int32)
    tokens[:, 1:4] = [0, 3, 2]  # root's children: nodes 1, 2, 3
    tokens[:, 6:8] = [1, 2]  # node 2's children: nodes 6, 7
    logits[:, 0, 3] = logits[:, 2, 2] = logits[:, 7, 1] = 5.0  # argmax: 3 at the root, 2 at node 2, 1 at node 7
    logits[1, 0, 3], logits[1, 0, 1] = 0.0, 5.0  # row 1: argmax 1 at the root, no child holds it
    num_nodes = jnp.asarray([M, M, 7])  # row 2: node 7 is not in its tree
    emitted, n, path = verify_tree(jnp.asarray(logits), jnp.zeros((S, M, V)), jnp.asarray(tokens),
                                   jnp.tile(jnp.asarray(WIDE, jnp.int32), (S, 1)), num_nodes,
                                   *_settings(S, temperature=0.0), jnp.zeros(S, jnp.uint32), jnp.zeros(S, jnp.int32))
    np.testing.assert_array_equal(np.asarray(n), [3, 1, 2])
    np.testing.assert_array_equal(np.asarray(emitted)[:, :3], [[3, 2, 1], [1, -1, -1], [3, 2, -1]])
    np.testing.assert_array_equal(np.asarray(path)[:, :2], [[2, 7], [-1, -1], [2, -1]])
    coupled = verify_tree_coupled(jnp.asarray(np.argmax(logits, -1), jnp.int32), jnp.asarray(tokens),
                                  jnp.tile(jnp.asarray(WIDE, jnp.int32), (S, 1)), num_nodes)
    for a, b in zip(coupled, (emitted, n, path)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("sp", [dict(temperature=0.7), dict(temperature=1.0, top_p=0.9), dict(temperature=0.0)],
                         ids=["t0.7", "top_p0.9", "greedy"])
def test_coupled_verify_of_top_k_trees_equals_plain_sampling(sp):
    """Top-2 trees of depth 2 from an unrelated draft, verified by `verify_tree_coupled` with the target's
    token at each node drawn as the sampler draws it: every row's first three tokens equal sampling
    without speculation (one token per step, same seed and positions), token for token."""
    target, draft = _table(3, 2.0), _table(4, 2.0)
    S = 2000
    seeds = jnp.arange(S, dtype=jnp.uint32) + 11
    settings = _settings(S, **sp)
    plain = np.tile(np.asarray(PREFIX), (S, 1))
    for _ in range(3):
        logits = jnp.asarray(target[plain[:, -2], plain[:, -1]])
        nxt = sample(logits, *settings, seeds, jnp.full(S, plain.shape[1], jnp.int32))
        plain = np.concatenate([plain, np.asarray(nxt)[:, None]], axis=1)

    shape = np.asarray([-1, 0, 0, 1, 1, 2, 2], np.int32)
    parents = np.tile(shape, (S, 1))
    out = np.tile(np.asarray(PREFIX), (S, 1)).tolist()
    while min(len(r) for r in out) < len(PREFIX) + 3:
        tokens = np.zeros((S, len(shape)), np.int64)
        tokens[:, 0] = [r[-1] for r in out]
        prev = np.asarray([r[-2] for r in out])
        for parent, first in ((0, 1), (1, 3), (2, 5)):  # each node's two children: the draft's top 2
            a, b = _contexts(tokens, parents, prev)
            top = np.argsort(-draft[a[:, parent], b[:, parent]], axis=1, kind="stable")[:, :2]
            tokens[:, first:first + 2] = top
        a, b = _contexts(tokens, parents, prev)
        _, depth = tree_masks(jnp.asarray(parents))
        root = np.asarray([len(r) - 1 for r in out])
        pos = jnp.asarray(root[:, None] + np.asarray(depth) + 1, jnp.int32)  # position of each node's next token
        rep = lambda x: jnp.repeat(x, len(shape))  # noqa: E731
        drawn = sample(jnp.asarray(target[a, b]).reshape(-1, V), *(rep(x) for x in settings), rep(seeds),
                       pos.reshape(-1)).reshape(S, len(shape))
        emitted, n, _ = verify_tree_coupled(drawn, jnp.asarray(tokens, jnp.int32), jnp.asarray(parents),
                                            jnp.full(S, len(shape), jnp.int32))
        emitted, n = np.asarray(emitted), np.asarray(n)
        for r in range(S):
            out[r].extend(emitted[r, :n[r]].tolist())
    got = np.asarray([r[:len(PREFIX) + 3] for r in out])
    np.testing.assert_array_equal(got, plain)


def test_move_path_kv_puts_the_accepted_path_at_consecutive_positions():
    """Accepted nodes 3 and 5 of a window at positions 6.. (block size 4, blocks 2 -> 0 -> 3) move to
    positions 7 and 8 across a block boundary; a row with nothing accepted and every other slot are untouched."""
    L, P, B = 2, 5, 4
    pool = jnp.arange(L * P * B * 2, dtype=jnp.float32).reshape(L, P, B, 1, 2)
    tables = jnp.asarray([[2, 0, 3, 1], [4, 1, 0, 0]], jnp.int32)
    path = jnp.asarray([[3, 5, -1, -1], [-1, -1, -1, -1]], jnp.int32)
    got = np.asarray(move_path_kv(pool, tables, jnp.asarray([6, 2], jnp.int32), path))
    want = np.asarray(pool).copy()
    slot = lambda pos: (int(tables[0, pos // B]), pos % B)  # noqa: E731
    want[:, slot(7)[0], slot(7)[1]] = np.asarray(pool)[:, slot(9)[0], slot(9)[1]]
    want[:, slot(8)[0], slot(8)[1]] = np.asarray(pool)[:, slot(11)[0], slot(11)[1]]
    np.testing.assert_array_equal(got, want)
    assert (got != np.asarray(pool)).any()
