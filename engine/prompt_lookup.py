"""The host proposer: prompt lookup (n-gram) drafts through the `engine.proposers.Proposer` interface.

Sources: Saxena 2023, *Prompt Lookup Decoding*, and vLLM's n-gram speculator.
"""

from __future__ import annotations

from typing import Hashable

import numpy as np

from engine.adaptive import SpeculationConfig
from engine.proposers import Proposer
from scheduler.ngram import Contexts
from scheduler.packing import tree_depths
from scheduler.request import Request
from scheduler.scheduler import StepPlan


class NgramProposer(Proposer):
    """Prompt lookup: propose what followed the latest earlier occurrence of the context's last n tokens.

    For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n
    tokens of the request's prompt + output are searched for earlier in it;
    the first n with a match proposes the (up to K) tokens that followed it,
    taking the latest match among those with the longest continuation. No
    model: it pays where the output copies its input (summaries, code edits,
    retrieval-augmented answers) and costs nothing where nothing matches (the
    row then decodes plainly). The lookup reads a dictionary of each n-gram's
    positions per request, extended as tokens arrive (`scheduler.ngram.NgramIndex`).

    With `tree_nodes`, the continuations of every earlier match are merged into
    a token tree (`scheduler.ngram.NgramIndex.lookup_tree`): where the context repeated
    itself with variations, the verify step tries them all at once
    (`engine.speculative.make_tree_verify_step`). A draft length the cost gate
    cuts keeps the first nodes, still a tree (parents come first).
    """

    kind = "ngram"
    output_independent = True  # verify_deterministic: drafting never changes a seeded output

    def __init__(self, config: SpeculationConfig):
        super().__init__(config)
        self._contexts = self._new_contexts()
        self._proposed: dict[str, list[int]] = {}  # request id -> its latest lookup's proposal
        self._matched: dict[str, Hashable] = {}  # request id -> what its latest lookup matched (`_lookup`)
        self._parents: dict[str, list[int]] = {}  # request id -> its latest tree's node parents

    def _new_contexts(self):
        """Each request's lookup structure, kept as its tokens arrive."""
        return Contexts(self.config.prompt_lookup_max, self.config.prompt_lookup_min)

    def policy_k(self, request: Request, step: int) -> int:
        """K capped by the request's own `num_speculative_tokens`: which proposals run is the cost gate's
        call, per class and matched n-gram size, with no switching off per request or class (a lookup
        keeps no draft state and costs nothing when the gate declines it)."""
        cap = request.sampling.num_speculative_tokens
        return self.config.num_speculative_tokens if cap is None else min(cap, self.config.num_speculative_tokens)

    def wanted(self, request: Request, step: int) -> int:
        """The lookup's proposal length (at most the policy's K); the proposal is kept for `proposals`."""
        k = self.policy_k(request, step)
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
