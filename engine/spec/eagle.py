"""An EAGLE head as a proposer: chains and EAGLE-2 trees drafted from the target's features.

Sources: Li et al. 2024, *EAGLE* (§4.2) and *EAGLE-2* (dynamic draft trees).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from engine.spec.config import SpeculationConfig
from engine.spec.draft import DraftModelProposer
from engine.spec.gate import gate_caps
from engine.spec.ngram import Contexts
from engine.spec.programs import (FeaturePool, SpecBatch, features_before, place_drafts, single_token_batch,
                                  target_verify, target_verify_tree)
from engine.spec.verify import sample_draft
from engine.step import KVPool, StepBatch, paged_attend, step_program
from model.eagle import FC
from scheduler.request import Request
from scheduler.scheduler import StepPlan


class EagleProposer(DraftModelProposer):
    """An EAGLE head (`model.eagle.EagleHead`) drafting from the target's features, inside the step program.

    The head's own KV and the target's final hidden state at every KV slot
    (`engine.spec.programs.FeaturePool`) are kept beside the target's pool; a
    step that runs without the head leaves them behind for its requests,
    which then stop drafting (as with a draft model). With `config.tree_nodes`
    the head drafts EAGLE-2 dynamic trees of up to that many nodes, `tree_branching`
    wide and at most G deep, verified by the coupled tree verify
    (`engine.spec.eagle.make_eagle_tree_step`), so the output is the target's
    whatever is drafted (`output_independent`). With `config.ngram_in_tree` the
    host's n-gram lookup adds its chain to each tree where the context has a
    match (one tree from two proposers: a copied span and the head's guesses
    are verified in one step), and acceptance is estimated per request class and
    matched n-gram size, as `engine.spec.ngram.NgramProposer` does.

    Args:
      head: a `checkpoints.LoadedModel` whose params hold `model.eagle.FC` (`checkpoints.draft.load_draft`).
      config: G, the trees and the adaptive-speculation settings.
      target_config: the target's `ModelConfig`.
      engine_config: the engine's config (the CPU kernel settings).
    Raises:
      ValueError: not an EAGLE head, or its width or vocabulary differs from the target's.
    """

    kind = "eagle"

    def __init__(self, head, config: SpeculationConfig, target_config, engine_config):
        if FC not in head.params:
            raise ValueError(f"{head.config.name} is not an EAGLE head (no {FC})")
        if head.config.hidden_size != target_config.hidden_size:
            raise ValueError(f"the EAGLE head's width ({head.config.hidden_size}) differs from the target's "
                             f"({target_config.hidden_size})")
        super().__init__(head, config, target_config.vocab_size, engine_config)
        self.target_config = target_config
        self._contexts = Contexts(config.prompt_lookup_max, config.prompt_lookup_min)
        self._chains: dict[str, tuple[list[int], int]] = {}  # request id -> (n-gram chain, matched n)

    def pools(self, num_blocks: int, block_size: int) -> tuple:
        return (*super().pools(num_blocks, block_size), FeaturePool.zeros(self.target_config, num_blocks, block_size))

    def bytes_per_block(self, block_size: int) -> int:
        return super().bytes_per_block(block_size) + FeaturePool.bytes_per_block(self.target_config, block_size)

    @property
    def output_independent(self) -> bool:
        """Token trees are verified by the coupled tree verify: the output is the target's whatever is drafted."""
        return bool(self.config.tree_nodes)

    def proposal_len(self, request: Request, k: int) -> int:
        """Chains: the policy's G. Trees: the node budget (the request's `num_tree_nodes` caps it), shrunk in
        proportion when the policy lowers G."""
        c = self.config
        n = c.tree_nodes
        if not n or not k:
            return k
        if c.ngram_in_tree:
            self._chains[request.request_id] = self._contexts.index(request).lookup(c.num_speculative_tokens)
        n = min(n, request.sampling.num_tree_nodes or n)
        return max(1, n * k // c.num_speculative_tokens)

    def acceptance_key(self, request: Request) -> str | tuple:
        """With n-gram chains in the trees: the class and the matched n-gram size (0: no match)."""
        if not self.config.ngram_in_tree:
            return request.request_class
        return request.request_class, self._chains.get(request.request_id, ((), 0))[1]

    def proposals(self, plan: StepPlan) -> dict[str, list[int]] | None:
        """With n-gram chains in the trees: each drafting row's chain, cut to its window and padded with -1."""
        if not self.config.ngram_in_tree:  # implies trees (SpeculationConfig)
            return None
        out = {}
        for s in plan.seqs:
            if s.num_draft:
                chain = self._chains.get(s.request.request_id, ((), 0))[0][:s.num_draft]
                out[s.request.request_id] = [*chain, *[-1] * (s.num_draft - len(chain))]
        return out

    @property
    def program_ks(self) -> tuple[int, ...]:
        """Trees: one program per gate cut (the head's drafting passes grow with the node count)."""
        return gate_caps(self.config, True) if self.config.tree_nodes else super().program_ks

    def depth(self, request: Request, k: int) -> int:
        """A tree of `k` nodes is at most k deep and at most as deep as the levels (`eagle_tree_shape`) of the
        program that drafts it, the smallest of `program_ks` that holds k nodes, or as its n-gram chain."""
        if not self.config.tree_nodes or not k:
            return k
        G = min(c for c in self.program_ks if c >= k)
        levels = eagle_tree_shape(G, self.config.tree_branching, self.config.num_speculative_tokens)[1]
        chain = self._chains.get(request.request_id, ((), 0))[0] if request is not None else ()
        return min(k, max(levels, len(chain)))

    def tree_parents(self, plan: StepPlan) -> dict[str, list[int]] | None:
        """Trees: placeholder chains (the program picks each row's tree and rewrites its masks and positions)."""
        if not self.config.tree_nodes:
            return None
        return {s.request.request_id: list(range(s.num_draft)) for s in plan.seqs if s.num_draft}

    def step_program(self, target_graphdef, attention, G: int):
        """The jitted step for draft length `G` (`engine.spec.eagle.make_eagle_step`), or for trees of `G`
        nodes (`make_eagle_tree_step`)."""
        if self.config.tree_nodes and G:
            return make_eagle_tree_step(target_graphdef, self.graphdef, attention, G, self.config.tree_branching,
                                        self.config.num_speculative_tokens, self.config.ngram_in_tree)
        return make_eagle_step(target_graphdef, self.graphdef, attention, G)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._contexts.forget(request_id)
        self._chains.pop(request_id, None)


@functools.cache
def make_eagle_step(target_graphdef: nnx.GraphDef, head_graphdef: nnx.GraphDef, attention: Callable, G: int):
    """Returns the jitted `step(target_state, head_state, pool, head_pool, features, batch, spec)` of an
    EAGLE head (see the module docstring).

    Returns `(sampled, num_emitted, path_rank, pool, head_pool, features)`, the first three as
    `make_spec_step`'s; the three pools are donated. `G = 0` runs no draft
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
        if G:
            single = single_token_batch(batch, batch.token_ids[last], last_pos, batch.slot_mapping[last],
                                         spec.num_draft > 0)
            prev = features_before(features, batch.block_tables, jnp.arange(S), last_pos)
            h, head_pool = head(single.token_ids, prev, single.positions, paged_attend(single, attention), head_pool)
            for j in range(1, G + 1):
                t, p = sample_draft(head.logits(h), *sampling, last_pos + j)
                tokens.append(t)
                probs.append(p)
                if j < G:
                    single = single_token_batch(batch, t, last_pos + j, spec.draft_slots[j - 1], j < spec.num_draft)
                    h, head_pool = head(single.token_ids, h, single.positions, paged_attend(single, attention),
                                        head_pool)
        token_ids, draft_tokens, draft_probs = place_drafts(batch, spec, tokens, probs, V)
        sampled, num_emitted, pool, hidden = target_verify(target, pool, batch, spec, token_ids, draft_tokens,
                                                            draft_probs, attention)
        B = features.f.shape[2]
        features = FeaturePool(features.f.at[0, batch.slot_mapping // B, batch.slot_mapping % B, 0].set(
            hidden.astype(features.f.dtype)))
        T = token_ids.shape[0]
        rows = jnp.clip(jnp.searchsorted(batch.query_start_loc, jnp.arange(T), side="right") - 1, 0, S - 1)
        prev = features_before(features, batch.block_tables, rows, batch.positions)
        _, head_pool = head(token_ids, prev, batch.positions, paged_attend(batch, attention), head_pool)
        return sampled, num_emitted, None, pool, head_pool, features

    return step


def eagle_tree_shape(G: int, branching: int, max_depth: int) -> tuple[int, int]:
    """(top-k per expanded node, candidate levels) of an EAGLE-2 tree program of `G` nodes: each level's
    `branching` best nodes (fewer if G is smaller) are expanded while their window fits in G slots, at most
    `max_depth` levels deep."""
    k = min(branching, G)
    return k, min(max_depth, G, 1 + G // k)


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
def make_eagle_tree_step(target_graphdef: nnx.GraphDef, head_graphdef: nnx.GraphDef, attention: Callable, G: int,
                         branching: int, max_depth: int, with_chains: bool = False):
    """Returns the jitted `step(target_state, head_state, pool, head_pool, features, batch, spec)` of an EAGLE
    head drafting dynamic token trees (EAGLE-2, Li et al. 2024, §4), returning what `make_eagle_step` returns
    but for `path_rank`, int32 `[S, G]`: the rank (0 = best) by confidence of each accepted node among its row's
    candidates, -1 past the accepted path. Ranks grow along a path, so a tree cut to its `n` best nodes (and at
    most as many levels as the program that drafts `n` nodes expands: `EagleProposer.depth`) would have
    accepted the path's nodes of rank < n: the cost gate's estimate of what each cut accepts
    (`engine.spec.acceptance.CutAcceptance`). The three pools are donated.

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
    consecutive slots. Needs `G` >= 1 (`make_eagle_step(..., 0)` keeps the pools when no row drafts).

    `with_chains`: `spec.draft_tokens` holds each row's host-proposed chain (an n-gram continuation; -1 past
    it), which joins the tree ranked before the head's candidates (rank j at depth j + 1); a head candidate
    whose path from the root spells a prefix of the chain is that chain node and merges into it (its children
    hang from the chain node), so no token is verified twice under one parent.
    """
    k, levels = eagle_tree_shape(G, branching, max_depth)

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

        single = single_token_batch(batch, batch.token_ids[last], last_pos, batch.slot_mapping[last], budget > 0)
        # The pool's feature before each row's first step token (that token's feature input; a drafting decode
        # row starts with its root), read here only: a read after this step's writes made XLA:CPU copy the
        # pool twice, ~20 ms a step. The conditional (always true) keeps XLA from fusing the read into the last
        # head pass, after the writes.
        first = jnp.minimum(batch.query_start_loc[:-1], T - 1)
        first_prev = jax.lax.cond(T > last[0], lambda: features_before(features, batch.block_tables, rows,
                                                                         batch.positions[first]),
                                  lambda: jnp.zeros((S, features.f.shape[-1]), features.f.dtype))
        prev = jnp.where((first == last)[:, None], first_prev,
                         features_before(features, batch.block_tables, rows, last_pos))
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
        node = jnp.where(take, jnp.cumsum(take, axis=1) - 1, G)  # window node (minus 1) of each candidate
        parent_cand = jnp.concatenate(c_parent, 1)
        parent_node = jnp.where(parent_cand < 0, 0,
                                1 + jnp.take_along_axis(node, jnp.maximum(parent_cand, 0), 1))
        scatter = lambda values, fill: jnp.full((S, G + 1), fill, jnp.int32).at[rows[:, None], node].set(
            values, mode="drop")  # candidates -> window nodes 0..G-1
        n_tok, n_parent, n_depth = scatter(jnp.concatenate(c_tok, 1), 0), scatter(parent_node, 0), scatter(depth, 1)
        n_rank = scatter(rank.astype(jnp.int32), 0)
        parents = jnp.concatenate([jnp.full((S, 1), -1, jnp.int32), n_parent[:, :G]], 1)
        base = last - batch.query_start_loc[:-1]
        slots = last[:, None] + jnp.arange(G + 1)[None]  # packed index of the root and window nodes
        is_node = (jnp.arange(G + 1)[None] <= num_draft[:, None]) & (budget > 0)[:, None]
        at = jnp.where(is_node, slots, T)
        token_ids = batch.token_ids.at[at[:, 1:]].set(n_tok[:, :G], mode="drop")
        positions = batch.positions.at[at[:, 1:]].set(last_pos[:, None] + n_depth[:, :G], mode="drop")
        tree_mask = spec.tree_mask.at[at].set(_ancestor_bits(parents, base), mode="drop")
        batch = batch.replace(token_ids=token_ids, positions=positions)
        spec = spec.replace(num_draft=jnp.where(budget > 0, num_draft, 0),
                            parents=jnp.where((budget > 0)[:, None], parents, spec.parents), tree_mask=tree_mask)
        sampled, num_emitted, pool, hidden, move, path = target_verify_tree(target, pool, batch, spec, token_ids, G,
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
