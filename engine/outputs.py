"""What the engine hands back per request: `RequestOutput`, and the incremental detokenizer behind its text."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestOutput:
    """A request's state after a step: the full text so far and what is new.

    A request with `n > 1` samples gives one output stream per sample (`index`).
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    # With SamplingParams.logprobs set: one entry per token of `token_ids`,
    # {token id: log-probability} for the top `logprobs` tokens (most likely
    # first) and the generated token (last, if not among them).
    logprobs: list[dict[int, float]] | None = None
    index: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # Speculative decoding (zero without a draft): draft tokens proposed and
    # accepted, and target steps that emitted tokens (decode or verify).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None if nothing was proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per target step that emitted any (1.0 without speculation)."""
        return len(self.token_ids) / max(self.num_target_steps, 1)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Detokenizer:
    """Incremental text of one request; holds back incomplete UTF-8 and possible stop-string prefixes."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self.emitted = 0

    def update(self, token_ids: list[int]) -> bool:
        """Re-decodes the output; returns True if a stop string now ends it (text truncated there)."""
        text = self.tokenizer.decode(token_ids)
        searched_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text = text
        hits = [i for i in (text.find(s, searched_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = text[:min(hits)]
            return True
        return False

    def delta(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                end -= 1
            end -= max((len(s) for s in self.stop), default=1) - 1
        end = max(end, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
