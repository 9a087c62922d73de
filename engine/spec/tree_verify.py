"""Token trees: their attention masks, exact tree verification, and the accepted path's KV moved into place.

A row's tree: node 0 is the root, the row's last accepted token (its target
logits give the distribution of the next token); nodes 1..n-1 are proposals,
each with a parent of smaller index (`parents[0] = -1`), so a node's subtree
follows it. A chain is the tree with one child per node. In the verify step
node i sits at KV position `root + i` (its slot in the window) and takes
RoPE position `root + depth(i)`, attending to the cached prefix and to its
ancestors only (`tree_masks`; the kernels' rule is
`pallas_kernels.reference.tree_visible`). After verification the accepted
path's KV moves to positions `root + 1, root + 2, ...` (`move_path_kv`), which
is where the next step expects it.

The verify, `verify_tree_coupled`, is exact for any candidate set, and is
meant for deterministic ones (top-k children: Medusa, EAGLE-2; n-gram and
suffix trees): the target's token at each node is drawn exactly as the plain
sampler (`engine.sampler`, after temperature / top-k / top-p / min-p) draws
the token at that position, and the walk follows the child holding it. With
one-hot proposals this is sampling-without-replacement verification (SpecTr,
Sun et al. 2023; Sequoia, Chen et al. 2024, §3.2: a rejected candidate's mass
leaves q and q is renormalised), realised with the sampler's own draws, so
the output equals decoding without speculation, seeded rows included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_TREE_NODES = 32  # one int32 word of mask bits (pallas_kernels.reference.TREE_WINDOW)


def tree_masks(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Attention masks and depths of token trees.

    Args:
      parents: int32 `[S, N]`, N <= 32, each node's parent (< its index; -1 for the root and for unused nodes).
    Returns:
      (masks int32 `[S, N]`: bit j of node i set iff j is i or an ancestor of i; depth int32 `[S, N]`, 0 at
      the root).
    Raises:
      ValueError: N > 32.
    """
    S, N = parents.shape
    if N > MAX_TREE_NODES:
        raise ValueError(f"a token tree holds at most {MAX_TREE_NODES} nodes, got {N}")
    rows = jnp.arange(S)
    masks = jnp.zeros((S, N), jnp.uint32)
    depth = jnp.zeros((S, N), jnp.int32)
    for i in range(N):  # parents come first, so one pass in index order settles every node
        p = parents[:, i]
        has = p >= 0
        up = jnp.clip(p, 0, N - 1)
        masks = masks.at[:, i].set(jnp.where(has, masks[rows, up], 0) | jnp.uint32(1 << i))
        depth = depth.at[:, i].set(jnp.where(has, depth[rows, up] + 1, 0))
    return jax.lax.bitcast_convert_type(masks, jnp.int32), depth


def _path_tokens(tokens: jax.Array, path: jax.Array, n: jax.Array, final: jax.Array) -> jax.Array:
    """Accepted nodes' tokens, then `final`, then -1: int32 `[S, N]` (N - 1 accepted at most, plus one)."""
    S, N = tokens.shape
    slot = jnp.arange(N)[None, :]
    along = jnp.take_along_axis(tokens, jnp.clip(path, 0, N - 1), axis=1)
    along = jnp.concatenate([along[:, :N - 1], jnp.zeros((S, 1), jnp.int32)], axis=1)
    return jnp.where(slot < n[:, None], along, jnp.where(slot == n[:, None], final[:, None], -1))


@jax.jit
def verify_tree_coupled(target_tokens: jax.Array, tokens: jax.Array, parents: jax.Array,
                        num_nodes: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tree verify for deterministic candidate sets, coupled to the plain sampler (see the module docstring).

    Args:
      target_tokens: int32 `[S, N]`, the target's token after each node, drawn as `engine.sampler.sample`
        draws the token at that position (greedy rows: the argmax).
      tokens: int32 `[S, N]`, each node's token (the root's is not read).
      parents: int32 `[S, N]`, as `tree_masks`.
      num_nodes: int32 `[S]`, 1..N; nodes past it are ignored (1: an ordinary sampling step).
    Returns:
      (emitted int32 `[S, N]`: the accepted nodes' tokens then the target's token at the last of them (the
       root when none), -1 after;
       num_emitted int32 `[S]`, 1..depth of the deepest node + 1;
       path int32 `[S, N]`: the accepted nodes in order, -1 after).
    """
    S, N = tokens.shape
    rows = jnp.arange(S)

    def visit(c, state):
        cur, path, n = state
        accept = (parents[:, c] == cur) & (c < num_nodes) & (tokens[:, c] == target_tokens[rows, cur])
        path = path.at[rows, n].set(jnp.where(accept, c, path[rows, n]))
        return jnp.where(accept, c, cur), path, n + accept

    cur, path, n = jax.lax.fori_loop(1, N, visit, (jnp.zeros(S, jnp.int32), jnp.full((S, N), -1, jnp.int32),
                                                   jnp.zeros(S, jnp.int32)))
    return _path_tokens(tokens, path, n, target_tokens[rows, cur]), n + 1, path


def move_path_kv(pool: jax.Array, block_tables: jax.Array, root_positions: jax.Array, path: jax.Array) -> jax.Array:
    """Moves each row's accepted nodes' KV from their window slots to consecutive positions.

    Node i of a row's window was written at position `root + i`; the k-th accepted node (`path[:, k]`)
    belongs at `root + 1 + k`. Every source is read before any destination is written, so overlapping
    moves are safe; rows and path entries of -1 move nothing.

    Args:
      pool: `[L, P, B, ...]`, any per-slot pool (G, V, draft KV, features).
      block_tables: int32 `[S, M]`.
      root_positions: int32 `[S]` (-1 or a row with no path: nothing moves).
      path: int32 `[S, N]`, as `verify_tree_coupled` returns.
    Returns:
      the pool, updated (donate it to update in place).
    """
    S, N = path.shape
    B = pool.shape[2]
    live = (path > 0) & (root_positions[:, None] >= 0)
    src_pos = root_positions[:, None] + path
    dst_pos = root_positions[:, None] + 1 + jnp.arange(N)[None, :]
    live &= src_pos != dst_pos

    def slot(pos):
        blk = jnp.take_along_axis(block_tables, jnp.clip(pos // B, 0, block_tables.shape[1] - 1), axis=1)
        return blk, pos % B

    (sb, so), (db, do) = slot(src_pos), slot(dst_pos)
    moved = pool[:, sb, so]  # [L, S, N, ...]
    P = pool.shape[1]
    return pool.at[:, jnp.where(live, db, P), do].set(moved, mode="drop")
