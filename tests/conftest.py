"""Test configuration: strict dtype and rank promotion, so silent broadcasting bugs fail loudly; and
quicker compilation.

Most of the suite's time is XLA compiling many small programs. The suite compiles them with
``jax_disable_most_optimizations``, which turns off LLVM's optimisation of the generated machine code
only: XLA's own passes (fusion, layout, buffer assignment) still run, so the compiled programs' form and
their ``memory_analysis()``, which tests pin, are the ones users get, and float results do not depend on
it beyond rounding. Where the installed XLA has them, the suite also compiles with XLA:CPU's legacy fusion
emitters (``--xla_cpu_use_fusion_emitters=false``), which halves its compile time; their pipeline is not
quite the users' (scatters become loops, products round differently), so a test that reads a compiled
program's form or memory compiles with the users' emitters, and so do the children checking the library's
bitwise claims (``compiled.py``).
Both are set in the environment, so subprocesses (the notebooks' kernels, the benchmark's command line)
inherit them; ``JAX_DISABLE_MOST_OPTIMIZATIONS=0 python -m pytest`` runs the suite fully optimised with
the default emitters.
"""

import os

import jax
import numpy as np
import pytest
from compiled import choose_emitters

_quick_compile = os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1").lower() not in ("0", "false")
if _quick_compile:
    choose_emitters()

# Data and fixture modules of the tests, not tests: p_rope.py registers an encoding when imported, which
# test_contract.py does in a scratch registry only.
collect_ignore = ["p_rope.py", "bad_inputs.py"]

jax.config.update("jax_disable_most_optimizations", _quick_compile)
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
