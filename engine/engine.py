"""The engine loop: scheduler -> packed batch -> jitted step -> request updates."""

from __future__ import annotations

import dataclasses
import logging
import secrets

import jax
import numpy as np
from flax import nnx

from engine.compilation import compilation_count, enable_persistent_cache
from engine.scoring import ScoreOutput, make_score_step, score_sequence
from engine.step import KVPool, Sampled, StepBatch, make_step
from model.llama import Llama
from pallas_kernels.reference import ragged_paged_attention_reference
from scheduler.block_manager import BlockManager
from scheduler.packing import PackedBatch, pack, power_of_two_buckets
from scheduler.request import FinishReason, InvalidRequestError, Request, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig, StepPlan

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine limits, separate from the model's config.

    num_blocks: KV pool size in blocks; None sizes the pool from
      `kv_cache_bytes`.
    max_model_len: prompt + output tokens per sequence; None means the model's
      context limit, capped at what the pool holds.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    # "auto": the Pallas kernel on GPU, the jnp reference on CPU (where Pallas
    # only runs in interpret mode, an emulator several times slower).
    attention: str = "auto"  # or "pallas" / "reference"

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.attention not in ("auto", "reference", "pallas"):
            raise ValueError(f"attention must be 'auto', 'reference' or 'pallas', got {self.attention!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (or None for the model's limit), got {self.max_model_len}")


@dataclasses.dataclass
class RequestOutput:
    """A request's state after a step: the full text so far and what is new."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    # With SamplingParams.logprobs set: one entry per token of `token_ids`,
    # {token id: log-probability} for the top `logprobs` tokens (most likely
    # first) and the generated token (last, if not among them).
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _Detokenizer:
    """Incremental text of one request; holds back incomplete UTF-8 and possible stop-string prefixes."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self.emitted = 0

    def update(self, token_ids: list[int]) -> bool:
        """Re-decodes the output; returns True if a stop string now ends it (text truncated there)."""
        text = self.tokenizer.decode(token_ids)
        searched_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text = text
        hits = [i for i in (text.find(s, searched_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = text[:min(hits)]
            return True
        return False

    def delta(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                end -= 1
            end -= max((len(s) for s in self.stop), default=1) - 1
        end = max(end, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out


class Engine:
    """Runs requests on one model: continuous batching over a paged KV pool.

    Args:
      model: a `checkpoints.LoadedModel` (config, params, tokenizer).
      config: engine limits.
    """

    def __init__(self, model, config: EngineConfig = EngineConfig()):
        enable_persistent_cache()
        cfg = model.config
        self.model_config = cfg
        self.tokenizer = model.tokenizer
        self.config = config
        llama = Llama(cfg, params=model.params)
        self.graphdef, self.state = nnx.split(llama)
        B = config.block_size
        bytes_per_block = 2 * cfg.num_layers * B * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize
        num_blocks = config.num_blocks or max(2, config.kv_cache_bytes // bytes_per_block)
        self.blocks = BlockManager(num_blocks, B)
        capacity = self.blocks.num_usable_blocks * B
        if config.max_model_len is not None and config.max_model_len > min(cfg.max_position_embeddings, capacity):
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's context limit "
                f"({cfg.max_position_embeddings}) or the KV pool's capacity ({capacity} tokens in {num_blocks} blocks)")
        self.max_model_len = config.max_model_len or min(cfg.max_position_embeddings, capacity)
        if self.max_model_len < cfg.max_position_embeddings:
            log.info("max_model_len %d (the KV pool holds %d tokens)", self.max_model_len, capacity)
        self.max_blocks_per_seq = -(-self.max_model_len // B)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len), self.blocks)
        self.token_buckets = power_of_two_buckets(config.max_num_batched_tokens)
        self.seq_buckets = power_of_two_buckets(config.max_num_seqs)
        self.pool = KVPool.zeros(cfg, num_blocks, B)
        self.attention = config.attention
        if self.attention == "auto":
            self.attention = "reference" if jax.default_backend() == "cpu" else "pallas"
        attention = ragged_paged_attention_reference
        if self.attention == "pallas":
            from pallas_kernels.ragged_paged_attention import ragged_paged_attention
            attention = ragged_paged_attention
        self._step = make_step(self.graphdef, attention)
        self._score_step = make_score_step(self.graphdef, attention)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) or tuple(cfg.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, _Detokenizer] = {}
        self._seeds: dict[str, int] = {}
        self._logprobs: dict[str, list[dict[int, float]]] = {}  # requests that asked for them
        self.num_steps = 0

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raises InvalidRequestError if the request cannot run.

        Rule: a prompt needs 1 to `max_model_len - 1` tokens (room for at
        least one generated token); generation stops with "length" when the
        sequence reaches `max_model_len`, even before `max_tokens`.
        """
        sampling.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens; the context limit is {self.max_model_len} tokens and must leave "
                "room for at least one generated token")
        V = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < V)]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be in [0, {V}); got {bad[:5]}")

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams,
                    request_id: str | None = None, priority: int = 0) -> Request:
        """Queues a request; raises InvalidRequestError (and queues nothing) if it is invalid.

        `priority`: lower values are admitted first and preempted last.
        """
        self.validate(prompt_token_ids, sampling)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        kwargs = {"request_id": request_id, "priority": priority} if request_id is not None else {"priority": priority}
        request = Request([int(t) for t in prompt_token_ids], sampling, self.eos_token_ids, **kwargs)
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self._requests[request.request_id] = request
        self._detok[request.request_id] = _Detokenizer(self.tokenizer, sampling.stop)
        self._seeds[request.request_id] = sampling.seed if sampling.seed is not None else secrets.randbits(32)
        if sampling.logprobs is not None:
            self._logprobs[request.request_id] = []
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        """Ends a request now and frees its blocks; unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request, FinishReason.ABORT)
            self._detok.pop(request_id)
            self._seeds.pop(request_id)
            self._logprobs.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request that got new tokens or finished."""
        plan = self.scheduler.schedule()
        if not plan.seqs:
            return []
        packed = pack(plan, self.config.block_size, self.max_blocks_per_seq, self.token_buckets,
                      self.seq_buckets, self._seeds)
        sampled, self.pool = self._step(self.state, self.pool, StepBatch.from_packed(packed))
        want_logprobs = packed.want_logprobs.any()
        # The step's one device-to-host read; the log-probabilities only when some request asked.
        sampled = jax.device_get(sampled if want_logprobs else sampled.tokens)
        tokens = sampled.tokens if want_logprobs else sampled
        self.scheduler.commit(plan)
        self.num_steps += 1
        outputs = []
        for i, s in enumerate(plan.seqs):
            if s.sample:
                n = s.request.sampling.logprobs
                logprob = _logprob_entry(sampled, i, n) if n is not None else None
                outputs.append(self._append(s.request, int(tokens[i]), logprob))
        return outputs

    def _append(self, request: Request, token: int, logprob: dict[int, float] | None = None) -> RequestOutput:
        reason = request.append_token(token, self.max_model_len)
        logprobs = self._logprobs.get(request.request_id)
        if logprobs is not None:
            logprobs.append(logprob)
        detok = self._detok[request.request_id]
        if detok.update(request.output_token_ids):
            reason = FinishReason.STOP
        if reason is not None:
            self.scheduler.finish(request, reason)
            del self._requests[request.request_id], self._detok[request.request_id]
            del self._seeds[request.request_id]
            self._logprobs.pop(request.request_id, None)
        return RequestOutput(request.request_id, request.prompt_token_ids, detok.text,
                             list(request.output_token_ids), reason.value if reason else None,
                             detok.delta(final=reason is not None), [token],
                             list(logprobs) if logprobs is not None else None)

    # ---- scoring --------------------------------------------------------------------------

    def score(self, token_ids: list[int]) -> ScoreOutput:
        """Log-probabilities of `token_ids[1:]`, each given the tokens before it (see `ScoreOutput`).

        Runs between steps (same thread as `step`); requests in flight are unaffected.
        Raises:
          InvalidRequestError: empty, longer than `max_model_len`, or ids outside [0, V).
          scheduler.block_manager.NoFreeBlocksError: too few free KV blocks right now.
        """
        return score_sequence(self, self._score_step, token_ids)

    # ---- compilation ----------------------------------------------------------------------

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Every (token bucket, sequence bucket) shape the step can be compiled for."""
        return [(t, s) for t in self.token_buckets for s in self.seq_buckets if s <= t]

    def precompile(self, buckets: list[tuple[int, int]] | None = None) -> int:
        """Compiles the step for `buckets` (default: all) with all-padding batches; returns the count."""
        for T, S in buckets or self.buckets:
            packed = _padding_batch(T, S, self.max_blocks_per_seq)
            _, self.pool = self._step(self.state, self.pool, StepBatch.from_packed(packed))
        jax.block_until_ready(self.pool)
        return len(buckets or self.buckets)

    @staticmethod
    def compilation_count() -> int:
        return compilation_count()


def _logprob_entry(sampled: Sampled, row: int, n: int) -> dict[int, float]:
    """Row `row`'s top `n` log-probabilities, most likely first, then the sampled token's if not among them."""
    entry = {int(t): float(v) for t, v in zip(sampled.top_ids[row, :n], sampled.top_logprobs[row, :n])}
    entry.setdefault(int(sampled.tokens[row]), float(sampled.logprobs[row]))
    return entry


def _padding_batch(T: int, S: int, max_blocks: int) -> PackedBatch:
    """A batch of shape (T, S) with no real tokens: it only writes to the reserved block."""
    return pack(StepPlan([], []), 1, max_blocks, (T,), (S,), {})
