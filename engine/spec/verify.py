"""Exact speculative sampling: draft proposals and their verification by the target.

Source: Leviathan et al. 2023, *Fast Inference from Transformers via
Speculative Decoding*, §2.3 and Algorithm 1; Chen et al. 2023, *Accelerating
LLM Decoding with Speculative Sampling*, Algorithm 2. Notation as in
DESIGN.md: `q` is the target's distribution, `p` the draft's, both taken
AFTER the request's temperature, top-k, top-p and min-p (`engine.sampler.
filter_logits`), so the emitted tokens follow exactly the distribution that
`engine.sampler.sample` draws from.

Randomness. Every random draw is keyed by (seed, stream, position), so a
seeded request is reproducible and independent of its row:
  - the token the target emits last in a step (the correction or bonus token)
    uses `fold_in(key(seed), position)` and `engine.sampler.draw`, exactly as
    `engine.sampler.sample` does; a row with no draft tokens therefore emits
    the same token as the plain sampler, bit for bit;
  - acceptance uniforms use `fold_in(fold_in(key(seed), ACCEPT_STREAM), position)`;
  - draft tokens use `fold_in(fold_in(key(seed), DRAFT_STREAM), position)`.
A sampled row's tokens still depend on where its windows start: a draft slot
emits the accepted proposal, a window's last slot the target's own draw. The
token budget (`Scheduler._draft_len`) and preemption can move those starts,
so such outputs are equal in distribution to decoding without speculation,
not token for token (tests/test_speculative_logprobs.py).
The stream tags are >= 2**31, never a position (positions are int32 >= 0).
That matters: with threefry, `fold_in(k, d)` is the same counter block as
element `d` of `jax.random.bits(k, ...)`, so a small tag could derive the
draft key from the key the sampler uses at another position.

A deterministic proposal (n-gram lookup: `p` one-hot) is verified by
`verify_deterministic` with the plain sampler's own draws instead, so its
output equals decoding without speculation whatever the draft lengths.

Each (stream, position) is consumed at most once along the emitted sequence:
a step that stops at the first rejection at position `t` has used acceptance
draws up to `t` and the final draw at `t`, and the next step starts at `t+1`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.sampler import argmax, draw, filter_logits
from model import numerics

ACCEPT_STREAM = 0xFFFF_FFFF
DRAFT_STREAM = 0xFFFF_FFFE


def _stream_keys(seeds: jax.Array, positions: jax.Array, stream: int | None) -> jax.Array:
    """Keys `[*positions.shape]` for `seeds [S]` and int32 `positions [S, ...]`."""

    def one(seed, pos):
        base = jax.random.key(seed)
        if stream is not None:
            base = jax.random.fold_in(base, stream)
        return jax.vmap(lambda p: jax.random.fold_in(base, p))(pos.reshape(-1)).reshape(pos.shape)

    return jax.vmap(one)(seeds, positions)


@jax.jit
def sample_draft(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                 seeds: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draws one draft token per row from `p` and returns `p` for the verifier.

    Args:
      logits: float32 `[S, V]`, the draft model's logits.
      temperature, top_k, top_p, min_p: `[S]` as in `engine.sampler.filter_logits`.
      seeds: uint32 `[S]`, the request's seed.
      positions: int32 `[S]`, the position the drafted token will take.
    Returns:
      (tokens int32 `[S]`, p float32 `[S, V]`); greedy rows take the argmax.
    """
    greedy = argmax(logits)

    def stochastic():
        t = jnp.where(temperature > 0, temperature, 1.0)
        filtered = filter_logits(logits, t, top_k, top_p, min_p)
        drawn = draw(filtered, _stream_keys(seeds, positions, DRAFT_STREAM))
        probs = numerics.softmax(filtered)
        return jnp.where(temperature > 0, drawn, greedy), probs

    def all_greedy():
        return greedy, jnp.zeros(logits.shape, jnp.float32)

    tokens, probs = jax.lax.cond(jnp.any(temperature > 0), stochastic, all_greedy)
    one_hot = jax.nn.one_hot(greedy, logits.shape[-1], dtype=jnp.float32)
    return tokens, jnp.where((temperature > 0)[:, None], probs, one_hot)


def _leading_true(mask: jax.Array) -> jax.Array:
    """Number of leading True values along the last axis: `[S, G]` -> int32 `[S]`."""
    return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1)


def _emitted(draft_tokens: jax.Array, n: jax.Array, final: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's `n` accepted draft tokens then `final`, -1 after: (int32 `[S, G+1]`, num_emitted `[S]`)."""
    S, G = draft_tokens.shape
    slot = jnp.arange(G + 1, dtype=jnp.int32)[None]
    draft_padded = jnp.concatenate([draft_tokens, jnp.zeros((S, 1), jnp.int32)], axis=1)
    tokens = jnp.where(slot < n[:, None], draft_padded, jnp.where(slot == n[:, None], final[:, None], -1))
    return tokens, n + 1


@jax.jit
def verify(target_logits: jax.Array, draft_probs: jax.Array, draft_tokens: jax.Array, num_draft: jax.Array,
           temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, seeds: jax.Array,
           positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Accepts a prefix of each row's draft tokens and appends one target token.

    Draft token `i` is accepted with probability `min(1, q_i(x_i) / p_i(x_i))`;
    at the first rejection a token is drawn from `norm(max(0, q_i - p_i))`;
    when all `num_draft` tokens are accepted a bonus token is drawn from
    `q_{num_draft}`. Greedy rows (temperature 0) accept while the draft token
    equals the target's argmax and then emit the argmax. The result follows
    the target's sampling distribution exactly, for any `p` (Leviathan et al.
    2023, Appendix A.1; Chen et al. 2023, Theorem 1).

    Args:
      target_logits: float32 `[S, G+1, V]`; row `s`, slot `i` are the target's
        logits for position `positions[s] + i` (the last slot scores the bonus).
      draft_probs: float32 `[S, G, V]`, the draft distribution each draft token
        was drawn from, after the same filtering (`sample_draft` returns it).
        It must give positive probability to the drafted token. Unused for
        greedy rows.
      draft_tokens: int32 `[S, G]`.
      num_draft: int32 `[S]`, draft tokens of each row, 0..G; slots past it are
        ignored. 0 makes the row an ordinary sampling step.
      temperature, top_k, top_p, min_p: `[S]`, the request's settings as in
        `engine.sampler.sample` (temperature 0 = greedy).
      seeds: uint32 `[S]`.
      positions: int32 `[S]`, the position of the first draft token.
    Returns:
      tokens: int32 `[S, G+1]`; row `s` emits `tokens[s, :num_emitted[s]]`
        (accepted draft tokens, then the correction or bonus token); later
        slots hold -1.
      num_emitted: int32 `[S]` in 1..num_draft+1.
    """
    S, K1, V = target_logits.shape
    G = K1 - 1
    slot = jnp.arange(K1, dtype=jnp.int32)
    rows = jnp.arange(S)
    in_draft = slot[None, :G] < num_draft[:, None]  # [S, G]

    target_argmax = argmax(target_logits)  # [S, G+1]
    n_greedy = _leading_true(in_draft & (draft_tokens == target_argmax[:, :G]))
    final_greedy = target_argmax[rows, n_greedy]

    def stochastic():
        t = jnp.where(temperature > 0, temperature, 1.0)
        per_slot = lambda x: jnp.repeat(x, K1)
        filtered = filter_logits(target_logits.reshape(S * K1, V), per_slot(t), per_slot(top_k),
                                 per_slot(top_p), per_slot(min_p)).reshape(S, K1, V)
        q = numerics.softmax(filtered)
        q_x = jnp.take_along_axis(q[:, :G], draft_tokens[..., None], axis=-1)[..., 0]  # [S, G]
        p_x = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
        u_keys = _stream_keys(seeds, positions[:, None] + slot[None, :G], ACCEPT_STREAM)  # [S, G]
        u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32)))(u_keys)
        # u < q/p without dividing; u is in [0, 1), so q >= p always accepts.
        n = _leading_true(in_draft & (u * p_x < q_x))
        # On rejection draw from max(0, q - p); after full acceptance draw from q,
        # scoring with the filtered logits themselves so that the draw is the
        # sampler's, bit for bit.
        rejected = n < num_draft
        p_n = jnp.concatenate([draft_probs, jnp.zeros((S, 1, V), draft_probs.dtype)], axis=1)[rows, n]
        residual = jnp.maximum(q[rows, n] - p_n, 0.0)
        # If rounding leaves no residual mass (q == p up to float error), q is the limit.
        has_mass = residual >= numerics.LOG_MIN  # below it, mass too small to draw (and outside log's domain)
        use_residual = rejected & jnp.any(has_mass, axis=-1)
        scores = jnp.where(use_residual[:, None], jnp.where(has_mass, numerics.log(residual), -jnp.inf),
                           filtered[rows, n])
        final = draw(scores, _stream_keys(seeds, (positions + n)[:, None], None)[:, 0])
        sampled = temperature > 0
        return jnp.where(sampled, n, n_greedy), jnp.where(sampled, final, final_greedy)

    n, final = jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda: (n_greedy, final_greedy))
    return _emitted(draft_tokens, n, final)


@jax.jit
def verify_deterministic(target_tokens: jax.Array, draft_tokens: jax.Array,
                         num_draft: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`verify` for deterministic proposals (a one-hot `p`), coupled to the plain sampler.

    `target_tokens` holds the target's token at every window slot, drawn as
    `engine.sampler.sample` draws the token at that position (same filtering,
    same key `fold_in(key(seed), position)`; greedy rows: the argmax). Draft
    tokens are accepted while they equal those draws, and the first draw that
    differs (or the bonus draw) is emitted. A draft token x is then accepted
    with probability q(x), and on a rejection the emitted token follows q
    restricted to tokens other than x, which is `norm(max(0, q - p))` for the
    one-hot `p`: the rule of `verify` (Leviathan et al. 2023, §2.3), realised
    with the sampler's own uniforms. So every emitted token is the one the
    plain sampler would draw at its position, and a seeded request's output
    does not depend on whether or how much it drafted (up to float rounding
    between window shapes).

    Args:
      target_tokens: int32 `[S, G+1]`.
      draft_tokens: int32 `[S, G]`; num_draft: int32 `[S]`, as in `verify`.
    Returns:
      as `verify`.
    """
    G = draft_tokens.shape[1]
    in_draft = jnp.arange(G)[None, :] < num_draft[:, None]  # [S, G]
    n = _leading_true(in_draft & (draft_tokens == target_tokens[:, :G]))
    return _emitted(draft_tokens, n, target_tokens[jnp.arange(draft_tokens.shape[0]), n])
