"""The draft model as the engine's collaborator: its weights, and the adaptive policy choosing K.

A `Drafter` is the one optional object the engine loop talks to about
speculation: how many draft tokens a request wants at its next decode step
(`draft_len`, passed to `Scheduler.schedule`), which step program a planned
step needs (`step_k`), and what each verify step accepted (`record`). Its
device half (the draft's KV pool and the fused draft + verify program) lives
in the runner (`engine.runner`), which keeps the draft's pool beside the
target's so both are indexed by the same block tables.

Sources: Leviathan et al. 2023 (§2.3, §3.1) for speculative sampling and the
per-token acceptance rate alpha.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from engine.step import build_model
from model.llama import Llama
from scheduler.request import InvalidRequestError, Request
from scheduler.scheduler import StepPlan


@dataclasses.dataclass
class SpeculationConfig:
    """Adaptive speculation: K per request class and per request from running acceptance rates.

    num_speculative_tokens: K when speculation pays (the top of the ladder
      K, K/2, ..., 1 of compiled draft lengths).
    min_acceptance: when a running acceptance rate (of a request or of its
      class) is below this, K is halved, down to 0 (off).
    ema_decay: weight of the past in the running averages, per verify step.
    retry_after_steps: a class switched off is retried at K = 1 after this many
      engine steps (twice as long after each failed retry), on the requests
      that arrive then.
    """

    num_speculative_tokens: int = 4
    min_acceptance: float = 0.5
    ema_decay: float = 0.5
    retry_after_steps: int = 200

    def __post_init__(self):
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if not 0 <= self.min_acceptance <= 1 or not 0 <= self.ema_decay < 1:
            raise ValueError("min_acceptance must be in [0, 1] and ema_decay in [0, 1)")

    @property
    def ladder(self) -> tuple[int, ...]:
        """The draft lengths a step program is compiled for: K, K/2, ..., 1 (ascending)."""
        ks, k = [], self.num_speculative_tokens
        while k:
            ks.append(k)
            k //= 2
        return tuple(reversed(ks))


@dataclasses.dataclass
class _Rate:
    """A running acceptance rate and the K it currently allows."""

    k: int
    rate: float = 1.0  # optimistic start: speculation is tried first
    off_since: int = 0  # engine step of the last halving (read once k is 0)
    good: int = 0  # verify steps at this K with the rate at or above the threshold
    failed_retries: int = 0  # retries in a row that ended off again


# A class's K climbs one ladder step after this many verify steps in a row at or above the threshold.
GROW_AFTER = 4
# The wait before a retry doubles with each failed retry, up to this factor.
MAX_BACKOFF = 64


class AdaptiveSpeculation:
    """Per-class and per-request acceptance rates (running averages) and each request's K.

    The rate of a verify step is accepted / tried draft tokens, where tried
    stops at the first rejection (min(num_draft, accepted + 1)): an estimate
    of the per-token acceptance probability alpha of Leviathan et al. 2023
    (§3.1) that does not depend on K, so one threshold serves every K.
    Whenever a rate is below `min_acceptance` its K halves (no optimistic
    reset: a class that does not pay goes from K to 0 in log2(K) + 1 poor
    steps); after `GROW_AFTER` verify steps in a row at or above it, a
    class's K climbs the ladder again, up to `num_speculative_tokens`. A class at 0
    retries at K = 1 (the cheapest verify) after `retry_after_steps`, twice
    as long after each retry that ends off again (exponential backoff, as
    in TCP's retransmission timer). A request at 0 stays off (its draft KV
    is no longer kept up to date).

    An unseeded request drafts min(class K, own K). A seeded request drafts
    its own K only, so its output depends on its own history alone.
    """

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self.classes: dict[str, _Rate] = {}
        self.requests: dict[str, _Rate] = {}

    def _class(self, name: str) -> _Rate:
        return self.classes.setdefault(name, _Rate(self.config.num_speculative_tokens))

    def class_k(self, request_class: str) -> int:
        return self._class(request_class).k

    def request_rate(self, request_id: str) -> float | None:
        r = self.requests.get(request_id)
        return None if r is None else r.rate

    def k_for(self, request_id: str, request_class: str, requested: int | None, step: int,
              seeded: bool = False) -> int:
        """K for a request's next verify step; `requested` is the request's own cap (None: engine default)."""
        c = self.config
        own = self.requests.setdefault(request_id, _Rate(c.num_speculative_tokens))
        k = own.k
        if not seeded:
            cls = self._class(request_class)
            wait = c.retry_after_steps * min(2 ** cls.failed_retries, MAX_BACKOFF)
            if cls.k == 0 and c.num_speculative_tokens and step - cls.off_since >= wait:
                cls.k, cls.rate, cls.good = 1, 1.0, 0  # retry
                cls.failed_retries += 1  # until it grows back to the top
            k = min(k, cls.k)
        return min(k, c.num_speculative_tokens if requested is None else requested)

    def update(self, request_id: str, request_class: str, num_draft: int, num_accepted: int, step: int) -> None:
        """Records one verify step's outcome: halves K where a running rate fell below the threshold
        and raises the class's K after a run of good steps."""
        if num_draft == 0:
            return
        c = self.config
        tried = min(num_draft, num_accepted + 1)
        own, cls = self.requests.setdefault(request_id, _Rate(c.num_speculative_tokens)), self._class(request_class)
        for r in (own, cls):
            r.rate = c.ema_decay * r.rate + (1 - c.ema_decay) * num_accepted / tried
            if r.rate < c.min_acceptance:
                r.good = 0
                if r.k > 0:
                    r.k //= 2
                    r.off_since = step
            else:
                r.good += 1
        if cls.good >= GROW_AFTER and 0 < cls.k < c.num_speculative_tokens:
            cls.k, cls.good = min(k for k in c.ladder if k > cls.k), 0
            if cls.k == c.num_speculative_tokens:
                cls.failed_retries = 0

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


class Drafter:
    """A standalone draft model (same vocabulary as the target) and the policy that sets its K.

    Args:
      draft: a `checkpoints.LoadedModel` with the target's vocabulary.
      config: K and the adaptive-speculation settings.
      vocab_size: the target's vocabulary size.
      engine_config: the engine's config (the CPU kernel settings); None: XLA's dot only.
    Raises:
      ValueError: the draft's vocabulary differs from the target's.
    """

    def __init__(self, draft, config: SpeculationConfig, vocab_size: int, engine_config=None):
        if draft.config.vocab_size != vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                             f"({vocab_size})")
        self.model_config = draft.config
        self.config = config
        if engine_config is None:
            self.graphdef, self.state = nnx.split(Llama(draft.config, params=draft.params))
            self.packed_bytes = 0
        else:
            self.graphdef, self.state, self.packed_bytes = build_model(draft, engine_config,
                                                                       engine_config.draft_kernel_dtype)
        self.policy = AdaptiveSpeculation(config)
        # Requests whose draft KV fell behind (a step ran without the draft): they never draft again.
        self._behind: set[str] = set()

    def validate(self, requested: int | None) -> None:
        """Raises InvalidRequestError if a request asks for more draft tokens than the engine compiles."""
        if requested is not None and requested > self.config.num_speculative_tokens:
            raise InvalidRequestError(f"num_speculative_tokens={requested} exceeds the engine's "
                                      f"{self.config.num_speculative_tokens}")

    def draft_len(self, request: Request, step: int) -> int:
        """The draft length `request` wants at engine step `step`; 0 once its draft KV fell behind."""
        if request.request_id in self._behind:
            return 0
        return self.policy.k_for(request.request_id, request.request_class, request.sampling.num_speculative_tokens,
                                 step, seeded=request.sampling.seed is not None)

    def step_k(self, plan: StepPlan, step: int) -> int | None:
        """The step's program: None (target only), 0 (the draft keeps its KV), or a ladder K >= every draft.

        When no request in the step will speculate, the draft is skipped: speculation that was
        switched off then costs nothing, and those requests' draft KV falls behind for good. Their
        blocks hold no draft KV either, so a later request that reuses them through the prefix
        cache drafts from an incomplete context: fewer tokens accepted, the output unchanged.
        """
        drafted = max(s.num_draft for s in plan.seqs)
        if drafted:
            return min(k for k in self.config.ladder if k >= drafted)
        if any(self.draft_len(s.request, step) for s in plan.seqs):
            return 0
        self._behind.update(s.request.request_id for s in plan.seqs)
        return None

    def record(self, request: Request, num_draft: int, num_accepted: int, step: int) -> None:
        """One verify step's outcome for `request` (adapts K for it and its class)."""
        self.policy.update(request.request_id, request.request_class, num_draft, num_accepted, step)

    def fork(self, parent: Request, children: list[Request]) -> None:
        """The samples of an n > 1 request share its blocks, so they inherit its draft KV state."""
        if parent.request_id in self._behind:
            self._behind.update(c.request_id for c in children)
        self.forget(parent.request_id)

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)
        self._behind.discard(request_id)
