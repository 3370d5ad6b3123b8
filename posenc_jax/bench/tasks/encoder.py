"""Ruoss et al. 2023's encoder tasks (arXiv:2305.16843): ``x`` then blanks, per-token accuracy.

A bidirectional model writes the answer on the blank tokens after ``x``: ``reverse_string``,
``missing_duplicate`` (which bit of ``w w`` is hidden), ``parity``, ``bucket_sort``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction
from typing import ClassVar

import numpy as np

from posenc_jax.bench.tasks.base import (
    BLANK,
    EMPTY,
    MARKER,
    NUM_SYMBOLS,
    PAD,
    TASK_FORMATS,
    Generated,
    check_format,
    format_notes,
    pad_rows,
    register_task,
)

__all__ = ["EncoderTask", "PAPER_ENCODER_SYMBOLS", "half_length"]

# Ruoss et al.'s alphabets: binary strings, except bucket sort's 5 symbols.
PAPER_ENCODER_SYMBOLS = {"reverse_string": 2, "missing_duplicate": 2, "parity": 2, "bucket_sort": 5}


def half_length(n: int) -> int:
    """Missing duplicate: the length of w in ``w w`` for an example of length n (n rounded up to even)."""
    return max(1, (n + 1) // 2)


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


@dataclasses.dataclass(frozen=True)
class EncoderTask(Generated):
    """``x`` then blanks; the answer is read from the blanks; per-token accuracy.

    Two formats (``format``): ``"ours"`` (reverse string and bucket sort over 10 symbols;
    missing duplicate rounds an odd length up to the next even one) and ``"paper"``, Ruoss et
    al.'s: reverse string over bits, bucket sort over 5 symbols, and missing duplicate keeping
    an odd length n as ``w w`` with ``|w| = n // 2`` followed by an empty token (length 1:
    the input ``1`` with the answer 1, as their code defines it). Parity is the same in both.

    Example:
      >>> task = EncoderTask("missing_duplicate", format="paper")
      >>> task.answer(np.array([1, 0, 1, 1, MARKER, 1, EMPTY]))  # 101 1?1, then the empty token
      array([0])
    """

    name: str
    format: str = "ours"
    kind: ClassVar[str] = "encoder"
    metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True

    def __post_init__(self):
        check_format(self.name, self.format, TASK_FORMATS)

    @property
    def symbols(self) -> int:
        """The alphabet of ``x`` (missing duplicate: of ``w``, before a token is hidden)."""
        if self.format == "paper":
            return PAPER_ENCODER_SYMBOLS.get(self.name, NUM_SYMBOLS)
        return 2 if self.name in ("parity", "missing_duplicate") else NUM_SYMBOLS

    @property
    def vocab_size(self) -> int:
        """The 10 symbols and the four special tokens, in either format."""
        return NUM_SYMBOLS + 4

    def _example(self, rng: np.random.Generator, n: int):
        if self.name in ("reverse_string", "bucket_sort", "parity"):
            x = rng.integers(0, self.symbols, n)
        elif self.name == "missing_duplicate":
            if self.format == "paper" and n == 1:
                x = np.array([1])  # Ruoss et al.'s length 1: input 1, answer 1
            else:
                # A binary string w w with one token hidden; say which.
                w = rng.integers(0, 2, n // 2 if self.format == "paper" else half_length(n))
                x = np.concatenate([w, w])
                x[rng.integers(len(x))] = MARKER
                if self.format == "paper" and n % 2:
                    x = np.concatenate([x, [EMPTY]])
        else:
            raise ValueError(f"unknown encoder task {self.name!r}")
        return x, self.answer(x)

    @property
    def slots_differ(self) -> bool:
        """Whether the answer's slots can hold different symbols for one input. The blanks are
        identical tokens, so a bidirectional model with no position information (NoPE) writes
        the same symbol on all of them: it cannot learn such a task, by construction."""
        return self.name in ("reverse_string", "bucket_sort")

    def answer(self, x: np.ndarray) -> np.ndarray:
        """The answer written on the blanks."""
        if self.name == "reverse_string":
            return x[::-1]
        if self.name == "bucket_sort":
            return np.sort(x)
        if self.name == "parity":
            return np.array([x.sum() % 2])
        if self.name == "missing_duplicate":
            core = x[x != EMPTY] if self.format == "paper" else x
            if self.format == "paper" and len(x) == 1:
                return np.array([1])
            hidden = int(np.flatnonzero(core == MARKER)[0])
            return np.array([core[(hidden + len(core) // 2) % len(core)]])  # the hidden token's twin
        raise ValueError(f"unknown encoder task {self.name!r}")

    def support(self, n: int):
        """Every input ``x`` of length ``n`` with its probability, as ``(x, p)`` pairs (for exact baselines)."""
        if self.name == "missing_duplicate":
            if self.format == "paper" and n == 1:
                return [(np.array([1]), 1.0)]
            half = n // 2 if self.format == "paper" else half_length(n)
            tail = [EMPTY] if self.format == "paper" and n % 2 else []
            out = []
            for w in itertools.product(range(2), repeat=half):
                for hidden in range(2 * half):
                    x = np.array(w + w + tuple(tail))
                    x[hidden] = MARKER
                    out.append((x, 2.0**-half / (2 * half)))
            return out
        a = self.symbols
        return [(np.array(x), float(a) ** -n) for x in itertools.product(range(a), repeat=n)]

    def max_tokens(self, n: int) -> int:
        """Model input length for an example of length n (x and its answer blanks)."""
        if self.name == "missing_duplicate" and self.format == "paper":
            return n + 1
        if self.name in ("parity", "missing_duplicate"):
            return n + 2
        return 2 * n

    def batch(self, rng: np.random.Generator, lengths, *, split: str = "train", pad_to: int | None = None) -> dict:
        seqs, weights, targets = [], [], []
        for n in lengths:
            x, y = self._example(rng, int(n))
            seqs.append(np.concatenate([x, np.full(len(y), BLANK)]))
            targets.append(np.concatenate([np.full(len(x), PAD), y]))
            weights.append(np.concatenate([np.zeros(len(x)), np.ones(len(y))]))
        total = max(len(s) for s in seqs) if pad_to is None else pad_to
        key_mask = np.zeros((len(seqs), total), bool)
        for i, s in enumerate(seqs):
            key_mask[i, : len(s)] = True
        w = np.zeros((len(seqs), total), np.float32)
        for i, row in enumerate(weights):
            w[i, : len(row)] = row
        return {
            "inputs": pad_rows(seqs, total, PAD),
            "targets": pad_rows(targets, total, PAD),
            "weights": w,
            "positions": np.arange(total, dtype=np.int32),
            "key_mask": key_mask,
        }

    def score(self, predictions: np.ndarray, batch: dict) -> np.ndarray:
        """Per-token accuracy on the blanks, per example."""
        w = batch["weights"]
        return ((predictions == batch["targets"]) * w).sum(-1) / np.maximum(w.sum(-1), 1)

    def chance(self, n: int) -> float | None:
        """Uniform guessing: 1/2 for the binary answers (parity, missing duplicate), 1/A per symbol."""
        return 0.5 if self.name in ("parity", "missing_duplicate") else 1.0 / self.symbols

    def baselines(self, n: int) -> dict[str, float | None]:
        """Chance, position-only and content-only per-token accuracy at input length ``n``, with the
        symbols uniform over the format's alphabet of A, or bits (:mod:`posenc_jax.bench.baselines`).

        * reverse string: position-only 1/A; content-only E[max_s c_s] / n, with the distribution of
          the largest count from P(max ≤ m) = #{sequences with every count ≤ m} / A^n, counted
          exactly by adding one symbol at a time.
        * bucket sort: content-only 1; position-only mean_j max_s P(y_j = s), where y_j is the j-th
          smallest symbol: P(y_j ≤ s) = P(Binomial(n, (s + 1)/A) ≥ j + 1).
        * parity, missing duplicate (one binary answer): position-only 1/2; content-only 1 (the
          number of ones decides parity; in ``w w`` with one bit hidden, the parity of the visible
          ones is the hidden bit). The paper format's missing duplicate at length 1 always answers 1.
        """
        a = self.symbols
        if self.name == "reverse_string":
            return self.baseline_scores(n, Fraction(1, a), _expected_largest_count(n, a) / n)
        if self.name == "bucket_sort":
            return self.baseline_scores(n, _sorted_slot_best(n, a), Fraction(1))
        if self.name == "missing_duplicate" and n == 1 and self.format == "paper":
            return self.baseline_scores(n, Fraction(1), Fraction(1))  # Ruoss et al.'s length 1: the answer is always 1
        return self.baseline_scores(n, Fraction(1, 2), Fraction(1))


_PAPER = "Ruoss et al.'s"
# Per task: its title, its overview column, how ours differs from the paper's format, the paper format.
_ENCODER_TASKS = {
    "reverse_string": (
        "Reverse string (encoder)",
        "reverse string (enc)",
        "10 symbols (theirs: binary)",
        "binary strings",
    ),
    "missing_duplicate": (
        "Missing duplicate: which bit of w w is hidden (encoder)",
        "missing dup. (enc)",
        "an odd length rounded up to even (theirs: kept, with an empty token)",
        "binary w w, one token hidden, an odd length kept with an empty token last",
    ),
    "parity": ("Parity of a bit string (encoder)", "parity (enc)", "", "binary strings"),
    "bucket_sort": ("Bucket sort (encoder)", "bucket sort (enc)", "10 symbols (theirs: 5)", "5 symbols"),
}
for _name, (_title, _short, _ours, _same) in _ENCODER_TASKS.items():
    register_task(
        _name,
        lambda name=_name, format="ours", **settings: EncoderTask(name, format),
        _title,
        short=_short,
        formats=TASK_FORMATS,
        notes=format_notes(_PAPER, ours=_ours, same=_same),
    )
