"""The EAGLE head as a proposer (`engine.spec.eagle.EagleProposer`), on tiny random-weight models.

A head built from a one-layer target's own layer, reading the token embedding
and ignoring the features (fc = [I; 0]), predicts the target's hidden state
exactly, so it accepts every draft token: that checks the head's KV and the
draft passes. Perturbed heads that also read the features give partial
acceptance, for greedy equality, the chi-square tests and the pool contents.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import LoadedModel, Tokenizer
from checkpoints.draft import early_exit_draft, load_draft, save_draft
from checkpoints.resolve import random_params
from engine import Engine, EngineConfig
from engine.spec.config import SpeculationConfig
from model.config import get_preset
from model.eagle import FC, EagleHead, deepen
from model.llama import Llama
from model.ops import dense_attention
from scheduler.request import InvalidRequestError, SamplingParams
from tests.test_speculative import (CFG, PROMPTS, SAMPLES, SETTINGS, VOCAB, _assert_follows_the_target,
                                    _first_three_tokens, _run)


def _target(vocab_size=256, seed=0, scale=4.0, num_layers=1):
    cfg = get_preset("tiny-llama").replace(vocab_size=vocab_size, num_layers=num_layers)
    params = {k: v if k.endswith("norm") else v * scale for k, v in random_params(cfg, seed).items()}
    return LoadedModel(cfg, params, Tokenizer.byte_level(256, eos_token_ids=cfg.eos_token_ids))


def _head(target, noise=0.0, feature_mix=0.0, seed=1):
    """The target's last layer as an EAGLE head: weights + `noise` x their std, fc = [I; feature_mix x R]."""
    base = early_exit_draft(target, [target.config.num_layers - 1], name="tiny-eagle")
    rng = np.random.default_rng(seed)
    params = {k: v if k.endswith("norm") or k == "embed" or noise == 0 else
              v + noise * np.std(v) * rng.standard_normal(v.shape).astype(v.dtype) for k, v in base.params.items()}
    E = target.config.hidden_size
    params[FC] = np.concatenate([np.eye(E), feature_mix * rng.standard_normal((E, E)) / np.sqrt(E)]).astype(np.float32)
    return dataclasses.replace(base, params=params)


EAGLE = SpeculationConfig(3, min_acceptance=0.0, method="eagle")
TREES = dataclasses.replace(EAGLE, tree_nodes=8, tree_branching=3)  # EAGLE-2: 3 + 9 + 9 candidates, 8 verified


@pytest.fixture(scope="module")
def target():
    return _target()


@pytest.fixture(scope="module")
def plain(target):
    return Engine(target, CFG)


@pytest.fixture(scope="module")
def head(target):
    return _head(target, noise=0.03, feature_mix=0.01)


@pytest.fixture(scope="module")
def eagle(target, head):
    return Engine(target, CFG, draft=head, speculation=EAGLE)


def test_a_head_equal_to_the_target_accepts_every_draft_token(target, plain):
    same = Engine(target, CFG, draft=_head(target), speculation=EAGLE)
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    want = [o.token_ids for o in _run(plain, PROMPTS, greedy)]
    for _ in range(2):  # the second round hits the prefix cache
        outs = _run(same, PROMPTS, greedy)
        assert [o.token_ids for o in outs] == want
        assert all(o.acceptance_rate == 1.0 for o in outs)
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True) for i in range(len(PROMPTS))]
    assert all(o.acceptance_rate == 1.0 for o in _run(same, PROMPTS, sampled))
    # 23 tokens after the first: verifies of K + 1 = 4 tokens, then the remainder.
    assert same.stats.position_acceptance == [1.0, 1.0, 1.0]


def test_a_head_equal_to_the_target_accepts_every_node_of_a_branchless_tree(target, plain):
    """EAGLE-2 trees with branching 1 expand one node per level: each level's head pass re-runs the window
    with tree masks, so an exact head accepts every level."""
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    same = Engine(target, CFG, draft=_head(target), speculation=dataclasses.replace(TREES, tree_nodes=3,
                                                                                   tree_branching=1))
    assert [o.token_ids for o in _run(same, PROMPTS, greedy)] == [o.token_ids for o in _run(plain, PROMPTS, greedy)]
    assert same.stats.position_acceptance == [1.0, 1.0, 1.0]


def test_tree_shape_and_bad_tree_settings():
    from engine.spec.eagle import eagle_tree_shape

    with pytest.raises(ValueError, match="tree_branching must be in"):
        dataclasses.replace(TREES, tree_branching=0)
    with pytest.raises(ValueError, match="token trees: methods 'ngram', 'medusa', 'eagle' and 'suffix'"):
        dataclasses.replace(TREES, method="draft")

    # (top-k, levels): expanded nodes (levels - 1) x top-k fit in the K window slots; depth <= K and the cap
    assert [eagle_tree_shape(K, 4, 4) for K in (1, 3, 7, 8, 15, 31)] == [(1, 1), (3, 2), (4, 2), (4, 3), (4, 4),
                                                                         (4, 4)]
    assert eagle_tree_shape(8, 1, 16) == (1, 8)


def test_trees_greedy_and_seeded_output_equal_target_alone(target, head, plain):
    """EAGLE-2 trees with chunked prefill and the prefix cache: greedy output and seeded sampled output equal the
    target alone's (the coupled tree verify), both verify outcomes happen, every block comes back."""
    trees = Engine(target, CFG, draft=head, speculation=TREES)
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    want = [o.token_ids for o in _run(plain, PROMPTS, greedy)]
    for _ in range(2):
        outs = _run(trees, PROMPTS, greedy)
        assert [o.token_ids for o in outs] == want
    assert 0 < sum(o.num_accepted_tokens for o in outs) < sum(o.num_draft_tokens for o in outs)
    params = [SamplingParams(temperature=t, top_p=top_p, seed=seed, max_tokens=20, ignore_eos=True)
              for seed, (t, top_p) in enumerate([(0.05, 1.0), (0.2, 0.9), (1.0, 1.0), (0.1, 1.0), (0.3, 0.95)])]
    got = _run(trees, PROMPTS[:5], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in _run(plain, PROMPTS[:5], params)]
    assert sum(o.num_accepted_tokens for o in got) > 0
    assert trees.blocks.num_free_blocks == trees.blocks.num_usable_blocks


def test_path_ranks_say_what_smaller_trees_accept(target, head):
    """The rank of each accepted node among the tree's candidates (`StepOutput.path_rank`) grows along the path,
    and a request whose tree is cut to n nodes accepts the whole tree's path nodes of rank < n: exactly so
    where the cut's program expands the same candidates (n = 1, 2: the best n of a subset that holds them;
    n >= 4: the 7-node program has the 8-node one's 3 levels; the 3-node program stops at 2 levels, where
    a node the deeper tree ranks out can come in)."""
    from tests.test_medusa import _first_verify

    trees = Engine(target, CFG, draft=head, speculation=TREES)
    assert [trees.proposer.depth(None, n) for n in range(9)] == [0, 1, 2, 2, 3, 3, 3, 3, 3]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    contexts = PROMPTS + [p + o.token_ids for p, o in zip(PROMPTS, _run(trees, PROMPTS, [greedy] * len(PROMPTS)))]
    deep = 0
    for prompt in contexts:
        accepted, ranks = _first_verify(trees, prompt, 8)
        path = ranks[ranks >= 0]
        assert len(path) == accepted and list(path) == sorted(set(path)) and all(path < 8)
        for n in (1, 2, 4, 5, 6, 7):
            want = min(trees.proposer.depth(None, n), int(np.sum(path < n)))
            assert _first_verify(trees, prompt, n)[0] == want, (prompt, n, path)
        deep += accepted >= 2
    assert deep >= 2


def test_a_deepened_head_drafts_what_its_one_layer_head_drafts(target, head):
    """`model.eagle.deepen` appends layers whose residual branches start at zero: the 2-layer head (its own
    2-layer KV pool) proposes, and so accepts, exactly what the 1-layer head does; fewer layers are refused."""
    params = {k: np.asarray(v) for k, v in head.params.items()}
    cfg, deep = deepen(head.config, params, target, 2)
    assert cfg.num_layers == 2 and deep["wq"].shape[0] == 2
    assert not deep["wo"][1].any() and not deep["w_down"][1].any() and deep["w_up"][1].any()
    np.testing.assert_array_equal(deep["wq"][0], params["wq"][0])
    runs = []
    for draft in (head, dataclasses.replace(head, config=cfg, params=deep)):
        engine = Engine(target, CFG, draft=draft, speculation=TREES)
        greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
        runs.append(([o.token_ids for o in _run(engine, PROMPTS, greedy)], engine.stats.position_acceptance))
    assert runs[1] == runs[0] and 0 < runs[0][1][0] < 1
    with pytest.raises(ValueError, match="cannot remove"):
        deepen(cfg, deep, target, 1)


def test_greedy_equals_target_alone_with_chunks_and_prefix_cache(plain, eagle):
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    want = [o.token_ids for o in _run(plain, PROMPTS, greedy)]
    for _ in range(2):
        outs = _run(eagle, PROMPTS, greedy)
        assert [o.token_ids for o in outs] == want
    rates = [o.acceptance_rate for o in outs]
    assert all(0 < r < 1 for r in rates), rates  # both outcomes of the verify happen


def test_a_request_the_gate_keeps_holding_stops_keeping_the_heads_state(target, head, plain):
    """With every verify priced far above a plain step, the cost gate gives no drafts; after `HOLD_STEPS` such
    steps the request's class is released and its steps run the target alone (no head pass), output
    unchanged."""
    from engine.spec.gate import HOLD_STEPS

    gated = Engine(target, CFG, draft=head, speculation=SpeculationConfig(3, method="eagle"))
    assert gated.proposer.config.min_acceptance > 0  # the gate is on
    runner = gated.runner
    for T in runner.token_buckets:
        for S in runner.seq_buckets:
            for K in (1, 2, 3):
                gated.gate.costs.observe(T, S, K, 10.0)
    ks = []
    gated.on_step = lambda timing: ks.append(timing.spec_k)
    sp = SamplingParams(temperature=0, max_tokens=HOLD_STEPS + 12, ignore_eos=True)
    [out] = _run(gated, [PROMPTS[1]], [sp])
    assert out.token_ids == _run(plain, [PROMPTS[1]], [sp])[0].token_ids
    assert out.num_draft_tokens == 0 and all(k in (0, None) for k in ks), ks
    # Prefill and the held steps keep the head's KV (K = 0; the first decode steps measure the plain step and
    # are not holds); then the target runs alone to the end.
    first_alone = ks.index(None)
    assert HOLD_STEPS <= first_alone <= HOLD_STEPS + 3 and set(ks[first_alone:]) == {None}, ks
    # The class stays held: a request arriving now keeps the head's state only through its prefill (33 tokens,
    # two chunks); the gate holds its first decode step and releases it there.
    ks.clear()
    [again] = _run(gated, [PROMPTS[4]], [sp])
    assert again.token_ids == _run(plain, [PROMPTS[4]], [sp])[0].token_ids
    assert ks == [0, 0] + [None] * (len(ks) - 2), ks


@pytest.mark.parametrize("swap", [False, True])
def test_greedy_equals_target_alone_under_preemption(target, swap):
    """Preempted sequences come back with their features and head KV (swap) or recompute them."""
    limits = EngineConfig(num_blocks=10, block_size=8, max_num_seqs=8, max_num_batched_tokens=16,
                          swap_space_bytes=(1 << 20) * swap, swap_threshold_tokens=1, kv_watermark=0.0)
    greedy = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 5
    small = Engine(target, limits, draft=_head(target), speculation=EAGLE)
    outs = _run(small, PROMPTS[:5], greedy)
    sch = small.scheduler
    assert (sch.num_swapped > 0, sch.num_recomputed > 0) == (swap, not swap)
    assert [o.token_ids for o in outs] == [o.token_ids for o in _run(Engine(target, limits), PROMPTS[:5], greedy)]
    if swap:  # swapped-in features and head KV are the ones swapped out: the head stays exact
        assert all(o.acceptance_rate == 1.0 for o in outs)


@pytest.mark.parametrize("trees", [False, True], ids=["chain", "tree"])
def test_pools_hold_the_target_features_and_the_head_kv_of_every_position(target, head, eagle, trees):
    """Mid-generation, after verifies that rejected draft tokens: at every position the target has run,
    the feature pool holds the target's hidden state and the head's KV pool the K/V of a fresh head pass
    over (target feature before, token) pairs. With trees, that takes the accepted paths' features and head
    KV moved to consecutive slots, and each node's head KV computed from its parent's feature."""
    if trees:
        eagle = Engine(target, CFG, draft=head, speculation=TREES)
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True)
    request = eagle.add_request(PROMPTS[4], sp)
    for _ in range(8):
        eagle.step()
    tokens = request.token_ids(0, request.num_tokens)
    n = request.num_computed_tokens  # the last token is sampled, not yet run
    assert n == len(tokens) - 1
    assert request.num_draft_tokens > request.num_accepted_tokens > 0
    _, head_pool, features = eagle.runner.pools
    B = CFG.block_size
    blocks = np.asarray(request.allocation.block_ids)
    pos = np.arange(n)
    blk, off = blocks[pos // B], pos % B

    model = Llama(target.config, params=target.params)
    want_f = np.asarray(_dense(model, tokens[:n]))
    np.testing.assert_allclose(np.asarray(features.f[0, blk, off, 0]), want_f, rtol=1e-4, atol=1e-4)

    prev = np.concatenate([np.zeros_like(want_f[:1]), want_f[:-1]])
    kv = {}
    _dense(EagleHead(head.config, head.params), tokens[:n], features=prev, keep=kv)
    np.testing.assert_allclose(np.asarray(head_pool.k[0, blk, off]), kv["k"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(head_pool.v[0, blk, off]), kv["v"], rtol=1e-4, atol=1e-4)
    eagle.abort(request.request_id)


def _dense(model, tokens, features=None, keep=None):
    """A dense causal pass over one sequence; with `keep`, the first layer's K and V are stored in it."""
    ids = jnp.asarray(tokens, jnp.int32)
    pos = jnp.arange(len(tokens), dtype=jnp.int32)
    seg = jnp.zeros(len(tokens), jnp.int32)

    def attend(q, k, v, layer, cache, spec):
        if keep is not None and layer == 0:
            keep["k"], keep["v"] = np.asarray(k), np.asarray(v)
        return dense_attention(q, k, v, pos, seg, spec), cache

    if features is None:
        return model(ids, pos, attend, None)[0]
    return model(ids, jnp.asarray(features), pos, attend, None)[0]


def test_first_three_tokens_follow_the_target_exactly():
    """As the draft model's test (tests/test_speculative.py): each setting's first three tokens follow the
    target's exact joint, with the test's power stated."""
    target = _target(vocab_size=VOCAB, seed=0, scale=8.0)
    head = _head(target, noise=0.5, feature_mix=0.5)
    engine = Engine(target, EngineConfig(num_blocks=300, block_size=4, max_num_seqs=64, max_num_batched_tokens=256),
                    draft=head, speculation=SpeculationConfig(2, min_acceptance=0.0, method="eagle"))
    prompt = [1, 2, 3]
    for name, (counts, drafted, accepted) in _first_three_tokens(engine, prompt, SETTINGS, SAMPLES).items():
        assert drafted >= SAMPLES and 0.1 < accepted / drafted < 0.95, name  # verify accepted and rejected many
        _assert_follows_the_target(counts, target, prompt, SETTINGS[name])


def test_first_three_tokens_of_merged_trees_follow_the_target_exactly():
    """EAGLE-2 trees with the n-gram chain in them (the default for SmolLM2): as above, with a prompt that repeats
    itself, so the chain (the tokens after the earlier "1 2") is in most trees."""
    target = _target(vocab_size=VOCAB, seed=0, scale=8.0)
    head = _head(target, noise=0.5, feature_mix=0.5)
    merged = SpeculationConfig(2, min_acceptance=0.0, method="eagle", tree_nodes=4, tree_branching=2,
                               ngram_in_tree=True)
    engine = Engine(target, EngineConfig(num_blocks=600, block_size=4, max_num_seqs=64, max_num_batched_tokens=512),
                    draft=head, speculation=merged)
    prompt = [1, 2, 3, 0, 1, 2]
    # Six tokens each, so the first verify (after the prefill's token) has a whole tree: the n-gram chain and
    # two of the head's candidates.
    got = _first_three_tokens(engine, prompt, SETTINGS, SAMPLES, max_tokens=6)
    assert any(n > 0 for _, n in engine.gate._acceptance)  # verifies of trees that held a chain
    for name, (counts, drafted, accepted) in got.items():
        assert drafted >= 4 * SAMPLES and 0.05 < accepted / drafted < 0.95, (name, accepted, drafted)
        _assert_follows_the_target(counts, target, prompt, SETTINGS[name])


def test_the_ngram_chain_joins_the_tree_once():
    """`_with_chain`: chain nodes come first (score 0, in order); a head candidate that spells a chain prefix
    merges into that chain node (never taken, its children re-hung); other candidates keep their parents,
    shifted past the chain."""
    from engine.spec.eagle import _with_chain

    chain = jnp.array([[7, 8, -1]])
    c_tok = [jnp.array([[7, 9]]), jnp.array([[8, 5, 6, 4]])]
    c_parent = [jnp.array([[-1, -1]]), jnp.array([[0, 0, 1, 1]])]
    score = jnp.array([[-0.1, -1.0, -0.2, -0.5, -1.5, -2.0]])
    depth = jnp.array([[1, 1, 2, 2, 2, 2]])
    tok, sc, parent, d = _with_chain(chain, c_tok, score, c_parent, depth)
    assert jnp.concatenate(tok, 1).tolist() == [[7, 8, 0, 7, 9, 8, 5, 6, 4]]
    assert sc.tolist() == [[0, 0, -np.inf, -np.inf, -1.0, -np.inf, -0.5, -1.5, -2.0]]
    assert jnp.concatenate(parent, 1).tolist() == [[-1, 0, 1, -1, -1, 0, 0, 4, 4]]
    assert d.tolist() == [[1, 2, 3, 1, 1, 2, 2, 2, 2]]


def test_merged_trees_accept_the_repeats_a_poor_head_misses(target, plain):
    """A head that hardly ever guesses right (noise 1.0) on a target whose greedy outputs loop: the n-gram
    chain in its trees accepts the loops (61 accepted against 6 without, on these prompts), and the output is
    the target's."""
    head = _head(target, noise=1.0, feature_mix=0.5)
    greedy = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)] * len(PROMPTS)
    want = [o.token_ids for o in _run(plain, PROMPTS, greedy)]
    accepted = {}
    for merge in (False, True):
        engine = Engine(target, CFG, draft=head, speculation=dataclasses.replace(TREES, ngram_in_tree=merge))
        outs = _run(engine, PROMPTS, greedy)
        assert [o.token_ids for o in outs] == want
        accepted[merge] = sum(o.num_accepted_tokens for o in outs)
    assert accepted[True] > 5 * max(accepted[False], 1), accepted
    with pytest.raises(ValueError, match="ngram_in_tree needs EAGLE-2 trees"):
        dataclasses.replace(EAGLE, ngram_in_tree=True)


@pytest.mark.parametrize("speculation", [EAGLE, TREES], ids=["chain", "tree"])
def test_finishing_inside_an_accepted_run_matches_the_plain_run(target, plain, speculation):
    same = Engine(target, CFG, draft=_head(target), speculation=speculation)
    prompt = PROMPTS[3]
    free = _run(plain, [prompt], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])[0]
    cases = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[free.token_ids[6]]),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[free.text[5:8]]),
    ]
    for sp in cases:
        want, got = _run(plain, [prompt], [sp])[0], _run(same, [prompt], [sp])[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert same.blocks.num_free_blocks == same.blocks.num_usable_blocks


def test_seeded_sampling_is_reproducible_and_batch_independent(eagle):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=16, ignore_eos=True)
    alone = _run(eagle, [PROMPTS[0]], [sp])[0]
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(3)]
    mixed = _run(eagle, [PROMPTS[4], PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others[0], sp, others[1], others[2]])
    assert mixed[1].token_ids == alone.token_ids and alone.num_draft_tokens > 0


def test_top_k_over_the_head_vocabulary_equals_it_over_the_full_logits(target):
    """`EagleHead.top_k` reads the `head_ids` columns alone; the full logits put -1e30 elsewhere. Same tokens,
    log-probabilities within float rounding (the drafting's confidence, EAGLE-2 §4.1)."""
    base = _head(target, noise=0.05)
    ids = np.sort(np.random.default_rng(3).choice(target.config.vocab_size, 40, replace=False)).astype(np.int32)
    cfg = base.config.replace(head_vocab_size=40, tie_word_embeddings=True)
    head = EagleHead(cfg, {**{k: v for k, v in base.params.items() if k != "lm_head"}, "head_ids": ids})
    h = jnp.asarray(np.random.default_rng(4).standard_normal((6, cfg.hidden_size)).astype(np.float32))
    logprobs, tokens = head.top_k(h, 5)
    want_logprobs, want_tokens = jax.lax.top_k(jax.nn.log_softmax(head.logits(h), axis=-1), 5)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)
    assert set(np.asarray(tokens).ravel()) <= set(ids.tolist())


def test_save_and_load_round_trip(target, tmp_path):
    tied = LoadedModel(target.config.replace(tie_word_embeddings=True),
                       {k: v for k, v in target.params.items() if k != "lm_head"}, target.tokenizer)
    head = _head(tied, noise=0.03, feature_mix=0.01)
    save_draft(tmp_path / "h", head.config, head.params, None, target_name="tiny", storage_dtype="float32")
    loaded = load_draft(str(tmp_path / "h"), tied)
    assert set(loaded.params) == set(head.params)
    for k, v in head.params.items():
        np.testing.assert_array_equal(loaded.params[k], v)
    engine = Engine(tied, CFG, draft=loaded)  # the kind comes from the head: EAGLE, not a draft model
    assert engine.proposer.kind == "eagle"


def test_wrong_kind_of_draft_is_refused(target):
    with pytest.raises(ValueError, match="needs an EAGLE head"):
        Engine(target, CFG, draft=_target(num_layers=1, seed=3), speculation=EAGLE)
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(target, CFG, draft=_head(target), speculation=SpeculationConfig(3, method="draft"))
    with pytest.raises(InvalidRequestError, match="exceeds"):
        Engine(target, CFG, draft=_head(target), speculation=EAGLE).add_request(
            [1, 2], SamplingParams(num_speculative_tokens=4))
    with pytest.raises(ValueError, match="EAGLE head needs"):
        EagleHead(target.config, {k: v for k, v in _head(target).params.items() if k != FC})
