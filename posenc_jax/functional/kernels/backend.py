"""Which forms a backend runs: the forms shaped on XLA:CPU are used on the CPU backend only.

A form shaped on XLA:CPU was measured faster there than the plain form beside it (its
docstring says by how much); no GPU or TPU timing says the same holds there, so on those
backends the plain form, what XLA compiles well in general, runs instead. The choice is made
when a function is traced, from ``jax.default_backend()``: a jitted function keeps the forms of
the backend it was traced for, as it keeps that backend. Both forms run on every backend, and
the tests hold them equal on the CPU (they replace :func:`cpu_forms` to trace the plain ones).
"""

from __future__ import annotations

import jax

__all__ = ["cpu_forms"]


def cpu_forms() -> bool:
    """Whether the forms shaped on XLA:CPU are used: JAX's default backend is the CPU."""
    return jax.default_backend() == "cpu"
