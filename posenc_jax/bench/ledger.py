"""The benchmark's results ledger: what a run has measured, and how it was made.

``results.jsonl`` holds one row per (task, encoding, seed, length), appended as each is
measured; every row carries the preset's :func:`fingerprint`, and a folder holding rows of
another fingerprint is refused, so numbers made with different settings never mix.
Re-running a command skips the rows already there (:meth:`Ledger.done`), which is how a
run resumes. ``run.json`` records the provenance: the preset, library versions, device,
git commit and per-cell timings.

One process writes a folder at a time (:class:`~posenc_jax.bench.files.FolderLock`, the file
``.lock``); rows are appended each with one write of one whole line, and ``run.json`` is
replaced whole (:mod:`posenc_jax.bench.files`), so a full disk or a kill leaves what was written
readable. :func:`read_rows` is the one reader
of ``results.jsonl``: a line it cannot use is an error naming the file, the line and the fix.

The two files are the run's record, and a run resuming in a folder checks them before it
trusts them (:class:`Ledger`): nothing is rebuilt or dropped without a word.

* ``run.json`` holds, in its field ``digests``, a SHA-256 of each of its fields as the run
  wrote it; a field changed, added or removed since is an error naming the fields.
* ``run.json`` missing beside rows is an error, except after a run killed in its first cell
  (run.json is written once a cell finishes; ``.pending-record`` marks rows written before it).
* A damaged line of ``results.jsonl`` is an error naming it, the last line included, with one
  exception: a last line cut short, with no newline (a run killed, or the machine stopped,
  mid-write), is dropped with a warning that shows it, and that row is measured again.

``--repair`` (``Ledger(..., repair=True)``) goes on past a missing or edited ``run.json``,
saying so in a warning and in the record's ``repairs``; for a damaged line the fix is to
delete it, or to run into a new folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import pathlib
import platform
import subprocess
import warnings

from posenc_jax.bench.files import (
    FolderLock,
    check_writable,
    json_type,
    read_json,
    write_error,
    write_json,
    write_text,
)

__all__ = [
    "METHOD",
    "FolderLock",
    "Ledger",
    "check_writable",
    "cell_checkpoint_dir",
    "checkpoint_dir",
    "field_digests",
    "fingerprint",
    "git_state",
    "provenance",
    "read_json",
    "read_rows",
    "write_json",
]

# Fields that choose which rows exist (or only document), not what a row's value is.
_NOT_HASHED = (
    *("name", "encodings", "tasks", "seeds", "normalizers", "eval_only_tasks"),
    *("description", "target", "paper_protocol"),
)
# Settings added after runs were committed: at their default they leave a fingerprint as it was,
# so those runs' folders stay theirs; any other value is hashed.
_HASHED_UNLESS_DEFAULT = {
    "task_format": "ours",
    "train_min_length": 1,
    "batches": "host",
    "steps_per_dispatch": 1,
}


# The benchmark's method: 3 trains every encoding the same steps (the preset's protocol) and
# counts every seed; 2 trained to criterion and gated each seed; 1: fixed steps, random text windows.
METHOD = 3


def fingerprint(preset, data: str | None = None) -> str:
    """A hash of every setting that shapes a result (not the lists of encodings, tasks, seeds),
    of the method's version (:data:`METHOD`) and of ``data`` (the text corpus's digest, where
    the run has the text task), so results of another method or text never mix.

    Example:
      >>> from posenc_jax.bench.presets import PRESETS
      >>> len(fingerprint(PRESETS["cpu"]))
      12
    """
    settings = dataclasses.asdict(preset)
    for key in _NOT_HASHED:
        settings.pop(key)
    for key, default in _HASHED_UNLESS_DEFAULT.items():
        if settings.get(key) == default:
            settings.pop(key)
    settings["method"] = METHOD
    if data is not None:  # the text corpus's digest, when the run has the text task
        settings["data"] = data
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def cell_checkpoint_dir(out: pathlib.Path, settings: str, task: str, label: str) -> pathlib.Path:
    """The folder of one cell's checkpoints (one sub-folder per seed)."""
    return out / "checkpoints" / settings / task / label.replace("|", "-")


def checkpoint_dir(out: pathlib.Path, settings: str, task: str, label: str, seed: int) -> pathlib.Path:
    """Where one seed of one cell keeps its orbax checkpoints."""
    return cell_checkpoint_dir(out, settings, task, label) / f"seed{seed}"


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=pathlib.Path(__file__).parent
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def git_state() -> dict:
    """``{"commit": ..., "dirty": ...}`` of the checkout this code runs from: the commit (None
    outside a git checkout, as for an installed wheel) and whether the library's files differ
    from it (None when unknown)."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def provenance() -> dict:
    """Library versions (posenc_jax's own included), device and git commit, for ``run.json``."""
    import flax
    import jax
    import numpy as np
    import optax
    import orbax.checkpoint

    import posenc_jax

    return {
        "versions": {
            "posenc_jax": posenc_jax.__version__,
            "jax": jax.__version__,
            "flax": flax.__version__,
            "optax": optax.__version__,
            "orbax-checkpoint": orbax.checkpoint.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "device": {
            "platform": jax.devices()[0].platform,
            "kind": jax.devices()[0].device_kind,
            "count": jax.local_device_count(),
        },
        "git_commit": git_state()["commit"],
    }


_FIX = "delete that line, or run into a new --out"
_LISTED = 4  # fields named in an error; the rest are counted
_PENDING = ".pending-record"  # rows written, run.json not yet (a run in its first cell)

# What every row holds, with the JSON type the report relies on.
_ROW_FIELDS = {"task": "string", "encoding": "string", "seed": "integer", "length": "integer", "value": "number"}


def _row_problem(row) -> str | None:
    """Why ``row`` is not a result row (None when it is one)."""
    if not isinstance(row, dict):
        return f"is a JSON {json_type(row)}, not an object"
    missing = [key for key in _ROW_FIELDS if key not in row]
    if missing:
        return f"lacks {', '.join(missing)}"
    for key, wanted in _ROW_FIELDS.items():
        found = json_type(row[key])
        if found != wanted and not (wanted == "number" and found == "integer"):
            return f"has {key} {row[key]!r}, a {found}, where a{'n' if wanted[0] in 'aeiou' else ''} {wanted} belongs"
    return None


def _read_rows_text(path: pathlib.Path) -> str:
    """The text of a ``results.jsonl``; a byte that is not UTF-8 is an error naming its line."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not the results file (rows of JSON); move it away and run again")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(
            f"cannot read {path} ({error.strerror or error}); check the file and its permissions"
        ) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(
            f"{path} line {line} is not text (byte {error.start} is 0x{data[error.start]:02x}); {_FIX}"
        ) from None


def read_rows(path, *, drop_cut_last: bool = False) -> list[tuple[int, dict]]:
    """The rows of a ``results.jsonl`` as ``(line number, row)``: every line must be a JSON object
    with a string ``task`` and ``encoding``, integer ``seed`` and ``length`` and a number
    ``value``, and no cell's row (task, encoding, seed, length) may come twice. Anything else
    is a ValueError naming the file, the line and what to do.

    Args:
      path: the ``results.jsonl``.
      drop_cut_last: a last line cut short, the mark of a write interrupted by a kill (the start
        of a row, ``{...``, not JSON, and no newline after it), is removed from the file with a
        warning that shows it, instead of refused, as a resuming run does. Any other line that
        is not JSON, the last included, is refused either way.
    """
    path = pathlib.Path(path)
    text = _read_rows_text(path)
    lines = text.splitlines()
    rows, seen = [], {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            cut = number == len(lines) and not text.endswith("\n") and line.lstrip().startswith("{")
            if cut and drop_cut_last:
                write_text(path, "".join(f"{kept}\n" for kept in lines[:-1]))
                warnings.warn(
                    f"{path} line {number} was cut short, a run killed while writing it ({line[:80]!r}, "
                    "no newline): dropped it; its row is measured again",
                    stacklevel=3,
                )
                break
            if cut:
                raise ValueError(
                    f"{path} line {number} is cut short (a run killed while writing it?); run the same command "
                    "again, which drops it (saying so) and resumes, or delete that line"
                ) from None
            raise ValueError(f"{path} line {number} is not JSON ({line[:60]!r}); {_FIX}") from None
        problem = _row_problem(row)
        if problem:
            raise ValueError(f"{path} line {number} {problem}: not a row of this benchmark; {_FIX}")
        key = (row["task"], row["encoding"], row["seed"], row["length"])
        if key in seen:
            first, earlier = seen[key]
            same = earlier == row["value"] or (
                isinstance(earlier, float) and math.isnan(earlier) and math.isnan(row["value"])
            )
            value = "the same value" if same else f"another value ({earlier!r} there, {row['value']!r} here)"
            raise ValueError(
                f"{path} line {number} repeats line {first} (task {key[0]}, encoding {key[1]}, seed {key[2]}, "
                f"length {key[3]}) with {value}: rows of two runs are mixed; keep one of the two lines, or run "
                "into a new --out"
            )
        seen[key] = (number, row["value"])
        rows.append((number, row))
    return rows


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def field_digests(record: dict) -> dict[str, str]:
    """A SHA-256 (12 hexadecimal digits) of each field of ``record`` as it reads back from JSON,
    one level down in a field that is an object (``"preset.steps"``); ``run.json`` keeps them in
    its field ``digests`` (which is not itself digested), so an edit names the fields it changed.

    Example:
      >>> sorted(field_digests({"preset": {"steps": 2, "seeds": [0]}, "cells": []}))
      ['cells', 'preset.seeds', 'preset.steps']
    """
    record = json.loads(json.dumps({key: value for key, value in record.items() if key != "digests"}))
    digests = {}
    for key, value in record.items():
        if isinstance(value, dict) and value:
            digests.update({f"{key}.{sub}": _digest(inner) for sub, inner in value.items()})
        else:
            digests[key] = _digest(value)
    return digests


def _edits(record: dict, digests: dict) -> str:
    """What differs between ``record`` and the field ``digests`` written with it ("" for nothing)."""
    now = field_digests(record)
    parts = []
    for names, how in (
        (sorted(k for k in now.keys() & digests.keys() if now[k] != digests[k]), "changed"),
        (sorted(now.keys() - digests.keys()), "added"),
        (sorted(digests.keys() - now.keys()), "removed"),
    ):
        if names:
            more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
            parts.append(f"{', '.join(names[:_LISTED])}{more} {how}")
    return "; ".join(parts)


class Ledger:
    """``results.jsonl`` and ``run.json`` of one output folder, for one preset fingerprint.

    Opening it reads the rows already there: it refuses rows of another fingerprint and any
    damaged line, drops a last row cut short by a kill with a warning (:func:`read_rows`),
    and ends a last row that lacks its newline with one, so the next row is not glued to it.
    :meth:`start_record` checks ``run.json`` against the rows and the digests it was written
    with (see the module's docstring).

    Args:
      out: the results folder.
      settings: the preset's :func:`fingerprint`.
      repair: go on past a missing, unreadable or edited ``run.json`` (``--repair``): a
        warning says what was found, the record notes it in ``repairs``, and a missing or
        unreadable one is started anew (the earlier cells' timings stay lost).
    """

    def __init__(self, out: pathlib.Path, settings: str, *, repair: bool = False):
        self.out = pathlib.Path(out)
        self.settings = settings
        self.repair = repair
        self.results_path = self.out / "results.jsonl"
        self.run_json = self.out / "run.json"
        self.pending = self.out / _PENDING
        self._done = self._read()

    def _read(self) -> set:
        path = self.results_path
        if not path.exists():
            return set()
        rows = read_rows(path, drop_cut_last=True)
        text = _read_rows_text(path)
        if text and not text.endswith("\n"):
            self._append(b"\n")
        foreign = {row.get("settings") for _, row in rows} - {self.settings}
        if foreign:
            first = next(number for number, row in rows if row.get("settings") != self.settings)
            raise ValueError(
                f"{path} holds results made with other settings ({sorted(map(str, foreign))}, now "
                f"{self.settings}), the first at line {first}; choose another --out, or delete that folder to "
                "start over"
            )
        return {(row["task"], row["encoding"], row["seed"], row["length"]) for _, row in rows}

    def done(self, task: str, label: str, seed: int, length: int) -> bool:
        return (task, label, seed, int(length)) in self._done

    def _append(self, data: bytes) -> None:
        """Appends ``data`` with one write; a write that fails (a full disk) is cut back off, so the
        file ends with the last whole row, and is a ValueError naming the file."""
        path = self.results_path
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as error:
            raise write_error(path, error) from error
        try:
            size = os.fstat(fd).st_size
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as error:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)  # no half row left behind
                raise write_error(path, error) from error
        finally:
            os.close(fd)

    def write(self, row: dict) -> None:
        """Appends one row (with this ledger's fingerprint): one write of one whole line. The first
        row of a folder without ``run.json`` first writes ``.pending-record``: rows of a cell not
        yet finished, which a resumed run may find without ``run.json``."""
        row = {**row, "settings": self.settings}
        problem = _row_problem(row)
        if problem:
            raise ValueError(f"a result row {problem}: {row!r}")
        if not self.run_json.exists() and not self.pending.exists():
            write_json(self.pending, {"settings": self.settings, "pid": os.getpid()})
        self._append((json.dumps(row) + "\n").encode())
        self._done.add((row["task"], row["encoding"], row["seed"], row["length"]))

    def start_record(self, preset, *, asked: dict | None = None, **extra) -> dict:
        """The run record: the preset, provenance and ``extra``, with the cells of earlier sittings.

        ``asked``: per task, the row labels (encodings) this sitting asks for; the record keeps
        those of every sitting (``record["asked"]``), what the report accepts rows of.
        """
        record = {"preset": dataclasses.asdict(preset), **extra, **provenance(), "settings": self.settings}
        earlier, repairs = self._earlier_record()
        record["cells"] = earlier.get("cells", [])
        if repairs or earlier.get("repairs"):
            record["repairs"] = [*earlier.get("repairs", []), *repairs]
        if asked is not None:
            merged = {task: set(labels) for task, labels in (earlier.get("asked") or {}).items()}
            for task, labels in asked.items():
                merged.setdefault(task, set()).update(labels)
            record["asked"] = {task: sorted(labels) for task, labels in merged.items()}
        return record

    def _earlier_record(self) -> tuple[dict, list[str]]:
        """The record of earlier sittings (``{}`` for none) and what ``--repair`` went past; a
        missing, unreadable or edited ``run.json`` beside rows is an error without ``repair``."""
        rows = len(self._done)
        if not self.run_json.exists():
            if not rows or self.pending.exists():  # nothing yet, or a first cell killed before its end
                return {}, []
            problem = (
                f"{self.run_json} is missing beside {rows} rows of {self.results_path.name}: the record of the cells "
                "that made them (their timings and the encodings asked) is gone"
            )
            fix = "restore it, run into a new --out, or pass --repair to start run.json anew (that record stays lost)"
            return {}, self._go_on_past(problem, fix)
        fix = "restore it, run into a new --out, or pass --repair to start run.json anew"
        try:
            earlier = read_json(self.run_json, "run record", fix=fix)
        except ValueError as error:
            if not self.repair:
                raise
            return {}, self._go_on_past(str(error).removesuffix(f"; {fix}"), fix)
        digests = earlier.pop("digests", None)
        if not isinstance(digests, dict):  # written before run.json held digests: nothing to check it by
            return earlier, []
        edits = _edits(earlier, digests)
        if not edits:
            return earlier, []
        problem = f"{self.run_json} differs from what the run wrote ({edits}): edited by hand?"
        fix = "undo the edit, run into a new --out, or pass --repair to keep it as it is now"
        return earlier, self._go_on_past(problem, fix)

    def _go_on_past(self, problem: str, fix: str) -> list[str]:
        if not self.repair:
            raise ValueError(f"{problem}; {fix}")
        warnings.warn(f"--repair: {problem}; going on, noted in run.json's repairs", stacklevel=4)
        return [problem]

    def save_record(self, record: dict) -> None:
        """Writes ``run.json``, listing every commit that made a row of ``results.jsonl``, with the
        digest of each of its fields (:func:`field_digests`)."""
        commits = {}
        if self.results_path.exists():
            for _, row in read_rows(self.results_path):
                key = (row.get("commit"), row.get("dirty"))
                commits[key] = commits.get(key, 0) + 1
        record["commits"] = [
            {"commit": commit, "dirty": dirty, "rows": rows}
            for (commit, dirty), rows in sorted(commits.items(), key=str)
        ]
        written = {key: value for key, value in record.items() if key != "digests"}
        write_json(self.run_json, {**written, "digests": field_digests(written)})  # whole or not at all
        self.pending.unlink(missing_ok=True)
