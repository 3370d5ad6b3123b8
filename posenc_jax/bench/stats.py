"""Intervals over seeds, paired differences between encodings, and which orderings they resolve.

A benchmark cell trains one model per seed; each seed gives one number (say, its mean exact
match beyond the training length). Seeds are few (5), so the spread of their mean is given
by Student's t distribution:

    mean ± t(0.975, n − 1) · s / √n,    s the sample standard deviation (ddof = 1).

Two encodings trained on the same task with the same seeds see the same data (the batch of
step k depends only on the seed and k), so they are compared seed by seed: the interval of
the paired differences d_s = a_s − b_s is the same formula applied to the d_s. An ordering
"a above b" is *resolved* at 95% when that interval excludes 0, and unresolved otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.special import stdtrit  # the Student-t quantile (scipy.stats' t.ppf, without importing scipy.stats)

__all__ = ["Interval", "Ordering", "paired_difference", "resolved_orderings", "t_interval"]


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean over ``n`` seeds with its two-sided ``confidence`` interval ``[low, high]``
    (Student t; both ends NaN with one seed, where no spread can be estimated)."""

    mean: float
    low: float
    high: float
    n: int
    confidence: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def excludes(self, value: float) -> bool:
        """Whether the interval lies wholly on one side of ``value`` (False with one seed)."""
        return self.n > 1 and (self.low > value or self.high < value)

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.mean:.3f} (1 seed)"
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _check(values, what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D sequence of numbers (one per seed), got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{what} holds a non-finite value ({array.tolist()}); drop or fix that seed's result")
    return array


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean of ``values`` (one per seed) with its Student-t ``confidence`` interval.

    Example:
      >>> str(t_interval([0.9, 0.8, 1.0]))  # 0.9 ± 4.303 · 0.1 / √3
      '0.900 [0.652, 1.148]'
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}; 0.95 gives a 95% interval")
    array = _check(values, "values")
    n = array.size
    mean = float(array.mean())
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1, confidence)
    half = float(stdtrit(n - 1, 0.5 + confidence / 2) * array.std(ddof=1) / math.sqrt(n))
    return Interval(mean, mean - half, mean + half, n, confidence)


def paired_difference(a: Mapping[int, float], b: Mapping[int, float], confidence: float = 0.95) -> Interval | None:
    """The mean difference ``a − b`` over the seeds both have, with its Student-t interval;
    None when they share no seed."""
    common = sorted(set(a) & set(b))
    if not common:
        return None
    return t_interval([a[s] - b[s] for s in common], confidence)


@dataclasses.dataclass(frozen=True)
class Ordering:
    """Encoding ``better`` against ``worse`` on one measure: the paired difference (oriented so
    that a positive mean favours ``better``) and whether its interval excludes 0."""

    better: str
    worse: str
    difference: Interval

    @property
    def resolved(self) -> bool:
        return self.difference.excludes(0.0)


def resolved_orderings(
    per_seed: Mapping[str, Mapping[int, float]], *, higher_is_better: bool = True, confidence: float = 0.95
) -> list[Ordering]:
    """Every pair of encodings in ``per_seed`` (label → seed → value), each oriented so that the
    one with the better mean comes first, with the paired difference's interval. Pairs with no
    common seed are left out.

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
