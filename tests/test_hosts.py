"""A benchmark run over several hosts: the cells dealt round them once each, the folders merged."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from posenc_jax.bench import cli, hosts
from posenc_jax.bench.extrapolate import _tasks, plan
from posenc_jax.bench.ledger import Ledger, fingerprint, read_rows
from posenc_jax.bench.presets import PRESETS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_host_argument_is_checked():
    assert hosts.parse_host("0/4") == (0, 4)
    assert hosts.parse_host(" 3 / 4 ") == (3, 4)
    for bad in ("4/4", "1", "a/b", "0/0", "-1/2"):
        with pytest.raises(ValueError, match="--host"):
            hosts.parse_host(bad)


def test_every_cell_is_dealt_to_exactly_one_host(tmp_path):
    preset = PRESETS["cpu-full"]
    tasks = _tasks(preset, None)
    ledger = Ledger(tmp_path, fingerprint(preset))
    every = [(c.task_name, c.label) for c, _ in plan(preset, tasks, ledger, log=lambda line: None)]
    for count in (1, 3, 8):
        dealt = [
            [(c.task_name, c.label) for c, _ in plan(preset, tasks, ledger, log=lambda line: None, host=(i, count))]
            for i in range(count)
        ]
        assert sorted(sum(dealt, [])) == sorted(every)  # each cell once, on one host
        assert max(map(len, dealt)) - min(map(len, dealt)) <= 1  # dealt round, not in blocks
    assert len(every) > 100


HOST = """
import sys, jax
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from posenc_jax.bench import cli
sys.exit(cli.main(["extrapolate", "--preset", "smoke", "--encodings", "nope,alibi", "--tasks", "counting_copy",
                   "--steps", "2", "--seeds", "0", "--out", sys.argv[3], "--distributed", "--no-plots",
                   "--no-progress"]))
"""


@pytest.mark.long
@pytest.mark.slow  # processes training their share and merging stay in the main suite
def test_two_hosts_write_their_own_folders_and_merge_into_one_report(tmp_path):
    # Two JAX processes of one jax.distributed job on this machine, as two hosts of a pod would be: each
    # trains its share of the cells on its own device and saves its own checkpoints (process-local).
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    hosts_run = [
        subprocess.Popen(
            [sys.executable, "-c", HOST, f"localhost:{port}", str(i), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=600)[0] for p in hosts_run]
    assert [p.returncode for p in hosts_run] == [0, 0], [log[-3000:] for log in logs]
    folders = [tmp_path / "host-0-of-2", tmp_path / "host-1-of-2"]
    cells = [{(row["task"], row["encoding"]) for _, row in read_rows(f / "results.jsonl")} for f in folders]
    # Cells in the preset's order, dealt round (the dealing itself is the test above): host 0 has the first.
    assert cells == [{("counting_copy", "nope")}, {("counting_copy", "alibi")}]

    assert cli.main(["merge", str(tmp_path), "--no-plots"]) == 0
    merged = read_rows(tmp_path / "results.jsonl")
    assert len(merged) == sum(len(read_rows(f / "results.jsonl")) for f in folders)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["hosts"] == [str(f) for f in folders] and "host" not in record
    assert len(record["cells"]) == 2 and sum(c["rows"] for c in record["commits"]) == len(merged)
    report = (tmp_path / "report.md").read_text()
    assert "alibi" in report and "nope" in report
    assert "Device: cpu x 1" in report  # one kind of device: one line

    # Folders named explicitly merge into any folder; one made on another device (here its record says
    # so) puts a line per device in the report, naming the cells each ran.
    record_1 = json.loads((folders[1] / "run.json").read_text())
    record_1["device"] = {"platform": "gpu", "kind": "NVIDIA H200", "count": 1}
    (folders[1] / "run.json").write_text(json.dumps(record_1))
    named = tmp_path / "named"
    assert cli.main(["merge", str(named), str(folders[1]), str(folders[0]), "--no-plots"]) == 0
    assert len(read_rows(named / "results.jsonl")) == len(merged)
    assert {c["device"].split(",")[0] for c in json.loads((named / "run.json").read_text())["cells"]} == {
        "cpu x 1",
        "NVIDIA H200 x 1",
    }
    devices = next(line for line in (named / "report.md").read_text().splitlines() if line.startswith("Devices"))
    assert "NVIDIA H200 x 1, jax " in devices and "counting_copy (alibi)" in devices
    assert devices.index("counting_copy (nope)") > devices.index("cpu x 1")

    # A folder that finished no cell (an interrupted run's: no rows yet, or the rows of its first cell but no
    # run.json, written once a cell finishes) is refused, or with --partial left out and named.
    empty, midway = tmp_path / "interrupted-at-start", tmp_path / "interrupted-in-its-first-cell"
    (empty / "checkpoints").mkdir(parents=True)
    midway.mkdir()
    (midway / "results.jsonl").write_text((folders[1] / "results.jsonl").read_text().splitlines()[0] + "\n")
    with pytest.raises(ValueError, match=r"at-start has no finished cell yet \(no run.json; it holds no rows\)"):
        hosts.merge(tmp_path / "partial", [folders[0], empty])
    with pytest.raises(ValueError, match="first-cell has no finished cell yet .*its 1 rows are of an unfinished"):
        hosts.merge(tmp_path / "partial", [folders[0], midway])
    partial = tmp_path / "partial"
    assert cli.main(["merge", str(partial), str(empty), str(folders[0]), str(midway), "--partial", "--no-plots"]) == 0
    record = json.loads((partial / "run.json").read_text())
    assert record["unfinished"] == [str(empty), str(midway)] and record["hosts"] == [str(folders[0])]
    assert len(read_rows(partial / "results.jsonl")) == len(read_rows(folders[0] / "results.jsonl"))
    # The baselines come from a merged folder, not from the first one named.
    baselines = json.loads((folders[0] / "baselines.json").read_text())
    assert baselines and json.loads((partial / "baselines.json").read_text()) == baselines
    report = (partial / "report.md").read_text()
    assert f"**Partial.** Merged without 2 folder(s) that had finished no cell: {empty}, {midway}" in report
    with pytest.raises(ValueError, match="none of the folders .* has a finished cell yet"):
        hosts.merge(tmp_path / "none", [empty], partial=True)

    # A cell's rows in two folders (a host run again with another count, say) are refused, naming both.
    first = (folders[0] / "results.jsonl").read_text().splitlines()[0]
    with open(folders[1] / "results.jsonl", "a") as f:
        f.write(first + "\n")
    with pytest.raises(ValueError, match="is in both .*host-0-of-2.* and .*host-1-of-2"):
        hosts.merge(tmp_path)
    # The merged folder is the merge's: a folder holding a run's own results is not merged into.
    with pytest.raises(ValueError, match="no host folders"):
        hosts.merge(folders[0])


def test_processes_train_their_share_of_the_cells_and_merge(tmp_path, capsys):
    # --processes 2: the command as --host 0/2 and 1/2 in two child processes of this machine, then merged.
    args = ["extrapolate", "--preset", "smoke", "--encodings", "nope,alibi", "--tasks", "counting_copy", "--steps", "2"]
    args += ["--seeds", "0", "--out", str(tmp_path), "--no-progress", "--no-plots", "--processes", "2"]
    assert cli.main(args) == 0
    folders = [tmp_path / "host-0-of-2", tmp_path / "host-1-of-2"]
    cells = [{row["encoding"] for _, row in read_rows(f / "results.jsonl")} for f in folders]
    assert cells == [{"nope"}, {"alibi"}]
    merged = read_rows(tmp_path / "results.jsonl")
    assert len(merged) == sum(len(read_rows(f / "results.jsonl")) for f in folders)
    assert "trained in 2 processes" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--processes must be at least 1, got 0"):
        cli.main([*args[:-1], "0"])
    with pytest.raises(SystemExit, match="does not combine with --host or --distributed"):
        cli.main([*args, "--host", "0/2"])


def test_merged_baselines_are_those_of_every_folders_tasks(tmp_path):
    # Two runs of one settings' different tasks (as `--tasks` splits them): the merge keeps the
    # baselines of both, the first folder's where both hold a task.
    folders = []
    for name, task, value in (("a", "copy", 0.1), ("b", "counting_replace", 0.2)):
        folder = tmp_path / name
        folder.mkdir()
        row = {"task": task, "encoding": "nope", "seed": 0, "length": 4, "value": 1.0, "settings": "abc"}
        (folder / "results.jsonl").write_text(json.dumps(row) + "\n")
        (folder / "run.json").write_text(json.dumps({"settings": "abc", "cells": [], "asked": {task: ["nope"]}}))
        lines = {"4": {"chance": None, "position-only": value, "content-only": 1.0}}
        both = {"lengths": {"4": {"chance": None, "position-only": value, "content-only": 0.5}}}
        (folder / "baselines.json").write_text(json.dumps({task: {"lengths": lines}, "parity": both}))
        folders.append(folder)
    merged = json.loads((hosts.merge(tmp_path / "out", folders) / "baselines.json").read_text())
    assert sorted(merged) == ["copy", "counting_replace", "parity"]
    assert merged["counting_replace"]["lengths"]["4"]["position-only"] == 0.2
    assert merged["parity"]["lengths"]["4"]["position-only"] == 0.1  # the first folder's
