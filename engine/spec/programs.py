"""Speculative decoding's step programs: one jitted program per step, draft (if on the device) + target + verify.

This module holds the verify programs of host proposers and what every program shares; a device
proposer's drafting programs live beside it (`engine.spec.draft.make_spec_step`,
`engine.spec.eagle.make_eagle_step` and `make_eagle_tree_step`, `engine.spec.medusa.make_medusa_step`).

Sources: Leviathan et al. 2023 (§2.3, Algorithm 1) and Chen et al. 2023
(Algorithm 2) for the proposal/verify scheme; the verify itself is
`engine.spec.verify.verify`.

The draft keeps its own paged KV pool with the target's shape of block
tables: it is indexed by the same block ids and slots, so one allocation (and
one prefix-cache entry) covers both models, and rolling back rejected tokens
needs nothing beyond lowering the sequence length. The draft therefore sees
every token the target sees, prefill chunks included.

One step program (`make_spec_step`) runs, on a packed batch whose decode
rows carry `G_i` placeholder tokens after their last accepted token:
  1. the draft over the whole packed batch (KV for every new token; its
     logits at each row's last real token give draft token 1),
  2. `G` single-token draft passes: pass j feeds draft token j at its
     position (writing its KV, so after a fully accepted round the draft is
     level with the target) and, for j < G, proposes token j + 1,
  3. the target over the packed batch with the draft tokens written into the
     placeholders (the verify window of G + 1 positions per row),
  4. `verify`: accepted tokens plus one correction or bonus token per row.
Rows with `num_draft = 0` (prefill chunks, requests without speculation)
are ordinary sampling steps.

A host proposer (n-gram lookup) has packed its tokens into the placeholders
already; `make_verify_step` runs steps 3 and 4 alone, with a one-hot `p`, and
`make_tree_verify_step` does the same for token trees: the target attends
through the tree masks, `engine.spec.tree_verify.verify_tree_coupled` walks the
tree, and the accepted path's KV moves to consecutive positions in the same
program.

An EAGLE head (`model.eagle.EagleHead`) drafts from the target's features,
kept per KV slot in a `FeaturePool` beside the KV pools (`make_eagle_step`):
  1. one head pass per row on its last real token x_j, paired with the
     target's feature f_{j-1} (written by an earlier step), gives draft token 1;
     G - 1 more single-token passes feed the head its own predicted feature and
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
from engine.spec.tree_verify import move_path_kv, verify_tree_coupled
from engine.spec.verify import verify, verify_deterministic


@struct.dataclass
class SpecBatch:
    """Device arrays describing the draft tokens of a packed step (see `scheduler.packing.SpecArrays`)."""

    num_draft: jax.Array  # int32 [S], draft tokens of each row (0 = no speculation)
    draft_token_index: jax.Array  # int32 [S, G], index in the packed tokens of each placeholder (T = none)
    verify_indices: jax.Array  # int32 [S, G+1], packed index of each verify position
    draft_slots: jax.Array  # int32 [G, S], slot of draft pass j's input token (0 = masked)
    draft_tokens: jax.Array  # int32 [S, G], a host proposer's draft tokens (already in the packed tokens)
    parents: jax.Array  # int32 [S, G+1], each window node's parent (-1: the root or none)
    tree_mask: jax.Array  # int32 [T], attention masks of the step's tokens (token trees; causal elsewhere)

    @classmethod
    def from_packed(cls, spec) -> SpecBatch:
        """On the device, field by field (step programs take `to_device(SpecBatch, spec)` instead)."""
        return to_device(cls, spec).unpack()


def single_token_batch(batch: StepBatch, tokens: jax.Array, positions: jax.Array, slots: jax.Array,
                        live: jax.Array) -> StepBatch:
    """A decode batch of one token per row (`[S]`), sharing `batch`'s block tables."""
    S = tokens.shape[0]
    return StepBatch(
        token_ids=tokens, positions=positions, slot_mapping=jnp.where(live, slots, 0),
        query_start_loc=jnp.arange(S + 1, dtype=jnp.int32), seq_lens=jnp.where(live, positions + 1, 1),
        block_tables=batch.block_tables, logits_indices=jnp.arange(S, dtype=jnp.int32),
        temperature=batch.temperature, top_k=batch.top_k, top_p=batch.top_p, min_p=batch.min_p, seeds=batch.seeds,
        want_logprobs=batch.want_logprobs)


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


def features_before(features: FeaturePool, block_tables: jax.Array, rows: jax.Array,
                     positions: jax.Array) -> jax.Array:
    """f_{p-1} `[N, E]` for tokens of block-table rows `rows` int32 `[N]` at `positions` `[N]`; zeros at p = 0."""
    B = features.f.shape[2]
    prev = jnp.maximum(positions - 1, 0)
    blk = jnp.take_along_axis(block_tables[rows], (prev // B)[:, None], axis=1)[:, 0]
    return jnp.where((positions > 0)[:, None], features.f[0, blk, prev % B, 0], 0)


def place_drafts(batch: StepBatch, spec: SpecBatch, tokens: list, probs: list, V: int):
    """The packed tokens with the draft tokens (G lists of `[S]`) in their placeholders, the draft tokens
    `[S, G]` and their distributions `[S, G, V]` (G = 0: the batch's tokens and empty arrays)."""
    S = spec.num_draft.shape[0]
    if not tokens:
        return batch.token_ids, jnp.zeros((S, 0), jnp.int32), jnp.zeros((S, 0, V), jnp.float32)
    draft_tokens = jnp.stack(tokens, axis=1)
    token_ids = batch.token_ids.at[spec.draft_token_index].set(draft_tokens, mode="drop")
    return token_ids, draft_tokens, jnp.stack(probs, axis=1)


def _window_rows(spec: SpecBatch, seq_lens: jax.Array, W: int) -> tuple[jax.Array, ...]:
    """The verify windows' token rows, compacted: each real row's slots 0..num_draft, in order.

    Returns, for the W compact rows, int32 `[W]` each: `rows`, the packed token index; `seq`, the sequence;
    `flat`, the window slot (s * (G+1) + i); and `slot` int32 `[S, G+1]`, the compact row of each window
    slot (a slot past the window reads its row's slot 0). `W` = min(T, S (G+1)) holds them all: a real
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


def target_verify(target, pool: KVPool, batch: StepBatch, spec: SpecBatch, token_ids: jax.Array,
                   draft_tokens: jax.Array, draft_probs: jax.Array | None, attention: Callable):
    """The target over the packed batch (verify windows included), then `verify` (or `verify_deterministic`
    when `draft_probs` is None: a deterministic proposal) and the log-probabilities; returns
    `(sampled, num_emitted, pool, hidden [T, E])`.

    The LM head runs on the windows' real slots only (`_window_rows`): a batch where few rows draft costs
    little more than a plain step, not S (G+1) rows of logits.
    """
    S, G = draft_tokens.shape
    hidden, pool = target(token_ids, batch.positions, paged_attend(batch, attention), pool)
    rows, seq, flat, slot = _window_rows(spec, batch.seq_lens, min(hidden.shape[0], S * (G + 1)))
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
def make_verify_step(target_graphdef: nnx.GraphDef, attention: Callable, G: int):
    """Returns the jitted `step(target_state, pool, batch, spec) -> (sampled, num_emitted, pool)` for a host
    proposer: the draft tokens are in `batch.token_ids` and `spec.draft_tokens` already, and the proposal
    is deterministic (a one-hot `p`), verified by `engine.spec.verify.verify_deterministic` (the output equals
    that without speculation). Outputs as `make_spec_step`'s; the pool is donated."""

    @step_program(donate_argnums=(1,))
    def step(target_state, pool: KVPool, batch: StepBatch, spec: SpecBatch):
        target = nnx.merge(target_graphdef, target_state)
        return target_verify(target, pool, batch, spec, batch.token_ids, spec.draft_tokens, None, attention)[:3]

    return step


def target_verify_tree(target, pool: KVPool, batch: StepBatch, spec: SpecBatch, token_ids: jax.Array, G: int,
                 attention: Callable):
    """The target over the packed batch with token trees in its verify windows, then the coupled tree verify
    and the accepted paths' KV moves (see `make_tree_verify_step`). Returns `(sampled, num_emitted, pool,
    hidden [T, E], move, path)`: `hidden` per packed token, `move(x)`, which moves the accepted paths' slots
    of any per-slot array laid out as the KV pool (`[L, P, B, H, D]`) as the KV was moved, and `path` int32
    `[S, G]`, the window node (1..G) of each accepted node, -1 past the path."""
    S = spec.num_draft.shape[0]
    hidden, pool = target(token_ids, batch.positions, paged_attend(batch, attention, spec.tree_mask), pool)
    rows, seq, flat, slot = _window_rows(spec, batch.seq_lens, min(hidden.shape[0], S * (G + 1)))
    logits = target.logits(hidden[rows])  # [W, V]
    choice = sample(logits, batch.temperature[seq], batch.top_k[seq], batch.top_p[seq], batch.min_p[seq],
                    batch.seeds[seq], batch.positions[rows] + 1)
    nodes = token_ids[spec.verify_indices]  # [S, G+1], the root then the nodes
    out, num_emitted, path = verify_tree_coupled(choice[slot], nodes, spec.parents, spec.num_draft + 1)
    root = jnp.where((spec.num_draft > 0) & (batch.seq_lens > 0), batch.positions[batch.logits_indices], -1)
    # G = 0 accepts no node, so nothing moves. (XLA:CPU turns the one-slot scatter into a select over the
    # whole pool, ~130 ms a pool on SmolLM2's, so it is left out of the program rather than run as a no-op.)
    move = (lambda x: move_path_kv(x, batch.block_tables, root, path)) if G else (lambda x: x)
    pool = KVPool(move(pool.k), move(pool.v))
    # Emitted token j comes from node path[j - 1] (the root for j = 0): log-probabilities on the compact
    # rows, each row scoring the token emitted from its node, then gathered per emitted slot.
    rows_ = jnp.arange(S)[:, None]
    source = jnp.concatenate([jnp.zeros((S, 1), jnp.int32), path[:, :G]], axis=1)  # [S, G+1]
    live = jnp.arange(G + 1)[None, :] < num_emitted[:, None]
    emitted = jnp.maximum(out, 0)
    at_node = jnp.zeros((S, G + 1), jnp.int32).at[rows_, jnp.where(live, source, G + 1)].set(emitted, mode="drop")
    sampled = token_logprobs(logits, at_node.reshape(-1)[flat], batch.want_logprobs[seq])
    by_slot = slot[rows_, jnp.maximum(source, 0)].reshape(-1)
    sampled = jax.tree.map(lambda x: x[by_slot], sampled).replace(tokens=emitted.reshape(-1))
    return sampled, num_emitted, pool, hidden, move, path[:, :G]


@functools.cache
def make_tree_verify_step(target_graphdef: nnx.GraphDef, attention: Callable, G: int):
    """Returns the jitted `step(target_state, pool, batch, spec) -> (sampled, num_emitted, pool)` for a host
    proposer's token trees (a chain is a tree too): window node i of a row holds position root + depth(i)
    and KV slot root + i, attends to its ancestors (`spec.tree_mask`); the target's token after each node is
    drawn as the plain sampler draws it, `verify_tree_coupled` follows the nodes that hold them (so the
    output equals decoding without speculation), and the accepted path's KV is moved to positions
    root + 1, root + 2, ... before the program returns. Outputs as `make_spec_step`'s; the pool is donated."""

    @step_program(donate_argnums=(1,))
    def step(target_state, pool: KVPool, batch: StepBatch, spec: SpecBatch):
        target = nnx.merge(target_graphdef, target_state)
        return target_verify_tree(target, pool, batch, spec, batch.token_ids, G, attention)[:3]

    return step
