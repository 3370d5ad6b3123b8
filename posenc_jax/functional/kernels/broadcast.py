"""Broadcasting a shared term to the ``[B, N, T, S]`` scores, with a gradient that stays one pass.

A bias shared by the batch (``[1, N, T, S]``: T5, learned clipped bias, Kerple, FIRE) or a
factor shared by it (URPE's Toeplitz ``C``) is broadcast over the batch when it meets the
scores; the gradient of its parameters then sums the ``[B, N, T, S]`` cotangent over the
batch. Autodiff writes that sum as one reduction over a non-minor axis, which XLA:CPU reads
with a stride: at B = 8, N = 4, T = S = 512 it took 70 ms, five times a copy of the array,
and made a training step with a learned bias 1.2-1.5x one without. Summed as the
elementwise sum of its slices, the same reduction is one fused pass (1.2 ms there).
:func:`broadcast_to` is ``jnp.broadcast_to`` with that transpose. Both are forms shaped on
XLA:CPU, used on the CPU only (:func:`~posenc_jax.functional.kernels.backend.cpu_forms`); on
the other backends they are the plain broadcast and the plain sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posenc_jax.functional.kernels import backend

__all__ = ["broadcast_to", "sum_to_shape"]

# Broadcast axes up to this long are summed slice by slice; longer ones by one reduction.
_SLICE_SUM_LIMIT = 64


def _broadcast_axes(shape: tuple, target: tuple) -> tuple[int, ...]:
    """Axes of ``target`` along which an array of ``shape`` is broadcast (checked)."""
    if len(shape) > len(target) or any(d not in (1, t) for d, t in zip(shape[::-1], target[::-1], strict=False)):
        raise ValueError(f"an array of shape {tuple(shape)} does not broadcast to {tuple(target)}")
    padded = (1,) * (len(target) - len(shape)) + tuple(shape)
    return tuple(axis for axis, (d, t) in enumerate(zip(padded, target, strict=True)) if d == 1 and t != 1)


def sum_to_shape(x: jax.Array, shape: tuple) -> jax.Array:
    """``x`` summed over the axes along which an array of ``shape`` is broadcast to ``x.shape``.

    The transpose of ``jnp.broadcast_to(y, x.shape)`` for ``y`` of ``shape``: the same sums
    as ``x.sum(axes, keepdims=True)``. Axes of up to 64 entries (a batch, the heads) are
    summed as an elementwise sum of their slices, which XLA fuses into one pass.

    Args:
      x: the array to reduce, ``[..., B, N, T, S]`` say.
      shape: a shape that broadcasts to ``x.shape``.

    Returns:
      An array of ``shape`` and ``x``'s dtype.

    Example:
      >>> sum_to_shape(jnp.arange(6.0).reshape(3, 2), (1, 2)).tolist()
      [[6.0, 9.0]]
    """
    shape = tuple(shape)
    if not backend.cpu_forms():
        return x.sum(axis=_broadcast_axes(shape, x.shape), keepdims=True).reshape(shape)
    for axis in _broadcast_axes(shape, x.shape):
        size = x.shape[axis]
        if size <= _SLICE_SUM_LIMIT:
            x = functools.reduce(jnp.add, [jax.lax.slice_in_dim(x, i, i + 1, axis=axis) for i in range(size)])
        else:
            x = x.sum(axis=axis, keepdims=True)
    return x.reshape(shape)


def broadcast_to(x: jax.Array, shape: tuple) -> jax.Array:
    """``jnp.broadcast_to(x, shape)`` whose gradient sums the broadcast axes as :func:`sum_to_shape` does.

    Use it where a term shared by the batch meets ``[B, N, T, S]`` scores or weights
    (``scores + broadcast_to(bias, scores.shape)``): the values and gradients are those of
    plain broadcasting; only the form of the gradient's reduction differs. Forward mode
    (``jax.jvp``) works too: the tangent is broadcast as copies laid side by side along each
    short broadcast axis, whose transpose, in reverse mode, is the sum of the cotangent's
    slices.

    Example:
      >>> bias = jnp.array([[1.0, 2.0]])  # [1, S], shared by 3 rows
      >>> jax.grad(lambda b: (broadcast_to(b, (3, 2)) * jnp.arange(6.0).reshape(3, 2)).sum())(bias).tolist()
      [[6.0, 9.0]]
    """
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    _broadcast_axes(x.shape, shape)  # checked here, before any derivative is traced
    return _broadcast(x, shape) if backend.cpu_forms() else jnp.broadcast_to(x, shape)


def _copies(x: jax.Array, shape: tuple) -> jax.Array:
    """``jnp.broadcast_to(x, shape)`` as copies concatenated along each broadcast axis of up to 64 entries.

    The same values; autodiff transposes a concatenation into slices of the cotangent, added up:
    the sum of slices of :func:`sum_to_shape`, one fused pass on XLA:CPU.
    """
    x = x.reshape((1,) * (len(shape) - x.ndim) + tuple(x.shape))
    for axis in _broadcast_axes(x.shape, shape):
        size = shape[axis]
        if size <= _SLICE_SUM_LIMIT:
            x = jnp.concatenate([x] * size, axis=axis)
        else:
            x = jnp.broadcast_to(x, x.shape[:axis] + (size,) + x.shape[axis + 1 :])
    return x


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _broadcast(x, shape):
    return jnp.broadcast_to(x, shape)


@_broadcast.defjvp
def _broadcast_jvp(shape, primals, tangents):
    (x,), (tangent,) = primals, tangents
    return _broadcast(x, shape), _copies(tangent, shape)
