"""The benchmark's results as a researcher reads them: every seed counted, gated on learning,
with intervals over seeds and comparisons corrected for multiplicity.

A results folder holds ``results.jsonl`` (one row per task, encoding, seed and length),
``run.json`` (the preset and provenance) and ``baselines.json``. From them:

* a cell's (task × encoding) scores are statistics over **all** its seeds: the mean with a 95%
  interval (inside [0, 1] for a bounded score; :mod:`posenc_jax.bench.stats`), and the best
  seed beside it (the statistic Ruoss et al. are said to report). No seed is ever dropped;
* a cell is **learned** when its all-seed mean at the longest training length passes the gate:
  at least ``learned_threshold`` (text: below the best n-gram model by ``text_margin`` bits per
  character on the same characters). Only then are its scores beyond the training length
  reported; an unlearned cell reads "not learned", never a score. Each seed's own pass or fail
  is counted too ("k/n seeds learned") but decides nothing;
* the learned cells of one task are compared seed by seed (paired differences beyond the
  training length, over all their common seeds), as one family: the paired t-tests' p-values
  are corrected by Holm's method at 0.05, and an ordering is resolved only when its corrected
  p-value is at most that. A tie is claimed only by an equivalence test (TOST) against the
  task's margin (``equivalence_margin``; text ``text_equivalence_margin``);
* every row records its training protocol: ``fixed-budget`` (every encoding the same steps;
  the steps to criterion a measurement) or ``to-criterion`` (the method of runs made before
  the fixed budget, in which each encoding trained its own number of steps). A folder's
  report names its protocol, and comparisons of ``to-criterion`` runs say that their budgets
  differ.

:func:`load_results` gives one row per cell and length; :func:`cells` one summary per cell;
:func:`comparison` a task's corrected family; :func:`table_family` a table's (several tasks
corrected together); :func:`summarize` the overview table.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import pathlib

import numpy as np

from posenc_jax.bench.ledger import read_json, read_rows
from posenc_jax.bench.stats import Comparison, Interval, Ordering, compare, holm, interval

__all__ = [
    "BOUNDED",
    "CellSummary",
    "Results",
    "cells",
    "comparison",
    "load_results",
    "orderings",
    "protocol",
    "read",
    "summarize",
    "table_family",
]

BOUNDED = ("exact_match", "accuracy")  # metrics in [0, 1]; bits per character is not bounded above


@dataclasses.dataclass(frozen=True)
class Results:
    """The contents of one results folder: its rows, the preset it ran (a dict, as in
    ``run.json``), its baselines and its run record."""

    rows: list[dict]
    preset: dict
    baselines: dict
    record: dict

    def setting(self, task: str, name: str, default=None):
        """A preset setting as ``task`` trained with it (its ``task_overrides`` first)."""
        overrides = dict(dict(self.preset.get("task_overrides") or ()).get(task, ()))
        return overrides.get(name, self.preset.get(name, default))

    def threshold(self, task: str) -> tuple[float, bool]:
        """``(threshold, higher_is_better)`` of the gate of ``task``: a score of at least
        ``learned_threshold``, or for text bits per character below the best n-gram model's by
        ``text_margin`` (``-inf``, which nothing passes, where a text run has no n-gram baseline)."""
        ngram = self.baselines.get(task, {}).get("ngram")
        if ngram:
            margin = float(self.setting(task, "text_margin", 0.2))
            return min(b["bits_per_char"] for b in ngram) - margin, False
        if any(row["task"] == task and row["metric"] not in BOUNDED for row in self.rows):
            # Bits per character with no n-gram model to beat (a run from before the baselines): no
            # gate can be read, so no cell counts as learned.
            return -math.inf, False
        return float(self.setting(task, "learned_threshold", 0.95)), True

    def margin(self, task: str) -> tuple[float, bool]:
        """``(margin, declared)``: the equivalence margin of ``task`` (within which two encodings
        are called tied) and whether the run's preset declared it before the run; a run made
        before margins were declared gets the defaults (0.02 accuracy, 0.05 bits per
        character), declared after it."""
        text = bool(self.baselines.get(task, {}).get("ngram"))
        name, default = ("text_equivalence_margin", 0.05) if text else ("equivalence_margin", 0.02)
        return float(self.setting(task, name, default)), name in self.preset

    @property
    def protocol(self) -> str:
        """The run's training protocol (:func:`protocol`)."""
        return protocol(self.preset)

    @functools.cached_property
    def summaries(self) -> tuple:
        """Every cell's :class:`CellSummary` (:func:`cells`), computed once: a report, its
        comparisons and its plots all read them."""
        return tuple(_summarize(self))


def protocol(preset: dict) -> str:
    """``"fixed-budget"`` or ``"to-criterion"``: the training protocol of a run's preset (as in
    ``run.json``); a preset from before the protocol was recorded trained to criterion."""
    return str(preset.get("protocol", "to-criterion"))


def read(path) -> Results:
    """Reads a results folder (or its ``results.jsonl``), checking that its rows are one run's.

    Every line of ``results.jsonl`` must be a row (:func:`~posenc_jax.bench.ledger.read_rows`:
    JSON objects with the fields a row has, no cell's row twice), ``run.json`` a JSON object
    with the run's ``preset``, and every row must carry the fingerprint ``run.json`` records
    (``settings``) and be of a task and encoding the run asked for (``run.json``'s ``asked``, by
    every sitting; a record from before ``asked`` was kept: its preset's tasks, encodings and
    normalisers). A folder put together by hand, whose ``run.json`` records no fingerprint, may
    hold rows without one (and any task or encoding). Anything else is a ValueError naming the
    file, the line and what to do: the report never mixes runs.
    """
    path = pathlib.Path(path)
    folder = path.parent if path.suffix == ".jsonl" else path
    results = folder / "results.jsonl"
    if not results.exists():
        raise ValueError(f"no results.jsonl in {folder}; run `posenc-bench extrapolate --out {folder}` first")
    numbered = read_rows(results)
    fix = f"run the command that made {folder} again to rewrite it, or restore it"
    record = read_json(folder / "run.json", "run record (preset and provenance)", fix=fix)
    if not isinstance(record.get("preset"), dict):
        raise ValueError(f"{folder / 'run.json'} has no preset (a JSON object), so it is no run record; {fix}")
    baselines = read_json(
        folder / "baselines.json", "baselines", required=False, fix="delete it; the next run writes it again"
    )
    _check_one_run(numbered, record, results)
    return Results([row for _, row in numbered], record["preset"], baselines, record)


def _asked(record: dict):
    """``asks(task, label)``: whether the run of ``record`` asked for rows of ``label`` on ``task``."""
    asked = record.get("asked")
    if isinstance(asked, dict):
        return lambda task, label: label in asked.get(task, ())
    preset = record["preset"]
    tasks, encodings = set(preset.get("tasks") or ()), set(preset.get("encodings") or ())
    normalizers = set(preset.get("normalizers") or ("softmax",))

    def asks(task, label):
        encoding, _, normalizer = label.partition("|")
        trained, variant, _ = encoding.partition("@")
        base = trained if trained in encodings or not variant else trained.split("+")[0]
        return task in tasks and base in encodings and (normalizer or "softmax") in normalizers

    return asks


def _check_one_run(numbered: list, record: dict, path: pathlib.Path) -> None:
    """Every row's fingerprint is the run's, and its task and encoding ones the run asked for."""
    settings = record.get("settings")
    asks = _asked(record) if settings is not None else (lambda task, label: True)
    run_json = path.parent / "run.json"
    for number, row in numbered:
        if row.get("settings") != settings:
            raise ValueError(
                f"{path} line {number} was made with settings {row.get('settings')!r}, but {run_json} records "
                f"{settings!r}: rows of another run are mixed in; move such lines out, or run into a new --out"
            )
        if not asks(row["task"], row["encoding"]):
            raise ValueError(
                f"{path} line {number} is a row of {row['encoding']} on {row['task']}, which the run of "
                f"{run_json} did not ask for: rows of another run are mixed in; delete such lines, or run into "
                "a new --out"
            )


@dataclasses.dataclass(frozen=True)
class CellSummary:
    """One task × encoding over all its seeds.

    Attributes:
      in_distribution: each seed's score at the longest training length.
      beyond: each seed's mean score over the lengths beyond training.
      learned_seeds: the seeds whose own score at the training length passed the gate ("k/n
        seeds learned"; recorded, never used to drop a seed).
      learned: whether the all-seed mean at the training length passed the gate.
      at_training: the interval over all seeds at the training length (shown for an unlearned
        cell too, as the evidence that it did not learn).
      extrapolation: the interval over all seeds beyond training (None if the cell is not learned).
      best: the best seed's score beyond training (max, or min for bits per character; None if
        the cell is not learned).
      steps: each seed's training steps.
      criterion_steps: each seed's steps to criterion (two checks in a row at the gate's
        margin; None where it never got there, or the run did not record it).
      protocol: ``"fixed-budget"`` or ``"to-criterion"`` (:func:`protocol`).
    """

    task: str
    encoding: str
    metric: str
    higher_is_better: bool
    train_length: int
    in_distribution: dict[int, float]
    beyond: dict[int, float]
    learned_seeds: tuple[int, ...]
    learned: bool
    at_training: Interval | None
    extrapolation: Interval | None
    steps: dict[int, int | None]
    best: float | None = None
    criterion_steps: dict[int, int | None] = dataclasses.field(default_factory=dict)
    protocol: str = "to-criterion"

    @property
    def seeds(self) -> int:
        return len(self.in_distribution)

    @property
    def bounded(self) -> bool:
        return self.metric in BOUNDED

    def text(self, which: str = "extrapolation") -> str:
        """The cell as a table shows it: ``mean [low, high]`` over all seeds (``mean, all n seeds``
        when they agree) or ``not learned (k/n)`` with the seeds that passed on their own; at the
        training length an unlearned cell shows its all-seed mean there (the evidence that it
        did not learn), never a score beyond it."""
        if not self.learned:
            if which == "at_training" and self.in_distribution:
                return f"{np.mean(list(self.in_distribution.values())):.3f}, not learned"
            return f"not learned ({len(self.learned_seeds)}/{self.seeds})"
        found = getattr(self, which)
        return "·" if found is None else str(found)


def _by_cell(rows):
    grouped = collections.defaultdict(lambda: collections.defaultdict(dict))
    for row in rows:
        grouped[(row["task"], row["encoding"])][row["seed"]][row["length"]] = row
    return grouped


def cells(results: Results) -> list[CellSummary]:
    """One :class:`CellSummary` per task × encoding, in the order the rows first name them."""
    return list(results.summaries)


def _summarize(results: Results) -> list[CellSummary]:
    out = []
    for (task, encoding), per_seed in _by_cell(results.rows).items():
        sample = next(iter(next(iter(per_seed.values())).values()))
        train = sample["train_length"]
        bounded = sample["metric"] in BOUNDED
        threshold, higher = results.threshold(task)

        def passes(value, threshold=threshold, higher=higher):
            return value >= threshold if higher else value < threshold

        inside, beyond, steps, criterion, learned = {}, {}, {}, {}, []
        # Beyond training, every seed is averaged over the same lengths: those all of the cell's
        # seeds have (a run read mid-evaluation, or resumed, may have more for some seeds).
        outside = set.intersection(*({n for n in by_length if n > train} for by_length in per_seed.values()))
        for seed, by_length in sorted(per_seed.items()):
            if train not in by_length:
                continue  # not yet evaluated at the training length: nothing can be said of it
            inside[seed] = by_length[train]["value"]
            steps[seed] = by_length[train].get("steps")
            criterion[seed] = by_length[train].get("criterion_step")
            values = [by_length[n]["value"] for n in outside]
            if values and all(math.isfinite(v) for v in values):
                beyond[seed] = float(np.mean(values))
            if passes(inside[seed]):
                learned.append(seed)
        at_training = interval(list(inside.values()), bounded=bounded) if inside else None
        cell_learned = at_training is not None and passes(at_training.mean)
        # Beyond training, all seeds or none: a seed with a non-finite score there leaves the
        # cell without a score (its rows say which), never with the others' mean.
        complete = cell_learned and bool(beyond) and set(beyond) == set(inside)
        out.append(
            CellSummary(
                task=task,
                encoding=encoding,
                metric=sample["metric"],
                higher_is_better=higher,
                train_length=train,
                in_distribution=inside,
                beyond=beyond,
                learned_seeds=tuple(learned),
                learned=cell_learned,
                at_training=at_training,
                extrapolation=interval(list(beyond.values()), bounded=bounded) if complete else None,
                steps=steps,
                best=((max if higher else min)(beyond.values()) if complete else None),
                criterion_steps=criterion,
                protocol=protocol(results.preset),
            )
        )
    return out


def comparison(results: Results, task: str, encodings=None) -> Comparison:
    """The learned cells of ``task`` (or of those of ``encodings``) compared pair by pair beyond the
    training length over all their common seeds, as one family: Holm-corrected paired t-tests,
    and every pair's equivalence test against the task's margin (:meth:`Results.margin`)."""
    learned = [
        c
        for c in cells(results)
        if c.task == task and c.extrapolation is not None and (encodings is None or c.encoding in encodings)
    ]
    margin, _ = results.margin(task)
    if not learned:
        return Comparison([], {}, margin)
    per_seed = {c.encoding: dict(c.beyond) for c in learned}
    return compare(per_seed, higher_is_better=learned[0].higher_is_better, margin=margin)


def table_family(results: Results, tasks, encodings=None) -> dict[str, list[Ordering]]:
    """The orderings of several tasks' learned cells corrected as one family (Holm over every pair
    of every task): what a table spanning those tasks may claim. Returns task → its orderings,
    each with the p-value corrected over the whole table."""
    found = {task: comparison(results, task, encodings).orderings for task in tasks}
    flat = [(task, i) for task in tasks for i, o in enumerate(found[task]) if o.difference.n > 1]
    adjusted = holm([found[task][i].difference.p_value for task, i in flat]) if flat else []
    out = {task: [dataclasses.replace(o, corrected_p=1.0) for o in found[task]] for task in tasks}
    for (task, i), p in zip(flat, adjusted, strict=True):
        out[task][i] = dataclasses.replace(out[task][i], corrected_p=p)
    return out


def orderings(results: Results, task: str) -> list[Ordering]:
    """The paired comparisons of the learned cells of ``task`` beyond the training length, over all
    their common seeds, each with its p-value corrected over the task's family (Holm)."""
    return comparison(results, task).orderings


def load_results(path):
    """One row per task, encoding and length: the mean over all the cell's seeds with its 95%
    interval (``low``, ``high``), the number of seeds, how many passed the gate on their own,
    and whether the cell learned (its scores are NaN when it did not: a score is reported only
    from a learned cell). A pandas DataFrame when pandas is installed, else a list of dicts.

    Args:
      path: a results folder (or its ``results.jsonl``).
    """
    results = read(path)
    summaries = {(c.task, c.encoding): c for c in cells(results)}
    out = []
    for (task, encoding), per_seed in _by_cell(results.rows).items():
        summary = summaries[(task, encoding)]
        lengths = sorted({n for by_length in per_seed.values() for n in by_length})
        for n in lengths:
            values = [by_length[n]["value"] for by_length in per_seed.values() if n in by_length]
            finite = all(math.isfinite(v) for v in values)
            found = interval(values, bounded=summary.bounded) if summary.learned and values and finite else None
            out.append(
                {
                    "task": task,
                    "encoding": encoding,
                    "length": n,
                    "in_distribution": n <= summary.train_length,
                    "metric": summary.metric,
                    "mean": found.mean if found else math.nan,
                    "low": found.low if found else math.nan,
                    "high": found.high if found else math.nan,
                    "seeds": len(values),
                    "learned_seeds": len(summary.learned_seeds),
                    "learned": summary.learned,
                    "protocol": summary.protocol,
                }
            )
    try:
        import pandas as pd
    except ImportError:
        return out
    return pd.DataFrame(out)


def _short(task_name: str) -> str:
    """A task's column in the overview table: its registered short name, or its name."""
    from posenc_jax.bench.tasks import TASKS

    return (TASKS[task_name].short if task_name in TASKS else "") or task_name


def _can_run(task_name: str, label: str) -> bool:
    """Whether the encoding of a row label (``enc``, ``enc|normaliser``, ``rope+pi@eval``) can run
    ``task_name`` at all (:func:`~posenc_jax.bench.presets.runs_on`); True when unknown."""
    from posenc_jax.bench.presets import runs_on
    from posenc_jax.bench.tasks import task

    encoding = label.split("|")[0]
    if encoding.endswith("@eval"):
        encoding = encoding.split("+")[0]
    try:
        return runs_on(task(task_name, max_length=8), encoding)
    except ValueError:
        return True


def summarize(results) -> str:
    """The overview table (markdown): every encoding (rows) on every task (columns), its score
    beyond the training length with the 95% interval over all its seeds, or "not learned (k/n)"
    with the number of seeds that passed the gate on their own; ``·`` where a cell has not run (yet), ``n/a``
    where it cannot (an encoding with no bidirectional form on an encoder task, or NoPE on an
    encoder task whose answer slots differ: see :func:`~posenc_jax.bench.presets.runs_on`).
    ``results``: a folder or a :class:`Results`."""
    results = results if isinstance(results, Results) else read(results)
    summaries = cells(results)
    tasks = list(dict.fromkeys(c.task for c in summaries))
    encodings = list(dict.fromkeys(c.encoding for c in summaries))
    found = {(c.task, c.encoding): c for c in summaries}
    lines = [
        "| encoding | " + " | ".join(_short(t) for t in tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    for encoding in encodings:
        parts = [
            found[(t, encoding)].text() if (t, encoding) in found else "·" if _can_run(t, encoding) else "n/a"
            for t in tasks
        ]
        lines.append(f"| {encoding} | " + " | ".join(parts) + " |")
    return "\n".join(lines)
