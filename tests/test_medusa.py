"""Medusa heads: the static sparse tree, the heads' candidates, and the engine's Medusa trees on a tiny model
(greedy and seeded output equal the target alone, logprobs too, the feature pool holds the target's hidden
states along accepted paths, finishing rules inside accepted paths)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import LoadedModel
from checkpoints.draft import load_draft, save_medusa
from engine import Engine, EngineConfig, SamplingParams
from engine.spec.config import SpeculationConfig
from model import medusa
from model.llama import Llama
from tests.test_speculative import _model, _run
from training.data import dense_hidden

PROMPTS = [[3, 4, 5, 6] * 4, list(range(3, 20)) * 2, [7] * 5, list(range(3, 40)), [9, 10, 11] * 12 + [9, 10]]
CFG = EngineConfig(num_blocks=96, block_size=16, max_num_seqs=4, max_num_batched_tokens=32)
ACCURACY = np.array([[0.6, 0.25, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1]], np.float32)
TREE = SpeculationConfig(num_speculative_tokens=3, method="medusa", tree_nodes=8, min_acceptance=0)


def test_medusa_tree_by_hand():
    """Best-first by the product of accuracies along the path: (0,) 0.6, (0,0) 0.3, (1,) 0.25, (1,0) 0.125."""
    acc = np.array([[0.6, 0.25], [0.5, 0.2]])
    assert medusa.medusa_tree(acc, 4) == ([0, 1, 0, 3], [0, 1, 0, 1], [0, 0, 1, 0])
    parents, heads, ranks = medusa.medusa_tree(acc, 6)  # every node of 2 heads x 2 candidates
    assert sorted(zip(heads, ranks)) == [(0, 0), (0, 1), (1, 0), (1, 0), (1, 1), (1, 1)]
    assert all(p < i + 1 for i, p in enumerate(parents))
    with pytest.raises(ValueError, match="cannot have 7 nodes"):
        medusa.medusa_tree(acc, 7)


def _heads(target, scale: float, seed: int = 0, head_ids=None) -> LoadedModel:
    E, K = target.config.hidden_size, len(ACCURACY)
    rng = np.random.default_rng(seed)
    ids = np.arange(target.config.vocab_size) if head_ids is None else head_ids
    params = {medusa.W: scale * rng.standard_normal((K, E, E)).astype(np.float32) / np.sqrt(E),
              medusa.B: scale * rng.standard_normal((K, E)).astype(np.float32), medusa.ACCURACY: ACCURACY,
              medusa.HEAD_IDS: ids.astype(np.int32),
              medusa.READOUT: medusa.target_readout(target.config, target.params)}
    return LoadedModel(target.config.replace(name="medusa-test"), params, target.tokenizer)


def test_candidates_are_each_heads_top_tokens_and_survive_a_save(tmp_path):
    """h + SiLU(h W_k + b_k) read out by the embedding rows of `head_ids` (numpy reference); top-n ids in
    order; a saved and loaded copy (bf16 storage) gives the same candidates."""
    target = _model(scale=4.0)
    ids = np.arange(0, 256, 3)
    loaded = _heads(target, 1.0, head_ids=ids)
    heads = medusa.MedusaHeads(target.config, loaded.params)
    h = np.random.default_rng(1).standard_normal((5, target.config.hidden_size)).astype(np.float32)
    got = np.asarray(heads.candidates(jnp.asarray(h), 3))
    w, b, emb = loaded.params[medusa.W], loaded.params[medusa.B], loaded.params[medusa.READOUT][ids]
    for k in range(3):
        pre = h @ w[k] + b[k]
        logits = (h + pre / (1 + np.exp(-pre))) @ emb.T
        np.testing.assert_array_equal(got[:, k], ids[np.argsort(-logits, axis=1)[:, :3]])
    save_medusa(tmp_path / "m", {n: loaded.params[n] for n in (medusa.W, medusa.B, medusa.ACCURACY, medusa.HEAD_IDS)},
                "tiny", storage_dtype="float32")
    again = load_draft(str(tmp_path / "m"), target)
    assert again.stored_dtype is None  # float32 storage: the kernels keep the target's dtype
    assert np.array_equal(np.asarray(medusa.MedusaHeads(target.config, again.params).candidates(jnp.asarray(h), 3)),
                          got)
    with pytest.raises(ValueError, match="need"):
        medusa.MedusaHeads(target.config, {k: v for k, v in loaded.params.items() if k != medusa.B})


@pytest.fixture(scope="module")
def target():
    return _model(scale=4.0)


@pytest.fixture(scope="module")
def heads(target):
    # Small weights: each head's candidates are near the target's own next-token ranking at h_t, so on these
    # repetitive prompts proposals are accepted and rejected.
    return _heads(target, 0.03)


@pytest.fixture(scope="module", params=[TREE, dataclasses.replace(TREE, tree_nodes=0)], ids=["tree", "chain"])
def engine(target, heads, request):
    return Engine(target, CFG, draft=heads, speculation=request.param)


def test_greedy_and_logprobs_equal_target_alone_with_chunks_and_prefix_cache(target, engine):
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)] * len(PROMPTS)
    plain = _run(Engine(target, CFG), PROMPTS, greedy)
    for _ in range(2):  # the second round hits the prefix cache
        outs = _run(engine, PROMPTS, greedy)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        for o, w in zip(outs, plain):
            assert len(o.logprobs) == len(w.logprobs) == len(w.token_ids) == 24
            for a, b in zip(o.logprobs, w.logprobs):
                assert list(a) == list(b) and np.allclose(list(a.values()), list(b.values()), atol=1e-4)
    accepted, drafted = sum(o.num_accepted_tokens for o in outs), sum(o.num_draft_tokens for o in outs)
    assert 0 < accepted < drafted
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_seeded_sampled_output_equals_decoding_without_speculation(target, engine):
    plain = Engine(target, CFG)
    params = [SamplingParams(temperature=t, top_p=top_p, seed=seed, max_tokens=20, ignore_eos=True)
              for seed, (t, top_p) in enumerate([(0.05, 1.0), (0.2, 0.9), (1.0, 1.0), (0.1, 1.0), (0.3, 0.95)])]
    got = _run(engine, PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in _run(plain, PROMPTS, params)]
    assert sum(o.num_accepted_tokens for o in got) > 0


def test_finishing_inside_an_accepted_path_matches_the_plain_run(target, engine):
    plain = Engine(target, CFG)
    prompt = PROMPTS[0]
    free = _run(plain, [prompt], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])[0]
    cases = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[free.token_ids[6]]),
             SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[free.text[5:8]])]
    for sp in cases:
        want, got = _run(plain, [prompt], [sp])[0], _run(engine, [prompt], [sp])[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_feature_pool_holds_the_targets_hidden_states_along_accepted_paths(target, heads):
    """After steps that accepted tree paths, the feature at every computed position is the dense forward's
    final hidden state there (the accepted nodes' features moved with their KV), which is what the heads read."""
    engine = Engine(target, CFG, draft=heads, speculation=TREE)
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while engine.stats.num_accepted_tokens < 4:
        assert engine.has_unfinished()
        engine.step()
    request = engine.scheduler.running[0]
    n = request.num_computed_tokens
    tokens = request.token_ids(0, n)
    want = np.asarray(dense_hidden(Llama(target.config, params=target.params), jnp.asarray([tokens])))[0]
    f, B = np.asarray(engine.runner.pools[1].f), CFG.block_size
    blocks = request.allocation.block_ids
    got = np.stack([f[0, blocks[p // B], p % B, 0] for p in range(n)])
    np.testing.assert_allclose(got, want, atol=2e-4)


def test_tree_is_cut_at_the_requests_depth(target, heads):
    """The tree is best-first ((0,) 0.6, (0,0) 0.3, (1,) 0.25, (1,0) 0.125, ...); a request's own
    num_speculative_tokens caps its depth: the tree's nodes up to the first deeper one; depth(k) is the
    first k nodes' deepest path."""
    from engine.spec.gate import Gate
    from engine.spec.medusa import MedusaProposer
    from scheduler.request import Request
    proposer = MedusaProposer(heads, TREE, target.config)
    gate = Gate(proposer)
    assert proposer.parents[:4] == [0, 1, 0, 3] and proposer.tree[0][:4] == (0, 1, 0, 1)
    wanted = [gate.wanted(Request([3, 4], SamplingParams(num_speculative_tokens=k)), 0) for k in (0, 1, 2, 3)]
    assert wanted[:2] == [0, 1] and 1 < wanted[2] < 8 and wanted[3] == 8
    assert gate.wanted(Request([3, 4], SamplingParams(num_tree_nodes=3)), 0) == 3  # a request's node budget
    assert [proposer.depth(None, k) for k in range(5)] == [0, 1, 2, 2, 2]


def _first_verify(engine, prompt, num_tree_nodes):
    """(accepted tokens, path ranks) of a greedy request's first verify."""
    outputs, run = [], engine.runner.run
    engine.runner.run = lambda *args, **kw: outputs.append(run(*args, **kw)) or outputs[-1]
    try:
        request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                            num_tree_nodes=num_tree_nodes))
        while not request.num_draft_tokens:
            engine.step()
    finally:
        del engine.runner.run
    while engine.has_unfinished():
        engine.step()
    out = outputs[-1]
    return int(out.num_emitted[0]) - 1, out.path_rank[0]


def test_path_ranks_say_what_each_smaller_cut_accepts(target, heads):
    """Medusa's cuts are prefixes of one static tree and the coupled verify follows the target's own tokens, so
    the whole tree's accepted ranks give exactly what a request cut to its first n nodes accepts
    (`engine.spec.acceptance.CutAcceptance`), and the gate's estimates after the whole tree's verifies are those."""
    engine = Engine(target, CFG, draft=heads, speculation=TREE)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    contexts = PROMPTS + [p + o.token_ids for p, o in zip(PROMPTS, _run(Engine(target, CFG), PROMPTS,
                                                                         [greedy] * len(PROMPTS)))]
    deep = 0
    for prompt in contexts:
        accepted, ranks = _first_verify(engine, prompt, 8)
        path = ranks[ranks >= 0]
        assert len(path) == accepted and list(path) == sorted(set(path)) and all(path < 8)
        for n in range(1, 8):
            want = min(engine.proposer.depth(None, n), int(np.sum(path < n)))
            assert _first_verify(engine, prompt, n)[0] == want, (prompt, n)
        deep += accepted >= 2
    assert deep >= 2  # first verifies that accepted paths two or three deep, so the cuts differ


def test_heads_in_the_cpu_kernels_give_the_reference_candidates():
    """The heads' two products in the native kernels (AMX tiles where the CPU has them, else the skinny
    kernel's panels; fp32 weights) rank each head's candidates as XLA's dot does."""
    from engine.step import kernel_layout

    layout = kernel_layout(EngineConfig(), "float32")
    if layout is None:
        pytest.skip("the native kernels are not available here")
    target = _model(scale=4.0)
    loaded = _heads(target, 1.0, head_ids=np.arange(0, 256, 3))
    plain, packed = (medusa.MedusaHeads(target.config, loaded.params) for _ in range(2))
    assert packed.pack_linears(*layout) > 0
    h = jnp.asarray(np.random.default_rng(2).standard_normal((6, target.config.hidden_size)).astype(np.float32))
    want = np.asarray(plain.logits(h))
    got = np.asarray(jax.jit(lambda h: packed.logits(h))(h))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(packed.candidates(h, 3)), np.asarray(plain.candidates(h, 3)))
