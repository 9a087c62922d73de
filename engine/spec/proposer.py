"""The proposer contract: where draft tokens come from. How many a step drafts is the gate's call
(`engine.spec.gate.Gate`).

A proposer hands the verify step its tokens and the distribution `p` they
were drawn from, so the output follows the target's distribution exactly
(`engine.spec.verify.verify`, `engine.spec.tree_verify.verify_tree_coupled`):

- `engine.spec.draft.DraftModelProposer`: a standalone draft model, run on the
  device inside the step program; its KV pool sits beside the target's in
  the runner, indexed by the same block tables.
- `engine.spec.eagle.EagleProposer`: an EAGLE head on the target's features
  (Li et al. 2024), on the device, chains or EAGLE-2 dynamic token trees; its
  KV pool and the target's features per KV slot sit beside the target's pool.
- `engine.spec.medusa.MedusaProposer`: Medusa heads on the target's last
  hidden state (Cai et al. 2024) fill a static token tree on the device.
- `engine.spec.ngram.NgramProposer`: prompt lookup on the host (no model);
  its `p` is one-hot, so a draft token is accepted with probability q(x).
- `engine.spec.suffix.SuffixProposer`: suffix decoding on the host, trees
  from the request's own context and from earlier outputs of its scope.
- `NoProposer`: no speculation; every step runs the target alone.

Shape letters (DESIGN.md, STYLE.md): T step tokens (a token bucket), S
sequences (a sequence bucket), G a program's draft length (a tree's node
count), V the vocabulary, E the hidden width, P KV blocks, B block size.

Source: Leviathan et al. 2023 (§2.3, §3.1) for speculative sampling.
"""

from __future__ import annotations

from engine.spec.config import SpeculationConfig
from engine.spec.programs import make_tree_verify_step, make_verify_step
from scheduler.request import InvalidRequestError, Request
from scheduler.scheduler import StepPlan


class Proposer:
    """Where a request's draft tokens come from, and the step programs that draft and verify them.

    `kind` names it (ModelInfo, metrics); `on_device` says whether it drafts
    inside the step program (then `model_config` is the draft model's, whose
    KV pool the runner keeps) or on the host (then `proposals` gives its
    tokens and the program only verifies).
    """

    kind = ""
    on_device = False
    # True when a seeded request's output does not depend on its draft lengths, so the gate may
    # choose them for seeded requests too.
    output_independent = False
    # Whether the adaptive G (`engine.spec.acceptance.AdaptiveSpeculation`) may switch drafting off per
    # request and class; a proposer that keeps no draft state leaves that to the cost gate alone.
    adaptive_k = True
    model_config = None
    packed_bytes = 0

    def __init__(self, config: SpeculationConfig):
        self.config = config

    @property
    def program_key(self) -> tuple | None:
        """What the compiled programs depend on besides the target (`engine.programs.Programs`)."""
        return self.kind, self.config, self.on_device, repr(getattr(self, "graphdef", None))

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

    def can_draft(self, request: Request) -> bool:
        """False once `request` can never draft again (a device proposer's state fell behind)."""
        return True

    def proposal_len(self, request: Request, k: int) -> int:
        """The draft tokens this proposer offers `request` when the adaptive policy allows `k` (a chain's length;
        a tree's node count): k for a model, what the lookup found for a host proposer."""
        return k

    def acceptance_key(self, request: Request) -> str | tuple:
        """What acceptance is estimated per: the request's class."""
        return request.request_class

    def depth(self, request: Request, k: int) -> int:
        """The longest path among the first `k` draft tokens of `request`'s proposal (k for a chain). The
        gate prices a window of k tokens but expects acceptance along one path of this length, and acceptance
        is recorded per path position."""
        return k

    @property
    def program_ks(self) -> tuple[int, ...]:
        """The G of each verify program compiled per step shape. A device proposer runs G draft passes, so
        it has one per ladder length; a host proposer's window costs what its real slots cost whatever
        G is (`engine.spec.programs._window_rows`), so one program (the largest G) serves every draft
        length and the compiled programs stay few (XLA:CPU maps ~600 memory regions per step program,
        and a process gets 65530: BUILD.md)."""
        if self.on_device:
            return self.config.ladder
        return (self.config.tree_nodes or self.config.num_speculative_tokens,)

    def idle_k(self, plan: StepPlan, will_draft) -> int | None:
        """The program of a step that drafts nothing: None (the target alone). `will_draft(request)` says
        whether a row may draft at a later step."""
        return None

    def step_program(self, target_graphdef, attention, G: int):
        """The jitted step program for draft length `G`; a host proposer's verifies the tokens packed into the
        placeholders (`make_verify_step`; `make_tree_verify_step` for token trees)."""
        make = make_tree_verify_step if self.config.tree_nodes else make_verify_step
        return make(target_graphdef, attention, G)

    def proposals(self, plan: StepPlan) -> dict[str, list[int]] | None:
        """A host proposer's draft tokens for each drafting row of `plan` (None for a device proposer)."""
        return None

    def tree_parents(self, plan: StepPlan) -> dict[str, list[int]] | None:
        """For token-tree proposals, each drafting row's node parents (`scheduler.packing.pack`); None: chains."""
        return None

    def pools(self, num_blocks: int, block_size: int) -> tuple:
        """A device proposer's pools, indexed by the target's block tables (none for a host proposer)."""
        return ()

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes `pools` take per KV block."""
        return 0

    def release(self, request: Request) -> None:
        """The gate has held `request`'s class at no drafts for a while: stop keeping `request`'s draft state
        (a host proposer keeps none)."""

    def fork(self, parent: Request, children: list[Request]) -> None:
        """The samples of an n > 1 request start from its state."""
        self.forget(parent.request_id)

    def finish(self, request: Request) -> None:
        """`request` finished or was aborted: its state is dropped."""
        self.forget(request.request_id)

    def forget(self, request_id: str) -> None:
        """Drops what the proposer keeps for `request_id`."""


class NoProposer(Proposer):
    """No speculation: no programs but the target's, and a request that asks for drafts is refused."""

    kind = "none"

    def __init__(self):
        super().__init__(SpeculationConfig(0))

    @property
    def program_key(self) -> None:
        return None

    @property
    def program_ks(self) -> tuple[int, ...]:
        return ()

    def validate(self, sampling) -> None:
        if sampling.num_speculative_tokens or sampling.num_tree_nodes:
            raise InvalidRequestError("speculation is not available: the engine has no proposer")

    def proposal_len(self, request: Request, k: int) -> int:
        return 0
