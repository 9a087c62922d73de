"""Scoring: log-probabilities of given token sequences under the model (teacher forcing).

A sequence runs through the same paged forward as generation
(`engine.runner.ModelRunner.score`), in chunks of at most the token budget,
writing its KV into blocks borrowed from the engine's pool for the duration
of the call; every position's logits are kept (not only the last), so a
sequence of n tokens costs one prefill of n tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from engine.step import KVPool, StepBatch, paged_attend, step_program


@dataclasses.dataclass
class ScoreOutput:
    """The log-probabilities of one sequence.

    token_logprobs[i] is log p(token_ids[i + 1] | token_ids[:i + 1]) (natural
    log); the first token has none, so there are len(token_ids) - 1 of them.
    token_is_greedy[i] says whether token_ids[i + 1] is the argmax of that
    position's logits (what greedy decoding would emit; ties go to the lowest id);
    top_token_ids[i] is that argmax and top_logprobs[i] its log-probability (OpenAI's
    top_logprobs of a prompt token, which lm-evaluation-harness reads to tell greedy).
    """

    token_ids: list[int]
    token_logprobs: list[float]
    token_is_greedy: list[bool] = dataclasses.field(default_factory=list)
    top_token_ids: list[int] = dataclasses.field(default_factory=list)
    top_logprobs: list[float] = dataclasses.field(default_factory=list)

    @property
    def log_likelihood(self) -> float:
        """Sum of `token_logprobs`: log p(token_ids[1:] | token_ids[0])."""
        return float(np.sum(self.token_logprobs, dtype=np.float64))


def make_score_step(graphdef: nnx.GraphDef, attention: Callable):
    """Returns the jitted `score_step(state, pool, batch, targets) -> (logprobs float32 [T], argmax int32 [T],
    top float32 [T], pool)`.

    `targets` int32 `[T]` is the token following each position of
    `batch.token_ids`; `logprobs` is its log-probability under the raw
    log-softmax of that position's logits, `argmax` their argmax and `top` its
    log-probability (`Llama.target_logprobs`: native kernels on CPU).
    The pool is donated.
    """

    @step_program(donate_argnums=(1,))
    def score_step(state, pool: KVPool, batch: StepBatch, targets: jax.Array):
        model = nnx.merge(graphdef, state)
        hidden, pool = model(batch.token_ids, batch.positions, paged_attend(batch, attention), pool)
        logprobs, argmax, top = model.target_logprobs(hidden, targets)
        return logprobs, argmax, top, pool

    return score_step
