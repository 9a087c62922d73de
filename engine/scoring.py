"""Scoring: log-probabilities of given token sequences under the model (teacher forcing).

A sequence runs through the same paged forward as generation, in chunks of at
most the token budget, writing its KV into blocks borrowed from the engine's
pool for the duration of the call; every position's logits are kept (not
only the last), so a sequence of n tokens costs one prefill of n tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from engine.step import KVPool, StepBatch, paged_attend
from scheduler.packing import bucket_for, pack
from scheduler.request import InvalidRequestError, Request, SamplingParams
from scheduler.scheduler import ScheduledSeq, StepPlan


@dataclasses.dataclass
class ScoreOutput:
    """The log-probabilities of one sequence.

    token_logprobs[i] is log p(token_ids[i + 1] | token_ids[:i + 1]) (natural
    log); the first token has none, so there are len(token_ids) - 1 of them.
    """

    token_ids: list[int]
    token_logprobs: list[float]

    @property
    def log_likelihood(self) -> float:
        """Sum of `token_logprobs`: log p(token_ids[1:] | token_ids[0])."""
        return float(np.sum(self.token_logprobs, dtype=np.float64))


def make_score_step(graphdef: nnx.GraphDef, attention: Callable):
    """Returns the jitted `score_step(state, pool, batch, targets) -> (logprobs float32 [T], pool)`.

    `targets` int32 `[T]` is the token following each position of
    `batch.token_ids`; the result is its log-probability under the raw
    log-softmax of that position's logits. The pool is donated.
    """

    @functools.partial(jax.jit, donate_argnums=(1,))
    def score_step(state, pool: KVPool, batch: StepBatch, targets: jax.Array):
        model = nnx.merge(graphdef, state)
        hidden, pool = model(batch.token_ids, batch.positions, paged_attend(batch, attention), pool)
        logits = model.logits(hidden)  # [T, V]
        chosen = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        return chosen - jax.nn.logsumexp(logits, axis=-1), pool

    return score_step


def score_sequence(engine, score_step: Callable, token_ids: list[int]) -> ScoreOutput:
    """Scores one sequence on `engine` (an `engine.engine.Engine`) with `score_step` (from
    `make_score_step`); call it on the engine's thread.

    Runs between engine steps; requests in flight are unaffected. Compiles
    once per token bucket on first use.
    Raises:
      InvalidRequestError: empty, longer than `engine.max_model_len`, or ids outside [0, V).
      scheduler.block_manager.NoFreeBlocksError: the pool has too few free
        blocks for the sequence right now (running requests hold them).
    """
    ids = [int(t) for t in token_ids]
    n, V = len(ids), engine.model_config.vocab_size
    if n == 0:
        raise InvalidRequestError("text to score is empty")
    if n > engine.max_model_len:
        raise InvalidRequestError(f"text to score has {n} tokens; the context limit is {engine.max_model_len}")
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise InvalidRequestError(f"token ids must be in [0, {V}); got {bad[:5]}")
    # A request object only to reuse `pack`; it never enters the scheduler.
    request = Request(ids, SamplingParams(), request_id="score")
    request.allocation = engine.blocks.allocate(None, n - 1)
    budget = engine.config.max_num_batched_tokens
    out = np.empty(n - 1, np.float32)
    try:
        for start in range(0, n - 1, budget):
            m = min(budget, n - 1 - start)  # the last token is only a target
            plan = StepPlan([ScheduledSeq(request, start, m, sample=False)], [])
            packed = pack(plan, engine.config.block_size, engine.max_blocks_per_seq, engine.token_buckets,
                          engine.seq_buckets, {"score": 0})
            targets = np.zeros(bucket_for(m, engine.token_buckets), np.int32)
            targets[:m] = ids[start + 1:start + 1 + m]
            logprobs, engine.pool = score_step(engine.state, engine.pool, StepBatch.from_packed(packed), targets)
            out[start:start + m] = np.asarray(logprobs)[:m]
    finally:
        engine.blocks.free(request.allocation)
    return ScoreOutput(ids, out.tolist())
