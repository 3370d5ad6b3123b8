"""Test configuration: strict dtype and rank promotion, so silent broadcasting bugs fail loudly."""

import jax
import numpy as np
import pytest

# Data and fixture modules of the tests, not tests: p_rope.py registers an encoding when imported, which
# test_contract.py does in a scratch registry only.
collect_ignore = ["p_rope.py", "bad_inputs.py"]

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a test once as written and once with the function under ``jax.jit``."""

    def wrap(fn, **jit_kwargs):
        return jax.jit(fn, **jit_kwargs) if request.param else fn

    return wrap


@pytest.fixture
def rng():
    return np.random.default_rng(0)
