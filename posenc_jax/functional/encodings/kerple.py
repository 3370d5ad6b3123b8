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

import functools
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.head_bias import HeadBias, head_column
from posenc_jax.functional.core.hooks import (
    AttentionContext,
    BiasHook,
    EncodingConfig,
    Placement,
    parameter,
    pytree_dataclass,
)
from posenc_jax.functional.core.positions import batched_positions, position_difference
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.core.relative import relative_positions
from posenc_jax.functional.core.validation import check_number
from posenc_jax.functional.kernels.autodiff import linear_primitives

__all__ = ["Kerple", "KerpleConfig", "kerple_bias"]

KERPLE = Source.paper(
    "chi2022kerple",
    title="KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation",
    authors="Chi, Ta-Chung and Fan, Ting-Han and Ramadge, Peter J. and Rudnicky, Alexander I.",
    year=2022,
    arxiv="2205.09921",
)

_VARIANTS = ("log", "power")


def kerple_bias(r1, r2, query_positions, key_positions, *, variant: Literal["log", "power"] = "log"):
    """Kerple bias ``[B|1, N, T, S]`` float32 for per-head ``r1``, ``r2`` ``[N]``.

    Example:
      >>> b = kerple_bias(jnp.ones(2), jnp.ones(2), jnp.arange(3), jnp.arange(3))
      >>> b.shape, float(b[0, 0, 2, 0])  # -log(1 + 2)
      ((1, 2, 3, 3), -1.0986123085021973)
    """
    _check_variant(variant)
    if np.ndim(r1) != 1 or np.shape(r1) != np.shape(r2):
        raise ValueError(f"r1 and r2 must both have shape [N], got {np.shape(r1)} and {np.shape(r2)}")
    q = batched_positions(query_positions, "query_positions")
    k = batched_positions(key_positions, "key_positions")
    return _pairwise(r1, r2, q, k, variant)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _pairwise(r1, r2, query_positions, key_positions, variant):
    """The bias at every pair; its tangent is :data:`_tangent`'s, whose transpose keeps no ``[N, T, S]`` term."""
    return _kernel(r1, r2, _distance(query_positions, key_positions), variant)


@_pairwise.defjvp
def _pairwise_jvp(variant, primals, tangents):
    r1, r2, query_positions, key_positions = primals
    rows = jnp.stack([jnp.asarray(r1, jnp.float32), jnp.asarray(r2, jnp.float32)])[None]  # [1, 2, N]
    direction = jnp.stack([jnp.asarray(t, jnp.float32) for t in tangents[:2]])[None]
    out = _pairwise(r1, r2, query_positions, key_positions, variant)
    return out, _tangent(direction, rows, query_positions, key_positions, variant=variant)


def _distance(query_positions, key_positions) -> jax.Array:
    """``|key_pos - query_pos|``, float32 ``[B|1, T, S]``, of positions ``[B|1, T]``, ``[B|1, S]``."""
    return jnp.abs(relative_positions(query_positions, key_positions, dtype=jnp.float32))


def _partials(rows, query_positions, key_positions, variant):
    """The bias's derivatives in r1 and r2 at every pair, ``[B|1, N, T, S]`` each; ``rows`` ``[B|1, 2, N]``."""
    distance = _distance(query_positions, key_positions)[:, None]
    r1, r2 = rows[:, 0, :, None, None], rows[:, 1, :, None, None]
    if variant == "log":
        return -jnp.log1p(r2 * distance), -r1 * distance / (1.0 + r2 * distance)
    safe = jnp.where(distance > 0, distance, 1.0)
    power = jnp.where(distance > 0, safe**r2, 0.0)
    return -power, -r1 * power * jnp.log(safe)


def _apply_tangent(direction, rows, query_positions, key_positions, *, variant):
    """The bias's tangent along ``direction`` ``[B|1, 2, N]`` (of r1, r2): ``[B|1, N, T, S]``."""
    by_r1, by_r2 = _partials(rows, query_positions, key_positions, variant)
    return direction[:, 0, :, None, None] * by_r1 + direction[:, 1, :, None, None] * by_r2


def _transpose_tangent(cotangent, rows, query_positions, key_positions, *, variant):
    """The cotangent of r1 and r2, ``[B, 2, N]``: both sums over the pairs in one pass, which XLA fuses with the
    partials' recomputation (the barrier keeps it from sharing the forward's bias, which would then be kept)."""
    rows, query_positions, key_positions = jax.lax.optimization_barrier((rows, query_positions, key_positions))
    by_r1, by_r2 = _partials(rows, query_positions, key_positions, variant)
    zero = jnp.zeros((), jnp.float32)
    sums = jax.lax.reduce(
        (cotangent * by_r1, cotangent * by_r2), (zero, zero), lambda x, y: (x[0] + y[0], x[1] + y[1]), (2, 3)
    )
    return jnp.stack(sums, axis=1)


# The tangent is linear in the direction, with the parameters and positions read as fixed: forward mode
# applies it, reverse mode its transpose (kernels.autodiff).
_tangent, _ = linear_primitives("kerple_tangent", _apply_tangent, _transpose_tangent)


def _kernel(r1, r2, distance, variant):
    """The kernel of ``d = |distance|`` (float32 ``[B|1, ...]``) for each head: ``[B|1, N, ...]``."""
    distance = jnp.abs(distance)[:, None]
    per_head = (1, np.shape(r1)[0]) + (1,) * (distance.ndim - 2)
    r1 = jnp.asarray(r1, jnp.float32).reshape(per_head)
    r2 = jnp.asarray(r2, jnp.float32).reshape(per_head)
    return _kerple_of(r1, r2, distance, variant)


def _kerple_of(r1, r2, distance, variant):
    """The one definition of Kerple's kernel, elementwise in ``d = |j - i| >= 0`` and the heads' ``r1``, ``r2``."""
    if variant == "log":
        return -r1 * jnp.log1p(r2 * distance)
    # d ** r2 with a gradient that stays finite at d = 0.
    safe = jnp.where(distance > 0, distance, 1.0)
    return jnp.where(distance > 0, -r1 * safe**r2, 0.0)


def _kerple_at(variant, parameters, query_positions, key_positions) -> jax.Array:
    """Kerple's per-head function (:class:`~posenc_jax.functional.core.head_bias.HeadBias`): rows ``[r1, r2]``."""
    distance = jnp.abs(position_difference(key_positions, query_positions, dtype=jnp.float32))
    return _kerple_of(head_column(parameters[0], 0), head_column(parameters[0], 1), distance, variant)


def _check_concrete_positive(name, value, upper=None):
    try:
        values = np.asarray(value)
    except jax.errors.TracerArrayConversionError:
        return
    if np.any(values <= 0) or (upper is not None and np.any(values > upper)):
        bound = f"in (0, {upper}]" if upper is not None else "> 0"
        raise ValueError(f"Kerple {name} must be {bound} for every head, got {values}")


@pytree_dataclass
class Kerple(BiasHook):
    """Kerple as a ``logits`` hook; ``r1``, ``r2`` ``[N]`` are parameters of the caller.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 2, 8)); pos = jnp.arange(4)
      >>> enc = Kerple(jnp.ones(2), jnp.ones(2), variant="power")
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, encodings=[enc]).shape
      (1, 4, 2, 8)
    """

    r1: jax.Array = parameter()
    r2: jax.Array = parameter()
    variant: Literal["log", "power"] = "log"

    def __post_init__(self):
        _check_variant(self.variant)
        _check_concrete_positive("r1", self.r1)
        _check_concrete_positive("r2", self.r2, 2.0 if self.variant == "power" else None)

    def bias(self, context: AttentionContext) -> jax.Array:
        """The ``[B|1, N, T, S]`` bias, to compute once and share across layers."""
        context.check_heads(np.shape(self.r1)[0], f"Kerple's r1 [N] {np.shape(self.r1)}")
        return kerple_bias(self.r1, self.r2, context.query_positions, context.key_positions, variant=self.variant)

    def distance_bias(self, distance: jax.Array, context: AttentionContext) -> jax.Array:
        """The bias at float32 distances ``[B|1, D]``, ``[B|1, N, D]``: a function of ``|j - i|`` alone."""
        context.check_heads(np.shape(self.r1)[0], f"Kerple's r1 [N] {np.shape(self.r1)}")
        return _kernel(self.r1, self.r2, distance, self.variant)

    def head_bias(self, context: AttentionContext) -> HeadBias:
        """The per-head form of :meth:`bias` (the Pallas kernel computes it per tile; r1 and r2 get gradients)."""
        context.check_heads(np.shape(self.r1)[0], f"Kerple's r1 [N] {np.shape(self.r1)}")
        rows = jnp.stack([jnp.asarray(self.r1, jnp.float32), jnp.asarray(self.r2, jnp.float32)], axis=1)
        return HeadBias((rows,), functools.partial(_kerple_at, self.variant))


def _check_variant(variant):
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")


_DESCRIPTION = "A learned conditionally positive definite kernel of the distance: -r1 {} per head."


@register_encoding(
    "kerple-log",
    description=_DESCRIPTION.format("log(1 + r2 |j - i|)"),
    source=KERPLE,
    fixed=dict(variant="log"),
    hook=Kerple,
    hooks=("logits",),
    tiled=("distance", "head"),
    cached=(),
    prepared="bias",
)
@register_encoding(
    "kerple-power",
    description=_DESCRIPTION.format("|j - i|^r2"),
    source=KERPLE,
    fixed=dict(variant="power"),
    hook=Kerple,
    hooks=("logits",),
    tiled=("distance", "head"),
    cached=(),
    prepared="bias",
)
@pytree_dataclass
class KerpleConfig(EncodingConfig):
    """Kerple ``r1``, ``r2`` ``[N]``; kept positive (and r2 <= 2 for power) by clamping at ``eps``.

    Initialised as in the authors' code: ``r1 ~ U(0, 1)``, ``r2 ~ U(0, 2)`` (power) or
    ``U(0, 1)`` (log), then clamped.
    """

    variant: Literal["log", "power"] = "log"
    eps: float = 1e-2
    acts_on: ClassVar[Placement] = "shared_bias"

    def __post_init__(self):
        _check_variant(self.variant)
        check_number("eps", self.eps, above=0, below=1, fix="the floor of r1 and r2, 0.01 by default")

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        k1, k2 = jax.random.split(key)
        r2_max = 2.0 if self.variant == "power" else 1.0
        return {
            "r1": jax.random.uniform(k1, (num_heads,), minval=self.eps, maxval=1.0),
            "r2": jax.random.uniform(k2, (num_heads,), minval=self.eps, maxval=r2_max),
        }

    def build(self, params: dict) -> Kerple:
        r1 = jnp.maximum(params["r1"], self.eps)
        r2 = jnp.maximum(params["r2"], self.eps)
        if self.variant == "power":
            r2 = jnp.minimum(r2, 2.0)
        return Kerple(r1, r2, variant=self.variant)
