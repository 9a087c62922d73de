"""Suffix decoding: suffix tries on the host (pure Python) and the proposer drafting from them.

Source: Oliaro et al. 2025, *SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications*
(NeurIPS 2025, arXiv 2411.04975), §3: a suffix tree over earlier outputs (global) and one over the
request's own prompt and output (local); the longest match of the context's last tokens picks a node, and
the proposal is the tree of its most frequent continuations, grown best-first by their empirical
probability, at most `max_spec_factor` x the match length deep. Here each structure is a suffix trie cut at
`max_depth` tokens (every substring of at most that many tokens, with its count), which is what a lookup of
matches up to `max_depth - 1` tokens needs. `SuffixProposer` drafts from them.
"""

from __future__ import annotations

import collections
import heapq
import math
from typing import Hashable, Sequence

from engine.spec.config import SpeculationConfig
from engine.spec.ngram import NgramProposer
from scheduler.request import Request

# The longest substring the suffix tries keep (each kept token costs up to this many trie nodes; the paper's
# trees go to 64), and the longest match looked up: a match of d tokens has MAX_DEPTH - d tokens of continuation.
MAX_DEPTH = 16
MAX_MATCH = 8
# A proposal is at most this many times its match's length deep (the paper's max_spec_factor): a one-token
# match proposes one token, a long one up to MAX_DEPTH - MAX_MATCH (and G).
MAX_SPEC_FACTOR = 1.0
# Continuations less likely than this (their share of the earlier occurrences, along the path) are not proposed.
MIN_PROB = 0.1

_CHILD = (1 << 32) - 1  # a packed single child's id: token << 32 | child


class SuffixTrie:
    """Every substring of at most `max_depth` tokens of the sequences added, with its number of occurrences.

    Node 0 is the root; node n's string is the tokens on the path to it and `count(n)` the number of
    (sequence, start) pairs whose tokens begin with it. A sequence of L tokens adds up to L * max_depth
    nodes (fewer where substrings repeat); `remove` takes back exactly what `add` put in, so the trie
    after a removal is the trie of the sequences left.

    Args:
      max_depth: the longest substring kept (>= 2: a match of d tokens needs depth d + 1 for a continuation).
    """

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        # node -> None (a leaf), token << 32 | child (one child: most nodes, and an int is a seventh of a
        # dict's memory), or {token: child}
        self._children: list[dict[int, int] | int | None] = [None]
        self._count: list[int] = [0]
        self._free: list[int] = []  # ids of removed nodes, reused
        self.num_nodes = 1  # live nodes, the root included

    def count(self, node: int) -> int:
        return self._count[node]

    def children(self, node: int):
        """(token, child) of each child of `node`."""
        kids = self._children[node]
        if kids is None:
            return ()
        if type(kids) is int:
            return ((kids >> 32, kids & _CHILD),)
        return kids.items()

    def _child(self, node: int, token: int) -> int | None:
        kids = self._children[node]
        if type(kids) is int:
            return kids & _CHILD if kids >> 32 == token else None
        return kids.get(token) if kids else None

    def _new_node(self) -> int:
        if self._free:
            node = self._free.pop()
            self._children[node], self._count[node] = None, 0
        else:
            node = len(self._count)
            self._children.append(None)
            self._count.append(0)
        self.num_nodes += 1
        return node

    def extend(self, active: list[int], tokens: Sequence[int]) -> list[int]:
        """Appends `tokens` to a sequence being added piece by piece.

        Args:
          active: the nodes of the sequence's last `max_depth - 1` (or fewer) suffixes, longest first, as
            the previous call returned them ([] for a new sequence).
          tokens: ints to append.
        Returns:
          the new `active` list (pass it to the next call).
        """
        top = self.max_depth - 1
        children, count = self._children, self._count
        for t in tokens:
            t = int(t)
            nodes = active[-top:]
            nodes.append(0)
            active = []
            for n in nodes:  # each suffix, and the root, steps to its child for t (made if missing)
                kids = children[n]
                if type(kids) is int:
                    child = kids & _CHILD if kids >> 32 == t else None
                else:
                    child = kids.get(t) if kids else None
                if child is None:
                    child = self._new_node()
                    if kids is None:
                        children[n] = t << 32 | child
                    elif type(kids) is int:
                        children[n] = {kids >> 32: kids & _CHILD, t: child}
                    else:
                        kids[t] = child
                count[child] += 1
                active.append(child)
        return active[-top:]

    def add(self, tokens: Sequence[int]) -> None:
        """Adds a whole sequence."""
        self.extend([], tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Takes back a sequence that `add` put in (the same tokens); nodes left with no occurrence are freed."""
        tokens = [int(t) for t in tokens]
        for start in range(len(tokens)):
            node = 0
            for t in tokens[start:start + self.max_depth]:
                parent, node = node, self._child(node, t)
                self._count[node] -= 1
                if self._count[node] == 0:  # no other occurrence: nor of anything below it
                    kids = self._children[parent]
                    if type(kids) is int:
                        self._children[parent] = None
                    else:
                        del kids[t]
                    self._free_subtree(node)
                    break

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(child for _, child in self.children(n))
            self._children[n], self._count[n] = None, 0
            self._free.append(n)
            self.num_nodes -= 1

    def _walk(self, tokens: Sequence[int]) -> int | None:
        node = 0
        for t in tokens:
            node = self._child(node, t)
            if node is None:
                return None
        return node

    def match(self, context: Sequence[int], max_len: int) -> tuple[int, int]:
        """The longest suffix of `context` (at most `max_len` < `max_depth` tokens) that occurred with a
        continuation: a match of d tokens leaves room for `max_depth - d` tokens of continuation.

        Having a continuation is monotone in the suffix's length (a continuation of the last d tokens is one
        of the last d - 1 too), so the length is found by bisection.
        Returns:
          (node, d): the suffix's node and its length d; (0, 0) when not even the last token occurred
          followed by something.
        """
        lo, hi, best = 1, min(max_len, self.max_depth - 1, len(context)), (0, 0)
        while lo <= hi:
            d = (lo + hi) // 2
            node = self._walk(context[len(context) - d:])
            if node is not None and self._children[node]:
                best, lo = (node, d), d + 1
            else:
                hi = d - 1
        return best

    def candidates(self, node: int, max_nodes: int, max_depth: int, min_prob: float,
                   chain: bool = False) -> tuple[list[int], list[int], list[float]]:
        """The token tree of `node`'s likeliest continuations, grown best-first (SuffixDecoding §3.2).

        A continuation's probability is the product, along its path, of each token's share of its parent's
        continuations (counts); nodes are taken in descending probability (ties: trie order), so a parent
        precedes its children and a tree cut to its first n nodes holds the n likeliest.
        Args:
          node: the matched node (`match`).
          max_nodes: most nodes below the root.
          max_depth: most tokens along a path.
          min_prob: continuations below this probability are left out.
          chain: only the likeliest child of each node: the likeliest path.
        Returns:
          (tokens, parents, probs): node i + 1 holds `tokens[i]` under node `parents[i]` (0 is the root),
          with probability `probs[i]`.
        """
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        heap: list = []
        order = 0

        def push(at: int, index: int, prob: float, depth: int):
            nonlocal order
            kids = list(self.children(at))
            if not kids or depth >= max_depth:
                return
            total = sum(self._count[c] for _, c in kids)
            if chain:  # the first of the likeliest children, as the heap would order them
                kids = [max(kids, key=lambda kid: self._count[kid[1]])]
            for token, child in kids:
                p = prob * self._count[child] / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, order, token, child, index, depth + 1))
                    order += 1

        push(node, 0, 1.0, 0)
        while heap and len(tokens) < max_nodes:
            p, _, token, child, parent, depth = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            probs.append(-p)
            push(child, len(tokens), -p, depth)
        return tokens, parents, probs


class SuffixCache:
    """Earlier outputs, one `SuffixTrie` per scope (a tenant and its cache salt), at most `max_tokens` in all.

    Requests are kept whole, oldest added evicted first (their sequences removed from their trie) once the
    tokens kept exceed `max_tokens`; a scope whose last sequence left drops its trie. Each trie holds at most
    `max_tokens * max_depth` nodes (natural text: ~12 a token, ~0.76 KB).

    Args:
      max_depth: each trie's `max_depth`.
      max_tokens: most tokens kept over every scope (0: nothing is kept).
    """

    def __init__(self, max_depth: int, max_tokens: int):
        self.max_depth, self.max_tokens = max_depth, max_tokens
        self._tries: dict[Hashable, SuffixTrie] = {}
        self._entries: collections.OrderedDict[int, tuple[Hashable, list[int]]] = collections.OrderedDict()
        self._added = 0  # sequences added so far: the next one's key
        self.num_tokens = 0

    def trie(self, scope: Hashable) -> SuffixTrie | None:
        return self._tries.get(scope)

    @property
    def num_nodes(self) -> int:
        return sum(t.num_nodes for t in self._tries.values())

    def add(self, scope: Hashable, tokens: Sequence[int]) -> None:
        """Keeps one request's `tokens` in `scope`'s trie; a sequence longer than the cache keeps its last
        `max_tokens`."""
        tokens = [int(t) for t in tokens[max(0, len(tokens) - self.max_tokens):]] if self.max_tokens else []
        if not tokens:
            return
        self._tries.setdefault(scope, SuffixTrie(self.max_depth)).add(tokens)
        self._entries[self._added] = (scope, tokens)
        self._added += 1
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            _, (old_scope, old) = self._entries.popitem(last=False)
            trie = self._tries[old_scope]
            trie.remove(old)
            self.num_tokens -= len(old)
            if trie.num_nodes == 1:
                del self._tries[old_scope]


class RequestSuffix:
    """One request's local `SuffixTrie` over its context (prompt + output so far) and the context's tail."""

    def __init__(self, max_depth: int):
        self.trie = SuffixTrie(max_depth)
        self.tail: list[int] = []  # the context's last max_depth - 1 tokens: what a match is looked up for
        self.num_tokens = 0
        self._active: list[int] = []

    def extend(self, tokens: Sequence[int]) -> None:
        self._active = self.trie.extend(self._active, tokens)
        self.tail = (self.tail + [int(t) for t in tokens])[-(self.trie.max_depth - 1):]
        self.num_tokens += len(tokens)


class SuffixContexts:
    """Each request's `RequestSuffix`, extended with only what is new since the last call."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self._requests: dict[str, RequestSuffix] = {}

    def index(self, request) -> RequestSuffix:
        """`request`'s local suffix trie (a `scheduler.request.Request`), holding all its known tokens."""
        local = self._requests.get(request.request_id)
        total = request.num_known_tokens
        if local is None or total < local.num_tokens:
            local = self._requests[request.request_id] = RequestSuffix(self.max_depth)
        if total > local.num_tokens:
            local.extend(request.token_ids(local.num_tokens, total))
        return local

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


class SuffixProposer(NgramProposer):
    """Suffix decoding: the likeliest continuations of the context's longest earlier match, as a token tree.

    Two suffix tries are searched each step (`engine.spec.suffix.SuffixTrie`): the request's own (prompt and
    output so far, as n-gram lookup does) and the global one of its scope, which holds the prompt tail (the
    last `MAX_MATCH` tokens) and output of every earlier finished request with the same `cache_salt`
    (the server salts with the tenant: one tenant's outputs never shape another's proposals or speed). In
    each, the longest suffix of the context (up to `MAX_MATCH` tokens) with a continuation picks a node,
    and the tree of its continuations grows best-first by empirical probability (`SuffixTrie.candidates`),
    at most `MAX_SPEC_FACTOR` x the match length, `MAX_DEPTH` - the match length and G deep, at most the
    tree budget wide (with `tree_nodes` 0: the likeliest path); the tree whose probabilities sum higher
    (the more tokens it expects accepted) is proposed. Its tokens are one-hot
    proposals, verified like n-gram trees by the coupled tree verify, so the output is the target's
    whatever is proposed (`output_independent`). Acceptance is estimated per class, trie and match length
    (1, 2-3, 4-7, 8 tokens), so the cost gate learns which matches pay and declines the rest: a short
    match on chat traffic costs the lookup only.

    The global cache keeps at most `config.suffix_cache_tokens` tokens over every scope, evicting whole
    requests, least recently added first (`SuffixCache`).

    Args:
      config: G (the proposals' depth), `tree_nodes` (0: chains, the likeliest path alone), `suffix_cache_tokens`.
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
