"""Intervals over seeds, paired comparisons between encodings, their multiplicity correction,
and equivalence tests.

A benchmark cell trains one model per seed; each seed gives one number (say, its mean exact
match beyond the training length). Every seed counts: a cell's statistic is over all its
seeds, never over those that passed a gate. Seeds are few (5), so:

* **A bounded score** (exact match, accuracy: in [0, 1]) gets a score interval whose ends lie
  in [0, 1] by construction (:func:`bounded_interval`): the set of means μ whose distance from
  the seeds' mean m is within what the seeds' spread allows at μ,

      (m − μ)² ≤ t²(0.975, n − 1) · φ · μ(1 − μ) / n,     φ = s² / (m(1 − m)),

  Wilson's interval for a proportion with the over-dispersion φ estimated from the seeds
  (s the sample standard deviation, ddof = 1). The variance it allows shrinks to 0 at the
  bounds, so the interval is asymmetric near 0 and 1 and never leaves [0, 1]. Seeds that all
  scored the same value carry no spread to estimate: the interval is that value alone and
  prints as such ("0.000, all 5 seeds").
* **An unbounded score** (bits per character) gets Student's t interval (:func:`t_interval`):
  mean ± t(0.975, n − 1) · s / √n.

Two encodings trained on the same task with the same seeds see the same data (the batch of
step k depends only on the seed and k), so they are compared seed by seed: the paired
differences d_s = a_s − b_s get a paired t-test (:func:`paired_difference`, with its two-sided
p-value). A page makes many such comparisons, so they are corrected as a family
(:func:`holm`, Holm–Bonferroni at 0.05): an ordering is *resolved* only when its corrected
p-value is at most 0.05, and *unresolved* otherwise, which is never read as a tie. A tie is
claimed only by an equivalence test (:func:`equivalence`, two one-sided tests against a margin
declared before the run).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.special import stdtr, stdtrit  # the Student-t CDF and quantile (scipy.stats' t.cdf/t.ppf)

__all__ = [
    "Comparison",
    "Equivalence",
    "Interval",
    "Ordering",
    "bounded_interval",
    "compare",
    "equivalence",
    "holm",
    "interval",
    "one_sided",
    "paired_difference",
    "resolved_orderings",
    "t_interval",
    "tost",
]


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean over ``n`` seeds with its two-sided ``confidence`` interval ``[low, high]`` (both ends
    NaN with one seed, where no spread can be estimated; both the mean when every seed gave the
    same value, ``equal``). ``p_value``: for a paired difference, the two-sided p-value of "the
    mean difference is 0" (paired t-test); NaN otherwise."""

    mean: float
    low: float
    high: float
    n: int
    confidence: float = 0.95
    equal: bool = False
    p_value: float = math.nan

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def excludes(self, value: float) -> bool:
        """Whether the interval lies wholly on one side of ``value`` (False with one seed)."""
        return self.n > 1 and (self.low > value or self.high < value)

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.mean:.3f} (1 seed)"
        if self.equal:
            return f"{self.mean:.3f}, all {self.n} seeds"
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _check(values, what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D sequence of numbers (one per seed), got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{what} holds a non-finite value ({array.tolist()}); drop or fix that seed's result")
    return array


def _confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}; 0.95 gives a 95% interval")


def _degenerate(array: np.ndarray, confidence: float) -> Interval | None:
    """The interval of one seed (no spread: NaN ends) or of seeds that all agree (the value alone)."""
    mean = float(array.mean())
    if array.size == 1:
        return Interval(mean, math.nan, math.nan, 1, confidence)
    if np.ptp(array) <= 1e-12:  # the same value (up to rounding, as in 0.5 - 0.3 and 0.6 - 0.4)
        return Interval(mean, mean, mean, int(array.size), confidence, equal=True)
    return None


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean of ``values`` (one per seed) with its Student-t ``confidence`` interval, for an
    unbounded score (bits per character) or a difference.

    Example:
      >>> str(t_interval([0.9, 0.8, 1.0]))  # 0.9 ± 4.303 · 0.1 / √3
      '0.900 [0.652, 1.148]'
    """
    _confidence(confidence)
    array = _check(values, "values")
    degenerate = _degenerate(array, confidence)
    if degenerate is not None:
        return degenerate
    n = array.size
    mean = float(array.mean())
    half = float(stdtrit(n - 1, 0.5 + confidence / 2) * array.std(ddof=1) / math.sqrt(n))
    return Interval(mean, mean - half, mean + half, n, confidence)


def bounded_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean of ``values`` (one per seed, each in [0, 1]) with a ``confidence`` interval inside
    [0, 1] by construction: Wilson's score interval with the over-dispersion estimated from the
    seeds (module docstring).

    Solving (m − μ)² = c·μ(1 − μ) for μ, with c = t²·φ/n and φ = s²/(m(1 − m)), gives

        μ = (m + c/2 ± √(c·m(1 − m) + c²/4)) / (1 + c).

    Example:
      >>> str(bounded_interval([0.0, 0.0, 0.0, 0.0, 0.035]))  # the t interval: [-0.010, 0.024]
      '0.007 [0.001, 0.064]'
      >>> str(bounded_interval([0.0] * 5))
      '0.000, all 5 seeds'
    """
    _confidence(confidence)
    array = _check(values, "values")
    if np.any((array < 0) | (array > 1)):
        raise ValueError(
            f"a bounded score must lie in [0, 1], got {array.tolist()}; use t_interval for an unbounded score "
            "(bits per character)"
        )
    degenerate = _degenerate(array, confidence)
    if degenerate is not None:
        return degenerate
    n = array.size
    m = float(array.mean())
    phi = float(array.var(ddof=1)) / (m * (1 - m))  # 0 < m < 1: the seeds differ, all in [0, 1]
    c = float(stdtrit(n - 1, 0.5 + confidence / 2)) ** 2 * phi / n
    centre = (m + c / 2) / (1 + c)
    half = math.sqrt(c * m * (1 - m) + c * c / 4) / (1 + c)
    return Interval(m, max(0.0, centre - half), min(1.0, centre + half), n, confidence)


def interval(values: Sequence[float], *, bounded: bool, confidence: float = 0.95) -> Interval:
    """:func:`bounded_interval` for a score in [0, 1], :func:`t_interval` otherwise."""
    return bounded_interval(values, confidence) if bounded else t_interval(values, confidence)


def paired_difference(a: Mapping[int, float], b: Mapping[int, float], confidence: float = 0.95) -> Interval | None:
    """The mean difference ``a − b`` over the seeds both have, with its Student-t interval and the
    paired t-test's two-sided p-value; None when they share no seed. Where every seed's difference
    is the same value the t-test has no spread to use, and the p-value is the exact sign test's:
    2 · 0.5ⁿ when that value is not 0 (at 5 seeds, 0.0625: no single value of seeds that all agree
    is evidence enough at 0.05), 1 when it is 0."""
    common = sorted(set(a) & set(b))
    if not common:
        return None
    d = [a[s] - b[s] for s in common]
    # Two-sided: twice the smaller one-sided p-value (the sign test's where the seeds all agree).
    p_value = min(1.0, 2 * min(one_sided(d, 0.0, +1), one_sided(d, 0.0, -1)))
    return dataclasses.replace(t_interval(d, confidence), p_value=p_value)


def holm(p_values: Sequence[float], alpha: float = 0.05) -> list[float]:
    """Holm–Bonferroni adjusted p-values of one family of tests (in the order given): sorted
    ascending, the i-th smallest (from 0) is multiplied by (m − i), then made non-decreasing and
    capped at 1. A test is rejected at family-wise level ``alpha`` when its adjusted p-value is
    at most ``alpha``.

    Example (Holm 1979's procedure on four tests):
      >>> [round(p, 3) for p in holm([0.01, 0.04, 0.03, 0.005])]
      [0.03, 0.06, 0.06, 0.02]
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}; 0.05 is the usual family-wise level")
    p = np.asarray(p_values, dtype=np.float64)
    if p.ndim != 1 or np.any(~np.isfinite(p)) or np.any((p < 0) | (p > 1)):
        raise ValueError(f"p-values must be a 1-D sequence of numbers in [0, 1], got {list(p_values)}")
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.empty(m)
    running = 0.0
    for i, index in enumerate(order):
        running = max(running, min(1.0, (m - i) * p[index]))
        adjusted[index] = running
    return adjusted.tolist()


def tost(differences: Sequence[float], margin: float) -> float:
    """The p-value of two one-sided tests that the mean of ``differences`` lies within ±``margin``:
    the larger of :func:`one_sided` above ``-margin`` and below ``margin``."""
    return max(one_sided(differences, -margin, +1), one_sided(differences, margin, -1))


def one_sided(differences: Sequence[float], null: float, direction: int) -> float:
    """The p-value of a one-sided t-test that the mean of ``differences`` is above ``null``
    (``direction`` +1) or below it (-1). Differences that are all the same value have no spread for
    a t-test: they get the exact sign test's p-value, 0.5ⁿ when that value lies strictly on the
    claimed side of ``null``, 1 otherwise.

    Example:
      >>> round(one_sided([0.1, 0.2, 0.3], 0.0, +1), 4)  # t = 0.2 / (0.1 / √3) = 3.464, 2 df
      0.0371
    """
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 (above null) or -1 (below it), got {direction}")
    array = _check(differences, "differences")
    mean = float(array.mean())
    if array.size < 2:
        return 1.0
    if np.ptp(array) <= 1e-12:
        # No spread for the t-test: the exact sign test, every seed on the claimed side (0.5^n).
        return 0.5**array.size if direction * (mean - null) > 0 else 1.0
    se = float(array.std(ddof=1) / math.sqrt(array.size))
    return float(stdtr(array.size - 1, -direction * (mean - null) / se))


@dataclasses.dataclass(frozen=True)
class Equivalence:
    """Two one-sided tests (TOST) of "the mean difference lies within ±``margin``": ``p_value`` is
    the larger of the two one-sided p-values; the difference is shown equivalent at level α when
    it is at most α, which is the same as the (1 − 2α) interval of the difference lying inside
    (−margin, margin)."""

    difference: Interval
    margin: float
    p_value: float

    def equivalent(self, alpha: float = 0.05) -> bool:
        return self.p_value <= alpha


def equivalence(a: Mapping[int, float], b: Mapping[int, float], margin: float) -> Equivalence | None:
    """The paired TOST of ``a`` and ``b`` (seed → value) against ``margin``; None without a common seed.

    Seeds whose differences are all the same value ``d`` give the exact sign test's p = 0.5ⁿ when
    |d| < margin, 1 otherwise.

    Example:
      >>> e = equivalence({0: 0.50, 1: 0.52, 2: 0.49}, {0: 0.50, 1: 0.50, 2: 0.50}, margin=0.03)
      >>> round(e.p_value, 4), e.equivalent()  # d = 0, 0.02, -0.01: t = (0.0033 - 0.03) / 0.0088, 2 df
      (0.0471, True)
    """
    if not margin > 0:
        raise ValueError(f"an equivalence margin must be positive, got {margin}; declare it per task in the preset")
    diff = paired_difference(a, b)
    if diff is None:
        return None
    common = sorted(set(a) & set(b))
    return Equivalence(diff, margin, tost([a[s] - b[s] for s in common], margin))


@dataclasses.dataclass(frozen=True)
class Ordering:
    """Encoding ``better`` against ``worse`` on one measure: the paired difference (oriented so
    that a positive mean favours ``better``), its p-value corrected within its family
    (``corrected_p``, Holm; the raw p-value until :func:`compare` corrects it) and whether the
    corrected test rejects "no difference" at ``alpha``."""

    better: str
    worse: str
    difference: Interval
    corrected_p: float = math.nan
    alpha: float = 0.05

    @property
    def resolved(self) -> bool:
        p = self.difference.p_value if math.isnan(self.corrected_p) else self.corrected_p
        return self.difference.n > 1 and p <= self.alpha


def resolved_orderings(
    per_seed: Mapping[str, Mapping[int, float]], *, higher_is_better: bool = True, confidence: float = 0.95
) -> list[Ordering]:
    """Every pair of encodings in ``per_seed`` (label → seed → value), each oriented so that the
    one with the better mean comes first, with the paired difference's interval and raw p-value
    (uncorrected: :func:`compare` corrects a family). Pairs with no common seed are left out.

    Example:
      >>> rows = resolved_orderings({"a": {0: 0.9, 1: 0.8, 2: 0.85}, "b": {0: 0.1, 1: 0.2, 2: 0.15}})
      >>> rows[0].better, rows[0].worse, rows[0].resolved
      ('a', 'b', True)
    """
    sign = 1.0 if higher_is_better else -1.0
    labels = list(per_seed)
    out = []
    for i, first in enumerate(labels):
        for second in labels[i + 1 :]:
            # Differences in "goodness": positive favours `first` whichever way the metric points.
            a = {seed: sign * value for seed, value in per_seed[first].items()}
            b = {seed: sign * value for seed, value in per_seed[second].items()}
            diff = paired_difference(a, b, confidence)
            if diff is None:
                continue
            if diff.mean < 0:
                first_, second_ = second, first
                diff = dataclasses.replace(diff, mean=-diff.mean, low=-diff.high, high=-diff.low)
            else:
                first_, second_ = first, second
            out.append(Ordering(first_, second_, diff))
    return out


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One family of paired comparisons, corrected together: its orderings (with Holm-corrected
    p-values) and, where a margin was given, the equivalence test of every pair."""

    orderings: list[Ordering]
    equivalences: dict[tuple[str, str], Equivalence]
    margin: float | None
    alpha: float = 0.05

    @property
    def resolved(self) -> list[Ordering]:
        return [o for o in self.orderings if o.resolved]

    @property
    def unresolved(self) -> list[Ordering]:
        return [o for o in self.orderings if not o.resolved]

    def equivalent(self) -> list[tuple[str, str]]:
        """The pairs shown equivalent within the margin (TOST, Holm-corrected over the family's pairs)."""
        pairs = list(self.equivalences)
        if not pairs:
            return []
        adjusted = holm([self.equivalences[p].p_value for p in pairs], self.alpha)
        return [p for p, q in zip(pairs, adjusted, strict=True) if q <= self.alpha]


def compare(
    per_seed: Mapping[str, Mapping[int, float]],
    *,
    higher_is_better: bool = True,
    margin: float | None = None,
    alpha: float = 0.05,
) -> Comparison:
    """Every pair of ``per_seed`` (label → seed → value) compared seed by seed, as one family:
    the paired t-tests' p-values corrected by :func:`holm` at ``alpha``; with a ``margin``, every
    pair's equivalence test too.

    Example:
      >>> family = compare({"a": {0: 0.9, 1: 0.8, 2: 0.85}, "b": {0: 0.1, 1: 0.2, 2: 0.15}})
      >>> [(o.better, o.worse, o.resolved) for o in family.orderings]
      [('a', 'b', True)]
    """
    pairs = resolved_orderings(per_seed, higher_is_better=higher_is_better)
    testable = [i for i, o in enumerate(pairs) if o.difference.n > 1]
    adjusted = holm([pairs[i].difference.p_value for i in testable], alpha) if testable else []
    corrected = dict(zip(testable, adjusted, strict=True))
    orderings = [dataclasses.replace(o, corrected_p=corrected.get(i, 1.0), alpha=alpha) for i, o in enumerate(pairs)]
    equivalences = {}
    if margin is not None:
        for o in orderings:
            test = equivalence(per_seed[o.better], per_seed[o.worse], margin)
            if test is not None:
                equivalences[(o.better, o.worse)] = test
    return Comparison(orderings, equivalences, margin, alpha)
