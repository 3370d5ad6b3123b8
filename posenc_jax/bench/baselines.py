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

Each generated task gives its own closed forms, for any length (its ``baselines`` method, whose
docstring derives them; :func:`algorithmic_baselines` asks it); :func:`enumerated_baselines`
computes the same quantities by walking every input of a task (its ``support``), which is exact
but only feasible for short inputs; the tests hold one to the other. A task that has no exact
value for a baseline gives None there (content-only of flip-flop and of CoPE's counting task).
The text task's baselines are n-gram models (:func:`text_baselines`, :mod:`posenc_jax.bench.ngram`).
"""

from __future__ import annotations

import collections

import numpy as np

__all__ = ["BASELINE_NAMES", "algorithmic_baselines", "enumerated_baselines", "text_baselines"]

BASELINE_NAMES = ("chance", "position-only", "content-only")


def algorithmic_baselines(task, n: int) -> dict[str, float | None]:
    """Chance, position-only and content-only scores of ``task`` at input length ``n``, exactly: the
    task's own closed forms (its ``baselines`` method, which derives each). A score is None where
    the task draws no chance line, or where no exact value is known (content-only of flip-flop and
    of counting).

    Example:
      >>> from posenc_jax.bench.tasks import make_task
      >>> {k: round(v, 3) for k, v in algorithmic_baselines(make_task("bucket_sort"), 10).items()}
      {'chance': 0.1, 'position-only': 0.366, 'content-only': 1.0}
    """
    if not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"n must be an input length >= 1, got {n!r}")
    if task.length_family != "algorithmic":
        raise ValueError(
            f"no algorithmic baselines for task {task.name!r}: they exist for the generated decoder and encoder "
            "tasks (the text task's baselines are n-gram models, posenc_jax.bench.ngram)"
        )
    return task.baselines(int(n))


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
