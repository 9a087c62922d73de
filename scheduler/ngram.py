"""N-gram (prompt lookup) proposals on the host: pure numpy, no jax.

Source: Saxena 2023, *Prompt Lookup Decoding*; vLLM's n-gram speculator
(`prompt_lookup_max` / `prompt_lookup_min`). The engine's `NgramProposer`
(`engine/prompt_lookup.py`) calls `lookup` (a chain) or `lookup_tree` (the
continuations of several matches, merged into a token tree) for each
decoding request.
"""

from __future__ import annotations

import numpy as np


def _matches(context: np.ndarray, k: int, max_n: int, min_n: int) -> tuple[np.ndarray, int]:
    """Earlier occurrences of the longest matching suffix n-gram: their last indices, ordered by the tokens
    after them (at most `k` count) then latest first; and n. (empty, 0) when nothing matches."""
    L = len(context)
    if L < 2:
        return np.zeros(0, np.int64), 0
    # Candidate match ends: earlier positions holding the last token; longer n-grams only check those.
    ends = np.flatnonzero(context[:L - 1] == context[L - 1])
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        e = ends[ends >= n - 1]
        for d in range(1, n):
            e = e[context[e - d] == context[L - 1 - d]]
        if e.size:
            follow = np.minimum(k, L - 1 - e)
            return e[np.lexsort((-e, -follow))], n
    return np.zeros(0, np.int64), 0


def lookup(context: np.ndarray, k: int, max_n: int, min_n: int) -> tuple[list[int], int]:
    """Up to `k` tokens that followed an earlier occurrence of the last n tokens of `context`.

    Args:
      context: int `[L]`, prompt + output so far.
      k: most tokens to propose (>= 1).
      max_n, min_n: n-gram sizes, tried from `max_n` down to `min_n`.
    Returns:
      (proposal, n): for the largest n with a match, the continuation of the
      latest match among those with the most tokens after them (at most `k`
      tokens), and that n; ([], 0) when nothing matches.
    """
    ends, n = _matches(context, k, max_n, min_n)
    if not n:
        return [], 0
    return context[ends[0] + 1:ends[0] + 1 + k].tolist(), n


def lookup_tree(context: np.ndarray, max_nodes: int, depth: int, max_n: int,
                min_n: int) -> tuple[list[int], list[int], int]:
    """The continuations of every earlier occurrence of the last n tokens, merged into a token tree.

    Matches are taken in `lookup`'s order of preference (the first path is
    `lookup`'s chain), each continuation (at most `depth` tokens) inserted into
    a trie under the root (the context's last token) until `max_nodes` nodes.
    Shared prefixes share nodes, so the tree branches where earlier
    occurrences went different ways.

    Args:
      context: int `[L]`, prompt + output so far.
      max_nodes: most nodes below the root (>= 1).
      depth: most tokens along any path (>= 1).
      max_n, min_n: n-gram sizes, as `lookup`.
    Returns:
      (tokens, parents, n): node i + 1 holds `tokens[i]` under node
      `parents[i]` (0 is the root; a parent precedes its children), and the
      matched n; ([], [], 0) when nothing matches.
    """
    ends, n = _matches(context, depth, max_n, min_n)
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (node, token) -> child node
    for e in ends:
        node = 0
        for t in context[e + 1:e + 1 + depth].tolist():
            child = children.get((node, t))
            if child is None:
                if len(tokens) == max_nodes:
                    return tokens, parents, n
                tokens.append(t)
                parents.append(node)
                child = children[(node, t)] = len(tokens)
            node = child
    return tokens, parents, n


class Contexts:
    """Each request's prompt + output as a growing int32 array, appending only what is new since the last
    call: what `lookup` and `lookup_tree` search, per decode step, without rebuilding it."""

    def __init__(self):
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def tokens(self, request) -> np.ndarray:
        """int32 `[L]`: `request`'s tokens (a `scheduler.request.Request`)."""
        buf, n = self._buffers.get(request.request_id, (np.zeros(0, np.int32), 0))
        total = request.num_known_tokens
        if total < n:  # cannot shrink in practice; start over if it did
            buf, n = np.zeros(0, np.int32), 0
        if total > len(buf):
            grown = np.zeros(max(total, 2 * len(buf), 64), np.int32)
            grown[:n] = buf[:n]
            buf = grown
        buf[n:total] = request.token_ids(n, total)
        self._buffers[request.request_id] = (buf, total)
        return buf[:total]

    def forget(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)
