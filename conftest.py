"""The suite's shared compilation cache, and the doctest namespace.

Compilation cache: the suite's processes (pytest-xdist workers, the benchmark runs and notebook
kernels the tests start) compile many of the same programs; a persistent JAX compilation cache
in one temporary folder per session, shared through the environment, compiles each once. It is
set before jax is imported, left alone if the caller set ``JAX_COMPILATION_CACHE_DIR``, and
removed when the session ends. JAX writes no entry for a program with a host callback, and every
jitted program that checks traced positions has one (``check_values``' ``jax.debug.callback``), so
the models' training and evaluation steps compile afresh in each process; what the cache saves is
the small programs (eager operations, initialisers): about a tenth of the benchmark tests' CPU time.
Doctest namespace: docstring examples may use ``jnp`` and ``np`` without importing them.
Order: tests marked ``long`` run first, so that the workers share them and finish on short ones.
"""

import os
import shutil
import tempfile

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller; xdist workers inherit its folder
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="posenc-jax-test-cache-")
    os.environ["POSENC_JAX_TEST_CACHE_OWNER"] = str(os.getpid())
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # op-by-op programs too

import jax.numpy as jnp
import numpy as np
import pytest


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: otherwise as collected


def pytest_unconfigure(config):
    if os.environ.get("POSENC_JAX_TEST_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


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
