"""Input processing in one place: prompts to token ids, and the checks on token ids.

Every entry point (`LLM`, the gRPC server, the engine, scoring) goes through
these, so a prompt is encoded and a token id is refused the same way
everywhere.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

from scheduler.request import InvalidRequestError

# A prompt is text, token ids, or a chat conversation (list of {"role", "content"}).
Prompt = Union[str, Sequence[int], Sequence[dict]]


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt; chat conversations go through the model's chat template.

    Token ids are returned as given (checked later by `check_token_ids`).
    Raises:
      InvalidRequestError: not a string, a list of ints or a list of chat
        messages with string `role` and `content`.
      ValueError, jinja2.TemplateError: from the chat template (no template,
        or the template refused the messages).
    """
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1 and np.issubdtype(prompt.dtype, np.integer):
        return prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise InvalidRequestError(
            f"a prompt must be a string, a list of token ids or a list of chat messages, got {type(prompt).__name__}")
    prompt = [int(t) if isinstance(t, np.integer) else t for t in prompt]
    if prompt and all(isinstance(m, dict) for m in prompt):
        for m in prompt:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"chat messages need string 'role' and 'content': {m!r}")
        return tokenizer.encode(tokenizer.apply_chat_template(prompt, add_generation_prompt=True))
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise InvalidRequestError("a prompt must be a string, a list of token ids or a list of chat messages")


def check_token_ids(token_ids: Sequence, vocab_size: int, what: str = "prompt token ids") -> list[int]:
    """Returns `token_ids` as Python ints; raises InvalidRequestError if one is not an integer in [0, V)."""
    bad = [t for t in token_ids
           if not (isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < vocab_size)]
    if bad:
        raise InvalidRequestError(f"{what} must be in [0, {vocab_size}); got {bad[:5]}")
    return [int(t) for t in token_ids]
