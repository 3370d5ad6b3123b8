"""Deprecated: the backend is read at one place, :func:`posenc_jax.functional.core.operations.current_backend`.

Forms shaped on XLA:CPU are registered for the CPU backend
(:class:`~posenc_jax.functional.core.operations.Operation`); the plain forms run on the others.
"""

from __future__ import annotations

import warnings

from posenc_jax.functional.core import operations

__all__ = ["cpu_forms"]


def cpu_forms() -> bool:
    """Deprecated: ``posenc_jax.functional.core.operations.current_backend() == "cpu"``."""
    warnings.warn(
        "posenc_jax.functional.kernels.backend.cpu_forms is deprecated: use "
        'posenc_jax.functional.core.operations.current_backend() == "cpu"',
        DeprecationWarning,
        stacklevel=2,
    )
    return operations.current_backend() == "cpu"
