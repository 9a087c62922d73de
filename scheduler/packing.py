"""Turns a StepPlan into the padded numpy arrays of the unified step (host only)."""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from scheduler.scheduler import StepPlan


def power_of_two_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `limit` (appended if not a power of two)."""
    buckets = [1]
    while buckets[-1] * 2 < limit:
        buckets.append(buckets[-1] * 2)
    if buckets[-1] < limit:
        buckets.append(limit)
    return tuple(buckets)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n; raises ValueError if n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


# From this token bucket up a step is mostly prefill, and its sequence count pads to a power of 4 (1, 4, 16,
# 64): a few more rows of logits on a long step, and a third fewer step programs there to compile (BUILD.md).
COARSE_SEQS_FROM = 128


def seq_buckets_for(T: int, seq_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The sequence buckets a step of token bucket `T` pads to: all of `seq_buckets` below
    `COARSE_SEQS_FROM` tokens, from there its powers of 4 and its largest."""
    if T < COARSE_SEQS_FROM:
        return seq_buckets
    return tuple(s for s in seq_buckets if (s & (s - 1) == 0 and s & 0x55555555) or s == seq_buckets[-1])


def step_shape(num_tokens: int, num_seqs: int, token_buckets: tuple[int, ...],
               seq_buckets: tuple[int, ...]) -> tuple[int, int]:
    """The (token bucket T, sequence bucket S) a step of `num_tokens` tokens over `num_seqs` sequences pads to;
    raises ValueError past the largest buckets."""
    T = bucket_for(max(num_tokens, 1), token_buckets)
    return T, bucket_for(max(num_seqs, 1), seq_buckets_for(T, seq_buckets))


def step_buckets(token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...]) -> list[tuple[int, int]]:
    """Every (T, S) shape `step_shape` gives (S <= T: a sequence has at least one token)."""
    return [(t, s) for t in token_buckets for s in seq_buckets_for(t, seq_buckets) if s <= t]


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One step's inputs, padded to a (token bucket T, sequence bucket S) shape."""

    token_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    slot_mapping: np.ndarray  # int32 [T]; padding tokens write to slot 0 (reserved block 0)
    query_start_loc: np.ndarray  # int32 [S+1]; padded sequences have query length 0
    seq_lens: np.ndarray  # int32 [S]; KV length after this step, 0 for padding
    block_tables: np.ndarray  # int32 [S, max_blocks_per_seq]
    logits_indices: np.ndarray  # int32 [S]; last token of each sequence
    temperature: np.ndarray  # float32 [S]
    top_k: np.ndarray  # int32 [S]
    top_p: np.ndarray  # float32 [S]
    min_p: np.ndarray  # float32 [S]
    seeds: np.ndarray  # uint32 [S]
    want_logprobs: np.ndarray  # bool [S]; the step computes log-probabilities only if any is set
    # int32 [T]: for a token the step in flight samples (async scheduling), its row there; -1 elsewhere
    feed_index: np.ndarray
    num_seqs: int  # real sequences (the rest is padding)
    spec: SpecArrays | None = None  # present when the step runs with a draft model


@dataclasses.dataclass(frozen=True)
class SpecArrays:
    """Where the draft tokens of a speculative step go (G = the step's largest draft length).

    A row with `num_draft = k` packs its last accepted token followed by `k`
    placeholder tokens: a device proposer writes its draft tokens into them; a
    host proposer's tokens are packed there and in `draft_tokens`. A token
    tree's nodes (`engine.spec.tree_verify`) take the placeholders in node order,
    with RoPE positions root + depth and their ancestors' attention masks.
    """

    num_draft: np.ndarray  # int32 [S]
    draft_token_index: np.ndarray  # int32 [S, G]; packed index of placeholder j, T where none (dropped)
    verify_indices: np.ndarray  # int32 [S, G+1]; packed index of the last real token, then the placeholders
    draft_slots: np.ndarray  # int32 [G, S]; slot of placeholder j (draft pass j writes there), 0 where none
    draft_tokens: np.ndarray  # int32 [S, G]; a host proposer's draft tokens (an EAGLE row's n-gram chain, -1 past it), 0 where none
    parents: np.ndarray  # int32 [S, G+1]; each window node's parent (-1: the root, or none); a chain: i - 1
    tree_mask: np.ndarray  # int32 [T]; with trees, each token's pallas_kernels.reference.tree_visible mask, else -1


def pack(plan: StepPlan, block_size: int, max_blocks_per_seq: int, token_buckets: tuple[int, ...],
         seq_buckets: tuple[int, ...], seeds: dict[str, int], spec_k: int | None = None,
         proposals: dict[str, list[int]] | None = None, parents: dict[str, list[int]] | None = None,
         pending: dict[str, int] | None = None) -> PackedBatch:
    """Packs `plan` into the smallest (token, sequence) bucket that holds it.

    `seeds` maps request id to its (explicit or drawn) 32-bit sampling seed.
    `spec_k`: the step verifies draft tokens, G (>= every row's `num_draft`)
    per row; None for a plain step (no row may have draft tokens).
    `proposals`: a host proposer's draft tokens per drafting request (exactly
    `num_draft` each); None leaves the placeholders to a device proposer.
    `parents`: for proposals that are token trees, each node's parent (0 is
    the row's last accepted token, nodes are 1..num_draft); absent: a chain.
    `pending`: for requests whose last token a step in flight samples (`Request.num_pending_tokens`), that
    step's row; the token goes in as `feed_index` (the device fills it in).
    Raises ValueError for draft tokens without `spec_k`, a proposal of the wrong length or a tree that is
    not one (a parent not before its child) or whose window passes the 32 tokens a tree mask covers.
    """
    n_seqs = len(plan.seqs)
    T, S = step_shape(plan.num_tokens, n_seqs, token_buckets, seq_buckets)
    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.zeros(T, np.int32)
    query_start_loc = np.zeros(S + 1, np.int32)
    seq_lens = np.zeros(S, np.int32)
    block_tables = np.zeros((S, max_blocks_per_seq), np.int32)
    logits_indices = np.zeros(S, np.int32)
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    min_p = np.zeros(S, np.float32)
    seed_arr = np.zeros(S, np.uint32)
    want_logprobs = np.zeros(S, bool)
    G = spec_k or 0
    num_draft = np.zeros(S, np.int32)
    draft_token_index = np.full((S, G), T, np.int32)
    verify_indices = np.zeros((S, G + 1), np.int32)
    draft_slots = np.zeros((G, S), np.int32)
    draft_tokens = np.zeros((S, G), np.int32)
    tree_parents = np.full((S, G + 1), -1, np.int32)
    tree_mask = np.full(T, -1, np.int32)
    feed_index = np.full(T, -1, np.int32)
    t = 0
    for i, s in enumerate(plan.seqs):
        r = s.request
        end = s.start + s.num_new_tokens
        real_end = end - s.num_draft  # the placeholders stay 0 here
        blocks = np.asarray(r.allocation.block_ids, np.int32)
        pos = np.arange(s.start, end, dtype=np.int32)
        known = min(real_end, r.num_known_tokens)
        token_ids[t:t + known - s.start] = r.token_ids(s.start, known)
        if known < real_end:  # one token, sampled by the step in flight
            feed_index[t + known - s.start] = pending[r.request_id]
        positions[t:t + s.num_new_tokens] = pos
        slots = blocks[pos // block_size] * block_size + pos % block_size
        slot_mapping[t:t + s.num_new_tokens] = slots
        last = t + real_end - s.start - 1
        if parents is not None:
            tree_mask[t:t + s.num_new_tokens] = _causal_masks(s.num_new_tokens)
        t += s.num_new_tokens
        query_start_loc[i + 1] = t
        seq_lens[i] = end
        block_tables[i, :len(blocks)] = blocks
        logits_indices[i] = last
        if s.num_draft:
            k = s.num_draft
            num_draft[i] = k
            draft_token_index[i, :k] = np.arange(last + 1, last + 1 + k)
            draft_slots[:k, i] = slots[-k:]
            if proposals is not None:
                proposed = proposals[r.request_id]
                if len(proposed) != k:
                    raise ValueError(f"{r.request_id}: {len(proposed)} proposed tokens for {k} draft slots")
                draft_tokens[i, :k] = proposed
                token_ids[last + 1:last + 1 + k] = np.maximum(proposed, 0)  # -1: past an EAGLE row's chain
            tree = (parents or {}).get(r.request_id)
            tree_parents[i, :k + 1] = [-1, *(range(k) if tree is None else tree)]
            if tree is not None:
                depth = tree_depths(tree_parents[i, :k + 1], r.request_id)
                positions[last + 1:last + 1 + k] = positions[last] + depth[1:]
                base = last - query_start_loc[i]  # the root's index among the row's step tokens
                if base + k + 1 > TREE_WINDOW:
                    raise ValueError(f"{r.request_id}: a tree window of {k + 1} tokens after {base} more")
                tree_mask[last:last + k + 1] = (_ancestor_masks(tree_parents[i, :k + 1]).astype(np.int64) << base
                                                | (1 << base) - 1).astype(np.uint32).view(np.int32)
        verify_indices[i] = last
        verify_indices[i, 1:s.num_draft + 1] = np.arange(last + 1, last + 1 + s.num_draft)
        sp = r.sampling
        temperature[i], top_k[i], top_p[i], min_p[i] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
        seed_arr[i] = seeds[r.request_id]
        want_logprobs[i] = s.sample and sp.logprobs is not None
    query_start_loc[n_seqs + 1:] = t
    spec = None
    if spec_k is not None:
        spec = SpecArrays(num_draft, draft_token_index, verify_indices, draft_slots, draft_tokens, tree_parents,
                          tree_mask)
    elif any(s.num_draft for s in plan.seqs):
        raise ValueError("draft tokens in a step packed without spec_k")
    return PackedBatch(token_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                       logits_indices, temperature, top_k, top_p, min_p, seed_arr, want_logprobs, feed_index, n_seqs,
                       spec)


TREE_WINDOW = 32  # step tokens a tree mask covers (pallas_kernels.reference.TREE_WINDOW; no jax here)


def _causal_masks(n: int) -> np.ndarray:
    """int32 `[n]`: step token j sees step tokens 0..j (all bits from the 32nd on)."""
    j = np.arange(n, dtype=np.int64)
    return np.where(j >= TREE_WINDOW - 1, -1, (1 << np.minimum(j + 1, TREE_WINDOW - 1)) - 1).astype(np.int32)


def tree_depths(parents: np.ndarray, request_id: str) -> np.ndarray:
    """int32 `[n]`: each window node's depth, from its parent (`parents[0]` is the root's, ignored).

    Raises:
      ValueError: a parent not before its child.
    """
    depth = np.zeros(len(parents), np.int32)
    for i in range(1, len(parents)):
        if not 0 <= parents[i] < i:
            raise ValueError(f"{request_id}: tree node {i} has parent {parents[i]} (want 0..{i - 1})")
        depth[i] = depth[parents[i]] + 1
    return depth


def _ancestor_masks(parents: np.ndarray) -> np.ndarray:
    """uint32 per node: its own bit and its ancestors' (parents checked by `tree_depths`)."""
    masks = np.zeros(len(parents), np.uint32)
    for i, p in enumerate(parents):
        masks[i] = (masks[p] if p >= 0 else 0) | (1 << i)
    return masks
