"""What an algorithmic task's score means: chance, and the best predictors that see half of it.

A model that extrapolates must use two things: *where* it is in the answer and *what* the
input holds. Each baseline is the best possible predictor that sees only one of them, so a
score at or below it shows that a model used no more than that:

* **position-only**: sees the length n of the input and the slot j of the answer being
  written, never the input's symbols. For per-token accuracy it writes, at each slot, the
  symbol most likely there: ``mean_j max_s P(y_j = s | n)``. For exact match it writes the
  most likely whole answer: ``max_y P(y | n)``.
* **content-only**: sees the multiset M of the input's symbols (and so n), never their order.
  Per token: ``E_M[mean_j max_s P(y_j = s | M)]``; exact match: ``E_M[max_y P(y | M)]``.
  A task whose answer is a function of M alone (counting copy and replace, bucket sort, parity, the
  binary missing duplicate) scores 1 here: it needs positions only to lay the answer out.
* **chance**: guessing uniformly (the task's own :meth:`~posenc_jax.bench.tasks.Task.chance`).

:func:`algorithmic_baselines` gives the closed forms below for any length;
:func:`enumerated_baselines` computes the same quantities by walking every input of a task
(its ``support``), which is exact but only feasible for short inputs; the tests hold one to
the other.

Closed forms (symbols uniform over the task's alphabet of A symbols (``task.symbols``: 10 in the
benchmark's own format; the paper formats' 100, 5 or 2), or over bits):

* counting copy, counting replace (exact match): position-only 1/A (the symbol written is a
  guess); content-only 1 (in ``s t s^n`` the symbol seen once is t, and the other's count is
  n + 1).
* copy, reverse, duplicate (exact match): position-only A^-n; content-only: given M with
  counts c, each arrangement has probability Π c_s! / n!, and summed over M weighted by
  P(M) = n! / (Π c_s! · A^n) this is (number of multisets) / A^n = C(n + A − 1, A − 1) / A^n.
* reverse string (per token): position-only 1/A; content-only E[max_s c_s] / n, with the
  distribution of the largest count from P(max ≤ m) = #{sequences with every count ≤ m} / A^n,
  counted exactly by adding one symbol at a time.
* bucket sort (per token): content-only 1; position-only mean_j max_s P(y_j = s), where y_j is
  the j-th smallest symbol: P(y_j ≤ s) = P(Binomial(n, (s + 1)/A) ≥ j + 1).
* parity, missing duplicate (one binary answer): position-only 1/2; content-only 1 (the
  number of ones decides parity; in ``w w`` with one bit hidden, the parity of the visible
  ones is the hidden bit).
* the blind-spot probe (each position's index on n identical tokens): both 1, since the
  answer is the slot itself; what the probe reads against is chance, 1/n.
* flip-flop (accuracy over the read bits): position-only 1/2, since every bit is uniform and
  independent of the instructions. Content-only is left out (None): the counts of the bits
  and instructions say a little about the reads, by an amount with no closed form.
* CoPE's counting task (accuracy of one answer): position-only is the most likely answer at n
  statements, ``max_k P(answer = k | n)``, from the exact distribution the task computes
  (:meth:`~posenc_jax.bench.tasks.CountingTask.answer_distribution`). Content-only is left out
  (None): the counts of the words do not say which increments came after the last set.
"""

from __future__ import annotations

import collections
import math
from fractions import Fraction

import numpy as np

__all__ = ["BASELINE_NAMES", "algorithmic_baselines", "enumerated_baselines", "text_baselines"]

BASELINE_NAMES = ("chance", "position-only", "content-only")


def _sequences_with_counts_at_most(n: int, m: int, alphabet: int) -> int:
    """The number of length-n sequences over ``alphabet`` symbols in which no symbol occurs more than m times."""
    ways = [1] + [0] * n  # ways[j]: sequences of length j over the symbols added so far
    for _ in range(alphabet):
        ways = [sum(ways[j - k] * math.comb(j, k) for k in range(min(m, j) + 1)) for j in range(n + 1)]
    return ways[n]


def _expected_largest_count(n: int, alphabet: int) -> Fraction:
    """E[max_s c_s] for n symbols drawn uniformly from ``alphabet``."""
    total = alphabet**n
    at_most = [_sequences_with_counts_at_most(n, m, alphabet) for m in range(n + 1)]
    # E[max] = sum over m >= 1 of P(max >= m) = sum over m of (1 - P(max <= m - 1)).
    return sum((Fraction(total - at_most[m - 1], total) for m in range(1, n + 1)), Fraction(0))


def _sorted_slot_best(n: int, alphabet: int) -> Fraction:
    """Bucket sort, position-only: mean over slots j of max_s P(j-th smallest = s)."""

    def at_most(j: int, s: int) -> Fraction:  # P(y_j <= s) = P(#{x_i <= s} >= j + 1)
        if s < 0:
            return Fraction(0)
        p = Fraction(s + 1, alphabet)
        return sum((math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(j + 1, n + 1)), Fraction(0))

    best = [max(at_most(j, s) - at_most(j, s - 1) for s in range(alphabet)) for j in range(n)]
    return sum(best, Fraction(0)) / n


def algorithmic_baselines(task, n: int) -> dict[str, float | None]:
    """Chance, position-only and content-only scores of ``task`` at input length ``n``, exactly
    (see the module docstring for each formula). A score is None where the task draws no chance
    line, or where no exact value is known (content-only of flip-flop and of counting).

    Example:
      >>> from posenc_jax.bench.tasks import make_task
      >>> {k: round(v, 3) for k, v in algorithmic_baselines(make_task("bucket_sort"), 10).items()}
      {'chance': 0.1, 'position-only': 0.366, 'content-only': 1.0}
    """
    if not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"n must be an input length >= 1, got {n!r}")
    n = int(n)
    a = getattr(task, "symbols", 10)  # the alphabet of x (the task's format decides it)
    name = task.name
    if name in ("counting_copy", "counting_replace"):
        position, content = Fraction(1, a), Fraction(1)
    elif name in ("copy", "reverse", "duplicate"):
        position, content = Fraction(1, a**n), Fraction(math.comb(n + a - 1, a - 1), a**n)
    elif name == "reverse_string":
        position, content = Fraction(1, a), _expected_largest_count(n, a) / n
    elif name == "bucket_sort":
        position, content = _sorted_slot_best(n, a), Fraction(1)
    elif name == "missing_duplicate" and n == 1 and getattr(task, "format", "ours") == "paper":
        position, content = Fraction(1), Fraction(1)  # Ruoss et al.'s length 1: the answer is always 1
    elif name in ("parity", "missing_duplicate"):
        position, content = Fraction(1, 2), Fraction(1)
    elif name in ("probe", "probe_boundary"):
        # The answer is the slot itself, which both predictors know; the line that matters is chance
        # (1/n), what a model that cannot tell the positions apart scores.
        position, content = Fraction(1), Fraction(1)
    elif name == "flip_flop":
        position, content = Fraction(1, 2), None
    elif name == "cope_count":
        position, content = max(task.answer_distribution(n)), None
    else:
        raise ValueError(
            f"no algorithmic baselines for task {name!r}: they exist for the generated decoder and encoder "
            "tasks (the text task's baselines are n-gram models, posenc_jax.bench.ngram)"
        )
    return {
        "chance": task.chance(n),
        "position-only": float(position),
        "content-only": None if content is None else float(content),
    }


def enumerated_baselines(task, n: int) -> dict[str, float]:
    """Position-only and content-only scores of ``task`` at length ``n`` by walking every input of
    ``task.support(n)`` (exact, and feasible only for short inputs: 10^n of them for most tasks).
    Exact-match tasks score the whole answer; per-token tasks each slot of it."""
    exact = task.metric == "exact_match"
    support = task.support(n)
    by_multiset: dict[tuple, list] = collections.defaultdict(list)
    for x, p in support:
        by_multiset[tuple(sorted(x.tolist()))].append((tuple(task.answer(x).tolist()), p))

    def best(group) -> float:
        """The score of the best fixed answer for the inputs of ``group``, times their total probability."""
        if exact:
            mass: dict[tuple, float] = collections.defaultdict(float)
            for y, p in group:
                mass[y] += p
            return max(mass.values())
        slots = len(group[0][0])
        total = 0.0
        for j in range(slots):
            mass = collections.defaultdict(float)
            for y, p in group:
                mass[y[j]] += p
            total += max(mass.values())
        return total / slots

    everything = [pair for group in by_multiset.values() for pair in group]
    return {
        "position-only": best(everything),
        "content-only": sum(best(group) for group in by_multiset.values()),
    }


def text_baselines(task, characters: int, orders=(1, 2, 3, 4, 5), smoothings=("add_one", "kneser_ney")) -> list[dict]:
    """Count-based n-gram models fitted on the text task's train split, scored in bits per
    character on exactly the test characters the models are scored on (the ``characters``
    characters after the first of the test split), each with its full preceding history.

    Returns one dict per model: ``order``, ``smoothing`` and ``bits_per_char``.
    """
    from posenc_jax.bench.ngram import NGramModel

    scored = task.test[: characters + 1]
    out = []
    for smoothing in smoothings:
        for order in orders:
            model = NGramModel.fit(task.train, order, smoothing=smoothing, vocab_size=task.vocab_size)
            bits = -model.log2_probs(scored)[1:]
            out.append({"order": order, "smoothing": smoothing, "bits_per_char": float(bits.mean())})
    return out
