"""Compiling as a user's program is compiled.

The suite runs XLA:CPU with its legacy fusion emitters where the installed XLA has them
(:func:`choose_emitters`, called by ``conftest.py``): they compile in about half the time, but their
pipeline differs from the one users get (scatters expanded into loops, other rounding). A test that reads
a compiled program's form or its memory compiles through ``compiled``, which asks for the users' emitters
for that one compilation; :func:`user_environment` is a subprocess's environment for the same (the
library's bitwise claims: seeds trained together, sharded attention against one device). Small bitwise
comparisons of one function's two forms (vmapped and per example, say) run with the suite's emitters.
"""

import os
import subprocess
import sys

_LEGACY = "--xla_cpu_use_fusion_emitters=false"
_CHOICE = "POSENC_JAX_TEST_EMITTERS"  # "legacy" or "default", inherited by xdist workers and subprocesses


def _xla_knows(flag) -> bool:
    """Whether this XLA starts with ``flag`` (an unknown flag aborts the process, so ask a child)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}  # no accelerator started for the question
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


def choose_emitters() -> None:
    """Adds the legacy emitters to ``XLA_FLAGS`` where XLA knows them; decided once, by the first process
    (pytest-xdist's workers inherit the environment), before jax starts its backend, which reads the flags.
    A user's own choice of emitters in ``XLA_FLAGS`` is left alone."""
    if _CHOICE in os.environ or "fusion_emitters" in os.environ.get("XLA_FLAGS", ""):
        return
    legacy = _xla_knows(_LEGACY)
    os.environ[_CHOICE] = "legacy" if legacy else "default"
    if legacy:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_LEGACY}".strip()


def legacy_emitters() -> bool:
    """Whether this process compiles with the legacy emitters."""
    return os.environ.get(_CHOICE) == "legacy"


def user_environment(**extra) -> dict:
    """This process's environment (and ``extra``) for a child that compiles with the users' emitters."""
    flags = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag != _LEGACY)
    return {**os.environ, "XLA_FLAGS": flags, _CHOICE: "default", **extra}


def compiled(lowered):
    """``lowered.compile()`` with the emitters users get."""
    return lowered.compile(compiler_options={"xla_cpu_use_fusion_emitters": True} if legacy_emitters() else {})
