"""How much to speculate: the settings, the adaptive K per request class, and the cost gate's measurements.

`SpeculationConfig` holds the settings; `AdaptiveSpeculation` halves a class's
(or a request's) K while its running acceptance rate stays under
`min_acceptance` and climbs it back when verifies pay; `StepCosts` keeps the
measured seconds of each step shape and `_Acceptance` each request class's
decayed acceptance rate, which the cost gate in `engine.proposers.Proposer`
weighs with `expected_accepted`; `CutAcceptance` replaces it for token trees
(the measured accepted tokens of every tree cut).

Source: Leviathan et al. 2023, §3.1 (the per-token acceptance rate alpha and
the expected tokens of a window).
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from scheduler.packing import step_shape

@dataclasses.dataclass
class SpeculationConfig:
    """Speculation settings: K, adaptive K per request class and per request, and the proposer.

    num_speculative_tokens: K when speculation pays (the top of the ladder
      K, K/2, ..., 1 of compiled draft lengths).
    min_acceptance: when a running acceptance rate (of a request or of its
      class) is below this, K is halved, down to 0 (off). A floor for
      proposals that hardly ever pay; whether a rate above it pays in a
      given batch is the cost gate's call (`Proposer.begin_step`). 0 turns
      both off: every decode drafts K.
    ema_decay: weight of the past in the running acceptance rates, per
      verify step (0.9: a rate that has seen alpha 0.5 for a while falls
      below 0.1 after about 20 verifies in a row that accept nothing; a
      proposal that never accepts turns off after 7).
    retry_after_steps: a class switched off is retried at K = 1 after this many
      engine steps (twice as long after each failed retry), on the requests
      that arrive then.
    prompt_lookup_max, prompt_lookup_min: the n-gram sizes "ngram" matches,
      longest first.
    method: the proposer, "draft" (a draft model), "eagle" (an EAGLE head),
      "medusa" (Medusa heads), "ngram" (prompt lookup) or "suffix" (suffix
      decoding: `engine.suffix_proposer.SuffixProposer`).
    tree_nodes: 0 for chains; else proposals are token trees of at most this
      many nodes below the root (<= 31: a tree mask is one int32 word), each
      path at most `num_speculative_tokens` deep. "ngram": the continuations of
      every earlier match, merged (`scheduler.ngram.lookup_tree`); "medusa": the
      heads' static sparse tree (`model.medusa.medusa_tree`); "eagle": EAGLE-2
      dynamic trees (`engine.speculative.make_eagle_tree_step`); "suffix": the
      likeliest continuations of the longest suffix match.
    tree_branching: "eagle" trees: children proposed per expanded node, and
      nodes expanded per level (EAGLE-2's top-k), 1..8.
    ngram_in_tree: "eagle" trees: where the context has an n-gram match
      (`scheduler.ngram.lookup`, sizes `prompt_lookup_max`..`prompt_lookup_min`),
      its continuation (at most K tokens) joins the head's candidates in the
      same tree, ranked before them; the head's candidates that repeat it merge
      into it. The coupled tree verify keeps the output the target's whatever
      the tree holds, so this stays exact.
    """

    num_speculative_tokens: int = 4
    min_acceptance: float = 0.1
    ema_decay: float = 0.9
    retry_after_steps: int = 200
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    method: str = "draft"
    tree_nodes: int = 0
    tree_branching: int = 4
    ngram_in_tree: bool = False
    suffix_cache_tokens: int = 65536

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), {"int": int, "float": float}.get(field.type)
            if kind is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral if kind is int else numbers.Real):
                raise ValueError(f"{field.name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
            setattr(self, field.name, kind(value))  # numpy scalars become Python's
        if self.method not in ("draft", "eagle", "medusa", "ngram", "suffix"):
            raise ValueError(f"speculation method must be 'draft', 'eagle', 'medusa', 'ngram' or 'suffix', "
                             f"got {self.method!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt lookup sizes must satisfy 1 <= prompt_lookup_min <= prompt_lookup_max")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if not 0 <= self.tree_nodes <= 31 or (self.tree_nodes and self.method == "draft"):
            raise ValueError(f"tree_nodes must be in [0, 31] (token trees: methods 'ngram', 'medusa', 'eagle' and "
                             f"'suffix'), got {self.tree_nodes}")
        if self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens must be >= 0, got {self.suffix_cache_tokens}")
        if not 1 <= self.tree_branching <= 8:
            raise ValueError(f"tree_branching must be in [1, 8], got {self.tree_branching}")
        if self.ngram_in_tree and not (self.method == "eagle" and self.tree_nodes):
            raise ValueError("ngram_in_tree needs EAGLE-2 trees (method 'eagle' and tree_nodes >= 1)")
        if self.tree_nodes and not self.num_speculative_tokens:
            raise ValueError(f"tree_nodes={self.tree_nodes} needs num_speculative_tokens >= 1 (the trees' depth)")
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
    """A running acceptance rate and the K it currently allows."""

    k: int
    estimate: _Acceptance
    off_since: int = 0  # engine step of the last halving (read once k is 0)
    good: int = 0  # verify steps at this K with the rate at or above the threshold
    failed_retries: int = 0  # retries in a row that ended off again

    @property
    def rate(self) -> float:
        return self.estimate.alpha


# A class's K climbs one ladder step after this many verify steps in a row at or above the threshold.
GROW_AFTER = 4
# The wait before a retry doubles with each failed retry, up to this factor.
MAX_BACKOFF = 64


class AdaptiveSpeculation:
    """Per-class and per-request acceptance rates (running averages) and each request's K.

    A rate is accepted / tried draft tokens over the verifies so far, older
    ones decaying by `ema_decay` each, where tried stops at the first rejection
    (min(num_draft, accepted + 1)): an estimate of the per-token acceptance
    probability alpha of Leviathan et al. 2023 (§3.1) that does not depend on
    K, so one threshold serves every K. A new request's rate starts from its
    class's, so a request of a class that pays needs evidence of its own to
    fall below the threshold, not a few unlucky first verifies.
    Whenever a rate is below `min_acceptance` its K halves (no optimistic
    reset: a class that does not pay goes from K to 0 in log2(K) + 1 poor
    steps); after `GROW_AFTER` verify steps in a row at or above it, a
    class's K climbs the ladder again, up to `num_speculative_tokens`. A class at 0
    retries at K = 1 (the cheapest verify) after `retry_after_steps`, twice
    as long after each retry that ends off again (exponential backoff, as
    in TCP's retransmission timer). A request at 0 stays off (its draft KV
    is no longer kept up to date).

    A request drafts min(class K, own K), except a `seeded` one (a seeded
    sampled request whose output depends on its draft lengths): it drafts its
    own K only, so its output depends on its own history alone.
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
        """K for a request's next verify step; `requested` is the request's own cap (None: engine default)."""
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
        """Records one verify step's outcome: halves K where a running rate fell below the threshold
        and raises the class's K after a run of good steps."""
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


def attention_pairs(start: int, num_tokens: int) -> int:
    """(query, key) pairs a row attends under the causal mask: `num_tokens` queries at positions
    `start`, ..., `start + num_tokens - 1`, each over the keys up to itself."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepCosts:
    """Measured seconds of an engine step by its shape and attention work, as running averages.

    A shape is (token bucket T, sequence bucket S, program K), K as in
    `StepTiming.spec_k`. A step's attention work is the (query, key) pairs it
    attends, `attention_pairs` summed over its rows: the part of its cost that
    grows with the contexts. Each shape keeps the running means of its
    seconds and of its work (plain averages over its first 1 / (1 - DECAY)
    steps, so one slow early step is soon outweighed); one slope, seconds
    per pair, is fitted across shapes (least squares on the deviations from
    each shape's means), so a shape measured at other contexts is priced at
    this step's (`get(..., work)`). Steps that compiled a program are not
    recorded (`Engine.step` skips them), so a first call never poisons a
    shape.
    """

    DECAY = 0.8  # weight of the past per observation of a shape
    SLOPE_DECAY = 0.99  # weight of the past in the slope's sums: about the last 100 steps count
    MIN_SHARE = 0.1  # a step at fewer pairs costs at least this share of its shape's measured mean

    def __init__(self, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...]):
        self.token_buckets, self.seq_buckets = token_buckets, seq_buckets
        self._means: dict[tuple[int, int, int | None], tuple[float, float, int]] = {}  # (seconds, pairs, steps)
        self._sxy = self._sxx = 0.0

    def observe(self, T: int, S: int, K: int | None, seconds: float, work: float = 0.0) -> None:
        """One step of shape (T, S, K) took `seconds` and attended `work` (query, key) pairs."""
        key = (T, S, K)
        old = self._means.get(key)
        if old is None:
            self._means[key] = (seconds, work, 1)
            return
        mean_s, mean_w, n = old
        dw = work - mean_w
        self._sxy = self.SLOPE_DECAY * self._sxy + dw * (seconds - mean_s)
        self._sxx = self.SLOPE_DECAY * self._sxx + dw * dw
        w = max(1 / (n + 1), 1 - self.DECAY)
        self._means[key] = ((1 - w) * mean_s + w * seconds, (1 - w) * mean_w + w * work, n + 1)

    @property
    def seconds_per_pair(self) -> float:
        """The fitted attention cost of one (query, key) pair (0 until contexts have varied; never negative)."""
        return max(0.0, self._sxy / self._sxx) if self._sxx > 0 else 0.0

    def get(self, T: int, S: int, K: int | None, work: float | None = None) -> float | None:
        """Seconds of a step of this shape (at `work` pairs; None: at its mean work), at least `MIN_SHARE` of its
        measured mean; None if never measured (or measured at 0 s)."""
        old = self._means.get((T, S, K))
        if old is None:
            return None
        seconds = old[0] if work is None else old[0] + self.seconds_per_pair * (work - old[1])
        # The fitted slope extrapolated to much shorter contexts can reach zero: the weights' pass is still paid.
        seconds = max(seconds, self.MIN_SHARE * old[0])
        return seconds if seconds > 0 else None

    def prior(self, T: int) -> float | None:
        """A guess for a step over token bucket T from the cheapest measured step of each bucket (such as
        prefill chunks): bucket T's own, else interpolated linearly between the nearest measured buckets
        below and above, else the nearest above (a step over more tokens is no cheaper); None if no bucket
        from T up is measured."""
        cheapest: dict[int, float] = {}
        for (t, _, _), (v, _, _) in self._means.items():
            cheapest[t] = min(v, cheapest.get(t, v))
        if T in cheapest:
            return cheapest[T]
        hi = min((t for t in cheapest if t > T), default=None)
        if hi is None:
            return None
        lo = max((t for t in cheapest if t < T), default=None)
        if lo is None:
            return cheapest[hi]
        return cheapest[lo] + (cheapest[hi] - cheapest[lo]) * (T - lo) / (hi - lo)

    def estimate(self, T: int, S: int, K: int | None, work: float, plain_T: int, plain: float,
                 plain_work: float) -> float | None:
        """Seconds of a step of shape (T, S, K) attending `work` pairs, in a batch whose plain step (token
        bucket `plain_T`, measured, `plain_work` pairs) takes `plain`: the shape's measurement at `work`,
        else the plain step plus what the extra tokens' products cost, `prior(T) - prior(plain_T)`, plus
        their attention (what makes this batch's plain step dearer than a bare step of its bucket is
        already in `plain`); None when `prior(T)` is."""
        seconds = self.get(T, S, K, work)
        if seconds is not None:
            return seconds
        cheap_T = self.prior(T)
        if cheap_T is None:
            return None
        return plain + max(0.0, cheap_T - self.prior(plain_T)) + self.seconds_per_pair * max(0.0, work - plain_work)

    def shape(self, num_seqs: int, num_tokens: int) -> tuple[int, int] | None:
        """The (T, S) buckets a step of this many sequences and tokens pads to; None if beyond the largest."""
        if num_tokens > self.token_buckets[-1] or num_seqs > self.seq_buckets[-1]:
            return None
        return step_shape(num_tokens, num_seqs, self.token_buckets, self.seq_buckets)


class DraftRegret:
    """What drafting has really cost each request class against decoding plainly, and the credit that bounds it.

    The cost gate's choice rests on estimates (step costs, acceptance) that can be wrong, and its optimism
    toward held classes (`_Acceptance.relax`) spends steps on drafts that may not pay. This keeps the
    account, per request class and batch bucket S (whether drafting pays depends on the batch: on CPU a
    wide verify costs more at batch 4 than at batch 1). Each decode step is one of the class's arms: drafting
    (its rows drafted, or the step right after, which refills an async pipeline) or plain. Each arm keeps
    its decayed tokens and seconds (the class's share of each step, by rows), so the plain arm measures
    what decoding plainly gives here and now. After a drafting step the class is charged its regret, its
    share of the step's seconds minus what the plain arm takes for the tokens its rows emitted, less
    `MARGIN` (drafting that merely breaks even is noise and host load for nothing), and every
    decode step earns it `budget` of its share; both in plain steps (before the plain arm has `MIN_STEPS`
    steps, the step cost the gate measured prices it). The gate drafts for a class only while its credit is
    positive, so drafting that does not pay costs the class at most `budget` of its decode time (plus one
    step) whatever the estimates got wrong, and drafting that pays more than `MARGIN` is never stopped: its
    regret is negative.
    Credit is capped at `cap` plain steps, so a past gain does not pay for a long losing run; a new class
    starts with `start`.

    Source: conservative exploration (Wu et al. 2016, *Conservative Bandits*: explore only while the
    cumulative reward stays within a fraction of the safe arm's), with plain decoding as the safe arm.
    """

    BUDGET = 0.01
    MARGIN = 0.05  # drafting is charged as if plain decoding were this much faster: a break-even class stops
    CAP = 16.0
    START = 2.0
    DECAY = 0.98  # weight of the past in an arm's sums, per step of the arm
    MIN_STEPS = 8.0  # decayed steps of the plain arm before it prices the regret

    def __init__(self, budget: float = BUDGET, cap: float = CAP, start: float = START):
        self.budget, self.cap, self.start = budget, cap, start
        self._credit: dict[tuple[str, int], float] = {}  # (class, S) -> plain steps
        self._arms: dict[tuple[str, int, bool], list[float]] = {}  # (class, S, drafted) -> [tokens, seconds, steps]
        self._drafted: dict[str, bool] = {}  # class -> whether its rows drafted in its latest decode step
        self.last_drafted: dict[str, bool] = {}  # class -> whether its latest decode step counted as drafting

    def allows(self, request_class: str, S: int) -> bool:
        """Whether the class may draft in a batch of bucket S now (its credit is positive)."""
        return self.credit(request_class, S) > 0

    def credit(self, request_class: str, S: int) -> float:
        return self._credit.get((request_class, S), self.start)

    def observe(self, request_class: str, S: int, drafted: bool, rows: int, num_seqs: int, tokens: int,
                seconds: float, plain: float) -> None:
        """One decode step of `num_seqs` rows took `seconds`; `rows` of them were this class's and emitted
        `tokens`; `drafted`: they drafted; `plain`: the gate's measured seconds of this batch's plain step (the
        price of a plain step until the plain arm has its own)."""
        # The step after a drafting one counts as drafting too: with async scheduling a drafting step runs
        # synchronously, and the next one refills the pipeline (its host work is not hidden).
        drafted, self._drafted[request_class] = drafted or self._drafted.get(request_class, False), drafted
        share = seconds * rows / num_seqs
        off = self._arms.get((request_class, S, False))
        if off is not None and off[2] >= self.MIN_STEPS:
            per_token = off[1] / off[0]
            plain = per_token * num_seqs  # a plain step of this batch, as the plain arm measured it
        else:
            per_token = plain / num_seqs
        key = (request_class, S)
        credit = self.credit(request_class, S) + self.budget * share / plain
        if drafted:
            credit -= (share - (1 - self.MARGIN) * tokens * per_token) / plain
        self._credit[key] = min(self.cap, credit)
        arm = self._arms.setdefault((request_class, S, drafted), [0.0, 0.0, 0.0])
        arm[0] = self.DECAY * arm[0] + tokens
        arm[1] = self.DECAY * arm[1] + share
        arm[2] = self.DECAY * arm[2] + 1
        self.last_drafted[request_class] = drafted

    def tokens_per_second(self) -> dict[tuple[str, bool], float]:
        """(class, drafting) -> the class's tokens per second in its recent decode steps of that arm, over all
        batch buckets."""
        sums: dict[tuple[str, bool], list[float]] = {}
        for (name, _, drafted), (tokens, seconds, _) in self._arms.items():
            total = sums.setdefault((name, drafted), [0.0, 0.0])
            total[0], total[1] = total[0] + tokens, total[1] + seconds
        return {key: t / s for key, (t, s) in sums.items() if s > 0}
