"""Broadcasting a shared term to the ``[B, N, T, S]`` scores, with a gradient that stays one pass.

A bias shared by the batch (``[1, N, T, S]``: T5, learned clipped bias, Kerple, FIRE) or a
factor shared by it (URPE's Toeplitz ``C``) is broadcast over the batch when it meets the
scores; the gradient of its parameters then sums the ``[B, N, T, S]`` cotangent over the
batch. Autodiff writes that sum as one reduction over a non-minor axis, which XLA:CPU reads
with a stride, several times slower than a copy of the array. Summed as the elementwise sum
of its slices, the same reduction is one fused pass.
:func:`broadcast_to` is ``jnp.broadcast_to`` with that transpose. Both are forms shaped on
XLA:CPU, registered for the CPU only (:mod:`posenc_jax.functional.core.operations`); on
the other backends the plain broadcast and the plain sum run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posenc_jax.functional.core import operations
from posenc_jax.functional.core.operations import broadcast_axes, broadcast_to, sum_to_shape

__all__ = ["broadcast_to", "sum_to_shape"]

# Broadcast axes up to this long are summed slice by slice; longer ones by one reduction.
_SLICE_SUM_LIMIT = 64


@operations.SUM_TO_SHAPE.implement(backend="cpu")
def _sum_of_slices(x: jax.Array, shape: tuple) -> jax.Array:
    """:func:`sum_to_shape` with axes of up to 64 entries (a batch, the heads) summed as an elementwise
    sum of their slices, which XLA:CPU fuses into one pass."""
    for axis in broadcast_axes(shape, x.shape):
        size = x.shape[axis]
        if size <= _SLICE_SUM_LIMIT:
            x = functools.reduce(jnp.add, [jax.lax.slice_in_dim(x, i, i + 1, axis=axis) for i in range(size)])
        else:
            x = x.sum(axis=axis, keepdims=True)
    return x.reshape(shape)


def _copies(x: jax.Array, shape: tuple) -> jax.Array:
    """``jnp.broadcast_to(x, shape)`` as copies concatenated along each broadcast axis of up to 64 entries.

    The same values; autodiff transposes a concatenation into slices of the cotangent, added up:
    the sum of slices of :func:`sum_to_shape`, one fused pass on XLA:CPU.
    """
    x = x.reshape((1,) * (len(shape) - x.ndim) + tuple(x.shape))
    for axis in broadcast_axes(x.shape, shape):
        size = shape[axis]
        if size <= _SLICE_SUM_LIMIT:
            x = jnp.concatenate([x] * size, axis=axis)
        else:
            x = jnp.broadcast_to(x, x.shape[:axis] + (size,) + x.shape[axis + 1 :])
    return x


@operations.BROADCAST_TO.implement(backend="cpu")
@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _broadcast(x, shape):
    """:func:`broadcast_to` whose tangent is copies laid side by side along each short broadcast axis:
    its transpose, in reverse mode, is the sum of the cotangent's slices (forward mode works too)."""
    return jnp.broadcast_to(x, shape)


@_broadcast.defjvp
def _broadcast_jvp(shape, primals, tangents):
    (x,), (tangent,) = primals, tangents
    return _broadcast(x, shape), _copies(tangent, shape)
