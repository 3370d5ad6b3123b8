"""The extrapolation benchmark: end to end, resume after a kill, seeds trained together, bad input,
the ledger, the CLI, reports and plots, tasks.

Runs happen in this process (``main([...])``) wherever they can, so they share its compilations;
only the kill test needs a subprocess.
"""

import collections
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest
from compiled import legacy_emitters, user_environment
from flax import nnx

from posenc_jax.bench import cell as bench_cell
from posenc_jax.bench import costmodel, extrapolate, presets, report, results
from posenc_jax.bench.cli import main
from posenc_jax.bench.ledger import Ledger, fingerprint
from posenc_jax.bench.tasks import EOS, SEP, TASKS, DecoderTask, EncoderTask, ProbeTask, make_task, stdlib_corpus
from posenc_jax.training import train_step

CLI = [sys.executable, "-m", "posenc_jax.bench.cli", "extrapolate"]


def _rows(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def _values(path):
    return {(r["task"], r["encoding"], r["seed"], r["length"]): r["value"] for r in _rows(path)}


@pytest.fixture
def standard_promotion():
    """The benchmark runs as a user runs it, with jax's default dtype promotion."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.mark.long
@pytest.mark.slow  # CI's main job runs the same smoke preset end to end
def test_smoke_preset_writes_every_output(tmp_path, standard_promotion, capsys):
    args = ["extrapolate", "--preset", "smoke", "--encodings", "rope", "--text-lengths", "16,32"]
    args += ["--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    rows = _rows(tmp_path / "results.jsonl")
    # counting_copy at 4 lengths, text at 2 lengths, 3 eval-only RoPE rows and 4 fine-tuned ones (plain RoPE
    # and 3 scalings) x 2 lengths.
    assert len(rows) == 4 + 2 + 3 * 2 + 4 * 2
    assert {r["encoding"] for r in rows if r["encoding"].endswith("@ft")} == {
        "rope@ft",
        "rope+pi@ft",
        "rope+ntk@ft",
        "rope+yarn@ft",
    }
    assert {r["task"] for r in rows} == {"counting_copy", "text"}
    assert all(0.0 <= r["value"] <= 1.0 for r in rows if r["metric"] == "exact_match")
    assert all(0.0 < r["value"] < 10.0 for r in rows if r["metric"] == "bits_per_char")
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["preset"]["name"] == "smoke" and record["versions"]["jax"]
    assert record["versions"]["posenc_jax"] == __import__("posenc_jax").__version__
    assert all(cell["seeds"] == [0] and cell["compile_seconds"] > 0 for cell in record["cells"])
    for cell in record["cells"]:  # CPU seconds of the cell's span: at most every core of it busy
        wall = sum(cell[f"{stage}_seconds"] for stage in ("compile", "train", "checkpoint", "eval"))
        assert 0 < cell["cpu_seconds"] <= (os.cpu_count() or 1) * wall * 1.1 + 1, (cell, wall)
    printed = capsys.readouterr().out
    assert re.search(r"\[cell 1 of 2, [\dms]+ elapsed, about [\dms]+ left\] counting_copy", printed), printed
    assert "[cell 2 of 2" in printed
    report_text = (tmp_path / "report.md").read_text()
    assert "A pipeline check, not a result" in report_text and "published" not in report_text
    assert "not learned" in report_text and "*position-only (baseline)*" in report_text
    assert "| 5-gram, kneser-ney |" in report_text and json.loads((tmp_path / "baselines.json").read_text())["text"]
    assert all(r["commit"] == rows[0]["commit"] and "steps" in r for r in rows)
    assert all(set(r["buckets"]) == {"<1x", "1-2x"} for r in rows if r["task"] == "text" and r["length"] == 32)
    assert (tmp_path / "counting_copy.png").stat().st_size > 1000 and (tmp_path / "text.svg").exists()
    # Re-running the finished command trains and evaluates nothing again.
    assert main([*args, "--no-plots"]) == 0
    assert len(_rows(tmp_path / "results.jsonl")) == len(rows)
    assert len(json.loads((tmp_path / "run.json").read_text())["cells"]) == len(record["cells"])


@pytest.mark.long
@pytest.mark.slow  # resuming stays in the main suite: seeds left at different steps, test_training
def test_killed_run_resumes_to_the_same_results(tmp_path, standard_promotion):
    preset = dataclasses.replace(
        presets.PRESETS["smoke"], encodings=("rope",), tasks=("counting_copy",), steps=200, checkpoint_every=10
    )
    reference = tmp_path / "uninterrupted"
    extrapolate.run(preset, reference, progress=False, log=lambda line: None)

    interrupted = tmp_path / "interrupted"
    args = ["--preset", "smoke", "--encodings", "rope", "--tasks", "counting_copy", "--steps", "200"]
    process = subprocess.Popen(
        CLI + args + ["--no-progress", "--no-plots", "--out", str(interrupted)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
    assert steps and max(steps) < 200  # killed mid-training

    with pytest.warns(UserWarning, match="taking over the stale lock"):  # the killed run's
        record = extrapolate.run(preset, interrupted, progress=False, log=lambda line: None)
    assert record["cells"][-1]["resumed_from_step"] == max(steps)
    assert _values(interrupted / "results.jsonl") == _values(reference / "results.jsonl")


def _tiny_cell(encoding="rope+randomized", preset=None):
    preset = preset or dataclasses.replace(presets.PRESETS["smoke"], dropout_rate=0.1)
    cell = bench_cell.Cell(preset.resolve(make_task("counting_copy")), encoding, "softmax")
    configs = bench_cell.encodings_for(encoding, cell.settings.head_dim, cell.train_tokens, cell.max_tokens)
    return preset, cell, configs


def _leaves(model):
    keys = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return [np.asarray(keys(x)) for x in jax.tree.leaves(nnx.state(model))]


def _seeds_together_against_one_by_one(batched):
    preset, cell, configs = _tiny_cell()
    seeds, steps = (0, 1, 2), 4
    reference = {}
    for seed in seeds:
        model, optimizer = bench_cell.build(cell, configs, seed)
        batches = [bench_cell.train_batch(cell.settings, seed, k) for k in range(steps)]
        losses = [float(train_step(model, optimizer, batch)) for batch in batches]
        reference[seed] = (np.array(losses, np.float32), _leaves(model))
    # Not vacuous: the seeds' models differ from one another.
    assert not all(np.array_equal(a, b) for a, b in zip(reference[0][1], reference[1][1], strict=True))
    pairs = [bench_cell.build(cell, configs, seed) for seed in seeds]
    group = bench_cell.SeedGroup([m for m, _ in pairs], [o for _, o in pairs], batched=batched)
    together = []
    for k in range(steps):
        per_seed = [bench_cell.train_batch(cell.settings, seed, k) for seed in seeds]
        together.append(np.asarray(group.step({n: np.stack([b[n] for b in per_seed]) for n in per_seed[0]})))
    together = np.array(together)
    for i, seed in enumerate(seeds):
        losses, leaves = reference[seed]
        trained = _leaves(group.seed(i)[0])
        if batched:
            np.testing.assert_allclose(together[:, i], losses, rtol=2e-6, atol=1e-6)
            for a, b in zip(trained, leaves, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(together[:, i], losses)
            for a, b in zip(trained, leaves, strict=True):
                np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # seeds trained together stay in the main suite: seeds left at different steps
def test_seeds_trained_together_match_seeds_trained_one_by_one(standard_promotion):
    """Dropout and randomized positions included (both draw from the model's RNG streams).
    ``lax.map`` runs each seed's unbatched step: bitwise equal. ``vmap`` batches the seeds'
    products, which XLA rounds differently: equal to float32 rounding (a few ulps after 4 steps)."""
    _seeds_together_against_one_by_one(batched=True)
    if not legacy_emitters():
        _seeds_together_against_one_by_one(batched=False)
        return
    # Bitwise equality is a property of the compiled programs users get: checked in a child compiling with
    # XLA:CPU's default emitters (the suite's legacy ones round a loop body's products differently).
    tests = os.path.dirname(os.path.abspath(__file__))
    script = (
        f"import sys; sys.path.insert(0, {tests!r}); import jax; jax.config.update('jax_numpy_rank_promotion', "
        "'raise'); import test_bench; test_bench._seeds_together_against_one_by_one(batched=False); print('equal')"
    )  # jax's default dtype promotion, as the standard_promotion fixture gives this process
    result = subprocess.run(
        [sys.executable, "-c", script], env=user_environment(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "equal", result.stderr[-3000:]


def test_the_first_step_is_not_in_the_cells_progress_bar(tmp_path, standard_promotion):
    preset = dataclasses.replace(presets.PRESETS["smoke"], steps=5, checkpoint_every=5)
    _, cell, _ = _tiny_cell("alibi", preset)
    bars = []

    class Bar:
        def __init__(self, total, initial, description):
            self.total, self.initial, self.description, self.n = total, initial, description, initial
            bars.append(self)

        def update(self, n):
            self.n += n

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            self.closed = True

    rows = []
    todo = {0: [(None, 2)], 1: [(None, 6)]}
    records = bench_cell.train_and_evaluate(
        cell,
        [0, 1],
        todo,
        out=tmp_path,
        fingerprint="test",
        write=rows.append,
        criterion=bench_cell.Criterion(0.95, higher_is_better=True),
        bar=Bar,
    )
    (bar,) = bars
    assert (bar.total, bar.initial, bar.n, bar.closed) == (5, 1, 5, True)  # created after the first step
    assert "seeds 0,1" in bar.description
    assert [(r["seed"], r["length"]) for r in rows] == [(0, 2), (1, 6)]
    assert records[0]["seeds"] == [0, 1] and len(records[0]["final_loss"]) == 2


_TWO_SEEDS = dataclasses.replace(
    presets.PRESETS["smoke"], encodings=("nope",), tasks=("counting_copy",), seeds=(0, 1), steps=3, checkpoint_every=1
)


@pytest.fixture(scope="module")
def two_seeds_finished(tmp_path_factory):
    """A finished run of two seeds that kept its checkpoints, made once for the tests that damage copies of it."""
    folder = tmp_path_factory.mktemp("two-seeds")
    with jax.numpy_dtype_promotion("standard"):
        extrapolate.run(_TWO_SEEDS, folder, progress=False, keep_checkpoints=True, log=lambda line: None)
    return folder


@pytest.mark.parametrize(
    "lost, resumed_from",
    # Killed after seed 0 saved step 3 and before seed 1 did: both go back to step 2. Killed while
    # the first checkpoints were written (seed 1 has none): both start again from step 0.
    [("3", 2), ("", 0)],
    ids=["common step", "no common step"],
)
def test_seeds_left_at_different_steps_resume_together(
    tmp_path, two_seeds_finished, standard_promotion, lost, resumed_from
):
    preset = _TWO_SEEDS
    shutil.copytree(two_seeds_finished, tmp_path, dirs_exist_ok=True)
    first = _values(tmp_path / "results.jsonl")
    (seed1,) = (tmp_path / "checkpoints").glob("*/counting_copy/nope/seed1")
    subprocess.run(["rm", "-rf", str(seed1 / lost)], check=True)
    (tmp_path / "results.jsonl").unlink()
    record = extrapolate.run(preset, tmp_path, progress=False, log=lambda line: None)
    assert record["cells"][-1]["seeds"] == [0, 1] and record["cells"][-1]["resumed_from_step"] == resumed_from
    assert _values(tmp_path / "results.jsonl") == first


@pytest.mark.parametrize(
    "args,message",
    [
        (["--encodings", "rope,ropee"], "unknown encodings \\['ropee'\\]; known encodings: alibi"),
        (["--encodings", ","], "no encodings given; name at least one"),
        (["--tasks", ","], "no tasks given; name at least one"),
        (["--seeds", "1,1"], "seeds \\[1\\] named twice"),
        (["--tasks", "copyy"], "unknown tasks \\['copyy'\\]; known tasks: counting_copy"),
        (["--steps", "0"], "steps must be >= 1, got 0"),
        (["--eval-lengths", "2,3", "--train-length", "4"], "must include the training length 4"),
        (["--eval-lengths", "2,4", "--train-length", "4"], "must reach beyond the training length 4"),
        (["--text-lengths", "16,40"], "--text-lengths 16,40: each must be a multiple of the text context 16"),
        (["--tasks", "text", "--eval-lengths", "8,64"], "has only the text task; .* --text-lengths"),
        (
            ["--preset", "huge"],
            "unknown preset 'huge'; presets: smoke, cpu, cpu-full, cpu-long, gpu-text, gpu-long, kazemnejad, "
            "kazemnejad-long, ruoss, cope-tasks, colab-tpu, paper",
        ),
    ],
)
def test_bad_input_says_why(tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        main(["extrapolate", "--preset", "smoke", "--out", str(tmp_path), "--no-progress", "--no-plots", *args])
    assert not (tmp_path / "checkpoints").exists()


def test_a_corpus_too_small_for_the_lengths_is_refused_before_training(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("x" * 400)  # the last 10%, 40 characters, is the test split
    args = ["--preset", "smoke", "--tasks", "counting_copy,text", "--corpus", str(corpus), "--out", str(tmp_path / "o")]
    with pytest.raises(
        SystemExit, match=r"test split of the text corpus .* has 40 characters, too few for windows of 64"
    ):
        main(["extrapolate", *args, "--no-progress", "--no-plots"])
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_the_text_task_takes_its_lengths_from_text_lengths(tmp_path, standard_promotion):
    args = ["--preset", "smoke", "--encodings", "alibi", "--tasks", "text", "--text-lengths", "16,48", "--steps", "2"]
    assert main(["extrapolate", *args, "--out", str(tmp_path), "--no-progress", "--no-plots"]) == 0
    assert {r["length"] for r in _rows(tmp_path / "results.jsonl")} == {16, 48}


def test_version_help_and_a_missing_bench_extra(monkeypatch, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    version = __import__("posenc_jax").__version__
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"posenc-bench (posenc_jax) {version}"
    with pytest.raises(SystemExit):
        main(["extrapolate", "--help"])
    text = capsys.readouterr().out
    for preset in presets.PRESETS:
        assert re.search(rf"^  {preset} ", text, re.M), preset
    assert re.search(
        r"cpu-full .*\n.*25 encodings x 11 tasks x 5 seeds \(\d+ cells\); about [\d.]+ h on a 2-core", text
    )
    assert "counting_copy      decoder, exact match" in text and "transformer-xl" in text
    assert re.search(r"about \d+ min on a Colab TPU v2-8 \(not run on a TPU: the time its cells took on an H200", text)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tqdm" else real(name, *a))
    with pytest.raises(
        SystemExit, match=r'tqdm \(for the progress bars\) not installed.*\n.*pip install -e "\.\[bench\]"'
    ):
        main(["extrapolate", "--preset", "smoke", "--no-plots"])


def test_an_unwritable_out_names_the_path_and_the_fix(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("a file where the folder should go")
    with pytest.raises(SystemExit, match=f"--out {re.escape(str(taken))} is a file, not a folder; pass a folder"):
        main(["extrapolate", "--preset", "smoke", "--out", str(taken), "--no-progress", "--no-plots"])
    below = taken / "results"
    with pytest.raises(SystemExit, match=f"cannot write to --out {re.escape(str(below))} .*; choose a folder you can"):
        main(["extrapolate", "--preset", "smoke", "--out", str(below), "--no-progress", "--no-plots"])


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_out_names_the_path_and_the_fix(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(SystemExit, match=f"cannot write to --out {re.escape(str(locked))} .*Permission denied"):
        main(["extrapolate", "--preset", "smoke", "--out", str(locked), "--no-progress", "--no-plots"])


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


def test_a_resumed_cell_with_no_steps_left_logs_no_made_up_loss(tmp_path, standard_promotion):
    preset = dataclasses.replace(
        presets.PRESETS["smoke"], encodings=("nope",), tasks=("counting_copy",), steps=2, checkpoint_every=1
    )
    first, again = [], []
    extrapolate.run(preset, tmp_path, progress=False, keep_checkpoints=True, log=first.append)
    (tmp_path / "results.jsonl").unlink()  # as if killed after training, before any result was written
    extrapolate.run(preset, tmp_path, progress=False, log=again.append)
    assert re.search(r"seeds 0: 2 of 2 steps, loss \d+\.\d{3}", first[0]), first
    assert "nan" not in again[0] and "resumed at step 2 of 2, no steps left" in again[0], again
    strict = lambda constant: pytest.fail(f"run.json holds {constant}, which is not JSON")
    record = json.loads((tmp_path / "run.json").read_text(), parse_constant=strict)
    assert record["cells"][-1]["final_loss"] is None and record["cells"][-1]["resumed_from_step"] == 2


def test_each_checkpoint_records_the_cell_it_belongs_to(tmp_path, standard_promotion):
    preset = dataclasses.replace(presets.PRESETS["smoke"], encodings=("alibi",), tasks=("counting_copy",), steps=1)
    extrapolate.run(preset, tmp_path, progress=False, keep_checkpoints=True, log=lambda line: None)
    (meta,) = (tmp_path / "checkpoints").glob("*/counting_copy/alibi/seed0/1/meta/metadata")
    meta = json.loads(meta.read_text())
    assert meta["config"] == {
        "settings": fingerprint(preset),
        "task": "counting_copy",
        "encoding": "alibi",
        "seed": 0,
        "encoding_configs": ["ALiBi(bidirectional=None)"],
    }
    assert meta["model"]["encodings"] == ["ALiBi(bidirectional=None)"] and meta["model"]["num_layers"] == 1


def test_fingerprints_follow_what_shapes_a_result_and_the_method(monkeypatch):
    from posenc_jax.bench import ledger

    smoke = presets.PRESETS["smoke"]
    base = fingerprint(smoke)
    assert fingerprint(dataclasses.replace(smoke, seeds=(3, 4), eval_only_tasks=(), description="x")) == base
    for change in (
        {"blockwise_from": 64},
        {"query_init_scale": 0.1},
        {"learned_threshold": 0.9},
        {"check_every": 5},
        {"text_eval_characters": 2048},
        {"text_corpus_sha256": "0" * 64},
        {"task_overrides": (("text", (("steps", 9),)),)},
    ):
        assert fingerprint(dataclasses.replace(smoke, **change)) != base, change
    # Results of the earlier method (fixed steps, no gate) never mix with these.
    monkeypatch.setattr(ledger, "METHOD", ledger.METHOD - 1)
    assert fingerprint(smoke) != base


def test_query_init_scale_shrinks_the_initial_query_projection_and_bad_values_are_refused():
    smoke = presets.PRESETS["smoke"]
    task = make_task("probe")
    configs = bench_cell.encodings_for("nope", head_dim=16, train_tokens=8, max_tokens=16)
    plain = bench_cell.build_model(task, smoke, configs, seed=0)
    small = bench_cell.build_model(task, dataclasses.replace(smoke, query_init_scale=0.1), configs, seed=0)
    for a, b in zip(plain.blocks, small.blocks, strict=True):
        np.testing.assert_allclose(b.attention.query.kernel[...], 0.1 * a.attention.query.kernel[...], rtol=1e-6)
        np.testing.assert_array_equal(b.attention.key.kernel[...], a.attention.key.kernel[...])
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="query_init_scale must be a positive finite number"):
            dataclasses.replace(smoke, query_init_scale=bad).validate()


def test_the_ledger_repairs_a_cut_last_row_and_refuses_other_settings(tmp_path):
    row = {"task": "copy", "encoding": "nope", "seed": 0, "length": 4, "value": 1.0, "settings": "abc"}
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(row))  # the last row lacks its newline
    ledger = Ledger(tmp_path, "abc")
    assert ledger.done("copy", "nope", 0, 4) and path.read_text().endswith("}\n")
    ledger.write({**row, "length": 6})
    assert [r["length"] for r in _rows(path)] == [4, 6]
    path.write_text(path.read_text() + '{"task": "copy", "enc')  # killed mid-write
    assert not Ledger(tmp_path, "abc").done("copy", "nope", 0, 8) and len(_rows(path)) == 2
    with pytest.raises(ValueError, match=r"holds results made with other settings \(\['abc'\], now xyz\)"):
        Ledger(tmp_path, "xyz")


def test_cpu_long_evaluates_long_text_blockwise_as_the_materialising_path_would():
    long = presets.PRESETS["cpu-long"]
    assert long.text_context == 256 and long.text_context * max(long.text_multiples) == 32_768
    text = long.resolve(long.task("text"))
    assert text.implementation_at(1024) == "materialize" and text.implementation_at(2048) == "blockwise"
    from posenc_jax.nn import Transformer

    model = Transformer(
        vocab_size=16,
        model_dim=16,
        num_layers=2,
        num_heads=2,
        mlp_dim=32,
        encoding=["alibi", "shaw"],
        causal=True,
        block_q=8,
        block_k=8,
        rngs=nnx.Rngs(0),
    )
    tokens = jax.random.randint(jax.random.key(0), (2, 40), 0, 16)
    batch = {"inputs": tokens, "positions": jax.numpy.arange(40), "targets": tokens}
    want = bench_cell.predict(model, batch, implementation="materialize")
    got = bench_cell.predict(model, batch, implementation="blockwise")
    np.testing.assert_allclose(got["target_log_probs"], want["target_log_probs"], atol=1e-5)
    np.testing.assert_array_equal(got["predictions"], want["predictions"])
    with pytest.raises(ValueError, match="implementation='flash' is not one the model runs"):
        bench_cell.predict(model, batch, implementation="flash")


def test_presets_validate_and_the_colab_tpu_estimate_is_the_h200_time_of_its_cells():
    for preset in presets.PRESETS.values():
        preset.validate()
    tpu = presets.PRESETS["colab-tpu"]
    assert tpu.batch_size % 8 == 0  # the 8 cores of a v2-8 share each batch
    # The assumption, and only it: a TPU v2-8 as fast as the H200 ran this preset's own cells.
    assert presets.TPU_ESTIMATE is presets.COLAB_TPU_ON_H200
    # An upper bound (20 cells, every one to its budget) above the 9 cells that ran on the H200 (23.8 min).
    assert 40 * 60 < presets.expected_seconds(tpu, presets.TPU_ESTIMATE) < 70 * 60
    # Five seeds everywhere but the pipeline check and the long text run (its 128x evaluations cost most).
    assert all(len(p.seeds) >= 5 for name, p in presets.PRESETS.items() if name != "smoke")


def _cell_run(flops, steps, eval_flops, programs, *, rates, device="cpu", finetune_flops=0.0):
    """A measured cell whose seconds are exactly those ``rates`` give it."""
    cost = presets.Cost(1, flops, eval_flops, programs, finetune_flops=finetune_flops, train_steps=steps)
    train = steps * rates.seconds_per_step + flops / rates.train_flops_per_second
    evaluation = finetune_flops / rates.train_flops_per_second + eval_flops / rates.eval_flops_per_second
    evaluation += programs * rates.seconds_per_eval_program
    return costmodel.CellRun("run", device, "copy", "rope", cost, 4.0, train, rates.seconds_per_cell - 4.0, evaluation)


def test_fit_rates_recovers_the_rates_its_cells_were_made_with():
    rates = presets.Rates(
        train_flops_per_second=3e12,
        seconds_per_step=0.02,
        eval_flops_per_second=1e12,
        seconds_per_eval_program=1.5,
        seconds_per_cell=40.0,
    )
    cells = [
        _cell_run(2e14, 1000, 1e13, 1, rates=rates),
        _cell_run(1e14, 3000, 2e13, 31, rates=rates),
        _cell_run(5e14, 1500, 4e12, 6, rates=rates),
        # Fine-tuning is timed within evaluation and charged at the training rate; such a cell does
        # not fit evaluation's rates (its compilations would pass for evaluation's), but is predicted.
        _cell_run(3e14, 2000, 1e13, 40, rates=rates, finetune_flops=8e13),
    ]
    fit = costmodel.fit_rates(cells)
    for field in dataclasses.fields(presets.Rates):
        assert getattr(fit.rates, field.name) == pytest.approx(getattr(rates, field.name), rel=1e-6), field.name
    assert all(low == pytest.approx(1) and high == pytest.approx(1) for low, _, high in fit.spread.values())
    assert fit.predicted(cells[3]) == pytest.approx(cells[3].seconds)
    # A cell that shared its machine took longer than its model, never shorter: one that took 3x
    # (its training, as a cell beside other work does) is left out, and the rates come out as before.
    slowed = _cell_run(4e14, 2500, 1e13, 6, rates=rates)
    slowed = dataclasses.replace(slowed, train_seconds=slowed.train_seconds + 2 * slowed.seconds)  # 3x in all
    fit = costmodel.fit_rates([*cells, slowed])
    assert fit.left_out == (slowed,) and len(fit.cells) == len(cells)
    assert fit.rates.train_flops_per_second == pytest.approx(rates.train_flops_per_second, rel=1e-6)
    # Two such cells: both are left out, the slower first, then the other against a fit without either.
    slower = _cell_run(1.5e14, 1200, 2e13, 3, rates=rates)
    slower = dataclasses.replace(slower, train_seconds=slower.train_seconds + 4 * slower.seconds)  # 5x
    fit = costmodel.fit_rates([slowed, *cells, slower])
    assert fit.left_out == (slowed, slower) and len(fit.cells) == len(cells)
    assert fit.rates.seconds_per_step == pytest.approx(rates.seconds_per_step, rel=1e-6)
    assert costmodel.fit_rates([*cells, slowed], contended=4.0).left_out == ()  # within the bound: fitted
    with pytest.raises(ValueError, match=r"contended must be a multiple of the modelled seconds above 1, got 0.5"):
        costmodel.fit_rates(cells, contended=0.5)
    # A negative coefficient is no rate: where cells of more steps took less time at the same FLOPs
    # (noise, on a shared machine), the per-step cost is 0 and the FLOPs take all the time.
    noisy = dataclasses.replace(rates, seconds_per_step=-0.01)
    cells = [_cell_run(f, s, 1e13, 1, rates=noisy) for f, s in ((2e14, 3000), (4e14, 1000), (3e14, 2000))]
    fit = costmodel.fit_rates(cells)
    assert fit.rates.seconds_per_step == 0.0 and fit.spread["train"][0] < 1 < fit.spread["train"][2]
    with pytest.raises(ValueError, match=r"one device at a time, got cells of \['H200', 'cpu'\]; use fit_runs"):
        costmodel.fit_rates([*cells, dataclasses.replace(cells[0], device="H200")])


@pytest.mark.parametrize("name", sorted(costmodel.FITTED_FROM))
def test_the_rates_in_presets_are_the_fits_of_the_committed_runs(name):
    root = pathlib.Path(__file__).resolve().parents[1]
    (fit,) = costmodel.fit_runs(root / folder for folder in costmodel.FITTED_FROM[name]).values()
    written = getattr(presets, name)
    for field in dataclasses.fields(presets.Rates):  # written to 3 significant figures
        assert getattr(written, field.name) == pytest.approx(getattr(fit.rates, field.name), rel=5e-3), field.name
    assert fit.device == ("cpu" if name == "CPU_ESTIMATE" else "NVIDIA H200")


def test_the_smoke_report_says_it_is_a_check_and_the_overview_marks_what_cannot_run(tmp_path):
    rows = [
        {
            "task": task,
            "encoding": encoding,
            "seed": 0,
            "length": n,
            "metric": "accuracy",
            "value": 1.0,
            "train_length": 8,
            "in_distribution": n <= 8,
        }
        for task, encoding in (("counting_copy", "cope"), ("counting_copy", "nope"), ("parity", "nope"))
        for n in (4, 8, 12)
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.json").write_text(json.dumps({"preset": dataclasses.asdict(presets.PRESETS["smoke"])}))
    text = report.write_report(tmp_path, plots=False)
    assert "A pipeline check, not a result" in text and "published" not in text and "## Overview" not in text
    (tmp_path / "run.json").write_text(json.dumps({"preset": dataclasses.asdict(presets.PRESETS["cpu"])}))
    text = report.write_report(tmp_path, plots=False)
    assert "## Overview" in text and "published, test 21-40" in text
    table = results.summarize(tmp_path)
    assert "| cope | 1.000 (1 seed) | n/a |" in table  # CoPE has no bidirectional form for parity


def test_the_probe_heat_map_puts_softmax_first_and_marks_what_is_expected(tmp_path):
    from posenc_jax.bench import probe

    rows = [
        {"task": task, "encoding": label, "seed": 0, "length": n, "value": 0.5, "in_distribution": n <= 4}
        for label in ("alibi|urpe", "alibi", "nope|l2", "nope")
        for task in ("probe", "probe_boundary")
        for n in (4, 8)
    ]
    encodings, columns = probe._order(rows)
    assert encodings == ["alibi", "nope"] and columns[:2] == [("softmax", "probe"), ("softmax", "probe_boundary")]
    assert [c[0] for c in columns] == ["softmax", "softmax", "l2", "l2", "urpe", "urpe"]
    text = probe.write_probe_report(rows, tmp_path)
    assert text.index("| alibi | softmax | no |") < text.index("| alibi | urpe | no |")
    preset = dataclasses.asdict(probe.preset_with("smoke"))
    assert "--query-init-scale" not in probe.write_probe_report(rows, tmp_path, preset=preset)
    preset = dataclasses.asdict(probe.preset_with("smoke", steps=200))
    text = probe.write_probe_report(rows, tmp_path, preset=preset)
    assert "trained 200 steps, one seed; indicative only" in text and "pipeline check" not in text
    preset = dataclasses.asdict(probe.preset_with("smoke", query_init_scale=0.1))
    assert "initial query projection is scaled by 0.1" in probe.write_probe_report(rows, tmp_path, preset=preset)
    assert probe.heat_map(rows, tmp_path).stat().st_size > 1000
    # Several seeds: each seed's mean over n, then their mean with its 95% interval inside [0, 1]
    # (stats.bounded_interval: c = 4.303^2 * 0.04 / 3, 0.5 +- sqrt(c/4 + c^2/4) / (1 + c)).
    seeds = [dict(row, seed=s, value=v) for row in rows for s, v in ((0, 0.4), (1, 0.5), (2, 0.6))]
    text = probe.write_probe_report(seeds, tmp_path)
    assert "| alibi | softmax | no | 0.500 [0.278, 0.722] | 0.500 [0.278, 0.722] |" in text


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


def test_counting_replace_by_hand():
    # Kazemnejad et al.'s "Replace 6 with 3 in 6 6 6": the two symbols, then the first n times;
    # the answer is the second n times, then the end token.
    task = DecoderTask("counting_replace")
    np.testing.assert_array_equal(task.answer(np.array([6, 3, 6, 6, 6])), [3, 3, 3])
    rng = np.random.default_rng(2)
    batch = task.batch(rng, [1, 4], pad_to=task.max_tokens(4))
    assert batch["inputs"].shape == (2, 4 + 2 + 1 + 4)  # s t s^4 SEP t^4 (EOS is only a target)
    for i, n in enumerate((1, 4)):
        s, t, *rest = batch["inputs"][i][: n + 2]
        assert s != t and rest == [s] * n and batch["inputs"][i][n + 2] == SEP
        np.testing.assert_array_equal(batch["targets"][i][batch["weights"][i] > 0], [t] * n + [EOS])
    # Every ordered pair of distinct symbols is drawn, uniformly (90 pairs).
    pairs = collections.Counter(tuple(task._example(rng, 2)[0][:2]) for _ in range(9000))
    assert len(pairs) == 90 and all(a != b for a, b in pairs) and max(pairs.values()) < 2 * min(pairs.values())


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


def test_every_task_speaks_the_one_protocol():
    rng = np.random.default_rng(0)
    for name in TASKS:
        task = make_task(name)
        assert task.scored_on in ("predictions", "target_log_probs") and task.length_family in ("algorithmic", "text")
        lengths = task.train_lengths(rng, 8, 5)
        assert len(lengths) == 5 and min(lengths) >= 1 and max(lengths) <= 8
        batch = task.batch(rng, lengths, pad_to=task.max_tokens(8))
        assert batch["inputs"].shape == (5, task.max_tokens(8))
        perfect = np.where(batch["weights"] > 0, batch["targets"], 0)
        output = perfect if task.scored_on == "predictions" else np.zeros(perfect.shape)  # log-prob 0: certain
        np.testing.assert_allclose(task.score(output, batch), 1.0 if task.higher_is_better else 0.0)
    assert make_task("parity").chance(9) == 0.5 and make_task("probe").chance(8) == 1 / 8
    assert make_task("copy").chance(9) is None and make_task("text").chance(64) is None
    with pytest.raises(ValueError, match="length 300 needs 300 position classes but the task has 256"):
        make_task("probe").check_lengths(16, [32, 300])


def test_stdlib_corpus_is_fixed_and_split_by_file():
    train, test, names = stdlib_corpus()
    assert len(train) > 4 * len(test) > 4 * 65_536 and names == sorted(names)
    assert stdlib_corpus()[2] == names  # the same selection every time
    text = make_task("text", corpus=str(pathlib.Path(__file__)))
    assert len(text.train) > len(text.test) > 0
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        make_task("text", corpus="/no/such/path")


@pytest.mark.slow  # the probe's report and heat map stay in the main suite on made-up rows
def test_probe_smoke_preset_writes_report_and_heat_map(tmp_path, standard_promotion, capsys):
    from posenc_jax.bench.cli import main as cli

    assert cli(["probe", "--preset", "smoke", "--encodings", "alibi", "--out", str(tmp_path), "--no-progress"]) == 0
    rows = _rows(tmp_path / "results.jsonl")
    assert {r["encoding"] for r in rows} == {"alibi", "alibi|urpe"}
    assert {r["task"] for r in rows} == {"probe", "probe_boundary"}
    text = (tmp_path / "report.md").read_text()
    assert "| alibi | softmax | no |" in text and "blind: chance 1/n" in text and "pipeline check" in text
    assert {r["length"] for r in rows} == {3, 6} and "| at the longest n |" in text  # only lengths it trained on
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
    assert expected_outcome("alibi", "l2", False).startswith("mirror-blind: at most ceil(n/2)/n")
    assert expected_outcome("sandwich", "relu2", False).startswith("mirror-blind")
    assert expected_outcome("alibi", "l2", True).startswith("solvable")  # [CLS] and [SEP] differ
    assert expected_outcome("t5", "l2", False).startswith("solvable")  # T5's buckets tell i - j from j - i


def test_hub_corpus_loading_code_on_a_small_local_file(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from posenc_jax.bench.tasks import load_hub_corpus, text_from_dataset

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


def test_hybrids_with_randomized_positions_run_and_are_sized_from_the_sampler(tmp_path, standard_promotion):
    sampler, learned = bench_cell.encodings_for("randomized+learned", head_dim=8, train_tokens=12, max_tokens=42)
    assert sampler.max_length == 4 * 42 and learned.max_positions == sampler.max_length
    (rope,) = bench_cell.encodings_for("rope-yarn", head_dim=8, train_tokens=12, max_tokens=48)
    assert (rope.scaling.factor, rope.scaling.original_context) == (4.0, 12)
    args = ["--preset", "smoke", "--encodings", "rope+randomized,learned+randomized", "--tasks", "counting_copy"]
    assert main(["extrapolate", *args, "--steps", "3", "--out", str(tmp_path), "--no-progress", "--no-plots"]) == 0
    rows = _rows(tmp_path / "results.jsonl")
    assert {r["encoding"] for r in rows} == {"rope+randomized", "learned+randomized"}
    assert all(0.0 <= r["value"] <= 1.0 for r in rows)


def test_eval_only_variants_are_structured_and_sized_per_length():
    preset = presets.PRESETS["cpu-full"]
    copy = preset.resolve(preset.task("copy"))
    variants = copy.variants("rope", "softmax")
    assert [v.label for v in variants] == ["rope+pi@eval", "rope+ntk@eval", "rope+yarn@eval"]
    assert copy.variants("alibi", "softmax") == () and copy.variants("rope", "l2") == ()
    cpu = presets.PRESETS["cpu"]
    assert cpu.resolve(cpu.task("counting_copy")).variants("rope", "softmax") == ()
    yarn = variants[2].config(train_tokens=21, eval_tokens=84, head_dim=16)
    assert (yarn.scaling.factor, yarn.scaling.original_context) == (4.0, 21)


def test_a_finished_cell_leaves_no_checkpoints_unless_asked(tmp_path, standard_promotion, capsys):
    preset = dataclasses.replace(
        presets.PRESETS["smoke"], encodings=("nope", "alibi"), tasks=("counting_copy",), steps=2, checkpoint_every=1
    )
    extrapolate.run(preset, tmp_path / "a", progress=False, log=lambda line: None)
    assert not (tmp_path / "a" / "checkpoints").exists()  # nor the empty folders
    assert len(_values(tmp_path / "a" / "results.jsonl")) == 2 * len(preset.eval_lengths)
    # Kept when asked, through the CLI; it says "and plots" only when it drew them; bars only on a terminal.
    args = ["--preset", "smoke", "--encodings", "alibi", "--tasks", "counting_copy", "--steps", "2", "--no-plots"]
    main(["extrapolate", *args, "--keep-checkpoints", "--out", str(tmp_path / "b")])
    kept = {p.parts[-3] for p in (tmp_path / "b" / "checkpoints").glob("*/counting_copy/*/seed0/*") if p.name.isdigit()}
    assert kept == {"alibi"}
    printed = capsys.readouterr()
    assert "report.md in" in printed.out and "plots" not in printed.out.splitlines()[-1]
    assert "it/s" not in printed.err


def test_ctrl_c_says_in_one_line_that_running_again_resumes(monkeypatch, capsys, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(extrapolate, "run", interrupted)
    code = main(["extrapolate", "--preset", "smoke", "--no-progress", "--no-plots", "--out", str(tmp_path / "run")])
    assert code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "posenc-bench extrapolate: interrupted; the rows measured so far and the last checkpoints are kept: run the "
        "same command again to resume"
    ]


def test_the_time_left_scales_the_cost_model_of_the_cells_left_by_the_pace_so_far():
    """A short first cell (counting copy) says little of a long one (text) at its own pace: the
    time left is the model's estimate of the cells left, times measured over modelled so far."""
    cells = [types.SimpleNamespace(task_name=name) for name in ("counting_copy", "counting_copy", "text")]
    shown = extrapolate._Progress(cells, bars=False, modelled=[10.0, 10.0, 100.0])
    assert shown.finished(0, 20.0).endswith("about 3m40s left")  # twice the model: 2 x (10 + 100)
    assert shown.finished(1, 10.0).endswith("about 2m30s left")  # 30 s for 20 modelled: 1.5 x 100
    assert shown.finished(2, 150.0).endswith("about 0s left")


def test_the_readmes_preset_times_are_the_cost_models_as_help_prints_them(capsys):
    from posenc_jax.bench.cost import estimate

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z-]+)` \|.*\| ([^|]+) \|$", readme, re.M))
    assert set(presets.PRESETS) <= set(rows)
    for name, preset in presets.PRESETS.items():
        assert rows[name].startswith(estimate(preset)), (name, rows[name], estimate(preset))
    with pytest.raises(SystemExit):
        main(["extrapolate", "--help"])
    text = capsys.readouterr().out
    for preset in presets.PRESETS.values():
        assert estimate(preset) in text
