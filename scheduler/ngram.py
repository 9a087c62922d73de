"""N-gram (prompt lookup) proposals on the host: pure numpy, no jax.

Source: Saxena 2023, *Prompt Lookup Decoding*; vLLM's n-gram speculator
(`prompt_lookup_max` / `prompt_lookup_min`). The engine's `NgramProposer`
(`engine/proposers.py`) calls `lookup` for each decoding request.
"""

from __future__ import annotations

import numpy as np


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
    L = len(context)
    if L < 2:
        return [], 0
    # Candidate match ends: earlier positions holding the last token; longer n-grams only check those.
    ends = np.flatnonzero(context[:L - 1] == context[L - 1])
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        e = ends[ends >= n - 1]
        for d in range(1, n):
            e = e[context[e - d] == context[L - 1 - d]]
        if e.size:
            follow = np.minimum(k, L - 1 - e)
            start = e[np.flatnonzero(follow == follow.max())[-1]] + 1
            return context[start:start + k].tolist(), n
    return [], 0
