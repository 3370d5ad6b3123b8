"""A position bias's per-head form: the one definition of its value at a pair of positions.

A bias that depends only on positions and per-head parameters (ALiBi, T5, Kerple) declares the
tiled form ``head`` (:mod:`~posenc_jax.functional.core.forms`): ``head_bias(context)`` returns a
:class:`HeadBias`, its parameters as one row per head and a pure, elementwise function of a
head's row and a pair of positions. Every path computes the bias with that one function: the
materialising path over ``[B|1, N, T, S]`` (:func:`head_bias_at`), the blockwise path through the
encoding's ``bias``/``distance_bias`` (which call it), and the Pallas kernel
(:mod:`posenc_jax.functional.kernels.pallas`) on each tile's ``[bq, 1]`` query and ``[1, bk]`` key
positions with one head's row ``[1, P]``.

The function uses only elementwise operations, selections and sums (no slice, gather or
reshape), so it traces inside a Pallas kernel for every backend: a parameter's column is read
with :func:`head_column`, never by indexing.

Example:
  >>> scale = lambda params, q, k: head_column(params[0], 0) * (k - q).astype(jnp.float32)
  >>> head_bias_at(HeadBias((jnp.array([[1.0], [2.0]]),), scale), jnp.arange(2), jnp.arange(3))[0, 1]
  Array([[ 0.,  2.,  4.],
         [-2.,  0.,  2.]], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.positions import with_batch_axis

__all__ = ["HeadBias", "head_bias_at", "head_column"]


class HeadBias(NamedTuple):
    """A bias's per-head form.

    Attributes:
      parameters: a tuple of float32 arrays ``[N, P_i]``, one row per head (a learned table's
        rows are its parameters: gradients reach them through this form).
      function: ``function(parameters, query_positions, key_positions) -> float32 bias``, pure
        and elementwise: each parameter has shape ``[..., P_i]`` and is read only through
        :func:`head_column` (a column ``[..., 1]``), positions are int32 ``[..., T, 1]`` and
        ``[..., 1, S]``, all of one rank (``[1, N, 1, P]`` with ``[B|1, 1, T, 1]`` over a whole call,
        ``[1, P]`` with ``[bq, 1]`` in a kernel's tile), and everything broadcasts. Its static
        settings (the direction, the bucket count) are bound in it.
    """

    parameters: tuple
    function: Callable


def head_column(parameter: jax.Array, index: int) -> jax.Array:
    """Column ``index`` of ``parameter [..., P]`` as ``[..., 1]``: a selection and a sum, which every Pallas
    backend lowers (a slice or gather would not).

    Example:
      >>> head_column(jnp.array([[1.0, 2.0], [3.0, 4.0]]), 1)
      Array([[2.],
             [4.]], dtype=float32)
    """
    lanes = jax.lax.broadcasted_iota(jnp.int32, parameter.shape, parameter.ndim - 1)
    return jnp.sum(jnp.where(lanes == index, parameter, jnp.zeros((), parameter.dtype)), axis=-1, keepdims=True)


def head_bias_at(head: HeadBias, query_positions, key_positions) -> jax.Array:
    """``head``'s bias over every pair of positions, ``[B|1, N, T, S]`` float32.

    Args:
      head: the form.
      query_positions, key_positions: int32 ``[T]``/``[B, T]`` and ``[S]``/``[B, S]``.
    """
    q = with_batch_axis(jnp.asarray(query_positions, jnp.int32))[:, None, :, None]
    k = with_batch_axis(jnp.asarray(key_positions, jnp.int32))[:, None, None, :]
    parameters = tuple(jnp.asarray(p, jnp.float32)[None, :, None, :] for p in head.parameters)  # [1, N, 1, P]
    return head.function(parameters, q, k).astype(jnp.float32)
