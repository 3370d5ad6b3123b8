"""Length-generalisation tasks, generated on the fly from a seed (no download).

Every task makes batches ``{"inputs", "targets", "weights", "positions"}`` of token ids
for a Transformer (encoder tasks add ``key_mask``; causal tasks pad after the
answer, where no query looks), and says how to score a prediction:

* **decoder tasks** (after Kazemnejad et al. 2023, arXiv:2305.19466; :mod:`~posenc_jax.bench.tasks.decoder`):
  the sequence is ``x SEP y EOS``; the causal model is trained on ``y EOS`` and scored by
  exact match. ``counting_copy``, ``counting_replace``, ``copy``, ``duplicate``, ``reverse``.
* **encoder tasks** (after Ruoss et al. 2023, arXiv:2305.16843; :mod:`~posenc_jax.bench.tasks.encoder`):
  ``x`` followed by blank tokens; a bidirectional model writes the answer on the blanks and is
  scored by per-token accuracy. ``reverse_string``, ``missing_duplicate``, ``parity``, ``bucket_sort``.
* **probe** (the blind spot of relative encodings, Su 2022; Luo et al. 2022): n identical
  tokens, the answer at each position is its index; optionally wrapped in boundary tokens
  ``[CLS] ... [SEP]`` (``probe_boundary``).
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
draw training lengths, make a batch, score a model's outputs, what chance and its other
baselines are, and whether a length can be served at all (a corpus too short for the windows
asked of it is refused before any training).

**A task is one module.** Each module of this package defines its tasks and registers them
(:func:`~posenc_jax.bench.tasks.base.register_task`: the factory, the report's title, the formats
and how each stands to the paper's); this package imports every module in it, so a new module
is a new task for :func:`make_task`, the presets, the runner and the report.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from posenc_jax.bench.tasks.base import (
    ALGO_VOCAB,
    BLANK,
    EMPTY,
    EOS,
    MARKER,
    NUM_SYMBOLS,
    PAD,
    SEP,
    TASK_FORMATS,
    TASKS,
    Task,
    TaskEntry,
    check_format,
    formatted_tasks,
    register_task,
)

# Every module of the package registers its tasks when imported: these first, in the order the
# benchmark has always listed its tasks, then any other in the order of their names.
_FIRST = ("decoder", "encoder", "probe", "text", "flip_flop", "cope_count")
for _module in sorted(
    pkgutil.iter_modules(__path__),
    key=lambda m: (_FIRST.index(m.name) if m.name in _FIRST else len(_FIRST), m.name),
):
    importlib.import_module(f"{__name__}.{_module.name}")

from posenc_jax.bench.tasks.cope_count import (  # noqa: E402
    COUNT_EQUALS,
    COUNT_FIRST_VARIABLE,
    COUNT_INCREMENT,
    COUNT_MAX_VALUE,
    COUNT_PASS,
    COUNT_PRINT,
    COUNT_SEMICOLON,
    COUNT_WEIGHTS,
    COUNT_WORDS,
    CountingTask,
)
from posenc_jax.bench.tasks.corpus import (  # noqa: E402
    HUB_CORPORA,
    STDLIB_CORPUS_SHA256,
    load_hub_corpus,
    stdlib_corpus,
    text_from_dataset,
)
from posenc_jax.bench.tasks.decoder import PAPER_DECODER_SYMBOLS, DecoderTask  # noqa: E402
from posenc_jax.bench.tasks.encoder import PAPER_ENCODER_SYMBOLS, EncoderTask  # noqa: E402
from posenc_jax.bench.tasks.flip_flop import (  # noqa: E402
    FF_IGNORE,
    FF_ONE,
    FF_PAD,
    FF_READ,
    FF_WRITE,
    FF_ZERO,
    FlipFlopTask,
)
from posenc_jax.bench.tasks.probe import ProbeTask  # noqa: E402
from posenc_jax.bench.tasks.text import TextTask  # noqa: E402

__all__ = [
    "ALGO_VOCAB",
    "COUNT_EQUALS",
    "COUNT_FIRST_VARIABLE",
    "COUNT_INCREMENT",
    "COUNT_MAX_VALUE",
    "COUNT_PASS",
    "COUNT_PRINT",
    "COUNT_SEMICOLON",
    "COUNT_WEIGHTS",
    "COUNT_WORDS",
    "FF_IGNORE",
    "FF_ONE",
    "FF_PAD",
    "FF_READ",
    "FF_WRITE",
    "FF_ZERO",
    "BLANK",
    "EMPTY",
    "EOS",
    "FORMATTED_TASKS",
    "HUB_CORPORA",
    "MARKER",
    "NUM_SYMBOLS",
    "PAD",
    "PAPER_DECODER_SYMBOLS",
    "PAPER_ENCODER_SYMBOLS",
    "SEP",
    "STDLIB_CORPUS_SHA256",
    "TASKS",
    "TASK_FORMATS",
    "CountingTask",
    "DecoderTask",
    "EncoderTask",
    "FlipFlopTask",
    "ProbeTask",
    "Task",
    "TaskEntry",
    "TextTask",
    "format_note",
    "load_hub_corpus",
    "make_task",
    "register_task",
    "stdlib_corpus",
    "task",
    "task_names",
    "text_from_dataset",
    "title",
]

# The tasks with a paper format (``make_task(name, format="paper")``).
FORMATTED_TASKS = formatted_tasks()


def task_names() -> list[str]:
    """Every registered task's name."""
    return list(TASKS)


def _entry(name: str) -> TaskEntry:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]


def make_task(name: str, *, format: str = "ours", **kwargs):
    """The task called ``name`` (see :data:`TASKS`), in ``format`` (:data:`TASK_FORMATS`: the
    benchmark's own, or the paper's, for the tasks of :data:`FORMATTED_TASKS`). ``kwargs`` are the
    task's own settings (``max_length`` of the probe, ``corpus`` of text, ...); a task ignores
    those it does not take."""
    entry = _entry(name)
    if len(entry.formats) == 1:  # a task with formats checks its own where it is built
        check_format(name, format, entry.formats)
    return entry.make(format=format, **kwargs)


@functools.cache
def task(name: str, format: str = "ours", **kwargs):
    """:func:`make_task`, made once per arguments and shared (tasks hold no state a caller changes):
    what the cost model and the report read a task's vocabulary and length family from."""
    return make_task(name, format=format, **kwargs)


def title(name: str) -> str:
    """The report's heading of task ``name`` (the name itself for a task not registered)."""
    return TASKS[name].title if name in TASKS else name


def format_note(name: str, format: str) -> str:
    """One sentence on how ``name`` in ``format`` stands to its paper's task (empty for a task
    without one).

    Example:
      >>> format_note("bucket_sort", "ours")
      "Format: ours, not Ruoss et al.'s: 10 symbols (theirs: 5)."
    """
    return TASKS[name].notes.get(format, "") if name in TASKS else ""
