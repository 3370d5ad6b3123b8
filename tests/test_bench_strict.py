"""No results folder mixes runs: one writer per folder, rows checked when read, a diverged cell
stops the run, a full disk leaves the rows readable, a damaged checkpoint says one line."""

import dataclasses
import errno
import json
import os
import re
import subprocess
import sys

import jax
import pytest

from posenc_jax.bench import extrapolate, ledger, presets, results
from posenc_jax.bench.cli import main
from posenc_jax.bench.ledger import FolderLock, Ledger

ROW = {"task": "counting_copy", "encoding": "rope", "seed": 0, "length": 8, "value": 1.0, "settings": "abc"}


def _one_line(message: str) -> str:
    assert "\n" not in message and len(message) < 700, message
    return message


def _folder(tmp_path, rows, record=None):
    """A results folder of ``rows`` (dicts, or strings written as they are) and a run.json."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    (tmp_path / "results.jsonl").write_text("".join(line + "\n" for line in lines))
    preset = dataclasses.asdict(presets.PRESETS["smoke"])
    record = {"preset": preset, "settings": "abc", "asked": {"counting_copy": ["rope"]}} if record is None else record
    (tmp_path / "run.json").write_text(json.dumps(record))
    return tmp_path


# 1. One writer per folder.


def test_a_live_lock_is_refused_naming_the_folder_and_pid_and_a_dead_one_taken_over(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"pid": sleeper.pid, "host": __import__("socket").gethostname(), "started": "2025-01-01T00:00:00"}
        (tmp_path / ".lock").write_text(json.dumps(lock))
        with pytest.raises(
            ValueError,
            match=rf"--out {re.escape(str(tmp_path))} is being written by another run "
            rf"\(pid {sleeper.pid}, since 2025-01-01",
        ):
            FolderLock(tmp_path).acquire()
        # Through the command: one line, before anything is trained.
        with pytest.raises(SystemExit, match=rf"posenc-bench extrapolate: --out .* pid {sleeper.pid}") as error:
            main(["extrapolate", "--preset", "smoke", "--out", str(tmp_path), "--no-progress", "--no-plots"])
        _one_line(str(error.value))
        assert not (tmp_path / "checkpoints").exists()
        # Another host's lock cannot be checked from here: refused, naming the host.
        (tmp_path / ".lock").write_text(json.dumps({**lock, "host": "elsewhere"}))
        with pytest.raises(ValueError, match="pid .* on host elsewhere"):
            FolderLock(tmp_path).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    (tmp_path / ".lock").write_text(json.dumps(lock))  # its pid is gone now
    stale = rf"taking over the stale lock .*\(pid {sleeper.pid} is no longer running\)"
    with pytest.warns(UserWarning, match=stale), FolderLock(tmp_path):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert not (tmp_path / ".lock").exists()


def test_the_lock_is_released_on_an_exception_and_a_second_writer_in_process_refused(tmp_path):
    with pytest.raises(KeyboardInterrupt), FolderLock(tmp_path):
        with pytest.raises(ValueError, match=rf"pid {os.getpid()}"):
            FolderLock(tmp_path).acquire()
        raise KeyboardInterrupt
    assert not (tmp_path / ".lock").exists()
    (tmp_path / ".lock").write_text("garbage")  # unreadable: taken over
    with pytest.warns(UserWarning, match="cannot be read"), FolderLock(tmp_path):
        pass


def test_two_processes_on_one_folder(tmp_path):
    code = (
        "import sys, time; from posenc_jax.bench.ledger import FolderLock\n"
        "with FolderLock(sys.argv[1]):\n    print('held', flush=True); time.sleep(30)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert first.stdout.readline().strip() == "held"
        second = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env)
        assert second.returncode != 0 and f"pid {first.pid}" in second.stderr.splitlines()[-1]
    finally:
        first.kill()
        first.wait()


# 2. Rows checked when read.


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["not json", ROW], r"line 1 is not JSON \('not json'\); delete that line"),
        ([[1, 2]], r"line 1 is a JSON array, not an object"),
        ([{k: v for k, v in ROW.items() if k != "value"}], r"line 1 lacks value"),
        ([{"foo": 1}], r"line 1 lacks task, encoding, seed, length, value"),
        ([{**ROW, "length": "8"}], r"line 1 has length '8', a string, where an integer belongs"),
        ([ROW, ROW], r"line 2 repeats line 1 \(task counting_copy, encoding rope, seed 0, length 8\) with the same"),
        ([ROW, {**ROW, "value": 0.5}], r"line 2 repeats line 1 .* another value \(1.0 there, 0.5 here\)"),
        ([ROW, {**ROW, "seed": 1, "settings": "xyz"}], r"line 2 was made with settings 'xyz', but .*run.json records"),
        ([ROW, {**ROW, "encoding": "alibi"}], r"line 2 is a row of alibi on counting_copy, which the run .* did not"),
        ([{**ROW, "task": "parity"}], r"line 1 is a row of rope on parity"),
        ([ROW, '{"task": "counting'], r"line 2 is not JSON \('\{\"task\": \"counting'\); delete that line"),
    ],
)
def test_a_row_that_is_not_this_runs_is_an_error_naming_file_and_line(tmp_path, lines, message):
    _folder(tmp_path, lines)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "results.jsonl")) + " " + message) as error:
        results.read(tmp_path)
    _one_line(str(error.value))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.unlink(), r"no run.json in .*; run the command that made"),
        (lambda p: p.write_text("{garbage"), r"run.json is not JSON \(.*\), not the run record"),
        (lambda p: p.write_text("[1]"), r"run.json holds a JSON array, not the run record"),
        (lambda p: p.write_text("{}"), r"run.json has no preset"),
        (lambda p: (p.unlink(), p.mkdir()), r"run.json is a folder, not the run record"),
    ],
)
def test_a_missing_or_garbage_run_json_is_one_clear_error(tmp_path, damage, message):
    _folder(tmp_path, [ROW])
    damage(tmp_path / "run.json")
    with pytest.raises(ValueError, match=message) as error:
        results.read(tmp_path)
    _one_line(str(error.value))


def test_rows_of_every_sitting_are_accepted_and_an_older_record_falls_back_to_its_preset(tmp_path):
    rows = [ROW, {**ROW, "encoding": "rope+pi@eval"}, {**ROW, "encoding": "alibi|l2"}]
    record = {"preset": {"tasks": ["counting_copy"], "encodings": ["rope", "alibi"], "normalizers": ["softmax", "l2"]}}
    _folder(tmp_path, rows, {**record, "settings": "abc"})
    assert len(results.read(tmp_path).rows) == 3
    _folder(tmp_path, [*rows, {**ROW, "encoding": "t5"}], {**record, "settings": "abc"})
    with pytest.raises(ValueError, match="line 4 is a row of t5"):
        results.read(tmp_path)


def test_the_ledger_on_resume_says_the_same_and_still_drops_a_cut_last_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "value": 0.0}) + "\n")
    with pytest.raises(ValueError, match=r"results.jsonl line 2 repeats line 1 .*another value"):
        Ledger(tmp_path, "abc")
    path.write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "length": "9"}) + "\n")
    with pytest.raises(ValueError, match=r"line 2 has length '9', a string"):
        Ledger(tmp_path, "abc")
    path.write_text(json.dumps(ROW) + "\n" + '{"task": "cou')
    assert Ledger(tmp_path, "abc").done("counting_copy", "rope", 0, 8) and path.read_text() == json.dumps(ROW) + "\n"
    (tmp_path / "run.json").mkdir()
    with pytest.raises(ValueError, match=r"run.json is a folder, not the run record"):
        Ledger(tmp_path, "abc").start_record(presets.PRESETS["smoke"])


# 3. A diverged cell stops the run.


def test_a_non_finite_loss_stops_the_run_with_the_cell_and_step_and_writes_no_rows(tmp_path):
    preset = dataclasses.replace(
        presets.PRESETS["smoke"], encodings=("nope",), tasks=("counting_copy",), steps=3, learning_rate=1e30
    )
    with jax.numpy_dtype_promotion("standard"), pytest.raises(ValueError) as error:
        extrapolate.run(preset, tmp_path, progress=False, log=lambda line: None)
    message = _one_line(str(error.value))
    assert re.search(r"training diverged: counting_copy / nope, seed 0: the loss is nan at step [23] of 3", message)
    assert "--learning-rate" in message
    assert not (tmp_path / "results.jsonl").exists() and not (tmp_path / ".lock").exists()
    assert not list((tmp_path / "checkpoints").glob("*/counting_copy/nope/seed0/[0-9]*"))  # no diverged state saved


# 4. A full disk.


def test_a_full_disk_names_the_file_and_leaves_the_rows_readable(tmp_path, monkeypatch):
    book = Ledger(tmp_path, "abc")
    book.write(ROW)
    real = os.write

    def full(fd, data):  # half a line reaches the disk, then it is full
        real(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ledger.os, "write", full)
    with pytest.raises(ValueError, match=r"cannot write .*results.jsonl \(No space left on device\); free space"):
        book.write({**ROW, "length": 16})
    monkeypatch.undo()
    assert [r["length"] for r in results.read_rows(tmp_path / "results.jsonl") for r in [r[1]]] == [8]

    (tmp_path / "run.json").write_text('{"preset": {}, "cells": []}')
    original = (tmp_path / "run.json").read_text()
    real_replace = os.replace
    monkeypatch.setattr(ledger.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(ValueError, match=r"cannot write .*run.json \(No space left\); free space") as error:
        book.save_record({"preset": {}, "cells": [1]})
    _one_line(str(error.value))
    monkeypatch.setattr(ledger.os, "replace", real_replace)
    assert (tmp_path / "run.json").read_text() == original  # the old record, whole
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


# 5. A damaged checkpoint: our one line, not orbax's pages.


def test_a_damaged_restore_prints_one_warning_and_no_orbax_logging(tmp_path, capfd):
    import gc
    import logging

    import optax
    from absl import logging as absl_logging
    from flax import nnx

    from posenc_jax.checkpoint import Checkpointer
    from posenc_jax.nn import Transformer
    from posenc_jax.training import make_optimizer

    settings = dict(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=32, encoding="rope")
    model = Transformer(rngs=nnx.Rngs(0), **settings)
    ckpt = Checkpointer(tmp_path / "ckpt", max_to_keep=3)
    for step in (1, 2):
        ckpt.save(step, model, make_optimizer(model, optax.adam(1e-3)))
    for manifest in (tmp_path / "ckpt" / "2" / "model").glob("**/manifest.ocdbt"):
        manifest.write_bytes(b"xx" + manifest.read_bytes()[2:])
    # Where absl logs at INFO (as a notebook or an absl app may set it), orbax logs ~20 lines here. With
    # absl's handler on the root logger, set_verbosity sets the root logger's level: all three are put back.
    # What is counted is the restore's output alone: closing the checkpointer logs at INFO (orbax's ordinary
    # chatter), which a handler another test or an import left on the root logger (absl's first log call
    # adds one when the root has none) would print.
    absl_level, root_level = logging.getLogger("absl").level, logging.root.level
    verbosity = absl_logging.get_verbosity()
    absl_logging.use_absl_handler()
    absl_logging.set_verbosity(absl_logging.INFO)
    gc.collect()  # what earlier tests left (orbax's managers) is collected before, not while, the output is read
    capfd.readouterr()
    try:
        with pytest.warns(UserWarning, match=r"skipped damaged checkpoint step 2 in .*; restored step 1") as caught:
            assert ckpt.restore(Transformer(rngs=nnx.Rngs(1), **settings)) == 1
        printed = capfd.readouterr()
    finally:
        logging.root.removeHandler(absl_logging.get_absl_handler())
        absl_logging.set_verbosity(verbosity)
        logging.getLogger("absl").setLevel(absl_level)
        logging.root.setLevel(root_level)
        ckpt.close()
    assert len((printed.out + printed.err).strip().splitlines()) <= 2, (printed.out + printed.err)[:2000]
    assert all("\n" not in str(w.message) for w in caught)


def test_bench_run_holds_the_lock_until_its_report_is_written(tmp_path, monkeypatch):
    from posenc_jax import bench
    from posenc_jax.bench import report

    seen = []
    write = report.write_report
    monkeypatch.setattr(
        report, "write_report", lambda out, **kw: (seen.append((out / ".lock").exists()), write(out, **kw))
    )
    bench.run("smoke", tmp_path, encodings=("nope",), tasks=("counting_copy",), steps=2, plots=False, log=None)
    assert seen == [True] and not (tmp_path / ".lock").exists()


# ---------------------------------------------------------------- issue 56: no silent wrong answer left


def test_a_full_disk_while_saving_a_checkpoint_says_the_path_and_the_os_error_and_leaves_no_temporary_folder(
    tmp_path, monkeypatch
):
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx

    from posenc_jax.checkpoint import Checkpointer, CheckpointError
    from posenc_jax.nn import Transformer
    from posenc_jax.training import make_optimizer

    settings = dict(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=32, encoding="rope")
    model = Transformer(rngs=nnx.Rngs(0), **settings)
    optimizer = make_optimizer(model, optax.adam(1e-3))
    ckpt = Checkpointer(tmp_path / "ckpt", max_to_keep=3)
    ckpt.save(1, model, optimizer)

    async def full(self, value, directory):  # a write inside orbax's own save path meets a full disk
        (directory / "metadata").write_text("{")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "metadata"))

    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", full)
    with pytest.raises(CheckpointError) as error:
        ckpt.save(2, model, optimizer)
    where = re.escape(str(tmp_path / "ckpt" / "2"))
    assert re.fullmatch(
        rf"cannot save {where} \(No space left on device\); free space on its disk, .*", error.value.args[0]
    )
    _one_line(str(error.value))
    assert error.value.__cause__ is None and error.value.__suppress_context__  # the cause first, not orbax's pages
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1"]  # no orbax-checkpoint-tmp folder left
    monkeypatch.undo()  # space freed: the earlier step restores and the next save works
    assert ckpt.restore(Transformer(rngs=nnx.Rngs(1), **settings)) == 1
    ckpt.save(2, model, optimizer)
    assert ckpt.all_steps() == [1, 2]
    ckpt.close()
