"""Speculative decoding in the engine, on tiny random-weight target and draft models.

Exactness is checked three ways: greedy output equals the target's alone;
the joint distribution of the first three sampled tokens equals the target's
exact distribution (chi-square, with its power stated); finishing inside an
accepted run stops where the plain run stops.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import LoadedModel, Tokenizer
from checkpoints.resolve import random_params
from engine import Engine, EngineConfig
from engine.sampler import filter_logits
from engine.spec.acceptance import AdaptiveSpeculation
from engine.spec.config import SpeculationConfig
from model.config import get_preset
from model.llama import Llama
from scheduler.request import InvalidRequestError, SamplingParams
from tests import chi2


def _model(vocab_size=256, seed=0, scale=1.0):
    cfg = get_preset("tiny-llama").replace(vocab_size=vocab_size)
    params = {k: v if k.endswith("norm") else v * scale for k, v in random_params(cfg, seed).items()}
    return LoadedModel(cfg, params, Tokenizer.byte_level(256, eos_token_ids=cfg.eos_token_ids))


def _perturbed(model, noise, seed=1):
    rng = np.random.default_rng(seed)
    return dataclasses.replace(model, params={
        k: v if k.endswith("norm") else v + noise * np.std(v) * rng.standard_normal(v.shape).astype(v.dtype)
        for k, v in model.params.items()})


def _run(engine, prompts, params):
    ids = {engine.add_request(p, sp).request_id: i for i, (p, sp) in enumerate(zip(prompts, params))}
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out
    return [done[i] for i in range(len(prompts))]


PROMPTS = [list(range(3, 3 + n)) for n in (1, 15, 16, 17, 33, 70)]
CFG = EngineConfig(num_blocks=96, block_size=16, max_num_seqs=4, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def target():
    return _model(scale=4.0)  # larger weights: peaked, input-dependent distributions


@pytest.fixture(scope="module")
def plain(target):
    return Engine(target, CFG)


@pytest.fixture(scope="module")
def spec(target):
    # A noisy copy of the target: it agrees often but not always.
    return Engine(target, CFG, draft=_perturbed(target, 0.1), speculation=SpeculationConfig(3, min_acceptance=0.0))


def test_greedy_equals_target_alone_with_chunks_and_prefix_cache(plain, spec):
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    want = [o.token_ids for o in _run(plain, PROMPTS, greedy)]
    for _ in range(2):  # the second round hits the prefix cache
        outs = _run(spec, PROMPTS, greedy)
        assert [o.token_ids for o in outs] == want
    rates = [o.acceptance_rate for o in outs]
    assert all(0 < r < 1 for r in rates), rates  # both outcomes of the verify happen
    assert all(1 < o.tokens_per_step <= 4 for o in outs)
    assert outs[-1].num_cached_tokens == 64
    assert spec.blocks.num_free_blocks == spec.blocks.num_usable_blocks


def test_mixed_batch_with_and_without_speculation(plain, spec):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [dataclasses.replace(greedy, num_speculative_tokens=k) for k in (0, 1, 2, 3, None, 0)]
    outs = _run(spec, PROMPTS, params)
    want = _run(plain, PROMPTS, [greedy] * len(PROMPTS))
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert [o.num_draft_tokens == 0 for o in outs] == [True, False, False, False, False, True]
    with pytest.raises(InvalidRequestError, match="exceeds the engine's 3"):
        spec.add_request([5], dataclasses.replace(greedy, num_speculative_tokens=4))
    with pytest.raises(InvalidRequestError, match="no proposer"):
        plain.add_request([5], dataclasses.replace(greedy, num_speculative_tokens=2))


def test_finishing_inside_an_accepted_run_matches_the_plain_run(target):
    # The target as its own draft accepts everything: each verify emits K + 1 = 4 tokens.
    same = Engine(target, CFG, draft=target, speculation=SpeculationConfig(3))
    plain = Engine(target, CFG)
    prompt = PROMPTS[3]
    free = _run(plain, [prompt], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])[0]
    stop_token = free.token_ids[6]  # emitted inside the second verify run (tokens 5-8)
    cases = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),  # max_tokens < K + 1
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[free.text[5:8]]),  # spans tokens
    ]
    for sp in cases:
        want, got = _run(plain, [prompt], [sp])[0], _run(same, [prompt], [sp])[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert got.acceptance_rate in (None, 1.0)
    assert len(_run(same, [prompt], [cases[2]])[0].token_ids) == 6
    assert same.blocks.num_free_blocks == same.blocks.num_usable_blocks
    stats = same.stats
    assert stats.position_acceptance == [1.0, 1.0, 1.0] and stats.acceptance_rate == 1.0
    assert stats.acceptance_length == 1 + stats.num_draft_tokens / stats.num_verifies


# The chi-square tests of sampled output (here and in the other proposers' tests) use a vocabulary of 4: the
# first three tokens' joint has 64 cells, which 8000 samples per setting test with power >= 0.9 against any
# total-variation error of 0.05 (asserted per setting, tests/chi2.py); a vocabulary of 8 (512 cells) would need
# ~10x the samples. The settings: temperature 1, and the filters (temperature, top-p, min-p) that change it.
VOCAB = 4
SETTINGS = {"t1": SamplingParams(temperature=1.0), "t0.7-top_p0.9": SamplingParams(temperature=0.7, top_p=0.9),
            "min_p0.2": SamplingParams(temperature=1.0, min_p=0.2)}
SAMPLES = 8000


def _exact_joint(model, prompt, sp, n=3):
    """The target's exact distribution of its first `n` sampled tokens, `[V] * n`, after filtering: one dense
    forward of the prompt followed by every (n-1)-token continuation gives each prefix's next-token logits."""
    V = model.config.vocab_size
    heads = np.asarray(list(itertools.product(range(V), repeat=n - 1)), np.int32).reshape(-1, n - 1)
    ids = np.concatenate([np.tile(np.asarray(prompt, np.int32), (len(heads), 1)), heads], axis=1)
    logits = Llama(model.config, params=model.params).dense_logits(jnp.asarray(ids))[:, len(prompt) - 1:]
    rep = lambda x, dtype: jnp.full(logits.shape[0] * n, x, dtype)  # noqa: E731
    filtered = filter_logits(logits.reshape(-1, V), rep(sp.temperature, jnp.float32), rep(sp.top_k, jnp.int32),
                             rep(sp.top_p, jnp.float32), rep(sp.min_p, jnp.float32))
    probs = np.asarray(jax.nn.softmax(filtered), np.float64).reshape(len(heads), n, V)
    along = np.prod(np.take_along_axis(probs[:, :n - 1], heads[:, :, None], axis=2)[:, :, 0], axis=1)
    return (along[:, None] * probs[:, n - 1]).reshape((V,) * n)


def _first_three_tokens(engine, prompt, settings, N, max_tokens=3):
    """Runs N seeded requests of `prompt` per setting (name -> SamplingParams), all in one stream (settings
    share batches; seeds differ), `max_tokens` each. Returns name -> (counts `[VOCAB] * 3` of the first three
    tokens, draft tokens proposed, accepted)."""
    names = [name for name in settings for _ in range(N)]
    outs = _run(engine, [prompt] * len(names), [dataclasses.replace(settings[name], seed=i, max_tokens=max_tokens,
                                                                    ignore_eos=True) for i, name in enumerate(names)])
    got = {}
    for name in settings:
        mine = [o for o, n in zip(outs, names) if n == name]
        counts = np.zeros((VOCAB,) * 3)
        for o in mine:
            assert len(o.token_ids) == max_tokens, o
            counts[tuple(o.token_ids[:3])] += 1
        got[name] = counts, sum(o.num_draft_tokens for o in mine), sum(o.num_accepted_tokens for o in mine)
    return got


def _assert_follows_the_target(counts, target, prompt, sp):
    """Chi-square of the first three tokens' `counts` against the target's exact joint under `sp`, with the
    test's power against a total-variation error of 0.05 asserted; a filtered setting's joint must also lie
    farther than that from the unfiltered one (so a sampler that skipped the filter is caught)."""
    exact = _exact_joint(target, prompt, sp)
    cells = chi2.Cells(exact, int(counts.sum()))
    assert cells.power >= chi2.POWER, cells
    assert cells.pvalue(counts) > chi2.ALPHA, cells
    if sp != SamplingParams(temperature=1.0):
        unfiltered = _exact_joint(target, prompt, SamplingParams(temperature=1.0))
        assert 0.5 * np.abs(exact - unfiltered).sum() > chi2.TV
    return cells


def test_first_three_tokens_follow_the_target_exactly():
    """An unrelated draft (many rejections, residual draws), K = 2: each setting's first three tokens (one
    verify window and the bonus) follow the target's exact joint."""
    target = _model(vocab_size=VOCAB, seed=0, scale=8.0)
    draft = _model(vocab_size=VOCAB, seed=1, scale=8.0)
    engine = Engine(target, EngineConfig(num_blocks=300, block_size=4, max_num_seqs=64,
                                         max_num_batched_tokens=256),
                    draft=draft, speculation=SpeculationConfig(2, min_acceptance=0.0))
    prompt = [1, 2, 3]
    for name, (counts, drafted, accepted) in _first_three_tokens(engine, prompt, SETTINGS, SAMPLES).items():
        assert drafted >= SAMPLES and 0.1 < accepted / drafted < 0.9, name  # verify accepted and rejected many
        _assert_follows_the_target(counts, target, prompt, SETTINGS[name])


def test_adaptive_speculation_halves_k_per_class_and_retries_with_backoff():
    ctl = AdaptiveSpeculation(SpeculationConfig(4, min_acceptance=0.5, ema_decay=0.5, retry_after_steps=10))
    assert ctl.config.ladder == (1, 2, 4) and SpeculationConfig(3).ladder == (1, 3)
    ks = []
    for step in range(1, 4):  # nothing accepted: rate (accepted / tried, halved each verify) 1/3, 1/7, 1/15
        ctl.update(f"a{step}", "code", ctl.k_for(f"a{step}", "code", None, step), 0, step)
        ks.append(ctl.class_k("code"))
    assert ks == [2, 1, 0]
    assert ctl.k_for("b", "chat", None, step=5) == 4  # other classes keep speculating
    assert ctl.k_for("c", "code", None, step=12) == 0
    assert ctl.k_for("c", "code", None, step=13) == 1  # retried at K = 1, retry_after_steps after switching off
    assert ctl.k_for("d", "code", 2, step=14) == 1  # a request's own cap does not raise it
    ctl.update("c", "code", 1, 0, step=15)  # the retry starts from the prior (1 of 1) and fails: 1/3, off again
    ctl.update("c", "code", 1, 0, step=16)
    assert ctl.class_k("code") == 0  # and the next wait doubles
    assert ctl.k_for("e", "code", None, step=15 + 19) == 0 and ctl.k_for("e", "code", None, step=15 + 20) == 1
    ks = []
    for step in range(37, 45):  # all accepted: K climbs the ladder every 4 verify steps
        ctl.update("e", "code", ctl.k_for("e", "code", None, step), 1, step)
        ks.append(ctl.class_k("code"))
    assert ks == [1, 1, 1, 2, 2, 2, 2, 4]
    # The rate counts tried tokens (up to the first rejection): 2 accepted of 4 drafted -> 2 of 3, on the
    # prior of 1 of 1 halved.
    ctl.update("f", "chat", 4, 2, step=50)
    assert ctl.request_rate("f") == pytest.approx((0.5 + 2) / (0.5 + 3))


def test_default_rates_ride_out_a_run_of_misses_but_not_a_proposal_that_never_accepts():
    """With the defaults (min_acceptance 0.1, ema_decay 0.9), a class that has accepted half its tried tokens
    keeps K through 15 verifies in a row that accept nothing, and a request arriving then starts from the
    class's rate; a class that never accepts is off after 7 verifies."""
    ctl = AdaptiveSpeculation(SpeculationConfig(4))
    for step in range(100):  # alpha 0.5: every verify accepts 1 of 4, trying 2
        ctl.update("old", "code", ctl.k_for("old", "code", None, step), 1, step)
    assert ctl.class_k("code") == 4 and ctl.request_rate("old") == pytest.approx(0.5, abs=0.01)
    for step in range(100, 115):
        ctl.update("old", "code", ctl.k_for("old", "code", None, step), 0, step)
    assert ctl.class_k("code") == 4 and ctl.k_for("old", "code", None, 115) == 4
    ctl.update("new", "code", ctl.k_for("new", "code", None, 115), 0, 115)
    # Its own rate is the class's (it started from it, and both saw the same verify), not 1/3 from the prior.
    assert ctl.request_rate("new") == pytest.approx(ctl.classes["code"].rate) and ctl.request_rate("new") > 0.15
    assert ctl.k_for("new", "code", None, 116) == 4
    ks = []
    for step in range(8):
        ctl.update(f"n{step}", "never", ctl.k_for(f"n{step}", "never", None, step), 0, step)
        ks.append(ctl.class_k("never"))
    assert ks == [4] * 6 + [2, 1]


def test_seeded_requests_adapt_on_their_own_history_only():
    ctl = AdaptiveSpeculation(SpeculationConfig(4, min_acceptance=0.5, ema_decay=0.5))
    for step in range(4):
        ctl.update(f"u{step}", "chat", 4, 0, step)
    assert ctl.class_k("chat") == 0
    assert ctl.k_for("s", "chat", None, step=5, seeded=True) == 4  # the class being off does not matter
    for step in range(6, 10):
        ctl.update("s", "chat", ctl.k_for("s", "chat", None, step, seeded=True), 0, step)
    assert ctl.k_for("s", "chat", None, step=10**6, seeded=True) == 0  # off for the rest of the request


def test_bad_draft_is_switched_off_and_then_skipped(target, plain):
    unrelated = _model(seed=7, scale=4.0)
    engine = Engine(target, CFG, draft=unrelated, speculation=SpeculationConfig(4, retry_after_steps=10**6))
    engine.gate.costs = None  # the policy's floor alone: the cost gate's choices depend on measured timings
    ks = []
    engine.on_step = lambda timing: ks.append(timing.spec_k)
    greedy = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3
    outs = _run(engine, PROMPTS[:3], greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _run(plain, PROMPTS[:3], greedy)]
    assert engine.gate.policy.class_k("default") == 0
    assert all(o.num_draft_tokens < 4 * 4 for o in outs)  # off after a few verify steps
    assert 4 in ks and set(ks) <= {None, 0, 1, 2, 4}  # K = 4 was tried, then halved
    # Once off, steps run the target alone (the draft is skipped) and the requests stay off.
    assert ks[-10:] == [None] * 10 and ks.count(None) > len(ks) // 2
    ks.clear()
    later = _run(engine, PROMPTS[3:4], greedy[:1])[0]
    assert later.num_draft_tokens == 0 and set(ks) == {None}


def test_seeded_sampling_with_speculation_is_reproducible_and_batch_independent(spec):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=16, ignore_eos=True)
    alone = _run(spec, [PROMPTS[2]], [sp])[0]
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(3)]
    mixed = _run(spec, [PROMPTS[4], PROMPTS[2], PROMPTS[1], PROMPTS[5]], [others[0], sp, others[1], others[2]])
    assert mixed[1].token_ids == alone.token_ids and alone.num_draft_tokens > 0


def test_logprobs_with_speculation_match_the_plain_engine(plain, spec):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    want, got = _run(plain, PROMPTS[1:3], [sp] * 2), _run(spec, PROMPTS[1:3], [sp] * 2)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.num_accepted_tokens > 0
        assert len(g.logprobs) == len(w.logprobs) == 10
        for a, b in zip(g.logprobs, w.logprobs):
            assert list(a) == list(b) and np.allclose(list(a.values()), list(b.values()), atol=1e-4)


def test_samples_of_an_n_request_keep_its_class(spec):
    sp = SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=8, ignore_eos=True)
    spec.add_request(PROMPTS[1], sp, request_class="n-class")
    while spec.has_unfinished():
        spec.step()
    assert spec.gate.policy.classes["n-class"].good > 0  # the samples' verify steps were counted for the class
