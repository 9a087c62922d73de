"""Prompt lookup (n-gram) proposals: a per-request index on the host, and the proposer drafting from it.

`NgramIndex` keeps every n-gram's positions in a request's context (pure
Python), so `lookup` (a chain) and `lookup_tree` (the continuations of
several matches, merged into a token tree) are a few dictionary reads;
`NgramProposer` asks it for each decoding request.

Sources: Saxena 2023, *Prompt Lookup Decoding*; vLLM's n-gram speculator
(`prompt_lookup_max` / `prompt_lookup_min`).
"""

from __future__ import annotations

import bisect
from typing import Hashable

import numpy as np

from engine.spec.config import SpeculationConfig
from engine.spec.proposer import Proposer
from scheduler.packing import tree_depths
from scheduler.request import Request
from scheduler.scheduler import StepPlan


class NgramIndex:
    """A context (prompt + output so far) and the end positions of every n-gram in it, for each size n in
    [`min_n`, `max_n`], extended as tokens are appended: a lookup is a few dictionary reads instead of a scan
    of the whole context (~50 us a row per step in numpy on the 2-core CPU, paid again every step).

    Args:
      max_n, min_n: the n-gram sizes, tried from `max_n` down to `min_n` (1 <= min_n <= max_n).
      tokens: the context's first tokens.
    """

    def __init__(self, max_n: int, min_n: int, tokens=()):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its end positions, ascending
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Appends `tokens` (ints) to the context."""
        t, ends = self.tokens, self._ends
        for x in tokens:
            t.append(int(x))
            i = len(t) - 1
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                ends.setdefault(tuple(t[i + 1 - n:]), []).append(i)

    def matches(self, k: int) -> tuple[list[int], int]:
        """Earlier occurrences of the longest n-gram ending the context that occurred before: their end
        positions, those with `k` or more tokens after them latest first, then the others by tokens after
        them, most first; and n. ([], 0) when nothing matches."""
        t, L = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            earlier = self._ends[tuple(t[L - n:])][:-1]  # the last end is the context's own suffix
            if earlier:
                full = bisect.bisect_right(earlier, L - 1 - k)
                return earlier[full - 1::-1] + earlier[full:] if full else earlier, n
        return [], 0

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to `k` tokens that followed an earlier occurrence of the context's last n tokens.

        Returns:
          (proposal, n): for the largest n with a match, the continuation of the
          latest match among those with the most tokens after them (at most `k`
          tokens), and that n; ([], 0) when nothing matches.
        """
        ends, n = self.matches(k)
        if not n:
            return [], 0
        return self.tokens[ends[0] + 1:ends[0] + 1 + k], n

    def lookup_tree(self, max_nodes: int, depth: int) -> tuple[list[int], list[int], int]:
        """The continuations of every earlier occurrence of the last n tokens, merged into a token tree.

        Matches are taken in `lookup`'s order of preference (the first path is
        `lookup`'s chain), each continuation (at most `depth` tokens) inserted into
        a trie under the root (the context's last token) until `max_nodes` nodes.
        Shared prefixes share nodes, so the tree branches where earlier
        occurrences went different ways.

        Args:
          max_nodes: most nodes below the root (>= 1).
          depth: most tokens along any path (>= 1).
        Returns:
          (tokens, parents, n): node i + 1 holds `tokens[i]` under node
          `parents[i]` (0 is the root; a parent precedes its children), and the
          matched n; ([], [], 0) when nothing matches.
        """
        ends, n = self.matches(depth)
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (node, token) -> child node
        for e in ends:
            node = 0
            for t in self.tokens[e + 1:e + 1 + depth]:
                child = children.get((node, t))
                if child is None:
                    if len(tokens) == max_nodes:
                        return tokens, parents, n
                    tokens.append(t)
                    parents.append(node)
                    child = children[(node, t)] = len(tokens)
                node = child
        return tokens, parents, n


def lookup(context, k: int, max_n: int, min_n: int) -> tuple[list[int], int]:
    """`NgramIndex.lookup` on `context` (int `[L]`, prompt + output so far)."""
    return NgramIndex(max_n, min_n, context).lookup(k)


def lookup_tree(context, max_nodes: int, depth: int, max_n: int, min_n: int) -> tuple[list[int], list[int], int]:
    """`NgramIndex.lookup_tree` on `context` (int `[L]`, prompt + output so far)."""
    return NgramIndex(max_n, min_n, context).lookup_tree(max_nodes, depth)


class Contexts:
    """Each request's `NgramIndex`, extended with only what is new since the last call."""

    def __init__(self, max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n
        self._indexes: dict[str, NgramIndex] = {}  # request id -> its context's index

    def index(self, request) -> NgramIndex:
        """`request`'s index (a `scheduler.request.Request`), holding all its known tokens."""
        index = self._indexes.get(request.request_id)
        total = request.num_known_tokens
        if index is None or total < len(index.tokens):  # cannot shrink in practice; start over if it did
            index = self._indexes[request.request_id] = NgramIndex(self.max_n, self.min_n)
        if total > len(index.tokens):
            index.extend(request.token_ids(len(index.tokens), total))
        return index

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


class NgramProposer(Proposer):
    """Prompt lookup: propose what followed the latest earlier occurrence of the context's last n tokens.

    For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n
    tokens of the request's prompt + output are searched for earlier in it;
    the first n with a match proposes the (up to G) tokens that followed it,
    taking the latest match among those with the longest continuation. No
    model: it pays where the output copies its input (summaries, code edits,
    retrieval-augmented answers) and costs nothing where nothing matches (the
    row then decodes plainly). The lookup reads a dictionary of each n-gram's
    positions per request, extended as tokens arrive (`NgramIndex`).

    With `tree_nodes`, the continuations of every earlier match are merged into
    a token tree (`NgramIndex.lookup_tree`): where the context repeated
    itself with variations, the verify step tries them all at once
    (`engine.spec.programs.make_tree_verify_step`). A draft length the cost gate
    cuts keeps the first nodes, still a tree (parents come first).
    """

    kind = "ngram"
    output_independent = True  # verify_deterministic: drafting never changes a seeded output
    adaptive_k = False  # a lookup keeps no draft state: the cost gate alone declines what does not pay

    def __init__(self, config: SpeculationConfig):
        super().__init__(config)
        self._contexts = self._new_contexts()
        self._proposed: dict[str, list[int]] = {}  # request id -> its latest lookup's proposal
        self._matched: dict[str, Hashable] = {}  # request id -> what its latest lookup matched (`_lookup`)
        self._parents: dict[str, list[int]] = {}  # request id -> its latest tree's node parents

    def _new_contexts(self):
        """Each request's lookup structure, kept as its tokens arrive."""
        return Contexts(self.config.prompt_lookup_max, self.config.prompt_lookup_min)

    def proposal_len(self, request: Request, k: int) -> int:
        """The lookup's proposal length (at most `k`); the proposal is kept for `proposals`."""
        rid = request.request_id
        tokens, self._parents[rid], self._matched[rid] = self._lookup(request, k) if k else ([], [], 0)
        self._proposed[rid] = tokens
        return len(tokens)

    def _lookup(self, request: Request, k: int) -> tuple[list[int], list[int], Hashable]:
        """(tokens, parents, match): `request`'s proposal, at most `k` deep (a chain's parents are ignored),
        and what acceptance is estimated per besides the class (here the matched n-gram size)."""
        index = self._contexts.index(request)
        if self.config.tree_nodes:
            return index.lookup_tree(request.sampling.num_tree_nodes or self.config.tree_nodes, k)
        tokens, n = index.lookup(k)
        return tokens, [], n

    def acceptance_key(self, request: Request) -> tuple[str, Hashable]:
        """Acceptance is estimated per class and match (`_lookup`): a longer match is a surer proposal."""
        return request.request_class, self._matched.get(request.request_id, 0)

    def proposals(self, plan: StepPlan) -> dict[str, list[int]]:
        return {s.request.request_id: self._proposed[s.request.request_id][:s.num_draft]
                for s in plan.seqs if s.num_draft}

    def depth(self, request: Request, k: int) -> int:
        parents = self._parents.get(request.request_id) if self.config.tree_nodes else None
        if not parents:
            return k
        return int(tree_depths(np.array([-1, *parents[:k]]), request.request_id).max())

    def tree_parents(self, plan: StepPlan) -> dict[str, list[int]] | None:
        if not self.config.tree_nodes:
            return None
        return {s.request.request_id: self._parents[s.request.request_id][:s.num_draft]
                for s in plan.seqs if s.num_draft}

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._parents.pop(request_id, None)
        self._contexts.forget(request_id)
        self._proposed.pop(request_id, None)
        self._matched.pop(request_id, None)
