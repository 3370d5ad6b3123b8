"""CoPE's counting task (Golovneva et al. 2024, arXiv:2405.18719): the printed variable's value.

Statements set, increment or leave alone variables; the answer is the value of the variable the
question prints. Its lengths are statements (:class:`CountingTask`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import ClassVar

import numpy as np

from posenc_jax.bench.tasks.base import Generated, pad_rows, register_task

__all__ = [
    "COUNT_EQUALS",
    "COUNT_FIRST_VARIABLE",
    "COUNT_INCREMENT",
    "COUNT_MAX_VALUE",
    "COUNT_PASS",
    "COUNT_PRINT",
    "COUNT_SEMICOLON",
    "COUNT_WEIGHTS",
    "COUNT_WORDS",
    "CountingTask",
]

# CoPE's counting task: the values 0..10 (the set value 0 is the same token), then the words.
COUNT_MAX_VALUE = 10
COUNT_WORDS = range(COUNT_MAX_VALUE + 1, COUNT_MAX_VALUE + 6)
COUNT_EQUALS, COUNT_SEMICOLON, COUNT_PASS, COUNT_INCREMENT, COUNT_PRINT = COUNT_WORDS
COUNT_FIRST_VARIABLE = COUNT_PRINT + 1
# The generator's weights of its three context statements (set, pass, increment).
COUNT_WEIGHTS = (1, 50, 7)


@dataclasses.dataclass(frozen=True)
class CountingTask(Generated):
    """The counting task of CoPE (Golovneva et al. 2024, "Contextual Position Encoding: Learning
    to Count What's Important", arXiv:2405.18719), transliterated from the paper's generator
    (facebookresearch/RAM, ``projects/cope/scripts/count_data_gen.py``).

    The context is n statements over ``num_variables`` variables ``a, b, c, ...``, each drawn
    with weights set : pass : increment = 1 : 50 : 7:

    * ``v = 0 ;`` sets a variable drawn uniformly from all of them to 0 (4 tokens);
    * ``pass;`` does nothing (1 token);
    * ``v ++;`` increments a variable drawn uniformly from those already set (2 tokens).

    A statement that cannot be made (an increment with no variable set yet, or past the
    largest value 10) is drawn again. Then comes the question ``print v`` for a variable
    drawn uniformly from those set (an example with none set is drawn again from the start),
    and the answer is v's value: the number of increments of v since it was last set. Tokens
    are the paper's whitespace-separated words (``pass;`` and ``++;`` are one token each; the
    set value ``0`` and the answer ``0`` are the same token); no begin or end token.
    The causal model is trained on the answer token only (the paper's ``--train-on answer``)
    and scored by its **accuracy** (one answer per example, so exact match).

    What differs from the paper: the length n is the number of statements, drawn by the
    benchmark in 1..L for training (the paper draws 3..512 and trains at every length up to
    its block of 512 tokens, cutting longer contexts from the left) and tested longer, so
    that the test contexts hold more statements than any training one; no such cut is made.
    An example takes up to 4n + 3 tokens (n sets), though about 1.2n on average, and is padded
    to that bound. The paper's released script runs 3 and 5 variables (default here: 3), models
    of 4 layers x 256 and 10,000 training examples; the benchmark draws fresh examples at its
    own sizes.
    Short contexts mostly print a variable never incremented: the most likely answer, 0, is
    right for 83% of examples at 4 statements and 46% at 16 (the position-only baseline, from
    :meth:`answer_distribution`), so train on 16 statements or more for the task to say much.

    Example:
      >>> from posenc_jax.bench.tasks import make_task
      >>> task = make_task("cope_count")
      >>> x = np.array([16, 11, 0, 12, 13, 16, 14, 16, 14, 15, 16])  # a = 0 ; pass; a ++; a ++; print a
      >>> task.answer(x)
      array([2])
    """

    name: str = "cope_count"
    num_variables: int = 3
    kind: ClassVar[str] = "decoder"
    metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True

    def __post_init__(self):
        if not 1 <= self.num_variables <= 26:
            raise ValueError(f"cope_count: num_variables must be in 1..26 (a to z), got {self.num_variables}")

    @property
    def pad(self) -> int:
        return COUNT_FIRST_VARIABLE + self.num_variables

    @property
    def vocab_size(self) -> int:
        return self.pad + 1

    def _context(self, rng: np.random.Generator, n: int):
        """n statements and the question, or None when no variable was set (then drawn again)."""
        values: dict[int, int] = {}
        tokens: list[int] = []
        total = sum(COUNT_WEIGHTS)
        for _ in range(n):
            while True:  # a statement that cannot be made is drawn again
                u = rng.random() * total
                if u < COUNT_WEIGHTS[0]:
                    var = int(rng.integers(self.num_variables))
                    values[var] = 0
                    tokens += [COUNT_FIRST_VARIABLE + var, COUNT_EQUALS, 0, COUNT_SEMICOLON]
                    break
                if u < COUNT_WEIGHTS[0] + COUNT_WEIGHTS[1]:
                    tokens.append(COUNT_PASS)
                    break
                if not values:
                    continue
                var = sorted(values)[int(rng.integers(len(values)))]
                if values[var] + 1 > COUNT_MAX_VALUE:
                    continue
                values[var] += 1
                tokens += [COUNT_FIRST_VARIABLE + var, COUNT_INCREMENT]
                break
        if not values:
            return None
        var = sorted(values)[int(rng.integers(len(values)))]
        return np.array([*tokens, COUNT_PRINT, COUNT_FIRST_VARIABLE + var])

    def _example(self, rng: np.random.Generator, n: int):
        while (x := self._context(rng, n)) is None:
            pass
        return x, self.answer(x)

    def answer(self, x: np.ndarray) -> np.ndarray:
        """The printed variable's value, counted from the statements of ``x`` (context and ``print v``)."""
        x = [int(t) for t in x]
        values: dict[int, int] = {}
        for i, token in enumerate(x[:-2]):
            if token == COUNT_EQUALS:
                values[x[i - 1]] = 0
            elif token == COUNT_INCREMENT:
                values[x[i - 1]] += 1
        if x[-2] != COUNT_PRINT or x[-1] not in values:
            raise ValueError(f"cope_count: {x} does not end in 'print v' for a variable that was set")
        return np.array([values[x[-1]]])

    def answer_distribution(self, n: int) -> np.ndarray:
        """P(answer = k), k = 0..10, for n statements, exactly: the generator run forward on the
        multiset of the variables' values (unset, 0..10), which is all it depends on."""
        unset = -1
        states = {(unset,) * self.num_variables: 1.0}
        set_w, pass_w, inc_w = COUNT_WEIGHTS
        for _ in range(n):
            after: dict[tuple, float] = collections.defaultdict(float)
            for state, p in states.items():
                existing = [v for v in state if v != unset]
                can = sum(v < COUNT_MAX_VALUE for v in existing)
                # Statements are drawn again until one can be made: outcomes in proportion to their weights.
                z = set_w + pass_w + (inc_w * can / len(existing) if existing else 0.0)
                after[state] += p * pass_w / z
                for j in range(self.num_variables):
                    new = tuple(sorted((*state[:j], 0, *state[j + 1 :])))
                    after[new] += p * set_w / self.num_variables / z
                for j, v in enumerate(state):
                    if v != unset and v < COUNT_MAX_VALUE:
                        new = tuple(sorted((*state[:j], v + 1, *state[j + 1 :])))
                        after[new] += p * inc_w / len(existing) / z
            states = after
        out = np.zeros(COUNT_MAX_VALUE + 1)
        for state, p in states.items():
            existing = [v for v in state if v != unset]
            for v in existing:  # print picks one of the set variables uniformly
                out[v] += p / len(existing)
        return out / out.sum()  # examples with no variable set are drawn again

    def max_tokens(self, n: int) -> int:
        """Model input length for n statements: at most 4n context tokens, ``print v`` and the
        answer, less the last token."""
        return 4 * n + 2

    def batch(self, rng: np.random.Generator, lengths, *, split: str = "train", pad_to: int | None = None) -> dict:
        seqs = [np.concatenate([x, y]) for x, y in (self._example(rng, int(n)) for n in lengths)]
        total = max(len(s) for s in seqs) if pad_to is None else pad_to + 1
        tokens = pad_rows(seqs, total, self.pad)
        weights = np.zeros((len(seqs), total - 1), np.float32)
        for i, s in enumerate(seqs):
            weights[i, len(s) - 2] = 1.0  # predicting the answer from "print v"
        return {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "weights": weights,
            "positions": np.arange(total - 1, dtype=np.int32),
        }

    def score(self, predictions: np.ndarray, batch: dict) -> np.ndarray:
        """Accuracy of the answer, per example."""
        w = batch["weights"]
        return ((predictions == batch["targets"]) * w).sum(-1) / np.maximum(w.sum(-1), 1)

    def chance(self, n: int) -> float | None:
        """1/11: a value 0..10 guessed uniformly."""
        return 1.0 / (COUNT_MAX_VALUE + 1)

    def baselines(self, n: int) -> dict[str, float | None]:
        """Accuracy of the one answer: position-only is the most likely answer at n statements,
        ``max_k P(answer = k | n)``, from the exact distribution (:meth:`answer_distribution`);
        content-only None: the counts of the words do not say which increments came after the
        last set (:mod:`posenc_jax.bench.baselines`)."""
        return self.baseline_scores(n, max(self.answer_distribution(n)), None)


register_task(
    "cope_count",
    lambda num_variables=3, **settings: CountingTask("cope_count", num_variables),
    "Counting: the printed variable's value after set and increment statements (decoder)",
    unit="statements",
)
