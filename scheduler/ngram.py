"""N-gram (prompt lookup) proposals on the host: pure numpy, no jax.

Source: Saxena 2023, *Prompt Lookup Decoding*; vLLM's n-gram speculator
(`prompt_lookup_max` / `prompt_lookup_min`). The engine's `NgramProposer`
(`engine/proposers.py`) calls `lookup` for each decoding request.
"""

from __future__ import annotations

import numpy as np


def lookup(context: np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the last n tokens of `context`.

    Args:
      context: int `[L]`, prompt + output so far.
      k: most tokens to propose (>= 1).
      max_n, min_n: n-gram sizes, tried from `max_n` down to `min_n`.
    Returns:
      The proposal (possibly empty): for the largest n with a match, the
      continuation of the latest match among those with the most tokens after
      them (at most `k`).
    """
    L = len(context)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(context[:L - 1], n)  # starts 0 .. L-1-n
        hits = np.flatnonzero((windows == context[L - n:]).all(axis=1))
        if hits.size:
            follow = np.minimum(k, L - (hits + n))
            start = hits[np.flatnonzero(follow == follow.max())[-1]] + n
            return context[start:start + k].tolist()
    return []
