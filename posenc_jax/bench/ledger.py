"""The benchmark's results ledger: what a run has measured, and how it was made.

``results.jsonl`` holds one row per (task, encoding, seed, length), appended as each is
measured; every row carries the preset's :func:`fingerprint`, and a folder holding rows of
another fingerprint is refused, so numbers made with different settings never mix.
Re-running a command skips the rows already there (:meth:`Ledger.done`), which is how a
run resumes. ``run.json`` records the provenance: the preset, library versions, device,
git commit and per-cell timings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import platform
import subprocess

__all__ = ["METHOD", "Ledger", "check_writable", "checkpoint_dir", "fingerprint", "git_state", "provenance"]

# Fields that choose which rows exist (or only document), not what a row's value is.
_NOT_HASHED = ("name", "encodings", "tasks", "seeds", "normalizers", "eval_only_tasks", "description", "target")


# The benchmark's method: 2 trains to criterion, gates results on it and scores text on the
# same characters at every length (1: fixed steps, random text windows).
METHOD = 2


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
    settings["method"] = METHOD
    if data is not None:  # the text corpus's digest, when the run has the text task
        settings["data"] = data
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def check_writable(out: pathlib.Path) -> None:
    """Makes ``out`` and writes a file in it, so a path that cannot hold the results fails before
    any training, with the path and what to do."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; pass a folder for the results")
    probe = out / ".write-test"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ValueError(
            f"cannot write to --out {out} ({error.strerror or error}); choose a folder you can write to"
        ) from None


def checkpoint_dir(out: pathlib.Path, settings: str, task: str, label: str, seed: int) -> pathlib.Path:
    """Where one seed of one cell keeps its orbax checkpoints."""
    return out / "checkpoints" / settings / task / label.replace("|", "-") / f"seed{seed}"


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


class Ledger:
    """``results.jsonl`` and ``run.json`` of one output folder, for one preset fingerprint.

    Opening it reads the rows already there: it refuses rows of another fingerprint, drops
    a half-written last row (a run killed mid-write) and ends a last row that lacks its
    newline with one, so the next row is not glued to it.
    """

    def __init__(self, out: pathlib.Path, settings: str):
        self.out = pathlib.Path(out)
        self.settings = settings
        self.results_path = self.out / "results.jsonl"
        self.run_json = self.out / "run.json"
        self._done = self._read()

    def _read(self) -> set:
        path = self.results_path
        if not path.exists():
            return set()
        text = path.read_text()
        lines = text.splitlines()
        rows = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i != len(lines) - 1:
                    raise ValueError(f"{path} line {i + 1} is not JSON; remove it or use another --out") from None
                path.write_text("".join(f"{kept}\n" for kept in lines[:-1]))  # killed mid-write
                text = None
        if text and not text.endswith("\n"):
            with path.open("a") as results:
                results.write("\n")
        foreign = {row.get("settings") for row in rows} - {self.settings}
        if foreign:
            raise ValueError(
                f"{path} holds results made with other settings ({sorted(map(str, foreign))}, now "
                f"{self.settings}); choose another --out, or delete that folder to start over"
            )
        return {(row["task"], row["encoding"], row["seed"], row["length"]) for row in rows}

    def done(self, task: str, label: str, seed: int, length: int) -> bool:
        return (task, label, seed, int(length)) in self._done

    def write(self, row: dict) -> None:
        """Appends one row (with this ledger's fingerprint) and flushes it to disk."""
        row = {**row, "settings": self.settings}
        with self.results_path.open("a") as results:
            results.write(json.dumps(row) + "\n")
        self._done.add((row["task"], row["encoding"], row["seed"], row["length"]))

    def start_record(self, preset, **extra) -> dict:
        """The run record: the preset, provenance and ``extra``, with the cells of earlier sittings."""
        record = {"preset": dataclasses.asdict(preset), **extra, **provenance(), "settings": self.settings}
        record["cells"] = []
        if self.run_json.exists():
            record["cells"] = json.loads(self.run_json.read_text()).get("cells", [])
        return record

    def save_record(self, record: dict) -> None:
        """Writes ``run.json``, listing every commit that made a row of ``results.jsonl``."""
        commits = {}
        if self.results_path.exists():
            for line in self.results_path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    key = (row.get("commit"), row.get("dirty"))
                    commits[key] = commits.get(key, 0) + 1
        record["commits"] = [
            {"commit": commit, "dirty": dirty, "rows": rows}
            for (commit, dirty), rows in sorted(commits.items(), key=str)
        ]
        self.run_json.write_text(json.dumps(record, indent=1))
