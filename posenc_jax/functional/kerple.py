"""Kerple: kernelized relative positional embedding (Chi et al. 2022).

Two conditionally positive definite kernels of the distance ``d = |key_pos - query_pos|``
with learned per-head ``r1, r2 > 0``:

* logarithmic: ``logits += -r1 · log(1 + r2 · d)``;
* power: ``logits += -r1 · d ** r2`` with ``r2`` in ``(0, 2]``.

Both decrease with distance for positive parameters. The hook uses the values it is
given; a module keeps them positive (e.g. by clamping at a small epsilon, as the
authors do). Computed in float32 from positions, no length ceiling.

Reference: Chi, Fan, Ramadge and Rudnicky, "KERPLE: Kernelized Relative Positional
Embedding for Length Extrapolation", NeurIPS 2022, arXiv:2205.09921.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.relative import relative_positions

__all__ = ["Kerple", "kerple_bias"]

_VARIANTS = ("log", "power")


def kerple_bias(r1, r2, query_positions, key_positions, *, variant: Literal["log", "power"] = "log"):
    """Kerple bias ``[B|1, N, T, S]`` float32 for per-head ``r1``, ``r2`` ``[N]``.

    Example:
      >>> b = kerple_bias(jnp.ones(2), jnp.ones(2), jnp.arange(3), jnp.arange(3))
      >>> b.shape, float(b[0, 0, 2, 0])  # -log(1 + 2)
      ((1, 2, 3, 3), -1.0986123085021973)
    """
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
    if np.ndim(r1) != 1 or np.shape(r1) != np.shape(r2):
        raise ValueError(f"r1 and r2 must both have shape [N], got {np.shape(r1)} and {np.shape(r2)}")
    num_heads = np.shape(r1)[0]
    distance = jnp.abs(relative_positions(query_positions, key_positions)).astype(jnp.float32)[:, None]
    r1 = jnp.asarray(r1, jnp.float32).reshape(1, num_heads, 1, 1)
    r2 = jnp.asarray(r2, jnp.float32).reshape(1, num_heads, 1, 1)
    if variant == "log":
        return -r1 * jnp.log1p(r2 * distance)
    # d ** r2 with a gradient that stays finite at d = 0.
    safe = jnp.where(distance > 0, distance, 1.0)
    return jnp.where(distance > 0, -r1 * safe**r2, 0.0)


def _check_concrete_positive(name, value, upper=None):
    try:
        values = np.asarray(value)
    except jax.errors.TracerArrayConversionError:
        return
    if np.any(values <= 0) or (upper is not None and np.any(values > upper)):
        bound = f"in (0, {upper}]" if upper is not None else "> 0"
        raise ValueError(f"Kerple {name} must be {bound} for every head, got {values}")


@dataclasses.dataclass(frozen=True)
class Kerple:
    """Kerple as a ``logits`` hook; ``r1``, ``r2`` ``[N]`` are parameters of the caller.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 2, 8)); pos = jnp.arange(4)
      >>> enc = Kerple(jnp.ones(2), jnp.ones(2), variant="power")
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, encodings=[enc]).shape
      (1, 4, 2, 8)
    """

    r1: jax.Array
    r2: jax.Array
    variant: Literal["log", "power"] = "log"
    hooks: ClassVar[frozenset[str]] = frozenset({"logits"})

    def __post_init__(self):
        if self.variant not in _VARIANTS:
            raise ValueError(f"variant must be one of {_VARIANTS}, got {self.variant!r}")
        _check_concrete_positive("r1", self.r1)
        _check_concrete_positive("r2", self.r2, 2.0 if self.variant == "power" else None)

    def bias(self, query_positions, key_positions, num_heads: int | None = None):
        """The ``[B|1, N, T, S]`` bias, to compute once and share across layers (``num_heads`` is fixed by the parameters)."""
        return kerple_bias(self.r1, self.r2, query_positions, key_positions, variant=self.variant)

    def logits(self, q, k, query_positions, key_positions):
        return self.bias(query_positions, key_positions)
