"""On-device sampling: greedy, truncation masks, seeded reproducibility, and the sampled distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cpu_kernels
from engine.sampler import argmax, draw, filter_logits, sample, xla_draw, xla_filter_logits

# `filter_logits` runs the native kernel on CPU; `xla_filter_logits` is what other backends run: both are held
# to the same sorted definition.
FILTERS = pytest.mark.parametrize("filter_fn", [filter_logits, xla_filter_logits], ids=["default", "xla"])


def _arrays(S, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return (jnp.full(S, temperature, jnp.float32), jnp.full(S, top_k, jnp.int32),
            jnp.full(S, top_p, jnp.float32), jnp.full(S, min_p, jnp.float32))


PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = np.log(PROBS).astype(np.float32)


def _kept(filter_fn, **kw):
    t, k, p, m = _arrays(1, **kw)
    out = np.asarray(filter_fn(jnp.asarray(LOGITS[None]), t, k, p, m))[0]
    return set(np.flatnonzero(np.isfinite(out)).tolist())


@FILTERS
def test_filters_keep_the_expected_tokens(filter_fn):
    kept = lambda **kw: _kept(filter_fn, **kw)
    assert kept() == {0, 1, 2, 3, 4, 5}
    assert kept(top_k=2) == {0, 1}
    assert kept(top_p=0.35) == {0}  # the first token alone reaches it
    assert kept(top_p=0.5) == {0, 1}
    assert kept(top_p=0.81) == {0, 1, 2, 3}  # mass before token 3 is 0.8 < 0.81
    assert kept(min_p=0.3) == {0, 1, 2}  # >= 0.12
    assert kept(top_k=3, top_p=0.5) == {0, 1}


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native kernels here")
def test_the_cpu_sampler_runs_the_native_kernels():
    """The step programs' sampling is the native kernels' on CPU (a silent fallback to XLA would compile ~60
    more kernels into every step program)."""
    t, k, p, m = _arrays(2, top_p=0.5)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(2))
    hlo = jax.jit(lambda x: draw(filter_logits(x, t, k, p, m), keys)).lower(jnp.zeros((2, 8))).as_text()
    assert "jse_filter_logits" in hlo and "jse_draw" in hlo


def test_greedy_rows_take_argmax_and_mix_with_sampled_rows():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((4, 50)).astype(np.float32))
    t = jnp.asarray([0.0, 1.0, 0.0, 1.0])
    _, k, p, m = _arrays(4)
    out = np.asarray(sample(logits, t, k, p, m, jnp.arange(4, dtype=jnp.uint32), jnp.zeros(4, jnp.int32)))
    assert out[0] == np.argmax(logits[0]) and out[2] == np.argmax(logits[2])
    _, k1, _, _ = _arrays(4, top_k=1)
    out = np.asarray(sample(logits, jnp.ones(4), k1, p, m, jnp.arange(4, dtype=jnp.uint32), jnp.zeros(4, jnp.int32)))
    np.testing.assert_array_equal(out, np.argmax(np.asarray(logits), -1))


def test_seeded_row_does_not_depend_on_batch():
    rng = np.random.default_rng(1)
    row = rng.standard_normal(100).astype(np.float32)
    others = rng.standard_normal((7, 100)).astype(np.float32)
    alone = sample(jnp.asarray(row[None]), *_arrays(1), jnp.asarray([123], jnp.uint32), jnp.asarray([9], jnp.int32))
    batch = np.concatenate([others[:3], row[None], others[3:]])
    seeds = jnp.asarray([5, 6, 7, 123, 8, 9, 10, 11], jnp.uint32)
    together = sample(jnp.asarray(batch), *_arrays(8), seeds, jnp.full(8, 9, jnp.int32))
    assert int(alone[0]) == int(together[3])


@pytest.mark.parametrize("kw,support", [({}, 6), ({"temperature": 0.7}, 6), ({"top_p": 0.81}, 4),
                                         ({"top_k": 3}, 3)])
def test_sampled_distribution_matches_target(kw, support):
    """Chi-square goodness of fit over N=20000 draws (6 categories). With alpha = 1e-3 the
    test has power > 0.99 against a shift of 0.02 in any one probability; seeds are fixed."""
    from scipy.stats import chisquare

    N = 20000
    temperature = kw.get("temperature", 1.0)
    p = PROBS ** (1 / temperature)
    order = np.argsort(-p)
    keep = np.zeros(6, bool)
    keep[order[:kw.get("top_k", 6) or 6]] = True
    if "top_p" in kw:
        c = np.cumsum(p[order] / p.sum()) - p[order] / p.sum()
        keep &= np.isin(np.arange(6), order[c < kw["top_p"]])
    want = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (N, 6))
    tokens = np.asarray(sample(logits, *_arrays(N, **kw), jnp.full(N, 7, jnp.uint32), jnp.arange(N, dtype=jnp.int32)))
    counts = np.bincount(tokens, minlength=6)
    assert (counts[~keep] == 0).all()
    assert np.count_nonzero(keep) == support
    assert chisquare(counts[keep], N * want[keep]).pvalue > 1e-3


def _sorted_filter(logits, temperature, top_k, top_p, min_p):
    """The kept set by its definition, sorting each row (numpy)."""
    kept = []
    for x, t, k, p, m in zip(logits, temperature, top_k, top_p, min_p):
        s = x / t
        desc = np.sort(s)[::-1]
        probs = np.exp(desc - desc.max())
        probs /= probs.sum()
        threshold = desc[min(k, len(s)) - 1] if k > 0 else -np.inf
        if p < 1:
            n_keep = max(int(np.sum(np.cumsum(probs) - probs < p)), 1)
            threshold = max(threshold, desc[n_keep - 1])
        if m > 0:
            threshold = max(threshold, desc[0] + np.log(m))
        kept.append(s >= threshold)
    return np.array(kept)


@FILTERS
@pytest.mark.parametrize("V,scale", [(200, 3.0), (5000, 0.5), (5000, 4.0)])
def test_filter_equals_sorting_the_row(V, scale, filter_fn):
    """Both threshold paths: nuclei inside the top CANDIDATES (scale 4) and wider ones that
    need the bisection (scale 0.5 over 5000 tokens); rounded logits make ties."""
    rng = np.random.default_rng(V)
    S = 16
    for trial in range(4):
        x = (rng.standard_normal((S, V)) * scale).astype(np.float32)
        if trial % 2:
            x = np.round(x)
        t = rng.uniform(0.3, 1.5, S).astype(np.float32)
        k = rng.choice([0, 1, 7, 300, 1000], S).astype(np.int32)
        p = rng.choice([1.0, 0.9, 0.5, 0.999], S).astype(np.float32)
        m = rng.choice([0.0, 0.1, 0.01], S).astype(np.float32)
        got = np.isfinite(np.asarray(filter_fn(jnp.asarray(x), t, k, p, m)))
        # Float sums may place a token whose mass before it is within 1e-5 of top_p either side.
        tol = np.where(p < 1, 1e-5, 0).astype(np.float32)
        assert (got >= _sorted_filter(x, t, k, p - tol, m)).all()
        assert (got <= _sorted_filter(x, t, k, p + tol, m)).all()


@pytest.mark.parametrize("native", [True, False], ids=["default", "xla"])
def test_draw_follows_softmax_across_blocks_and_skips_excluded_tokens(native):
    """Chi-square over N=20000 draws from 300 tokens (3 blocks of the inverse CDF), 100 of them
    excluded: 40 kept tokens with most of the mass, and the rest pooled into one category so every
    expected count is >= 5. alpha = 1e-3; power > 0.99 against a shift of 0.02 in one probability."""
    from scipy.stats import chisquare

    N, V = 20000, 300
    rng = np.random.default_rng(3)
    scores = rng.standard_normal(V).astype(np.float32) * 2
    scores[rng.choice(V, 100, replace=False)] = -np.inf
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(11), i))(jnp.arange(N))
    rows = jnp.broadcast_to(jnp.asarray(scores), (N, V))
    if native:
        tokens = np.asarray(draw(rows, keys))
    else:
        tokens = np.asarray(xla_draw(rows, jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)))
    assert np.isfinite(scores[tokens]).all()
    want = np.exp(scores.astype(np.float64) - scores[np.isfinite(scores)].max())
    want /= want.sum()
    top = np.argsort(-want)[:40]
    counts = np.bincount(tokens, minlength=V)
    observed = np.append(counts[top], N - counts[top].sum())
    expected = N * np.append(want[top], 1 - want[top].sum())
    expected *= N / expected.sum()
    assert chisquare(observed, expected).pvalue > 1e-3


def test_argmax_takes_the_lowest_index_among_ties_in_any_leading_shape():
    """`argmax` (the native kernel's on AVX-512) equals jnp.argmax: ties at the max go to the lowest index,
    rows of a partial head's -1e30 included, over `[S, N, V]` as over `[S, V]`."""
    rng = np.random.default_rng(5)
    logits = rng.integers(-3, 3, (3, 5, 1000)).astype(np.float32)  # many ties
    logits[1, :, 500:] = -1e30
    logits[2, 1] = rng.normal(0, 1, 1000)
    got = np.asarray(jax.jit(argmax)(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(logits[0]))), np.argmax(logits[0], axis=-1))
