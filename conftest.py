"""Doctest namespace: docstring examples may use ``jnp`` and ``np`` without importing them."""

import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace["jnp"] = jnp
    doctest_namespace["np"] = np


@pytest.fixture(autouse=True)
def _doctest_flax_names(doctest_namespace):
    from flax import nnx

    doctest_namespace["nnx"] = nnx


@pytest.fixture(autouse=True)
def _doctest_jax(doctest_namespace):
    import jax

    doctest_namespace["jax"] = jax
