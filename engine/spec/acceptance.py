"""How often proposals are accepted: per-class estimates, tree-cut estimates and the adaptive G.

`_Acceptance` is a request class's decayed per-token acceptance rate alpha,
which the cost gate (`engine.spec.gate.Gate`) weighs with `expected_accepted`;
`CutAcceptance` replaces it for token trees (the measured accepted tokens of
every tree cut); `AdaptiveSpeculation` halves a class's (or a request's) G
while its running acceptance rate stays under `min_acceptance` and climbs it
back when verifies pay.

Source: Leviathan et al. 2023, §3.1 (the per-token acceptance rate alpha and
the expected tokens of a window).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.spec.config import SpeculationConfig


class _Acceptance:
    """accepted / tried draft tokens with older verifies decaying by `decay` each: an estimate of the per-token
    acceptance rate alpha. Each verify weighs by the tokens it tried, so a run of first-token misses moves it
    less than an average of per-verify ratios would; the prior (accepted, tried) is one accepted token
    (optimistic: a new class is tried first) or another estimate's sums."""

    def __init__(self, decay: float = 0.95, accepted: float = 1.0, tried: float = 1.0):
        self.decay, self.accepted, self.tried = decay, accepted, tried

    def add(self, accepted: int, tried: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.tried = self.decay * self.tried + tried

    def relax(self) -> None:
        """One step in which the cost gate gave this estimate's class no drafts (so no verify updates it): the
        past decays toward the optimistic prior of 1 accepted of 1 tried. A class the gate holds is tried
        again once the prior outweighs the evidence (at decay 0.95, an estimate of 0.24 over the last 40
        verifies is back at 0.5 after 46 held steps), and fresh verifies soon outweigh the prior again."""
        self.accepted = self.decay * self.accepted + (1 - self.decay)
        self.tried = self.decay * self.tried + (1 - self.decay)

    def copy(self) -> "_Acceptance":
        return _Acceptance(self.decay, self.accepted, self.tried)

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried


class CutAcceptance:
    """Expected accepted tokens of a token tree cut to its `n` best nodes, for every n, as decayed means.

    One alpha prices a tree cut badly: a tree's acceptance is not geometric in its depth (its first level is
    several candidates wide), so at a dip in alpha a gate pricing cuts by `expected_accepted(alpha, depth)`
    shrinks a tree that still pays. Instead every verify of an `m`-node tree reports the rank of each accepted
    node among its candidates (`StepOutput.path_rank`); ranks grow along a path, so the tree cut to its `n`
    best nodes (n <= m) would have accepted the path's nodes of rank < n, at most `depths[n]` of them: one
    observation for each of those cuts from a single verify (with coupled verify the target's tokens do not
    depend on the tree, so this is what that cut would have accepted, up to candidates that a program of
    fewer levels ranks differently). Each observed cut's mean weighs past verifies by `decay` each. Cuts
    larger than the verified one are not observed: their means move toward the optimistic prior
    (`depths[n]`, every level accepted) by `1 - relax_decay` per verify and their evidence decays by as
    much, so a cut the gate stopped using after a stretch of poor verifies is tried again (at 0.95, a mean
    of 1.5 of 4 is at 2.9 after 20 steps) and a fresh verify then counts for more than the stale past.

    Args:
      depths: int `[N + 1]`, the most tokens a tree of n nodes can accept (its levels); depths[0] = 0.
      decay: weight of the past per observation.
      relax_decay: how much of the mean's distance to the prior, and of its evidence, is kept per verify
        (or held step, `relax`) that does not observe a cut.
    """

    def __init__(self, depths, decay: float = 0.95, relax_decay: float = 0.95):
        self.depths = np.asarray(depths, np.float64)
        self.decay, self.relax_decay = decay, relax_decay
        self.mean, self.weight = self.depths.copy(), np.ones_like(self.depths)

    def add(self, num_nodes: int, ranks) -> None:
        """One verify of a tree of `num_nodes` nodes whose accepted nodes had ranks `ranks` (ascending)."""
        n = np.arange(len(self.depths))
        seen = n <= num_nodes
        would = np.minimum(self.depths, np.searchsorted(np.asarray(ranks), n, side="left"))
        weight = self.decay * self.weight + 1
        observed = self.mean + (would - self.mean) / weight
        self.relax()
        self.mean, self.weight = np.where(seen, observed, self.mean), np.where(seen, weight, self.weight)

    def relax(self) -> None:
        """Every cut moves toward the prior (also each step in which the cost gate gives this class no drafts)."""
        r = self.relax_decay
        self.mean = r * self.mean + (1 - r) * self.depths
        self.weight = r * self.weight

    def expected(self, n: int) -> float:
        """Expected accepted tokens of a tree cut to its `n` best nodes (n clipped to N)."""
        return float(self.mean[min(n, len(self.depths) - 1)])


@dataclasses.dataclass
class _Rate:
    """A running acceptance rate and the G it currently allows."""

    k: int
    estimate: _Acceptance
    off_since: int = 0  # engine step of the last halving (read once k is 0)
    good: int = 0  # verify steps at this G with the rate at or above the threshold
    failed_retries: int = 0  # retries in a row that ended off again

    @property
    def rate(self) -> float:
        return self.estimate.alpha


# A class's G climbs one ladder step after this many verify steps in a row at or above the threshold.
GROW_AFTER = 4


# The wait before a retry doubles with each failed retry, up to this factor.
MAX_BACKOFF = 64


class AdaptiveSpeculation:
    """Per-class and per-request acceptance rates (running averages) and each request's G.

    A rate is accepted / tried draft tokens over the verifies so far, older
    ones decaying by `ema_decay` each, where tried stops at the first rejection
    (min(num_draft, accepted + 1)): an estimate of the per-token acceptance
    probability alpha of Leviathan et al. 2023 (§3.1) that does not depend on
    G, so one threshold serves every G. A new request's rate starts from its
    class's, so a request of a class that pays needs evidence of its own to
    fall below the threshold, not a few unlucky first verifies.
    Whenever a rate is below `min_acceptance` its G halves (no optimistic
    reset: a class that does not pay goes from G to 0 in log2(G) + 1 poor
    steps); after `GROW_AFTER` verify steps in a row at or above it, a
    class's G climbs the ladder again, up to `num_speculative_tokens`. A class at 0
    retries at G = 1 (the cheapest verify) after `retry_after_steps`, twice
    as long after each retry that ends off again (exponential backoff, as
    in TCP's retransmission timer). A request at 0 stays off (its draft KV
    is no longer kept up to date).

    A request drafts min(class G, own G), except a `seeded` one (a seeded
    sampled request whose output depends on its draft lengths): it drafts its
    own G only, so its output depends on its own history alone.
    """

    def __init__(self, config: SpeculationConfig):
        self.config = config
        self.classes: dict[str, _Rate] = {}
        self.requests: dict[str, _Rate] = {}

    def _fresh(self, prior: _Acceptance | None = None) -> _Rate:
        return _Rate(self.config.num_speculative_tokens, prior.copy() if prior else _Acceptance(self.config.ema_decay))

    def _class(self, name: str) -> _Rate:
        if name not in self.classes:
            self.classes[name] = self._fresh()
        return self.classes[name]

    def class_k(self, request_class: str) -> int:
        return self._class(request_class).k

    def request_rate(self, request_id: str) -> float | None:
        r = self.requests.get(request_id)
        return None if r is None else r.rate

    def k_for(self, request_id: str, request_class: str, requested: int | None, step: int,
              seeded: bool = False) -> int:
        """G for a request's next verify step; `requested` is the request's own cap (None: engine default)."""
        c = self.config
        cls = self._class(request_class)
        if request_id not in self.requests:  # a seeded request's history is its own alone
            self.requests[request_id] = self._fresh(None if seeded else cls.estimate)
        k = self.requests[request_id].k
        if not seeded:
            wait = c.retry_after_steps * min(2 ** cls.failed_retries, MAX_BACKOFF)
            if cls.k == 0 and c.num_speculative_tokens and step - cls.off_since >= wait:
                cls.k, cls.estimate, cls.good = 1, _Acceptance(c.ema_decay), 0  # retry
                cls.failed_retries += 1  # until it grows back to the top
            k = min(k, cls.k)
        return min(k, c.num_speculative_tokens if requested is None else requested)

    def update(self, request_id: str, request_class: str, num_draft: int, num_accepted: int, step: int) -> None:
        """Records one verify step's outcome: halves G where a running rate fell below the threshold
        and raises the class's G after a run of good steps."""
        if num_draft == 0:
            return
        c = self.config
        tried = min(num_draft, num_accepted + 1)
        cls = self._class(request_class)
        own = self.requests.setdefault(request_id, self._fresh())
        for r in (own, cls):
            r.estimate.add(num_accepted, tried)
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


def expected_accepted(alpha: float, k: int) -> float:
    """Expected accepted draft tokens of a k-token proposal when each is accepted with probability alpha
    (given the ones before it): alpha + alpha^2 + ... + alpha^k (Leviathan et al. 2023, §3.1)."""
    return sum(alpha ** j for j in range(1, k + 1))


def oracle_tree_acceptance(hits: np.ndarray) -> np.ndarray:
    """Acceptance length (accepted drafts + the bonus token) of a greedy verify rooted at each position of one
    sequence, for a tree that expands its proposer's top-w tokens at every node, per w.

    Args:
      hits: bool `[D, N, W]`; `hits[d, i, w]`: the proposer's top w + 1 tokens at depth d + 1, drafted from
        the root `i - d` along the target's own path, hold the target's token after position i.
    Returns:
      float64 `[N, W]`: 1 + the depths the tree at root i accepts, i.e. the longest d with hits[u, i + u, w]
      for every u < d (positions past the sequence count as misses).
    """
    D, N, W = hits.shape
    alive = np.ones((N, W), bool)
    accepted = np.zeros((N, W))
    for d in range(D):
        at = np.zeros((N, W), bool)
        at[:N - d] = hits[d, d:]
        alive &= at
        accepted += alive
    return 1.0 + accepted
