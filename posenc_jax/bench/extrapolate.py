"""The length-extrapolation benchmark: train short, test long, for each encoding.

For every cell (task x encoding x normaliser) the runner builds one small Transformer per
seed, trains the seeds together (checkpointing with orbax as it goes), then evaluates
each at every evaluation length, appending one row per length to ``results.jsonl`` as
soon as it is measured. Re-running the same command skips finished rows and resumes
interrupted training from the last checkpoint; the data of step k depends only on
(seed, k), so a resumed run ends with the same results.

The pieces live where they change: presets in :mod:`~posenc_jax.bench.presets`, the
results ledger and provenance in :mod:`~posenc_jax.bench.ledger`, one cell's training and
evaluation in :mod:`~posenc_jax.bench.cell`, tasks behind one protocol in
:mod:`posenc_jax.bench.tasks`. This module only plans the cells, shows progress and runs them.

The settings flow one way: the runner resolves each task's settings once
(:meth:`Preset.resolve <posenc_jax.bench.presets.Preset.resolve>`, a
:class:`~posenc_jax.bench.settings.TaskSettings`), and the plan, the baselines, the criterion,
the cost model and every cell read those; nothing past this point goes back to the preset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import shutil
import time

import jax

from posenc_jax.bench.cell import SUPPORTED_IMPLEMENTATIONS, Cell, Criterion, row_label, train_and_evaluate
from posenc_jax.bench.cost import CPU_ESTIMATE, H200_ESTIMATE, TPU_ESTIMATE, cell_cost, duration
from posenc_jax.bench.hosts import runs_here
from posenc_jax.bench.ledger import (
    FolderLock,
    Ledger,
    cell_checkpoint_dir,
    check_writable,
    fingerprint,
    git_state,
    write_json,
)
from posenc_jax.bench.presets import PRESETS, Preset
from posenc_jax.bench.settings import TaskSettings, runs_on, why_not_run
from posenc_jax.functional.core.validation import reraise_check_errors
from posenc_jax.training import data_parallel_mesh

__all__ = ["PRESETS", "Preset", "baselines", "fingerprint", "pin_corpus", "plan", "row_label", "run"]


def _tasks(preset: Preset, corpus: str | None) -> dict[str, TaskSettings]:
    """Each task of the preset with its settings, resolved once (:meth:`Preset.resolve`) and
    checked against its lengths before anything trains."""
    resolved = {}
    for name in preset.tasks:
        settings = preset.resolve(preset.task(name, corpus))
        task, lengths = settings.task, settings.lengths
        task.check_lengths(lengths.train, lengths.eval)
        if lengths.text and len(task.test) < lengths.examples + 1:
            raise ValueError(
                f"the text corpus's test split ({task.corpus_description}) has {len(task.test)} characters, fewer "
                f"than the {lengths.examples} every length scores (text_eval_characters); pass a larger corpus "
                "(--text-corpus) or score fewer characters (--text-eval-characters)"
            )
        for n in lengths.eval:
            implementation = settings.implementation_at(task.max_tokens(n))
            if implementation not in SUPPORTED_IMPLEMENTATIONS:
                raise ValueError(
                    f"preset {preset.name} evaluates {name} at {n} with {implementation} attention "
                    f"(blockwise_from={preset.blockwise_from}), which the benchmark's model cannot run yet "
                    f"(it runs {', '.join(SUPPORTED_IMPLEMENTATIONS)}); use shorter --text-lengths"
                )
        resolved[name] = settings
    return resolved


def pin_corpus(preset: Preset, tasks: dict, corpus: str | None) -> Preset:
    """The preset a run records, its text corpus checked against ``preset.text_corpus_sha256``.

    The default corpus (``corpus`` None) must hash to the preset's pin, or the run stops here,
    before anything trains, naming both hashes. A corpus passed explicitly (``--corpus PATH``)
    is the caller's own: its hash becomes the preset's (recorded in ``run.json`` and part of
    the results' fingerprint, so a folder's rows never mix two texts). ``tasks``: the run's tasks
    by name (task objects).
    """
    if "text" not in tasks:
        return preset
    sha256 = tasks["text"].sha256
    if corpus is not None:
        return dataclasses.replace(preset, text_corpus_sha256=sha256)
    if sha256 != preset.text_corpus_sha256:
        raise ValueError(
            f"the text corpus ({tasks['text'].corpus_description}) has SHA-256 {sha256}, but preset {preset.name} "
            f"pins {preset.text_corpus_sha256}; set text_corpus_sha256 to the corpus's hash, or pass a corpus of "
            "your own with --corpus PATH"
        )
    return preset


def plan(preset: Preset, tasks: dict, ledger: Ledger, log=print, host=None) -> list[tuple[Cell, dict]]:
    """Every cell of ``preset`` that has rows left to measure, with each seed's ``(variant, length)``
    still to do (variant None for the trained encoding itself). ``tasks``: each task's resolved
    settings (:func:`_tasks`); ``preset`` says which encodings, normalisers and seeds run. With
    ``host=(i, H)``, only the cells this host trains: every H-th of the preset's cells in their
    fixed order, from the i-th (:mod:`posenc_jax.bench.hosts`)."""
    cells = []
    position = -1
    for task_name, settings in tasks.items():
        for encoding in preset.encodings:
            why = why_not_run(settings.task, encoding)
            if why:
                log(f"{encoding} {why}: not run on the encoder task {task_name}")
                continue
            for normalizer in preset.normalizers:
                position += 1
                if not runs_here(position, host):
                    continue
                cell = Cell(settings, encoding, normalizer)
                variants = (None, *settings.variants(encoding, normalizer))
                todo = {
                    seed: [
                        (v, n)
                        for v in variants
                        for n in settings.lengths.eval
                        if not ledger.done(task_name, cell.label if v is None else v.label, seed, n)
                    ]
                    for seed in preset.seeds
                }
                todo = {seed: rows for seed, rows in todo.items() if rows}
                if todo:
                    cells.append((cell, todo))
    return cells


def asked(preset: Preset, tasks: dict) -> dict[str, list[str]]:
    """Per task, the row labels (``encoding`` fields) ``preset`` asks for: each encoding that runs
    on it with each normaliser, and their evaluation variants (``tasks``: each task's resolved
    settings). ``run.json`` keeps them, and the report reads rows of these alone."""
    labels = {}
    for task_name, settings in tasks.items():
        found = []
        for encoding in preset.encodings:
            if not runs_on(settings.task, encoding):
                continue
            for normalizer in preset.normalizers:
                found.append(row_label(encoding, normalizer))
                found += [v.label for v in settings.variants(encoding, normalizer)]
        labels[task_name] = sorted(set(found))
    return labels


def baselines(tasks: dict, out: pathlib.Path | None = None) -> dict:
    """Per task (``tasks``: each task's resolved settings), what its scores are read against: the
    task's own baselines (its ``baselines`` method). For an algorithmic task, chance, position-only
    and content-only at each evaluation length; for text, n-gram models on the scored characters,
    kept in ``out/baselines.json`` (the n-gram fits take seconds), keyed by what they depend on."""
    path = None if out is None else pathlib.Path(out) / "baselines.json"
    stored = json.loads(path.read_text()) if path is not None and path.exists() else {}
    result = {}
    for name, settings in tasks.items():
        task, lengths = settings.task, settings.lengths
        if lengths.text:
            key = f"{task.corpus_description} | SHA-256 {task.sha256} | {lengths.examples} characters"
            if stored.get(name, {}).get("key") != key:
                stored[name] = {"key": key, "ngram": task.baselines(lengths.examples)}
            result[name] = stored[name]
        else:
            result[name] = {"lengths": {str(n): task.baselines(n) for n in lengths.eval}}
    if path is not None:
        write_json(path, {**stored, **result})  # whole or not at all; a full disk names the file
    return result


def criterion(settings: TaskSettings, task_baselines: dict) -> Criterion:
    """When a seed of the task of ``settings`` has met its criterion (recorded as its steps to
    criterion; under the ``to-criterion`` protocol it stops there): ``learned_threshold +
    criterion_margin`` (at most 1) at the longest training length; for text, ``text_margin``
    fewer bits per character than the best n-gram baseline on the same characters (the checks
    compare on the validation split's characters). The gate a result passes afterwards is read
    off the test examples, on the mean over all seeds."""
    task = settings.task
    if "ngram" in task_baselines:
        from posenc_jax.bench.ngram import NGramModel

        best = min(task_baselines["ngram"], key=lambda b: b["bits_per_char"])
        model = NGramModel.fit(task.train, best["order"], smoothing=best["smoothing"], vocab_size=task.vocab_size)
        return Criterion(-settings.text_margin, higher_is_better=False, reference=-model.log2_probs(task.validation))
    return Criterion(min(1.0, settings.learned_threshold + settings.criterion_margin), higher_is_better=True)


class _Progress:
    """Overall progress: cell i of N, elapsed time, and the time left: the cost model's estimate of
    the cells left (``modelled``, seconds per cell), times how long the finished cells took against
    their own estimates, so a run whose first cells are short ones (counting copy) does not promise
    its long ones (text) at their pace; with ``bars``, a tqdm bar over the cells and one per cell's
    training steps."""

    def __init__(self, cells: list[Cell], *, bars: bool, modelled: list[float]):
        self.tasks = [cell.task_name for cell in cells]
        self.modelled = modelled
        self.began = time.perf_counter()
        self.measured = 0.0
        self.overall = None
        if bars:
            from tqdm.auto import tqdm

            self.tqdm = tqdm
            self.overall = tqdm(total=len(cells), desc="cells", unit="cell", position=0, dynamic_ncols=True)

    def cell_bar(self, total: int, initial: int, description: str):
        return self.tqdm(
            total=total, initial=initial, desc=description, position=1, leave=False, dynamic_ncols=True, unit="step"
        )

    def finished(self, index: int, seconds: float) -> str:
        """Records cell ``index`` as done; returns ``cell i of N, elapsed, about T left``."""
        self.measured += seconds
        pace = self.measured / max(sum(self.modelled[: index + 1]), 1e-9)
        left = pace * sum(self.modelled[index + 1 :])
        if self.overall is not None:
            self.overall.update(1)
        return (
            f"cell {index + 1} of {len(self.tasks)}, {duration(time.perf_counter() - self.began)} elapsed, "
            f"about {duration(left)} left"
        )

    def close(self):
        if self.overall is not None:
            self.overall.close()


def _summary(records: list[dict], steps: int) -> str:
    parts = []
    for record in records:
        if record["final_loss"] is None:
            training = f"resumed at step {record['resumed_from_step']} of {steps}, no steps left"
        else:
            trained = sorted(set(record["steps"].values()))
            training = f"{'/'.join(map(str, trained))} of {steps} steps, loss " + "/".join(
                f"{x:.3f}" for x in record["final_loss"]
            )
            if record["resumed_from_step"]:
                training += f" (resumed from step {record['resumed_from_step']})"
        parts.append(
            f"seeds {','.join(map(str, record['seeds']))}: {training}, compile {record['compile_seconds']:.1f}s, "
            f"train {record['train_seconds']:.1f}s, eval {record['eval_seconds']:.1f}s"
        )
    return "; ".join(parts)


def run(
    preset: Preset,
    out: pathlib.Path,
    *,
    corpus: str | None = None,
    progress: bool = True,
    keep_checkpoints: bool = False,
    log=print,
    lock: bool = True,
    host: tuple[int, int] | None = None,
    repair: bool = False,
) -> dict:
    """Runs (or resumes) every cell of ``preset``, writing into ``out``.

    Everything that can be checked is checked before any training: the settings, the output
    folder, the results already there, and that every task can serve its lengths. One run
    writes a folder at a time: a second one on the same ``out`` stops at once, naming the
    pid of the first (:class:`~posenc_jax.bench.ledger.FolderLock`).

    Args:
      preset: the run's settings.
      out: the output folder (``results.jsonl``, ``run.json``, checkpoints).
      corpus: the text task's corpus (a path, or a hub corpus name); None for the default.
      progress: tqdm bars over the cells and the current cell's steps.
      keep_checkpoints: keep a finished cell's checkpoints (by default they are deleted once
        its rows are written: the ledger then says the cell is done, and nothing reads them).
      log: called with one line per finished cell.
      lock: take the folder's lock (False: the caller holds it, as :func:`posenc_jax.bench.run`
        does until the report is written).
      host: ``(i, H)``: train only host i's share of the cells (:mod:`posenc_jax.bench.hosts`);
        ``out`` is then that host's own folder.
      repair: resume past a missing, unreadable or edited ``run.json`` beside the rows, saying
        so (a warning, and ``repairs`` in the record); without it that stops the run, as a
        damaged line of ``results.jsonl`` always does (:class:`~posenc_jax.bench.ledger.Ledger`).

    Returns:
      The run record written to ``run.json``.
    """
    preset.validate()
    out = pathlib.Path(out)
    check_writable(out)
    with FolderLock(out) if lock else contextlib.nullcontext():
        return _run_locked(
            preset,
            out,
            corpus=corpus,
            progress=progress,
            keep_checkpoints=keep_checkpoints,
            log=log,
            host=host,
            repair=repair,
        )


def _run_locked(
    preset: Preset, out: pathlib.Path, *, corpus, progress, keep_checkpoints, log, host=None, repair=False
) -> dict:
    tasks = _tasks(preset, corpus)
    preset = pin_corpus(preset, {name: settings.task for name, settings in tasks.items()}, corpus)
    settings = fingerprint(preset, data=tasks["text"].task.digest if "text" in tasks else None)
    ledger = Ledger(out, settings, repair=repair)
    record = ledger.start_record(preset, corpus=corpus, asked=asked(preset, tasks))
    if host is not None:
        record["host"] = list(host)
    for resolved in tasks.values():
        description = getattr(resolved.task, "corpus_description", None)
        if description:
            record["text_corpus"] = description
    if progress and log is print:
        from tqdm.auto import tqdm

        log = tqdm.write  # lines above the bars, not through them
    known = baselines(tasks, out)
    criteria = {name: criterion(resolved, known[name]) for name, resolved in tasks.items()}
    stamp = git_state()
    cells = plan(preset, tasks, ledger, log, host=host)
    mesh = None
    if jax.local_device_count() > 1 and preset.batch_size % jax.local_device_count() == 0:
        mesh = data_parallel_mesh()
    rates = {"gpu": H200_ESTIMATE, "tpu": TPU_ESTIMATE}.get(jax.default_backend(), CPU_ESTIMATE)
    modelled = [
        cell_cost(cell.settings.with_seeds(sorted(todo)), cell.encoding, cell.normalizer).seconds(rates)
        for cell, todo in cells
    ]
    shown = _Progress([cell for cell, _ in cells], bars=progress, modelled=modelled)
    for index, (cell, todo) in enumerate(cells):
        began = time.perf_counter()
        with reraise_check_errors():  # a check failing in a step (read later on an accelerator) raises itself
            records = train_and_evaluate(
                cell,
                sorted(todo),
                todo,
                out=out,
                fingerprint=settings,
                write=ledger.write,
                criterion=criteria[cell.task_name],
                stamp=stamp,
                mesh=mesh,
                bar=shown.cell_bar if progress else None,
            )
        record["cells"].extend(records)
        ledger.save_record(record)
        if not keep_checkpoints:  # every row of the cell is written: nothing resumes from these
            shutil.rmtree(cell_checkpoint_dir(out, settings, cell.task_name, cell.label), ignore_errors=True)
        # Each cell compiles programs no later cell reuses. Dropping them keeps a long run's
        # memory flat: a cpu-full run compiling ~190 cells in one process once ran out of
        # LLVM's mapped code memory ("Unable to allocate section memory").
        jax.clear_caches()
        where = shown.finished(index, time.perf_counter() - began)
        log(f"[{where}] {cell.task_name:14s} {cell.label:12s} {_summary(records, cell.settings.steps)}")
    shown.close()
    ledger.save_record(record)
    if not keep_checkpoints:
        _remove_empty_folders(out / "checkpoints")
    return record


def _remove_empty_folders(root: pathlib.Path) -> None:
    """Removes the folders under ``root`` (and ``root``) that hold nothing, deepest first."""
    if root.is_dir():
        for folder in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            if not any(folder.iterdir()):
                folder.rmdir()
        if not any(root.iterdir()):
            root.rmdir()
