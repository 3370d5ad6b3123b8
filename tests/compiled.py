"""Compiling as a user's program is compiled.

The suite runs XLA:CPU with its legacy fusion emitters (``conftest.py``): they compile in about half the
time, but their pipeline differs from the one users get (scatters expanded into loops, other rounding). A
test that reads a compiled program's form or its memory compiles through ``compiled``, which asks for the
users' emitters for that one compilation; ``USER_PIPELINE`` is the same request for ``jax.jit``'s
``compiler_options`` and ``user_environment()`` for a subprocess's (the library's bitwise claims: seeds
trained together, sharded attention against one device). Small bitwise comparisons of one
function's two forms (vmapped and per example, say) run with the suite's emitters.
"""

import os

_LEGACY = "--xla_cpu_use_fusion_emitters=false"
LEGACY_EMITTERS = os.environ.get("POSENC_JAX_TEST_EMITTERS") == "legacy"  # set by conftest.py
USER_PIPELINE = {"xla_cpu_use_fusion_emitters": True} if LEGACY_EMITTERS else {}


def user_environment(**extra) -> dict:
    """This process's environment (and ``extra``) for a child that compiles with the users' emitters."""
    flags = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag != _LEGACY)
    return {**os.environ, "XLA_FLAGS": flags, "POSENC_JAX_TEST_EMITTERS": "default", **extra}


def compiled(lowered):
    """``lowered.compile()`` with the emitters users get."""
    return lowered.compile(compiler_options=USER_PIPELINE)
