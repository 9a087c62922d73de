"""Suffix decoding: the suffix tries against brute force, exact output in the engine, scoping per cache salt."""

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig
from engine.spec.config import SpeculationConfig
from engine.spec.suffix import MAX_DEPTH, MAX_MATCH
from scheduler.request import SamplingParams
from engine.spec.suffix import SuffixCache, SuffixTrie
from tests.test_speculative import (PROMPTS, SAMPLES, SETTINGS, VOCAB, _assert_follows_the_target, _first_three_tokens,
                                    _model, _run)

SUFFIX = SpeculationConfig(8, min_acceptance=0.0, method="suffix", tree_nodes=8)
CFG = EngineConfig(num_blocks=96, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=False)
sequences = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=4)


def _substrings(seqs, depth):
    """Brute force: every substring of at most `depth` tokens and its occurrences."""
    counts = collections.Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                counts[tuple(s[i:j])] += 1
    return counts


def _contents(trie):
    """The trie as {string: count}, read by walking it."""
    out, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        for token, child in trie.children(node):
            out[path + (token,)] = trie.count(child)
            stack.append((child, path + (token,)))
    return out


@settings(max_examples=60, deadline=None)
@given(seqs=sequences, depth=st.integers(2, 5), cut=st.integers(0, 12))
def test_trie_counts_every_substring_and_extends_piece_by_piece(seqs, depth, cut):
    whole, pieces = SuffixTrie(depth), SuffixTrie(depth)
    for s in seqs:
        whole.add(s)
        pieces.extend(pieces.extend([], s[:cut]), s[cut:])
    want = _substrings(seqs, depth)
    assert _contents(whole) == _contents(pieces) == dict(want)
    assert whole.num_nodes == len(want) + 1


@settings(max_examples=60, deadline=None)
@given(seqs=sequences, depth=st.integers(2, 5), gone=st.integers(0, 3))
def test_removing_a_sequence_leaves_the_trie_of_the_others(seqs, depth, gone):
    trie = SuffixTrie(depth)
    for s in seqs:
        trie.add(s)
    trie.remove(seqs[gone % len(seqs)])
    rest = seqs[:gone % len(seqs)] + seqs[gone % len(seqs) + 1:]
    assert _contents(trie) == dict(_substrings(rest, depth))
    assert trie.num_nodes == len(_substrings(rest, depth)) + 1
    for s in rest:  # freed nodes are reused and the trie still counts right
        trie.add(s)
    assert _contents(trie) == dict(_substrings(rest + rest, depth))


@settings(max_examples=80, deadline=None)
@given(seqs=sequences, context=st.lists(st.integers(0, 3), min_size=1, max_size=8), max_len=st.integers(1, 6))
def test_match_is_the_longest_suffix_with_a_continuation(seqs, context, max_len):
    depth = 5
    trie = SuffixTrie(depth)
    for s in seqs:
        trie.add(s)
    subs = _substrings(seqs, depth)
    want = max((d for d in range(1, min(max_len, depth - 1, len(context)) + 1)
                if any(k[:-1] == tuple(context[-d:]) for k in subs if len(k) == d + 1)), default=0)
    node, length = trie.match(context, max_len)
    assert length == want
    if want:
        assert trie.count(node) == subs[tuple(context[-want:])]


def test_candidates_grow_best_first_by_the_continuations_shares():
    """After [1, 2] the sequences continued 3 (twice: 3 1, 3 5) and 4 (once): 3 has 2/3, its children 1/3 each
    (1/2 of 2/3), 4 has 1/3 and its child 1 (after 4) 1/3; min_prob 0.3 leaves none out, 0.34 all but 3."""
    trie = SuffixTrie(6)
    for s in ([1, 2, 3, 1], [1, 2, 3, 5], [1, 2, 4, 1]):
        trie.add(s)
    node, length = trie.match([7, 1, 2], 4)
    assert length == 2
    tokens, parents, probs = trie.candidates(node, 10, 3, 0.3)
    assert tokens == [3, 4, 1, 5, 1] and parents == [0, 0, 1, 1, 2]
    np.testing.assert_allclose(probs, [2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert trie.candidates(node, 10, 3, 0.34) == ([3], [0], [pytest.approx(2 / 3)])
    assert trie.candidates(node, 2, 3, 0.0)[0] == [3, 4]  # the node budget keeps the likeliest
    assert trie.candidates(node, 10, 1, 0.0)[0] == [3, 4]  # one level deep


def test_cache_keeps_its_token_budget_evicting_the_oldest_and_scopes_apart():
    cache = SuffixCache(4, max_tokens=10)
    cache.add("a", [1, 2, 3, 4])
    cache.add("b", [1, 2, 3, 5])
    assert cache.trie("a").match([1, 2], 3)[1] == 2 and cache.trie("b").match([9, 4], 3)[1] == 0
    cache.add("a", [6, 7, 8])  # 11 tokens: the oldest ("a"'s first) goes
    assert cache.num_tokens == 7
    assert _contents(cache.trie("a")) == dict(_substrings([[6, 7, 8]], 4))
    cache.add("c", list(range(30)))  # longer than the cache: its last 10 tokens, the rest evicted
    assert cache.num_tokens == 10 and cache.trie("a") is None and cache.trie("b") is None
    assert _contents(cache.trie("c")) == dict(_substrings([list(range(20, 30))], 4))
    assert cache.num_nodes == 1 + len(_substrings([list(range(20, 30))], 4))


def test_bad_suffix_settings_get_a_clear_error():
    with pytest.raises(ValueError, match="suffix_cache_tokens must be >= 0, got -1"):
        dataclasses.replace(SUFFIX, suffix_cache_tokens=-1)
    with pytest.raises(ValueError, match="suffix_cache_tokens must be an integer"):
        dataclasses.replace(SUFFIX, suffix_cache_tokens=1.5)
    with pytest.raises(ValueError, match="max_depth must be >= 2"):
        SuffixTrie(1)


@pytest.fixture(scope="module")
def target():
    return _model(scale=4.0)


def test_greedy_equals_the_target_and_a_repeated_request_copies_its_earlier_output(target):
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)] * len(PROMPTS)
    plain = _run(Engine(target, CFG), PROMPTS, greedy)
    engine = Engine(target, CFG, speculation=SUFFIX)
    rounds = [_run(engine, PROMPTS, greedy) for _ in range(2)]
    for outs in rounds:
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        for o, w in zip(outs, plain):
            assert len(o.logprobs) == len(w.logprobs) == 24
            for a, b in zip(o.logprobs, w.logprobs):
                assert list(a) == list(b) and np.allclose(list(a.values()), list(b.values()), atol=1e-4)
    # The second round finds each output in the global trie (its prompt tail leads into it): few target steps.
    first, second = (sum(o.num_target_steps for o in outs) for outs in rounds)
    assert second <= first // 2
    assert all(o.num_accepted_tokens >= 12 for o in rounds[1])
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    kept = engine.proposer.cache
    assert kept.num_tokens == sum(min(MAX_MATCH, len(p)) + 24 for p in PROMPTS) * 2


def test_one_salts_outputs_never_shape_anothers_proposals(target):
    """Tenant isolation: a request under salt B, after the same request ran twice under salt A, gets exactly
    the proposals (at every context length) that it gets from an engine that never saw A."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = PROMPTS[4]

    def lookups(engine, salt):
        seen = {}
        lookup = engine.proposer._lookup

        def recording(request, k):
            seen[request.num_known_tokens] = out = lookup(request, k)
            return out
        engine.proposer._lookup = recording
        engine.add_request(prompt, greedy, cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
        engine.proposer._lookup = lookup
        return seen

    fresh = lookups(Engine(target, CFG, speculation=SUFFIX), "B")
    shared = Engine(target, CFG, speculation=SUFFIX)
    first_a, second_a = lookups(shared, "A"), lookups(shared, "A")
    assert any(m[0] == "global" for _, _, m in second_a.values())  # A's own repeat does use A's outputs
    assert first_a == fresh
    b = lookups(shared, "B")
    common = b.keys() & fresh.keys()
    assert len(common) >= 8 and all(b[n] == fresh[n] for n in common)
    assert all(m == 0 or m[0] == "local" for _, _, m in b.values())


def test_the_global_tries_stay_within_their_token_budget_over_a_long_run(target):
    engine = Engine(target, CFG, speculation=dataclasses.replace(SUFFIX, suffix_cache_tokens=200))
    rng = np.random.default_rng(0)
    for _ in range(6):
        prompts = [list(rng.integers(3, 200, size=int(rng.integers(4, 40)))) for _ in range(4)]
        _run(engine, prompts, [SamplingParams(temperature=1.0, seed=i, max_tokens=20) for i in range(4)])
        cache = engine.proposer.cache
        assert cache.num_tokens <= 200
        kept = [tokens for _, tokens in cache._entries.values()]
        assert sum(map(len, kept)) == cache.num_tokens
        assert _contents(cache.trie(None)) == dict(_substrings(kept, MAX_DEPTH))
    assert cache._added >= 2 * len(kept) and cache.num_tokens > 200 - 28  # evicted, down to the budget


def test_first_three_tokens_follow_the_target_exactly():
    """Seeded requests of one prompt: from the first finished ones on, the global trie proposes the continuations
    earlier samples took (a frequency-scored tree of the target's own distribution). As the draft-model test
    (tests/test_speculative.py): each setting's first three tokens follow the target's exact joint, with the
    test's power stated."""
    target = _model(vocab_size=VOCAB, seed=0, scale=8.0)
    engine = Engine(target, EngineConfig(num_blocks=300, block_size=4, max_num_seqs=64, max_num_batched_tokens=256,
                                         async_scheduling=False),
                    speculation=dataclasses.replace(SUFFIX, num_speculative_tokens=2, tree_nodes=4))
    prompt = [1, 2, 0, 3, 1, 2]
    got = _first_three_tokens(engine, prompt, SETTINGS, SAMPLES)
    assert engine.proposer.cache.num_tokens > 0
    for name, (counts, drafted, accepted) in got.items():
        assert drafted >= SAMPLES and 0.05 < accepted / drafted < 0.95, name
        _assert_follows_the_target(counts, target, prompt, SETTINGS[name])
