"""Logprobs on every path that emits tokens, on a tiny random-weight target: each proposer (a draft model's
chain, EAGLE chains and EAGLE-2 trees, Medusa chains and trees, n-gram chains and trees, suffix trees), greedy
and seeded sampling, and preemption by swap and by recompute. Every entry is checked against a float64
log-softmax of the dense forward (tolerance 1e-4: float32 sums over at most 256 terms in another order) and
against the plain engine; every output's logprobs have one entry per token."""

import dataclasses
import functools

import numpy as np
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.spec.config import SpeculationConfig
from tests.test_eagle import _head, _target
from tests.test_logprobs_score import dense_log_softmax
from tests.test_medusa import _heads
from tests.test_speculative import _perturbed, _run

TOL = 1e-4
NEW_TOKENS = 16
# Repetitive prompts (n-gram and suffix proposals find matches), one over the token budget (chunked prefill).
PROMPTS = [[3, 4, 5, 6] * 4, list(range(3, 20)) * 2, [9, 10, 11] * 12 + [9, 10], list(range(3, 40)) + list(range(3, 10))]
PARAMS = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3),
          SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)]
# Synchronous steps: with async scheduling a step the cost gate gives no drafts runs ahead plainly.
CFG = EngineConfig(num_blocks=96, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=False)

EAGLE = SpeculationConfig(3, min_acceptance=0.0, method="eagle")
MEDUSA = SpeculationConfig(3, min_acceptance=0.0, method="medusa")
NGRAM = SpeculationConfig(3, min_acceptance=0.0, method="ngram")
PROPOSERS = {  # name: (the proposer's weights from the target, or None; its speculation)
    "draft": (lambda t: _perturbed(t, 0.1), SpeculationConfig(3, min_acceptance=0.0)),
    "eagle-chain": (lambda t: _head(t, noise=0.03, feature_mix=0.01), EAGLE),
    "eagle-tree": (lambda t: _head(t, noise=0.03, feature_mix=0.01),
                   dataclasses.replace(EAGLE, tree_nodes=8, tree_branching=3)),
    "medusa-chain": (lambda t: _heads(t, 0.03), MEDUSA),
    "medusa-tree": (lambda t: _heads(t, 0.03), dataclasses.replace(MEDUSA, tree_nodes=8)),
    "ngram-chain": (None, NGRAM),
    "ngram-tree": (None, dataclasses.replace(NGRAM, tree_nodes=8)),
    "suffix": (None, SpeculationConfig(8, min_acceptance=0.0, method="suffix", tree_nodes=8)),
}
# Chains drafted by sampling a distribution (a draft model's, an EAGLE head's), verified by rejection sampling: a
# seeded row's tokens depend on where its windows start (a draft slot's token is the accepted proposal, a
# window's last slot the target's own draw), which preemption and the token budget move. Equal in distribution
# only (the chi-square tests); every other proposal is verified coupled to the target's own seeded draws.
REJECTION_SAMPLED = ("draft", "eagle-chain")


def _engine(target, proposer: str | None, config: EngineConfig = CFG) -> Engine:
    if proposer is None:
        return Engine(target, config)
    draft, speculation = PROPOSERS[proposer]
    return Engine(target, config, draft=draft(target) if draft else None, speculation=speculation)


@pytest.fixture(scope="module")
def target():
    return _target()  # one layer (an EAGLE head made of it accepts often), peaked, input-dependent distributions


@pytest.fixture(scope="module")
def plain(target):
    engine = Engine(target, CFG)
    return engine, _run(engine, PROMPTS, PARAMS)


@pytest.fixture(scope="module")
def dense(plain):
    """`dense(ids)`: float64 `[len(ids), V]` log-softmax of the unpaged forward at every position of `ids`."""
    return functools.partial(dense_log_softmax, plain[0])


def _check(outs, want, dense) -> None:
    """`outs` (an engine's outputs for `PROMPTS` x `PARAMS`) against the dense forward and the plain engine's
    outputs `want`: one logprobs entry per token, the top `logprobs` ids most likely first plus the emitted
    token, values within `TOL`; greedy rows equal the plain engine's tokens and entries."""
    for prompt, sp, out, ref in zip(PROMPTS, PARAMS, outs, want):
        assert len(out.token_ids) == NEW_TOKENS
        if sp.logprobs is None:
            assert out.logprobs is None
            continue
        assert len(out.logprobs) == NEW_TOKENS
        rows = dense(prompt + out.token_ids)[len(prompt) - 1:-1]
        for token, entry, row in zip(out.token_ids, out.logprobs, rows):
            ids = list(entry)
            assert ids[:sp.logprobs] == np.argsort(-row, kind="stable")[:sp.logprobs].tolist()
            assert token in entry and len(ids) == sp.logprobs + (token not in ids[:sp.logprobs])
            np.testing.assert_allclose([entry[t] for t in ids], row[ids], atol=TOL, rtol=0)
        if sp.temperature == 0:
            assert out.token_ids == ref.token_ids
            for a, b in zip(out.logprobs, ref.logprobs):
                assert list(a) == list(b)
                np.testing.assert_allclose(list(a.values()), list(b.values()), atol=TOL, rtol=0)


def test_the_plain_engine_equals_the_dense_forward(plain, dense):
    _check(plain[1], plain[1], dense)


@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_every_proposer_reports_the_targets_logprobs(target, plain, dense, proposer):
    engine = _engine(target, proposer)
    outs = _run(engine, PROMPTS, PARAMS)
    assert 0 < sum(o.num_accepted_tokens for o in outs) < sum(o.num_draft_tokens for o in outs)
    _check(outs, plain[1], dense)
    if proposer not in REJECTION_SAMPLED:
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain[1]]


@pytest.mark.parametrize("proposer", [None, "draft", "eagle-tree", "ngram-chain"])
@pytest.mark.parametrize("swap", [True, False], ids=["swap", "recompute"])
def test_preemption_keeps_tokens_and_logprobs(target, dense, proposer, swap):
    """9 usable blocks of 8 tokens for four requests: requests are preempted, by swap (every preempted
    sequence, threshold 1 token) or by recompute (no swap space); tokens and logprobs equal a roomy engine's."""
    small = dataclasses.replace(CFG, num_blocks=10, block_size=8, max_num_batched_tokens=16, kv_watermark=0.0,
                                swap_space_bytes=(1 << 20) * swap, swap_threshold_tokens=1)
    engine = _engine(target, proposer, small)
    outs = _run(engine, PROMPTS, PARAMS)
    sch = engine.scheduler
    assert (sch.num_swapped > 0, sch.num_recomputed > 0) == (swap, not swap)
    roomy = _run(_engine(target, proposer), PROMPTS, PARAMS)
    _check(outs, roomy, dense)
    for sp, o, r in zip(PARAMS, outs, roomy):
        if sp.temperature > 0 and proposer in REJECTION_SAMPLED:
            continue
        assert o.token_ids == r.token_ids
        for a, b in zip(o.logprobs or [], r.logprobs or []):
            assert list(a) == list(b)
            np.testing.assert_allclose(list(a.values()), list(b.values()), atol=TOL, rtol=0)
    assert engine.blocks.num_free_blocks == 9 and sch.swap_used_blocks == 0
