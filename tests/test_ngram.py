"""The n-gram (prompt lookup) proposer: the lookup itself, exact output in the engine, packing of host proposals."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig
from engine.spec.config import SpeculationConfig
from engine.spec.ngram import NgramIndex, lookup, lookup_tree
from scheduler.request import SamplingParams
from tests.test_speculative import (SAMPLES, SETTINGS, VOCAB, _assert_follows_the_target, _first_three_tokens, _model,
                                    _run)

NGRAM = SpeculationConfig(3, min_acceptance=0.0, method="ngram")
NGRAM_TREE = dataclasses.replace(NGRAM, tree_nodes=8)
BRANCHING = [3, 4, 5, 3, 4, 6, 3, 4, 7, 3, 4, 5, 9, 3, 4]  # after [3, 4]: 5, 6 or 7


@pytest.mark.parametrize("context,k,want", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),  # the 2-gram [1, 2] occurred at 0
    ([5, 6, 7, 5, 6, 8, 5, 6], 2, [8, 5]),  # two full continuations: the latest wins
    ([5, 6, 7, 9, 5, 6, 5, 6], 3, [7, 9, 5]),  # the latest match ([5, 6] at 4) has 2 tokens after it; 0 has 3
    ([1, 2, 1, 2], 4, [1, 2]),  # continuation cut by the context's end
    ([9, 8, 7, 1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),  # longest n first: [1, 2, 3] beats the later [3]
    ([1, 2, 3], 2, []),  # nothing repeats
    ([4], 2, []),
])
def test_lookup(context, k, want):
    assert lookup(np.asarray(context, np.int32), k, max_n=3, min_n=1)[0] == want


def _lookup_by_hand(context, k, max_n, min_n):
    L = len(context)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        starts = [i for i in range(L - n) if context[i:i + n] == context[L - n:]]
        if starts:
            best = max(min(k, L - (i + n)) for i in starts)
            i = max(i for i in starts if min(k, L - (i + n)) == best)
            return context[i + n:i + n + k], n
    return [], 0


@settings(max_examples=200, deadline=None)
@given(context=st.lists(st.integers(0, 3), min_size=1, max_size=40), k=st.integers(1, 5),
       sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)))
def test_lookup_equals_a_direct_search(context, k, sizes):
    max_n, min_n = sizes[0], max(1, sizes[0] - sizes[1])
    assert lookup(np.asarray(context, np.int32), k, max_n, min_n) == _lookup_by_hand(context, k, max_n, min_n)


@pytest.mark.parametrize("context,nodes,depth,want", [
    # [5, 6] ends at 1 and 4, both with 3 tokens after them: the latest first, then the other, sharing nothing
    ([5, 6, 7, 5, 6, 8, 5, 6], 8, 3, ([8, 5, 6, 7, 5, 6], [0, 1, 2, 0, 4, 5])),
    ([5, 6, 7, 5, 6, 8, 5, 6], 4, 3, ([8, 5, 6, 7], [0, 1, 2, 0])),  # the node budget cuts the second path
    # [3, 4] ends at 1, 4, 7 and 10: shared first tokens share nodes ([5, 3] twice)
    (BRANCHING, 8, 2, ([5, 9, 7, 3, 6, 3, 3], [0, 1, 0, 3, 0, 5, 1])),
    ([1, 2, 3], 8, 2, ([], [])),
])
def test_lookup_tree(context, nodes, depth, want):
    assert lookup_tree(np.asarray(context, np.int32), nodes, depth, max_n=3, min_n=1)[:2] == want


@settings(max_examples=200, deadline=None)
@given(context=st.lists(st.integers(0, 3), min_size=1, max_size=40), depth=st.integers(1, 5),
       nodes=st.integers(1, 12), max_n=st.integers(1, 4))
def test_lookup_tree_is_a_trie_of_continuations_led_by_the_chain(context, depth, nodes, max_n):
    """Parents come first, siblings differ, every root-to-node path follows an occurrence of the matched n-gram,
    and the first path is `lookup`'s chain."""
    ctx = np.asarray(context, np.int32)
    tokens, parents, n = lookup_tree(ctx, nodes, depth, max_n, 1)
    chain, n_chain = lookup(ctx, depth, max_n, 1)
    assert n == n_chain and len(tokens) == len(parents) <= nodes
    m = min(len(chain), nodes)
    assert tokens[:m] == chain[:m] and parents[:m] == list(range(m))
    assert all(0 <= p <= i for i, p in enumerate(parents))
    assert len({(p, t) for p, t in zip(parents, tokens)}) == len(tokens)
    L = len(context)
    ends = [i + n - 1 for i in range(L - n) if context[i:i + n] == context[L - n:]] if n else []
    for i in range(len(tokens)):
        path, j = [], i + 1
        while j:
            path.insert(0, tokens[j - 1])
            j = parents[j - 1]
        assert len(path) <= depth and any(context[e + 1:e + 1 + len(path)] == path for e in ends)


@settings(max_examples=200, deadline=None)
@given(context=st.lists(st.integers(0, 3), min_size=1, max_size=40), cuts=st.lists(st.integers(1, 40), max_size=4),
       k=st.integers(1, 5), max_n=st.integers(1, 4))
def test_an_index_extended_piece_by_piece_answers_as_a_fresh_one(context, cuts, k, max_n):
    """The engine extends each request's index with the tokens of every step and looks up in between."""
    index = NgramIndex(max_n, 1)
    for end in sorted(cuts) + [len(context)]:
        index.extend(context[len(index.tokens):end])
        fresh = context[:len(index.tokens)]
        assert index.lookup(k) == _lookup_by_hand(fresh, k, max_n, 1)
        assert index.lookup_tree(8, k) == lookup_tree(np.asarray(fresh, np.int32), 8, k, max_n, 1)


def test_lookup_respects_min_n():
    assert lookup(np.asarray([7, 1, 2, 7], np.int32), 2, max_n=3, min_n=2) == ([], 0)
    assert lookup(np.asarray([7, 1, 2, 7], np.int32), 2, max_n=3, min_n=1) == ([1, 2], 1)
    assert lookup(np.asarray([5, 7, 1, 2, 5, 7], np.int32), 2, max_n=3, min_n=1) == ([1, 2], 2)


PROMPTS = [[3, 4, 5, 6] * 4, list(range(3, 20)) * 2, [7] * 5, list(range(3, 40)), [9, 10, 11] * 12 + [9, 10]]
# Synchronous steps: these tests need the lookups' drafts verified, and with async scheduling a step the cost
# gate gives no drafts (on a tiny model, where host work is most of a step, most of them) runs ahead plainly
# (tests/test_async_scheduling.py covers that mix).
CFG = EngineConfig(num_blocks=96, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=False)


@pytest.fixture(scope="module")
def target():
    return _model(scale=4.0)


def test_greedy_equals_target_alone_with_chunks_and_prefix_cache(target):
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    plain = Engine(target, CFG)
    want = [o.token_ids for o in _run(plain, PROMPTS, greedy)]
    ngram = Engine(target, CFG, speculation=NGRAM)
    assert ngram.runner.pools[1:] == ()  # no draft model, no second pool
    for _ in range(2):  # the second round hits the prefix cache
        outs = _run(ngram, PROMPTS, greedy)
        assert [o.token_ids for o in outs] == want
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert any(o.num_draft_tokens > o.num_accepted_tokens for o in outs)  # rejections happen too
    assert ngram.blocks.num_free_blocks == ngram.blocks.num_usable_blocks
    st = ngram.stats  # per-position counts add up, and position i is accepted only after position i - 1
    assert sum(st.drafted_at) == st.num_draft_tokens and sum(st.accepted_at) == st.num_accepted_tokens
    assert all(a >= b for a, b in zip(st.accepted_at, st.accepted_at[1:])) and st.drafted_at[0] == st.num_verifies
    assert st.acceptance_length == 1 + st.num_accepted_tokens / st.num_verifies
    assert 0 < st.draft_share < 1 and plain.stats.draft_share == 0  # the lookups' host time; none without one


def test_first_three_tokens_follow_the_target_exactly():
    """As the draft-model test (tests/test_speculative.py), with one-hot proposals from the prompt: each setting's
    first three tokens follow the target's exact joint, with the test's power stated."""
    target = _model(vocab_size=VOCAB, seed=0, scale=8.0)
    engine = Engine(target, EngineConfig(num_blocks=300, block_size=4, max_num_seqs=64, max_num_batched_tokens=256,
                                         async_scheduling=False),
                    speculation=dataclasses.replace(NGRAM, num_speculative_tokens=2))
    prompt = [1, 2, 0, 3, 1, 2]  # every token of the vocabulary occurs: a proposal at each step
    for name, (counts, drafted, accepted) in _first_three_tokens(engine, prompt, SETTINGS, SAMPLES).items():
        assert drafted >= SAMPLES and 0.05 < accepted / drafted < 0.95, name  # verify accepted and rejected many
        _assert_follows_the_target(counts, target, prompt, SETTINGS[name])


@pytest.fixture(scope="module", params=[NGRAM, NGRAM_TREE], ids=["chain", "tree"])
def ngram(target, request):
    return Engine(target, CFG, speculation=request.param)


def test_finishing_inside_an_accepted_run_matches_the_plain_run(target, ngram):
    """EOS-free stops inside a run of accepted proposals: a stop token, max_tokens, a stop string."""
    plain = Engine(target, CFG)
    prompt = PROMPTS[0]  # the model answers with a repeated token: long accepted runs
    free = _run(plain, [prompt], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])[0]
    cases = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[free.token_ids[6]]),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[free.text[5:8]]),
    ]
    for sp in cases:
        want, got = _run(plain, [prompt], [sp])[0], _run(ngram, [prompt], [sp])[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert _run(ngram, [prompt], [cases[2]])[0].num_accepted_tokens > 0
    assert ngram.blocks.num_free_blocks == ngram.blocks.num_usable_blocks


def test_seeded_sampling_is_reproducible_and_batch_independent(ngram):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=16, ignore_eos=True)
    alone = _run(ngram, [PROMPTS[0]], [sp])[0]
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(3)]
    mixed = _run(ngram, [PROMPTS[4], PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others[0], sp, others[1], others[2]])
    assert mixed[1].token_ids == alone.token_ids and alone.num_draft_tokens > 0


def test_default_settings_keep_a_seeded_output_independent_of_its_batch_mates(target):
    """The default settings: the cost gate and its regret account choose each step's draft lengths from
    measured times (which differ run to run), with async scheduling; a seeded sampled request still gets the
    plain engine's tokens, alone or beside others."""
    plain = Engine(target, CFG)
    default = Engine(target, dataclasses.replace(CFG, async_scheduling=True), speculation=SpeculationConfig(
        3, method="ngram"))
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True)
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(3)]
    want = _run(plain, [PROMPTS[0]], [sp])[0].token_ids
    for _ in range(2):  # the second round: the gate has measured, the prefix cache hits
        assert _run(default, [PROMPTS[0]], [sp])[0].token_ids == want
        mixed = _run(default, [PROMPTS[4], PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others[0], sp, others[1], others[2]])
        assert mixed[1].token_ids == want
    assert default.gate.regret.last_drafted  # the account saw decode steps


def test_seeded_sampled_output_equals_decoding_without_speculation(target, ngram):
    """`verify_deterministic` emits the plain sampler's own draw at every position, so a seeded request's
    tokens are those of the engine without speculation, whatever was proposed and accepted."""
    plain = Engine(target, CFG)
    params = [SamplingParams(temperature=t, top_p=top_p, min_p=min_p, seed=seed, max_tokens=20, ignore_eos=True)
              for seed, (t, top_p, min_p) in enumerate([(0.05, 1.0, 0.0), (0.2, 0.9, 0.0), (0.2, 1.0, 0.1),
                                                        (0.1, 1.0, 0.0), (0.3, 0.95, 0.0)])]
    want = _run(plain, PROMPTS, params)
    got = _run(ngram, PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    drafted, accepted = sum(o.num_draft_tokens for o in got), sum(o.num_accepted_tokens for o in got)
    assert drafted > 20 and 0 < accepted < drafted  # proposals were accepted and rejected


def test_logprobs_with_ngram_speculation_match_the_plain_engine(target, ngram):
    """Log-probabilities come from the windows' compacted rows: rows with and without logprobs, greedy and
    seeded, drafting or not, give the plain engine's entries."""
    plain = Engine(target, CFG)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.2, seed=4, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)]
    prompts = [PROMPTS[0], PROMPTS[4], PROMPTS[1], PROMPTS[2]]
    want, got = _run(plain, prompts, params), _run(ngram, prompts, params)
    assert sum(o.num_accepted_tokens for o in got) > 0
    for w, g, sp in zip(want, got, params):
        assert g.token_ids == w.token_ids
        if sp.logprobs is None:
            assert not g.logprobs
            continue
        assert len(g.logprobs) == len(w.logprobs) == 12
        for a, b in zip(g.logprobs, w.logprobs):
            assert list(a) == list(b) and np.allclose(list(a.values()), list(b.values()), atol=1e-4)


def test_host_proposals_are_packed_into_the_verify_window(target):
    """Each drafting row's proposal is in the packed tokens right after its last accepted token, and in
    `spec.draft_tokens`; a proposal that does not fill the row's draft slots is refused."""
    engine = Engine(target, CFG, speculation=NGRAM)
    calls = []
    pack = engine.runner.pack

    refused = []

    def recording_pack(plan, seeds, spec_k=None, proposals=None, parents=None):
        if proposals and not refused:
            rid = next(iter(proposals))
            with pytest.raises(ValueError, match="proposed tokens for") as e:
                pack(plan, seeds, spec_k, {**proposals, rid: proposals[rid] + [1]})
            refused.append(e)
        packed = pack(plan, seeds, spec_k, proposals, parents)
        calls.append((plan, seeds, spec_k, proposals, packed))
        return packed

    engine.runner.pack = recording_pack
    _run(engine, PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2)
    drafting = [c for c in calls if c[3]]
    assert drafting
    for plan, seeds, K, proposals, packed in drafting:
        for i, s in enumerate(plan.seqs):
            want = proposals.get(s.request.request_id, [])
            assert len(want) == s.num_draft <= K
            assert packed.spec.draft_tokens[i, :s.num_draft].tolist() == want
            last = packed.logits_indices[i]
            assert packed.token_ids[last + 1:last + 1 + s.num_draft].tolist() == want
    assert refused


def test_token_trees_greedy_equal_target_alone_and_pack_as_trees(target):
    """Token trees of up to 8 nodes from several matches: greedy output equals the target alone (chunked
    prefill, then again on prefix-cache hits); the packed windows hold branching trees, their nodes at RoPE
    positions root + depth with their ancestors' masks, and every block comes back; a node whose parent does
    not come before it is refused."""
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)] * (len(PROMPTS) + 1)
    prompts = PROMPTS + [BRANCHING]
    plain = _run(Engine(target, CFG), prompts, greedy)
    want = [o.token_ids for o in plain]
    engine = Engine(target, CFG, speculation=NGRAM_TREE)
    packed_trees = []
    pack = engine.runner.pack

    def recording_pack(plan, seeds, spec_k=None, proposals=None, parents=None):
        if parents and not packed_trees:  # a node whose parent is not before it is refused
            rid = next(iter(parents))
            with pytest.raises(ValueError, match="tree node 1 has parent 1"):
                pack(plan, seeds, spec_k, proposals, {**parents, rid: [1] + parents[rid][1:]})
        packed = pack(plan, seeds, spec_k, proposals, parents)
        if parents:
            packed_trees.append((plan, parents, packed))
        return packed

    engine.runner.pack = recording_pack
    for _ in range(2):
        outs = _run(engine, prompts, greedy)
        assert [o.token_ids for o in outs] == want
        for o, w in zip(outs, plain):  # each emitted token scored at its own node (an ancestors-only view)
            assert len(o.logprobs) == len(w.logprobs) == len(w.token_ids) == 24
            for a, b in zip(o.logprobs, w.logprobs):
                assert list(a) == list(b) and np.allclose(list(a.values()), list(b.values()), atol=1e-4)
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    branched = 0
    for plan, parents, packed in packed_trees:
        for i, s in enumerate(plan.seqs):
            if not s.num_draft:
                continue
            tree = [-1, *parents[s.request.request_id]]
            branched += len(set(tree[1:])) < len(tree) - 1
            depth = [0]
            for p in tree[1:]:
                depth.append(depth[p] + 1)
            last, base = packed.logits_indices[i], packed.logits_indices[i] - packed.query_start_loc[i]
            window = slice(last, last + len(tree))
            assert packed.positions[window].tolist() == [packed.positions[last] + d for d in depth]
            # Node j sees the step's tokens before the window (prefill) and its ancestors, found by walking up.
            masks = []
            for j in range(len(tree)):
                bits, up = (1 << base) - 1, j
                while up >= 0:
                    bits, up = bits | 1 << (base + up), tree[up]
                masks.append(bits)
            assert packed.spec.tree_mask[window].tolist() == np.asarray(masks, np.uint32).view(np.int32).tolist()
            assert packed.spec.parents[i, :len(tree)].tolist() == tree
    assert branched > 0



def test_tree_depth_is_what_the_gate_expects_acceptance_along():
    """The cost gate prices a tree's window by its nodes but expects acceptance along one path: the depth of
    the first k nodes (BRANCHING's tree: 5 -> 9, 7 -> 3, 6 -> 3, 5 -> 3)."""
    from engine.spec.gate import Gate
    from engine.spec.ngram import NgramProposer
    from scheduler.request import Request
    proposer = NgramProposer(dataclasses.replace(NGRAM_TREE, num_speculative_tokens=2))
    r = Request(BRANCHING, SamplingParams(temperature=0))
    assert Gate(proposer).wanted(r, 0) == 7
    assert [proposer.depth(r, k) for k in range(8)] == [0, 1, 2, 2, 2, 2, 2, 2]
    chain = NgramProposer(NGRAM)
    assert Gate(chain).wanted(r, 0) == 3 and chain.depth(r, 3) == 3
    capped = Request(BRANCHING, SamplingParams(temperature=0, num_tree_nodes=4))  # a request's node budget
    assert Gate(proposer).wanted(capped, 0) == 4 and proposer.depth(capped, 4) == 2
