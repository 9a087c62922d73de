"""The engine loop: schedule -> run -> update, over a scheduler (host), a runner (device) and per-request state.

One `Engine.step`: the scheduler plans the step under the token budget
(asking the speculation gate how many draft tokens each decode gets); the
runner applies the plan's block operations, packs it into a bucket and runs
the one step program; the engine then commits the step to the scheduler and
turns each row's emitted tokens into a `RequestOutput` (detokenizing, stop
strings, log-probabilities). The structure follows vLLM v1's `EngineCore.step`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np

from engine import kernels
from engine.compilation import compilation_count, release_if_near_limit
from engine.config import EngineConfig
from engine.spec import SpeculationConfig, make_proposer
from engine.spec.costs import StepCosts
from engine.spec.gate import Gate
from engine.inputs import check_token_ids
from engine.outputs import Detokenizer, RequestOutput
from engine.runner import EngineStats, ModelRunner, StepOutput, StepTiming
from engine.distributed import agree_on_timing, seed_source
from engine.step import kv_bytes_per_block
from engine.scoring import ScoreOutput
from engine.step import Sampled
from scheduler.block_manager import BlockManager
from scheduler.request import FinishReason, InvalidRequestError, Request, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig, StepPlan
from scheduler.util import cdiv

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class ScoreJob:
    """A sequence being scored chunk by chunk (`Engine.start_score`), holding KV blocks until `end_score`."""

    token_ids: list[int]
    allocation: object  # the block manager's, for len(token_ids) - 1 tokens; None once freed
    logprobs: np.ndarray  # float32 [n - 1], filled up to num_scored
    top_ids: np.ndarray  # int32 [n - 1], each position's argmax, filled up to num_scored
    top_logprobs: np.ndarray  # float32 [n - 1], the argmax's log-probability
    num_scored: int = 0

    def output(self) -> ScoreOutput:
        greedy = self.top_ids == np.asarray(self.token_ids[1:])
        return ScoreOutput(self.token_ids, self.logprobs.tolist(), greedy.tolist(), self.top_ids.tolist(),
                           self.top_logprobs.tolist())


@dataclasses.dataclass(eq=False)
class RequestState:
    """The engine's bookkeeping of one request (or of one sample of an n > 1 request)."""

    request: Request
    detokenizer: Detokenizer
    seed: int  # the explicit or drawn 32-bit sampling seed
    logprobs: list[dict[int, float]] | None  # one entry per generated token, when the request asked for them


class Engine:
    """Runs requests on one model: continuous batching over a paged KV pool.

    Args:
      model: a `checkpoints.LoadedModel` (config, params, tokenizer).
      config: engine limits.
      draft: a `LoadedModel` of a draft model, an EAGLE head or Medusa heads for
        the target, for speculation methods "draft", "eagle" and "medusa".
      speculation: the proposer, G and the adaptive-speculation settings (None:
        the method `draft` is for, with a draft, else no speculation).
    Raises:
      ValueError: bad limits, a draft whose vocabulary differs, or method "draft" / "eagle" / "medusa"
        without a draft of that kind.

    `on_step`, if set, is called with each step's `StepTiming` (the program it
    ran and its time per phase); `stats` keeps the totals.
    """

    def __init__(self, model, config: EngineConfig = EngineConfig(), draft=None,
                 speculation: SpeculationConfig | None = None):
        cfg = model.config
        self.model_config = cfg
        self.tokenizer = model.tokenizer
        # One kernel family for target and proposer (`engine.kernels`); tensor parallel runs use XLA's dot.
        dtype = config.kernel_dtype or model.stored_dtype or cfg.dtype
        self.kernel_choice = (kernels.KernelChoice("xla", "tensor parallel") if config.tensor_parallel_size > 1
                              else kernels.choose(cfg, dtype, config.matmul,
                                                  kernels.weight_formats(model.params, dtype)))
        config = dataclasses.replace(config, matmul=self.kernel_choice.family)
        self.config = config
        self.proposer = make_proposer(draft, speculation, cfg, config)
        B = config.block_size
        bytes_per_block = kv_bytes_per_block(cfg, B, config.tensor_parallel_size) + self.proposer.bytes_per_block(B)
        num_blocks = config.num_blocks or max(2, config.kv_cache_bytes // bytes_per_block)
        self.blocks = BlockManager(num_blocks, B, config.enable_prefix_caching, config.kv_watermark)
        # A windowed model's passed blocks go back to the pool, unless a proposer's own KV (a draft model's, an
        # EAGLE head's) reads every position through the same block table.
        self.kv_window = cfg.max_window if self.proposer.bytes_per_block(B) == 0 else 0
        capacity = self.blocks.num_usable_blocks * B
        if config.max_model_len is not None and config.max_model_len > min(cfg.max_position_embeddings, capacity):
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's context limit "
                f"({cfg.max_position_embeddings}) or the KV pool's capacity ({capacity} tokens in {num_blocks} blocks)")
        self.max_model_len = config.max_model_len or min(cfg.max_position_embeddings, capacity)
        if self.max_model_len < cfg.max_position_embeddings:
            log.info("max_model_len %d (the KV pool holds %d tokens)", self.max_model_len, capacity)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                            config.swap_threshold_tokens, config.swap_space_bytes // bytes_per_block,
                            self.kv_window), self.blocks)
        self.runner = ModelRunner(model, config, num_blocks, cdiv(self.max_model_len, B), self.proposer)
        self.gate = Gate(self.proposer, StepCosts(self.runner.token_buckets, self.runner.seq_buckets))
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) or tuple(cfg.eos_token_ids)
        self._states: dict[str, RequestState] = {}
        self._draw_seed = seed_source()
        self._samples: dict[str, list[Request]] = {}  # n > 1 requests after their fork: the samples
        self.stats = EngineStats()
        self.on_step: Callable[[StepTiming], None] | None = None
        self._ahead: tuple | None = None  # async scheduling: the step dispatched ahead (`_dispatch_ahead`)
        self._gate_asked_at = -1  # the step whose drafts `_runs_ahead` had the cost gate choose
        self._gate_seconds = 0.0  # the cost gate's time in `_runs_ahead`, for the next step's `propose`

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raises InvalidRequestError if the request cannot run.

        Rule: a prompt needs 1 to `max_model_len - 1` tokens (room for at
        least one generated token); generation stops with "length" when the
        sequence reaches `max_model_len`, even before `max_tokens`.
        """
        sampling.validate()
        config = self.config
        if len(sampling.stop) > config.max_stop_strings:
            raise InvalidRequestError(f"{len(sampling.stop)} stop strings: at most max_stop_strings="
                                      f"{config.max_stop_strings}")
        longest = max(map(len, sampling.stop), default=0)
        if longest > config.max_stop_chars:
            raise InvalidRequestError(f"a stop string of {longest} characters: at most max_stop_chars="
                                      f"{config.max_stop_chars}")
        self.proposer.validate(sampling)
        if sampling.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={sampling.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens; the context limit is {self.max_model_len} tokens and must leave "
                "room for at least one generated token")
        check_token_ids(prompt_token_ids, self.model_config.vocab_size)

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                    request_class: str = "default") -> Request:
        """Queues a request; raises InvalidRequestError (and queues nothing) if it is invalid.

        `priority`: lower values are admitted first and preempted last.
        `cache_salt`: requests share prefix-cache entries only with the same salt.
        `request_class`: speculation adapts G to the acceptance rate per class.
        """
        if not isinstance(request_class, str):
            raise InvalidRequestError(f"request_class must be a string, got {request_class!r}")
        self.validate(prompt_token_ids, sampling)
        if not isinstance(priority, int) or isinstance(priority, bool) or not -2**31 <= priority < 2**31:
            raise InvalidRequestError(f"priority must be an integer in [-2**31, 2**31), got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a string, got {cache_salt!r}")
        kwargs = {"priority": priority, "cache_salt": cache_salt, "request_class": request_class}
        if request_id is not None:
            kwargs["request_id"] = request_id
        request = Request([int(t) for t in prompt_token_ids], sampling, self.eos_token_ids, **kwargs)
        if request.request_id in self._states or request.request_id in self._samples:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        seed = sampling.seed if sampling.seed is not None else self._draw_seed()
        self._track(request, seed, [] if sampling.logprobs is not None else None)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        """Ends a request (all its samples) now and frees its blocks; unknown ids are ignored."""
        state = self._states.get(request_id)
        for request in [state.request if state else None, *self._samples.get(request_id, ())]:
            if request is not None and not request.finished:
                self.scheduler.finish(request, FinishReason.ABORT)
                self._forget(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_requests(self) -> int:
        """Requests (and samples of n > 1 requests) the engine keeps state for: added and not yet finished."""
        return len(self._states)

    def _track(self, request: Request, seed: int, logprobs: list | None) -> None:
        self._states[request.request_id] = RequestState(
            request, Detokenizer(self.tokenizer, request.sampling.stop), seed, logprobs)

    def _forget(self, request: Request) -> None:
        """Drops the engine's bookkeeping of a finished request."""
        del self._states[request.request_id]
        self.gate.finish(request)
        self.runner.forget(request.request_id)
        if request.parent is not None:
            parent_id = request.parent.request_id
            if all(c.finished for c in self._samples[parent_id]):
                del self._samples[parent_id]

    def _fork(self, parent: Request, children: list[Request]) -> None:
        """Hands an n > 1 request's bookkeeping to its samples; sample i uses seed + i."""
        state = self._states.pop(parent.request_id)
        self._samples[parent.request_id] = children
        for c in children:
            self._track(c, (state.seed + c.index) % 2**32, [] if state.logprobs is not None else None)
        self.gate.fork(parent, children)

    # ---- the loop -------------------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        """Steps that ran a program."""
        return self.stats.num_steps

    def step(self) -> list[RequestOutput]:
        """Runs one step (schedule -> run -> update); returns an output for every request that got new tokens or
        finished."""
        if self._ahead is not None or self._runs_ahead():
            return self._step_ahead()
        timing, compiled = StepTiming(), compilation_count()
        plan = self._schedule(timing)
        outputs, num_emitted = [], None
        if plan.seqs:
            result = self._run(plan, timing)
            t = time.perf_counter()
            outputs = self._update(plan, result)
            timing.update = time.perf_counter() - t
            if result.num_emitted is not None:
                num_emitted = result.num_emitted[:len(plan.seqs)].tolist()
        self._account(plan if plan.seqs else None, timing, compiled, num_emitted)
        return outputs

    def _schedule(self, timing: StepTiming) -> StepPlan:
        """The gate picks draft lengths, the scheduler plans the step, the runner applies its block operations."""
        t0 = time.perf_counter()
        if self.gate.enabled:  # (only speculation's host time counts as `propose`)
            if self._gate_asked_at != self.num_steps:  # `_runs_ahead` asked it on these tokens already
                self.gate.begin_step(self.scheduler.decodes(), self.num_steps)
            timing.propose = time.perf_counter() - t0
        plan = self.scheduler.schedule(self._draft_len)
        t1 = time.perf_counter()
        self.runner.apply_block_ops(plan)
        for parent, children in plan.forks:
            self._fork(parent, children)
        timing.schedule, timing.block_ops = t1 - t0 - timing.propose, time.perf_counter() - t1
        return plan

    def _run(self, plan: StepPlan, timing: StepTiming) -> StepOutput:
        """The step's program (`Gate.spec_k`) and a host proposer's drafts, packed and run."""
        t0 = time.perf_counter()
        proposals, parents = None, None
        G = self.gate.spec_k(plan, self.num_steps)
        if G:
            proposals, parents = self.proposer.proposals(plan), self.proposer.tree_parents(plan)
        t1 = time.perf_counter()
        if self.gate.enabled:
            timing.propose += t1 - t0
        seeds = {s.request.request_id: self._states[s.request.request_id].seed for s in plan.seqs}
        packed = self.runner.pack(plan, seeds, G, proposals, parents)
        timing.pack = time.perf_counter() - t1
        return self.runner.run(packed, G, timing)

    def _account(self, plan: StepPlan | None, timing: StepTiming, compiled: int,
                 num_emitted: list[int] | None) -> None:
        """Books a step that ran `plan` (None: nothing ran): its timing into `stats` and `on_step`, and, unless a
        program compiled during it (`compiled`: the count before), its cost into the gate's measurements."""
        timing.propose, self._gate_seconds = timing.propose + self._gate_seconds, 0.0
        self.stats.add(timing)
        seconds, compiled = agree_on_timing(timing.total, compilation_count() != compiled)
        if compiled:
            release_if_near_limit(len(self.runner.spec_ks))
        elif plan is not None:
            self.gate.observe(plan, timing.num_tokens, timing.num_seqs, timing.spec_k, seconds, num_emitted)
        if plan is not None and self.on_step is not None:
            self.on_step(timing)

    def _step_ahead(self) -> list[RequestOutput]:
        """One step under async scheduling (vLLM's async scheduling, SGLang's overlap scheduler): the next step
        is scheduled, packed and dispatched before this one's tokens are read back, so the host's work runs while
        the device computes. The next step takes this one's sampled tokens on the device (`make_step`'s feed); a
        request that this step ends (EOS, a stop string) has a row there that is dropped, and one that its
        `max_tokens` or the context limit ends is not scheduled again. The gate learns what a plain step costs
        here, host work hidden: what its drafts must beat."""
        timing, compiled = StepTiming(), compilation_count()
        if self._ahead is None:
            self._ahead = self._dispatch_ahead(timing, None)
        current, self._ahead = self._ahead, None
        outputs = []
        if current is not None:
            if self._runs_ahead():
                self._ahead = self._dispatch_ahead(timing, current)
            plan, flight, _ = current
            result = self.runner.collect(flight, timing)
            t = time.perf_counter()
            outputs = self._collect(plan, result)
            timing.update = time.perf_counter() - t
            timing.num_tokens, timing.num_seqs = flight.num_tokens, flight.num_seqs
        self._account(current[0] if current is not None else None, timing, compiled, None)
        return outputs

    def _runs_ahead(self) -> bool:
        """Whether the next step may be dispatched before the host has this one's tokens: always without a
        proposer (with `async_scheduling`); with a host proposer (n-gram lookup) while its cost gate, asked on
        the tokens the host has, drafts for no decode, so a step that would verify drafts runs synchronously
        (a device proposer's drafts need every step's tokens). Asking the gate counts as its step."""
        if not self.config.async_scheduling:
            return False
        if not self.gate.enabled:
            return True
        if self.proposer.on_device:
            return False
        decodes = self.scheduler.decodes()
        t = time.perf_counter()
        self.gate.begin_step(decodes, self.num_steps)
        self._gate_seconds += time.perf_counter() - t
        self._gate_asked_at = self.num_steps
        return not any(self.gate.draft_len(r, self.num_steps) for r in decodes)

    def _dispatch_ahead(self, timing: StepTiming, before: tuple | None) -> tuple | None:
        """Schedules, packs and dispatches a plain step after `before` (the step in flight, or None); commits it
        ahead (`Scheduler.commit_ahead`). Returns (plan, in-flight step, {request id: sampling row}) or None."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(None)
        t1 = time.perf_counter()
        self.runner.apply_block_ops(plan)
        for parent, children in plan.forks:
            self._fork(parent, children)
        t2 = time.perf_counter()
        timing.schedule += t1 - t0
        timing.block_ops += t2 - t1
        if not plan.seqs:
            return None
        seeds = {s.request.request_id: self._states[s.request.request_id].seed for s in plan.seqs}
        packed = self.runner.pack(plan, seeds, pending=before[2] if before is not None else None)
        timing.pack += time.perf_counter() - t2
        flight = self.runner.dispatch(packed, None, timing)
        self.scheduler.commit_ahead(plan)
        return plan, flight, {s.request.request_id: i for i, s in enumerate(plan.seqs) if s.sample}

    def _collect(self, plan: StepPlan, result: StepOutput) -> list[RequestOutput]:
        """`_update` for a step committed ahead: appends each sampling row's token, drops those of requests
        that finished while it ran."""
        self.stats.num_steps += 1
        outputs = []
        for i, s in enumerate(plan.seqs):
            r = s.request
            if not self.scheduler.collect(r, s.sample) or not s.sample:
                continue
            r.num_target_steps += 1
            n = r.sampling.logprobs
            token = int(result.tokens[i, 0])
            logprobs = [_logprob_entry(result.sampled, i, 0, n)] if n is not None else None
            outputs.append(self._append(self._states[r.request_id], [token], logprobs))
        return outputs

    def _draft_len(self, request: Request) -> int:
        return self.gate.draft_len(request, self.num_steps)

    def _update(self, plan: StepPlan, result: StepOutput) -> list[RequestOutput]:
        """Commits the step to the scheduler and appends each sampling row's emitted tokens."""
        accepted = [int(result.num_emitted[i]) - 1 if s.num_draft else 0 for i, s in enumerate(plan.seqs)]
        self.scheduler.commit(plan, accepted)
        self.stats.num_steps += 1
        outputs = []
        for i, s in enumerate(plan.seqs):
            if not s.sample:
                continue
            r = s.request
            r.num_target_steps += 1
            if s.num_draft:
                r.num_draft_tokens += s.num_draft
                r.num_accepted_tokens += accepted[i]
                ranks = None if result.path_rank is None else result.path_rank[i, :accepted[i]]
                self.stats.add_verify(self.gate.verified(r, s.num_draft, accepted[i], ranks, self.num_steps),
                                      accepted[i])
            n = r.sampling.logprobs
            emitted = result.tokens[i, :result.num_emitted[i]].tolist()
            logprobs = [_logprob_entry(result.sampled, i, j, n) for j in range(len(emitted))] if n is not None else None
            outputs.append(self._append(self._states[r.request_id], emitted, logprobs))
        return outputs

    def _append(self, state: RequestState, tokens: list[int], logprobs: list[dict] | None) -> RequestOutput:
        """Appends emitted tokens one by one; the first that finishes the request ends it (the rest are dropped)."""
        request, detok = state.request, state.detokenizer
        reason = None
        for n, token in enumerate(tokens, 1):
            reason = request.append_token(token, self.max_model_len)
            if detok.update(request.output_token_ids):
                reason = FinishReason.STOP
            if reason is not None:
                tokens = tokens[:n]
                break
        if state.logprobs is not None:
            state.logprobs.extend(logprobs[:len(tokens)])
        if reason is not None:
            self.scheduler.finish(request, reason)
            self._forget(request)
        user_id = request.parent.request_id if request.parent else request.request_id
        return RequestOutput(
            user_id, request.prompt_token_ids, detok.text, list(request.output_token_ids),
            reason.value if reason else None, delta_text=detok.delta(final=reason is not None),
            delta_token_ids=tokens, logprobs=list(state.logprobs) if state.logprobs is not None else None,
            index=request.index, num_cached_tokens=request.num_cached_tokens,
            num_draft_tokens=request.num_draft_tokens, num_accepted_tokens=request.num_accepted_tokens,
            num_target_steps=request.num_target_steps)

    # ---- scoring --------------------------------------------------------------------------

    def score(self, token_ids: list[int]) -> ScoreOutput:
        """Log-probabilities of `token_ids[1:]`, each given the tokens before it (see `ScoreOutput`).

        Runs between steps (same thread as `step`) in blocks borrowed from the
        pool for the call; requests in flight are unaffected. To interleave a
        long sequence with decode steps, run its chunks yourself
        (`start_score`, `score_chunk`, `end_score`), as the gRPC worker does.
        Raises:
          InvalidRequestError: empty, longer than `max_model_len`, or ids outside [0, V).
          scheduler.block_manager.NoFreeBlocksError: too few free KV blocks right now.
        """
        job = self.start_score(token_ids)
        try:
            while not self.score_chunk(job):
                pass
            return job.output()
        finally:
            self.end_score(job)

    def check_score_input(self, token_ids: list[int]) -> list[int]:
        """A sequence to score as Python ints; raises InvalidRequestError as `score` does. Reads only fixed
        fields: any thread may call it (the server checks a whole Score call before any of it runs)."""
        n = len(token_ids)
        if n == 0:
            raise InvalidRequestError("text to score is empty")
        if n > self.max_model_len:
            raise InvalidRequestError(f"text to score has {n} tokens; the context limit is {self.max_model_len}")
        return check_token_ids(token_ids, self.model_config.vocab_size, "token ids")

    def start_score(self, token_ids: list[int]) -> ScoreJob:
        """Validates a sequence to score and takes KV blocks for it; raises as `score` does."""
        ids = self.check_score_input(token_ids)
        n = len(ids)
        return ScoreJob(ids, self.blocks.allocate(None, n - 1), np.empty(n - 1, np.float32), np.empty(n - 1, np.int32),
                        np.empty(n - 1, np.float32))

    def score_chunk(self, job: ScoreJob) -> bool:
        """Scores the job's next chunk (at most the token budget); returns True once all of it is scored."""
        return self.score_chunks([job])[0]

    def score_chunks(self, jobs: list[ScoreJob]) -> list[bool]:
        """Scores the next chunks of several jobs in one step, in order, as many tokens as the budget and
        `max_num_seqs` allow; returns for each job whether all of it is scored."""
        budget, chunks, taken = self.config.max_num_batched_tokens, [], []
        for job in jobs[:self.config.max_num_seqs]:
            m = min(budget, len(job.logprobs) - job.num_scored)
            if m > 0:
                chunks.append((job.token_ids, job.allocation, job.num_scored, m))
                taken.append(job)
                budget -= m
            if budget == 0:
                break
        if chunks:
            for job, (logprobs, top_ids, top_logprobs) in zip(taken, self.runner.score_chunks(chunks)):
                job.logprobs[job.num_scored:job.num_scored + len(logprobs)] = logprobs
                job.top_ids[job.num_scored:job.num_scored + len(logprobs)] = top_ids
                job.top_logprobs[job.num_scored:job.num_scored + len(logprobs)] = top_logprobs
                job.num_scored += len(logprobs)
        return [job.num_scored == len(job.logprobs) for job in jobs]

    def end_score(self, job: ScoreJob) -> None:
        """Returns the job's KV blocks (done or abandoned); idempotent."""
        if job.allocation is not None:
            self.blocks.free(job.allocation)
            job.allocation = None

    # ---- compilation ----------------------------------------------------------------------

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Every (token bucket, sequence bucket) shape the step can be compiled for."""
        return self.runner.buckets

    def precompile(self, buckets: list[tuple[int, int]] | None = None,
                   progress: Callable[[int, int], None] | None = None) -> int:
        """Compiles the step for `buckets` (default: every program a server can run: all step shapes, Score's
        and the block-op programs); returns the step shapes compiled. See `ModelRunner.precompile`."""
        return self.runner.precompile(buckets, progress)

    @staticmethod
    def compilation_count() -> int:
        return compilation_count()


def _logprob_entry(sampled: Sampled, row: int, slot: int, n: int) -> dict[int, float]:
    """Top `n` log-probabilities at (row, slot), most likely first, then the emitted token's if not among them."""
    entry = {int(t): float(v) for t, v in zip(sampled.top_ids[row, slot, :n], sampled.top_logprobs[row, slot, :n])}
    entry.setdefault(int(sampled.tokens[row, slot]), float(sampled.logprobs[row, slot]))
    return entry

