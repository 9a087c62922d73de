"""The suffix-decoding proposer: token trees from the request's own context and from earlier outputs.

Source: Oliaro et al. 2025, *SuffixDecoding* (NeurIPS 2025, arXiv 2411.04975), §3; vLLM's `method="suffix"`.
"""

from __future__ import annotations

import math
from typing import Hashable

from engine.adaptive import SpeculationConfig
from engine.prompt_lookup import NgramProposer
from scheduler.request import Request
from scheduler.suffix import SuffixCache, SuffixContexts

# The longest substring the suffix tries keep (each kept token costs up to this many trie nodes; the paper's
# trees go to 64), and the longest match looked up: a match of d tokens has MAX_DEPTH - d tokens of continuation.
MAX_DEPTH = 16
MAX_MATCH = 8
# A proposal is at most this many times its match's length deep (the paper's max_spec_factor): a one-token
# match proposes one token, a long one up to MAX_DEPTH - MAX_MATCH (and K).
MAX_SPEC_FACTOR = 1.0
# Continuations less likely than this (their share of the earlier occurrences, along the path) are not proposed.
MIN_PROB = 0.1


class SuffixProposer(NgramProposer):
    """Suffix decoding: the likeliest continuations of the context's longest earlier match, as a token tree.

    Two suffix tries are searched each step (`scheduler.suffix.SuffixTrie`): the request's own (prompt and
    output so far, as n-gram lookup does) and the global one of its scope, which holds the prompt tail (the
    last `MAX_MATCH` tokens) and output of every earlier finished request with the same `cache_salt`
    (the server salts with the tenant: one tenant's outputs never shape another's proposals or speed). In
    each, the longest suffix of the context (up to `MAX_MATCH` tokens) with a continuation picks a node,
    and the tree of its continuations grows best-first by empirical probability (`SuffixTrie.candidates`),
    at most `MAX_SPEC_FACTOR` x the match length, `MAX_DEPTH` - the match length and K deep, at most the
    tree budget wide (with `tree_nodes` 0: the likeliest path); the tree whose probabilities sum higher
    (the more tokens it expects accepted) is proposed. Its tokens are one-hot
    proposals, verified like n-gram trees by the coupled tree verify, so the output is the target's
    whatever is proposed (`output_independent`). Acceptance is estimated per class, trie and match length
    (1, 2-3, 4-7, 8 tokens), so the cost gate learns which matches pay and declines the rest: a short
    match on chat traffic costs the lookup only.

    The global cache keeps at most `config.suffix_cache_tokens` tokens over every scope, evicting whole
    requests, least recently added first (`SuffixCache`).

    Args:
      config: K (the proposals' depth), `tree_nodes` (0: chains, the likeliest path alone), `suffix_cache_tokens`.
    """

    kind = "suffix"

    def __init__(self, config: SpeculationConfig):
        super().__init__(config)
        self.cache = SuffixCache(MAX_DEPTH, config.suffix_cache_tokens)

    def _new_contexts(self):
        return SuffixContexts(MAX_DEPTH)

    def _lookup(self, request: Request, k: int) -> tuple[list[int], list[int], Hashable]:
        """The likelier tree of the local and the global trie (see the class docstring), and its match:
        (trie, match-length bucket); ([], [], 0) when neither matches."""
        local = self._contexts.index(request)
        nodes = request.sampling.num_tree_nodes or self.config.tree_nodes
        best, best_score = ([], [], 0), 0.0
        for name, trie in (("local", local.trie), ("global", self.cache.trie(request.cache_salt))):
            if trie is None:
                continue
            node, length = trie.match(local.tail, MAX_MATCH)
            if not length:
                continue
            depth = min(k, MAX_DEPTH - length, max(1, math.floor(MAX_SPEC_FACTOR * length)))
            tokens, parents, probs = trie.candidates(node, nodes or depth, depth, MIN_PROB, chain=not nodes)
            score = sum(probs)
            if score > best_score:
                best, best_score = (tokens, parents, (name, min(length.bit_length(), 4))), score
        return best

    def finish(self, request: Request) -> None:
        """Keeps the finished (or aborted) request's prompt tail and output in its scope's global trie."""
        output = request.output_token_ids
        if output:
            tail = request.prompt_token_ids[-MAX_MATCH:]
            self.cache.add(request.cache_salt, [*tail, *output])
        super().finish(request)
