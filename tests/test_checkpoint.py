"""Checkpoints: what a restore checks (step, model, config, arrays, checksums) and what it says."""

import json
import pathlib
import re

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from posenc_jax.checkpoint import Checkpointer, check_finite
from posenc_jax.nn import MultiHeadAttention, Transformer
from posenc_jax.training import make_optimizer

KW = dict(vocab_size=16, model_dim=16, num_layers=2, num_heads=2, mlp_dim=32, causal=True)
TOKENS = np.arange(12, dtype=np.int32).reshape(2, 6) % 16


def _model(seed=0, **settings):
    return Transformer(rngs=nnx.Rngs(seed), **{"encoding": "rope", **KW, **settings})


def _saved(path, steps=(1,), **settings):
    """A checkpointer with ``steps`` saved (model and optimizer), and the model of the last one."""
    ckpt = Checkpointer(path, max_to_keep=5)
    model = _model(**settings)
    optimizer = make_optimizer(model, optax.adam(1e-3))
    for step in steps:
        # Each step a different model, so restoring the wrong step shows.
        nnx.update(model, jax.tree.map(lambda x: x + 0.01, nnx.state(model, nnx.Param)))
        ckpt.save(step, model, optimizer)
    return ckpt, model, optimizer


def _outputs(model):
    return np.asarray(model(TOKENS, np.arange(6)))


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and len(message) < 600, message
    return message


def _arrays_as_orbax_reads_them(step_dir: pathlib.Path) -> list[np.ndarray]:
    """Every array of a step as plain orbax reads it back (each item folder, no target)."""
    arrays = []
    for item in sorted(p for p in step_dir.iterdir() if (p / "_METADATA").exists()):
        for x in jax.tree.leaves(ocp.StandardCheckpointer().restore(item)):
            is_key = jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            arrays.append(np.asarray(jax.random.key_data(x) if is_key else x))
    return arrays


def _flip_bytes(step_dir: pathlib.Path) -> None:
    """Flips 8 bytes of a saved step's array data where orbax itself then reads every array
    back without an error, but with other values: damage that only a checksum finds.

    Orbax keeps array data in OCDBT files in folders named ``d``; which file holds which array
    varies from save to save, so offsets are tried, largest file first, until a flip does that.
    """
    intact = _arrays_as_orbax_reads_them(step_dir)
    data_files = sorted(
        (p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"), key=lambda p: -p.stat().st_size
    )
    for path in data_files:
        original = path.read_bytes()
        for eighth in range(1, 8):
            data = bytearray(original)
            at = len(data) * eighth // 8
            data[at : at + 8] = bytes(b ^ 0xFF for b in data[at : at + 8])
            path.write_bytes(bytes(data))
            try:
                damaged = _arrays_as_orbax_reads_them(step_dir)
            except Exception:  # orbax noticed this one; look for one it does not
                continue
            if any(not np.array_equal(a, b, equal_nan=True) for a, b in zip(damaged, intact, strict=True)):
                return
        path.write_bytes(original)
    pytest.fail(f"no flipped bytes under {step_dir} read back silently with other values")


def test_the_model_alone_restores_from_a_checkpoint_with_its_optimizer(tmp_path):
    ckpt, model, _ = _saved(tmp_path / "ckpt", dropout_rate=0.1)  # RNG keys among the arrays
    restored = _model(seed=1, dropout_rate=0.1)
    assert ckpt.restore(restored) == 1
    np.testing.assert_array_equal(_outputs(restored), _outputs(model))
    key = lambda m: np.asarray(jax.random.key_data(m.dropout.rngs.key[...]))
    np.testing.assert_array_equal(key(restored), key(model))
    # The model and optimizer restore together as before.
    restored = _model(seed=1, dropout_rate=0.1)
    restored_opt = make_optimizer(restored, optax.adam(1e-3))
    assert ckpt.restore(restored, restored_opt) == 1
    np.testing.assert_array_equal(_outputs(restored), _outputs(model))


def test_an_optimizer_that_was_not_saved_is_an_error(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(4, _model())
    restored = _model(seed=1)
    with pytest.raises(ValueError, match="step 4 in .*ckpt holds no optimizer state") as error:
        ckpt.restore(restored, make_optimizer(restored, optax.adam(1e-3)))
    _one_line(error)


def test_a_missing_step_lists_the_steps_there(tmp_path):
    ckpt, _, _ = _saved(tmp_path / "ckpt", steps=(1, 2))
    with pytest.raises(ValueError, match=r"no step 7 in .*ckpt; its steps are \[1, 2\]") as error:
        ckpt.restore(_model(), step=7)
    _one_line(error)
    with pytest.raises(ValueError, match="no checkpoint in .*empty"):
        Checkpointer(tmp_path / "empty").restore(_model())


def test_another_layer_count_is_refused_naming_both_counts(tmp_path):
    ckpt, _, _ = _saved(tmp_path / "ckpt")
    deeper = _model(num_layers=3)
    with pytest.raises(ValueError, match="step 1 in .*ckpt") as error:
        ckpt.restore(deeper, make_optimizer(deeper, optax.adam(1e-3)), step=1)
    message = _one_line(error)
    assert "num_layers=2 there, 3 here" in message


class TwoLayers(nnx.Module):  # any NNX module checkpoints; this one does not describe itself
    def __init__(self, width):
        self.first = nnx.Linear(4, width, rngs=nnx.Rngs(0))
        self.second = nnx.Linear(width, 4, rngs=nnx.Rngs(0))


def test_another_structure_names_a_few_differing_paths_and_shapes(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(1, TwoLayers(8))
    with pytest.raises(ValueError, match="step 1 in .*ckpt: the model's arrays differ from the saved ones") as error:
        ckpt.restore(TwoLayers(6))
    message = _one_line(error)
    assert "first/kernel: (4, 8) float32 there, (4, 6) float32 here" in message

    ckpt, _, _ = _saved(tmp_path / "adam")
    model = _model(seed=1)
    with pytest.raises(ValueError, match="step 1 in .*adam: the optimizer's arrays differ") as error:
        ckpt.restore(model, make_optimizer(model, optax.sgd(1e-3, momentum=0.9)))
    message = _one_line(error)
    assert re.search(r"opt_state/0/[\w/]+: \([\d, ]*\) \w+ there, missing here", message), message
    assert re.search(r"and \d+ more", message), message


def test_another_encoding_of_the_same_shapes_is_refused_naming_both(tmp_path):
    ckpt, _, _ = _saved(tmp_path / "ckpt")  # RoPE and ALiBi have no parameters: the same arrays
    with pytest.raises(ValueError, match="step 1 in .*ckpt was saved from another model") as error:
        ckpt.restore(_model(encoding="alibi"))
    message = _one_line(error)
    assert "RoPE(base=10000.0" in message and "ALiBi(bidirectional=None)" in message


class OwnModel(nnx.Module):
    """One's own model of the library's attention (no describe()): a checkpoint of it records its encodings."""

    def __init__(self, encodings=("rope",), num_heads=2, num_kv_heads=None, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(16, 16, rngs=rngs)
        self.attention = MultiHeadAttention(num_heads, 16, num_kv_heads=num_kv_heads, encodings=encodings, rngs=rngs)

    def __call__(self, tokens):
        return self.attention(self.embed(tokens), causal=True)


def test_ones_own_model_is_refused_a_checkpoint_of_other_encodings_or_heads_of_the_same_shapes(tmp_path):
    ckpt = Checkpointer(tmp_path / "own")
    saved = OwnModel()
    ckpt.save(1, saved)
    meta = json.loads((tmp_path / "own" / "1" / "meta" / "metadata").read_text())
    assert meta["encodings"] == {
        "attention": "MultiHeadAttention(num_heads=2, num_kv_heads=2, head_dim=8)",
        "attention/encodings/0": repr(saved.attention.encodings[0].config),
    }
    # RoPE and NoPE, xPos, or 2 heads of 8 and 4 of 4, hold arrays of the same shapes: the layout check passes them.
    for other, named in (
        (OwnModel(encodings=()), r"attention/encodings/0=\"RoPE\(base=10000.0.*\" there, '<unset>' here"),
        (OwnModel(encodings=("xpos",)), r"attention/encodings/0=\"RoPE\(base.*\" there, \"XPos\(.*\" here"),
        (OwnModel(num_heads=4), r"attention='MultiHeadAttention\(num_heads=2, .*' there, '.*num_heads=4, "),
    ):
        before = _outputs_of(other)
        with pytest.raises(ValueError, match=r"step 1 in .*own was saved from a model with other encodings") as error:
            ckpt.restore(other)
        message = _one_line(error)
        assert re.search(named, message), message
        assert "restore into a model built with the encodings it was saved with" in message
        np.testing.assert_array_equal(_outputs_of(other), before)  # nothing changed
    fresh = OwnModel(seed=1)
    assert ckpt.restore(fresh) == 1
    np.testing.assert_array_equal(_outputs_of(fresh), _outputs_of(saved))


def _outputs_of(model):
    return np.asarray(model(TOKENS[:1]))


def test_the_callers_config_is_recorded_and_checked(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    model = _model()
    ckpt.save(3, model, config={"settings": "abc123", "task": "copy"})
    meta = json.loads(next((tmp_path / "ckpt" / "3").rglob("metadata")).read_text())
    assert meta["config"] == {"settings": "abc123", "task": "copy"}
    assert meta["model"]["encodings"] == ["RoPE(base=10000.0, rotary_dim=None, layout='interleaved', scaling=None)"]
    assert ckpt.restore(_model(seed=1), config={"settings": "abc123", "task": "copy"}) == 3
    with pytest.raises(ValueError, match="step 3 in .*ckpt was saved with another config") as error:
        ckpt.restore(_model(seed=1), config={"settings": "fff000", "task": "copy"})
    assert "settings='abc123' there, 'fff000' here" in _one_line(error)
    with pytest.raises(ValueError, match="config must be a JSON-serialisable dict"):
        ckpt.save(4, model, config={"when": object()})


BIG = dict(model_dim=64, mlp_dim=256)  # arrays large enough that most of a data file is array values


def test_flipped_bytes_are_found_and_the_previous_intact_step_restored(tmp_path):
    ckpt, _, _ = _saved(tmp_path / "ckpt", steps=(1, 2), **BIG)
    good = _model(seed=1, **BIG)
    ckpt.restore(good, step=1)
    _flip_bytes(tmp_path / "ckpt" / "2")

    with pytest.raises(
        ValueError, match="step 2 in .*ckpt is damaged: .* model array.* differ from the sha256"
    ) as error:
        ckpt.restore(_model(seed=1, **BIG), step=2)
    _one_line(error)
    restored = _model(seed=1, **BIG)
    restored_opt = make_optimizer(restored, optax.adam(1e-3))
    with pytest.warns(UserWarning, match=re.escape("skipped damaged checkpoint step 2 in")):
        assert ckpt.restore(restored, restored_opt) == 1
    np.testing.assert_array_equal(_outputs(restored), _outputs(good))

    # Training on from step 1 saves step 2 again, in place of the damaged one.
    ckpt.save(2, restored, restored_opt)
    again = _model(seed=2, **BIG)
    assert ckpt.restore(again, step=2) == 2
    np.testing.assert_array_equal(_outputs(again), _outputs(restored))


def test_every_step_damaged_is_an_error_naming_them(tmp_path):
    ckpt, _, _ = _saved(tmp_path / "ckpt", steps=(1, 2), **BIG)
    for step in (1, 2):
        _flip_bytes(tmp_path / "ckpt" / str(step))
    with pytest.raises(ValueError, match="no intact checkpoint in .*ckpt: step 2 .*; step 1 ") as error:
        ckpt.restore(_model(**BIG))
    _one_line(error)


def test_transformer_describes_its_settings_as_json():
    description = _model(encoding=["rope", "t5"], dropout_rate=0.1).describe()
    assert json.loads(json.dumps(description)) == description
    assert description["num_layers"] == 2 and description["dropout_rate"] == 0.1
    assert description["encodings"][1].startswith("T5Config(")
    assert description["normalizer"] == "softmax"


def test_a_process_local_checkpoint_restores_the_same_model(tmp_path):
    # Each host of a benchmark run over several hosts saves alone (host arrays, no other process taking part).
    ckpt = Checkpointer(tmp_path / "ckpt", process_local=True)
    model = _model(dropout_rate=0.1)  # RNG keys among the arrays
    ckpt.save(3, model, make_optimizer(model, optax.adam(1e-3)))
    restored = _model(seed=1, dropout_rate=0.1)
    assert ckpt.restore(restored, make_optimizer(restored, optax.adam(1e-3))) == 3
    np.testing.assert_array_equal(_outputs(restored), _outputs(model))
    key = lambda m: np.asarray(jax.random.key_data(m.dropout.rngs.key[...]))
    np.testing.assert_array_equal(key(restored), key(model))
    assert isinstance(restored.embed.embedding[...], jax.Array)


# --- issue 56: a folder, whole steps, and parameters that are finite ---------------------------------


def _poisoned(model):
    """``model`` with 2 NaNs in block 0's query kernel and an inf in the embedding table."""
    model.blocks[0].attention.query.kernel[...] = model.blocks[0].attention.query.kernel[...].at[0, 0, :2].set(np.nan)
    model.embed.embedding[...] = model.embed.embedding[...].at[3, 0].set(np.inf)
    return model


def test_a_file_is_not_a_checkpoint_folder(tmp_path):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"not a folder")
    for path in (file, file / "ckpt"):
        with pytest.raises(ValueError, match=r"weights.bin is a file, not a folder; give a folder") as error:
            Checkpointer(path)
        _one_line(error)


@pytest.mark.parametrize(
    "step, error, message",
    [
        (-1, ValueError, r"step must be an integer >= 0, got -1"),
        (2.5, TypeError, r"step must be an integer >= 0, got 2.5"),
        (True, TypeError, r"step must be an integer >= 0, got True"),
        ("3", TypeError, r"step must be an integer >= 0, got '3'"),
    ],
)
def test_a_step_that_is_not_a_whole_number_from_0_is_refused(tmp_path, step, error, message):
    ckpt = Checkpointer(tmp_path / "ckpt")
    with pytest.raises(error, match=message):
        ckpt.save(step, _model())
    with pytest.raises(error, match=message):
        ckpt.restore(_model(), step=step)
    assert ckpt.all_steps() == []


def test_check_finite_names_the_arrays_that_hold_nan_or_inf():
    check_finite(_model())  # a fresh model passes
    model = _poisoned(_model())
    with pytest.raises(ValueError, match=r"the model holds NaN or inf in 2 of 29 arrays") as error:
        check_finite(model)
    message = _one_line(error)
    assert "blocks/0/attention/query/kernel (2 NaN of 256)" in message
    assert "embed/embedding (1 inf of 256)" in message
    with pytest.raises(ValueError, match=r"the state holds NaN or inf in 2 of 29 arrays: blocks/0/attention/query"):
        check_finite(nnx.state(model), what="the state")
    with pytest.raises(TypeError, match=r"check_finite reads concrete arrays; call it outside jit"):
        jax.jit(lambda state: check_finite(state))(nnx.to_pure_dict(nnx.state(model)))


def test_a_step_with_nan_or_inf_is_refused_naming_the_arrays_and_the_step(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(2, _model())
    diverged = _poisoned(_model())
    ckpt.save(3, diverged, make_optimizer(diverged, optax.adam(1e-3)))
    fresh = _model(seed=1)
    before = _outputs(fresh)
    with pytest.raises(ValueError, match=r"step 3 in .*ckpt holds NaN or inf in 2 of 29 model arrays") as error:
        ckpt.restore(fresh)  # the newest step: not skipped for an earlier one, and nothing loaded
    message = _one_line(error)
    assert "blocks/0/attention/query/kernel (2 NaN of 256)" in message and "step=2" in message
    np.testing.assert_array_equal(_outputs(fresh), before)
    assert ckpt.restore(fresh, step=2) == 2
    assert ckpt.restore(fresh, step=3, allow_nonfinite=True) == 3
    assert np.isnan(np.asarray(fresh.blocks[0].attention.query.kernel[...])).sum() == 2


def test_fit_stops_at_a_diverged_loss_and_saves_nothing_of_it(tmp_path):
    from posenc_jax.training import TrainingDiverged, fit

    ckpt = Checkpointer(tmp_path / "ckpt")
    model = _model()
    optimizer = make_optimizer(model, optax.adam(1e-3))
    batch = {"inputs": TOKENS[:, :-1], "targets": TOKENS[:, 1:], "positions": np.arange(5)}
    losses = iter([0.5, 0.4, float("nan"), 0.3])  # a step function whose third loss is NaN
    with pytest.raises(TrainingDiverged) as caught:
        fit(
            model,
            optimizer,
            [batch] * 4,
            steps=4,
            log=None,
            step_fn=lambda *_: next(losses),
            checkpointer=ckpt,
            checkpoint_every=2,
        )
    message = _one_line(caught)
    assert "the loss is nan at step 3 of 4" in message and "the last checkpoint is step 2" in message
    assert ckpt.all_steps() == [2]  # step 4 (a NaN loss read before its save) was not saved

    logged = iter([0.5, float("inf")])
    with pytest.raises(TrainingDiverged, match=r"the loss is inf at step 2 of 2.*no checkpoint was saved"):
        fit(model, optimizer, [batch] * 2, steps=2, log=lambda line: None, log_every=1, step_fn=lambda *_: next(logged))
