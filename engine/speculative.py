"""Speculative decoding: one jitted program per step, draft (if on the device) + target + verify.

Sources: Leviathan et al. 2023 (§2.3, Algorithm 1) and Chen et al. 2023
(Algorithm 2) for the proposal/verify scheme; the verify itself is
`engine.verify.verify`.

The draft keeps its own paged KV pool with the target's shape of block
tables: it is indexed by the same block ids and slots, so one allocation (and
one prefix-cache entry) covers both models, and rolling back rejected tokens
needs nothing beyond lowering the sequence length. The draft therefore sees
every token the target sees, prefill chunks included.

One step program (`make_spec_step`) runs, on a packed batch whose decode
rows carry `K_i` placeholder tokens after their last accepted token:
  1. the draft over the whole packed batch (KV for every new token; its
     logits at each row's last real token give draft token 1),
  2. `K` single-token draft passes: pass j feeds draft token j at its
     position (writing its KV, so after a fully accepted round the draft is
     level with the target) and, for j < K, proposes token j + 1,
  3. the target over the packed batch with the draft tokens written into the
     placeholders (the verify window of K + 1 positions per row),
  4. `verify`: accepted tokens plus one correction or bonus token per row.
Rows with `num_draft = 0` (prefill chunks, requests without speculation)
are ordinary sampling steps.

A host proposer (n-gram lookup) has packed its tokens into the placeholders
already; `make_verify_step` runs steps 3 and 4 alone, with a one-hot `p`, and
`make_tree_verify_step` does the same for token trees: the target attends
through the tree masks, `engine.tree_verify.verify_tree_coupled` walks the
tree, and the accepted path's KV moves to consecutive positions in the same
program.

An EAGLE head (`model.eagle.EagleHead`) drafts from the target's features,
kept per KV slot in a `FeaturePool` beside the KV pools (`make_eagle_step`):
  1. one head pass per row on its last real token x_j, paired with the
     target's feature f_{j-1} (written by an earlier step), gives draft token 1;
     K - 1 more single-token passes feed the head its own predicted feature and
     the token drawn from it,
  2. the target and `verify` as above; the target's hidden state at every
     packed token goes into the feature pool,
  3. a head pass over the whole packed batch, each token x_i paired with the
     target's f_{i-1} from this step or an earlier one, rewrites the head's KV
     at every new position from the target's features (the accepted draft
     tokens' KV was written from predicted ones in 1), prefill chunks included.
So every position the target has accepted has head KV made from target
features (Li et al. 2024, EAGLE §4.2, where the draft is rerun on the
accepted tokens), and draft token 1 of the next step needs one head pass.
With token trees the head grows each row's tree instead (EAGLE-2,
`make_eagle_tree_step`) and the target verifies it as a host proposer's tree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from engine.sampler import sample
from engine.step import KVPool, StepBatch, paged_attend, step_program, to_device, token_logprobs
from engine.tree_verify import move_path_kv, verify_tree_coupled
from engine.verify import sample_draft, verify, verify_deterministic


@struct.dataclass
class SpecBatch:
    """Device arrays describing the draft tokens of a packed step (see `scheduler.packing.SpecArrays`)."""

    num_draft: jax.Array  # int32 [S], draft tokens of each row (0 = no speculation)
    draft_token_index: jax.Array  # int32 [S, K], index in the packed tokens of each placeholder (T = none)
    verify_indices: jax.Array  # int32 [S, K+1], packed index of each verify position
    draft_slots: jax.Array  # int32 [K, S], slot of draft pass j's input token (0 = masked)
    draft_tokens: jax.Array  # int32 [S, K], a host proposer's draft tokens (already in the packed tokens)
    parents: jax.Array  # int32 [S, K+1], each window node's parent (-1: the root or none)
    tree_mask: jax.Array  # int32 [T], attention masks of the step's tokens (token trees; causal elsewhere)

    @classmethod
    def from_packed(cls, spec) -> SpecBatch:
        """On the device, field by field (step programs take `to_device(SpecBatch, spec)` instead)."""
        return to_device(cls, spec).unpack()


def _single_token_batch(batch: StepBatch, tokens: jax.Array, positions: jax.Array, slots: jax.Array,
                        live: jax.Array) -> StepBatch:
    """A decode batch of one token per row (`[S]`), sharing `batch`'s block tables."""
    S = tokens.shape[0]
    return StepBatch(
        token_ids=tokens, positions=positions, slot_mapping=jnp.where(live, slots, 0),
        query_start_loc=jnp.arange(S + 1, dtype=jnp.int32), seq_lens=jnp.where(live, positions + 1, 1),
        block_tables=batch.block_tables, logits_indices=jnp.arange(S, dtype=jnp.int32),
        temperature=batch.temperature, top_k=batch.top_k, top_p=batch.top_p, min_p=batch.min_p, seeds=batch.seeds,
        want_logprobs=batch.want_logprobs)


@functools.cache
def make_spec_step(target_graphdef: nnx.GraphDef, draft_graphdef: nnx.GraphDef, attention: Callable, K: int):
    """Returns the jitted `step(target_state, draft_state, pool, draft_pool, batch, spec)`.

    Returns `(sampled, num_emitted int32 [S], path_rank, pool, draft_pool)`: `sampled`
    is an `engine.step.Sampled` over the `S * (K+1)` verify slots (row-major;
    log-probabilities only if some row wants them), row `s` emits
    `sampled.tokens[s * (K+1):][:num_emitted[s]]`, and `path_rank` is None (a chain's
    accepted tokens are its first ones; token-tree programs return ranks, as
    `make_eagle_tree_step` does). Both pools are donated. `K`
    (static) is the largest draft length in the step; `K = 0` only keeps the
    draft's KV in step with the target's and samples as `make_step` does.
    """

    @step_program(donate_argnums=(2, 3))
    def step(target_state, draft_state, pool: KVPool, draft_pool: KVPool, batch: StepBatch, spec: SpecBatch):
        draft = nnx.merge(draft_graphdef, draft_state)
        target = nnx.merge(target_graphdef, target_state)
        hidden, draft_pool = draft(batch.token_ids, batch.positions, paged_attend(batch, attention), draft_pool)
        last_pos = batch.positions[batch.logits_indices]  # [S], position of each row's last real token
        V = target.cfg.vocab_size
        sampling = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds)
        tokens, probs = [], []
        if K:
            t, p = sample_draft(draft.logits(hidden[batch.logits_indices]), *sampling, last_pos + 1)
            tokens.append(t)
            probs.append(p)
            for j in range(1, K + 1):
                live = j <= spec.num_draft
                single = _single_token_batch(batch, tokens[-1], last_pos + j, spec.draft_slots[j - 1], live)
                h, draft_pool = draft(single.token_ids, single.positions, paged_attend(single, attention),
                                      draft_pool)
                if j < K:
                    t, p = sample_draft(draft.logits(h), *sampling, last_pos + j + 1)
                    tokens.append(t)
                    probs.append(p)
        token_ids, draft_tokens, draft_probs = _place_drafts(batch, spec, tokens, probs, V)
        sampled, num_emitted, pool, _ = _target_verify(target, pool, batch, spec, token_ids, draft_tokens,
                                                       draft_probs, attention)
        return sampled, num_emitted, None, pool, draft_pool

    return step


@struct.dataclass
class FeaturePool:
    """The target's final hidden state (after the final norm) at every KV slot, for the EAGLE head.

    f: `[1, P, B, 1, E]` in the target's dtype: the KV pool's block layout, so a block
      operation (copy-on-write, swap) treats it as one more pool.
    """

    f: jax.Array

    @classmethod
    def zeros(cls, cfg, num_blocks: int, block_size: int) -> FeaturePool:
        return cls(jnp.zeros((1, num_blocks, block_size, 1, cfg.hidden_size), cfg.dtype))

    @staticmethod
    def bytes_per_block(cfg, block_size: int) -> int:
        return block_size * cfg.hidden_size * jnp.dtype(cfg.dtype).itemsize


def _features_before(features: FeaturePool, block_tables: jax.Array, rows: jax.Array,
                     positions: jax.Array) -> jax.Array:
    """f_{p-1} `[N, E]` for tokens of block-table rows `rows` int32 `[N]` at `positions` `[N]`; zeros at p = 0."""
    B = features.f.shape[2]
    prev = jnp.maximum(positions - 1, 0)
    blk = jnp.take_along_axis(block_tables[rows], (prev // B)[:, None], axis=1)[:, 0]
    return jnp.where((positions > 0)[:, None], features.f[0, blk, prev % B, 0], 0)


@functools.cache
def make_eagle_step(target_graphdef: nnx.GraphDef, head_graphdef: nnx.GraphDef, attention: Callable, K: int):
    """Returns the jitted `step(target_state, head_state, pool, head_pool, features, batch, spec)` of an
    EAGLE head (see the module docstring).

    Returns `(sampled, num_emitted, path_rank, pool, head_pool, features)`, the first three as
    `make_spec_step`'s; the three pools are donated. `K = 0` runs no draft
    pass but keeps the feature pool and the head's KV up to date.
    """

    @step_program(donate_argnums=(2, 3, 4))
    def step(target_state, head_state, pool: KVPool, head_pool: KVPool, features: FeaturePool, batch: StepBatch,
             spec: SpecBatch):
        head = nnx.merge(head_graphdef, head_state)
        target = nnx.merge(target_graphdef, target_state)
        last = batch.logits_indices
        last_pos = batch.positions[last]  # [S], position of each row's last real token
        S = last_pos.shape[0]
        V = target.cfg.vocab_size
        sampling = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds)
        tokens, probs = [], []
        if K:
            single = _single_token_batch(batch, batch.token_ids[last], last_pos, batch.slot_mapping[last],
                                         spec.num_draft > 0)
            prev = _features_before(features, batch.block_tables, jnp.arange(S), last_pos)
            h, head_pool = head(single.token_ids, prev, single.positions, paged_attend(single, attention), head_pool)
            for j in range(1, K + 1):
                t, p = sample_draft(head.logits(h), *sampling, last_pos + j)
                tokens.append(t)
                probs.append(p)
                if j < K:
                    single = _single_token_batch(batch, t, last_pos + j, spec.draft_slots[j - 1], j < spec.num_draft)
                    h, head_pool = head(single.token_ids, h, single.positions, paged_attend(single, attention),
                                        head_pool)
        token_ids, draft_tokens, draft_probs = _place_drafts(batch, spec, tokens, probs, V)
        sampled, num_emitted, pool, hidden = _target_verify(target, pool, batch, spec, token_ids, draft_tokens,
                                                            draft_probs, attention)
        B = features.f.shape[2]
        features = FeaturePool(features.f.at[0, batch.slot_mapping // B, batch.slot_mapping % B, 0].set(
            hidden.astype(features.f.dtype)))
        T = token_ids.shape[0]
        rows = jnp.clip(jnp.searchsorted(batch.query_start_loc, jnp.arange(T), side="right") - 1, 0, S - 1)
        prev = _features_before(features, batch.block_tables, rows, batch.positions)
        _, head_pool = head(token_ids, prev, batch.positions, paged_attend(batch, attention), head_pool)
        return sampled, num_emitted, None, pool, head_pool, features

    return step


def eagle_tree_shape(K: int, branching: int, max_depth: int) -> tuple[int, int]:
    """(top-k per expanded node, candidate levels) of an EAGLE-2 tree program of `K` nodes: each level's
    `branching` best nodes (fewer if K is smaller) are expanded while their window fits in K slots, at most
    `max_depth` levels deep."""
    k = min(branching, K)
    return k, min(max_depth, K, 1 + K // k)


def _ancestor_bits(parents: jax.Array, base: jax.Array) -> jax.Array:
    """int32 `[S, N]` tree masks (`pallas_kernels.reference.tree_visible`) of window nodes with `parents`
    int32 `[S, N]` (node 0 the root, -1; a parent precedes its child), the root being step token `base` `[S]`
    of its row: each node sees the row's tokens before the root and its own ancestors."""
    S, N = parents.shape
    one = jnp.int32(1)
    masks = [jnp.left_shift(one, base + 1) - 1]
    for i in range(1, N):
        above = jnp.take_along_axis(jnp.stack(masks, axis=1), jnp.clip(parents[:, i:i + 1], 0, i - 1), axis=1)[:, 0]
        masks.append(jnp.left_shift(one, base + i) | above)
    return jnp.stack(masks, axis=1)


@functools.cache
def make_eagle_tree_step(target_graphdef: nnx.GraphDef, head_graphdef: nnx.GraphDef, attention: Callable, K: int,
                         branching: int, max_depth: int, with_chains: bool = False):
    """Returns the jitted `step(target_state, head_state, pool, head_pool, features, batch, spec)` of an EAGLE
    head drafting dynamic token trees (EAGLE-2, Li et al. 2024, §4), returning what `make_eagle_step` returns
    but for `path_rank`, int32 `[S, K]`: the rank (0 = best) by confidence of each accepted node among its row's
    candidates, -1 past the accepted path. Ranks grow along a path, so a tree cut to its `n` best nodes (and at
    most as many levels as the program that drafts `n` nodes expands: `EagleProposer.depth`) would have
    accepted the path's nodes of rank < n: the cost gate's estimate of what each cut accepts
    (`engine.adaptive.CutAcceptance`). The three pools are donated.

    Each drafting row's tree is grown on the device. The head runs on the root (its last real token) and
    proposes its top-k children (k = `eagle_tree_shape`); each further level expands the k nodes of highest
    confidence (the product of the head's probabilities along the path, §4.1) by their top-k children, the
    head attending to the context and, through tree masks, to each node's ancestors (every pass re-runs the
    whole expanded window in the row's verify slots, so the kernels' tree masks need no window offset). The
    row's `num_draft` best candidates by confidence (§4.2's reranking; a node never ranks below its
    descendants, so the pick is a tree) become its verify window in level order: their tokens, positions
    (root + depth), parents and tree masks replace the packed placeholders, and the target verifies them with
    the coupled tree verify as `make_tree_verify_step` does (the output is the target's whatever is drafted).
    The head's KV and the target's features of every packed token are written as in `make_eagle_step` (a
    tree node's feature input is its parent's) and the accepted path's KV, head KV and features are moved to
    consecutive slots. Needs `K` >= 1 (`make_eagle_step(..., 0)` keeps the pools when no row drafts).

    `with_chains`: `spec.draft_tokens` holds each row's host-proposed chain (an n-gram continuation; -1 past
    it), which joins the tree ranked before the head's candidates (rank j at depth j + 1); a head candidate
    whose path from the root spells a prefix of the chain is that chain node and merges into it (its children
    hang from the chain node), so no token is verified twice under one parent.
    """
    k, levels = eagle_tree_shape(K, branching, max_depth)

    @step_program(donate_argnums=(2, 3, 4))
    def step(target_state, head_state, pool: KVPool, head_pool: KVPool, features: FeaturePool, batch: StepBatch,
             spec: SpecBatch):
        head = nnx.merge(head_graphdef, head_state)
        target = nnx.merge(target_graphdef, target_state)
        last = batch.logits_indices
        last_pos = batch.positions[last]
        S, T = last.shape[0], batch.token_ids.shape[0]
        budget = spec.num_draft  # [S] window slots of each row
        rows = jnp.arange(S)

        def confidence(h):  # [..., E] -> top-k (log-probabilities, tokens) of the head's distribution
            return head.top_k(h.reshape(-1, h.shape[-1]), k)

        single = _single_token_batch(batch, batch.token_ids[last], last_pos, batch.slot_mapping[last], budget > 0)
        # The pool's feature before each row's first step token (that token's feature input; a drafting decode
        # row starts with its root), read here only: a read after this step's writes made XLA:CPU copy the
        # pool twice, ~20 ms a step. The conditional (always true) keeps XLA from fusing the read into the last
        # head pass, after the writes.
        first = jnp.minimum(batch.query_start_loc[:-1], T - 1)
        first_prev = jax.lax.cond(T > last[0], lambda: _features_before(features, batch.block_tables, rows,
                                                                         batch.positions[first]),
                                  lambda: jnp.zeros((S, features.f.shape[-1]), features.f.dtype))
        prev = jnp.where((first == last)[:, None], first_prev,
                         _features_before(features, batch.block_tables, rows, last_pos))
        h, head_pool = head(single.token_ids, prev, single.positions, paged_attend(single, attention), head_pool)
        score, tok = confidence(h)  # [S, k]: level 1, all of them expanded next
        # Candidates in level order: token, confidence, parent candidate (-1: the root), depth.
        c_tok, c_score, c_parent, c_depth = [tok], [score], [jnp.full((S, k), -1, jnp.int32)], [1]
        front = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (S, k))  # candidate index of each frontier node
        front_h = jnp.broadcast_to(h[:, None], (S, k, h.shape[-1]))  # its feature input: its parent's output
        w_tok, w_feat, w_mask, w_depth = [], [], [], []  # the expanded window, in the rows' verify slots
        w_parent = jnp.full((S, k), -1, jnp.int32)  # window index of each frontier node's parent (-1: root)
        for level in range(1, levels):
            n0 = (level - 1) * k  # window index of this frontier's first node
            all_tok, all_score = jnp.concatenate(c_tok, 1), jnp.concatenate(c_score, 1)
            w_tok.append(jnp.take_along_axis(all_tok, front, 1))
            w_feat.append(front_h)
            w_depth += [level] * k
            above = jnp.take_along_axis(jnp.concatenate(w_mask, 1), jnp.maximum(w_parent, 0), 1) if w_mask else 0
            w_mask.append(jnp.left_shift(jnp.int32(1), n0 + jnp.arange(k, dtype=jnp.int32))[None]
                          | jnp.where(w_parent >= 0, above, 0))
            W = n0 + k
            q_len = jnp.minimum(budget, W)  # a row expands only the nodes its slots hold
            start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_len)]).astype(jnp.int32)
            j = jnp.arange(W, dtype=jnp.int32)
            live = j[None] < q_len[:, None]  # [S, W]
            dest = jnp.where(live, start[:-1, None] + j[None], S * W).reshape(-1)
            packed_index = jnp.minimum(last[:, None] + 1 + j[None], T - 1)
            window = StepBatch(
                token_ids=jnp.zeros(S * W, jnp.int32).at[dest].set(jnp.concatenate(w_tok, 1).reshape(-1), mode="drop"),
                positions=jnp.zeros(S * W, jnp.int32).at[dest].set(
                    (last_pos[:, None] + jnp.asarray(w_depth, jnp.int32)[None]).reshape(-1), mode="drop"),
                slot_mapping=jnp.zeros(S * W, jnp.int32).at[dest].set(
                    jnp.where(live, batch.slot_mapping[packed_index], 0).reshape(-1), mode="drop"),
                query_start_loc=start, seq_lens=jnp.where(q_len > 0, last_pos + 1 + q_len, 0),
                block_tables=batch.block_tables, logits_indices=last, temperature=batch.temperature,
                top_k=batch.top_k, top_p=batch.top_p, min_p=batch.min_p, seeds=batch.seeds,
                want_logprobs=batch.want_logprobs)
            masks = jnp.zeros(S * W, jnp.int32).at[dest].set(jnp.concatenate(w_mask, 1).reshape(-1), mode="drop")
            feats = jnp.zeros((S * W, h.shape[-1]), h.dtype).at[dest].set(
                jnp.concatenate(w_feat, 1).reshape(S * W, -1), mode="drop")
            hw, head_pool = head(window.token_ids, feats, window.positions, paged_attend(window, attention, masks),
                                 head_pool)
            new_h = hw[jnp.clip(start[:-1, None] + n0 + jnp.arange(k)[None], 0, S * W - 1)]  # [S, k, E]
            s2, t2 = confidence(new_h)
            expanded = (n0 + jnp.arange(k))[None] < budget[:, None]  # [S, k]
            parent_score = jnp.take_along_axis(all_score, front, 1)
            s2 = jnp.where(expanded[..., None], parent_score[..., None] + s2.reshape(S, k, k), -jnp.inf)
            offset = sum(c.shape[1] for c in c_tok)
            c_tok.append(t2.reshape(S, k * k))
            c_score.append(s2.reshape(S, k * k))
            c_parent.append(jnp.repeat(front, k, axis=1))
            c_depth.append(level + 1)
            best = jax.lax.top_k(s2.reshape(S, k * k), k)[1]  # the next frontier, among this level's children
            front_h = jnp.take_along_axis(new_h, (best // k)[..., None], 1)
            w_parent = n0 + best // k
            front = offset + best
        # Rerank every candidate; take each row's num_draft best (ties go to the earlier candidate: a parent).
        score = jnp.concatenate(c_score, 1)  # [S, candidates]
        depth = jnp.concatenate([jnp.full((S, c.shape[1]), d, jnp.int32) for c, d in zip(c_tok, c_depth)], 1)
        if with_chains:
            c_tok, score, c_parent, depth = _with_chain(spec.draft_tokens, c_tok, score, c_parent, depth)
        rank = jnp.argsort(jnp.argsort(-score, axis=1, stable=True), axis=1, stable=True)
        take = (rank < budget[:, None]) & jnp.isfinite(score)
        num_draft = jnp.sum(take, axis=1).astype(jnp.int32)
        node = jnp.where(take, jnp.cumsum(take, axis=1) - 1, K)  # window node (minus 1) of each candidate
        parent_cand = jnp.concatenate(c_parent, 1)
        parent_node = jnp.where(parent_cand < 0, 0,
                                1 + jnp.take_along_axis(node, jnp.maximum(parent_cand, 0), 1))
        scatter = lambda values, fill: jnp.full((S, K + 1), fill, jnp.int32).at[rows[:, None], node].set(
            values, mode="drop")  # candidates -> window nodes 0..K-1
        n_tok, n_parent, n_depth = scatter(jnp.concatenate(c_tok, 1), 0), scatter(parent_node, 0), scatter(depth, 1)
        n_rank = scatter(rank.astype(jnp.int32), 0)
        parents = jnp.concatenate([jnp.full((S, 1), -1, jnp.int32), n_parent[:, :K]], 1)
        base = last - batch.query_start_loc[:-1]
        slots = last[:, None] + jnp.arange(K + 1)[None]  # packed index of the root and window nodes
        is_node = (jnp.arange(K + 1)[None] <= num_draft[:, None]) & (budget > 0)[:, None]
        at = jnp.where(is_node, slots, T)
        token_ids = batch.token_ids.at[at[:, 1:]].set(n_tok[:, :K], mode="drop")
        positions = batch.positions.at[at[:, 1:]].set(last_pos[:, None] + n_depth[:, :K], mode="drop")
        tree_mask = spec.tree_mask.at[at].set(_ancestor_bits(parents, base), mode="drop")
        batch = batch.replace(token_ids=token_ids, positions=positions)
        spec = spec.replace(num_draft=jnp.where(budget > 0, num_draft, 0),
                            parents=jnp.where((budget > 0)[:, None], parents, spec.parents), tree_mask=tree_mask)
        sampled, num_emitted, pool, hidden, move, path = _tree_verify(target, pool, batch, spec, token_ids, K,
                                                                      attention)
        path_rank = jnp.where(path > 0, jnp.take_along_axis(n_rank, jnp.maximum(path - 1, 0), 1), -1)
        B = features.f.shape[2]
        token_rows = jnp.clip(jnp.searchsorted(batch.query_start_loc, jnp.arange(T), side="right") - 1, 0, S - 1)
        f = features.f.at[0, batch.slot_mapping // B, batch.slot_mapping % B, 0].set(hidden.astype(features.f.dtype))
        # Each token's feature input is the hidden state at the position before it: the step's own token before
        # it in its row, else (a row's first token) the pool's, read above.
        starts_row = jnp.arange(T) == batch.query_start_loc[token_rows]
        prev = jnp.where(starts_row[:, None], first_prev[token_rows], jnp.roll(hidden, 1, axis=0).astype(f.dtype))
        # A tree node's feature input is its parent's hidden state, not the one at the slot before it.
        parent_at = jnp.where(is_node[:, 1:], last[:, None] + parents[:, 1:], 0)
        prev = prev.at[at[:, 1:]].set(hidden[parent_at].astype(prev.dtype), mode="drop")
        _, head_pool = head(token_ids, prev, batch.positions, paged_attend(batch, attention, tree_mask), head_pool)
        return (sampled, num_emitted, path_rank, pool, KVPool(move(head_pool.k), move(head_pool.v)),
                FeaturePool(move(f)))

    return step


def _with_chain(chain: jax.Array, c_tok: list, score: jax.Array, c_parent: list, depth: jax.Array):
    """A host chain joined to an EAGLE-2 tree's candidates (`make_eagle_tree_step(..., with_chains=True)`).

    Args:
      chain: int32 `[S, C]`, each row's chain (-1 from where it ends).
      c_tok, c_parent: per level, int32 `[S, n_level]`: the head's candidates' tokens and parent candidates
        (-1: the root), in level order.
      score: float `[S, N]` their confidences (log-probabilities, <= 0); depth: int32 `[S, N]`.
    Returns:
      (c_tok, score, c_parent, depth) over the C chain nodes followed by the N head candidates: chain node j
      scores 0 (the best: ranked first, in order) and hangs from node j - 1; a head candidate that repeats
      a chain node scores -inf (never taken) and its children hang from the chain node instead.
    """
    S, C = chain.shape
    valid = jnp.cumprod(chain >= 0, axis=1).astype(bool)
    alias = []  # per level: the chain node each candidate repeats (-1: none)
    for tok, parent in zip(c_tok, c_parent):  # a parent is on an earlier level
        up = jnp.take_along_axis(jnp.concatenate(alias, 1), jnp.maximum(parent, 0), 1) if alias else -1
        at = jnp.where(parent < 0, 0, up + 1)  # the chain node this candidate would be
        j = jnp.minimum(at, C - 1)
        same = (((parent < 0) | (up >= 0)) & (at < C) & (tok == jnp.take_along_axis(chain, j, 1))
                & jnp.take_along_axis(valid, j, 1))
        alias.append(jnp.where(same, at, -1))
    alias = jnp.concatenate(alias, 1)  # [S, N]
    parent = jnp.concatenate(c_parent, 1)
    up = jnp.take_along_axis(alias, jnp.maximum(parent, 0), 1)
    head_parent = jnp.where(parent < 0, -1, jnp.where(up >= 0, up, parent + C))
    chain_parent = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32) - 1, (S, C))
    return ([jnp.maximum(chain, 0)] + list(c_tok),
            jnp.concatenate([jnp.where(valid, 0.0, -jnp.inf).astype(score.dtype), jnp.where(alias >= 0, -jnp.inf,
                                                                                              score)], 1),
            [chain_parent, head_parent],
            jnp.concatenate([jnp.broadcast_to(jnp.arange(1, C + 1, dtype=jnp.int32), (S, C)), depth], 1))


def _place_drafts(batch: StepBatch, spec: SpecBatch, tokens: list, probs: list, V: int):
    """The packed tokens with the draft tokens (K lists of `[S]`) in their placeholders, the draft tokens
    `[S, K]` and their distributions `[S, K, V]` (K = 0: the batch's tokens and empty arrays)."""
    S = spec.num_draft.shape[0]
    if not tokens:
        return batch.token_ids, jnp.zeros((S, 0), jnp.int32), jnp.zeros((S, 0, V), jnp.float32)
    draft_tokens = jnp.stack(tokens, axis=1)
    token_ids = batch.token_ids.at[spec.draft_token_index].set(draft_tokens, mode="drop")
    return token_ids, draft_tokens, jnp.stack(probs, axis=1)


def _window_rows(spec: SpecBatch, seq_lens: jax.Array, W: int) -> tuple[jax.Array, ...]:
    """The verify windows' token rows, compacted: each real row's slots 0..num_draft, in order.

    Returns, for the W compact rows, int32 `[W]` each: `rows`, the packed token index; `seq`, the sequence;
    `flat`, the window slot (s * (K+1) + i); and `slot` int32 `[S, K+1]`, the compact row of each window
    slot (a slot past the window reads its row's slot 0). `W` = min(T, S (K+1)) holds them all: a real
    row has at least 1 + num_draft tokens in the step and padding rows (seq_len 0) have none.
    """
    S, K1 = spec.verify_indices.shape
    valid = (jnp.arange(K1)[None, :] <= spec.num_draft[:, None]) & (seq_lens > 0)[:, None]
    index = (jnp.cumsum(valid.reshape(-1)) - 1).reshape(S, K1)
    dest = jnp.where(valid, index, W).reshape(-1)  # slots past a window are dropped
    rows = jnp.zeros(W, jnp.int32).at[dest].set(spec.verify_indices.reshape(-1), mode="drop")
    flat = jnp.zeros(W, jnp.int32).at[dest].set(jnp.arange(S * K1, dtype=jnp.int32), mode="drop")
    slot = jnp.clip(jnp.where(valid, index, index[:, :1]), 0, W - 1)
    return rows, flat // K1, flat, slot


def _target_verify(target, pool: KVPool, batch: StepBatch, spec: SpecBatch, token_ids: jax.Array,
                   draft_tokens: jax.Array, draft_probs: jax.Array | None, attention: Callable):
    """The target over the packed batch (verify windows included), then `verify` (or `verify_deterministic`
    when `draft_probs` is None: a deterministic proposal) and the log-probabilities; returns
    `(sampled, num_emitted, pool, hidden [T, E])`.

    The LM head runs on the windows' real slots only (`_window_rows`): a batch where few rows draft costs
    little more than a plain step, not S (K+1) rows of logits.
    """
    S, K = draft_tokens.shape
    hidden, pool = target(token_ids, batch.positions, paged_attend(batch, attention), pool)
    rows, seq, flat, slot = _window_rows(spec, batch.seq_lens, min(hidden.shape[0], S * (K + 1)))
    logits = target.logits(hidden[rows])  # [W, V]
    if draft_probs is None:
        # The target's token at each slot, drawn exactly as the plain sampler draws the token at its position.
        choice = sample(logits, batch.temperature[seq], batch.top_k[seq], batch.top_p[seq], batch.min_p[seq],
                        batch.seeds[seq], batch.positions[rows] + 1)
        out, num_emitted = verify_deterministic(choice[slot], draft_tokens, spec.num_draft)
    else:
        last_pos = batch.positions[batch.logits_indices]
        sampling = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds)
        out, num_emitted = verify(logits[slot], draft_probs, draft_tokens, spec.num_draft, *sampling, last_pos + 1)
    # Log-probabilities on the compact rows too; each compact row's token is its slot's emitted one.
    emitted = jnp.maximum(out.reshape(-1), 0)
    sampled = token_logprobs(logits, emitted[flat], batch.want_logprobs[seq])
    sampled = jax.tree.map(lambda x: x[slot.reshape(-1)], sampled).replace(tokens=emitted)
    return sampled, num_emitted, pool, hidden


@functools.cache
def make_verify_step(target_graphdef: nnx.GraphDef, attention: Callable, K: int):
    """Returns the jitted `step(target_state, pool, batch, spec) -> (sampled, num_emitted, pool)` for a host
    proposer: the draft tokens are in `batch.token_ids` and `spec.draft_tokens` already, and the proposal
    is deterministic (a one-hot `p`), verified by `engine.verify.verify_deterministic` (the output equals
    that without speculation). Outputs as `make_spec_step`'s; the pool is donated."""

    @step_program(donate_argnums=(1,))
    def step(target_state, pool: KVPool, batch: StepBatch, spec: SpecBatch):
        target = nnx.merge(target_graphdef, target_state)
        return _target_verify(target, pool, batch, spec, batch.token_ids, spec.draft_tokens, None, attention)[:3]

    return step


def _tree_verify(target, pool: KVPool, batch: StepBatch, spec: SpecBatch, token_ids: jax.Array, K: int,
                 attention: Callable):
    """The target over the packed batch with token trees in its verify windows, then the coupled tree verify
    and the accepted paths' KV moves (see `make_tree_verify_step`). Returns `(sampled, num_emitted, pool,
    hidden [T, E], move, path)`: `hidden` per packed token, `move(x)`, which moves the accepted paths' slots
    of any per-slot array laid out as the KV pool (`[L, P, B, H, D]`) as the KV was moved, and `path` int32
    `[S, K]`, the window node (1..K) of each accepted node, -1 past the path."""
    S = spec.num_draft.shape[0]
    hidden, pool = target(token_ids, batch.positions, paged_attend(batch, attention, spec.tree_mask), pool)
    rows, seq, flat, slot = _window_rows(spec, batch.seq_lens, min(hidden.shape[0], S * (K + 1)))
    logits = target.logits(hidden[rows])  # [W, V]
    choice = sample(logits, batch.temperature[seq], batch.top_k[seq], batch.top_p[seq], batch.min_p[seq],
                    batch.seeds[seq], batch.positions[rows] + 1)
    nodes = token_ids[spec.verify_indices]  # [S, K+1], the root then the nodes
    out, num_emitted, path = verify_tree_coupled(choice[slot], nodes, spec.parents, spec.num_draft + 1)
    root = jnp.where((spec.num_draft > 0) & (batch.seq_lens > 0), batch.positions[batch.logits_indices], -1)
    # K = 0 accepts no node, so nothing moves. (XLA:CPU turns the one-slot scatter into a select over the
    # whole pool, ~130 ms a pool on SmolLM2's, so it is left out of the program rather than run as a no-op.)
    move = (lambda x: move_path_kv(x, batch.block_tables, root, path)) if K else (lambda x: x)
    pool = KVPool(move(pool.k), move(pool.v))
    # Emitted token j comes from node path[j - 1] (the root for j = 0): log-probabilities on the compact
    # rows, each row scoring the token emitted from its node, then gathered per emitted slot.
    rows_ = jnp.arange(S)[:, None]
    source = jnp.concatenate([jnp.zeros((S, 1), jnp.int32), path[:, :K]], axis=1)  # [S, K+1]
    live = jnp.arange(K + 1)[None, :] < num_emitted[:, None]
    emitted = jnp.maximum(out, 0)
    at_node = jnp.zeros((S, K + 1), jnp.int32).at[rows_, jnp.where(live, source, K + 1)].set(emitted, mode="drop")
    sampled = token_logprobs(logits, at_node.reshape(-1)[flat], batch.want_logprobs[seq])
    by_slot = slot[rows_, jnp.maximum(source, 0)].reshape(-1)
    sampled = jax.tree.map(lambda x: x[by_slot], sampled).replace(tokens=emitted.reshape(-1))
    return sampled, num_emitted, pool, hidden, move, path[:, :K]


@functools.cache
def make_tree_verify_step(target_graphdef: nnx.GraphDef, attention: Callable, K: int):
    """Returns the jitted `step(target_state, pool, batch, spec) -> (sampled, num_emitted, pool)` for a host
    proposer's token trees (a chain is a tree too): window node i of a row holds position root + depth(i)
    and KV slot root + i, attends to its ancestors (`spec.tree_mask`); the target's token after each node is
    drawn as the plain sampler draws it, `verify_tree_coupled` follows the nodes that hold them (so the
    output equals decoding without speculation), and the accepted path's KV is moved to positions
    root + 1, root + 2, ... before the program returns. Outputs as `make_spec_step`'s; the pool is donated."""

    @step_program(donate_argnums=(1,))
    def step(target_state, pool: KVPool, batch: StepBatch, spec: SpecBatch):
        target = nnx.merge(target_graphdef, target_state)
        return _tree_verify(target, pool, batch, spec, batch.token_ids, K, attention)[:3]

    return step


@functools.cache
def make_medusa_step(target_graphdef: nnx.GraphDef, heads_graphdef: nnx.GraphDef, attention: Callable,
                     K: int, tree: tuple[tuple[int, ...], tuple[int, ...]]):
    """Returns the jitted `step(target_state, heads_state, pool, features, batch, spec)` of Medusa heads
    (`model.medusa.MedusaHeads`), returning `(sampled, num_emitted, path_rank, pool, features)` as
    `make_eagle_tree_step` does (a node's rank is its index in the static tree, whose every prefix is the best
    tree of its size); the pools are donated.

    With `K` > 0, each drafting row's heads read the target's feature at the position before its last real
    token (the hidden state whose logits gave that token, from the `FeaturePool`) and their candidates fill
    the static tree `tree` = (heads, ranks) of node 1..K (`model.medusa.medusa_tree`; a cut tree keeps its
    first nodes); the target then verifies the trees as `make_tree_verify_step` does. Every step writes the
    target's hidden state at each packed token into the feature pool and moves the accepted paths' features
    with their KV, so the next step's heads read the feature of the last accepted node. `K = 0` only keeps
    the feature pool up to date.
    """
    heads_of, ranks_of = (jnp.asarray(x, jnp.int32) for x in tree)
    n = max(tree[1]) + 1 if K else 0

    @step_program(donate_argnums=(2, 3))
    def step(target_state, heads_state, pool: KVPool, features: FeaturePool, batch: StepBatch, spec: SpecBatch):
        target = nnx.merge(target_graphdef, target_state)
        token_ids = batch.token_ids
        if K:
            heads = nnx.merge(heads_graphdef, heads_state)
            S = spec.num_draft.shape[0]
            prev = _features_before(features, batch.block_tables, jnp.arange(S), batch.positions[batch.logits_indices])
            candidates = heads.candidates(prev, n)  # [S, heads, n]
            token_ids = token_ids.at[spec.draft_token_index].set(candidates[:, heads_of, ranks_of], mode="drop")
        B = features.f.shape[2]
        sampled, num_emitted, pool, hidden, move, path = _tree_verify(target, pool, batch, spec, token_ids, K,
                                                                      attention)
        f = features.f.at[0, batch.slot_mapping // B, batch.slot_mapping % B, 0].set(hidden.astype(features.f.dtype))
        return sampled, num_emitted, path - (path > 0), pool, FeaturePool(move(f))

    return step
