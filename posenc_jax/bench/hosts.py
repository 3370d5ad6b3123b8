"""One benchmark run over several hosts: each cell trained by exactly one host, the rows merged.

A run over H hosts (a TPU pod slice, a cluster of GPU machines) gives every host the same
command with ``--host i/H`` (or ``--distributed``, which reads i and H from
``jax.distributed``). The cells of the preset, in their fixed order (tasks, then encodings,
then normalisers), are dealt round the hosts: host i trains cells i, i + H, i + 2H, ... on
its own devices, into its own folder ``<out>/host-i-of-H`` (an ordinary results folder: its
own lock, ledger and checkpoints, so each host resumes on its own). No cell has two
writers. :func:`merge` then joins the hosts' folders into ``<out>`` (rows, run records,
baselines) and the report is written from all of them.

Usage on a pod slice (the same command on every host; ``<out>`` on storage they share):

    posenc-bench extrapolate --preset colab-tpu --distributed --out /shared/colab-tpu
    posenc-bench merge /shared/colab-tpu

On machines without ``jax.distributed`` (independent hosts), ``--host 0/2`` on one and
``--host 1/2`` on the other do the same. Folders of one preset's settings made any other way
(one process per cell on a shared accelerator, say) merge too when named:
``posenc-bench merge <out> <folder> <folder> ...``. Each cell of the merged record keeps the
device it ran on, and a report over several kinds of device says which cells ran where.
"""

from __future__ import annotations

import json
import pathlib
import re

from posenc_jax.bench.ledger import FolderLock, read_json, read_rows, write_json, write_text

__all__ = ["host_folder", "merge", "parse_host", "runs_here"]

_FOLDER = re.compile(r"host-(\d+)-of-(\d+)$")


def parse_host(text: str) -> tuple[int, int]:
    """``"i/H"`` as ``(i, H)``, checked: ``0 <= i < H``."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not match:
        raise ValueError(f"--host takes INDEX/COUNT, e.g. 0/4 for the first of 4 hosts; got {text!r}")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"--host {text}: the index must be in 0 .. COUNT - 1 and COUNT at least 1")
    return index, count


def runs_here(position: int, host: tuple[int, int] | None) -> bool:
    """Whether the cell at ``position`` (in the preset's fixed order) is this host's to train."""
    return host is None or position % host[1] == host[0]


def host_folder(out: pathlib.Path, host: tuple[int, int]) -> pathlib.Path:
    """Where host ``(i, H)`` writes: ``<out>/host-i-of-H``."""
    return pathlib.Path(out) / f"host-{host[0]}-of-{host[1]}"


def _device_label(record) -> str:
    """``"NVIDIA H200 x 1, jax 0.11.2"``: the device and jax of one run record."""
    device, versions = record.get("device") or {}, record.get("versions") or {}
    return f"{device.get('kind', 'unknown')} x {device.get('count', '?')}, jax {versions.get('jax', '?')}"


def merge(out: pathlib.Path, folders=None, *, partial: bool = False) -> pathlib.Path:
    """Joins the hosts' folders (default: every ``<out>/host-i-of-H``) into ``out``.

    Rows must share one settings fingerprint, and no cell's row may come from two folders
    (a ValueError names both). ``out`` gets ``results.jsonl`` (the rows of every folder, in
    folder order), ``run.json`` (the first folder's record with the cells, asked labels and
    commits of all), ``baselines.json`` (each task's from the first merged folder that holds
    it; they depend on the settings alone) and a ``hosts`` entry naming the folders. Existing
    results in ``out`` itself are refused: it is the merge's, not a run's. ``partial``: a folder
    with no finished cell yet (an interrupted run's) is left out and named in the record's
    ``unfinished`` entry, which the report states, instead of refused.
    """
    out = pathlib.Path(out)
    if folders is None:
        folders = sorted(
            (p for p in out.glob("host-*-of-*") if p.is_dir() and _FOLDER.search(p.name)),
            key=lambda p: tuple(int(g) for g in _FOLDER.search(p.name).groups()[::-1]),
        )
    folders = [pathlib.Path(f) for f in folders]
    if not folders:
        raise ValueError(f"no host folders (host-i-of-H) in {out}; run each host with --host i/H first")
    counts = {int(_FOLDER.search(f.name).group(2)) for f in folders if _FOLDER.search(f.name)}
    if len(counts) > 1:
        raise ValueError(
            f"{out} holds folders of runs over different numbers of hosts ({sorted(counts)}); a cell may then "
            f"have been trained twice: merge the folders of one run, passing them explicitly"
        )
    out.mkdir(parents=True, exist_ok=True)
    with FolderLock(out):
        if (out / "results.jsonl").exists() and not (out / "run.json").exists():
            raise ValueError(f"{out}/results.jsonl exists without run.json; move it away before merging into {out}")
        if (out / "run.json").exists() and "hosts" not in read_json(out / "run.json", "run record"):
            raise ValueError(f"{out} holds a run's own results; merge the host folders into an empty folder")
        rows, seen, settings = [], {}, set()
        records, merged, unfinished = [], [], []
        for folder in folders:
            path = folder / "results.jsonl"
            if not (folder / "run.json").exists():  # written once a cell has finished
                if partial:
                    unfinished.append(str(folder))
                    continue
                rows_there = sum(1 for line in path.read_text().splitlines() if line.strip()) if path.exists() else 0
                held = f"its {rows_there} rows are of an unfinished cell" if rows_there else "it holds no rows"
                raise ValueError(
                    f"{folder} has no finished cell yet (no run.json; {held}); pass partial=True "
                    f"(posenc-bench merge --partial) to merge the others"
                )
            for _, row in read_rows(path):
                cell = (row["task"], row["encoding"], row["seed"], row["length"])
                if cell in seen:
                    raise ValueError(f"the row {cell} is in both {seen[cell]} and {folder}; each cell has one host")
                seen[cell] = folder
                settings.add(row.get("settings"))
                rows.append(row)
            record = read_json(folder / "run.json", "run record")
            device = _device_label(record)
            for cell in record.get("cells", []):
                cell.setdefault("device", device)
            records.append(record)
            merged.append(folder)
        if not records:
            raise ValueError(f"none of the folders {[str(f) for f in folders]} has a finished cell yet")
        if len(settings) > 1:
            raise ValueError(f"the host folders hold rows of different settings {sorted(map(str, settings))}")
        record = {key: value for key, value in records[0].items() if key != "host"}  # the merge's, not host 0's
        record["cells"] = [cell for r in records for cell in r.get("cells", [])]
        asked = {}
        for r in records:
            for task, labels in (r.get("asked") or {}).items():
                asked.setdefault(task, set()).update(labels)
        record["asked"] = {task: sorted(labels) for task, labels in asked.items()}
        commits = {}
        for r in records:
            for c in r.get("commits", []):
                key = (c["commit"], c["dirty"])
                commits[key] = commits.get(key, 0) + c["rows"]
        record["commits"] = [
            {"commit": commit, "dirty": dirty, "rows": n} for (commit, dirty), n in sorted(commits.items(), key=str)
        ]
        record["hosts"] = [str(f) for f in merged]
        # The first host's field digests describe its own record, not the merged one: drop them (the merge
        # writes a new record; a run resumed into a merged folder is refused by its "hosts" field).
        record.pop("digests", None)
        if unfinished:
            record["unfinished"] = unfinished
        write_text(out / "results.jsonl", "".join(json.dumps(row) + "\n" for row in rows))  # whole or not at all
        write_json(out / "run.json", record)
        # Each folder holds the baselines of the tasks it ran; one run's settings give a task the same
        # baselines in every folder, so the first folder holding a task's gives them.
        baselines = {}
        for folder in merged:
            if (folder / "baselines.json").exists():
                for task, values in read_json(folder / "baselines.json", "baselines").items():
                    baselines.setdefault(task, values)
        if baselines:
            write_json(out / "baselines.json", baselines)
    return out
