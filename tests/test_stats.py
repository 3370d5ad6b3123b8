"""The statistics every benchmark figure rests on, against hand calculations, SciPy's own tests,
and (for the bounded interval's coverage) simulation."""

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from posenc_jax.bench import stats


def test_holm_against_the_procedure_by_hand():
    # Sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> raised to 0.06.
    adjusted = stats.holm([0.01, 0.04, 0.03, 0.005])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert [p <= 0.05 for p in adjusted] == [True, False, False, True]
    assert stats.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert stats.holm([0.02]) == pytest.approx([0.02])  # one test: no correction
    for bad in ([1.5], [float("nan")], [[0.1]]):
        with pytest.raises(ValueError, match="p-values"):
            stats.holm(bad)
    with pytest.raises(ValueError, match="alpha"):
        stats.holm([0.1], alpha=5)


def test_the_paired_t_test_is_scipys():
    a = {0: 0.91, 1: 0.85, 2: 0.99, 3: 0.70, 4: 0.88}
    b = {0: 0.80, 1: 0.86, 2: 0.90, 3: 0.61, 4: 0.75, 9: 0.0}  # seed 9 has no partner: left out
    diff = stats.paired_difference(a, b)
    want = scipy_stats.ttest_rel([a[s] for s in range(5)], [b[s] for s in range(5)])
    assert diff.n == 5
    assert diff.p_value == pytest.approx(want.pvalue, rel=1e-9)
    low, high = want.confidence_interval(0.95)
    assert (diff.low, diff.high) == pytest.approx((low, high), rel=1e-9)
    same = stats.paired_difference({0: 0.3, 1: 0.3}, {0: 0.3, 1: 0.3})
    assert same.equal and same.p_value == 1.0
    # Seeds that all agree: the exact sign test (2 * 0.5^n), which depends on how many they are.
    shifted = stats.paired_difference({0: 0.5, 1: 0.6}, {0: 0.3, 1: 0.4})
    assert shifted.equal and shifted.p_value == 0.5 and str(shifted) == "0.200, all 2 seeds"
    five = stats.paired_difference(dict.fromkeys(range(5), 0.2), dict.fromkeys(range(5), 0.0))
    assert five.p_value == pytest.approx(0.0625) and stats.one_sided([0.2] * 5, 0.0, +1) == pytest.approx(1 / 32)
    assert stats.equivalence(dict.fromkeys(range(5), 0.0), dict.fromkeys(range(5), 0.0), 0.02).p_value == 1 / 32


def test_tost_is_two_of_scipys_one_sided_tests():
    a = {0: 0.52, 1: 0.47, 2: 0.55, 3: 0.50, 4: 0.49}
    b = {0: 0.50, 1: 0.50, 2: 0.50, 3: 0.51, 4: 0.48}
    d = [a[s] - b[s] for s in range(5)]
    for margin in (0.01, 0.03, 0.1):
        test = stats.equivalence(a, b, margin)
        lower = scipy_stats.ttest_1samp(d, -margin, alternative="greater").pvalue
        upper = scipy_stats.ttest_1samp(d, margin, alternative="less").pvalue
        assert test.p_value == pytest.approx(max(lower, upper), rel=1e-9)
    assert not stats.equivalence(a, b, 0.01).equivalent()
    assert stats.equivalence(a, b, 0.1).equivalent()
    # Not told apart is not the same as equivalent: wide spread, no difference in the mean.
    noisy = stats.equivalence({0: 0.9, 1: 0.1, 2: 0.5}, {0: 0.1, 1: 0.9, 2: 0.5}, 0.05)
    assert not noisy.equivalent() and not noisy.difference.excludes(0.0)
    with pytest.raises(ValueError, match="margin"):
        stats.equivalence(a, b, 0.0)


def test_a_family_is_corrected_together():
    # Three encodings, three pairs: p-values corrected by Holm over the three.
    per_seed = {
        "a": {0: 0.92, 1: 0.93, 2: 0.84, 3: 0.99, 4: 0.88},
        "b": {0: 0.70, 1: 0.75, 2: 0.60, 3: 0.80, 4: 0.66},
        "c": {0: 0.71, 1: 0.74, 2: 0.61, 3: 0.79, 4: 0.67},
    }
    family = stats.compare(per_seed, margin=0.03)
    raw = {(o.better, o.worse): o.difference.p_value for o in family.orderings}
    corrected = {(o.better, o.worse): o.corrected_p for o in family.orderings}
    assert list(corrected.values()) == pytest.approx(stats.holm(list(raw.values())))
    assert {pair for pair, p in corrected.items() if p <= 0.05} == {(o.better, o.worse) for o in family.resolved}
    assert all(corrected[pair] >= raw[pair] for pair in raw)
    assert ("a", "b") in {(o.better, o.worse) for o in family.resolved}
    # b and c differ by 0.01 on every seed but one: equivalent within 0.03, not an ordering.
    assert {frozenset(p) for p in family.equivalent()} == {frozenset(("b", "c"))}
    assert frozenset(("b", "c")) in {frozenset((o.better, o.worse)) for o in family.unresolved}


def test_a_comparison_significant_alone_can_fail_its_family():
    # 20 pairs of which one has p about 0.01: significant uncorrected, not after Holm's correction.
    rng = np.random.default_rng(0)
    per_seed = {f"e{i}": {s: 0.5 + 0.01 * rng.standard_normal() for s in range(5)} for i in range(7)}
    family = stats.compare(per_seed)
    raw = [o.difference.p_value for o in family.orderings]
    corrected = [o.corrected_p for o in family.orderings]
    assert len(raw) == 21
    assert all(c >= r for c, r in zip(corrected, raw, strict=True))
    assert sum(p <= 0.05 for p in corrected) <= sum(p <= 0.05 for p in raw)


def test_the_bounded_interval_by_hand_and_inside_the_range():
    values = [0.0, 0.0, 0.0, 0.0, 0.035]
    interval = stats.bounded_interval(values)
    m, s2, n = 0.007, np.var(values, ddof=1), 5
    c = scipy_stats.t.ppf(0.975, n - 1) ** 2 * s2 / (m * (1 - m)) / n
    root = math.sqrt(c * m * (1 - m) + c * c / 4)
    assert (interval.low, interval.high) == pytest.approx(((m + c / 2 - root) / (1 + c), (m + c / 2 + root) / (1 + c)))
    assert 0 < interval.low < m < interval.high < 1
    # Where the t interval leaves [0, 1], this one does not.
    for seeds in ([0.0, 0.0, 0.0, 0.0, 0.035], [1.0, 1.0, 0.9, 0.55, 0.96], [0.99, 1.0, 1.0, 0.97, 1.0]):
        t = stats.t_interval(seeds)
        b = stats.bounded_interval(seeds)
        assert t.low < 0 or t.high > 1
        assert 0 <= b.low <= b.mean <= b.high <= 1
    equal = stats.bounded_interval([0.0] * 5)
    assert equal.equal and str(equal) == "0.000, all 5 seeds" and equal.low == equal.high == 0.0
    assert str(stats.bounded_interval([1.0] * 3)) == "1.000, all 3 seeds"
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        stats.bounded_interval([0.5, 1.2])


def _coverage(interval, mean: float, concentration: float, examples: int, draws: int, rng) -> float:
    """How often ``interval`` over 5 seeds covers the true mean, each seed's score the fraction
    right of ``examples`` examples at a rate drawn from a beta distribution of that mean."""
    rates = rng.beta(mean * concentration, (1 - mean) * concentration, size=(draws, 5))
    scores = rng.binomial(examples, rates) / examples
    hits = 0
    for seeds in scores:
        found = interval(seeds)
        hits += found.low <= mean <= found.high
    return hits / draws


@pytest.mark.parametrize("mean", [0.05, 0.5, 0.95])
def test_the_bounded_interval_covers_the_mean_by_simulation(mean):
    # Seeds spread as the benchmark's do (a seed's standard deviation about 0.05 near the ends,
    # 0.1 in the middle; 1,280 examples a seed), 2,000 draws of 5 seeds each: the nominal 95%
    # interval covers the true mean at least 90% of the time. The Student-t interval, at the
    # ends, does not: the check can fail.
    rng = np.random.default_rng(1)
    bounded = _coverage(stats.bounded_interval, mean, 20.0, 1280, 2000, rng)
    assert bounded >= 0.90, bounded
    if mean != 0.5:
        t = _coverage(stats.t_interval, mean, 20.0, 1280, 2000, np.random.default_rng(1))
        assert t < 0.90, t
