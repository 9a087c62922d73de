"""Speculative verification (engine/spec/verify.py): exactness of the emitted distribution, greedy
rows, filtering order, and agreement with the plain sampler.

Statistical power. Every distribution test uses Pearson's chi-square at
significance ALPHA = 0.001 on N = 60,000 independent rows (one batched call,
one seed per row). Any alternative at total-variation distance delta from the
expected distribution has chi-square divergence sum((a-e)^2/e) >= (2 delta)^2
(Cauchy-Schwarz), so Pearson's statistic is asymptotically noncentral
chi-square with lambda >= N (2 delta)^2 = 96 for delta = 0.02. Power at
ALPHA = 0.001 (scipy.stats.ncx2): 8 cells (df 7) > 0.9999; the 64-cell joint
(df 63) 0.9968. `test_power_is_as_stated` recomputes these numbers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from engine.sampler import filter_logits, sample
from engine.spec.verify import sample_draft, verify
from tests import chi2

ALPHA = 1e-3
N = 60_000
V, K = 8, 3
START = 5  # position of the first draft token


def _settings(S, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return (jnp.full(S, temperature, jnp.float32), jnp.full(S, top_k, jnp.int32),
            jnp.full(S, top_p, jnp.float32), jnp.full(S, min_p, jnp.float32))


def _q(logits, **kw):
    """The target distribution after filtering, float64 [V]."""
    t, k, p, m = _settings(1, **kw)
    return np.asarray(jax.nn.softmax(filter_logits(jnp.asarray(logits[None]), t, k, p, m)), np.float64)[0]


def _chi2_pvalue(samples, expected_probs):
    """Pearson chi-square p-value of `samples` against `expected_probs` over its support;
    0 if any sample falls outside the support."""
    expected_probs = np.asarray(expected_probs, np.float64).ravel()
    counts = np.bincount(samples, minlength=expected_probs.size)
    support = expected_probs > 0
    if counts[~support].any():
        return 0.0
    e = expected_probs[support] / expected_probs[support].sum() * len(samples)
    return stats.chisquare(counts[support], e).pvalue


def test_power_is_as_stated():
    lam = N * (2 * 0.02) ** 2
    for df, power in [(7, 0.9999), (63, 0.99)]:
        assert stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, lam) >= power


@pytest.mark.parametrize("shape", ["flat", "tail", "filtered"])
def test_chi2_cells_state_a_power_the_test_reaches(shape):
    """tests/chi2.py: on 64 cells (a flat joint; a long tail, partly merged; one with zeros, as filters leave),
    Pearson's test of 5000 samples (a power well below 1, so the check says something) rejects random
    alternatives at TV 0.05 at least as often as `Cells.power` says (1000 simulated tests each, less 3 standard
    errors), and the expected distribution itself about ALPHA of the time."""
    rng = np.random.default_rng(0)
    probs = {"flat": rng.dirichlet(np.full(64, 20.0)), "tail": rng.dirichlet(np.full(64, 0.6)),
             "filtered": rng.dirichlet(np.full(64, 2.0)) * (rng.random(64) < 0.5)}[shape]
    n, trials = 5000, 1000
    cells = chi2.Cells(probs, n)
    assert 0.5 < cells.power < 0.99, cells
    for seed in range(3):
        wrong = chi2.perturbed(probs, seed=seed).ravel()
        rejected = np.mean([cells.pvalue(c) < chi2.ALPHA for c in rng.multinomial(n, wrong, trials)])
        assert rejected >= cells.power - 3 * np.sqrt(cells.power * (1 - cells.power) / trials), (cells, rejected)
    right = probs / probs.sum()
    assert np.sum([cells.pvalue(c) < chi2.ALPHA for c in rng.multinomial(n, right, trials)]) <= 6


def _draft(draft_logits, seeds, start, settings):
    """Draft tokens [N, K] and p [N, K, V] drawn by `sample_draft` at positions start..start+K-1."""
    tokens, probs = [], []
    for i in range(K):
        logits = jnp.broadcast_to(jnp.asarray(draft_logits[i]), (len(seeds), V))
        tok, p = sample_draft(logits, *settings, seeds, jnp.full(len(seeds), start + i, jnp.int32))
        tokens.append(tok)
        probs.append(p)
    return jnp.stack(tokens, 1), jnp.stack(probs, 1)


def _speculate(target_logits, draft_logits, seeds, num_draft, start, **kw):
    """One verify call with a context-free target: slot i scores position start+i with target_logits[i]."""
    settings = _settings(len(seeds), **kw)
    tokens, probs = _draft(draft_logits, seeds, start, settings)
    tl = jnp.broadcast_to(jnp.asarray(target_logits[:K + 1]), (len(seeds), K + 1, V))
    out, n = verify(tl, probs, tokens, num_draft, *settings, seeds, jnp.full(len(seeds), start, jnp.int32))
    return np.asarray(out), np.asarray(n)


@pytest.fixture(scope="module")
def logits():
    rng = np.random.default_rng(0)
    # Position START+j has target logits TL[j] and draft logits DL[j]; moderate spreads keep
    # every cell's expected count large and the draft far enough from the target to be rejected often.
    TL = rng.normal(0.0, 0.8, (K + 2, V)).astype(np.float32)
    DL = (TL[:K + 1] + rng.normal(0.0, 0.8, (K + 1, V))).astype(np.float32)
    return TL, DL


def test_emitted_tokens_follow_the_target(logits):
    """First emitted token ~ q_0, and the first two tokens of a sequence ~ q_0 x q_1.

    The second token is the first call's second emitted token, or, when the
    first call emitted one token, the first token of the next call at START+1
    (whose randomness reuses positions the first call discarded, as the engine will).
    Rows use num_draft 0..K, so K_i = 0 rows and short drafts are covered too.
    """
    TL, DL = logits
    seeds = jnp.arange(N, dtype=jnp.uint32)
    num_draft = jnp.asarray(np.arange(N) % (K + 1), jnp.int32)
    out1, n1 = _speculate(TL, DL, seeds, num_draft, START)
    out2, _ = _speculate(TL[1:], DL[1:], seeds, num_draft, START + 1)
    first = out1[:, 0]
    second = np.where(n1 >= 2, out1[:, 1], out2[:, 0])
    q0, q1 = _q(TL[0]), _q(TL[1])
    assert _chi2_pvalue(first, q0) > ALPHA
    assert _chi2_pvalue(first * V + second, np.outer(q0, q1)) > ALPHA
    # Speculation did happen: a good share of rows accepted draft tokens.
    assert 0.2 < np.mean(n1[np.asarray(num_draft) > 0] > 1) < 0.9


@pytest.mark.parametrize("kw", [{"temperature": 0.5}, {"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.4},
                                {"temperature": 1.5, "top_p": 0.8}])
def test_target_distribution_is_taken_after_filtering(logits, kw):
    """Emitted tokens follow the filtered q; the unfiltered q (what a verifier that applied
    the settings after, or not at all, would produce) is rejected."""
    TL, DL = logits
    seeds = jnp.arange(N, dtype=jnp.uint32) + 7 * N
    out, _ = _speculate(TL, DL, seeds, jnp.full(N, K, jnp.int32), START, **kw)
    q, q_unfiltered = _q(TL[0], **kw), _q(TL[0])
    assert 0.5 * np.abs(q - q_unfiltered).sum() > 0.05  # far enough apart for the test's power
    assert _chi2_pvalue(out[:, 0], q) > ALPHA
    assert _chi2_pvalue(out[:, 0], q_unfiltered) < 1e-9


def _draft_probs(logits, temperature, top_k, top_p, min_p):
    """Reference `p` [S, V]: softmax of the filtered logits; one-hot at the argmax for greedy rows."""
    t = jnp.where(temperature > 0, temperature, 1.0)
    probs = jax.nn.softmax(filter_logits(logits, t, top_k, top_p, min_p), axis=-1)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where((temperature > 0)[:, None], probs, one_hot)


def test_draft_sampler_draws_from_p_independently_of_the_sampler():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(np.broadcast_to(rng.normal(0, 1, V).astype(np.float32), (N, V)))
    settings = _settings(N, temperature=0.8, top_p=0.9)
    seeds, positions = jnp.arange(N, dtype=jnp.uint32), jnp.full(N, START, jnp.int32)
    tokens, probs = sample_draft(logits, *settings, seeds, positions)
    np.testing.assert_allclose(probs, _draft_probs(logits, *settings), rtol=1e-6)
    tokens = np.asarray(tokens)
    assert _chi2_pvalue(tokens, np.asarray(probs[0])) > ALPHA
    # The draft stream and the sampler's stream at the same (seed, position) are independent.
    plain = np.asarray(sample(logits, *settings, seeds, positions))
    support = np.flatnonzero(np.asarray(probs[0]) > 0)
    table = np.array([[np.sum((tokens == a) & (plain == b)) for b in support] for a in support])
    assert stats.chi2_contingency(table).pvalue > ALPHA


def test_greedy_rows_accept_while_draft_equals_argmax():
    argmax = np.array([[3, 1, 4, 1], [5, 2, 6, 5], [7, 0, 7, 3], [2, 2, 2, 2], [6, 6, 1, 0]])
    tl = jax.nn.one_hot(argmax, V) * 5.0
    draft = jnp.asarray([[3, 1, 4], [5, 0, 6], [0, 0, 7], [2, 2, 2], [6, 6, 1]], jnp.int32)
    num_draft = jnp.asarray([3, 3, 3, 1, 0], jnp.int32)
    settings = _settings(5, temperature=0.0)
    junk_p = jnp.full((5, K, V), 1.0 / V)
    out, n = verify(tl, junk_p, draft, num_draft, *settings, jnp.arange(5, dtype=jnp.uint32),
                    jnp.zeros(5, jnp.int32))
    np.testing.assert_array_equal(n, [4, 2, 1, 2, 1])
    np.testing.assert_array_equal(out, [[3, 1, 4, 1], [5, 2, -1, -1], [7, -1, -1, -1], [2, 2, -1, -1],
                                        [6, -1, -1, -1]])


def test_greedy_and_sampled_rows_share_a_batch():
    """A greedy row gives the same tokens alone and next to sampled rows."""
    rng = np.random.default_rng(2)
    tl = jnp.asarray(rng.normal(0, 1, (5, K + 1, V)).astype(np.float32))
    argmax = np.asarray(jnp.argmax(tl, -1))
    draft = jnp.asarray(np.concatenate([argmax[:, :2], np.zeros((5, 1))], axis=1), jnp.int32)
    probs = jax.nn.softmax(jnp.asarray(rng.normal(0, 1, (5, K, V)).astype(np.float32)))
    t = jnp.asarray([0.0, 1.0, 0.0, 0.7, 1.0])
    _, k, p, m = _settings(5)
    args = (jnp.full(5, K, jnp.int32), t, k, p, m, jnp.arange(5, dtype=jnp.uint32), jnp.zeros(5, jnp.int32))
    out, n = verify(tl, probs, draft, *args)
    for row in (0, 2):
        accepted = 3 if argmax[row, 2] == 0 else 2
        assert n[row] == accepted + 1
        np.testing.assert_array_equal(out[row, :accepted + 1], argmax[row, :accepted + 1])
        alone, n_alone = verify(tl[row:row + 1], probs[row:row + 1], draft[row:row + 1],
                                *(a[row:row + 1] for a in args))
        assert n_alone[0] == n[row]
        np.testing.assert_array_equal(alone[0], out[row])


def _random_case(S, V_, seed):
    rng = np.random.default_rng(seed)
    tl = jnp.asarray(rng.normal(0, 2, (S, K + 1, V_)).astype(np.float32))
    draft_logits = jnp.asarray(rng.normal(0, 2, (S, K, V_)).astype(np.float32))
    settings = (jnp.asarray(rng.choice([0.0, 0.7, 1.0, 1.3], S), jnp.float32),
                jnp.asarray(rng.choice([0, 1, 50], S), jnp.int32),
                jnp.asarray(rng.choice([1.0, 0.9, 0.5], S), jnp.float32),
                jnp.asarray(rng.choice([0.0, 0.05], S), jnp.float32))
    seeds = jnp.asarray(rng.integers(0, 2**32, S, dtype=np.uint64).astype(np.uint32))
    positions = jnp.asarray(rng.integers(0, 4000, S), jnp.int32)
    drafts = [sample_draft(draft_logits[:, i], *settings, seeds, positions + i) for i in range(K)]
    tokens = jnp.stack([d[0] for d in drafts], 1)
    probs = jnp.stack([d[1] for d in drafts], 1)
    return tl, probs, tokens, settings, seeds, positions


S_RANDOM, V_RANDOM = 64, 1000


def test_rows_without_drafts_match_the_plain_sampler():
    S = S_RANDOM
    tl, probs, tokens, settings, seeds, positions = _random_case(S, V_RANDOM, 3)
    out, n = verify(tl, probs, tokens, jnp.zeros(S, jnp.int32), *settings, seeds, positions)
    plain = sample(tl[:, 0], *settings, seeds, positions)
    np.testing.assert_array_equal(n, np.ones(S))
    np.testing.assert_array_equal(out[:, 0], plain)
    assert (np.asarray(out[:, 1:]) == -1).all()


def test_result_does_not_depend_on_batch_row_or_draft_length():
    S = S_RANDOM
    tl, probs, tokens, settings, seeds, positions = _random_case(S, V_RANDOM, 4)
    num_draft = jnp.asarray(np.arange(S) % (K + 1), jnp.int32)
    out, n = verify(tl, probs, tokens, num_draft, *settings, seeds, positions)
    perm = np.random.default_rng(5).permutation(S)
    take = lambda x: x[perm]
    out_p, n_p = verify(take(tl), take(probs), take(tokens), take(num_draft), *map(take, settings), take(seeds),
                        take(positions))
    np.testing.assert_array_equal(out_p, np.asarray(out)[perm])
    np.testing.assert_array_equal(n_p, np.asarray(n)[perm])
    for row, k in ((6, 2), (7, K)):  # num_draft 2 with K cut to 2; num_draft 3 alone
        assert int(num_draft[row]) == k
        one = lambda x, row=row: x[row:row + 1]
        out_1, n_1 = verify(tl[row:row + 1, :k + 1], probs[row:row + 1, :k], tokens[row:row + 1, :k],
                            one(num_draft), *map(one, settings), one(seeds), one(positions))
        assert int(n_1[0]) == int(n[row])
        np.testing.assert_array_equal(out_1[0], np.asarray(out)[row, :k + 1])
