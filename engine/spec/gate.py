"""The gate: how many draft tokens each decode gets this step. A proposer says where they come from.

Each step, before scheduling, `begin_step` asks the adaptive policy for each
decode's G (`engine.spec.acceptance.AdaptiveSpeculation`), the proposer how
many tokens it offers under that G (`Proposer.proposal_len`), and then runs
the cost gate: from the measured seconds of every step shape (`StepCosts`)
and each request class's acceptance (a per-token rate for chains; for token
trees whose verifies report where the accepted nodes ranked, the mean
accepted tokens of every tree cut, `CutAcceptance`), it picks the draft
lengths that give the most expected tokens per second for this batch, which
is no drafting where speculation does not pay (a large batch, a class that
rarely accepts). Once it has held a request class at no drafts for
`HOLD_STEPS` steps in a row, the class's requests stop keeping their draft
state (`Proposer.release`), so a device proposer's steps then cost what the
target's alone do. Each step a class is held, its acceptance estimate relaxes
toward the optimistic prior (`_Acceptance.relax`), so a held class is tried
again on the requests that arrive later. What the gate's choices really cost
is kept too (`DraftRegret`, fed by `observe` after every decode step): a
class whose drafting has lost more than its small budget against the
measured plain step drafts no more until the budget grows back, whatever the
estimates say.

Source: Leviathan et al. 2023 (§2.3, §3.1) for the per-token acceptance rate
alpha and the expected tokens of a window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.spec.acceptance import AdaptiveSpeculation, CutAcceptance, _Acceptance, expected_accepted
from engine.spec.config import SpeculationConfig
from engine.spec.costs import DraftRegret, StepCosts, attention_pairs
from scheduler.request import Request
from scheduler.scheduler import StepPlan

if TYPE_CHECKING:
    from engine.spec.proposer import Proposer

# When the cost gate gives a request class no drafts this many steps in a row, its requests stop keeping their
# draft state (`Proposer.release`) until a step drafts for the class again; a request arriving then is held
# once, and released, unless the gate drafts for it.
HOLD_STEPS = 16


def gate_caps(config: SpeculationConfig, on_device: bool) -> tuple[int, ...]:
    """The draft-length caps the cost gate tries: for chains, every length up to G on the host (its one
    verify program serves them all, and G = 3 fills a 4-token window where G = 4 pads to 8), the ladder
    G, G/2, ..., 1 on the device (a program per length); for token trees, cuts that fill a power-of-two
    verify window (1, 3, 7, 15 nodes + the root) and the whole tree, so a CPU, where a wide window costs
    more, verifies small trees and a GPU large ones."""
    n = config.tree_nodes
    if not n:
        return config.ladder if on_device else tuple(range(1, config.num_speculative_tokens + 1))
    return tuple(sorted({c for c in (1, 3, 7, 15) if c < n} | {n}))


class Gate:
    """How many draft tokens each decode gets: the adaptive G, the cost gate and its regret account.

    The engine calls `begin_step` with the requests that may decode, then the
    scheduler asks `draft_len` of each. `wanted` is what the adaptive policy
    and the proposer allow a request; the cost gate then picks, among
    draft-length caps (`gate_caps`) and the top m requests by their class's
    acceptance rate, the choice with the most expected tokens per second
    (`expected_tokens`) of this step's shape (`StepCosts`, measured as the
    engine runs and priced at this step's contexts: each draft token attends
    its row's whole context; an unmeasured shape is priced as the plain step
    plus the cost difference of the cheapest measured steps of the two token
    buckets, such as prefill chunks, or else as a plain step, so it is tried).
    Seeded sampled requests skip the gate (their draft lengths, and so their
    outputs, never depend on their batch mates), unless the proposer's verify
    makes the output independent of the draft lengths anyway
    (`output_independent`: n-gram, token trees); greedy requests never skip it
    (their output is the target's argmax whatever is drafted).
    `min_acceptance = 0` turns adaptation off: every decode drafts what
    `wanted` allows.

    Args:
      proposer: where the drafts come from (`engine.spec.proposer.NoProposer`: the gate drafts nothing).
      costs: the measured step costs (None: no cost gate, the adaptive G alone).
    """

    def __init__(self, proposer: Proposer, costs: StepCosts | None = None):
        self.proposer = proposer
        self.config = proposer.config
        self.enabled = bool(proposer.program_ks)
        self.costs = costs
        self.policy = AdaptiveSpeculation(self.config)
        self._acceptance: dict = {}  # acceptance_key -> _Acceptance, alpha's estimate
        self._cuts: dict = {}  # acceptance_key -> CutAcceptance, for proposers whose verifies report path ranks
        self._drafts: dict[str, int] = {}  # request id -> this step's draft length (from begin_step)
        self._held: dict[str, int] = {}  # request class -> steps in a row the gate gave it no drafts
        self.regret = DraftRegret()  # what drafting really cost per class; the gate drafts within its credit

    @property
    def gate_caps(self) -> tuple[int, ...]:
        return gate_caps(self.config, self.proposer.on_device)

    def policy_k(self, request: Request, step: int) -> int:
        """The adaptive policy's G for `request` at engine step `step`, capped by its `num_speculative_tokens`.
        A proposer without `adaptive_k` gets the cap alone: which proposals run is the cost gate's call, per
        class and match, with no switching off per request or class (a lookup keeps no draft state and costs
        nothing when the gate declines it)."""
        if not self.proposer.adaptive_k:
            cap, k = request.sampling.num_speculative_tokens, self.config.num_speculative_tokens
            return k if cap is None else min(cap, k)
        return self.policy.k_for(request.request_id, request.request_class, request.sampling.num_speculative_tokens,
                                 step, seeded=self._draft_dependent(request))

    def wanted(self, request: Request, step: int) -> int:
        """The draft length the policy and the proposer allow `request` at engine step `step`, before the gate."""
        if not self.enabled or not self.proposer.can_draft(request):
            return 0
        return self.proposer.proposal_len(request, self.policy_k(request, step))

    def draft_len(self, request: Request, step: int) -> int:
        """The draft length `request` gets at engine step `step` (the gate's choice from `begin_step`)."""
        if not self.enabled:
            return 0
        d = self._drafts.get(request.request_id)
        return self.wanted(request, step) if d is None else d

    def spec_k(self, plan: StepPlan, step: int) -> int | None:
        """The step's program: the smallest of the proposer's `program_ks` >= every draft length, or, with no
        drafts, the proposer's `idle_k` (None: the target alone)."""
        drafted = max(s.num_draft for s in plan.seqs)
        if drafted:
            return min(k for k in self.proposer.program_ks if k >= drafted)
        if not self.enabled:
            return None
        return self.proposer.idle_k(plan, lambda r: bool(self.wanted(r, step)))

    def verified(self, request: Request, num_draft: int, num_accepted: int, ranks, step: int) -> int:
        """`request`'s `num_draft` draft tokens were verified at engine step `step` and `num_accepted` of them
        accepted (`ranks`: where the accepted nodes of a token tree ranked, `StepOutput.path_rank`; None for
        chains): records the outcome (`record`, `record_tree`). Returns the path positions verified
        (`Proposer.depth`)."""
        depth = self.proposer.depth(request, num_draft)
        self.record(request, depth, num_accepted, step)
        if ranks is not None:
            self.record_tree(request, num_draft, ranks)
        return depth

    def record(self, request: Request, num_draft: int, num_accepted: int, step: int) -> None:
        """One verify step's outcome for `request` (adapts G for it and its class, and the class's alpha);
        `num_draft` counts path positions (`Proposer.depth`)."""
        self.policy.update(request.request_id, request.request_class, num_draft, num_accepted, step)
        if num_draft:
            self._acceptance.setdefault(self.proposer.acceptance_key(request), _Acceptance()).add(
                num_accepted, min(num_draft, num_accepted + 1))

    def record_tree(self, request: Request, num_nodes: int, ranks) -> None:
        """One verify of a `num_nodes`-node token tree for `request` whose accepted nodes had ranks `ranks`
        (`StepOutput.path_rank`): updates the class's expected accepted tokens per tree cut (`CutAcceptance`)."""
        key = self.proposer.acceptance_key(request)
        if key not in self._cuts:
            depths = [0] + [self.proposer.depth(request, n) for n in range(1, max(self.proposer.program_ks) + 1)]
            self._cuts[key] = CutAcceptance(depths)
        self._cuts[key].add(num_nodes, ranks)

    def observe(self, plan: StepPlan, num_tokens: int, num_seqs: int, spec_k: int | None, seconds: float,
                num_emitted: list[int] | None) -> None:
        """A step of `plan` in bucket (`num_tokens`, `num_seqs`) ran program `spec_k` in `seconds` (no program
        compiled): its cost joins `costs`; a step of decodes only (`num_emitted` tokens per row, None: one
        each) charges each class's drafting its regret (`observe_step`)."""
        if not self.enabled or self.costs is None or not plan.seqs:
            return
        work = sum(attention_pairs(s.start, s.num_new_tokens) for s in plan.seqs)
        self.costs.observe(num_tokens, num_seqs, spec_k, seconds, work)
        if all(s.sample and s.num_new_tokens == 1 + s.num_draft for s in plan.seqs):
            self.observe_step(plan.seqs, num_emitted or [1] * len(plan.seqs), seconds)

    def fork(self, parent: Request, children: list[Request]) -> None:
        """The samples of an n > 1 request start from its state."""
        self.forget(parent.request_id)
        self.proposer.fork(parent, children)

    def finish(self, request: Request) -> None:
        """`request` finished or was aborted: the gate's state for it and the proposer's are dropped."""
        self.forget(request.request_id)
        self.proposer.finish(request)

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)
        self._drafts.pop(request_id, None)

    def alpha(self, request: Request) -> float:
        """The estimated per-token acceptance rate of `request`'s next proposal (1 before any verify)."""
        return self._acceptance.setdefault(self.proposer.acceptance_key(request), _Acceptance()).alpha


    def expected_tokens(self, request: Request, k: int) -> float:
        """Expected accepted draft tokens of `request`'s next proposal cut to `k` tokens: the class's measured
        mean for a tree cut to its k best nodes once its verifies have reported path ranks (`record_tree`),
        else `expected_accepted(alpha, depth)`."""
        cuts = self._cuts.get(self.proposer.acceptance_key(request))
        if cuts is not None:
            return cuts.expected(k)
        return expected_accepted(self.alpha(request), self.proposer.depth(request, k))


    def begin_step(self, decodes: list[Request], step: int) -> None:
        """Chooses this step's draft length for each of `decodes` (the requests that may decode)."""
        if not self.enabled:
            return
        num_decodes, base = len(decodes), (0 if self.proposer.on_device else None)
        gated = self.costs is not None and num_decodes and self.config.min_acceptance > 0
        shape = self.costs.shape(num_decodes, num_decodes) if gated else None
        # A class whose drafting has spent its credit at this batch size drafts nothing, and is not looked up.
        broke = [r for r in decodes if shape and not self._draft_dependent(r)
                 and not self.regret.allows(r.request_class, shape[1])]
        skip = {r.request_id for r in broke}
        self._drafts = {r.request_id: 0 if r.request_id in skip else self.wanted(r, step) for r in decodes}
        if not gated:
            return
        plain_work = sum(attention_pairs(r.num_computed_tokens, 1) for r in decodes)
        plain = self.costs.get(*shape, base, plain_work) if shape else None
        if plain is None:  # measure this batch size's plain step first
            for r in decodes:
                if not self._draft_dependent(r):
                    self._drafts[r.request_id] = 0
            return
        plain_at = (plain, plain_work)
        fixed, fixed_k, gain, work, rows = 0, 0, 0.0, plain_work, []
        for r in decodes:
            k = self._drafts[r.request_id]
            if not k:
                continue
            if self._draft_dependent(r):
                fixed, fixed_k, gain = fixed + k, max(fixed_k, k), gain + self.expected_tokens(r, k)
                work += self._extra_pairs(r, k)
            else:
                rows.append((self.alpha(r), k, r))
        rows.sort(key=lambda row: -row[0])
        idle = self._cost(num_decodes, fixed, fixed_k, work, plain_at, base)
        if base is not None and not fixed:
            # Drafting nothing for long releases the requests' draft state (`HOLD_STEPS`), after which a step
            # runs the target alone, without the draft's upkeep pass: that is what drafting must beat.
            bare = self.costs.get(*shape, None, plain_work)
            idle = idle if bare is None else bare
        best, choice = (num_decodes + gain) / idle, (0, 0)
        fixed_work = work
        for cap in self.gate_caps:
            drafted, tokens, top, work = fixed, num_decodes + gain, fixed_k, fixed_work
            for m, (a, k, r) in enumerate(rows, 1):
                k = min(k, cap)
                drafted, tokens, top = drafted + k, tokens + self.expected_tokens(r, k), max(top, k)
                work += self._extra_pairs(r, k)
                rate = tokens / self._cost(num_decodes, drafted, top, work, plain_at, base)
                if rate > best:
                    best, choice = rate, (cap, m)
        cap, m = choice
        drafted: dict[str, int] = {}
        for i, (_, k, r) in enumerate(rows):
            self._drafts[r.request_id] = d = min(k, cap) if i < m else 0
            drafted[r.request_class] = drafted.get(r.request_class, 0) + d
        for c, d in drafted.items():
            self._held[c] = 0 if d else self._held.get(c, 0) + 1
        # Without verifies a held class's alpha would never change, so a class held once would be held forever.
        for r in broke:
            self._held[r.request_class] = self._held.get(r.request_class, 0) + 1
        held = ({self.proposer.acceptance_key(r) for _, _, r in rows} | {self.proposer.acceptance_key(r) for r in broke}) - {
            self.proposer.acceptance_key(r) for _, _, r in rows[:m] if cap}
        for key in held:
            self._acceptance.setdefault(key, _Acceptance()).relax()
            if key in self._cuts:
                self._cuts[key].relax()
        for r in [r for _, _, r in rows] + broke:
            if self._held[r.request_class] >= HOLD_STEPS:
                self.proposer.release(r)


    def observe_step(self, seqs, emitted: list[int], seconds: float) -> None:
        """A step of decode rows only (`ScheduledSeq`s, each sampling) emitted `emitted` tokens per row in
        `seconds`: charges each class's drafting its regret against this batch's measured plain step
        (`DraftRegret`). Nothing is charged before the plain step is measured."""
        if self.costs is None or not seqs:
            return
        num_decodes = len(seqs)
        shape = self.costs.shape(num_decodes, num_decodes)
        if shape is None:
            return
        work = sum(attention_pairs(s.start, 1) for s in seqs)
        plain = self.costs.get(*shape, None, work) or (self.costs.get(*shape, 0, work) if self.proposer.on_device else None)
        if not plain:
            return
        classes: dict[str, list] = {}
        for s, n in zip(seqs, emitted):
            c = classes.setdefault(s.request.request_class, [0, 0, False])
            c[0], c[1], c[2] = c[0] + 1, c[1] + n, c[2] or bool(s.num_draft)
        for name, (rows, tokens, drafted) in classes.items():
            self.regret.observe(name, shape[1], drafted, rows, num_decodes, tokens, seconds, plain)


    @staticmethod
    def _extra_pairs(request: Request, k: int) -> int:
        """The attention pairs `k` draft tokens add to a decode row."""
        start = request.num_computed_tokens
        return attention_pairs(start, 1 + k) - attention_pairs(start, 1)


    def _draft_dependent(self, request: Request) -> bool:
        """Whether `request`'s output depends on its draft lengths: seeded sampling, unless the proposer's
        verify makes it independent (greedy output is the target's argmax whatever is drafted). Such a request
        skips the gate and keeps the policy's draft length, so its output never depends on its batch mates."""
        s = request.sampling
        return s.seed is not None and s.temperature > 0 and not self.proposer.output_independent


    def _cost(self, num_decodes: int, drafted: int, top: int, work: int, plain_at: tuple[float, int],
              base: int | None) -> float:
        """Seconds of a step of `num_decodes` decodes verifying `drafted` draft tokens, at most `top` per row, attending
        `work` pairs; `plain_at`: the batch's plain step (seconds, pairs)."""
        plain, plain_work = plain_at
        if drafted == 0:
            return plain
        shape = self.costs.shape(num_decodes, num_decodes + drafted)
        if shape is None:
            return float("inf")
        G = min(k for k in self.proposer.program_ks if k >= top)
        plain_T = self.costs.shape(num_decodes, num_decodes)[0]
        seconds = self.costs.estimate(*shape, G, work, plain_T, plain, plain_work)
        return plain if seconds is None else max(seconds, plain)


