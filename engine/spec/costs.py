"""What steps cost: measured seconds per step shape (`StepCosts`) and drafting's real cost per class
(`DraftRegret`), which the cost gate (`engine.spec.gate.Gate`) prices its choices with."""

from __future__ import annotations

from scheduler.packing import step_shape


def attention_pairs(start: int, num_tokens: int) -> int:
    """(query, key) pairs a row attends under the causal mask: `num_tokens` queries at positions
    `start`, ..., `start + num_tokens - 1`, each over the keys up to itself."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepCosts:
    """Measured seconds of an engine step by its shape and attention work, as running averages.

    A shape is (token bucket T, sequence bucket S, program G), G as in
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

    def observe(self, T: int, S: int, G: int | None, seconds: float, work: float = 0.0) -> None:
        """One step of shape (T, S, G) took `seconds` and attended `work` (query, key) pairs."""
        key = (T, S, G)
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

    def get(self, T: int, S: int, G: int | None, work: float | None = None) -> float | None:
        """Seconds of a step of this shape (at `work` pairs; None: at its mean work), at least `MIN_SHARE` of its
        measured mean; None if never measured (or measured at 0 s)."""
        old = self._means.get((T, S, G))
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

    def estimate(self, T: int, S: int, G: int | None, work: float, plain_T: int, plain: float,
                 plain_work: float) -> float | None:
        """Seconds of a step of shape (T, S, G) attending `work` pairs, in a batch whose plain step (token
        bucket `plain_T`, measured, `plain_work` pairs) takes `plain`: the shape's measurement at `work`,
        else the plain step plus what the extra tokens' products cost, `prior(T) - prior(plain_T)`, plus
        their attention (what makes this batch's plain step dearer than a bare step of its bucket is
        already in `plain`); None when `prior(T)` is."""
        seconds = self.get(T, S, G, work)
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
