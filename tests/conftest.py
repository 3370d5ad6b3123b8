"""Test configuration: strict dtype and rank promotion, so silent broadcasting bugs fail loudly."""

import jax
import numpy as np
import pytest

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
