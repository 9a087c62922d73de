"""The tests' prompts (tests/data/prompts.jsonl, written for them): the same inputs on every machine."""

import json
import os

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prompts.jsonl")


def prompts(domain: str | None = None) -> list[str]:
    """The prompt texts of `domain` ("chat", "code", "math", "summarization", "creative"; None: all) in file order."""
    with open(_PATH) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["prompt"] for r in rows if domain is None or r["domain"] == domain]


def chat_messages(n: int) -> list[list[dict]]:
    """The first `n` chat prompts as single user messages. Raises ValueError if there are fewer than n."""
    texts = prompts("chat")
    if n > len(texts):
        raise ValueError(f"{n} chat prompts wanted, tests/data/prompts.jsonl has {len(texts)}")
    return [[{"role": "user", "content": t}] for t in texts[:n]]
