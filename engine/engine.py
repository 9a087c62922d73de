"""The engine loop: scheduler -> packed batch -> jitted step -> request updates."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time

import jax
import numpy as np
from flax import nnx

from engine.compilation import compilation_count
from engine.scoring import ScoreOutput, make_score_step, score_sequence
from engine.speculative import AdaptiveSpeculation, SpecBatch, SpeculationConfig, make_spec_step
from engine.step import KVPool, Sampled, StepBatch, copy_blocks, gather_blocks, make_step, scatter_blocks
from model.llama import Llama
from pallas_kernels.reference import ragged_paged_attention_reference
from scheduler.block_manager import BlockManager
from scheduler.packing import PackedBatch, bucket_for, pack, power_of_two_buckets
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
    enable_prefix_caching: reuse the KV of cached prompt blocks (radix tree, LRU).
    kv_watermark: fraction of the pool kept free: cached blocks are evicted to
      keep it on the free list, and new requests are admitted only above it.
    swap_space_bytes: host memory for the KV of preempted sequences.
    swap_threshold_tokens: preempted sequences at least this long are swapped
      to host memory; shorter ones (or when swap space is full) are recomputed.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_watermark: float = 0.1
    swap_space_bytes: int = 1 << 30
    swap_threshold_tokens: int = 256
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
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if self.swap_space_bytes < 0 or self.swap_threshold_tokens < 0:
            raise ValueError("swap_space_bytes and swap_threshold_tokens must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (or None for the model's limit), got {self.max_model_len}")


@dataclasses.dataclass
class RequestOutput:
    """A request's state after a step: the full text so far and what is new.

    A request with `n > 1` samples gives one output stream per sample (`index`).
    """

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
    index: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # Speculative decoding (zero without a draft): draft tokens proposed and
    # accepted, and target steps that emitted tokens (decode or verify).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None if nothing was proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per target step that emitted any (1.0 without speculation)."""
        return len(self.token_ids) / max(self.num_target_steps, 1)

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
      draft: a `LoadedModel` of a draft model with the target's vocabulary, for
        speculative decoding (None: no speculation).
      speculation: K and the adaptive-speculation settings (with a draft).
    Raises:
      ValueError: bad limits, or a draft whose vocabulary differs.
    """

    def __init__(self, model, config: EngineConfig = EngineConfig(), draft=None,
                 speculation: SpeculationConfig | None = None):
        cfg = model.config
        self.model_config = cfg
        self.tokenizer = model.tokenizer
        self.config = config
        llama = Llama(cfg, params=model.params)
        self.graphdef, self.state = nnx.split(llama)
        B = config.block_size
        bytes_per_block = _kv_bytes_per_block(cfg, B)
        if draft is not None:
            if draft.config.vocab_size != cfg.vocab_size:
                raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                                 f"({cfg.vocab_size})")
            bytes_per_block += _kv_bytes_per_block(draft.config, B)
        num_blocks = config.num_blocks or max(2, config.kv_cache_bytes // bytes_per_block)
        self.blocks = BlockManager(num_blocks, B, config.enable_prefix_caching, config.kv_watermark)
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
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                            config.swap_threshold_tokens, config.swap_space_bytes // bytes_per_block), self.blocks)
        self.token_buckets = power_of_two_buckets(config.max_num_batched_tokens)
        self.seq_buckets = power_of_two_buckets(config.max_num_seqs)
        self.block_op_buckets = power_of_two_buckets(max(config.max_num_seqs, self.max_blocks_per_seq))
        self.pool = KVPool.zeros(cfg, num_blocks, B)
        self.attention = config.attention
        if self.attention == "auto":
            self.attention = "reference" if jax.default_backend() == "cpu" else "pallas"
        attention = ragged_paged_attention_reference
        if self.attention == "pallas":
            from pallas_kernels.ragged_paged_attention import ragged_paged_attention
            attention = ragged_paged_attention
        self._step = make_step(self.graphdef, attention)
        self.draft_config = draft.config if draft is not None else None
        self.speculation = None
        if draft is not None:
            self.draft_graphdef, self.draft_state = nnx.split(Llama(draft.config, params=draft.params))
            self.draft_pool = KVPool.zeros(draft.config, num_blocks, B)
            self.speculation = AdaptiveSpeculation(speculation or SpeculationConfig())
            self._attention_fn = attention
        self._score_step = make_score_step(self.graphdef, attention)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) or tuple(cfg.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._detok: dict[str, _Detokenizer] = {}
        self._seeds: dict[str, int] = {}
        self._children: dict[str, list[Request]] = {}  # n > 1 requests after their fork
        self._logprobs: dict[str, list[dict[int, float]]] = {}  # requests that asked for them
        self.num_steps = 0
        self.num_draft_tokens = 0  # proposed and accepted draft tokens, all requests
        self.num_accepted_tokens = 0
        # Cumulative wall time: host work (schedule, pack, block ops, outputs) and the device step.
        self.host_seconds = 0.0
        self.device_seconds = 0.0

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raises InvalidRequestError if the request cannot run.

        Rule: a prompt needs 1 to `max_model_len - 1` tokens (room for at
        least one generated token); generation stops with "length" when the
        sequence reaches `max_model_len`, even before `max_tokens`.
        """
        sampling.validate()
        k = sampling.num_speculative_tokens
        if k and self.speculation is None:
            raise InvalidRequestError("speculation is not available: the engine has no draft model")
        if k is not None and self.speculation is not None and k > self.speculation.config.num_speculative_tokens:
            raise InvalidRequestError(f"num_speculative_tokens={k} exceeds the engine's "
                                      f"{self.speculation.config.num_speculative_tokens}")
        if sampling.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={sampling.n} exceeds max_num_seqs={self.config.max_num_seqs}")
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
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    request_class: str = "default") -> Request:
        """Queues a request; raises InvalidRequestError (and queues nothing) if it is invalid.

        `priority`: lower values are admitted first and preempted last.
        `cache_salt`: requests share prefix-cache entries only with the same salt.
        `request_class`: speculation adapts K to the acceptance rate per class.
        """
        if not isinstance(request_class, str):
            raise InvalidRequestError(f"request_class must be a string, got {request_class!r}")
        self.validate(prompt_token_ids, sampling)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a string, got {cache_salt!r}")
        kwargs = {"priority": priority, "cache_salt": cache_salt, "request_class": request_class}
        if request_id is not None:
            kwargs["request_id"] = request_id
        request = Request([int(t) for t in prompt_token_ids], sampling, self.eos_token_ids, **kwargs)
        if request.request_id in self._requests or request.request_id in self._children:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self._requests[request.request_id] = request
        self._detok[request.request_id] = _Detokenizer(self.tokenizer, sampling.stop)
        self._seeds[request.request_id] = sampling.seed if sampling.seed is not None else secrets.randbits(32)
        if sampling.logprobs is not None:
            self._logprobs[request.request_id] = []
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        """Ends a request (all its samples) now and frees its blocks; unknown ids are ignored."""
        for request in [self._requests.get(request_id), *self._children.get(request_id, ())]:
            if request is not None and not request.finished:
                self.scheduler.finish(request, FinishReason.ABORT)
                self._forget(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request that got new tokens or finished."""
        t0 = time.perf_counter()
        if self.speculation is not None:
            for r in self.scheduler.running:
                r.spec_k = self._spec_k(r)
        plan = self.scheduler.schedule()
        self._apply_block_ops(plan)
        for parent, children in plan.forks:
            self._fork(parent, children)
        if not plan.seqs:
            self.host_seconds += time.perf_counter() - t0
            return []
        K = self._step_k(plan)
        packed = pack(plan, self.config.block_size, self.max_blocks_per_seq, self.token_buckets,
                      self.seq_buckets, self._seeds, K)
        t1 = time.perf_counter()
        tokens, num_emitted, sampled = self._run(packed, K)
        t2 = time.perf_counter()
        accepted = [int(num_emitted[i]) - 1 if s.num_draft else 0 for i, s in enumerate(plan.seqs)]
        self.scheduler.commit(plan, accepted)
        self.num_steps += 1
        outputs = []
        for i, s in enumerate(plan.seqs):
            if not s.sample:
                continue
            r = s.request
            r.num_target_steps += 1
            if s.num_draft:
                r.num_draft_tokens += s.num_draft
                r.num_accepted_tokens += accepted[i]
                self.num_draft_tokens += s.num_draft
                self.num_accepted_tokens += accepted[i]
                self.speculation.update(r.request_id, r.request_class, s.num_draft, accepted[i], self.num_steps)
            n = r.sampling.logprobs
            emitted = tokens[i, :num_emitted[i]].tolist()
            logprobs = [_logprob_entry(sampled, i, j, n) for j in range(len(emitted))] if n is not None else None
            outputs.append(self._append(r, emitted, logprobs))
        self.host_seconds += (t1 - t0) + (time.perf_counter() - t2)
        self.device_seconds += t2 - t1
        return outputs

    def _spec_k(self, r: Request) -> int:
        """The draft length a request wants now; 0 once its draft KV fell behind."""
        if not r.draft_synced:
            return 0
        return self.speculation.k_for(r.request_id, r.request_class, r.sampling.num_speculative_tokens,
                                      self.num_steps, seeded=r.sampling.seed is not None)

    def _step_k(self, plan: StepPlan) -> int | None:
        """The step's program: None (target only), 0 (the draft keeps its KV), or a ladder K >= every draft.

        When no request in the step will speculate, the draft is skipped: speculation that was
        switched off then costs nothing, and those requests' draft KV falls behind for good. Their
        blocks hold no draft KV either, so a later request that reuses them through the prefix
        cache drafts from an incomplete context: fewer tokens accepted, the output unchanged.
        """
        if self.speculation is None:
            return None
        drafted = max(s.num_draft for s in plan.seqs)
        if drafted:
            return min(k for k in self.speculation.config.ladder if k >= drafted)
        if any(self._spec_k(s.request) for s in plan.seqs):
            return 0
        for s in plan.seqs:
            s.request.draft_synced = False
        return None

    def _run(self, packed: PackedBatch, K: int | None) -> tuple[np.ndarray, np.ndarray, Sampled | None]:
        """Runs the step program and makes the step's one device-to-host read.

        Returns (tokens int32 [S, K+1], num_emitted int32 [S], log-probabilities
        of each emitted slot as a host `Sampled` with `[S, K+1]` leading dims, or
        None when no request asked for them).
        """
        batch = StepBatch.from_packed(packed)
        if K is None:
            sampled, self.pool = self._step(self.state, self.pool, batch)
            num_emitted = np.ones(sampled.tokens.shape[0], np.int32)
        else:
            step = make_spec_step(self.graphdef, self.draft_graphdef, self._attention_fn, K)
            sampled, num_emitted, self.pool, self.draft_pool = step(
                self.state, self.draft_state, self.pool, self.draft_pool, batch, SpecBatch.from_packed(packed.spec))
        if not packed.want_logprobs.any():
            tokens, num_emitted = jax.device_get((sampled.tokens, num_emitted))
            return tokens.reshape(len(num_emitted), -1), num_emitted, None
        sampled, num_emitted = jax.device_get((sampled, num_emitted))
        sampled = jax.tree.map(lambda x: x.reshape(len(num_emitted), -1, *x.shape[1:]), sampled)
        return sampled.tokens, num_emitted, sampled

    def _append(self, request: Request, tokens: list[int], logprobs: list[dict] | None = None) -> RequestOutput:
        """Appends emitted tokens one by one; the first that finishes the request ends it (the rest are dropped)."""
        detok = self._detok[request.request_id]
        reason = None
        for n, token in enumerate(tokens, 1):
            reason = request.append_token(token, self.max_model_len)
            if detok.update(request.output_token_ids):
                reason = FinishReason.STOP
            if reason is not None:
                tokens = tokens[:n]
                break
        history = self._logprobs.get(request.request_id)
        if history is not None:
            history.extend(logprobs[:len(tokens)])
        if reason is not None:
            self.scheduler.finish(request, reason)
            self._forget(request)
        user_id = request.parent.request_id if request.parent else request.request_id
        return RequestOutput(
            user_id, request.prompt_token_ids, detok.text, list(request.output_token_ids),
            reason.value if reason else None, delta_text=detok.delta(final=reason is not None),
            delta_token_ids=tokens, logprobs=list(history) if history is not None else None, index=request.index,
            num_cached_tokens=request.num_cached_tokens, num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens, num_target_steps=request.num_target_steps)

    def _forget(self, request: Request) -> None:
        """Drops the engine's bookkeeping of a finished request."""
        rid = request.request_id
        del self._requests[rid], self._detok[rid], self._seeds[rid]
        self._logprobs.pop(rid, None)
        if self.speculation is not None:
            self.speculation.forget(rid)
        if request.parent is not None:
            siblings = self._children[request.parent.request_id]
            if all(c.finished for c in siblings):
                del self._children[request.parent.request_id]

    def _fork(self, parent: Request, children: list[Request]) -> None:
        """Takes over an n > 1 request's bookkeeping for its samples; sample i uses seed + i."""
        seed = self._seeds[parent.request_id]
        del self._requests[parent.request_id], self._detok[parent.request_id], self._seeds[parent.request_id]
        self._children[parent.request_id] = children
        for c in children:
            if self._logprobs.pop(parent.request_id, None) is not None or c.sampling.logprobs is not None:
                self._logprobs[c.request_id] = []
            self._requests[c.request_id] = c
            self._detok[c.request_id] = _Detokenizer(self.tokenizer, c.sampling.stop)
            self._seeds[c.request_id] = (seed + c.index) % 2**32

    def _apply_block_ops(self, plan: StepPlan) -> None:
        """Swap out, swap in, then copy-on-write copies, before the step writes anything."""
        pools = ["pool"] + (["draft_pool"] if self.speculation is not None else [])
        for request, blocks in plan.swap_out:
            ids = self._block_ids(blocks)
            request.swapped_kv = [np.asarray(x)[:, :len(blocks)]
                                  for name in pools for x in gather_blocks(getattr(self, name), ids)]
        for request, blocks in plan.swap_in:
            kv = request.swapped_kv
            request.swapped_kv = None
            ids = self._block_ids(blocks)
            pad = [(0, 0), (0, len(ids) - len(blocks))] + [(0, 0)] * 3
            for j, name in enumerate(pools):
                k, v = kv[2 * j], kv[2 * j + 1]
                setattr(self, name, scatter_blocks(getattr(self, name), ids, np.pad(k, pad), np.pad(v, pad)))
        if plan.copies:
            src = self._block_ids([c.src for c in plan.copies])
            dst = self._block_ids([c.dst for c in plan.copies])
            for name in pools:
                setattr(self, name, copy_blocks(getattr(self, name), src, dst))

    def _block_ids(self, blocks) -> np.ndarray:
        """Block ids padded with the reserved block 0 to a block-op bucket."""
        ids = np.zeros(bucket_for(len(blocks), self.block_op_buckets), np.int32)
        ids[:len(blocks)] = blocks
        return ids

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
        spec_ks = [None] if self.speculation is None else [None, 0, *self.speculation.config.ladder]
        for T, S in buckets or self.buckets:
            for K in spec_ks:
                self._run(_padding_batch(T, S, self.max_blocks_per_seq, K), K)
        if buckets is None:  # the block-op programs too (copy-on-write and swap)
            for n in self.block_op_buckets:
                ids = np.zeros(n, np.int32)
                self.pool = copy_blocks(self.pool, ids, ids)
                k, v = gather_blocks(self.pool, ids)
                self.pool = scatter_blocks(self.pool, ids, k, v)
                if self.speculation is not None:
                    self.draft_pool = copy_blocks(self.draft_pool, ids, ids)
                    k, v = gather_blocks(self.draft_pool, ids)
                    self.draft_pool = scatter_blocks(self.draft_pool, ids, k, v)
        jax.block_until_ready(self.pool)
        return len(buckets or self.buckets)

    @staticmethod
    def compilation_count() -> int:
        return compilation_count()


def _kv_bytes_per_block(cfg, block_size: int) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize


def _logprob_entry(sampled: Sampled, row: int, slot: int, n: int) -> dict[int, float]:
    """Top `n` log-probabilities at (row, slot), most likely first, then the emitted token's if not among them."""
    entry = {int(t): float(v) for t, v in zip(sampled.top_ids[row, slot, :n], sampled.top_logprobs[row, slot, :n])}
    entry.setdefault(int(sampled.tokens[row, slot]), float(sampled.logprobs[row, slot]))
    return entry


def _padding_batch(T: int, S: int, max_blocks: int, spec_k: int | None = None) -> PackedBatch:
    """A batch of shape (T, S) with no real tokens: it only writes to the reserved block."""
    return pack(StepPlan([], []), 1, max_blocks, (T,), (S,), {}, spec_k)
