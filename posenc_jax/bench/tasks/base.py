"""What every task implements, what the generated tasks share, and the registry of tasks.

A task module defines its task class and registers each of its names with
:func:`register_task` (its factory, its title, the formats it has and how each stands to the
paper's), which is all :func:`~posenc_jax.bench.tasks.make_task`, the runner and the report
read: adding a task is adding one module to this package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar, Protocol

import numpy as np

__all__ = [
    "ALGO_VOCAB",
    "BLANK",
    "EMPTY",
    "EOS",
    "MARKER",
    "NUM_SYMBOLS",
    "PAD",
    "SEP",
    "TASKS",
    "TASK_FORMATS",
    "Task",
    "TaskEntry",
    "check_format",
    "format_notes",
    "register_task",
]

NUM_SYMBOLS = 10
SEP, BLANK, PAD, EOS = NUM_SYMBOLS, NUM_SYMBOLS + 1, NUM_SYMBOLS + 2, NUM_SYMBOLS + 3
ALGO_VOCAB = NUM_SYMBOLS + 4
MARKER = 2  # missing duplicate's hidden token, outside its binary alphabet
EMPTY = 3  # missing duplicate's empty token after an odd length (paper format)

# The tasks' formats. "ours" is the benchmark's compact form (10 symbols, no instruction words,
# no separator inside an answer); "paper" follows the authors' code: Kazemnejad et al.'s dataset
# builders and instance processors (McGill-NLP/length-generalization, scripts/dataset_builders/
# make_copy_dataset.py and make_reverse_dataset.py, src/data/data_instance_processor/
# copy_instance_processor.py) for the decoder tasks, Ruoss et al.'s task classes
# (google-deepmind/randomized_positional_encodings, tasks/) for the encoder tasks.
TASK_FORMATS = ("ours", "paper")


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

    def baselines(self, n: int):
        """What the task's scores are read against at ``n`` (:mod:`posenc_jax.bench.baselines`): for
        a generated task, ``{"chance", "position-only", "content-only"}`` at input length ``n``
        (None where no exact value is known); for text, n-gram models scored on ``n`` characters."""

    def check_lengths(self, train_length: int, eval_lengths) -> None:
        """Raises ValueError, naming the length and the fix, if the task cannot serve these lengths."""


class Generated:
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

    def baseline_scores(self, n: int, position, content) -> dict[str, float | None]:
        """The baselines dict of :meth:`Task.baselines` from the two exact scores (None: unknown)."""
        return {
            "chance": self.chance(n),
            "position-only": float(position),
            "content-only": None if content is None else float(content),
        }


def pad_rows(rows, length, value):
    """``rows`` of token ids as one ``[len(rows), length]`` array, each padded with ``value``."""
    longest = max(len(row) for row in rows)
    if longest > length:
        raise ValueError(f"an example needs {longest} tokens but pad_to allows {length}")
    out = np.full((len(rows), length), value, np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def check_format(name: str, format: str, formats: tuple[str, ...]) -> None:
    """Raises ValueError unless ``format`` is one of the formats task ``name`` has: the one check
    of a task's format, made where the task is built."""
    if format in formats:
        return
    if format in TASK_FORMATS:
        raise ValueError(
            f"task {name!r} has no {format!r} format (only {', '.join(formatted_tasks())} do); run it with "
            "task_format='ours'"
        )
    raise ValueError(f"{name}: unknown task format {format!r}; use one of {', '.join(formats)}")


@dataclasses.dataclass(frozen=True)
class TaskEntry:
    """A registered task: how to make it and how the report names it.

    Attributes:
      make: ``make(format=..., **settings)`` returns the task (settings it does not take are ignored).
      title: the report's heading for the task.
      short: its column in the overview table (default: the name).
      unit: what one unit of its length counts (default: symbols of x, or characters for text).
      formats: the formats it has (:data:`TASK_FORMATS`); the first is its default.
      notes: per format, how it stands to the paper's task (:func:`format_notes`), or none.
    """

    make: Callable[..., Task]
    title: str
    short: str = ""
    unit: str = ""
    formats: tuple[str, ...] = ("ours",)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)


# Every registered task, by name, in the order the task modules register them.
TASKS: dict[str, TaskEntry] = {}


def register_task(name: str, make: Callable[..., Task], title: str, **entry) -> None:
    """Registers the task ``name``: ``make(format=..., **settings)`` builds it (see :class:`TaskEntry`
    for ``entry``). A name registered twice is an error."""
    if name in TASKS:
        raise ValueError(f"task {name!r} is registered twice; give the new task another name")
    TASKS[name] = TaskEntry(make, title, **entry)


def formatted_tasks() -> tuple[str, ...]:
    """The tasks that have a format besides the benchmark's own."""
    return tuple(name for name, entry in TASKS.items() if len(entry.formats) > 1)


def format_notes(paper: str, *, ours: str, same: str, words: bool = False) -> dict[str, str]:
    """A formatted task's notes: how ``ours`` differs from ``paper``'s task (empty: it does not),
    and what the paper format is (``same``); ``words``: the paper format has instruction words."""
    tail = " (one token per word; their T5 tokenizer splits some words)" if words else ""
    return {
        "ours": f"Format: ours, not {paper}: {ours}." if ours else f"Format: ours, the same as {paper}.",
        "paper": f"Format: {paper}, {same}{tail}.",
    }
