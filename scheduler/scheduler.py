"""Iteration-level scheduler under a token budget (host only, no jax).

Sources: Yu et al. 2022, Orca §3 (iteration-level scheduling); Agrawal et al.
2024, Sarathi-Serve §4 (chunked prefill under a token budget); Kwon et al.
2023, vLLM §4.5 (preemption by swap or recompute).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable

from scheduler.block_manager import BlockCopy, BlockManager, NoFreeBlocksError
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.util import cdiv


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 512  # token budget per step
    max_model_len: int = 8192  # prompt + output tokens per sequence
    # Preemption mode by length: a victim with at least this many computed
    # tokens is swapped to host memory (re-prefilling it would cost more than
    # the copy), a shorter one is recomputed.
    swap_threshold_tokens: int = 256
    swap_space_blocks: int = 0  # host memory for swapped KV, in blocks; 0 disables swap
    # Every layer's sliding window (`ModelConfig.max_window`): a running request's blocks that hold only
    # positions this far before its next token are given back (`BlockManager.release_before`); 0 keeps all.
    sliding_window: int = 0


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    start: int  # first token index computed this step (= num_computed_tokens before)
    num_new_tokens: int  # including `num_draft` placeholders for draft tokens
    sample: bool  # this chunk reaches the end of the request's tokens: sample the next one
    num_draft: int = 0  # draft tokens to verify after the last real token


@dataclasses.dataclass
class StepPlan:
    """One step's work, in the order the engine must apply it.

    swap_out: (request, blocks) to copy to host memory first (the blocks are
      already free and may be rewritten by this step);
    swap_in: (request, blocks) to fill from the request's host copy;
    copies: copy-on-write block copies;
    then the step computes `seqs`.
    forks: (parent, children) of n > 1 requests split this step;
    preempted: requests sent back to waiting (recompute) or swapped.
    """

    seqs: list[ScheduledSeq]
    preempted: list[Request] = dataclasses.field(default_factory=list)
    forks: list[tuple[Request, list[Request]]] = dataclasses.field(default_factory=list)
    copies: list[BlockCopy] = dataclasses.field(default_factory=list)
    swap_out: list[tuple[Request, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[Request, tuple[int, ...]]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class Scheduler:
    """Decides which tokens of which requests run in the next step."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: list[Request] = []  # ordered by (priority, arrival)
        self.swapped: list[Request] = []  # ordered by (priority, arrival)
        self.running: list[Request] = []
        self.swap_used_blocks = 0
        # Prefix-cache hit rate, in prompt tokens over every admission.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_swapped = 0  # preemptions by swap
        self.num_recomputed = 0  # preemptions by recompute
        self._copies: dict[int, list[BlockCopy]] = {}  # id(request) -> this step's copies

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=_order)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def decodes(self) -> list[Request]:
        """The running requests whose next step is a decode that may draft (the ones `schedule` asks
        `draft_len` of, budget permitting)."""
        return [r for r in self.running if _may_draft(r)]

    def schedule(self, draft_len: Callable[[Request], int] | None = None) -> StepPlan:
        """Packs one step.

        `draft_len(request)`: the draft tokens a decode wants this step (None:
        no speculation); asked only of requests that decode this step.

        Invariant: there are no prefill or decode phases; every scheduled
        request computes some of its missing tokens
        (`num_schedulable_tokens - num_computed_tokens`), plus, for a decode
        that wants k > 0 draft tokens, up to k counted in the budget;
        a request's scheduled tokens always have blocks. Order: running decodes, then
        running (chunked) prefills, each by priority then arrival and each
        taking what is left of the token budget; when one cannot get a block,
        the lowest-priority, latest-arrived running request is preempted. Then
        swapped requests come back, then waiting ones are admitted (prefix
        cache first), both by priority then arrival, while budget, sequence
        slots and free blocks above the watermark last.
        """
        self._copies = {}
        plan = StepPlan([])
        budget = self.config.max_num_batched_tokens
        for request in [r for r in self.running if r.is_parent and _missing(r) == 0]:
            self._fork(request, plan)
        for request in sorted(self.running, key=lambda r: (_missing(r) > 1, _order(r))):
            if budget == 0:
                break
            if request.status is RequestStatus.RUNNING and not self._ends_when_collected(request):
                n = min(_missing(request), budget)
                k = self._draft_len(request, budget, draft_len) if draft_len and _may_draft(request) else 0
                budget -= self._schedule_running(request, n + k, plan, k)
        while self.swapped and budget > 0 and self._num_slots() < self.config.max_num_seqs:
            n = self._swap_in(self.swapped[0], budget, plan)
            if n == 0:
                break
            budget -= n
        while self.waiting and budget > 0:
            n = self._admit(self.waiting[0], budget, plan)
            if n == 0:
                break
            budget -= n
        plan.copies = [c for copies in self._copies.values() for c in copies]
        return plan

    # ---- running requests ---------------------------------------------------------------

    def _draft_len(self, request: Request, budget: int, wanted: Callable[[Request], int]) -> int:
        """Draft tokens for a decode: what it wants, bounded by the budget, `max_tokens` and the context limit.

        A verify step emits at most num_draft + 1 tokens, so num_draft stays
        below both what `max_tokens` and `max_model_len` leave.
        """
        left = min(request.sampling.max_tokens - len(request.output_token_ids),
                   self.config.max_model_len - request.num_tokens)
        return max(0, min(wanted(request), budget - 1, left - 1))

    def _schedule_running(self, request: Request, n: int, plan: StepPlan, num_draft: int = 0) -> int:
        """Schedules `n` tokens of a running request, preempting others for blocks; returns tokens used."""
        if self.config.sliding_window:  # its tokens from num_computed_tokens on see no earlier positions
            self.blocks.release_before(request.allocation,
                                       request.num_computed_tokens - self.config.sliding_window + 1)
        while True:
            try:
                copy = self.blocks.copy_on_write(request.allocation, request.num_computed_tokens)
                if copy is not None:
                    self._copies.setdefault(id(request), []).append(copy)
                request.allocation = self.blocks.allocate(request.allocation, request.num_computed_tokens + n)
                break
            except NoFreeBlocksError:
                victim = max(self.running, key=_order)
                self._preempt(victim, plan)
                if victim is request:
                    return 0
        plan.seqs.append(_plan(request, n, num_draft))
        return n

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Frees a running request's blocks: swap (long sequences, if host space allows) or recompute."""
        plan.seqs[:] = [s for s in plan.seqs if s.request is not request]  # undo its scheduling this step
        # A block copied-on-write this step holds no data yet, so such a request is recomputed.
        copying = self._copies.pop(id(request), None)
        self.running.remove(request)
        request.num_preemptions += 1
        plan.preempted.append(request)
        n_blocks = cdiv(request.num_computed_tokens, self.blocks.block_size)
        if (not copying and request.num_computed_tokens >= self.config.swap_threshold_tokens
                and self.swap_used_blocks + n_blocks <= self.config.swap_space_blocks):
            plan.swap_out.append((request, request.allocation.block_ids[:n_blocks]))
            self.swap_used_blocks += n_blocks
            self.num_swapped += 1
            self.blocks.free(request.allocation)
            request.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, request, key=_order)
        else:
            self.blocks.free(request.allocation)
            request.num_computed_tokens = 0
            self.num_recomputed += 1
            self.add(request)  # keeps its priority and arrival, so it goes back near the front

    def _fork(self, parent: Request, plan: StepPlan) -> list[Request]:
        """Splits an n > 1 request whose prompt (but the last token) is computed into its samples."""
        children = [
            Request(parent.prompt_token_ids, parent.sampling, parent.eos_token_ids,
                    request_id=f"{parent.request_id}/{i}", priority=parent.priority, arrival=parent.arrival,
                    num_computed_tokens=parent.num_computed_tokens, status=RequestStatus.RUNNING,
                    allocation=self.blocks.fork(parent.allocation), cache_salt=parent.cache_salt,
                    num_cached_tokens=parent.num_cached_tokens, parent=parent, index=i,
                    request_class=parent.request_class)
            for i in range(parent.sampling.n)]
        self.blocks.free(parent.allocation)
        self.running.remove(parent)
        self.running.extend(children)
        parent.status = RequestStatus.FINISHED  # lives on as its children
        plan.forks.append((parent, children))
        return children

    # ---- swapped and waiting requests ---------------------------------------------------

    def _num_slots(self) -> int:
        """Sequence slots held by running requests (a parent holds one per sample)."""
        return sum(_width(r) for r in self.running)

    def _room(self, need: int) -> bool:
        """Admitting something that needs `need` more blocks keeps free blocks above the watermark.

        With nothing running the watermark is waived, so a lone request always runs.
        """
        reserve = self.blocks.watermark_blocks if self.running else 0
        return need <= self.blocks.num_free_blocks - reserve

    def _swap_in(self, request: Request, budget: int, plan: StepPlan) -> int:
        if request.num_pending_tokens:  # preempted with a token in flight: back once it is on the host
            return 0
        n = min(_missing(request), budget)
        if not self._room(self.blocks.blocks_needed(None, request.num_computed_tokens + n)):
            return 0
        request.allocation = self.blocks.allocate(None, request.num_computed_tokens + n, request.cache_salt)
        n_blocks = cdiv(request.num_computed_tokens, self.blocks.block_size)
        plan.swap_in.append((request, request.allocation.block_ids[:n_blocks]))
        self.swap_used_blocks -= n_blocks
        self.swapped.pop(0)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.seqs.append(_plan(request, n))
        return n

    def _admit(self, request: Request, budget: int, plan: StepPlan) -> int:
        """Admits the first waiting request (prefix cache first); returns tokens scheduled (0: stop admitting)."""
        if self._num_slots() + _width(request) > self.config.max_num_seqs or request.num_pending_tokens:
            return 0
        tokens = request.token_ids(0, request.num_tokens)
        allocation, cached = self.blocks.match_prefix(tokens, request.num_tokens - 1, request.cache_salt)
        n = min(request.num_schedulable_tokens - cached, budget)
        if not self._room(self.blocks.blocks_needed(allocation, cached + n)):
            self.blocks.free(allocation)
            return 0
        request.allocation = self.blocks.allocate(allocation, cached + n)
        request.num_computed_tokens = cached
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += cached
        if request.num_preemptions == 0:
            request.num_cached_tokens = cached
        self.waiting.pop(0)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if n > 0:
            plan.seqs.append(_plan(request, n))
            return n
        # A parent whose whole prompt but the last token was cached: its samples start now.
        used = 0
        for child in self._fork(request, plan):
            if used < budget and child.status is RequestStatus.RUNNING:
                used += self._schedule_running(child, 1, plan)
        return used

    # ---- after the step -----------------------------------------------------------------

    def commit(self, plan: StepPlan, num_accepted: list[int] | None = None) -> None:
        """Marks the plan's tokens as computed and caches full blocks (call after the step ran).

        `num_accepted[i]`: draft tokens of `plan.seqs[i]` the verify accepted
        (their KV stays); the rejected ones are forgotten and the blocks that
        only they used go back to the pool. Call before appending the
        emitted tokens.
        """
        for i, s in enumerate(plan.seqs):
            r = s.request
            accepted = num_accepted[i] if num_accepted is not None else 0
            r.num_computed_tokens = s.start + s.num_new_tokens - s.num_draft + accepted
            if s.num_draft:
                self.blocks.truncate(r.allocation, r.num_computed_tokens)
            self.blocks.cache_blocks(r.allocation, r.token_ids, r.num_computed_tokens)

    def commit_ahead(self, plan: StepPlan) -> None:
        """Marks a plain step's tokens as computed when it is dispatched, before its tokens reach the host (async
        scheduling): each sampling row's request counts its next token as pending (`Request.num_pending_tokens`)
        until `collect` appends it. Full blocks are cached by `collect`, which knows their tokens."""
        for s in plan.seqs:
            if s.num_draft:
                raise ValueError("commit_ahead: a step with draft tokens commits after its verify")
            s.request.num_computed_tokens = s.start + s.num_new_tokens
            s.request.num_pending_tokens += s.sample

    def collect(self, request: Request, sampled: bool) -> bool:
        """A committed-ahead step's outputs reached the host: caches the request's full blocks whose tokens are
        known, and for a `sampled` row takes its pending token (call before appending it). Returns False where
        the request finished while the step ran (its token is dropped)."""
        if request.finished:
            return False
        request.num_pending_tokens -= sampled
        if request.status is RequestStatus.RUNNING:
            known = min(request.num_computed_tokens, request.num_known_tokens)
            self.blocks.cache_blocks(request.allocation, request.token_ids, known)
        return True

    def _ends_when_collected(self, request: Request) -> bool:
        """A pending token takes the request to `max_tokens` or the context limit: nothing more to schedule."""
        return bool(request.num_pending_tokens) and (
            len(request.output_token_ids) + request.num_pending_tokens >= request.sampling.max_tokens
            or request.num_tokens >= self.config.max_model_len)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request (any state) and frees its blocks and host swap space."""
        if request.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.swap_used_blocks -= cdiv(request.num_computed_tokens, self.blocks.block_size)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        if request.allocation is not None:
            self.blocks.free(request.allocation)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason


def _order(request: Request) -> tuple[int, int, int]:
    return (request.priority, request.arrival, request.index)


def _width(request: Request) -> int:
    return request.sampling.n if request.is_parent else 1


def _missing(request: Request) -> int:
    return request.num_schedulable_tokens - request.num_computed_tokens


def _may_draft(request: Request) -> bool:
    """A running request whose next step is a decode. Only decodes draft: the first token always comes from a
    plain sampling step, so which positions are drafted never depends on how the prompt was chunked (seeded
    outputs stay batch-independent)."""
    return (request.status is RequestStatus.RUNNING and _missing(request) == 1 and not request.is_parent
            and bool(request.output_token_ids))


def _plan(request: Request, n: int, num_draft: int = 0) -> ScheduledSeq:
    start = request.num_computed_tokens
    return ScheduledSeq(request, start, n, not request.is_parent and start + n - num_draft == request.num_tokens,
                        num_draft)
