"""Flip-flop language modelling (Liu et al. 2023, arXiv:2306.00946), a task of CoPE (Golovneva et al. 2024).

Write, ignore and read instructions on bits; trained as a language model, scored on the read
bits. Its lengths are instruction-bit pairs (:class:`FlipFlopTask`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from posenc_jax.bench.tasks.base import Generated, pad_rows, register_task

__all__ = ["FF_IGNORE", "FF_ONE", "FF_PAD", "FF_READ", "FF_WRITE", "FF_ZERO", "FlipFlopTask"]

# Flip-flop tokens: the two bits, then the three instructions.
FF_ZERO, FF_ONE, FF_WRITE, FF_READ, FF_IGNORE, FF_PAD = range(6)


@dataclasses.dataclass(frozen=True)
class FlipFlopTask(Generated):
    """Flip-flop language modelling (Liu et al. 2023, "Exposing Attention Glitches with Flip-Flop
    Language Modeling", arXiv:2306.00946; a task of CoPE, Golovneva et al. 2024, arXiv:2405.18719).

    An example of length n is n instruction–bit pairs ``σ_1 b_1 σ_2 b_2 ... σ_n b_n``: ``w b``
    writes the bit b, ``i b`` is to be ignored, ``r b`` reads, and its b is the last written bit.
    As in Liu et al.'s FFL(p): the first instruction is ``w``, the last ``r``, the others are drawn
    independently with probabilities ``(p_w, p_r, p_i) = ((1 − p_i)/2, (1 − p_i)/2, p_i)``, and the
    bits of writes and ignores are uniform and independent. The default ``p_i = 0.8`` is FFL(0.8),
    the papers' training distribution; ``make_task("flip_flop", ignore_probability=0.98)`` is
    Liu et al.'s sparse test distribution and ``0.1`` their dense one (API only: the rows of
    such a run carry the task name ``flip_flop``, so give it its own results folder).

    The causal model is trained as a language model on the whole sequence (``weights``: every
    next token, the random bits included, as Liu et al. train), and scored only on the
    deterministic predictions, the bits after ``r`` (``read_weights``): **accuracy over the
    reads**, per example (Liu et al. report the error on those positions; 1 − this is it).

    What differs from the papers: they train and test at one fixed sequence length (T = 512
    tokens, 256 pairs, in Liu et al.); here the benchmark trains on lengths of 2..L pairs (at
    least 2: one write and one read) and tests longer ones at the same ``p_i``.
    At a fixed ``p_i`` the distance from a read back to its write does not grow with n (its
    mean is 1/p_w pairs), so a longer test probes positions beyond training more than longer
    dependencies; the sparse setting is the one with long ones. Liu et al.'s sparse and dense
    sets are out-of-distribution tests of a model trained on FFL(0.8); here a setting applies
    to training and testing alike. Sizes of the models are the benchmark's, not the papers'.

    Example:
      >>> from posenc_jax.bench.tasks import make_task
      >>> task = make_task("flip_flop")
      >>> batch = task.batch(np.random.default_rng(0), [3])
      >>> batch["inputs"].shape, int(batch["read_weights"].sum())
      ((1, 5), 1)
    """

    name: str = "flip_flop"
    ignore_probability: float = 0.8
    kind: ClassVar[str] = "decoder"
    metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True
    vocab_size: ClassVar[int] = FF_PAD + 1

    def __post_init__(self):
        if not 0.0 <= self.ignore_probability < 1.0:
            raise ValueError(
                f"flip_flop: ignore_probability must be in [0, 1) (writes and reads share the rest), "
                f"got {self.ignore_probability}"
            )

    def train_lengths(
        self, rng: np.random.Generator, train_length: int, batch_size: int, minimum: int = 1
    ) -> np.ndarray:
        """Lengths drawn uniformly from max(2, ``minimum``)..``train_length`` pairs (a write and a read at least)."""
        low = max(minimum, 2)
        return rng.integers(low, max(train_length, low) + 1, batch_size)

    def check_lengths(self, train_length: int, eval_lengths) -> None:
        lengths = [train_length, *eval_lengths]
        if min(lengths) < 2:
            raise ValueError(
                f"{self.name}: lengths are instruction-bit pairs and must be >= 2 (the first is a write, "
                f"the last a read), got {min(lengths)}"
            )

    def _example(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """The ``2n`` tokens of one sequence of n pairs."""
        if n < 2:
            raise ValueError(f"{self.name}: an example needs at least 2 pairs, got {n}")
        p_rw = (1.0 - self.ignore_probability) / 2
        instructions = rng.choice(
            np.array([FF_WRITE, FF_READ, FF_IGNORE]), size=n, p=[p_rw, p_rw, self.ignore_probability]
        )
        instructions[0], instructions[-1] = FF_WRITE, FF_READ
        bits = rng.integers(0, 2, n)
        writes = np.where(instructions == FF_WRITE, np.arange(n), 0)
        last_write = np.maximum.accumulate(writes)  # the first pair is a write
        reads = instructions == FF_READ
        bits[reads] = bits[last_write[reads]]
        return np.stack([instructions, bits], axis=1).reshape(-1)

    def max_tokens(self, n: int) -> int:
        """Model input length for n pairs: the 2n tokens less the last."""
        return 2 * n - 1

    def batch(self, rng: np.random.Generator, lengths, *, split: str = "train", pad_to: int | None = None) -> dict:
        seqs = [self._example(rng, int(n)) for n in lengths]
        total = max(len(s) for s in seqs) if pad_to is None else pad_to + 1
        tokens = pad_rows(seqs, total, FF_PAD)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        weights = np.zeros(inputs.shape, np.float32)
        for i, s in enumerate(seqs):
            weights[i, : len(s) - 1] = 1.0  # every next token of the sequence
        return {
            "inputs": inputs,
            "targets": targets,
            "weights": weights,
            "read_weights": (inputs == FF_READ).astype(np.float32),  # the bit after each r
            "positions": np.arange(total - 1, dtype=np.int32),
        }

    def score(self, predictions: np.ndarray, batch: dict) -> np.ndarray:
        """Accuracy over the read bits, per example."""
        w = batch["read_weights"]
        return ((predictions == batch["targets"]) * w).sum(-1) / np.maximum(w.sum(-1), 1)

    def chance(self, n: int) -> float | None:
        """1/2: a read's bit guessed uniformly."""
        return 0.5

    def baselines(self, n: int) -> dict[str, float | None]:
        """Accuracy over the read bits: position-only 1/2, since every bit is uniform and independent
        of the instructions; content-only None: the counts of the bits and instructions say a little
        about the reads, by an amount with no closed form (:mod:`posenc_jax.bench.baselines`)."""
        return self.baseline_scores(n, 0.5, None)


register_task(
    "flip_flop",
    lambda ignore_probability=0.8, **settings: FlipFlopTask("flip_flop", ignore_probability),
    "Flip-flop: read back the last written bit (decoder)",
    unit="instruction-bit pairs",
)
