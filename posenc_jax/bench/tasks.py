"""Length-generalisation tasks, generated on the fly from a seed (no download).

Every task makes batches ``{"inputs", "targets", "weights", "positions"}`` of token ids
for a Transformer (encoder tasks add ``key_mask``; causal tasks pad after the
answer, where no query looks), and says how to score a prediction:

* **decoder tasks** (after Kazemnejad et al. 2023, arXiv:2305.19466): the sequence
  is ``x SEP y EOS``; the causal model is trained on ``y EOS`` and scored by
  exact match. Teacher-forced argmax over ``y`` is exactly greedy decoding's exact
  match (if every next token is right given the true prefix, greedy never leaves
  it), so one forward pass scores it.
  ``counting_copy`` (one token repeated n times, copy it), ``counting_replace`` (their
  "replace s with t in s … s": ``x = s t s^n``, ``y = t^n``), ``copy``, ``duplicate``
  (``y = x x``), ``reverse``.
* **encoder tasks** (after Ruoss et al. 2023, arXiv:2305.16843): ``x`` followed by
  blank tokens; a bidirectional model writes the answer on the blanks and is
  scored by per-token accuracy. ``reverse_string``, ``missing_duplicate``,
  ``parity``, ``bucket_sort``.
* **probe** (the blind spot of relative encodings, Su 2022; Luo et al. 2022): n identical
  tokens, the answer at each position is its
  index; optionally wrapped in boundary tokens ``[CLS] ... [SEP]``.
* **the CoPE paper's tasks** (Golovneva et al. 2024, arXiv:2405.18719), causal:
  ``flip_flop`` (Liu et al. 2023, arXiv:2306.00946: write, ignore and read instructions on
  bits; trained as a language model, scored on the read bits) and ``cope_count`` (statements
  that set, increment or leave alone variables; the answer is the printed variable's value).
  Their lengths are pairs and statements (see :class:`FlipFlopTask`, :class:`CountingTask`).
* **text**: character-level language modelling on real text, scored in bits per
  character. The default corpus is Python source code: 78 standard-library files pinned by
  their SHA-256, the same text on every interpreter that has them (see :func:`stdlib_corpus`);
  any text file or folder works, and so do ``wikitext103`` and ``tinyshakespeare`` from the
  Hugging Face hub where there is internet (:func:`load_hub_corpus`, extra ``data``).

The length of an example is the length of ``x`` (for ``text``: the context).

Every task implements :class:`Task`, the one protocol the benchmark runner uses: how to
draw training lengths, make a batch, score a model's outputs, what chance is, and
whether a length can be served at all (a corpus too short for the windows asked of it
is refused before any training).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import pathlib
import platform
import sysconfig
import warnings
from typing import ClassVar, Protocol

import numpy as np

__all__ = [
    "CountingTask",
    "DecoderTask",
    "EncoderTask",
    "FlipFlopTask",
    "ProbeTask",
    "STDLIB_CORPUS_SHA256",
    "FORMATTED_TASKS",
    "format_note",
    "TASKS",
    "TASK_FORMATS",
    "Task",
    "TextTask",
    "load_hub_corpus",
    "make_task",
    "stdlib_corpus",
    "task_names",
    "text_from_dataset",
]

NUM_SYMBOLS = 10
SEP, BLANK, PAD, EOS = NUM_SYMBOLS, NUM_SYMBOLS + 1, NUM_SYMBOLS + 2, NUM_SYMBOLS + 3
ALGO_VOCAB = NUM_SYMBOLS + 4
MARKER = 2  # missing duplicate's hidden token, outside its binary alphabet
EMPTY = 3  # missing duplicate's empty token after an odd length (paper format)


def _half(n: int) -> int:
    """Missing duplicate: the length of w in ``w w`` for an example of length n (n rounded up to even)."""
    return max(1, (n + 1) // 2)


class Task(Protocol):
    """What the benchmark asks of a task (every task of :data:`TASKS` implements it).

    Attributes:
      name: the registered name.
      kind: ``"decoder"`` (a causal model) or ``"encoder"`` (a bidirectional one).
      metric: the name of the score (``"exact_match"``, ``"accuracy"``, ``"bits_per_char"``).
      higher_is_better: the score's direction.
      vocab_size: the model's number of tokens.
      scored_on: the model output :meth:`score` reads: ``"predictions"`` (argmax ids
        ``[B, T]``) or ``"target_log_probs"`` (the targets' log-probabilities ``[B, T]``, nats).
      length_family: ``"algorithmic"`` or ``"text"``: which of a benchmark preset's length
        settings apply (symbols of ``x``, or characters of context).
      fixed_eval_shape: True when every evaluation length is padded to the longest (one
        compilation; padding is masked or causally unseen), False when each length runs at
        its own size.
    """

    name: str
    kind: str
    metric: str
    higher_is_better: bool
    vocab_size: int
    scored_on: str
    length_family: str
    fixed_eval_shape: bool

    def max_tokens(self, n: int) -> int:
        """Model input length for an example of length ``n``."""

    def train_lengths(
        self, rng: np.random.Generator, train_length: int, batch_size: int, minimum: int = 1
    ) -> np.ndarray:
        """The lengths of one training batch's examples (``minimum``..``train_length`` where the
        task's lengths vary)."""

    def batch(self, rng: np.random.Generator, lengths, *, split: str = "train", pad_to: int | None = None) -> dict:
        """One example of each length in ``lengths`` (``split``: ``"train"`` or ``"test"``)."""

    def score(self, outputs: np.ndarray, batch: dict) -> np.ndarray:
        """The metric per example, from the model output named by ``scored_on``."""

    def chance(self, n: int) -> float | None:
        """The score of guessing uniformly at length ``n``, or None where no such line is meaningful."""

    def check_lengths(self, train_length: int, eval_lengths) -> None:
        """Raises ValueError, naming the length and the fix, if the task cannot serve these lengths."""


class _Generated:
    """What the generated (algorithmic) tasks share: lengths 1..L in training, fresh examples
    from the random generator (``split`` only names the use: train and test draw from
    different generators, so they never repeat by construction)."""

    scored_on: ClassVar[str] = "predictions"
    length_family: ClassVar[str] = "algorithmic"
    fixed_eval_shape: ClassVar[bool] = True

    def train_lengths(
        self, rng: np.random.Generator, train_length: int, batch_size: int, minimum: int = 1
    ) -> np.ndarray:
        """Lengths drawn uniformly from ``minimum``..``train_length``."""
        return rng.integers(minimum, train_length + 1, batch_size)

    def check_lengths(self, train_length: int, eval_lengths) -> None:
        lengths = [train_length, *eval_lengths]
        if min(lengths) < 1:
            raise ValueError(f"{self.name}: lengths must be >= 1, got {min(lengths)}")


def _pad(rows, length, value):
    longest = max(len(row) for row in rows)
    if longest > length:
        raise ValueError(f"an example needs {longest} tokens but pad_to allows {length}")
    out = np.full((len(rows), length), value, np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


# The tasks' formats. "ours" is the benchmark's compact form (10 symbols, no instruction words,
# no separator inside an answer); "paper" follows the authors' code: Kazemnejad et al.'s dataset
# builders and instance processors (McGill-NLP/length-generalization, scripts/dataset_builders/
# make_copy_dataset.py and make_reverse_dataset.py, src/data/data_instance_processor/
# copy_instance_processor.py) for the decoder tasks, Ruoss et al.'s task classes
# (google-deepmind/randomized_positional_encodings, tasks/) for the encoder tasks.
TASK_FORMATS = ("ours", "paper")
# Kazemnejad et al. draw random strings from 100 tokens of T5's vocabulary; here 100 symbols.
# (Their counting copy gives each example of a length its own token, from several thousand;
# here a token is drawn uniformly from the same 100.)
PAPER_DECODER_SYMBOLS = 100
# Ruoss et al.'s alphabets: binary strings, except bucket sort's 5 symbols.
PAPER_ENCODER_SYMBOLS = {"reverse_string": 2, "missing_duplicate": 2, "parity": 2, "bucket_sort": 5}
# The paper format's words, one token each (the authors' T5 tokenizer splits "Copy:" into two
# pieces; one token per word here): "Copy:", "Reverse:", "Replace", "with", "in", and the
# separator "[NEXT]" between the two copies of duplicate's answer.
_WORDS = ("copy", "reverse", "replace", "with", "in", "next")


def _check_format(name: str, format: str) -> None:
    if format not in TASK_FORMATS:
        raise ValueError(f"{name}: unknown task format {format!r}; use one of {', '.join(TASK_FORMATS)}")


@dataclasses.dataclass(frozen=True)
class DecoderTask(_Generated):
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
        _check_format(self.name, self.format)

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
    def vocab_size(self) -> int:
        return ALGO_VOCAB if self.format == "ours" else self.symbols + 4 + len(_WORDS)

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
        tokens = _pad(seqs, total, self.pad)
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


@dataclasses.dataclass(frozen=True)
class EncoderTask(_Generated):
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
        _check_format(self.name, self.format)

    @property
    def symbols(self) -> int:
        """The alphabet of ``x`` (missing duplicate: of ``w``, before a token is hidden)."""
        if self.format == "paper":
            return PAPER_ENCODER_SYMBOLS.get(self.name, NUM_SYMBOLS)
        return 2 if self.name in ("parity", "missing_duplicate") else NUM_SYMBOLS

    @property
    def vocab_size(self) -> int:
        return ALGO_VOCAB

    def _example(self, rng: np.random.Generator, n: int):
        if self.name in ("reverse_string", "bucket_sort", "parity"):
            x = rng.integers(0, self.symbols, n)
        elif self.name == "missing_duplicate":
            if self.format == "paper" and n == 1:
                x = np.array([1])  # Ruoss et al.'s length 1: input 1, answer 1
            else:
                # A binary string w w with one token hidden; say which.
                w = rng.integers(0, 2, n // 2 if self.format == "paper" else _half(n))
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
            half = n // 2 if self.format == "paper" else _half(n)
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
            "inputs": _pad(seqs, total, PAD),
            "targets": _pad(targets, total, PAD),
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


@dataclasses.dataclass(frozen=True)
class ProbeTask(_Generated):
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

    def check_lengths(self, train_length: int, eval_lengths) -> None:
        super().check_lengths(train_length, eval_lengths)
        longest = max(train_length, *eval_lengths)
        if longest > self.max_length:
            raise ValueError(
                f"{self.name}: length {longest} needs {longest} position classes but the task has "
                f"{self.max_length}; make it with make_task({self.name!r}, max_length={longest})"
            )


# Flip-flop tokens: the two bits, then the three instructions.
FF_ZERO, FF_ONE, FF_WRITE, FF_READ, FF_IGNORE, FF_PAD = range(6)


@dataclasses.dataclass(frozen=True)
class FlipFlopTask(_Generated):
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
        tokens = _pad(seqs, total, FF_PAD)
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


# CoPE's counting task: the values 0..10 (the set value 0 is the same token), then the words.
COUNT_MAX_VALUE = 10
COUNT_WORDS = range(COUNT_MAX_VALUE + 1, COUNT_MAX_VALUE + 6)
COUNT_EQUALS, COUNT_SEMICOLON, COUNT_PASS, COUNT_INCREMENT, COUNT_PRINT = COUNT_WORDS
COUNT_FIRST_VARIABLE = COUNT_PRINT + 1
# The generator's weights of its three context statements (set, pass, increment).
COUNT_WEIGHTS = (1, 50, 7)


@dataclasses.dataclass(frozen=True)
class CountingTask(_Generated):
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
        tokens = _pad(seqs, total, self.pad)
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


# The default text corpus, pinned: 78 standard-library files whose bytes are the same in CPython
# 3.11.2 (Debian 12), 3.11.7, 3.12.1, 3.13.0 and 3.13.5 (Debian 13), with the split each goes to
# (test: the first byte of the SHA-256 of its path below 39, about 15%). Chosen among the files
# of those versions that are identical in all five, leaving out the codecs (``encodings/``:
# tables and near-copies of one another), the test suite and the packages that distributions
# ship apart (idlelib, tkinter, turtledemo, lib2to3). Later releases change some of them (Debian's
# 3.13.18: 16 files, 3.14.10: 31): there the corpus is refused, never silently another text.
# Each line: the SHA-256 of the file, its split, its path under the standard-library directory.
_STDLIB_FILES = """
981d4c398849f9ebcab72300d9c1fe288fd6d7f28957b3b3fa3a493a5836d95c train __future__.py
a8ce70b199497950f0f06def93115a6814daf1f961934457f59046909901487f train __hello__.py
3ad5d60627477a60939ee44fc1bb3a05dbe8fb52f0f75039b8f5d8f1a278b981 train _compression.py
cb14dd6f2e2439eb70b806cd49d19911363d424c2b6b9f4b73c9c08022d47030 train _markupbase.py
f9c6fe3dd9b51bd7d93f867356e9d362600c924febfd903ee1c6e298860dca92 train _py_abc.py
b9388bc1d6d12ed6be12da420ab1feca40f99c0e33ec315d92b1e01cb69b25bc train _sitebuiltins.py
91895a451d06e9f521a1171b31b9b19bc9740f35af00d4fa106338ab7167c9ac train _weakrefset.py
8a5ee63e1b79ba2733e7ff4290b6eefea60e7f3a1ccb6bb519535aaf92b44967 test  antigravity.py
a5971f88be14cd1417d59adf539ae48c5d818f95362a4e0eb00017e3690ab37b train asyncio/exceptions.py
80e4cc3ded4b138baba486519e7444801a23d6ac35f229d336a407a96af7e8d2 train asyncio/log.py
8f4a3e16eca845ebfba422550cbcee7340ec8166d2bff6b750a8ed0de6b9ae3c test  asyncio/mixins.py
1d1b49988c338b4ef06e30f9e92d9db2e00080c341f0a3f573bb8312deb8aff6 train asyncio/protocols.py
39d37295383641565f0c08bd992e2f661dc8051eb17e890b834fce96bde0910e train asyncio/threads.py
c0eac37debcc51b702b808f6b7ed3e417343f5ff5f57125dad600a27eb082328 train asyncio/trsock.py
e6fcffefa2521666bc2aed0f5caf8e862c1c1014ad12d2ab5fbce09c2df9c6f0 train asyncio/windows_utils.py
87ad5c8954dd56fbbca04517bf87477ff4dce575170c7dd1281d7ef1f4214ac8 train concurrent/__init__.py
5ed260be8d1f4fe92261b7810b4bb1e8539c42093d7493f677d076e1a87f459a train contextvars.py
d8730e360dd00ec046bdd85cae41fe83c907c6ae3716a964158fce8f31ab28b0 train curses/__init__.py
15a052812d9ae80124bb25b3f5b9ffae38e2b03073774e163abf3d773140cfb3 train curses/has_key.py
13ef404a30da1825a612ca3e453db88c305d45deef4441c4c9e2ef7ee0ef50c7 train curses/panel.py
4178321600c0a19ca04cfe8542ce44487f339d15d89a473b58cea63c0b230217 test  email/_encoded_words.py
2d81026aef17e4786b15d9ec0629304987e3f275a0fd0a421a81b4ed87234b2c test  email/contentmanager.py
fada56c25b6a457c6a62af43f9f929bbc29424103ce65f40f114adb4fdf3d39f train email/headerregistry.py
b82a944ccba03e7e7eec46232e50ffe4ce2c32f4b0e26662e6bde30d533584ae train email/mime/application.py
460be5b50cfcaab8e72a73f24f14ab062cedf1a40a775b8b0d80c13aed44bb5e train email/mime/image.py
77b454bd3ba3b5e3776be28ae3a0fd8de5d1e50d5b8ee10dd539c37c2bd68082 test  email/quoprimime.py
6d43277e5c76fc0f073cd388fcff852d14d068f6bb6d4886c340f8b75a1229a9 train heapq.py
089d0e4c21c88d6034648552e2fa0e440b27d91e11d9c40112d3ec6442690126 test  importlib/metadata/_collections.py
3ec636fb8aeb297e1155e442d681a9d65075a660bd78a37cf3f7fe6c3f6e3a80 train importlib/metadata/_functools.py
72faffdaff0145bc5c225e71e6575fa9d1e3848f188bcb3cca4e741bf9e6ea34 train importlib/metadata/_itertools.py
1c2b0592c66924b7933f734493f9e0ac079755146d4ebb7287d78e001a113f80 train importlib/metadata/_text.py
d0d57d118d64916f7e6edb04f8bd1a760a1abb879125899ef50a36d09ef54df4 train importlib/readers.py
8e687aeeb1db537d2717cb0352c5f126ff7d4095c6de6dc7f00d5103f3009c40 train importlib/simple.py
d5d41e2c29049515d295d81a6d40b4890fbec8d8482cfb401630f8ef2f77e4d5 train json/__init__.py
a5a42976033c7d63ee2740acceef949a3582dcb0e0442845f9717e1be771c68b train multiprocessing/__init__.py
9127a40ea0ff342cb414383b5e7c594a05be2dd835fe246bd3bb0dc036a32a90 train multiprocessing/dummy/__init__.py
d63dd1979fde9c133efe430ee870e6ba6de43c0a0513866ce3ce475791fe57ab train multiprocessing/dummy/connection.py
f6bb79bb99b9ae484935f0d68822e9603a1622dd0b6c4966c79db232a93ba614 train multiprocessing/heap.py
0588ad0e5a36718b4377dc2a2a97864a10986c25a33dc3bfed12595711b0cdab test  multiprocessing/popen_forkserver.py
97b5d25aa479516894489877e6a7921252ee35f51e118c2f1f91f32919e7caa8 test  multiprocessing/popen_spawn_posix.py
4999f8b9ae7b3e8a7f5de302612b4131498dc2e238a2c47f894905c1c63294fe test  multiprocessing/reduction.py
77ef522912474652490b7df523112858e51721e63dcf109b8567a35ce9b31b0d test  multiprocessing/sharedctypes.py
07d224301cba312fa0697bff9cd5a4bb4f778a90629632091b3f4ae874d89af5 train optparse.py
e8ca09333701ba41244e20b8c2c37b7ed0499b88c4b2ca82cac51ef89ca9e647 test  pyclbr.py
f7fd87f8ac9dad7d1387e2401761ec05806c5108201a6d1ede6ab2f481f6df54 train sre_compile.py
87013dc0b349c2c044100f70a8daa9d713e60a527e26f6ab8ee1fc978a6d3234 train sre_constants.py
c4929134532306081918f185c99305c6f55213bc16b32f8c259bc60f7f81e810 train sre_parse.py
24aeae1f0526250f442022022bf98df9a823b1cb330543ee79e70e44907462e9 train string.py
60b6c83581093029312efb6670b11c540090b3f78bcf72264467b494f02f21a5 train stringprep.py
9c231f9497caf513a22dee8f790b07f969b0e45854a0bdd6dd84b492e08c2856 train struct.py
481d0cb3de511eae0b5713dad18542b07eafd9c013bb7690f7497bad49923a71 train this.py
71f67036895f4c5acab942618af0cbd3d814451ba61e967f358d0f341a5b8f51 test  tomllib/__init__.py
f864c6d9552a929c7032ace654ee05ef26ca75d21b027b801d77e65907138b74 train tomllib/_types.py
c2cc84a05b824df79840c98729a0e94ef8909b11c528a1b2c5a00aa436b97b25 train tracemalloc.py
ff6b9a100d32001715b40d61bc4d613623b139edb1fdc3566427b83c331caae3 test  unittest/__main__.py
905672317ab26c656c600defce25d477728068f597f00a7f94e22e8128c323b9 train unittest/_log.py
f8286e818ca56e10e03745bc056cdfd31147678f9a1dc8cb6b0fe96ef9a4362a test  unittest/signals.py
ed2da92bc9f97c53403ee2d3d12cc53b16a96e85d596ebc887b5a93458f3f6bc train unittest/suite.py
fdcc640c3505d16deab9c32eae7c3f5f67c3b5e81c563dc6698fa7fcf403854d train unittest/util.py
7e6c3b6d7a95f0d74f5968f51a87adae8a51bf42390cdfec98c7a99203e7bb76 train urllib/response.py
56f8d313fb74019e53eb9287400702fbce788b7fe30e097b0b6e06296f3f080c train weakref.py
c30e144025a63d267778d92f2f066fa592b476e789d888f79b96c059bf0bef60 test  wsgiref/__init__.py
ba66d30ce511a88eba9b809616c51e12bf89c67972102e7d976b18557f7a6387 train wsgiref/types.py
34296f728e7fe68cccb97a9f6edbf3bf3a686f44044c744fe85f207a92ed4811 test  xml/__init__.py
9bfacbbb64e239a75591a7260b3ed86748eeb4366e6c40f3542753e79bace9a7 train xml/dom/NodeFilter.py
b415a6f3d3663c3ac332ee4a0f4213eadad9281508dc97410e258a03633b063a train xml/dom/__init__.py
826b02a803930834b96b1086cbee7db1d21c684f65dd3073706dc7bb5ba1a3e8 train xml/dom/domreg.py
42974c4c67803dfe80b016ff8aeea0d1e5c751703ab3aec5be765f4e534367be train xml/dom/minicompat.py
614b88673d496a360e6b10efe8d733c7c0826fb214470ff12f24a1e597699870 train xml/dom/pulldom.py
91950edfb196c105d93886f8af7ea3c0a79e06a6b63be3e5a4ea09804e8672a6 train xml/etree/__init__.py
d0f57acab07fe4f9c116c3392d85946bac8e78608f409cea70005f16ea019b57 train xml/etree/cElementTree.py
b88497adc30d5d5eda7789c25a2206ee9270c932d584d7ac42680325651da45c train xml/parsers/__init__.py
64e1947747c2874117a7458bba1f07c86620cc0ed9a4a4116d262878e4a2aa09 train xml/parsers/expat.py
64c7aae49f1dd382a7b9012610307bfa1d43a14a5dc09a5c8da30903f6805c3d train xml/sax/handler.py
3fe2cdb6386e0c4d42d37c657bbecb78b69c57aedb1610dbd8bf4043944130ab train xml/sax/saxutils.py
87ad5c8954dd56fbbca04517bf87477ff4dce575170c7dd1281d7ef1f4214ac8 test  xmlrpc/__init__.py
ac7fb403e4371d07482ef2fda81dbcf6879484e9fc41d4be42c156d7e54c68a8 test  zoneinfo/__init__.py
67deaf0ba41aa4865e007297677207485a89b75629eea0ee5c472be8a3e83bf6 train zoneinfo/_common.py
"""

# The SHA-256 of the pinned corpus as the model sees it (:attr:`TextTask.sha256`), which the
# presets hold in ``text_corpus_sha256``.
STDLIB_CORPUS_SHA256 = "a76a9fbf1a5ff478946f90e71ca84bfcd28e734247e4fe7b053365b8c19d14cf"


def _pinned_files() -> list[tuple[str, str, str]]:
    return [tuple(line.split()) for line in _STDLIB_FILES.strip().splitlines()]


def stdlib_corpus(root: str | pathlib.Path | None = None) -> tuple[str, str, list[str]]:
    """The default text corpus: 78 pinned standard-library ``.py`` files, the same text everywhere.

    The files, their split and the SHA-256 of each are fixed in this module (``_STDLIB_FILES``):
    Python source chosen among the files identical in CPython 3.11.2, 3.11.7, 3.12.1, 3.13.0 and
    3.13.5, about 434,000 characters, 15% of them in the test split. They are read from the
    standard library of the running interpreter (``sysconfig.get_paths()["stdlib"]``) or from
    ``root``, and refused if any differs from its pinned hash: every machine trains and tests on
    the same text, or on none. Each split is its files in path order, one blank line apart (the
    model reads them as ASCII: :class:`TextTask` turns any other character into ``?``).

    Returns:
      ``(train_text, test_text, test_paths)``.

    Raises:
      ValueError: naming the files that are missing or differ, and the fix.

    Example:
      >>> train, test, paths = stdlib_corpus()
      >>> paths[:2], len(test) > 65_536
      (['antigravity.py', 'asyncio/mixins.py'], True)
    """
    here = root is None
    root = pathlib.Path(sysconfig.get_paths()["stdlib"] if here else root)
    texts: dict[str, list[str]] = {"train": [], "test": []}
    test_paths, missing, changed = [], [], []
    for sha256, split, path in _pinned_files():
        try:
            data = (root / path).read_bytes()
        except OSError:
            missing.append(path)
            continue
        if hashlib.sha256(data).hexdigest() != sha256:
            changed.append(path)
            continue
        texts[split].append(data.decode("utf-8", errors="replace"))
        if split == "test":
            test_paths.append(path)
    if missing or changed:
        where = f"{root} (Python {platform.python_version()})" if here else str(root)
        bad = missing + changed
        names = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ValueError(
            f"the pinned text corpus needs {len(_pinned_files())} standard-library files as CPython 3.11 to 3.13.5 "
            f"ship them, but in {where} {len(missing)} are missing and {len(changed)} differ ({names}); run the "
            "text task under such an interpreter, or pass a corpus of your own: --corpus PATH"
        )
    return "\n\n".join(texts["train"]), "\n\n".join(texts["test"]), test_paths


# Corpora on the Hugging Face hub, loaded through the optional `datasets` package (extra "data").
HUB_CORPORA = {
    "wikitext103": {"path": "Salesforce/wikitext", "name": "wikitext-103-raw-v1"},
    "tinyshakespeare": {"path": "karpathy/tiny_shakespeare", "name": None},
}


def text_from_dataset(dataset, field: str = "text") -> tuple[str, str]:
    """``(train_text, test_text)`` from a ``datasets.DatasetDict`` with ``train`` and ``test``
    (or ``validation``) splits, joining the ``field`` of every record with newlines."""
    test_split = "test" if "test" in dataset else "validation"
    if "train" not in dataset or test_split not in dataset:
        raise ValueError(f"the dataset needs a train and a test (or validation) split, got {list(dataset)}")
    return "\n".join(dataset["train"][field]), "\n".join(dataset[test_split][field])


def load_hub_corpus(name: str, **load_kwargs) -> tuple[str, str]:
    """WikiText-103 (raw) or Tiny Shakespeare from the Hugging Face hub, as train/test text.

    Needs ``pip install -e ".[data]"`` and internet; ``load_kwargs`` go to
    ``datasets.load_dataset`` (e.g. ``cache_dir``).
    """
    if name not in HUB_CORPORA:
        raise ValueError(f"unknown hub corpus {name!r}; known: {', '.join(HUB_CORPORA)}")
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--corpus {name} needs the datasets package: pip install -e '.[data]'") from None
    spec = HUB_CORPORA[name]
    try:
        dataset = datasets.load_dataset(spec["path"], spec["name"], **load_kwargs)
    except OSError as error:  # what datasets raises offline: ConnectionError, or a hub file not found
        raise ValueError(
            f"--corpus {name}: could not load {name} ({spec['path']}) from the Hugging Face hub "
            f"({type(error).__name__}: {error}); check the network, or download the text where there is one "
            f"and pass the file or folder instead: --corpus PATH"
        ) from None
    return text_from_dataset(dataset)


def _corpus_file_text(file: pathlib.Path, given: pathlib.Path) -> str:
    """The text of one file of the corpus ``given`` (``--corpus``), read as UTF-8 strictly: a byte
    that is not UTF-8, or a NUL (UTF-16 text, a binary file), is a ValueError naming the file and
    the offset of the first such byte, never characters made up in its place."""
    name = f"--corpus {file}" if file == given else f"--corpus {given}: {file}"
    try:
        data = file.read_bytes()
    except OSError as error:
        raise ValueError(
            f"{name} cannot be read ({error.strerror or error}); check the file and its permissions"
        ) from None
    try:
        text = data.decode("utf-8")
        bad = None
    except UnicodeDecodeError as error:
        bad = error.start
    nul = data.find(b"\0")
    if nul >= 0 and (bad is None or nul < bad):
        bad = nul
    if bad is None:
        return text
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or data.count(b"\0") * 4 >= len(data):
        why, fix = "UTF-16, by its byte-order mark or its NUL bytes", "convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"
    elif data[bad] == 0:
        why, fix = "a NUL byte, which text does not hold: a binary file?", "remove it"
    else:
        why, fix = "another encoding, such as Latin-1, or not text", "convert it to UTF-8 (iconv -f LATIN1 -t UTF-8)"
    raise ValueError(
        f"{name} is not UTF-8 text: byte {bad} is 0x{data[bad]:02x} ({why}); {fix}, or pass another --corpus"
    )


def _read_corpus(path) -> tuple[str, str]:
    if str(path) in HUB_CORPORA:
        return load_hub_corpus(str(path))
    path = pathlib.Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        texts = [_corpus_file_text(p, path) for p in files]
        if not any(texts):
            raise ValueError(
                f"--corpus {path} holds no text (none of its {len(files)} files holds any); pass a folder of text files"
            )
        cut = max(1, int(len(texts) * 0.9)) if len(texts) > 1 else 1
        if len(texts) > 1:
            return "\n\n".join(texts[:cut]), "\n\n".join(texts[cut:])
        text = texts[0]
    elif path.is_file():
        text = _corpus_file_text(path, path)
        if not text:
            raise ValueError(f"--corpus {path} is empty; pass a file that holds text")
    else:
        raise ValueError(f"--corpus {path} is neither a file nor a folder")
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


class TextTask:
    """Character-level language modelling; bytes as tokens, scored in bits per character.

    Trains on windows of exactly the training context at random places of the train split, and
    evaluates each length on fixed windows of the test split (:meth:`window_starts`). The corpus
    is read when first used (so a task can be named, and its kind asked, where the corpus cannot
    be read); :attr:`sha256` identifies it, and a run refuses a corpus whose hash is not its
    preset's ``text_corpus_sha256``.

    Args:
      corpus: None for the pinned standard-library corpus (:func:`stdlib_corpus`); a text file
        (first 90% train, last 10% test) or folder (its files in path order, the last tenth of
        them test), read as UTF-8 strictly (another encoding, a NUL byte or an empty corpus is
        an error naming the file and the byte); or ``wikitext103`` / ``tinyshakespeare``
        (:func:`load_hub_corpus`).
    """

    kind = "decoder"
    metric = "bits_per_char"
    higher_is_better = False
    vocab_size = 128
    scored_on = "target_log_probs"
    length_family = "text"
    fixed_eval_shape = False

    def __init__(self, corpus: str | None = None):
        self.name = "text"
        self.corpus = corpus
        if corpus is None:
            self.corpus_description = "Python source: the 78 standard-library files pinned by SHA-256 (stdlib_corpus)"
        elif corpus in HUB_CORPORA:
            self.corpus_description = f"{corpus} (its train and test splits, from the Hugging Face hub)"
        elif pathlib.Path(corpus).exists():
            self.corpus_description = f"{corpus} (first 90% train, last 10% test)"
        else:
            raise ValueError(f"--corpus {corpus} is neither a file nor a folder")

    @functools.cached_property
    def _splits(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.corpus is None:
            train, test, _ = stdlib_corpus()
        else:
            train, test = _read_corpus(self.corpus)
            self._warn_outside_ascii(train + test)
        train = self._encode(train)
        # The last twentieth of the train split is held out: training checks its progress there.
        cut = len(train) - len(train) // 20
        return train[:cut], train[cut:], self._encode(test)

    @property
    def train(self) -> np.ndarray:
        """The characters training windows are drawn from."""
        return self._splits[0]

    @property
    def validation(self) -> np.ndarray:
        """The last twentieth of the train split, held out for training's checks."""
        return self._splits[1]

    @property
    def test(self) -> np.ndarray:
        """The characters every evaluation length is scored on."""
        return self._splits[2]

    @functools.cached_property
    def sha256(self) -> str:
        """The SHA-256 of the corpus as the model sees it: each split's name, length and characters.

        The presets pin the standard-library corpus's (:data:`STDLIB_CORPUS_SHA256`).
        """
        sha = hashlib.sha256()
        for name, data in (("train", self.train), ("validation", self.validation), ("test", self.test)):
            sha.update(f"{name} {len(data)}\n".encode())
            sha.update(data.astype(np.uint8).tobytes())
        return sha.hexdigest()

    @property
    def digest(self) -> str:
        """The first 12 hexadecimal digits of :attr:`sha256` (results of different texts never mix)."""
        return self.sha256[:12]

    def _warn_outside_ascii(self, text: str) -> None:
        """Says how many characters the model will read as ``?``: its vocabulary is the 128 ASCII
        characters, so any other character is one token, ``?``, wherever it occurs."""
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        outside = int((codes > 127).sum())
        if outside:
            examples = "".join(sorted({chr(c) for c in codes[codes > 127][:1000]})[:10])
            warnings.warn(
                f"--corpus {self.corpus}: {outside:,} of its {len(codes):,} characters ({outside / len(codes):.2%}) "
                f"are not ASCII (for example {examples!r}) and are read as '?', the model's vocabulary being the "
                "128 ASCII characters; transliterate the text first if those characters matter",
                stacklevel=3,
            )

    @staticmethod
    def _encode(text: str) -> np.ndarray:
        data = np.frombuffer(text.encode("ascii", errors="replace"), np.uint8).astype(np.int32)
        return np.minimum(data, 127)

    def max_tokens(self, n: int) -> int:
        return n

    def train_lengths(
        self, rng: np.random.Generator, train_length: int, batch_size: int, minimum: int = 1
    ) -> np.ndarray:
        """Every window is the training context (``minimum`` does not apply)."""
        return np.full(batch_size, train_length)

    def chance(self, n: int) -> float | None:
        """None: uniform guessing (7 bits per character) is no useful line on a text plot."""
        return None

    def check_lengths(self, train_length: int, eval_lengths) -> None:
        """The train split must hold a window of the training context and the test split one of
        the longest evaluation length (each plus the next character to predict)."""
        splits = (
            ("train", self.train, train_length),
            ("validation", self.validation, train_length),
            ("test", self.test, max(eval_lengths)),
        )
        for split, data, length in splits:
            if len(data) < length + 2:
                raise ValueError(
                    f"the {split} split of the text corpus ({self.corpus_description}) has {len(data)} characters, "
                    f"too few for windows of {length}; pass a larger --corpus, or shorter lengths "
                    f"(--text-context, --text-lengths)"
                )

    def window_starts(self, length: int, characters: int) -> np.ndarray:
        """Where the test windows of ``length`` begin: ``0, length, 2 * length, ...``, below ``characters``.

        The windows are a function of the test split and the length alone: the i-th window of
        ``length`` is always ``test[i * length : (i + 1) * length + 1]`` (its inputs, and the next
        character as the last target), whatever the encoding, seed, run or preset. ``characters`` (a
        preset's ``text_eval_characters``, a multiple of ``length``) says how many are scored, so a
        preset that scores fewer characters scores the first of the same windows. Non-overlapping
        windows from the start of the test split (Press et al. 2022's evaluation) score the same
        characters at every length.

        Example:
          >>> TextTask().window_starts(4096, 16_384).tolist()
          [0, 4096, 8192, 12288]
        """
        if length < 1 or characters % length or len(self.test) < characters + 1:
            raise ValueError(
                f"cannot score {characters} test characters in windows of {length}: need a multiple of the length "
                f"and a test split longer than that ({len(self.test)} characters)"
            )
        return np.arange(0, characters, length)

    def evaluation_windows(self, length: int, characters: int, batch: int):
        """The test batches of one evaluation length: the windows of :meth:`window_starts`,
        ``batch`` at a time."""
        starts = self.window_starts(length, characters)
        for first in range(0, len(starts), batch):
            yield self.windows_at("test", starts[first : first + batch], length)

    def batch(self, rng: np.random.Generator, lengths, *, split: str = "train", pad_to: int | None = None) -> dict:
        """Windows at random places of ``split`` (``"train"``, ``"validation"`` or ``"test"``)."""
        data = {"train": self.train, "validation": self.validation, "test": self.test}[split]
        length = int(max(lengths))
        if len(data) < length + 2:
            raise ValueError(f"the {split} text has {len(data)} characters, too few for windows of {length}")
        return self.windows_at(split, rng.integers(0, len(data) - length - 1, len(lengths)), length)

    def windows_at(self, split: str, starts, length: int) -> dict:
        """The windows of ``length`` characters (and the character after each) starting at ``starts`` of ``split``."""
        data = {"train": self.train, "validation": self.validation, "test": self.test}[split]
        windows = np.stack([data[s : s + length + 1] for s in starts])
        return {
            "inputs": windows[:, :-1],
            "targets": windows[:, 1:],
            "weights": np.ones((len(starts), length), np.float32),
            "positions": np.arange(length, dtype=np.int32),
        }

    def score(self, log_probs_of_targets: np.ndarray, batch: dict) -> np.ndarray:
        """Bits per character per window, from the targets' log-probabilities (nats)."""
        w = batch["weights"]
        return -(log_probs_of_targets * w).sum(-1) / np.maximum(w.sum(-1), 1) / np.log(2.0)


TASKS = {
    **{
        name: functools.partial(lambda name, format="ours", **kw: DecoderTask(name, format), name)
        for name in ("counting_copy", "counting_replace", "copy", "duplicate", "reverse")
    },
    **{
        name: functools.partial(lambda name, format="ours", **kw: EncoderTask(name, format), name)
        for name in ("reverse_string", "missing_duplicate", "parity", "bucket_sort")
    },
    "probe": lambda max_length=256, **kw: ProbeTask("probe", boundary=False, max_length=max_length),
    "probe_boundary": lambda max_length=256, **kw: ProbeTask("probe_boundary", boundary=True, max_length=max_length),
    "text": lambda corpus=None, **kw: TextTask(corpus),
    "flip_flop": lambda ignore_probability=0.8, **kw: FlipFlopTask("flip_flop", ignore_probability),
    "cope_count": lambda num_variables=3, **kw: CountingTask("cope_count", num_variables),
}


def task_names() -> list[str]:
    return list(TASKS)


# The tasks with a paper format (``make_task(name, format="paper")``).
FORMATTED_TASKS = ("counting_copy", "counting_replace", "copy", "duplicate", "reverse", *PAPER_ENCODER_SYMBOLS)

# How each format stands to the paper's, task by task (reports print it beside the published column).
_OURS_DIFFERS = {
    "counting_copy": "no instruction word ('Copy:'), 10 symbols (theirs: a token per example from thousands)",
    "counting_replace": "no instruction words ('Replace s with t in'), 10 symbols (theirs: about 80)",
    "copy": "no instruction word ('Copy:'), 10 symbols (theirs: 100)",
    "duplicate": "no instruction word ('Copy:') and no [NEXT] between the copies, 10 symbols (theirs: 100)",
    "reverse": "no instruction word ('Reverse:'), 10 symbols (theirs: 100)",
    "reverse_string": "10 symbols (theirs: binary)",
    "missing_duplicate": "an odd length rounded up to even (theirs: kept, with an empty token)",
    "parity": "",
    "bucket_sort": "10 symbols (theirs: 5)",
}
_PAPER_SAME = {
    "counting_copy": "'Copy: s^n [SEP] s^n'; 100 symbols, each example's drawn uniformly (theirs: a different "
    "token for each example of a length, from thousands of T5 tokens)",
    "counting_replace": "'Replace s with t in s^n [SEP] t^n'; 100 symbols (theirs: about 80)",
    "copy": "'Copy: x [SEP] x'; 100 symbols",
    "duplicate": "'Copy: x [SEP] x [NEXT] x'; 100 symbols",
    "reverse": "'Reverse: x [SEP] reversed x'; 100 symbols",
    "reverse_string": "binary strings",
    "missing_duplicate": "binary w w, one token hidden, an odd length kept with an empty token last",
    "parity": "binary strings",
    "bucket_sort": "5 symbols",
}


def format_note(name: str, format: str) -> str:
    """One sentence on how ``name`` in ``format`` stands to its paper's task (empty for a task
    without one).

    Example:
      >>> format_note("bucket_sort", "ours")
      "Format: ours, not Ruoss et al.'s: 10 symbols (theirs: 5)."
    """
    if name not in FORMATTED_TASKS:
        return ""
    paper = "Ruoss et al.'s" if name in PAPER_ENCODER_SYMBOLS else "Kazemnejad et al.'s"
    if format == "paper":
        words = " (one token per word; their T5 tokenizer splits some words)" if paper.startswith("K") else ""
        return f"Format: {paper}, {_PAPER_SAME[name]}{words}."
    if not _OURS_DIFFERS[name]:
        return f"Format: ours, the same as {paper}."
    return f"Format: ours, not {paper}: {_OURS_DIFFERS[name]}."


def make_task(name: str, *, format: str = "ours", **kwargs):
    """The task called ``name`` (see :data:`TASKS`), in ``format`` (:data:`TASK_FORMATS`: the
    benchmark's own, or the paper's, for the tasks of :data:`FORMATTED_TASKS`)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    _check_format(name, format)
    if format != "ours" and name not in FORMATTED_TASKS:
        raise ValueError(
            f"task {name!r} has no {format!r} format (only {', '.join(FORMATTED_TASKS)} do); run it with "
            "task_format='ours'"
        )
    if format != "ours":
        kwargs["format"] = format
    return TASKS[name](**kwargs)
