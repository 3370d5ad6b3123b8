"""Kazemnejad et al. 2023's decoder tasks (arXiv:2305.19466): ``x SEP y EOS``, causal, exact match.

``counting_copy`` (one token repeated n times, copy it), ``counting_replace`` (their "replace s
with t in s … s": ``x = s t s^n``, ``y = t^n``), ``copy``, ``duplicate`` (``y = x x``),
``reverse``. The causal model is trained on ``y EOS`` and scored by exact match: teacher-forced
argmax over ``y`` is exactly greedy decoding's exact match (if every next token is right given
the true prefix, greedy never leaves it), so one forward pass scores it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction
from typing import ClassVar

import numpy as np

from posenc_jax.bench.tasks.base import (
    NUM_SYMBOLS,
    TASK_FORMATS,
    Generated,
    check_format,
    format_notes,
    pad_rows,
    register_task,
)

__all__ = ["DecoderTask", "PAPER_DECODER_SYMBOLS"]

# Kazemnejad et al. draw random strings from 100 tokens of T5's vocabulary; here 100 symbols.
# (Their counting copy gives each example of a length its own token, from several thousand;
# here a token is drawn uniformly from the same 100.)
PAPER_DECODER_SYMBOLS = 100
# The paper format's words, one token each (the authors' T5 tokenizer splits "Copy:" into two
# pieces; one token per word here): "Copy:", "Reverse:", "Replace", "with", "in", and the
# separator "[NEXT]" between the two copies of duplicate's answer.
_WORDS = ("copy", "reverse", "replace", "with", "in", "next")


@dataclasses.dataclass(frozen=True)
class DecoderTask(Generated):
    """``prompt SEP y EOS`` with ``y = f(x)``, causal, exact match over ``y EOS``.

    The end token is part of the answer: knowing when to stop is what makes
    counting copy hard.

    Two formats (``format``):

    * ``"ours"``: the prompt is ``x`` itself over 10 symbols (counting replace: ``s t s^n``),
      and duplicate's answer is ``x x``.
    * ``"paper"``: Kazemnejad et al.'s: ``Copy: x`` (copy, counting copy, duplicate),
      ``Reverse: x``, ``Replace s with t in s^n``; duplicate's answer is ``x [NEXT] x``;
      symbols from an alphabet of 100.

    Example:
      >>> task = DecoderTask("duplicate", format="paper")
      >>> x = np.array([task.copy_word, 7, 42])  # "Copy: 7 42"
      >>> [task.token_name(t) for t in task.answer(x)]
      ['7', '42', '[NEXT]', '7', '42']
    """

    name: str
    format: str = "ours"
    kind: ClassVar[str] = "decoder"
    metric: ClassVar[str] = "exact_match"
    higher_is_better: ClassVar[bool] = True

    def __post_init__(self):
        check_format(self.name, self.format, TASK_FORMATS)

    @property
    def symbols(self) -> int:
        """The alphabet of ``x``."""
        return NUM_SYMBOLS if self.format == "ours" else PAPER_DECODER_SYMBOLS

    # Special tokens follow the symbols: SEP, (BLANK, unused), PAD, EOS, then the paper's words.
    @property
    def sep(self) -> int:
        return self.symbols

    @property
    def pad(self) -> int:
        return self.symbols + 2

    @property
    def eos(self) -> int:
        return self.symbols + 3

    def _word(self, word: str) -> int:
        return self.symbols + 4 + _WORDS.index(word)

    @property
    def copy_word(self) -> int:
        """The token "Copy:" (paper format)."""
        return self._word("copy")

    @property
    def words(self) -> tuple[str, ...]:
        """The format's instruction words, each a token after the special ones (none in ours)."""
        return () if self.format == "ours" else _WORDS

    @property
    def vocab_size(self) -> int:
        """The symbols, the four special tokens, then the format's words."""
        return self.symbols + 4 + len(self.words)

    def token_name(self, token: int) -> str:
        """A token as the authors' text writes it (symbols as numbers)."""
        token = int(token)
        if token < self.symbols:
            return str(token)
        names = ["[SEP]", "[BLANK]", "[PAD]", "[EOS]", "Copy:", "Reverse:", "Replace", "with", "in", "[NEXT]"]
        return names[token - self.symbols]

    def prompt(self, x: np.ndarray) -> np.ndarray:
        """The tokens before the separator, for the input string ``x`` (counting replace: ``s t s^n``)."""
        if self.format == "ours":
            return np.asarray(x)
        if self.name == "counting_replace":
            s, t, rest = x[0], x[1], x[2:]
            return np.array([self._word("replace"), s, self._word("with"), t, self._word("in"), *rest])
        word = self._word("reverse" if self.name == "reverse" else "copy")
        return np.array([word, *x])

    def _example(self, rng: np.random.Generator, n: int):
        a = self.symbols
        if self.name == "counting_copy":
            x = np.full(n, rng.integers(a))
        elif self.name == "counting_replace":
            # Kazemnejad et al.'s "Replace s with t in s s s": the two symbols, then s n times.
            s = rng.integers(a)
            t = (s + 1 + rng.integers(a - 1)) % a  # any symbol but s
            x = np.array([s, t, *[s] * n])
        elif self.name in ("copy", "duplicate", "reverse"):
            x = rng.integers(0, a, n)
        else:
            raise ValueError(f"unknown decoder task {self.name!r}")
        prompt = self.prompt(x)
        return prompt, self.answer(prompt)

    def answer(self, prompt: np.ndarray) -> np.ndarray:
        """``y = f(x)`` (without the end token), from the prompt."""
        prompt = np.asarray(prompt)
        if self.format == "ours":
            x = prompt
            if self.name == "counting_replace":
                return np.full(len(x) - 2, x[1])
        elif self.name == "counting_replace":  # Replace s with t in s^n
            return np.full(len(prompt) - 5, prompt[3])
        else:
            x = prompt[1:]  # after "Copy:" or "Reverse:"
        if self.name == "duplicate":
            middle = [] if self.format == "ours" else [self._word("next")]
            return np.concatenate([x, middle, x]).astype(x.dtype)
        if self.name == "reverse":
            return x[::-1]
        return x  # copy, counting copy

    def support(self, n: int):
        """Every prompt of length ``n`` with its probability, as ``(prompt, p)`` pairs (for exact baselines)."""
        a = self.symbols
        if self.name == "counting_copy":
            xs = [(np.full(n, s), 1 / a) for s in range(a)]
        elif self.name == "counting_replace":
            pairs = [(s, t) for s in range(a) for t in range(a) if t != s]
            xs = [(np.array([s, t, *[s] * n]), 1 / len(pairs)) for s, t in pairs]
        else:
            xs = [(np.array(x), float(a) ** -n) for x in itertools.product(range(a), repeat=n)]
        return [(self.prompt(x), p) for x, p in xs]

    def max_tokens(self, n: int) -> int:
        """Model input length for an example of length n (``prompt SEP y EOS`` less the last token)."""
        words = 0 if self.format == "ours" else 1  # "Copy:" or "Reverse:"; "[NEXT]" in duplicate's answer
        # Counting replace's prompt holds s and t besides s^n (the paper's adds "Replace", "with", "in").
        prompt = n + 2 + 3 * words if self.name == "counting_replace" else n + words
        answer = 2 * n + words if self.name == "duplicate" else n
        return prompt + 1 + answer

    def batch(self, rng: np.random.Generator, lengths, *, split: str = "train", pad_to: int | None = None) -> dict:
        """A batch with one example of each length in ``lengths``, padded to the longest
        (or to ``pad_to`` input tokens, for a fixed shape)."""
        seqs, weights = [], []
        for n in lengths:
            x, y = self._example(rng, int(n))
            seqs.append(np.concatenate([x, [self.sep], y, [self.eos]]))
            weights.append(np.concatenate([np.zeros(len(x)), np.ones(len(y) + 1)]))
        total = max(len(s) for s in seqs) if pad_to is None else pad_to + 1
        tokens = pad_rows(seqs, total, self.pad)
        w = np.zeros((len(seqs), total - 1), np.float32)
        for i, row in enumerate(weights):
            w[i, : len(row)] = row  # weight on predicting each y token from its prefix
        return {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "weights": w,
            "positions": np.arange(total - 1, dtype=np.int32),
        }

    def score(self, predictions: np.ndarray, batch: dict) -> np.ndarray:
        """Exact match per example: every weighted target predicted."""
        w = batch["weights"] > 0
        correct = (predictions == batch["targets"]) | ~w
        return correct.all(axis=-1).astype(np.float64)

    def chance(self, n: int) -> float | None:
        """None: guessing a whole answer right is vanishingly rare (below 10^-n)."""
        return None

    def baselines(self, n: int) -> dict[str, float | None]:
        """Chance, position-only and content-only exact match at input length ``n``, with the
        symbols uniform over the format's alphabet of A (:mod:`posenc_jax.bench.baselines`).

        * counting copy, counting replace: position-only 1/A (the symbol written is a guess);
          content-only 1 (in ``s t s^n`` the symbol seen once is t, and the other's count is n + 1).
        * copy, reverse, duplicate: position-only A^-n; content-only: given the multiset M with
          counts c, each arrangement has probability Π c_s! / n!, and summed over M weighted by
          P(M) = n! / (Π c_s! · A^n) this is (number of multisets) / A^n = C(n + A − 1, A − 1) / A^n.
        """
        a = self.symbols
        if self.name in ("counting_copy", "counting_replace"):
            return self.baseline_scores(n, Fraction(1, a), Fraction(1))
        return self.baseline_scores(n, Fraction(1, a**n), Fraction(math.comb(n + a - 1, a - 1), a**n))


_PAPER = "Kazemnejad et al.'s"
# How each format stands to the paper's (reports print it beside the published column), and the titles.
_DECODER_TASKS = {
    "counting_copy": (
        "Counting copy: one symbol repeated n times, copy it (decoder)",
        "counting copy",
        "no instruction word ('Copy:'), 10 symbols (theirs: a token per example from thousands)",
        "'Copy: s^n [SEP] s^n'; 100 symbols, each example's drawn uniformly (theirs: a different token for each "
        "example of a length, from thousands of T5 tokens)",
    ),
    "counting_replace": (
        "Counting replace: s t then s n times, write t n times (decoder)",
        "counting replace",
        "no instruction words ('Replace s with t in'), 10 symbols (theirs: about 80)",
        "'Replace s with t in s^n [SEP] t^n'; 100 symbols (theirs: about 80)",
    ),
    "copy": (
        "Copy a random string (decoder)",
        "",
        "no instruction word ('Copy:'), 10 symbols (theirs: 100)",
        "'Copy: x [SEP] x'; 100 symbols",
    ),
    "duplicate": (
        "Duplicate a random string, y = x x (decoder)",
        "",
        "no instruction word ('Copy:') and no [NEXT] between the copies, 10 symbols (theirs: 100)",
        "'Copy: x [SEP] x [NEXT] x'; 100 symbols",
    ),
    "reverse": (
        "Reverse a random string (decoder)",
        "",
        "no instruction word ('Reverse:'), 10 symbols (theirs: 100)",
        "'Reverse: x [SEP] reversed x'; 100 symbols",
    ),
}
for _name, (_title, _short, _ours, _same) in _DECODER_TASKS.items():
    register_task(
        _name,
        lambda name=_name, format="ours", **settings: DecoderTask(name, format),
        _title,
        short=_short,
        formats=TASK_FORMATS,
        notes=format_notes(_PAPER, ours=_ours, same=_same, words=True),
    )
