"""The accelerator queue (posenc_jax/bench/queue.py, `posenc-bench queue`) on the CPU: a tiny queue
of 2 encodings x 1 task x 2 seeds runs unit by unit, skips what is done, keeps to its budget and
lists its plan; and the real queue is the issue's, its folders free of rows of other settings."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from posenc_jax.bench import queue
from posenc_jax.bench.cli import main
from posenc_jax.bench.presets import H200_ESTIMATE, PRESETS, expected_seconds

TINY = dataclasses.replace(
    PRESETS["smoke"],
    name="tiny-queue",
    encodings=("nope", "alibi"),
    tasks=("counting_copy",),
    seeds=(0,),
    model_dim=16,
    num_heads=2,
    mlp_dim=32,
    steps=4,
    batch_size=8,
    train_length=4,
    eval_lengths=(2, 4, 6),
    eval_examples=8,
    checkpoint_every=4,  # one checkpoint and one check a unit: orbax and the check's compilation cost seconds
    check_every=4,
    check_examples=8,
)
ENTRY = queue.Entry(
    name="tiny",
    preset="tiny-queue",
    folder="extrapolation-tiny",
    tasks=("counting_copy",),
    encodings=("nope", "alibi"),
    seeds=(0, 1),
    why="a test",
)
UNITS = [(encoding, seed) for seed in (0, 1) for encoding in ("nope", "alibi")]  # seed by seed


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    monkeypatch.setitem(PRESETS, "tiny-queue", TINY)
    monkeypatch.setattr(queue, "QUEUE", (ENTRY,))
    return tmp_path


def _rows(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def _queue(root, *args) -> int:
    """The queue one seed a unit (--unit-seconds 0), as on a device where a cell's seeds do not fit together."""
    return main(["queue", "--root", str(root), "--no-progress", "--no-plots", "--unit-seconds", "0", *args])


def test_list_prints_every_pending_unit_and_an_estimate(tiny, capsys):
    assert _queue(tiny, "--list", "--device", "cpu") == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^   counting_copy (\w+) seed (\d) +about (\d+)s$", out, re.M)
    assert [(encoding, int(seed)) for encoding, seed, _ in listed] == UNITS
    assert all(int(seconds) > 0 for _, _, seconds in listed)  # the CPU fit's 18 s a cell, at least
    assert re.search(r"1\. tiny -> .*extrapolation-tiny \(preset tiny-queue, settings \w{12}\): 4 units pending", out)
    assert re.search(r"^total: 4 units, about (\d+m)?\d+s at the 2-core CPU fit$", out, re.M)
    assert not (tiny / "extrapolation-tiny").exists()  # nothing run, nothing written
    assert _queue(tiny, "--list", "--device", "gpu") == 0
    assert "at the H200 fit" in capsys.readouterr().out


def test_budget_zero_runs_nothing_and_says_so(tiny, capsys):
    assert _queue(tiny, "--budget", "0") == 0
    out = capsys.readouterr().out
    assert re.search(r"stopping: the next unit \(tiny: counting_copy nope seed 0\) needs about \d+s .*nothing run", out)
    assert not (tiny / "extrapolation-tiny" / "results.jsonl").exists()
    with pytest.raises(SystemExit, match="--budget must be a number of seconds >= 0, got -1"):
        _queue(tiny, "--budget", "-1")
    with pytest.raises(SystemExit, match="no entry 'nothing' in the queue; entries: tiny"):
        _queue(tiny, "--only", "nothing")


@pytest.mark.slow  # the queue running a unit to its report stays in the main suite (the killed unit below)
def test_the_queue_runs_each_cell_seed_once_and_resumes(tiny, capsys):
    folder = tiny / "extrapolation-tiny"
    assert _queue(tiny) == 0
    out = capsys.readouterr().out
    ran = re.findall(r"^posenc-bench queue: done tiny: counting_copy (\w+) seed (\d) in ", out, re.M)
    assert [(encoding, int(seed)) for encoding, seed in ran] == UNITS
    assert re.search(r"left: 0 units, about 0s at the 2-core CPU fit", out)
    rows = _rows(folder)
    for encoding, seed in UNITS:
        lengths = [r["length"] for r in rows if r["encoding"] == encoding and r["seed"] == seed]
        assert sorted(lengths) == [2, 4, 6], (encoding, seed)
    assert len({r["settings"] for r in rows}) == 1
    record = json.loads((folder / "run.json").read_text())
    # The record is of the folder's run (both encodings, both seeds), not of the last unit's sitting.
    assert record["preset"]["seeds"] == [0, 1] and record["preset"]["encodings"] == ["nope", "alibi"]
    assert record["queue"]["entry"] == "tiny" and len(record["cells"]) == 4
    assert "seeds [0, 1]" in (folder / "report.md").read_text()

    before = (folder / "results.jsonl").read_bytes()
    assert _queue(tiny) == 0
    assert "nothing pending" in capsys.readouterr().out
    assert (folder / "results.jsonl").read_bytes() == before

    # A unit cut short by a kill (its last row half written) is the one unit pending.
    lines = before.decode().splitlines(keepends=True)
    assert '"alibi"' in lines[-1] and '"seed": 1' in lines[-1]
    (folder / "results.jsonl").write_text("".join(lines[:-1]) + lines[-1][:20])
    assert _queue(tiny, "--list") == 0
    assert re.search(
        r"1 units pending.*\n.*\n   counting_copy alibi seed 1 .*\ntotal: 1 units", capsys.readouterr().out
    )
    (folder / "results.jsonl").write_bytes(before)


def test_a_unit_killed_after_its_first_row_leaves_a_folder_the_report_reads(tiny, monkeypatch, capsys):
    from posenc_jax.bench import extrapolate
    from posenc_jax.bench.ledger import Ledger

    folder = tiny / "extrapolation-tiny"
    monkeypatch.setattr(queue, "QUEUE", (dataclasses.replace(ENTRY, encodings=("nope",), seeds=(0,)),))
    assert main(["queue", "--root", str(tiny), "--no-progress"]) == 0  # with the report's plots
    assert (folder / "counting_copy.png").exists() and (folder / "report.md").exists()
    settings = json.loads((folder / "run.json").read_text())["settings"]
    row = next(r for r in _rows(folder) if r["length"] == 4)

    class Killed(BaseException):
        pass

    def killed(preset, out, **kwargs):  # the runner, killed once its first row of the new unit is written
        Ledger(out, settings).write({**row, "encoding": preset.encodings[0], "seed": preset.seeds[0]})
        raise Killed

    monkeypatch.setattr(extrapolate, "run", killed)
    monkeypatch.setattr(queue, "QUEUE", (dataclasses.replace(ENTRY, encodings=("nope", "alibi"), seeds=(0,)),))
    with pytest.raises(Killed):
        _queue(tiny)
    assert not (folder / ".lock").exists()
    # run.json asked for the unit's rows before it ran, so the folder's rows are all of its run.
    from posenc_jax.bench import report

    assert "| alibi |" in report.write_report(folder, plots=False)
    capsys.readouterr()


def test_the_queue_is_the_issues_and_its_folders_hold_no_other_settings():
    assert [entry.name for entry in queue.QUEUE] == [
        "gpu-long",
        "text-claims",
        "rope-finetune",
        "cpu-full-decoder",
        "kazemnejad-long",
    ]
    entries = {entry.name: entry for entry in queue.QUEUE}
    assert entries["gpu-long"].seeds == (0, 1, 2, 3, 4)
    assert len(entries["text-claims"].seeds) >= 10 and len(entries["rope-finetune"].seeds) >= 10
    assert entries["text-claims"].encodings == PRESETS["gpu-text"].encodings
    # PI and YaRN fine-tuned, and their control, are variants of the text RoPE cell.
    text = PRESETS["gpu-text"].resolve(PRESETS["gpu-text"].task("text"))
    labels = [v.label for v in text.variants("rope", "softmax")]
    assert {"rope@ft", "rope+pi@ft", "rope+yarn@ft"} <= set(labels)
    assert entries["cpu-full-decoder"].tasks == ("copy", "duplicate", "reverse")
    plans = queue.plan(rates=H200_ESTIMATE)
    assert [found.blocked for found in plans] == [""] * len(plans)
    # The RoPE units are run once, in the first entry that has them.
    rope = {found.entry.name: found for found in plans}["rope-finetune"]
    assert set(rope.shared.values()) <= {"text-claims"}
    assert not {(str(u.folder), u.task, u.encoding, s) for u in rope.units for s in u.seeds} & set(rope.shared)
    # Every unit fits the unit limit, or is one seed; a unit's seeds are one cell's.
    for found in plans:
        assert all(u.seconds <= queue.UNIT_SECONDS or len(u.seeds) == 1 for u in found.units), found.entry.name
    # kazemnejad-long: the paper's lengths, a few minutes a unit on an H200; the paper's own size out of reach.
    long = PRESETS["kazemnejad-long"]
    assert (long.train_min_length, long.train_length, long.task_format) == (4, 20, "paper")
    assert set(range(21, 41)) | {20} <= set(long.eval_lengths)
    units = {found.entry.name: found for found in plans}["kazemnejad-long"].units
    assert all(60 < unit.seconds <= queue.UNIT_SECONDS for unit in units)
    assert 40 < expected_seconds(PRESETS["paper"], H200_ESTIMATE) / 3600 < 65  # "some 40-60 H200-hours"


def test_a_cells_seeds_run_together_when_they_fit(tiny, capsys):
    """By default a unit holds as many of a cell's seeds as fit the unit limit by the estimate:
    the tiny cells' two seeds fit, so each cell is one unit and trains its seeds together."""
    folder = tiny / "extrapolation-tiny"
    # A limit below one seed's estimate splits the cells seed by seed.
    split = queue.plan((ENTRY,), tiny, H200_ESTIMATE, unit_seconds=0)[0].units
    assert [(u.encoding, u.seeds) for u in split] == [(e, (s,)) for e, s in UNITS]
    assert main(["queue", "--root", str(tiny), "--no-progress", "--no-plots", "--list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^   counting_copy (\w+) seeds 0, 1 +about", out, re.M) == ["nope", "alibi"]
    assert main(["queue", "--root", str(tiny), "--no-progress", "--no-plots"]) == 0
    ran = re.findall(
        r"^posenc-bench queue: done tiny: counting_copy (\w+) seeds 0, 1 in ", capsys.readouterr().out, re.M
    )
    assert ran == ["nope", "alibi"]
    rows = _rows(folder)
    assert {(r["encoding"], r["seed"]) for r in rows} == {(e, s) for e in ("nope", "alibi") for s in (0, 1)}
    record = json.loads((folder / "run.json").read_text())
    assert [cell["seeds"] for cell in record["cells"]] == [[0, 1], [0, 1]]  # one training of both seeds per cell
    with pytest.raises(SystemExit, match="--unit-seconds must be a number of seconds >= 0, got -5"):
        main(["queue", "--root", str(tiny), "--unit-seconds", "-5"])


def test_chunks_keep_the_seeds_order_within_the_limit():
    def cost(seeds):
        return 10.0 * len(seeds)

    assert queue._chunks([0, 1, 2, 3, 4], cost, 30) == [(0, 1, 2), (3, 4)]
    assert queue._chunks([0, 1, 2], cost, 0) == [(0,), (1,), (2,)]
    assert queue._chunks([], cost, 30) == []
