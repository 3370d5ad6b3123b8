"""A check that fails inside jit reaches the user as the library's own error, its message the first line.

The checks on traced values (``check_values``) raise from a host callback while the computation runs;
JAX wraps that in ``JaxRuntimeError: INTERNAL: CpuCallback error`` with the message far below. The
library's jitted entry points raise the check's own error instead (issue 56).
"""

import logging
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posenc_jax.bench.cell import SeedGroup, predict
from posenc_jax.functional.core.validation import check_values, reraise_check_errors
from posenc_jax.generation import generate
from posenc_jax.nn import Transformer, decode_step
from posenc_jax.training import make_optimizer, train_step

OUTSIDE = r"token id 8 is outside the vocabulary \[0, 8\) of this model"


def _model(seed=0):
    sizes = dict(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=16, causal=True)
    return Transformer(**sizes, rngs=nnx.Rngs(seed))


def _first_line(error: BaseException) -> str:
    """The line a user reads first: ``Type: message`` as Python prints it below the traceback."""
    return traceback.format_exception_only(error)[0].splitlines()[0]


def _seed_group():
    models = [_model(s) for s in (0, 1)]
    return SeedGroup(models, [make_optimizer(m, optax.adam(1e-3)) for m in models], batched=False)


def _batch(bad: bool, seeds: int | None = None):
    inputs = np.zeros((2, 4), np.int32)
    inputs[1, 2] = 8 if bad else 1
    batch = {"inputs": inputs, "targets": np.ones((2, 4), np.int32), "positions": np.arange(4, dtype=np.int32)}
    if seeds is None:
        return batch
    return {k: np.stack([v] * seeds) for k, v in batch.items()}


ENTRY_POINTS = {
    "decode_step": lambda bad: decode_step(_model())(
        jnp.asarray(_batch(bad)["inputs"][1:]), jnp.arange(4)[None], _model().init_cache(1, 8)
    ),
    "generate": lambda bad: generate(_model(), jnp.asarray(_batch(bad)["inputs"]), max_new_tokens=2),
    "train_step": lambda bad: train_step(
        *(lambda m: (m, make_optimizer(m, optax.adam(1e-3))))(_model()),
        {k: jnp.asarray(v) for k, v in _batch(bad).items()},
    ),
    "bench: SeedGroup.step": lambda bad: _seed_group().step(_batch(bad, seeds=2)),
    "bench: predict": lambda bad: predict(_model(), {k: jnp.asarray(v) for k, v in _batch(bad).items()}),
}


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_a_check_failing_inside_a_jitted_entry_point_raises_the_check_itself(name, capfd):
    call = ENTRY_POINTS[name]
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 step counts
        jax.block_until_ready(call(bad=False))
        capfd.readouterr()
        with pytest.raises(ValueError, match=OUTSIDE) as caught:
            jax.block_until_ready(call(bad=True))
    assert type(caught.value) is ValueError  # the library's error, not JaxRuntimeError
    assert _first_line(caught.value).startswith("ValueError: token id 8 is outside the vocabulary")
    assert "CpuCallback" not in str(caught.value) and caught.value.__suppress_context__
    # JAX's own log of the callback's traceback ("jax.debug.callback failed") is not printed above it.
    printed = capfd.readouterr()
    assert "jax.debug.callback failed" not in printed.err and "Traceback" not in printed.err, printed.err[-2000:]


def _range_check(values):
    raise ValueError(f"position {int(values.max())} is outside [0, 4); pass positions below 4")


@jax.jit
def _lookup(positions):
    check_values(_range_check, positions, within=(0, 4))
    return positions * 2


def test_a_callers_own_jit_inside_the_block_raises_the_check_and_other_errors_pass_unchanged(caplog):
    np.testing.assert_array_equal(_lookup(jnp.arange(4)), 2 * np.arange(4))
    # Outside the block, JAX's runtime error as before (it carries the message, far down).
    with caplog.at_level(logging.ERROR), pytest.raises(jax.errors.JaxRuntimeError, match="position 7 is outside"):
        jax.block_until_ready(_lookup(jnp.array([1, 7])))
    assert [r for r in caplog.records if "jax.debug.callback failed" in r.getMessage()]  # JAX logs it there
    caplog.clear()
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError) as caught, reraise_check_errors():
        jax.block_until_ready(_lookup(jnp.array([1, 9])))
    assert str(caught.value) == "position 9 is outside [0, 4); pass positions below 4"
    assert not [r for r in caplog.records if "jax.debug.callback failed" in r.getMessage()]
    # The block holds one failure per error: the same check failing again is raised again.
    with pytest.raises(ValueError, match="position 5 is outside"), reraise_check_errors():
        jax.block_until_ready(_lookup(jnp.array([5, 0])))
    # An error that is no check's passes through as it is.
    with pytest.raises(RuntimeError, match="not a check") as other, reraise_check_errors():
        raise RuntimeError("not a check")
    assert type(other.value) is RuntimeError


def test_the_block_is_a_decorator_too():
    @reraise_check_errors()
    def run(positions):
        return jax.block_until_ready(_lookup(positions))

    np.testing.assert_array_equal(run(jnp.arange(2)), [0, 2])
    with pytest.raises(ValueError, match=r"^position 4 is outside \[0, 4\)"):
        run(jnp.array([4]))
