"""Speculative decoding on the real SmolLM2-135M-Instruct with its bundled distilled draft.

Greedy output with speculation is token-identical to greedy output without
it, on 24 real prompts (chat, code, math), at batch 1 and batch 8, with
chunked prefill (64-token budget) and the prefix cache on.
"""

import pytest

from checkpoints import load_model
from checkpoints.draft import DEFAULT_DRAFT, load_draft
from engine import LLM, SamplingParams
from tests.test_real_model import ROOT

N = 24


def _prompts(llm):
    import json
    import os

    texts = []
    for domain in ("chat", "code", "math"):
        path = os.path.join(ROOT, "..", "shared", "data", "prompts", f"{domain}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                texts += [json.loads(line)["prompt"] for line in f][-N // 3:]  # the files' last prompts
    texts = texts or [f"Count from {i} to {i + 5}." for i in range(N)]
    return [llm.encode([{"role": "user", "content": t}]) for t in texts[:N]]


@pytest.fixture(scope="module")
def engines():
    target = load_model()
    draft = load_draft(DEFAULT_DRAFT, target)
    args = dict(max_num_seqs=8, max_num_batched_tokens=64)
    return LLM(target, speculative=None, **args), LLM(target, speculative="draft", draft_model=draft, **args)


def test_speculative_greedy_equals_plain_greedy(engines):
    plain, spec = engines
    prompts = _prompts(plain)
    sp = SamplingParams(temperature=0, max_tokens=24)
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    alone = [spec.generate([p], sp)[0] for p in prompts[:6]]  # batch 1
    assert [o.token_ids for o in alone] == want[:6]
    batched = spec.generate(prompts, sp)  # batch 8, prefix cache warm from the runs above
    assert [o.token_ids for o in batched] == want
    assert sum(o.num_cached_tokens for o in batched) > 0
    drafted = sum(o.num_draft_tokens for o in batched)
    accepted = sum(o.num_accepted_tokens for o in batched)
    assert drafted > 0 and accepted / drafted > 0.3, accepted / drafted
    blocks = spec.engine.blocks
    assert blocks.num_free_blocks == blocks.num_usable_blocks
