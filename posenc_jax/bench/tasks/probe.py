"""The blind-spot probe (Su 2022; Luo et al. 2022): n identical tokens, each position's answer its index.

``probe_boundary`` wraps the tokens in boundary tokens ``[CLS] ... [SEP]``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from posenc_jax.bench.tasks.base import ALGO_VOCAB, BLANK, PAD, SEP, Generated, register_task

__all__ = ["ProbeTask"]


@dataclasses.dataclass(frozen=True)
class ProbeTask(Generated):
    """The blind-spot probe: n identical tokens, the target at position i is i (optionally [CLS] ... [SEP])."""

    name: str
    boundary: bool = False
    max_length: int = 256
    kind: ClassVar[str] = "encoder"
    metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True

    @property
    def vocab_size(self) -> int:
        return self.max_length + ALGO_VOCAB  # position classes sit above the symbols

    # The target at position i is i: identical tokens with no positions cannot tell them apart.
    slots_differ: ClassVar[bool] = True

    def max_tokens(self, n: int) -> int:
        return n + (2 if self.boundary else 0)

    def batch(self, rng: np.random.Generator, lengths, *, split: str = "train", pad_to: int | None = None) -> dict:
        total = self.max_tokens(max(lengths)) if pad_to is None else pad_to
        inputs = np.full((len(lengths), total), PAD, np.int32)
        targets = np.zeros((len(lengths), total), np.int32)
        weights = np.zeros((len(lengths), total), np.float32)
        key_mask = np.zeros((len(lengths), total), bool)
        for i, n in enumerate(lengths):
            start = 1 if self.boundary else 0
            inputs[i, start : start + n] = 0
            if self.boundary:
                inputs[i, 0], inputs[i, n + 1] = SEP, BLANK  # [CLS], [SEP]
            targets[i, start : start + n] = np.arange(n) + ALGO_VOCAB  # classes above the symbols
            weights[i, start : start + n] = 1.0
            key_mask[i, : n + (2 if self.boundary else 0)] = True
        return {
            "inputs": inputs,
            "targets": targets,
            "weights": weights,
            "positions": np.arange(total, dtype=np.int32),
            "key_mask": key_mask,
        }

    def score(self, predictions, batch):
        w = batch["weights"]
        return ((predictions == batch["targets"]) * w).sum(-1) / np.maximum(w.sum(-1), 1)

    def chance(self, n: int) -> float | None:
        """1/n: what a model that cannot tell the positions apart scores at best (Su 2022)."""
        return 1.0 / n

    def baselines(self, n: int) -> dict[str, float | None]:
        """Chance 1/n; position-only and content-only both 1, since the answer is the slot itself,
        which both predictors know: what the probe reads against is chance, what a model that
        cannot tell the positions apart scores (:mod:`posenc_jax.bench.baselines`)."""
        return self.baseline_scores(n, 1, 1)

    def check_lengths(self, train_length: int, eval_lengths) -> None:
        super().check_lengths(train_length, eval_lengths)
        longest = max(train_length, *eval_lengths)
        if longest > self.max_length:
            raise ValueError(
                f"{self.name}: length {longest} needs {longest} position classes but the task has "
                f"{self.max_length}; make it with make_task({self.name!r}, max_length={longest})"
            )


register_task(
    "probe",
    lambda max_length=256, **settings: ProbeTask("probe", boundary=False, max_length=max_length),
    "Probe: index of each of n identical tokens (encoder)",
    short="probe (enc)",
)
register_task(
    "probe_boundary",
    lambda max_length=256, **settings: ProbeTask("probe_boundary", boundary=True, max_length=max_length),
    "Probe with [CLS] ... [SEP] boundary tokens (encoder)",
    short="probe + [CLS]/[SEP] (enc)",
)
