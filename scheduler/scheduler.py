"""Iteration-level scheduler under a token budget (host only, no jax).

Sources: Yu et al. 2022, Orca §3 (iteration-level scheduling); Agrawal et al.
2024, Sarathi-Serve §4 (chunked prefill under a token budget).
"""

from __future__ import annotations

import bisect
import dataclasses

from scheduler.block_manager import BlockManager, NoFreeBlocksError
from scheduler.request import FinishReason, Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 512  # token budget per step
    max_model_len: int = 8192  # prompt + output tokens per sequence


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    start: int  # first token index computed this step (= num_computed_tokens before)
    num_new_tokens: int
    sample: bool  # this chunk reaches the end of the request's tokens: sample the next one


@dataclasses.dataclass(frozen=True)
class StepPlan:
    seqs: list[ScheduledSeq]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


class Scheduler:
    """Decides which tokens of which requests run in the next step."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: list[Request] = []  # ordered by (priority, arrival)
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=_order)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """Packs one step.

        Invariant: there are no prefill or decode phases; every scheduled
        request computes some of its `num_tokens - num_computed_tokens`
        missing tokens. Running requests go first (by priority, then arrival),
        each taking what is left of the token budget; when a running request
        cannot get a block, the lowest-priority, latest-arrived running request
        is preempted (recompute). Waiting requests are admitted by priority
        tier, then arrival, while budget, sequence slots and blocks last.
        """
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []
        # Priority order: a preemption victim (the max of this order) is then
        # never a request already scheduled in this step.
        for request in sorted(self.running, key=_order):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, n, preempted):
                continue
            seqs.append(self._plan(request, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            try:
                request.allocation = self.blocks.allocate(request.allocation, request.num_computed_tokens + n)
            except NoFreeBlocksError:
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seqs.append(self._plan(request, n))
            budget -= n
        return StepPlan(seqs, preempted)

    def _plan(self, request: Request, n: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        return ScheduledSeq(request, start, n, start + n == request.num_tokens)

    def _reserve(self, request: Request, n: int, preempted: list[Request]) -> bool:
        """Makes room for `n` more tokens of `request`, preempting newer requests if needed."""
        while True:
            try:
                request.allocation = self.blocks.allocate(request.allocation, request.num_computed_tokens + n)
                return True
            except NoFreeBlocksError:
                victim = max(self.running, key=_order)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    return False

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.allocation)
        request.num_computed_tokens = 0
        self.add(request)  # keeps its priority and arrival, so it goes back near the front

    def commit(self, plan: StepPlan) -> None:
        """Marks the plan's tokens as computed (call after the step ran)."""
        for s in plan.seqs:
            s.request.num_computed_tokens = s.start + s.num_new_tokens

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request (any state) and frees its blocks."""
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.allocation is not None:
            self.blocks.free(request.allocation)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason


def _order(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival)
