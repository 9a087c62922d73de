"""The speculation cost gate: measured step costs and per-class acceptance decide each step's draft lengths."""

from __future__ import annotations

import numpy as np
import pytest

from engine.spec.acceptance import CutAcceptance, expected_accepted, oracle_tree_acceptance
from engine.spec.config import SpeculationConfig
from engine.spec.costs import DraftRegret, StepCosts, attention_pairs
from engine.spec.ngram import NgramProposer
from engine.spec.gate import Gate
from engine.spec.proposer import Proposer
from scheduler.packing import power_of_two_buckets
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import ScheduledSeq

BUCKETS = power_of_two_buckets(64)


class _Want(Proposer):
    """A host proposer that always offers its request's `want` draft tokens (capped by the policy)."""

    def __init__(self, config, want):
        super().__init__(config)
        self.want = want

    def proposal_len(self, request, k):
        return min(self.want[request.request_id], k)


def _gate(config, want, proposer=_Want):
    """The gate over a `proposer(config, want)`, with step costs to measure."""
    return Gate(proposer(config, want), StepCosts(BUCKETS, BUCKETS))


def _decodes(n, request_class="default", seed=None, prefix="r"):
    return [Request([1, 2, 3], SamplingParams(seed=seed), request_id=f"{prefix}{i}", request_class=request_class)
            for i in range(n)]


def _teach(proposer, request_class, outcomes, times=20):
    """Feeds the (num_draft, num_accepted) verify outcomes `times` over, as a request of the class."""
    r = Request([1], SamplingParams(), request_id="teacher", request_class=request_class)
    for _ in range(times):
        for num_draft, num_accepted in outcomes:
            proposer.record(r, num_draft, num_accepted, 0)


@pytest.mark.parametrize("field, value, error", [
    ("tree_nodes", 1.5, "tree_nodes must be an integer, got 1.5"),
    ("tree_nodes", True, "tree_nodes must be an integer, got True"),
    ("tree_branching", "4", "tree_branching must be an integer, got '4'"),
    ("num_speculative_tokens", None, "num_speculative_tokens must be an integer, got None"),
    ("min_acceptance", "0.1", "min_acceptance must be a number"),
    ("num_speculative_tokens", 0, r"tree_nodes=15 needs num_speculative_tokens >= 1"),
])
def test_bad_speculation_settings_are_named(field, value, error):
    """Wrong types fail where the settings are made, naming the setting, not in a later step."""
    with pytest.raises(ValueError, match=error):
        SpeculationConfig(**{"num_speculative_tokens": 4, "method": "eagle", "tree_nodes": 15, field: value})
    config = SpeculationConfig(np.int64(4), min_acceptance=np.float32(0.25))  # numpy scalars are fine
    assert type(config.num_speculative_tokens) is int and config.ladder == (1, 2, 4)
    assert type(config.min_acceptance) is float


def test_expected_accepted_is_the_geometric_sum():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4 and expected_accepted(0.0, 4) == 0


def test_oracle_tree_acceptance_follows_each_root_down_its_own_path():
    # Depth 1 holds the target's token at positions 0, 1, 2 with top-1 and everywhere with top-2; depth 2 at
    # position 1 (the root 0's second token) with top-2 only, depth 3 at position 2 with either.
    hits = np.zeros((3, 5, 2), bool)
    hits[0, :3, 0] = True
    hits[0, :, 1] = True
    hits[1, 1, 1] = True
    hits[2, 2, :] = True
    got = oracle_tree_acceptance(hits)
    # Root 0: depth 1 (top-1 and top-2), depth 2 only with top-2, then depth 3 at position 2 too.
    # Roots 1-4: depth 1 where it holds; their depth-2 positions (2..5) never do. Past the end is a miss.
    np.testing.assert_array_equal(got[:, 0], [2, 2, 2, 1, 1])
    np.testing.assert_array_equal(got[:, 1], [4, 2, 2, 2, 2])


def test_step_costs_average_and_buckets():
    costs = StepCosts(BUCKETS, BUCKETS)
    assert costs.get(4, 1, 2) is None
    costs.observe(4, 1, 2, 2.0)  # a slow first step
    costs.observe(4, 1, 2, 1.0)
    assert costs.get(4, 1, 2) == pytest.approx(1.5)  # the first five steps: their plain average
    for _ in range(3):
        costs.observe(4, 1, 2, 1.0)
    assert costs.get(4, 1, 2) == pytest.approx(1.2)
    costs.observe(4, 1, 2, 2.0)  # then a running mean, the past weighing 0.8
    assert costs.get(4, 1, 2) == pytest.approx(0.8 * 1.2 + 0.2 * 2.0)
    assert costs.shape(3, 11) == (16, 4) and costs.shape(1, 65) is None
    assert costs.estimate(4, 1, 2, 0, 4, 0.5, 0) == costs.get(4, 1, 2)  # measured shapes are their average


def test_priors_come_from_the_cheapest_step_of_each_bucket():
    costs = StepCosts(BUCKETS, BUCKETS)
    costs.observe(4, 4, None, 0.060)  # the batch's plain step (long contexts)
    costs.observe(4, 1, None, 0.030)  # a 4-token prefill chunk: bucket 4's cheapest
    assert costs.prior(8) is None and costs.estimate(8, 4, 1, 0, 4, 0.060, 0) is None  # nothing from bucket 8 up
    costs.observe(32, 1, None, 0.090)
    assert costs.prior(8) == pytest.approx(0.030 + 0.060 * 4 / 28)  # between buckets 4 and 32
    costs.observe(8, 1, None, 0.036)
    assert costs.prior(8) == 0.036 and costs.prior(2) == 0.030  # its own; below the cheapest: bounded above
    # The plain step plus the difference of the two buckets' priors (the extra tokens' products).
    assert costs.estimate(8, 4, 1, 0, 4, 0.060, 0) == pytest.approx(0.060 + 0.036 - 0.030)


def test_step_costs_fit_seconds_per_attention_pair_across_shapes():
    """One slope, seconds per (query, key) pair, from the deviations of each shape's steps from its means;
    a shape is then priced at any context."""
    costs = StepCosts(BUCKETS, BUCKETS)
    assert attention_pairs(100, 1) == 101 and attention_pairs(100, 5) == 500 + 15
    assert costs.seconds_per_pair == 0
    for work in (1_000, 3_000, 5_000):
        costs.observe(4, 4, None, 0.020 + 2e-6 * work, work)  # the same shape at growing contexts
        costs.observe(8, 4, 4, 0.030 + 2e-6 * work, work)
    assert costs.seconds_per_pair == pytest.approx(2e-6)
    mean_seconds, mean_work = costs.get(4, 4, None), costs._means[(4, 4, None)][1]
    assert costs.get(4, 4, None, mean_work + 10_000) == pytest.approx(mean_seconds + 0.020)
    assert costs.get(8, 4, 4, 20_000) == pytest.approx(0.030 + 2e-6 * 20_000)
    # An unmeasured verify: the plain step, its bucket's extra products (none measured: 0), its extra pairs.
    assert costs.estimate(4, 2, 4, 9_000, 4, 0.050, 4_000) == pytest.approx(0.050 + 2e-6 * 5_000)


@pytest.mark.parametrize("context, drafts", [(100, 4), (10_000, 0)])
def test_a_verify_measured_at_short_contexts_is_priced_at_this_steps(context, drafts):
    """The 5-token verify was measured at a 100-token context (21 ms, about the plain step there); at a
    10,000-token context each draft token attends 10,000 more pairs (100 ms at the fitted 10 us per pair;
    the plain step takes 120 ms), so with alpha 1/2 no draft length pays, although the verify's measured
    mean alone would say it does."""
    p = _gate(SpeculationConfig(4, min_acceptance=0.01), {"r0": 4})
    _teach(p, "default", [(4, 1)])  # alpha 1 / 2
    p.costs.observe(1, 1, None, 0.020, 100)
    p.costs.observe(1, 1, None, 0.120, 10_100)  # the plain step at a long context: 10 us per pair
    p.costs.observe(8, 1, 4, 0.021, attention_pairs(100, 5))
    [r] = _decodes(1)
    r.num_computed_tokens = context
    p.begin_step([r], 0)
    assert p.draft_len(r, 0) == drafts


def test_cheap_verify_and_good_acceptance_draft_the_full_k():
    p = _gate(SpeculationConfig(4), {"r0": 4})
    _teach(p, "default", [(4, 3)])  # alpha 3 / 4
    assert p.alpha(_decodes(1)[0]) == pytest.approx(0.75, abs=0.01)
    p.costs.observe(1, 1, None, 0.020)
    p.costs.observe(8, 1, 4, 0.023)  # a 5-token verify costs 1.15 plain steps
    p.costs.observe(2, 1, 4, 0.021)  # a host proposer compiles one verify program, K = 4
    p.costs.observe(4, 1, 4, 0.022)
    [r] = _decodes(1)
    p.begin_step([r], 0)
    # 1 + E(0.75, 4) = 3.05 tokens in 23 ms beats 1 + E(0.75, 2) = 2.31 in 22 ms and 1 in 20 ms.
    assert p.draft_len(r, 0) == 4


def test_expensive_verify_turns_drafting_off_for_the_step():
    p = _gate(SpeculationConfig(4), {f"r{i}": 4 for i in range(16)})
    _teach(p, "default", [(4, 1), (4, 0)])  # alpha 1 / 3
    assert p.alpha(_decodes(1)[0]) == pytest.approx(1 / 3, abs=0.03)
    p.costs.observe(16, 16, None, 0.040)
    for T in (32, 64):
        p.costs.observe(T, 16, 4, 0.040 * T / 16)  # the step is compute-bound: cost grows with its tokens
    rs = _decodes(16)
    p.begin_step(rs, 0)
    assert [p.draft_len(r, 0) for r in rs] == [0] * 16
    # The policy still allows drafting (the gate only skips this step).
    assert all(p.wanted(r, 0) == 4 for r in rs)


def test_a_device_proposer_must_beat_the_target_alone_not_its_upkeep_step():
    """A device proposer's no-draft step (K = 0) still runs its upkeep pass; the gate weighs drafting against the
    target alone (K = None), which the steps run once the class is released, where that is measured."""
    p = _gate(SpeculationConfig(4), {"r0": 4})
    p.proposer.on_device = True
    _teach(p, "default", [(4, 1), (4, 0)])  # alpha 1 / 3: 1 + E(1/3, 4) = 1.49 tokens per verify
    p.costs.observe(1, 1, 0, 0.026)  # the head's upkeep makes a no-draft step 30% dearer than the target's
    p.costs.observe(8, 1, 4, 0.030)
    [r] = _decodes(1)
    p.begin_step([r], 0)
    assert p.draft_len(r, 0) > 0  # 1.49 tokens in 30 ms beats 1 in 26 ms
    p.costs.observe(1, 1, None, 0.020)
    p.begin_step([r], 1)
    assert p.draft_len(r, 1) == 0  # but not 1 in 20 ms


def test_only_the_classes_that_pay_draft():
    want = {f"{c}{i}": 2 for c in "ab" for i in range(2)}
    p = _gate(SpeculationConfig(2, min_acceptance=0.01), want)  # the floor leaves both classes on
    _teach(p, "good", [(2, 2)] * 4 + [(2, 1)])  # alpha 9 / 10
    _teach(p, "bad", [(2, 1)] + [(2, 0)] * 4)  # alpha 1 / 6
    assert p.alpha(_decodes(1, "bad")[0]) == pytest.approx(1 / 6, abs=0.03) and p.policy.class_k("bad") == 2
    p.costs.observe(4, 4, None, 0.030)
    p.costs.observe(8, 4, 2, 0.033)  # up to 8 tokens: every row drafting 1, or two rows drafting 2
    p.costs.observe(16, 4, 2, 0.060)  # three or four rows drafting 2 pad to 16 tokens
    rs = _decodes(2, "good", prefix="a") + _decodes(2, "bad", prefix="b")
    p.begin_step(rs, 0)
    assert [p.draft_len(r, 0) for r in rs] == [2, 2, 0, 0]


def test_unmeasured_shapes_are_explored_and_plain_is_measured_first():
    p = _gate(SpeculationConfig(2), {"r0": 2})
    [r] = _decodes(1)
    p.begin_step([r], 0)
    assert p.draft_len(r, 0) == 0  # no plain step measured for this batch size yet
    p.costs.observe(1, 1, None, 0.020)
    p.begin_step([r], 1)
    assert p.draft_len(r, 1) == 2  # nothing measured from the verify's bucket up: counted as plain, so tried
    p.costs.observe(4, 1, 2, 0.050)  # 3 tokens (alpha 1 so far) in 2.5 plain steps
    p.begin_step([r], 2)
    assert p.draft_len(r, 2) == 1  # bucket 2 is priced between buckets 1 and 4 (0.030): 2 tokens in 1.5
    p.costs.observe(2, 1, 2, 0.045)  # the one verify program (K = 2) ran a 1-token draft
    p.begin_step([r], 3)
    assert p.draft_len(r, 3) == 2
    _teach(p, "default", [(2, 0)])  # nothing is ever accepted
    p.begin_step([r], 4)
    assert p.draft_len(r, 4) == 0


def test_seeded_requests_keep_their_own_k_and_adaptation_off_means_no_gate():
    p = _gate(SpeculationConfig(2), {"r0": 2})
    [seeded] = _decodes(1, seed=5)
    p.begin_step([seeded], 0)  # nothing measured: an unseeded request would not draft
    assert p.draft_len(seeded, 0) == 2
    p.costs.observe(1, 1, None, 0.020)
    p.costs.observe(4, 1, 2, 0.500)
    p.begin_step([seeded], 1)
    assert p.draft_len(seeded, 1) == 2
    # A greedy request's output is the target's argmax whatever is drafted: seeded or not, the gate chooses.
    greedy = Request([1, 2, 3], SamplingParams(temperature=0.0, seed=5), request_id="g")
    p.proposer.want["g"] = 2
    p.begin_step([greedy], 2)
    assert p.wanted(greedy, 2) == 2 and p.draft_len(greedy, 2) == 0
    raw = _gate(SpeculationConfig(2, min_acceptance=0.0), {"r0": 2})
    raw.costs.observe(1, 1, None, 0.020)
    raw.costs.observe(4, 1, 2, 0.500)
    [r] = _decodes(1)
    raw.begin_step([r], 0)
    assert raw.draft_len(r, 0) == 2


def test_ngram_acceptance_is_estimated_per_matched_size():
    p = Gate(NgramProposer(SpeculationConfig(2, method="ngram")))
    two = Request([5, 7, 1, 2, 5, 7], SamplingParams(), request_id="two")  # the 2-gram [5, 7] recurs
    one = Request([9, 1, 2, 9], SamplingParams(), request_id="one")  # only the 1-gram [9] recurs
    assert p.wanted(two, 0) == 2 and p.wanted(one, 0) == 2
    assert p.proposer.acceptance_key(two) == ("default", 2) and p.proposer.acceptance_key(one) == ("default", 1)
    for _ in range(30):
        p.record(two, 2, 2, 0)
        p.record(one, 2, 0, 0)
    assert p.alpha(two) > 0.95 and p.alpha(one) < 0.05


def test_ngram_never_switches_a_request_off():
    p = Gate(NgramProposer(SpeculationConfig(4, method="ngram")))
    unseeded = Request([9, 1, 2, 9], SamplingParams(), request_id="u")
    seeded = Request([9, 1, 2, 9], SamplingParams(seed=3), request_id="s")
    capped = Request([9, 1, 2, 9], SamplingParams(num_speculative_tokens=1), request_id="c")
    for step in range(10):
        p.record(unseeded, 4, 0, step)
        p.record(seeded, 4, 0, step)
    assert p.policy_k(unseeded, 10) == 4 and p.policy_k(seeded, 10) == 4 and p.policy_k(capped, 10) == 1
    assert p.alpha(unseeded) < 0.05  # what the gate weighs next time a 1-gram matches


def test_a_host_proposer_compiles_one_verify_program():
    p = Gate(NgramProposer(SpeculationConfig(4, method="ngram")))
    assert p.proposer.program_ks == (4,) and SpeculationConfig(4).ladder == (1, 2, 4)


def test_the_gate_chooses_for_seeded_ngram_requests_too():
    p = Gate(NgramProposer(SpeculationConfig(2, method="ngram")))
    p.costs = StepCosts(BUCKETS, BUCKETS)
    seeded = Request([9, 1, 2, 9], SamplingParams(seed=3), request_id="s", output_token_ids=[9])
    p.costs.observe(1, 1, None, 0.020)
    p.costs.observe(2, 1, 2, 0.060)
    p.costs.observe(4, 1, 2, 0.060)
    p.begin_step([seeded], 0)
    assert p.wanted(seeded, 0) == 2 and p.draft_len(seeded, 0) == 0


def test_an_unmeasured_verify_shape_is_priced_like_a_measured_prefill_of_its_bucket():
    p = _gate(SpeculationConfig(2), {f"r{i}": 2 for i in range(16)})
    _teach(p, "default", [(2, 1)])  # alpha 1 / 2
    p.costs.observe(16, 16, None, 0.040)
    p.costs.observe(32, 1, None, 0.100)  # a 32-token prefill chunk
    p.costs.observe(64, 1, None, 0.190)
    assert p.costs.prior(32) == 0.100 and p.costs.prior(8) == 0.040 and p.costs.prior(128) is None
    rs = _decodes(16)
    p.begin_step(rs, 0)
    assert [p.draft_len(r, 0) for r in rs] == [0] * 16  # 16 + 8 expected tokens in 2.5x the time: no


@pytest.mark.parametrize("accepts, drafts", [(2, False), (6, True)])
def test_an_unmeasured_verify_costs_the_plain_step_plus_its_extra_tokens(accepts, drafts):
    """The batch's plain step (long contexts) costs twice a bare step of its bucket; a verify in the next
    bucket is priced as the plain step plus the products of 4 more tokens (a bare 8-token step costs 0.030 s
    more than a 4-token one): 1.5 plain steps (not 1, as its cheapest measured step alone would say), so it
    pays with alpha 0.75 (4 rows: 4 + 3 tokens in 1.5 plain steps) but not with 0.25."""
    p = _gate(SpeculationConfig(2, min_acceptance=0.01), {f"r{i}": 1 for i in range(4)})  # the policy keeps K
    _teach(p, "default", [(1, int(i < accepts)) for i in range(8)])
    p.costs.observe(4, 4, None, 0.060)  # this batch's plain step
    p.costs.observe(4, 1, None, 0.030)  # a 4-token prefill chunk: the cheapest step of bucket 4
    p.costs.observe(8, 1, None, 0.060)  # and of bucket 8
    rs = _decodes(4)
    p.begin_step(rs, 0)
    assert [p.draft_len(r, 0) for r in rs] == [1 if drafts else 0] * 4


class _Tree(_Want):
    """A host proposer of 12-node token trees, 4 deep: depth 1 for the first 2 nodes, 2 up to 6, 3 up to 11."""

    def proposal_len(self, request, k):
        return 12

    def depth(self, request, k):
        return 0 if k == 0 else 1 if k < 3 else 2 if k < 7 else 3 if k < 12 else 4


@pytest.mark.parametrize("window_ms,want", [({2: 20.5, 4: 21, 8: 30, 16: 41}, 3),
                                            ({2: 20, 4: 20, 8: 20, 16: 20}, 12)], ids=["cpu", "gpu"])
def test_the_gate_cuts_trees_to_the_window_that_pays(window_ms, want):
    """Trees are cut at 1, 3, 7 nodes (windows of 2, 4, 8 tokens) or kept whole. At alpha 0.5, where a wide
    window costs more (CPU) 3 nodes win: 1 + E(0.5, 2) = 1.75 tokens in 21 ms; where windows cost the same
    (GPU) the whole tree, 4 deep."""
    config = SpeculationConfig(4, method="ngram", tree_nodes=12)
    p = _gate(config, {"r0": 12}, _Tree)
    assert p.gate_caps == (1, 3, 7, 12)
    _teach(p, "default", [(4, 1)])  # alpha 0.51: one of two tried path positions accepted
    assert p.alpha(_decodes(1)[0]) == pytest.approx(0.5, abs=0.01)
    p.costs.observe(1, 1, None, 0.020)
    for T, ms in window_ms.items():
        p.costs.observe(T, 1, 12, ms / 1000)
    [r] = _decodes(1)
    p.begin_step([r], 0)
    assert p.draft_len(r, 0) == want


def test_a_verify_observes_what_every_smaller_cut_would_have_accepted():
    """A 3-node verify accepting the nodes of rank 0 and 2: cut 1 holds the first (1 accepted), cut 2 too (rank 2
    is outside it), cut 3 both (its depth 2 allows them); cuts 4 and 5 are not observed and stay at the prior."""
    cuts = CutAcceptance([0, 1, 2, 2, 3, 3], decay=0.5, relax_decay=0.9)
    assert [cuts.expected(n) for n in range(6)] == [0, 1, 2, 2, 3, 3]  # optimistic prior: every level accepted
    cuts.add(3, [0, 2])
    # (0.5 x prior + observation) / (0.5 + 1)
    assert [cuts.expected(n) for n in range(1, 6)] == pytest.approx([1, 2 / 1.5, 2, 3, 3])
    for _ in range(30):
        cuts.add(5, [0, 1, 4])  # a deeper path: cut 5 (depth 3) holds all three, cuts 2 to 4 two, cut 1 one
    assert [cuts.expected(n) for n in range(1, 6)] == pytest.approx([1, 2, 2, 2, 3])
    assert cuts.expected(9) == cuts.expected(5)  # wider requests than the tree price as the whole tree
    for _ in range(30):
        cuts.add(1, [])  # cut 1 misses every time; cuts 2..5 are no longer observed and drift to the prior
    assert cuts.expected(1) == pytest.approx(0, abs=1e-6)
    kept = 0.9 ** 30  # of cut 4's distance to the prior, and of its evidence
    assert [cuts.expected(n) for n in range(2, 6)] == pytest.approx([2, 2, 3 - kept, 3])
    cuts.add(5, [0, 1, 4])  # a fresh verify outweighs cut 4's stale past (weight 2 x 0.9^30)
    assert cuts.expected(4) == pytest.approx(3 - kept - (1 - kept) / (1 + 0.5 * 2 * kept))
    assert cuts.expected(4) < 2.05
    cuts.relax()  # a held step: every cut moves toward the prior
    assert cuts.expected(1) == pytest.approx(0.9 * 0.5 + 0.1 * 1)  # 0.5 after the fresh hit, a tenth of the way to 1


@pytest.mark.parametrize("ranks,want", [([0, 4, 8, 11], 12), ([0], 1)], ids=["deep", "first-only"])
def test_trees_are_priced_by_what_each_cut_accepted(ranks, want):
    """At alpha 0.5 one geometric alpha prices 3 nodes best on the CPU windows above (1.75 tokens in 21 ms).
    Measured per cut it depends on where the accepted nodes rank: ranks 0, 4, 8, 11 of 12 nodes give cut 1 one
    token, cut 3 one, cut 7 two, the whole tree four (5 tokens in 41 ms beat 2 in 20.5); only the first
    node accepted: the one-node cut (2 tokens in 20.5 ms)."""
    p = _gate(SpeculationConfig(4, method="ngram", tree_nodes=12), {"r0": 12}, _Tree)
    _teach(p, "default", [(4, 1)])
    teacher = Request([1], SamplingParams(), request_id="teacher")
    for _ in range(40):
        p.record_tree(teacher, 12, ranks)
    p.costs.observe(1, 1, None, 0.020)
    for T, ms in {2: 20.5, 4: 21, 8: 30, 16: 41}.items():
        p.costs.observe(T, 1, 12, ms / 1000)
    [r] = _decodes(1)
    p.begin_step([r], 0)
    assert p.draft_len(r, 0) == want


def test_a_held_class_is_tried_again_and_held_again_on_fresh_misses():
    p = _gate(SpeculationConfig(2, min_acceptance=0.01), {"r0": 1})
    _teach(p, "bad", [(2, 1)] + [(2, 0)] * 4)  # alpha 1/6
    p.costs.observe(1, 1, None, 0.030)
    p.costs.observe(2, 1, 2, 0.040)  # one draft pays when alpha > 1/3
    r = _decodes(1, "bad")[0]
    drafts = []
    for step in range(100):
        p.begin_step([r], step)
        drafts.append(p.draft_len(r, step))
        if drafts[-1]:
            break
    # Held while the evidence says 1/6; each held step relaxes alpha toward the prior until a draft pays.
    assert drafts[:20] == [0] * 20 and drafts[-1] == 1 and 1 / 3 < p.alpha(r) < 0.4
    p.record(r, 1, 0, len(drafts))  # the retry accepts nothing: held again
    p.begin_step([r], len(drafts))
    assert p.draft_len(r, len(drafts)) == 0 and p.alpha(r) < 1 / 3


def _run_realized(p, rows, steps, drafted_seconds, drafted_tokens, plain=0.020):
    """Runs `steps` gate decisions over `rows`; a step that drafts takes `drafted_seconds` and emits
    `drafted_tokens` per drafting row (the gate's estimates never learn it: no verify is recorded), a plain
    step takes `plain`. Returns the engine steps that drafted."""
    drafted = []
    for step in range(steps):
        p.begin_step(rows, step)
        for r in rows:
            r.num_computed_tokens = 3  # fixed contexts: each step is priced the same
        seqs = [ScheduledSeq(r, 3, 1 + p.draft_len(r, step), True, p.draft_len(r, step)) for r in rows]
        if any(s.num_draft for s in seqs):
            drafted.append(step)
            p.observe_step(seqs, [drafted_tokens if s.num_draft else 1 for s in seqs], drafted_seconds)
        else:
            p.observe_step(seqs, [1] * len(seqs), plain)
    return drafted


def test_drafting_that_does_not_pay_costs_at_most_its_budget():
    """The gate's model says drafting pays (a cheap verify, alpha 1) but every drafting step really takes two
    plain steps and accepts nothing: drafting stops once the start credit is spent, and after that only the
    budget's 1% of the class's time goes to drafts (the exploration that would notice a change)."""
    p = _gate(SpeculationConfig(2, min_acceptance=0.01), {f"r{i}": 2 for i in range(4)})
    p.costs.observe(4, 4, None, 0.020, 4 * attention_pairs(3, 1))
    p.costs.observe(8, 4, 2, 0.021, 4 * attention_pairs(3, 3))
    rows = _decodes(4)
    drafted = _run_realized(p, rows, 1000, drafted_seconds=0.040, drafted_tokens=1)
    # Each drafting step is charged one plain step and the margin's 0.05 and earns 0.02 (the step after it is
    # charged 0.05 and earns 0.01), each plain step earns 0.01. The credit starts at 2 and drafting stops the
    # first time it is not positive.
    assert drafted[:2] == [0, 1] and 2 not in drafted
    loss = len(drafted) / 1000  # extra plain steps per step
    assert 0.7 * DraftRegret.BUDGET < loss <= DraftRegret.BUDGET + (DraftRegret.START + 1) / 1000
    assert any(step > 900 for step in drafted)  # it keeps exploring, within the budget
    assert not p.regret.allows("default", 4) or p.regret.credit("default", 4) <= DraftRegret.BUDGET * 2


def test_drafting_that_pays_is_never_stopped_and_the_account_is_per_batch_bucket():
    p = _gate(SpeculationConfig(2, min_acceptance=0.01), {f"{c}{i}": 2 for c in "rq" for i in range(4)})
    p.costs.observe(1, 1, None, 0.020, attention_pairs(3, 1))
    p.costs.observe(4, 1, 2, 0.021, attention_pairs(3, 3))
    p.costs.observe(4, 4, None, 0.020, 4 * attention_pairs(3, 1))
    p.costs.observe(8, 4, 2, 0.021, 4 * attention_pairs(3, 3))
    one = _decodes(1)
    # Batch 1: 3 tokens in 1.2 plain steps, every step.
    assert _run_realized(p, one, 100, drafted_seconds=0.024, drafted_tokens=3) == list(range(100))
    assert p.regret.credit("default", 1) == DraftRegret.CAP
    # Batch 4 (its own account): drafting there loses, and stops, while batch 1 keeps drafting.
    four = _decodes(4, prefix="q")
    assert _run_realized(p, four, 12, drafted_seconds=0.040, drafted_tokens=1) == [0, 1]
    assert not p.regret.allows("default", 4) and p.regret.allows("default", 1)
    rates = p.regret.tokens_per_second()
    assert rates[("default", True)] < rates[("default", False)]  # the last steps drafted at batch 4 and lost


def test_chains_are_cut_to_any_length_on_the_host_and_to_the_ladder_on_the_device():
    """A host proposer's one verify program serves every draft length, so the gate tries them all: at alpha
    0.75, K = 3 fills a 4-token window (1 + E(0.75, 3) = 2.73 tokens in 22 ms) where K = 4 pads to 8 tokens
    (3.05 in 30 ms) and K = 2 leaves a slot unused (2.31 in 21 ms). A device proposer has a program per ladder length (4, 2, 1) and is cut to those."""
    host = _gate(SpeculationConfig(4), {"r0": 4})
    assert host.gate_caps == (1, 2, 3, 4) and host.proposer.program_ks == (4,)
    device = _gate(SpeculationConfig(4), {"r0": 4})
    device.proposer.on_device = True
    assert device.gate_caps == (1, 2, 4) == device.proposer.program_ks
    _teach(host, "default", [(4, 3)])
    host.costs.observe(1, 1, None, 0.020)
    host.costs.observe(2, 1, 4, 0.021)
    host.costs.observe(4, 1, 4, 0.022)
    host.costs.observe(8, 1, 4, 0.030)
    [r] = _decodes(1)
    host.begin_step([r], 0)
    assert host.draft_len(r, 0) == 3


def test_the_plain_steps_measured_alongside_price_the_regret():
    """The gate's step costs say a plain batch-4 step takes 30 ms (an early slow stretch), so its drafts look
    like gains: 5 tokens in 28 ms. The class's own plain steps, run in between, take 20 ms: 5 tokens are
    worth 25 ms, and each drafting step loses 3 ms. Once the plain arm has its steps, the account charges
    that loss, the credit runs out, and drafting falls from every third step to what the budget pays for:
    the loss stays within 1% of the time (each drafting step loses 0.15 plain steps; each step earns 0.01)."""
    p = _gate(SpeculationConfig(2, min_acceptance=0.01), {f"r{i}": 2 for i in range(4)})
    p.costs.observe(4, 4, None, 0.030, 4 * attention_pairs(3, 1))
    p.costs.observe(8, 4, 2, 0.021, 4 * attention_pairs(3, 3))
    rows, drafted = _decodes(4), []
    for step in range(900):
        for r in rows:
            p.proposer.want[r.request_id] = 2 if step % 3 == 0 else 0  # a lookup matches every third step
            r.num_computed_tokens = 3
        p.begin_step(rows, step)
        seqs = [ScheduledSeq(r, 3, 1 + p.draft_len(r, step), True, p.draft_len(r, step)) for r in rows]
        if any(s.num_draft for s in seqs):
            drafted.append(step)
            p.observe_step(seqs, [2, 1, 1, 1], 0.028)
        else:
            p.observe_step(seqs, [1] * 4, 0.020)
    assert drafted[:10] == list(range(0, 30, 3))  # priced by the gate's plain step at first: gains
    late = [s for s in drafted if s >= 600]
    assert 10 < len(late) < 30  # of the 100 steps where a lookup matched
    loss, time = len(late) * (0.028 - 5 * 0.020 / 4), len(late) * 0.028 + (300 - len(late)) * 0.020
    assert loss / time <= DraftRegret.BUDGET * 1.1
    rates = p.regret.tokens_per_second()
    assert rates[("default", False)] == pytest.approx(4 / 0.020)


def test_a_steep_attention_slope_never_prices_a_step_at_zero():
    """Long contexts measured, then a batch of short ones: the fitted per-pair cost extrapolated to the short
    contexts went below zero, the plain step was priced at 0 s and the gate divided by it (a crash of the
    engine thread in the speculative benchmark). The price now keeps a tenth of the measured step."""
    p = _gate(SpeculationConfig(2, min_acceptance=0.01), {f"r{i}": 2 for i in range(4)})
    for long, seconds in [(4000, 0.010), (40000, 0.200)] * 10:
        p.costs.observe(4, 4, None, seconds, 4 * attention_pairs(long, 1))
    rows = _decodes(4)
    for r in rows:
        r.num_computed_tokens = 3
    work = 4 * attention_pairs(3, 1)
    mean = p.costs.get(4, 4, None)
    assert mean + p.costs.seconds_per_pair * (work - p.costs._means[(4, 4, None)][1]) < 0  # the raw fit
    assert p.costs.get(4, 4, None, work) == pytest.approx(StepCosts.MIN_SHARE * mean)
    p.begin_step(rows, 0)  # no ZeroDivisionError
