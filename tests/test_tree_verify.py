"""Token-tree verification (engine/spec/tree_verify.py): masks and depths, the coupled verify the engine runs
(`verify_tree_coupled`, engine/spec/programs.py) on greedy and sampled rows, and moving the accepted path's KV
into place.

The "tiny models" here are second-order Markov tables over a 4-token vocabulary (logits of the next token given
the last two), so the exact joint distribution of the first three emitted tokens (64 cells) is known in closed
form; each sampled setting's chi-square test states its power (tests/chi2.py).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from engine.sampler import sample
from engine.spec.tree_verify import move_path_kv, tree_masks, verify_tree_coupled
from tests import chi2
from tests.test_verify import _settings

V = 4
PREFIX = (1, 2)
# Root with 3 children, each with 2; node i's parent.
WIDE = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
# The root's and each child's two likeliest draft tokens (Medusa's and EAGLE-2's top-k trees), depth 2.
TOP2 = [-1, 0, 0, 1, 1, 2, 2]


def _table(seed, scale):
    return np.random.default_rng(seed).normal(0, scale, (V, V, V)).astype(np.float32)


def _probs(logits, sp):
    """Filtered distributions of logits `[..., V]` under settings dict `sp`, computed in float64 (softmax of the
    logits over temperature, then top-p / min-p on the sorted probabilities)."""
    t = sp.get("temperature", 1.0)
    z = logits.astype(np.float64) / t
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    keep = p >= sp.get("min_p", 0.0) * p.max(-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass of the likelier tokens
    in_top_p = np.zeros_like(keep)
    np.put_along_axis(in_top_p, order, before < sp.get("top_p", 1.0), axis=-1)
    p = np.where(keep & in_top_p, p, 0.0)
    return p / p.sum(-1, keepdims=True)


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


def _plain(target, sp, seeds, n=3):
    """Sampling without speculation: one token per step from PREFIX, `[S, n]`."""
    S = len(seeds)
    out = np.tile(np.asarray(PREFIX), (S, 1))
    for _ in range(n):
        logits = jnp.asarray(target[out[:, -2], out[:, -1]])
        nxt = sample(logits, *_settings(S, **sp), seeds, jnp.full(S, out.shape[1], jnp.int32))
        out = np.concatenate([out, np.asarray(nxt)[:, None]], axis=1)
    return out[:, len(PREFIX):]


def _speculate(target, draft, sp, seeds, n=3):
    """Rows from PREFIX until each has emitted `n` tokens: per step a TOP2 tree of the draft's candidates, the
    target's token after each node drawn as the engine draws it (`sample` at the node's next position), then
    `verify_tree_coupled`. Returns (the first `n` tokens `[S, n]`, accepted nodes per step `[steps * S]`)."""
    S, M = len(seeds), len(TOP2)
    parents = np.tile(np.asarray(TOP2, np.int32), (S, 1))
    depth = np.asarray(tree_masks(jnp.asarray(parents))[1])
    settings = [jnp.repeat(x, M) for x in _settings(S, **sp)]
    out = np.zeros((S, len(PREFIX) + n + M), np.int64)
    out[:, :len(PREFIX)] = PREFIX
    length = np.full(S, len(PREFIX))
    accepted = []
    rows = np.arange(S)
    while length.min() < len(PREFIX) + n:
        tokens = np.zeros((S, M), np.int64)
        tokens[:, 0] = out[rows, length - 1]
        prev = out[rows, length - 2]
        for c in range(1, M, 2):  # node c and c + 1: the draft's two likeliest after their parent
            a, b = _contexts(tokens, parents, prev)
            up = TOP2[c]
            tokens[:, c:c + 2] = np.argsort(-draft[a[:, up], b[:, up]], axis=1, kind="stable")[:, :2]
        a, b = _contexts(tokens, parents, prev)
        positions = jnp.asarray((length - 1)[:, None] + depth + 1, jnp.int32).reshape(-1)
        drawn = sample(jnp.asarray(target[a, b]).reshape(-1, V), *settings, jnp.repeat(seeds, M),
                       positions).reshape(S, M)
        emitted, num, _ = verify_tree_coupled(drawn, jnp.asarray(tokens, jnp.int32), jnp.asarray(parents),
                                              jnp.full(S, M, jnp.int32))
        emitted, num = np.asarray(emitted), np.asarray(num)
        for j in range(num.max()):
            live = j < num
            out[rows[live], length[live] + j] = emitted[live, j]
        length += num
        accepted.append(num - 1)
    return out[:, len(PREFIX):len(PREFIX) + n], np.concatenate(accepted)


@pytest.mark.parametrize("sp", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(min_p=0.2),
                                dict(temperature=0.0)], ids=["t1", "t0.7-top_p0.9", "min_p0.2", "greedy"])
def test_coupled_verify_of_top_k_trees_equals_plain_sampling(sp):
    """Top-2 trees of depth 2 from an unrelated draft: every row's first three tokens equal sampling without
    speculation (same seed and positions), token for token, and, sampled, follow the target's exact joint
    (chi-square with its power stated), with the first verify rejecting the whole tree, taking one node or two."""
    target, draft = _table(1, 2.0), _table(2, 2.0)
    S = 20_000
    seeds = jnp.arange(S, dtype=jnp.uint32) + 11
    got, accepted = _speculate(target, draft, sp, seeds)
    np.testing.assert_array_equal(got, _plain(target, sp, seeds))
    if sp.get("temperature", 1.0) > 0:
        first = accepted[:S]  # the first step's: every row's tree rooted at PREFIX
        assert 0.2 < np.mean(first == 0) < 0.8 and np.mean(first == 2) > 0.05
        cells = chi2.Cells(_exact_joint(target, sp), S)
        assert cells.power >= chi2.POWER, cells
        assert cells.pvalue(np.bincount(got @ [V * V, V, 1], minlength=V ** 3)) > chi2.ALPHA, cells


def test_a_tree_holding_the_targets_tokens_is_accepted_to_its_leaf():
    """The first child of each node holds the target's token there: the walk takes nodes 1 then 4 (a leaf) and
    emits their tokens and the target's token at node 4; cut to 4 nodes, it stops at node 1."""
    S, M = 3, len(WIDE)
    rng = np.random.default_rng(0)
    target_tokens = rng.integers(0, V, (S, M))
    tokens = (target_tokens + 1) % V  # no node holds its parent's target token...
    tokens[:, 1] = target_tokens[:, 0]  # ...but node 1 (the root's first child) and node 4 (node 1's first)
    tokens[:, 4] = target_tokens[:, 1]
    num_nodes = jnp.asarray([M, M, 4])
    emitted, n, path = verify_tree_coupled(jnp.asarray(target_tokens, jnp.int32), jnp.asarray(tokens, jnp.int32),
                                           jnp.tile(jnp.asarray(WIDE, jnp.int32), (S, 1)), num_nodes)
    np.testing.assert_array_equal(np.asarray(n), [3, 3, 2])
    np.testing.assert_array_equal(np.asarray(path)[:, :3], [[1, 4, -1], [1, 4, -1], [1, -1, -1]])
    want = [[tokens[r, 1], tokens[r, 4], target_tokens[r, 4], -1] for r in range(2)]
    want.append([tokens[2, 1], target_tokens[2, 1], -1, -1])
    np.testing.assert_array_equal(np.asarray(emitted)[:, :4], want)


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
    argmax = sample(jnp.asarray(logits).reshape(-1, V), *_settings(S * M, temperature=0.0),
                    jnp.zeros(S * M, jnp.uint32), jnp.zeros(S * M, jnp.int32)).reshape(S, M)
    emitted, n, path = verify_tree_coupled(argmax, jnp.asarray(tokens), jnp.tile(jnp.asarray(WIDE, jnp.int32), (S, 1)),
                                           num_nodes)
    np.testing.assert_array_equal(np.asarray(n), [3, 1, 2])
    np.testing.assert_array_equal(np.asarray(emitted)[:, :3], [[3, 2, 1], [1, -1, -1], [3, 2, -1]])
    np.testing.assert_array_equal(np.asarray(path)[:, :2], [[2, 7], [-1, -1], [2, -1]])


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
