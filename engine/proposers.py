"""Proposers: where draft tokens come from, and the adaptive policy choosing how many (K).

A `Proposer` is the one optional object the engine loop talks to about
speculation: how many draft tokens a request wants at its next decode step
(`draft_len`, passed to `Scheduler.schedule`), which step program a planned
step needs (`step_k`), the draft tokens of a host proposer (`proposals`), and
what each verify step accepted (`record`). Every proposer hands the verify
step (`engine.verify.verify`) its tokens and the distribution `p` they were
drawn from, so the output follows the target's distribution exactly:

- `DraftModelProposer`: a standalone draft model, run on the device inside
  the step program (`engine.speculative.make_spec_step`); its KV pool sits
  beside the target's in the runner, indexed by the same block tables.
- `EagleProposer`: an EAGLE head on the target's features (Li et al. 2024),
  on the device (`engine.speculative.make_eagle_step`; EAGLE-2 dynamic token
  trees: `make_eagle_tree_step`); its KV pool and the target's features per
  KV slot sit beside the target's pool.
- `engine.medusa_proposer.MedusaProposer`: Medusa heads on the target's last
  hidden state (Cai et al. 2024) fill a static token tree inside the step
  program (`engine.speculative.make_medusa_step`), verified by the coupled tree verify.
- `engine.prompt_lookup.NgramProposer`: prompt lookup on the host (no
  model); its `p` is one-hot, so a draft token is accepted with probability
  q(x) (`engine.speculative.make_verify_step`).

Each step, before scheduling, `begin_step` runs the cost gate: from the
measured seconds of every step shape (`StepCosts`) and each request class's
acceptance (a per-token rate for chains; for token trees whose verifies
report where the accepted nodes ranked, the mean accepted tokens of every
tree cut, `engine.adaptive.CutAcceptance`), it picks the draft lengths that
give the most expected tokens per second for this batch, which is no drafting where speculation
does not pay (a large batch, a class that rarely accepts); once it has held a
request class at no drafts for `HOLD_STEPS` steps in a row, the class's
requests stop keeping their draft state, so a device proposer's steps then
cost what the target's alone do. Each step a class is held, its acceptance
estimate relaxes toward the optimistic prior (`_Acceptance.relax`), so a
held class is tried again on the requests that arrive later. What the gate's
choices really cost is kept too (`engine.adaptive.DraftRegret`, fed by
`observe_step` after every decode step): a class whose drafting has lost more
than its small budget against the measured plain step drafts no more until
the budget grows back, whatever the estimates say.

Source: Leviathan et al. 2023 (§2.3, §3.1) for speculative sampling and the
per-token acceptance rate alpha.
"""

from __future__ import annotations


from engine.adaptive import (AdaptiveSpeculation, CutAcceptance, DraftRegret, SpeculationConfig, StepCosts,
                             _Acceptance, attention_pairs, expected_accepted)
from engine.speculative import (FeaturePool, eagle_tree_shape, make_eagle_step, make_eagle_tree_step, make_spec_step)
from engine.step import KVPool, build_model, kv_bytes_per_block
from model.eagle import FC
from scheduler.ngram import Contexts
from scheduler.request import InvalidRequestError, Request
from scheduler.scheduler import StepPlan


# When the cost gate gives a request class no drafts this many steps in a row, its requests stop keeping their
# draft state (`release`) until a step drafts for the class again; a request arriving then is held once, and
# released, unless the gate drafts for it.
HOLD_STEPS = 16


class Proposer:
    """What the engine loop needs from any proposer; the adaptive policy and the cost gate are shared.

    `kind` names it (ModelInfo, metrics); `on_device` says whether it runs inside
    the step program (then `model_config` is the draft model's, whose KV pool
    the runner keeps) or on the host (then `proposals` gives its tokens).

    The engine calls `begin_step` with the requests that may decode, then the
    scheduler asks `draft_len` of each. `wanted` is what the adaptive policy
    (and, for n-gram, the lookup) allows a request; the cost gate then picks,
    among draft-length caps on the ladder and the top m requests by their
    class's acceptance rate, the choice with the most expected tokens per
    second (`expected_tokens`) of this step's shape (`StepCosts`, measured as the engine runs and
    priced at this step's contexts: each draft token attends its row's whole
    context; an unmeasured shape is priced as the plain step plus the cost difference
    of the cheapest measured steps of the two token buckets, such as prefill
    chunks, or else as a plain step, so it is tried).
    Seeded sampled requests skip the gate (their draft lengths, and so their
    outputs, never depend on their batch mates), unless the proposer's verify
    makes the output independent of the draft lengths anyway
    (`output_independent`: n-gram, token trees); greedy requests never skip it
    (their output is the target's argmax whatever is drafted).
    `min_acceptance = 0` turns adaptation off: every decode drafts what
    `wanted` allows.
    """

    kind = ""
    on_device = False
    # True when a seeded request's output does not depend on its draft lengths, so the gate may
    # choose them for seeded requests too.
    output_independent = False
    model_config = None
    packed_bytes = 0

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self.policy = AdaptiveSpeculation(config)
        self.costs: StepCosts | None = None  # set by the engine; None: no gate
        self._acceptance: dict = {}  # acceptance_key -> _Acceptance, alpha's estimate
        self._cuts: dict = {}  # acceptance_key -> CutAcceptance, for proposers whose verifies report path ranks
        self._drafts: dict[str, int] = {}  # request id -> this step's draft length (from begin_step)
        self._held: dict[str, int] = {}  # request class -> steps in a row the gate gave it no drafts
        self.regret = DraftRegret()  # what drafting really cost per class; the gate drafts within its credit

    def validate(self, sampling) -> None:
        """Raises InvalidRequestError if a request (`SamplingParams`) asks for more draft tokens or tree nodes
        than the engine compiles, or for tree nodes from an engine without token trees."""
        k, nodes = sampling.num_speculative_tokens, sampling.num_tree_nodes
        if k is not None and k > self.config.num_speculative_tokens:
            raise InvalidRequestError(f"num_speculative_tokens={k} exceeds the engine's "
                                      f"{self.config.num_speculative_tokens}")
        if nodes is not None and not self.config.tree_nodes:
            raise InvalidRequestError(f"num_tree_nodes={nodes}: this engine verifies chains, not token trees")
        if nodes is not None and nodes > self.config.tree_nodes:
            raise InvalidRequestError(f"num_tree_nodes={nodes} exceeds the engine's {self.config.tree_nodes}")

    def policy_k(self, request: Request, step: int) -> int:
        return self.policy.k_for(request.request_id, request.request_class, request.sampling.num_speculative_tokens,
                                 step, seeded=self._draft_dependent(request))

    def wanted(self, request: Request, step: int) -> int:
        """The draft length the policy allows `request` at engine step `step`, before the cost gate."""
        return self.policy_k(request, step)

    def acceptance_key(self, request: Request) -> str | tuple:
        """What acceptance is estimated per: the request's class."""
        return request.request_class

    def alpha(self, request: Request) -> float:
        """The estimated per-token acceptance rate of `request`'s next proposal (1 before any verify)."""
        return self._acceptance.setdefault(self.acceptance_key(request), _Acceptance()).alpha

    def expected_tokens(self, request: Request, k: int) -> float:
        """Expected accepted draft tokens of `request`'s next proposal cut to `k` tokens: the class's measured
        mean for a tree cut to its k best nodes once its verifies have reported path ranks (`record_tree`),
        else `expected_accepted(alpha, depth)`."""
        cuts = self._cuts.get(self.acceptance_key(request))
        if cuts is not None:
            return cuts.expected(k)
        return expected_accepted(self.alpha(request), self.depth(request, k))

    def begin_step(self, decodes: list[Request], step: int) -> None:
        """Chooses this step's draft length for each of `decodes` (the requests that may decode)."""
        B, base = len(decodes), (0 if self.on_device else None)
        gated = self.costs is not None and B and self.config.min_acceptance > 0
        shape = self.costs.shape(B, B) if gated else None
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
        idle = self._cost(B, fixed, fixed_k, work, plain_at, base)
        if base is not None and not fixed:
            # Drafting nothing for long releases the requests' draft state (`HOLD_STEPS`), after which a step
            # runs the target alone, without the draft's upkeep pass: that is what drafting must beat.
            bare = self.costs.get(*shape, None, plain_work)
            idle = idle if bare is None else bare
        best, choice = (B + gain) / idle, (0, 0)
        fixed_work = work
        for cap in self.gate_caps:
            drafted, tokens, top, work = fixed, B + gain, fixed_k, fixed_work
            for m, (a, k, r) in enumerate(rows, 1):
                k = min(k, cap)
                drafted, tokens, top = drafted + k, tokens + self.expected_tokens(r, k), max(top, k)
                work += self._extra_pairs(r, k)
                rate = tokens / self._cost(B, drafted, top, work, plain_at, base)
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
        held = ({self.acceptance_key(r) for _, _, r in rows} | {self.acceptance_key(r) for r in broke}) - {
            self.acceptance_key(r) for _, _, r in rows[:m] if cap}
        for key in held:
            self._acceptance.setdefault(key, _Acceptance()).relax()
            if key in self._cuts:
                self._cuts[key].relax()
        for r in [r for _, _, r in rows] + broke:
            if self._held[r.request_class] >= HOLD_STEPS:
                self.release(r)

    def observe_step(self, seqs, emitted: list[int], seconds: float) -> None:
        """A step of decode rows only (`ScheduledSeq`s, each sampling) emitted `emitted` tokens per row in
        `seconds`: charges each class's drafting its regret against this batch's measured plain step
        (`DraftRegret`). Nothing is charged before the plain step is measured."""
        if self.costs is None or not seqs:
            return
        B = len(seqs)
        shape = self.costs.shape(B, B)
        if shape is None:
            return
        work = sum(attention_pairs(s.start, 1) for s in seqs)
        plain = self.costs.get(*shape, None, work) or (self.costs.get(*shape, 0, work) if self.on_device else None)
        if not plain:
            return
        classes: dict[str, list] = {}
        for s, n in zip(seqs, emitted):
            c = classes.setdefault(s.request.request_class, [0, 0, False])
            c[0], c[1], c[2] = c[0] + 1, c[1] + n, c[2] or bool(s.num_draft)
        for name, (rows, tokens, drafted) in classes.items():
            self.regret.observe(name, shape[1], drafted, rows, B, tokens, seconds, plain)

    def release(self, request: Request) -> None:
        """The gate has held `request`'s class at no drafts for `HOLD_STEPS` steps in a row: stop keeping
        `request`'s draft state (a host proposer keeps none)."""

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
        return s.seed is not None and s.temperature > 0 and not self.output_independent

    def _cost(self, B: int, drafted: int, top: int, work: int, plain_at: tuple[float, int],
              base: int | None) -> float:
        """Seconds of a step of B decodes verifying `drafted` draft tokens, at most `top` per row, attending
        `work` pairs; `plain_at`: the batch's plain step (seconds, pairs)."""
        plain, plain_work = plain_at
        if drafted == 0:
            return plain
        shape = self.costs.shape(B, B + drafted)
        if shape is None:
            return float("inf")
        K = min(k for k in self.program_ks if k >= top)
        seconds = self.costs.estimate(*shape, K, work, self.costs.shape(B, B)[0], plain, plain_work)
        return plain if seconds is None else max(seconds, plain)

    @property
    def gate_caps(self) -> tuple[int, ...]:
        """The draft-length caps the cost gate tries: for chains, every length up to K on the host (its one
        verify program serves them all, and K = 3 fills a 4-token window where K = 4 pads to 8), the ladder
        K, K/2, ..., 1 on the device (a program per length); for token trees, cuts that fill a power-of-two
        verify window (1, 3, 7, 15 nodes + the root) and the whole tree, so a CPU, where a wide window costs
        more, verifies small trees and a GPU large ones."""
        n = self.config.tree_nodes
        if not n:
            return self.config.ladder if self.on_device else tuple(range(1, self.config.num_speculative_tokens + 1))
        return tuple(sorted({c for c in (1, 3, 7, 15) if c < n} | {n}))

    def draft_len(self, request: Request, step: int) -> int:
        """The draft length `request` gets at engine step `step` (the gate's choice from `begin_step`)."""
        d = self._drafts.get(request.request_id)
        return self.wanted(request, step) if d is None else d

    @property
    def program_ks(self) -> tuple[int, ...]:
        """The K of each verify program compiled per step shape. A device proposer runs K draft passes, so
        it has one per ladder length; a host proposer's window costs what its real slots cost whatever
        K is (`engine.speculative._window_rows`), so one program (the largest K) serves every draft
        length and the compiled programs stay few (XLA:CPU maps ~600 memory regions per step program,
        and a process gets 65530: BUILD.md)."""
        if self.on_device:
            return self.config.ladder
        return (self.config.tree_nodes or self.config.num_speculative_tokens,)

    def step_k(self, plan: StepPlan, step: int) -> int | None:
        """The step's program: None (target only) or the smallest of `program_ks` >= every draft length."""
        drafted = max(s.num_draft for s in plan.seqs)
        return min(k for k in self.program_ks if k >= drafted) if drafted else None

    def proposals(self, plan: StepPlan) -> dict[str, list[int]] | None:
        """A host proposer's draft tokens for each drafting row of `plan` (None for a device proposer)."""
        return None

    def tree_parents(self, plan: StepPlan) -> dict[str, list[int]] | None:
        """For token-tree proposals, each drafting row's node parents (`scheduler.packing.pack`); None: chains."""
        return None

    def depth(self, request: Request, k: int) -> int:
        """The longest path among the first `k` draft tokens of `request`'s proposal (k for a chain). The
        gate prices a window of k tokens but expects acceptance along one path of this length, and acceptance
        is recorded per path position."""
        return k

    def pools(self, num_blocks: int, block_size: int) -> tuple:
        """A device proposer's pools, indexed by the target's block tables (none for a host proposer)."""
        return ()

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes `pools` take per KV block."""
        return 0

    def record(self, request: Request, num_draft: int, num_accepted: int, step: int) -> None:
        """One verify step's outcome for `request` (adapts K for it and its class, and the class's alpha);
        `num_draft` counts path positions (`depth`)."""
        self.policy.update(request.request_id, request.request_class, num_draft, num_accepted, step)
        if num_draft:
            self._acceptance.setdefault(self.acceptance_key(request), _Acceptance()).add(
                num_accepted, min(num_draft, num_accepted + 1))

    def record_tree(self, request: Request, num_nodes: int, ranks) -> None:
        """One verify of a `num_nodes`-node token tree for `request` whose accepted nodes had ranks `ranks`
        (`StepOutput.path_rank`): updates the class's expected accepted tokens per tree cut (`CutAcceptance`)."""
        key = self.acceptance_key(request)
        if key not in self._cuts:
            depths = [0] + [self.depth(request, n) for n in range(1, max(self.program_ks) + 1)]
            self._cuts[key] = CutAcceptance(depths)
        self._cuts[key].add(num_nodes, ranks)

    def fork(self, parent: Request, children: list[Request]) -> None:
        """The samples of an n > 1 request start from its state."""
        self.forget(parent.request_id)

    def finish(self, request: Request) -> None:
        """`request` finished or was aborted: its state is dropped."""
        self.forget(request.request_id)

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)
        self._drafts.pop(request_id, None)


class DraftModelProposer(Proposer):
    """A standalone draft model (same vocabulary as the target), run inside the step program.

    Args:
      draft: a `checkpoints.LoadedModel` with the target's vocabulary.
      config: K and the adaptive-speculation settings.
      vocab_size: the target's vocabulary size.
      engine_config: the engine's config (the CPU kernel settings).
    Raises:
      ValueError: the draft's vocabulary differs from the target's.
    """

    kind = "draft"
    on_device = True

    def __init__(self, draft, config: SpeculationConfig, vocab_size: int, engine_config):
        if draft.config.vocab_size != vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                             f"({vocab_size})")
        super().__init__(config)
        self.model_config = draft.config
        self.graphdef, self.state, self.packed_bytes = build_model(draft, engine_config,
                                                                   engine_config.draft_kernel_dtype)
        # Requests whose draft KV fell behind (a step ran without the draft): they never draft again.
        self._behind: set[str] = set()

    def wanted(self, request: Request, step: int) -> int:
        """0 once the request's draft KV fell behind, else the policy's K."""
        if request.request_id in self._behind:
            return 0
        return self.policy_k(request, step)

    def release(self, request: Request) -> None:
        """Keeping the draft KV costs a draft pass over every step token: a request the gate keeps holding
        drops it and never drafts again."""
        self._behind.add(request.request_id)

    def step_k(self, plan: StepPlan, step: int) -> int | None:
        """None (target only), 0 (the draft keeps its KV), or a ladder K >= every draft (`program_ks`).

        When no request in the step will speculate (the gate's choice for this step aside: the policy
        switched them off, or the gate released them), the draft is skipped: speculation that does not
        pay then costs nothing, and those requests' draft KV falls behind for good. Their
        blocks hold no draft KV either, so a later request that reuses them through the prefix
        cache drafts from an incomplete context: fewer tokens accepted, the output unchanged.
        """
        k = super().step_k(plan, step)
        if k is not None:
            return k
        if any(self.wanted(s.request, step) for s in plan.seqs):
            return 0
        self._behind.update(s.request.request_id for s in plan.seqs)
        return None

    def pools(self, num_blocks: int, block_size: int) -> tuple:
        return (KVPool.zeros(self.model_config, num_blocks, block_size),)

    def bytes_per_block(self, block_size: int) -> int:
        return kv_bytes_per_block(self.model_config, block_size)

    def step_program(self, target_graphdef, attention, K: int):
        """The jitted step for draft length `K` (`engine.speculative.make_spec_step`)."""
        return make_spec_step(target_graphdef, self.graphdef, attention, K)

    def fork(self, parent: Request, children: list[Request]) -> None:
        """The samples share the parent's blocks, so they inherit its draft KV state."""
        if parent.request_id in self._behind:
            self._behind.update(c.request_id for c in children)
        super().fork(parent, children)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._behind.discard(request_id)


class EagleProposer(DraftModelProposer):
    """An EAGLE head (`model.eagle.EagleHead`) drafting from the target's features, inside the step program.

    The head's own KV and the target's final hidden state at every KV slot
    (`engine.speculative.FeaturePool`) are kept beside the target's pool; a
    step that runs without the head leaves them behind for its requests,
    which then stop drafting (as with a draft model). With `config.tree_nodes`
    the head drafts EAGLE-2 dynamic trees of up to that many nodes, `tree_branching`
    wide and at most K deep, verified by the coupled tree verify
    (`engine.speculative.make_eagle_tree_step`), so the output is the target's
    whatever is drafted (`output_independent`). With `config.ngram_in_tree` the
    host's n-gram lookup adds its chain to each tree where the context has a
    match (one tree from two proposers: a copied span and the head's guesses
    are verified in one step), and acceptance is estimated per request class and
    matched n-gram size, as `engine.prompt_lookup.NgramProposer` does.

    Args:
      head: a `checkpoints.LoadedModel` whose params hold `model.eagle.FC` (`checkpoints.draft.load_draft`).
      config: K, the trees and the adaptive-speculation settings.
      target_config: the target's `ModelConfig`.
      engine_config: the engine's config (the CPU kernel settings).
    Raises:
      ValueError: not an EAGLE head, or its width or vocabulary differs from the target's.
    """

    kind = "eagle"

    def __init__(self, head, config: SpeculationConfig, target_config, engine_config):
        if FC not in head.params:
            raise ValueError(f"{head.config.name} is not an EAGLE head (no {FC})")
        if head.config.hidden_size != target_config.hidden_size:
            raise ValueError(f"the EAGLE head's width ({head.config.hidden_size}) differs from the target's "
                             f"({target_config.hidden_size})")
        super().__init__(head, config, target_config.vocab_size, engine_config)
        self.target_config = target_config
        self._contexts = Contexts(config.prompt_lookup_max, config.prompt_lookup_min)
        self._chains: dict[str, tuple[list[int], int]] = {}  # request id -> (n-gram chain, matched n)

    def pools(self, num_blocks: int, block_size: int) -> tuple:
        return (*super().pools(num_blocks, block_size), FeaturePool.zeros(self.target_config, num_blocks, block_size))

    def bytes_per_block(self, block_size: int) -> int:
        return super().bytes_per_block(block_size) + FeaturePool.bytes_per_block(self.target_config, block_size)

    @property
    def output_independent(self) -> bool:
        """Token trees are verified by the coupled tree verify: the output is the target's whatever is drafted."""
        return bool(self.config.tree_nodes)

    def wanted(self, request: Request, step: int) -> int:
        """Chains: the policy's K. Trees: the node budget (the request's `num_tree_nodes` caps it), shrunk in
        proportion when the policy lowers K; 0 once the request's features fell behind."""
        k = super().wanted(request, step)
        c = self.config
        n = c.tree_nodes
        if not n or not k:
            return k
        if c.ngram_in_tree:
            self._chains[request.request_id] = self._contexts.index(request).lookup(c.num_speculative_tokens)
        n = min(n, request.sampling.num_tree_nodes or n)
        return max(1, n * k // c.num_speculative_tokens)

    def acceptance_key(self, request: Request) -> str | tuple:
        """With n-gram chains in the trees: the class and the matched n-gram size (0: no match)."""
        if not self.config.ngram_in_tree:
            return request.request_class
        return request.request_class, self._chains.get(request.request_id, ((), 0))[1]

    def proposals(self, plan: StepPlan) -> dict[str, list[int]] | None:
        """With n-gram chains in the trees: each drafting row's chain, cut to its window and padded with -1."""
        if not self.config.ngram_in_tree:  # implies trees (SpeculationConfig)
            return None
        out = {}
        for s in plan.seqs:
            if s.num_draft:
                chain = self._chains.get(s.request.request_id, ((), 0))[0][:s.num_draft]
                out[s.request.request_id] = [*chain, *[-1] * (s.num_draft - len(chain))]
        return out

    @property
    def program_ks(self) -> tuple[int, ...]:
        """Trees: one program per gate cut (the head's drafting passes grow with the node count)."""
        return self.gate_caps if self.config.tree_nodes else super().program_ks

    def depth(self, request: Request, k: int) -> int:
        """A tree of `k` nodes is at most k deep and at most as deep as the levels (`eagle_tree_shape`) of the
        program that drafts it, the smallest of `program_ks` that holds k nodes, or as its n-gram chain."""
        if not self.config.tree_nodes or not k:
            return k
        K = min(c for c in self.program_ks if c >= k)
        levels = eagle_tree_shape(K, self.config.tree_branching, self.config.num_speculative_tokens)[1]
        chain = self._chains.get(request.request_id, ((), 0))[0] if request is not None else ()
        return min(k, max(levels, len(chain)))

    def tree_parents(self, plan: StepPlan) -> dict[str, list[int]] | None:
        """Trees: placeholder chains (the program picks each row's tree and rewrites its masks and positions)."""
        if not self.config.tree_nodes:
            return None
        return {s.request.request_id: list(range(s.num_draft)) for s in plan.seqs if s.num_draft}

    def step_program(self, target_graphdef, attention, K: int):
        """The jitted step for draft length `K` (`engine.speculative.make_eagle_step`), or for trees of `K`
        nodes (`make_eagle_tree_step`)."""
        if self.config.tree_nodes and K:
            return make_eagle_tree_step(target_graphdef, self.graphdef, attention, K, self.config.tree_branching,
                                        self.config.num_speculative_tokens, self.config.ngram_in_tree)
        return make_eagle_step(target_graphdef, self.graphdef, attention, K)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._contexts.forget(request_id)
        self._chains.pop(request_id, None)
