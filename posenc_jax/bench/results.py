"""The benchmark's results as a researcher reads them: gated on learning, with intervals over seeds.

A results folder holds ``results.jsonl`` (one row per task, encoding, seed and length),
``run.json`` (the preset and provenance) and ``baselines.json``. From them:

* a seed has **learned** its task when its score at the longest training length reaches the
  preset's ``learned_threshold`` (text: fewer bits per character than the best n-gram model
  on the same characters);
* a cell (task × encoding) is **learned** when at least ``learned_fraction`` of its seeds
  learned; only then are its scores reported, as the mean over its learned seeds with a 95%
  Student-t interval (:mod:`posenc_jax.bench.stats`). An unlearned cell reads "not learned",
  never a score;
* two learned cells of one task are compared seed by seed (the paired difference of their
  scores beyond the training length, over the seeds both learned); an ordering is resolved
  when the difference's interval excludes 0.

:func:`load_results` gives one row per cell and length; :func:`cells` one summary per cell;
:func:`summarize` the overview table the report prints.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import pathlib

import numpy as np

from posenc_jax.bench.ledger import read_json, read_rows
from posenc_jax.bench.stats import Interval, Ordering, resolved_orderings, t_interval

__all__ = ["CellSummary", "Results", "cells", "load_results", "orderings", "read", "summarize"]


@dataclasses.dataclass(frozen=True)
class Results:
    """The contents of one results folder: its rows, the preset it ran (a dict, as in
    ``run.json``), its baselines and its run record."""

    rows: list[dict]
    preset: dict
    baselines: dict
    record: dict

    def threshold(self, task: str) -> tuple[float, bool]:
        """``(threshold, higher_is_better)`` of the gate of ``task``."""
        ngram = self.baselines.get(task, {}).get("ngram")
        if ngram:
            return min(b["bits_per_char"] for b in ngram), False
        overrides = dict(dict(self.preset.get("task_overrides") or ()).get(task, ()))
        return float(overrides.get("learned_threshold", self.preset.get("learned_threshold", 0.95))), True


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
    """One task × encoding over its seeds.

    Attributes:
      in_distribution: each seed's score at the longest training length.
      beyond: each seed's mean score over the lengths beyond training.
      learned_seeds: the seeds whose in-distribution score passed the gate.
      learned: whether enough seeds passed (``learned_fraction`` of them).
      at_training, extrapolation: intervals over the learned seeds (None if the cell is not learned).
      steps: each seed's training steps.
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

    @property
    def seeds(self) -> int:
        return len(self.in_distribution)

    def text(self, which: str = "extrapolation") -> str:
        """The cell as a table shows it: ``mean [low, high]`` or ``not learned (k/n)``; at the
        training length an unlearned cell shows its mean over all seeds there (the evidence that
        it did not learn), never a score beyond it."""
        if not self.learned:
            if which == "at_training" and self.in_distribution:
                return f"{np.mean(list(self.in_distribution.values())):.3f}, not learned"
            return f"not learned ({len(self.learned_seeds)}/{self.seeds})"
        interval = getattr(self, which)
        return "·" if interval is None else str(interval)


def _by_cell(rows):
    grouped = collections.defaultdict(lambda: collections.defaultdict(dict))
    for row in rows:
        grouped[(row["task"], row["encoding"])][row["seed"]][row["length"]] = row
    return grouped


def cells(results: Results) -> list[CellSummary]:
    """One :class:`CellSummary` per task × encoding, in the order the rows first name them."""
    fraction = float(results.preset.get("learned_fraction", 0.8))
    out = []
    for (task, encoding), per_seed in _by_cell(results.rows).items():
        sample = next(iter(next(iter(per_seed.values())).values()))
        train = sample["train_length"]
        threshold, higher = results.threshold(task)
        inside, beyond, steps, learned = {}, {}, {}, []
        # Beyond training, every seed is averaged over the same lengths: those all of the cell's
        # seeds have (a run read mid-evaluation, or resumed, may have more for some seeds).
        outside = set.intersection(*({n for n in by_length if n > train} for by_length in per_seed.values()))
        for seed, by_length in sorted(per_seed.items()):
            if train not in by_length:
                continue  # not yet evaluated at the training length: nothing can be said of it
            inside[seed] = by_length[train]["value"]
            steps[seed] = by_length[train].get("steps")
            values = [by_length[n]["value"] for n in outside]
            if values and all(math.isfinite(v) for v in values):
                beyond[seed] = float(np.mean(values))
            if (inside[seed] >= threshold) if higher else (inside[seed] < threshold):
                learned.append(seed)
        cell_learned = bool(inside) and len(learned) >= math.ceil(fraction * len(inside) - 1e-9)
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
                at_training=t_interval([inside[s] for s in learned]) if cell_learned else None,
                extrapolation=(
                    t_interval([beyond[s] for s in learned if s in beyond])
                    if cell_learned and any(s in beyond for s in learned)
                    else None
                ),
                steps=steps,
            )
        )
    return out


def orderings(results: Results, task: str) -> list[Ordering]:
    """The paired comparisons of the learned cells of ``task`` beyond the training length, over
    the seeds each pair both learned."""
    learned = [c for c in cells(results) if c.task == task and c.learned]
    if not learned:
        return []
    per_seed = {c.encoding: {s: c.beyond[s] for s in c.learned_seeds if s in c.beyond} for c in learned}
    return resolved_orderings(per_seed, higher_is_better=learned[0].higher_is_better)


def load_results(path):
    """One row per task, encoding and length: the mean over the cell's learned seeds with its 95%
    interval (``low``, ``high``), the number of seeds, how many learned, and whether the cell
    learned (its scores are NaN when it did not: a score is reported only from a learned cell).
    A pandas DataFrame when pandas is installed, else a list of dicts.

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
            values = {s: by_length[n]["value"] for s, by_length in per_seed.items() if n in by_length}
            kept = [values[s] for s in summary.learned_seeds if s in values and math.isfinite(values[s])]
            interval = t_interval(kept) if summary.learned and kept else None
            out.append(
                {
                    "task": task,
                    "encoding": encoding,
                    "length": n,
                    "in_distribution": n <= summary.train_length,
                    "metric": summary.metric,
                    "mean": interval.mean if interval else math.nan,
                    "low": interval.low if interval else math.nan,
                    "high": interval.high if interval else math.nan,
                    "seeds": len(values),
                    "learned_seeds": len(summary.learned_seeds),
                    "learned": summary.learned,
                }
            )
    try:
        import pandas as pd
    except ImportError:
        return out
    return pd.DataFrame(out)


_SHORT = {
    "counting_copy": "counting copy",
    "counting_replace": "counting replace",
    "reverse_string": "reverse string (enc)",
    "missing_duplicate": "missing dup. (enc)",
    "parity": "parity (enc)",
    "bucket_sort": "bucket sort (enc)",
    "probe": "probe (enc)",
    "probe_boundary": "probe + [CLS]/[SEP] (enc)",
    "text": "text, bits/char",
}


def _can_run(task_name: str, label: str) -> bool:
    """Whether the encoding of a row label (``enc``, ``enc|normaliser``, ``rope+pi@eval``) can run
    ``task_name`` at all (:func:`~posenc_jax.bench.presets.runs_on`); True when unknown."""
    from posenc_jax.bench.presets import runs_on
    from posenc_jax.bench.tasks import make_task

    encoding = label.split("|")[0]
    if encoding.endswith("@eval"):
        encoding = encoding.split("+")[0]
    try:
        return runs_on(make_task(task_name, max_length=8), encoding)
    except ValueError:
        return True


def summarize(results) -> str:
    """The overview table (markdown): every encoding (rows) on every task (columns), its score
    beyond the training length with the 95% interval over its learned seeds, or "not learned
    (k/n)" with the number of seeds that learned; ``·`` where a cell has not run (yet), ``n/a``
    where it cannot (an encoding with no bidirectional form on an encoder task, or NoPE on an
    encoder task whose answer slots differ: see :func:`~posenc_jax.bench.presets.runs_on`).
    ``results``: a folder or a :class:`Results`."""
    results = results if isinstance(results, Results) else read(results)
    summaries = cells(results)
    tasks = list(dict.fromkeys(c.task for c in summaries))
    encodings = list(dict.fromkeys(c.encoding for c in summaries))
    found = {(c.task, c.encoding): c for c in summaries}
    lines = [
        "| encoding | " + " | ".join(_SHORT.get(t, t) for t in tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    for encoding in encodings:
        parts = [
            found[(t, encoding)].text() if (t, encoding) in found else "·" if _can_run(t, encoding) else "n/a"
            for t in tasks
        ]
        lines.append(f"| {encoding} | " + " | ".join(parts) + " |")
    return "\n".join(lines)
