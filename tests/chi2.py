"""Pearson's chi-square goodness of fit with its power stated, for the tests of sampled distributions.

A test fixes, from the expected distribution and the sample count alone, which cells it merges
(`Cells`); `Cells.power` is then a lower bound on the probability that it rejects any alternative at
total-variation distance `tv` from the expected distribution, and each test asserts it is >= `POWER`.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

ALPHA = 1e-3  # significance: a correct sampler fails each test one time in a thousand
TV = 0.05  # the total-variation error each test must catch...
POWER = 0.9  # ...with at least this probability
MIN_EXPECTED = 5  # expected count of each tested cell (merged ones included): the chi-square approximation


class Cells:
    """The cells of a chi-square test of `n` samples of `probs` (any shape, flattened; zeros outside the
    support): the smallest cells are merged into one, as many as maximise `power` while every cell keeps an
    expected count >= MIN_EXPECTED. A sample outside the support rejects outright."""

    def __init__(self, probs, n: int, tv: float = TV, alpha: float = ALPHA):
        self.probs = np.asarray(probs, np.float64).ravel() / np.sum(probs)
        self.n, self.tv, self.alpha = n, tv, alpha
        support = np.flatnonzero(self.probs > 0)
        support = support[np.argsort(self.probs[support], kind="stable")]  # ascending probability
        mass = np.concatenate([[0.0], np.cumsum(self.probs[support])])  # mass[k]: the k smallest cells'
        best = None
        for k in [0, *range(2, len(support))]:  # merge the k smallest cells into one (merging one is none)
            df = len(support) - k + (k > 0) - 1
            if self.probs[support[k]] * n < MIN_EXPECTED or 0 < mass[k] * n < MIN_EXPECTED or df < 1:
                continue
            power = self._power(df, mass[k])
            if best is None or power > best[0]:
                best = (power, k, df)
        if best is None:
            raise ValueError(f"{n} samples cannot give every cell an expected count >= {MIN_EXPECTED}")
        self.power, k, self.df = best
        self.merged, self.kept = support[:k], support[k:]

    def _power(self, df: int, merged: float) -> float:
        """Power against the least favourable alternative at TV distance `tv`, from the noncentral
        chi-square (Pearson's statistic is asymptotically ncx2(df, lambda), lambda = n * chi-square
        divergence). On the tested cells the alternative keeps TV >= tv - merged - s, where `merged` is the
        merged cells' mass (moves inside them are unseen) and s the alternative's mass outside the support
        (seen by any one sample there, probability 1 - (1 - s)^n); by Cauchy-Schwarz the divergence of an
        alternative at TV d is >= (2 d)^2. Minimised over s (a grid on [0, tv])."""
        crit = stats.chi2.isf(self.alpha, df)
        s = np.linspace(0.0, self.tv, 201)
        lam = self.n * (2 * np.maximum(self.tv - merged - s, 0.0)) ** 2
        miss = (1 - s) ** self.n
        return float(np.min(1 - miss + miss * stats.ncx2.sf(crit, df, lam)))

    def pvalue(self, counts) -> float:
        """Pearson's p-value of `counts` (the shape of `probs`, flattened) over these cells; 0 if any
        falls outside the support."""
        counts = np.asarray(counts, np.float64).ravel()
        assert counts.sum() == self.n, (counts.sum(), self.n)
        if counts[self.probs == 0].any():
            return 0.0
        obs, exp = counts[self.kept], self.probs[self.kept] * self.n
        if len(self.merged):
            obs = np.append(obs, counts[self.merged].sum())
            exp = np.append(exp, self.probs[self.merged].sum() * self.n)
        return float(stats.chisquare(obs, exp).pvalue)

    def __repr__(self):
        return (f"Cells({len(self.kept)} + {len(self.merged)} merged, df {self.df}, n {self.n}, "
                f"power {self.power:.3f} at TV {self.tv})")



def perturbed(probs, tv: float = TV, seed: int = 0) -> np.ndarray:
    """`probs` moved by `tv` in total variation within its support: a random set of cells holding about half
    the mass scaled up, the rest down, in proportion (the alternative whose chi-square divergence is nearest
    the Cauchy-Schwarz bound `Cells.power` assumes)."""
    p = np.asarray(probs, np.float64)
    flat = p.ravel() / p.sum()
    rng = np.random.default_rng(seed)
    support = np.flatnonzero(flat > 0)
    while True:  # each side must hold enough mass to give tv
        order = rng.permutation(support)
        half = np.cumsum(flat[order]) <= 0.5
        up, down = order[half], order[~half]
        if min(flat[up].sum(), flat[down].sum()) >= 2 * tv:
            break
    w = flat.copy()
    w[up] += tv * flat[up] / flat[up].sum()
    w[down] -= tv * flat[down] / flat[down].sum()
    return w.reshape(p.shape)
