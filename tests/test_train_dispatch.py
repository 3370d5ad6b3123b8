"""Training with batches made on the device and several steps a dispatch (Preset.batches,
Preset.steps_per_dispatch), and the default path (host batches, one step a call) left as it was."""

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from posenc_jax.bench import cell as bench_cell
from posenc_jax.bench import ledger
from posenc_jax.bench.device_batches import DeviceBatches, seed_key, step_key
from posenc_jax.bench.presets import PRESETS
from posenc_jax.bench.tasks import make_task
from posenc_jax.checkpoint import Checkpointer

SEEDS = (0, 1)
HOST = dataclasses.replace(
    PRESETS["smoke"], tasks=("counting_copy",), seeds=SEEDS, steps=8, checkpoint_every=4, check_every=4
)
DEVICE = dataclasses.replace(HOST, batches="device", steps_per_dispatch=4)


@pytest.fixture
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 step counts
        yield


def _cell(preset):
    task = make_task("counting_copy", format=preset.task_format)
    return bench_cell.Cell(preset.resolve(task), "rope", "softmax")


def _configs(cell):
    return bench_cell.encodings_for(cell.encoding, cell.settings.head_dim, cell.train_tokens, cell.max_tokens)


def _run(preset, out, lengths=()):
    """Trains both seeds of the cell (resuming from checkpoints in ``out``) and evaluates them at
    ``lengths``; its record and rows."""
    rows = []
    (record,) = bench_cell.train_and_evaluate(
        _cell(preset),
        list(SEEDS),
        {seed: [(None, length) for length in lengths] for seed in SEEDS},
        out=out,
        fingerprint="test",
        write=rows.append,
        criterion=bench_cell.Criterion(0.95, higher_is_better=True),
    )
    return record, rows


def _leaves(state):
    keys = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return [np.asarray(keys(x)) for x in jax.tree.leaves(state)]


def _saved(preset, out, seed, step):
    """The leaves of seed ``seed``'s checkpoint at ``step``."""
    cell = _cell(preset)
    model, optimizer = bench_cell.build(cell, _configs(cell), seed)
    directory = ledger.checkpoint_dir(out, "test", cell.task_name, cell.label, seed)
    Checkpointer(directory).restore(model, optimizer, step)
    return _leaves(nnx.state((model, optimizer)))


def _plain_loop(preset, batch_of):
    """The seeds trained by SeedGroup.step, one call a step on ``batch_of(seed, step)``: the
    losses ``[steps, S]`` and each seed's final leaves."""
    cell = _cell(preset)
    pairs = [bench_cell.build(cell, _configs(cell), seed) for seed in SEEDS]
    group = bench_cell.SeedGroup([m for m, _ in pairs], [o for _, o in pairs])
    losses = []
    for step in range(preset.steps):
        per_seed = [batch_of(seed, step) for seed in SEEDS]
        losses.append(np.asarray(group.step({k: np.stack([b[k] for b in per_seed]) for k in per_seed[0]})))
    return np.array(losses), [_leaves(nnx.state(group.seed(i))) for i in range(len(SEEDS))]


def test_host_batches_one_step_a_call_train_exactly_as_a_plain_loop_of_host_batches(tmp_path, standard_promotion):
    """The default path, pinned: the batch of step k is train_batch(seed, k), one step a call,
    bit for bit (the runs on the CPU made before device batches resume with this code)."""
    record, _ = _run(HOST, tmp_path)
    cell = _cell(HOST)
    losses, leaves = _plain_loop(HOST, lambda seed, k: bench_cell.train_batch(cell.settings, seed, k))
    assert record["final_loss"] == [float(x) for x in losses[-1]]
    for i, seed in enumerate(SEEDS):
        for got, want in zip(_saved(HOST, tmp_path, seed, 8), leaves[i], strict=True):
            np.testing.assert_array_equal(got, want)
        checks = json.loads(bench_cell._checks_path(tmp_path, "test", cell, seed).read_text())
        assert [step for step, _ in checks] == [4, 8]


def test_device_batches_train_as_a_plain_loop_of_them_and_a_resumed_run_as_an_uninterrupted_one(
    tmp_path, standard_promotion
):
    uninterrupted = tmp_path / "uninterrupted"
    record, rows = _run(DEVICE, uninterrupted, lengths=(4,))
    assert record["steps"] == dict.fromkeys(SEEDS, 8) and record["resumed_from_step"] == 0
    # The batch of step k of a seed is make(step_key(seed_key(seed), k)), four steps a dispatch.
    cell = _cell(DEVICE)
    make = DeviceBatches(cell.task, cell.lengths, DEVICE.batch_size)
    batch_of = jax.jit(lambda seed, k: make(None, step_key(seed_key(seed), k)))
    losses, leaves = _plain_loop(DEVICE, lambda seed, k: {n: np.asarray(x) for n, x in batch_of(seed, k).items()})
    np.testing.assert_allclose(record["final_loss"], losses[-1], rtol=2e-6)  # one program, or a scan of steps
    for i, seed in enumerate(SEEDS):
        for got, want in zip(_saved(DEVICE, uninterrupted, seed, 8), leaves[i], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        checks = json.loads(bench_cell._checks_path(uninterrupted, "test", cell, seed).read_text())
        assert [step for step, _ in checks] == [4, 8]
    # Killed after the checkpoint of step 4: resumed there, it sees the same data and ends the same.
    resumed = tmp_path / "resumed"
    shutil.copytree(uninterrupted, resumed)
    for seed in SEEDS:
        shutil.rmtree(ledger.checkpoint_dir(resumed, "test", cell.task_name, cell.label, seed) / "8")
    again, rows_again = _run(DEVICE, resumed, lengths=(4,))
    assert again["resumed_from_step"] == 4 and again["final_loss"] == record["final_loss"]
    assert rows_again == rows
    for seed in SEEDS:
        for got, want in zip(_saved(DEVICE, resumed, seed, 8), _saved(DEVICE, uninterrupted, seed, 8), strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_loss_gone_non_finite_inside_a_dispatch_names_its_step_and_seed(tmp_path, monkeypatch, standard_promotion):
    train = bench_cell.SeedGroup.train

    def poisoned(self, make_batch, data, keys, first_step, steps, frozen=None):
        losses = train(self, make_batch, data, keys, first_step, steps, frozen)
        return losses.at[1, 1].set(np.nan) if first_step == 4 else losses  # step 6, seed 1

    monkeypatch.setattr(bench_cell.SeedGroup, "train", poisoned)
    with pytest.raises(bench_cell.DivergedError, match="seed 1: the loss is nan at step 6 of 8") as error:
        _run(DEVICE, tmp_path)
    assert error.value.seeds == [1] and error.value.step == 6
    cell = _cell(DEVICE)
    saved = ledger.checkpoint_dir(tmp_path, "test", cell.task_name, cell.label, 1)
    assert sorted(p.name for p in saved.iterdir() if p.name.isdigit()) == ["4"]  # nothing of the diverged state


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(batches="gpu"), "batches must be one of host, device, got 'gpu'"),
        (dict(steps_per_dispatch=0), "steps_per_dispatch must be an integer >= 1, got 0"),
        (dict(steps_per_dispatch=4), "steps_per_dispatch=4 needs batches='device'"),
        (dict(batches="device", steps_per_dispatch=3), "must divide steps.* not steps=8, check_every=4, check"),
        (dict(batches="device", tasks=("counting_copy", "probe")), "but probe have no device generator"),
    ],
)
def test_preset_refuses_bad_batches_and_dispatches_in_one_line(change, message):
    with pytest.raises(ValueError, match=message) as error:
        dataclasses.replace(HOST, **change).validate()
    assert "\n" not in str(error.value)
    dataclasses.replace(HOST, batches="device", steps_per_dispatch=2).validate()
    overridden = dataclasses.replace(DEVICE, task_overrides=(("counting_copy", (("steps", 10),)),))
    with pytest.raises(ValueError, match="not steps=10"):
        overridden.validate()


def test_the_new_settings_at_their_defaults_leave_every_fingerprint_as_it_was():
    for name, preset in PRESETS.items():
        if (preset.batches, preset.steps_per_dispatch) != ("host", 1):
            continue
        # The fingerprint as it was computed before the two settings existed.
        settings = dataclasses.asdict(preset)
        for key in (*ledger._NOT_HASHED, "batches", "steps_per_dispatch"):
            settings.pop(key)
        for key, default in (("task_format", "ours"), ("train_min_length", 1)):
            if settings[key] == default:
                settings.pop(key)
        settings["method"] = ledger.METHOD
        want = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
        assert ledger.fingerprint(preset) == want, name
    base = ledger.fingerprint(HOST)
    assert ledger.fingerprint(dataclasses.replace(HOST, batches="device")) != base
    assert ledger.fingerprint(DEVICE) != ledger.fingerprint(dataclasses.replace(DEVICE, steps_per_dispatch=2))


def test_the_accelerator_presets_make_their_batches_on_the_device():
    # Their committed folders were made under the earlier method (another fingerprint), so no rows
    # of theirs are resumed: the queue writes new folders.
    for name in ("paper", "colab-tpu", "gpu-text", "gpu-long", "kazemnejad-long"):
        assert PRESETS[name].batches == "device" and PRESETS[name].steps_per_dispatch > 1, name
    for name in ("cpu", "cpu-full", "kazemnejad"):  # CPU runs, some in progress: host batches
        assert (PRESETS[name].batches, PRESETS[name].steps_per_dispatch) == ("host", 1), name
    # A CPU run started after device batches existed (its fixed-budget rows are all of these settings).
    assert (PRESETS["ruoss"].batches, PRESETS["ruoss"].steps_per_dispatch) == ("device", 50)


MESH_SCRIPT = """
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"  # simulated CPU devices, also on a GPU machine
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from posenc_jax.bench import cell as bc
from posenc_jax.bench import seeds
from posenc_jax.bench.device_batches import DeviceBatches, seed_key
from posenc_jax.bench.presets import PRESETS
from posenc_jax.bench.tasks import make_task
from posenc_jax.training import data_parallel_mesh
assert len(jax.devices()) == 2, jax.devices()
preset = PRESETS["smoke"]
task = make_task("copy")
cell = bc.Cell(preset.resolve(task), "rope", "softmax")
configs = bc.encodings_for("rope", 16, cell.train_tokens, cell.max_tokens)
make = DeviceBatches(task, cell.lengths, preset.batch_size)
losses = {}
with jax.numpy_dtype_promotion("standard"):
    for mesh in (None, data_parallel_mesh()):
        pairs = [bc.build(cell, configs, seed) for seed in (0, 1)]
        group = bc.SeedGroup([m for m, _ in pairs], [o for _, o in pairs], mesh=mesh, batched=True)
        data, keys = group.replicate((make.data, jnp.stack([seed_key(0), seed_key(1)])))
        losses[mesh is None] = np.asarray(group.train(make, data, keys, 0, 3))
        if mesh is not None:  # the examples split over the two devices: the gradients summed across them
            text = seeds._train_steps.lower(group.graphdef, group.state, data, make, keys, jnp.int32(0), 3, True,
                                         jnp.zeros(2, bool), mesh).compile().as_text()
            assert "all-reduce" in text
np.testing.assert_allclose(losses[False], losses[True], rtol=1e-5)
print("equal", losses[True].shape)
"""


@pytest.mark.slow  # data-parallel training on 8 devices stays in the main suite (test_training)
def test_device_batches_split_over_a_data_parallel_mesh_train_as_on_one_device():
    result = subprocess.run([sys.executable, "-c", MESH_SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "equal (3, 2)" in result.stdout
