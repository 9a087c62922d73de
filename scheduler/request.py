"""Requests, their sampling parameters and their state machine (host only)."""

from __future__ import annotations

import dataclasses
import enum
import itertools

MAX_LOGPROBS = 20  # most top tokens a request may ask log-probabilities for (a static size on device)
INT32_MAX = 2**31 - 1  # integers the device holds are int32: larger ones are refused, never wrapped
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message says which field and why."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names and defaults).

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 disables.
    top_p: keep the smallest set whose probability reaches top_p; 1 disables.
    min_p: drop tokens below min_p times the most likely token's probability.
    seed: makes sampling reproducible and independent of the batch; None
      draws one at random.
    max_tokens: upper bound on generated tokens.
    stop: strings that end generation; the matched string is not returned.
    stop_token_ids: token ids that end generation (besides the model's EOS).
    ignore_eos: keep generating past EOS (benchmarks).
    n: independent samples of the prompt; they share the prompt's KV blocks
      (copy-on-write) and sample `i` uses seed `seed + i` (mod 2**32).
    num_speculative_tokens: draft tokens per verify step for this request:
      None takes the engine's (adaptive) choice, 0 turns speculation off, k
      caps it at k. Output follows the same distribution either way.
    num_tree_nodes: with an engine that verifies token trees, at most this
      many tree nodes per verify step for this request (>= 1; None: the
      engine's tree).
    logprobs: for every generated token, also return its log-probability and
      those of the `logprobs` most likely tokens (0 to MAX_LOGPROBS); None
      returns none. They come from the model's raw distribution, before
      temperature and truncation (vLLM's convention).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    num_speculative_tokens: int | None = None
    num_tree_nodes: int | None = None
    logprobs: int | None = None

    def __post_init__(self):
        # A lone string is one stop string, not a sequence of characters.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))

    def validate(self) -> None:
        """Raises InvalidRequestError naming the first bad field."""
        t = self.temperature
        if not (_is_number(t) and (t == 0 or FLOAT32_TINY <= t <= FLOAT32_MAX)):
            raise InvalidRequestError(f"temperature must be 0 or a normal float32 (in [{FLOAT32_TINY:.4g}, "
                                      f"{FLOAT32_MAX:.4g}]), got {t!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise InvalidRequestError(f"top_k must be an integer in [0, 2**31) (0 disables), got {self.top_k!r}")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise InvalidRequestError(f"max_tokens must be an integer in [1, 2**31), got {self.max_tokens!r}")
        if not _is_int(self.n) or not 1 <= self.n <= 256:
            raise InvalidRequestError(f"n must be an integer in [1, 256], got {self.n!r}")
        k = self.num_speculative_tokens
        if k is not None and not (_is_int(k) and k >= 0):
            raise InvalidRequestError(f"num_speculative_tokens must be an integer >= 0 or None, got {k!r}")
        nodes = self.num_tree_nodes
        if nodes is not None and not (_is_int(nodes) and nodes >= 1):
            raise InvalidRequestError(f"num_tree_nodes must be an integer >= 1 or None, got {nodes!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**32):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {self.stop[:5]!r}")
        if any(not _is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be integers in [0, 2**31), got {self.stop_token_ids[:5]!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV copied to host memory
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"


_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request (one sequence) as the scheduler tracks it.

    `num_computed_tokens` counts tokens whose KV is in the pool; the request
    needs a step for the rest (`num_tokens - num_computed_tokens`): its whole
    prompt at first (possibly in chunks; less what the prefix cache holds),
    then one token per decode step.

    A request with `sampling.n > 1` is a parent: it prefills all but its last
    prompt token, then forks into `n` child requests (`index` 0..n-1) that
    share its blocks and each compute the last prompt token and sample.
    """

    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    request_id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    priority: int = 0  # lower runs first
    arrival: int = dataclasses.field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    allocation: object = None  # the block manager's opaque handle
    cache_salt: str | None = None  # requests share cached KV only with the same salt
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    parent: Request | None = None  # set on the children of an n > 1 request
    index: int = 0  # sample index among the parent's children
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # proposed by the draft, over the request's life
    num_accepted_tokens: int = 0
    num_target_steps: int = 0  # steps that emitted tokens for this request
    request_class: str = "default"  # acceptance rates are tracked per class
    # Tokens that dispatched steps sample, not yet on the host (async scheduling: up to 2, the step being read
    # back and the one dispatched ahead of it); counted in `num_tokens`.
    num_pending_tokens: int = 0

    @property
    def is_parent(self) -> bool:
        """An n > 1 request that has not forked yet (it never samples itself)."""
        return self.parent is None and self.sampling.n > 1

    @property
    def num_schedulable_tokens(self) -> int:
        """Tokens to compute: all of them, or all but the last prompt token for a parent."""
        return self.num_tokens - 1 if self.is_parent else self.num_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens `start:end` of prompt + output, without concatenating the two lists."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - n)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens on the host (`num_tokens` less the pending ones)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Records a sampled token; returns the finish reason it causes, if any."""
        self.output_token_ids.append(token_id)
        sp = self.sampling
        if not sp.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in sp.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= sp.max_tokens or self.num_known_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
