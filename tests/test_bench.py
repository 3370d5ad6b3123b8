"""The extrapolation benchmark: smoke preset end to end, resume after a kill, bad input, tasks."""

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from posenc_jax.bench import extrapolate
from posenc_jax.bench.cli import main
from posenc_jax.tasks import DecoderTask, EncoderTask, ProbeTask, make_task, stdlib_corpus

CLI = [sys.executable, "-m", "posenc_jax.bench.cli", "extrapolate"]


def _rows(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def test_smoke_preset_writes_every_output(tmp_path):
    result = subprocess.run(
        CLI + ["--preset", "smoke", "--out", str(tmp_path), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path / "results.jsonl")
    # 3 encodings x counting_copy at 4 lengths, 3 encodings x text at 3 lengths, 3 eval-only RoPE rows x 3 lengths.
    assert len(rows) == 3 * 4 + 3 * 3 + 3 * 3
    assert {r["task"] for r in rows} == {"counting_copy", "text"}
    assert all(0.0 <= r["value"] <= 1.0 for r in rows if r["metric"] == "exact_match")
    assert all(0.0 < r["value"] < 10.0 for r in rows if r["metric"] == "bits_per_char")
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["preset"]["name"] == "smoke" and record["versions"]["jax"]
    assert all("compile_seconds" in cell and "train_seconds" in cell for cell in record["cells"])
    report = (tmp_path / "report.md").read_text()
    assert "## counting_copy" in report and "## text" in report and "published" in report
    assert (tmp_path / "counting_copy.png").stat().st_size > 1000 and (tmp_path / "text.png").exists()
    # Re-running the finished command trains and evaluates nothing again.
    again = subprocess.run(
        CLI + ["--preset", "smoke", "--out", str(tmp_path), "--no-progress", "--no-plots"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0
    assert len(_rows(tmp_path / "results.jsonl")) == len(rows)


def test_killed_run_resumes_to_the_same_results(tmp_path):
    args = [
        "--preset",
        "smoke",
        "--encodings",
        "rope",
        "--tasks",
        "counting_copy",
        "--steps",
        "400",
        "--no-progress",
        "--no-plots",
    ]
    reference = tmp_path / "uninterrupted"
    subprocess.run(CLI + args + ["--out", str(reference)], check=True, capture_output=True, timeout=600)

    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen(
        CLI + args + ["--out", str(interrupted)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    saved = lambda: [p for p in (interrupted / "checkpoints").glob("*/counting_copy/rope/seed0/*") if p.name.isdigit()]
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if saved():
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be interrupted"
    assert not (interrupted / "results.jsonl").exists()
    steps = [int(p.name) for p in saved()]
    assert steps and max(steps) < 400  # killed mid-training

    subprocess.run(CLI + args + ["--out", str(interrupted)], check=True, capture_output=True, timeout=600)
    record = json.loads((interrupted / "run.json").read_text())
    assert record["cells"][-1]["resumed_from_step"] == max(steps)
    resumed = {(r["encoding"], r["length"]): r["value"] for r in _rows(interrupted / "results.jsonl")}
    expected = {(r["encoding"], r["length"]): r["value"] for r in _rows(reference / "results.jsonl")}
    assert resumed == expected


@pytest.mark.parametrize(
    "args,message",
    [
        (["--encodings", "rope,ropee"], "unknown encodings \\['ropee'\\]; known encodings: alibi"),
        (["--tasks", "copyy"], "unknown tasks \\['copyy'\\]; known tasks: counting_copy"),
        (["--steps", "0"], "steps must be >= 1, got 0"),
        (["--eval-lengths", "2,3", "--train-length", "4"], "must reach beyond the training length 4"),
        (["--preset", "huge"], "unknown preset 'huge'; presets: smoke, cpu, cpu-full, paper"),
    ],
)
def test_bad_input_says_why(tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        main(["extrapolate", "--preset", "smoke", "--out", str(tmp_path), *args])


def test_an_unwritable_out_names_the_path_and_the_fix(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("a file where the folder should go")
    with pytest.raises(SystemExit, match=f"--out {re.escape(str(taken))} is a file, not a folder; pass a folder"):
        main(["extrapolate", "--preset", "smoke", "--out", str(taken)])
    below = taken / "results"
    with pytest.raises(SystemExit, match=f"cannot write to --out {re.escape(str(below))} .*; choose a folder you can"):
        main(["extrapolate", "--preset", "smoke", "--out", str(below)])


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_names_the_path_and_the_fix(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(SystemExit, match=f"cannot write to --out {re.escape(str(locked))} .*Permission denied"):
        main(["extrapolate", "--preset", "smoke", "--out", str(locked)])


def test_an_unreachable_hub_corpus_says_what_failed_and_how_to_use_a_local_file(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(path, name=None, **kwargs):  # what datasets raises without a network
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(SystemExit) as error:
        main(["extrapolate", "--preset", "smoke", "--tasks", "text", "--corpus", "wikitext103", "--out", str(tmp_path)])
    message = str(error.value)
    assert "could not load wikitext103 (Salesforce/wikitext) from the Hugging Face hub" in message, message
    assert "Couldn't reach 'Salesforce/wikitext' on the Hub" in message and "--corpus PATH" in message, message


def test_a_resumed_cell_with_no_steps_left_logs_no_made_up_loss(tmp_path):
    preset = dataclasses.replace(
        extrapolate.PRESETS["smoke"], encodings=("nope",), tasks=("counting_copy",), steps=2, checkpoint_every=1
    )
    first, again = [], []
    with jax.numpy_dtype_promotion("standard"):
        extrapolate.run(preset, tmp_path, progress=False, log=first.append)
        (tmp_path / "results.jsonl").unlink()  # as if killed after training, before any result was written
        extrapolate.run(preset, tmp_path, progress=False, log=again.append)
    assert re.search(r"loss \d+\.\d{3}", first[0]), first
    assert "nan" not in again[0] and "resumed at step 2 of 2, no steps left" in again[0], again
    strict = lambda constant: pytest.fail(f"run.json holds {constant}, which is not JSON")
    record = json.loads((tmp_path / "run.json").read_text(), parse_constant=strict)
    assert record["cells"][-1]["final_loss"] is None and record["cells"][-1]["resumed_from_step"] == 2


def test_each_checkpoint_records_the_cell_it_belongs_to(tmp_path):
    preset = dataclasses.replace(extrapolate.PRESETS["smoke"], encodings=("alibi",), tasks=("counting_copy",), steps=1)
    with jax.numpy_dtype_promotion("standard"):
        extrapolate.run(preset, tmp_path, progress=False, log=lambda line: None)
    (meta,) = (tmp_path / "checkpoints").glob("*/counting_copy/alibi/seed0/1/meta/metadata")
    meta = json.loads(meta.read_text())
    assert meta["config"] == {
        "settings": extrapolate.fingerprint(preset),
        "task": "counting_copy",
        "encoding": "alibi",
        "seed": 0,
        "encoding_configs": ["ALiBi(bidirectional=None)"],
    }
    assert meta["model"]["encodings"] == ["ALiBi(bidirectional=None)"] and meta["model"]["num_layers"] == 1


def test_decoder_batches_end_with_eos_and_score_exact_match():
    task = DecoderTask("reverse")
    batch = task.batch(np.random.default_rng(0), [3, 5], pad_to=task.max_tokens(6))
    assert batch["inputs"].shape == (2, task.max_tokens(6))
    for i, n in enumerate((3, 5)):
        targets = batch["targets"][i][batch["weights"][i] > 0]
        x = batch["inputs"][i][:n]
        np.testing.assert_array_equal(targets[:-1], x[::-1])
        assert targets[-1] == 13  # EOS
    perfect = np.where(batch["weights"] > 0, batch["targets"], 0)
    np.testing.assert_array_equal(task.score(perfect, batch), [1.0, 1.0])
    wrong = perfect.copy()
    wrong[1, np.flatnonzero(batch["weights"][1])[0]] += 1
    np.testing.assert_array_equal(task.score(wrong, batch), [1.0, 0.0])


@pytest.mark.parametrize("name", ["reverse_string", "bucket_sort", "parity", "missing_duplicate"])
def test_encoder_tasks_answers(name):
    task = EncoderTask(name)
    rng = np.random.default_rng(1)
    for n in (1, 4, 7):
        batch = task.batch(rng, [n])
        answer = batch["targets"][0][batch["weights"][0] > 0]
        x = batch["inputs"][0][: np.flatnonzero(batch["weights"][0])[0]]
        if name == "reverse_string":
            np.testing.assert_array_equal(answer, x[::-1])
        elif name == "bucket_sort":
            np.testing.assert_array_equal(answer, np.sort(x))
        elif name == "parity":
            assert answer[0] == x.sum() % 2
        else:
            full = x.copy()
            full[full == 2] = answer[0]
            half = len(full) // 2
            np.testing.assert_array_equal(full[:half], full[half:])


def test_probe_targets_are_positions_with_and_without_boundaries():
    for task in (ProbeTask("probe"), ProbeTask("probe_boundary", boundary=True)):
        batch = task.batch(np.random.default_rng(0), [5])
        w = batch["weights"][0] > 0
        assert np.all(batch["inputs"][0][w] == batch["inputs"][0][w][0])  # identical tokens
        np.testing.assert_array_equal(batch["targets"][0][w] - batch["targets"][0][w][0], np.arange(5))


def test_stdlib_corpus_is_fixed_and_split_by_file():
    train, test, names = stdlib_corpus()
    assert len(train) > 10 * len(test) > 0 and names == sorted(names)
    assert stdlib_corpus()[2] == names  # the same selection every time
    text = make_task("text", corpus=str(pathlib.Path(__file__)))
    assert len(text.train) > len(text.test) > 0
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        make_task("text", corpus="/no/such/path")


def test_probe_smoke_preset_writes_report_and_heat_map(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "posenc_jax.bench.cli",
            "probe",
            "--preset",
            "smoke",
            "--out",
            str(tmp_path),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path / "results.jsonl")
    labels = {r["encoding"] for r in rows}
    assert labels == {"nope", "sinusoidal", "alibi", "nope|urpe", "sinusoidal|urpe", "alibi|urpe"}
    assert {r["task"] for r in rows} == {"probe", "probe_boundary"}
    report = (tmp_path / "report.md").read_text()
    assert "| nope | softmax | no |" in report and "blind: chance 1/n" in report
    assert (tmp_path / "probe_heatmap.png").stat().st_size > 1000


def test_expected_probe_outcomes_follow_the_theorem():
    from posenc_jax.bench.probe import expected_outcome

    assert expected_outcome("nope", "softmax", False).startswith("blind")
    assert expected_outcome("alibi", "softmax", False).startswith("blind")
    assert expected_outcome("alibi", "softmax", True).startswith("solvable")
    assert expected_outcome("nope", "softmax", True).startswith("blind")  # no position-dependent logits
    assert expected_outcome("sinusoidal", "softmax", False).startswith("solvable")
    assert expected_outcome("nope", "urpe", False).startswith("solvable")
    assert expected_outcome("nope", "relu2", False).startswith("blind")
    assert expected_outcome("t5", "relu2", False).startswith("solvable")


def test_hub_corpus_loading_code_on_a_small_local_file(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from posenc_jax.tasks import load_hub_corpus, text_from_dataset

    (tmp_path / "train.txt").write_text("first line\nsecond line\n")
    (tmp_path / "valid.txt").write_text("held out\n")
    local = datasets.load_dataset(
        "text",
        data_files={"train": str(tmp_path / "train.txt"), "validation": str(tmp_path / "valid.txt")},
        cache_dir=str(tmp_path / "cache"),
    )
    train, test = text_from_dataset(local)
    assert train == "first line\nsecond line" and test == "held out"
    with pytest.raises(ValueError, match="unknown hub corpus 'wiki'; known: wikitext103, tinyshakespeare"):
        load_hub_corpus("wiki")


def test_hybrids_with_randomized_positions_run_and_are_sized_from_the_sampler(tmp_path):
    from posenc_jax.bench.extrapolate import _encodings_for

    sampler, learned = _encodings_for("randomized+learned", head_dim=8, train_tokens=12, max_tokens=42)
    assert sampler.max_length == 4 * 42 and learned.max_positions == sampler.max_length
    (rope,) = _encodings_for("rope-yarn", head_dim=8, train_tokens=12, max_tokens=48)
    assert (rope.scaling.factor, rope.scaling.original_context) == (4.0, 12)
    result = subprocess.run(
        CLI
        + [
            "--preset",
            "smoke",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--no-plots",
            "--encodings",
            "rope+randomized,learned+randomized",
            "--tasks",
            "counting_copy",
            "--steps",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path / "results.jsonl")
    assert {r["encoding"] for r in rows} == {"rope+randomized", "learned+randomized"}
    assert all(0.0 <= r["value"] <= 1.0 for r in rows)
