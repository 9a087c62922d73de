"""Speculative decoding with a standalone draft model: one jitted program per step.

Sources: Leviathan et al. 2023 (§2.3, Algorithm 1) and Chen et al. 2023
(Algorithm 2) for the proposal/verify scheme; the verify itself is
`engine.verify.verify`.

The draft keeps its own paged KV pool with the target's shape of block
tables: it is indexed by the same block ids and slots, so one allocation (and
one prefix-cache entry) covers both models, and rolling back rejected tokens
needs nothing beyond lowering the sequence length. The draft therefore sees
every token the target sees, prefill chunks included.

One step program (`make_spec_step`) runs, on a packed batch whose decode
rows carry `K_i` placeholder tokens after their last accepted token:
  1. the draft over the whole packed batch (KV for every new token; its
     logits at each row's last real token give draft token 1),
  2. `K` single-token draft passes: pass j feeds draft token j at its
     position (writing its KV, so after a fully accepted round the draft is
     level with the target) and, for j < K, proposes token j + 1,
  3. the target over the packed batch with the draft tokens written into the
     placeholders (the verify window of K + 1 positions per row),
  4. `verify`: accepted tokens plus one correction or bonus token per row.
Rows with `num_draft = 0` (prefill chunks, requests without speculation)
are ordinary sampling steps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from engine.step import KVPool, StepBatch, paged_attend, token_logprobs
from engine.verify import sample_draft, verify


@struct.dataclass
class SpecBatch:
    """Device arrays describing the draft tokens of a packed step (see `scheduler.packing.SpecArrays`)."""

    num_draft: jax.Array  # int32 [S], draft tokens of each row (0 = no speculation)
    draft_token_index: jax.Array  # int32 [S, K], index in the packed tokens of each placeholder (T = none)
    verify_indices: jax.Array  # int32 [S, K+1], packed index of each verify position
    draft_slots: jax.Array  # int32 [K, S], slot of draft pass j's input token (0 = masked)

    @classmethod
    def from_packed(cls, spec) -> SpecBatch:
        return cls(**jax.device_put({f: getattr(spec, f) for f in cls.__dataclass_fields__}))


def _single_token_batch(batch: StepBatch, tokens: jax.Array, positions: jax.Array, slots: jax.Array,
                        live: jax.Array) -> StepBatch:
    """A decode batch of one token per row (`[S]`), sharing `batch`'s block tables."""
    S = tokens.shape[0]
    return StepBatch(
        token_ids=tokens, positions=positions, slot_mapping=jnp.where(live, slots, 0),
        query_start_loc=jnp.arange(S + 1, dtype=jnp.int32), seq_lens=jnp.where(live, positions + 1, 1),
        block_tables=batch.block_tables, logits_indices=jnp.arange(S, dtype=jnp.int32),
        temperature=batch.temperature, top_k=batch.top_k, top_p=batch.top_p, min_p=batch.min_p, seeds=batch.seeds,
        want_logprobs=batch.want_logprobs)


@functools.cache
def make_spec_step(target_graphdef: nnx.GraphDef, draft_graphdef: nnx.GraphDef, attention: Callable, K: int):
    """Returns the jitted `step(target_state, draft_state, pool, draft_pool, batch, spec)`.

    Returns `(sampled, num_emitted int32 [S], pool, draft_pool)`: `sampled`
    is an `engine.step.Sampled` over the `S * (K+1)` verify slots (row-major;
    log-probabilities only if some row wants them) and row `s` emits
    `sampled.tokens[s * (K+1):][:num_emitted[s]]`. Both pools are donated. `K`
    (static) is the largest draft length in the step; `K = 0` only keeps the
    draft's KV in step with the target's and samples as `make_step` does.
    """

    @functools.partial(jax.jit, donate_argnums=(2, 3))
    def step(target_state, draft_state, pool: KVPool, draft_pool: KVPool, batch: StepBatch, spec: SpecBatch):
        draft = nnx.merge(draft_graphdef, draft_state)
        target = nnx.merge(target_graphdef, target_state)
        hidden, draft_pool = draft(batch.token_ids, batch.positions, paged_attend(batch, attention), draft_pool)
        last_pos = batch.positions[batch.logits_indices]  # [S], position of each row's last real token
        S = last_pos.shape[0]
        V = target.cfg.vocab_size
        sampling = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds)
        tokens, probs = [], []
        if K:
            t, p = sample_draft(draft.logits(hidden[batch.logits_indices]), *sampling, last_pos + 1)
            tokens.append(t)
            probs.append(p)
            for j in range(1, K + 1):
                live = j <= spec.num_draft
                single = _single_token_batch(batch, tokens[-1], last_pos + j, spec.draft_slots[j - 1], live)
                h, draft_pool = draft(single.token_ids, single.positions, paged_attend(single, attention),
                                      draft_pool)
                if j < K:
                    t, p = sample_draft(draft.logits(h), *sampling, last_pos + j + 1)
                    tokens.append(t)
                    probs.append(p)
            draft_tokens = jnp.stack(tokens, axis=1)  # [S, K]
            token_ids = batch.token_ids.at[spec.draft_token_index].set(draft_tokens, mode="drop")
            draft_probs = jnp.stack(probs, axis=1)  # [S, K, V]
        else:
            draft_tokens = jnp.zeros((S, 0), jnp.int32)
            draft_probs = jnp.zeros((S, 0, V), jnp.float32)
            token_ids = batch.token_ids
        hidden, pool = target(token_ids, batch.positions, paged_attend(batch, attention), pool)
        logits = target.logits(hidden[spec.verify_indices.reshape(-1)]).reshape(S, K + 1, V)
        out, num_emitted = verify(logits, draft_probs, draft_tokens, spec.num_draft, *sampling, last_pos + 1)
        sampled = token_logprobs(logits.reshape(S * (K + 1), V), jnp.maximum(out.reshape(-1), 0),
                                 jnp.repeat(batch.want_logprobs, K + 1))
        return sampled, num_emitted, pool, draft_pool

    return step


# ---- adaptive speculation ---------------------------------------------------------------------


@dataclasses.dataclass
class SpeculationConfig:
    """Adaptive speculation: K per request class and per request from running acceptance rates.

    num_speculative_tokens: K when speculation pays (the top of the ladder
      K, K/2, ..., 1 of compiled draft lengths).
    min_acceptance: when a running acceptance rate (of a request or of its
      class) is below this, K is halved, down to 0 (off).
    ema_decay: weight of the past in the running averages, per verify step.
    retry_after_steps: a class switched off is retried at K = 1 after this many
      engine steps (twice as long after each failed retry), on the requests
      that arrive then.
    """

    num_speculative_tokens: int = 4
    min_acceptance: float = 0.5
    ema_decay: float = 0.5
    retry_after_steps: int = 200

    def __post_init__(self):
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if not 0 <= self.min_acceptance <= 1 or not 0 <= self.ema_decay < 1:
            raise ValueError("min_acceptance must be in [0, 1] and ema_decay in [0, 1)")

    @property
    def ladder(self) -> tuple[int, ...]:
        """The draft lengths a step program is compiled for: K, K/2, ..., 1 (ascending)."""
        ks, k = [], self.num_speculative_tokens
        while k:
            ks.append(k)
            k //= 2
        return tuple(reversed(ks))


@dataclasses.dataclass
class _Rate:
    """A running acceptance rate and the K it currently allows."""

    k: int
    rate: float = 1.0  # optimistic start: speculation is tried first
    off_since: int = 0  # engine step of the last halving (read once k is 0)
    good: int = 0  # verify steps at this K with the rate at or above the threshold
    failed_retries: int = 0  # retries in a row that ended off again


# A class's K climbs one ladder step after this many verify steps in a row at or above the threshold.
GROW_AFTER = 4
# The wait before a retry doubles with each failed retry, up to this factor.
MAX_BACKOFF = 64


class AdaptiveSpeculation:
    """Per-class and per-request acceptance rates (running averages) and each request's K.

    The rate of a verify step is accepted / tried draft tokens, where tried
    stops at the first rejection (min(num_draft, accepted + 1)): an estimate
    of the per-token acceptance probability alpha of Leviathan et al. 2023
    (§3.1) that does not depend on K, so one threshold serves every K.
    Whenever a rate is below `min_acceptance` its K halves (no optimistic
    reset: a class that does not pay goes from K to 0 in log2(K) + 1 poor
    steps); after `GROW_AFTER` verify steps in a row at or above it, a
    class's K climbs the ladder again, up to `num_speculative_tokens`. A class at 0
    retries at K = 1 (the cheapest verify) after `retry_after_steps`, twice
    as long after each retry that ends off again (exponential backoff, as
    in TCP's retransmission timer). A request at 0 stays off (its draft KV
    is no longer kept up to date).

    An unseeded request drafts min(class K, own K). A seeded request drafts
    its own K only, so its output depends on its own history alone.
    """

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self.classes: dict[str, _Rate] = {}
        self.requests: dict[str, _Rate] = {}

    def _class(self, name: str) -> _Rate:
        return self.classes.setdefault(name, _Rate(self.config.num_speculative_tokens))

    def class_k(self, request_class: str) -> int:
        return self._class(request_class).k

    def request_rate(self, request_id: str) -> float | None:
        r = self.requests.get(request_id)
        return None if r is None else r.rate

    def k_for(self, request_id: str, request_class: str, requested: int | None, step: int,
              seeded: bool = False) -> int:
        """K for a request's next verify step; `requested` is the request's own cap (None: engine default)."""
        c = self.config
        own = self.requests.setdefault(request_id, _Rate(c.num_speculative_tokens))
        k = own.k
        if not seeded:
            cls = self._class(request_class)
            wait = c.retry_after_steps * min(2 ** cls.failed_retries, MAX_BACKOFF)
            if cls.k == 0 and c.num_speculative_tokens and step - cls.off_since >= wait:
                cls.k, cls.rate, cls.good = 1, 1.0, 0  # retry
                cls.failed_retries += 1  # until it grows back to the top
            k = min(k, cls.k)
        return min(k, c.num_speculative_tokens if requested is None else requested)

    def update(self, request_id: str, request_class: str, num_draft: int, num_accepted: int, step: int) -> None:
        """Records one verify step's outcome: halves K where a running rate fell below the threshold
        and raises the class's K after a run of good steps."""
        if num_draft == 0:
            return
        c = self.config
        tried = min(num_draft, num_accepted + 1)
        own, cls = self.requests.setdefault(request_id, _Rate(c.num_speculative_tokens)), self._class(request_class)
        for r in (own, cls):
            r.rate = c.ema_decay * r.rate + (1 - c.ema_decay) * num_accepted / tried
            if r.rate < c.min_acceptance:
                r.good = 0
                if r.k > 0:
                    r.k //= 2
                    r.off_since = step
            else:
                r.good += 1
        if cls.good >= GROW_AFTER and 0 < cls.k < c.num_speculative_tokens:
            cls.k, cls.good = min(k for k in c.ladder if k > cls.k), 0
            if cls.k == c.num_speculative_tokens:
                cls.failed_retries = 0

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
