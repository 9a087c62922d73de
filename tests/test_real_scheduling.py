"""Scheduling never changes greedy output, on the real SmolLM2-135M-Instruct.

Each request's tokens are compared with the same request run alone (prefix
cache off): in a batch of 32 with arrivals and departures, with chunked
prefill at chunk sizes 1, 7, 16 and 512, with prefix-cache hits, and after
preemption by recompute or by swap, and with speculative decoding.
"""

import pytest

from checkpoints import load_model
from engine import LLM, SamplingParams
from tests.test_real_model import _chat_prompts

N = 32
POOL = 600  # KV blocks (~440 MB): one pool shape, so these engines share compiled programs


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def prompts(model):
    llm = LLM(model, max_num_seqs=1, num_blocks=POOL)
    return [llm.encode(p) for p in _chat_prompts(N)]


def _params(i):
    return SamplingParams(temperature=0, max_tokens=4 + (7 * i) % 13)  # 4..16 tokens: requests leave at different steps


@pytest.fixture(scope="module")
def alone(model, prompts):
    """Each request alone, prefix cache off."""
    llm = LLM(model, max_num_seqs=1, enable_prefix_caching=False, num_blocks=POOL)
    outs = [llm.generate([p], _params(i))[0] for i, p in enumerate(prompts)]
    assert all(o.num_cached_tokens == 0 for o in outs)
    return [o.token_ids for o in outs]


def _run(llm, prompts, first_wave, params=_params):
    """Submits `first_wave` requests, then two more per step; returns outputs by request index."""
    engine, outs, ids = llm.engine, {}, {}
    pending = list(enumerate(prompts))
    for i, p in pending[:first_wave]:
        ids[engine.add_request(p, params(i)).request_id] = i
    pending = pending[first_wave:]
    while engine.has_unfinished() or pending:
        for i, p in pending[:2]:
            ids[engine.add_request(p, params(i)).request_id] = i
        pending = pending[2:]
        for out in engine.step():
            if out.finished:
                outs[ids[out.request_id]] = out
    return [outs[i] for i in range(len(prompts))]


def test_batch_of_32_with_arrivals_and_prefix_hits_equals_alone(model, prompts, alone):
    llm = LLM(model, max_num_seqs=N, max_num_batched_tokens=512, num_blocks=POOL)
    outs = _run(llm, prompts, first_wave=12)
    assert [o.token_ids for o in outs] == alone
    # The chat template's system prompt is shared: requests added after the first step hit the prefix
    # cache (the first wave and the two added with it arrive before anything is computed).
    assert sum(o.num_cached_tokens > 0 for o in outs) >= N - 14
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_usable_blocks


@pytest.mark.parametrize("chunk", [1, 7, 16, 512])
def test_chunked_prefill_equals_alone(model, prompts, alone, chunk):
    k = 2 if chunk == 1 else 4
    llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=chunk, num_blocks=POOL)
    outs = _run(llm, prompts[:k], first_wave=k)
    assert [o.token_ids for o in outs] == alone[:k]


@pytest.mark.parametrize("swap", [False, True])
def test_preempted_requests_equal_alone(model, prompts, swap):
    # Outputs that outgrow their prompts' blocks, and a pool that holds the longest sequence but not half
    # of them: running requests need blocks the pool no longer has and get preempted. Prefix caching is
    # off (shared system-prompt blocks would make short prompts fit).
    prompts, sp = prompts[:5], SamplingParams(temperature=0, max_tokens=40)
    single = LLM(model, max_num_seqs=1, enable_prefix_caching=False, num_blocks=POOL)
    alone = [single.generate([p], sp)[0].token_ids for p in prompts]
    need = [-(-(len(p) + sp.max_tokens) // 16) for p in prompts]
    blocks = max(max(need), sum(need) // 2) + 1
    llm = LLM(model, num_blocks=blocks + 1, max_num_seqs=4, max_num_batched_tokens=64, kv_watermark=0.0,
              enable_prefix_caching=False, swap_threshold_tokens=1, swap_space_bytes=(1 << 28) * swap)
    outs = _run(llm, prompts, first_wave=5, params=lambda i: sp)
    sch = llm.engine.scheduler
    assert (sch.num_swapped > 0, sch.num_recomputed > 0) == (swap, not swap)
    assert [o.token_ids for o in outs] == alone


@pytest.fixture(scope="module")
def early_exit(model):
    from checkpoints.draft import early_exit_draft

    return early_exit_draft(model, [0, 1, 2, 3])


@pytest.mark.parametrize("batch", [8, 1])
def test_speculative_greedy_equals_alone(model, prompts, alone, early_exit, batch):
    # Exactness on the real model: an untrained early-exit draft (the target's first 4 layers) agrees
    # on some tokens and not others, so verify both accepts and rejects. Chunked prefill (32-token
    # budget) and prefix caching on; adaptation off so every decode step speculates.
    n = 16 if batch > 1 else 20
    llm = LLM(model, speculative="draft", draft_model=early_exit, num_speculative_tokens=3, max_num_seqs=batch,
              max_num_batched_tokens=32, num_blocks=POOL)
    llm.engine.proposer.config.min_acceptance = 0.0
    outs = _run(llm, prompts[:n], first_wave=batch)
    assert [o.token_ids for o in outs] == alone[:n]
    assert sum(o.num_cached_tokens > 0 for o in outs) >= n - batch - 2  # the shared system prompt hit the cache
    rates = [o.acceptance_rate for o in outs if o.num_draft_tokens]
    assert len(rates) >= n - 2 and 0 < sum(o.num_accepted_tokens for o in outs) < sum(
        o.num_draft_tokens for o in outs)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_usable_blocks
