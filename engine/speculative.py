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

import collections
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
    """Adaptive speculation: K per request class from running acceptance rates.

    num_speculative_tokens: K when speculation pays.
    min_acceptance: below this running acceptance rate (of a request or of its
      class) K is halved, down to 0 (off).
    ema_decay: weight of the past in the running averages, per verify step.
    retry_after_steps: a class switched off gets K again after this many engine
      steps (its acceptance is re-measured).
    """

    num_speculative_tokens: int = 4
    min_acceptance: float = 0.5
    ema_decay: float = 0.9
    retry_after_steps: int = 200

    def __post_init__(self):
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if not 0 <= self.min_acceptance <= 1 or not 0 <= self.ema_decay < 1:
            raise ValueError("min_acceptance must be in [0, 1] and ema_decay in [0, 1)")


class AdaptiveSpeculation:
    """Tracks acceptance rates (running averages per request and per class) and picks each request's K."""

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self.class_rate: dict[str, float] = collections.defaultdict(lambda: 1.0)
        self.class_k: dict[str, int] = collections.defaultdict(lambda: config.num_speculative_tokens)
        self._off_since: dict[str, int] = {}
        self.request_rate: dict[str, float] = {}

    def k_for(self, request_id: str, request_class: str, requested: int | None, step: int,
              seeded: bool = False) -> int:
        """K for a request's next verify step; `requested` is the request's own cap (None: engine default).

        Which positions are drafted changes which random draws a sampled token
        uses (not its distribution), so a `seeded` request's K depends only on
        its own history: its output then never depends on other requests.
        """
        c = self.config
        k = c.num_speculative_tokens if seeded else self.class_k[request_class]
        if k == 0 and step - self._off_since.get(request_class, step) >= c.retry_after_steps:
            k = self.class_k[request_class] = c.num_speculative_tokens  # retry
            self.class_rate[request_class] = 1.0
            self._off_since.pop(request_class)
        if self.request_rate.get(request_id, 1.0) < c.min_acceptance:
            k = min(k, 1)
        return min(k, c.num_speculative_tokens if requested is None else requested)

    def update(self, request_id: str, request_class: str, num_draft: int, num_accepted: int, step: int) -> None:
        """Records one verify step's outcome and lowers the class's K while its rate is below the threshold."""
        if num_draft == 0:
            return
        c = self.config
        rate = num_accepted / num_draft
        self.request_rate[request_id] = c.ema_decay * self.request_rate.get(request_id, 1.0) + (1 - c.ema_decay) * rate
        self.class_rate[request_class] = c.ema_decay * self.class_rate[request_class] + (1 - c.ema_decay) * rate
        if self.class_rate[request_class] < c.min_acceptance and self.class_k[request_class] > 0:
            self.class_k[request_class] //= 2
            self.class_rate[request_class] = 1.0  # measure the new K afresh
            if self.class_k[request_class] == 0:
                self._off_since[request_class] = step

    def forget(self, request_id: str) -> None:
        self.request_rate.pop(request_id, None)
