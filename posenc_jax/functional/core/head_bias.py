"""A position bias's per-head form: the one definition of its value at a pair of positions.

A bias that depends only on positions and per-head parameters (ALiBi, T5, Kerple, Sandwich, the
learned clipped bias, FIRE) declares the
tiled form ``head`` (:mod:`~posenc_jax.functional.core.forms`): ``head_bias(context)`` returns a
:class:`HeadBias`, its parameters as one row per head and a pure, elementwise function of a
head's row and a pair of positions. The Pallas kernel (:mod:`posenc_jax.functional.kernels.pallas`)
evaluates it on each tile's ``[bq, 1]`` query and ``[1, bk]`` key positions with one head's row
``[1, P]``; over ``[B|1, N, T, S]`` it is :func:`head_bias_at`. The materialising and blockwise
paths use the encoding's ``bias``/``distance_bias``, which call the same function where it is
arithmetic (ALiBi, Sandwich) and read a learned table directly where it is a lookup (T5,
the clipped bias: a gather there, not :func:`head_select`'s selections, whose program grows with
the table); FIRE keeps its MLP as a contraction over the hidden units. The tests hold every
encoding's per-head form equal to its ``bias`` and ``distance_bias`` (FIRE's to float32 rounding).

The function uses only elementwise operations, selections, sums and matrix products of
broadcast operands (no slice, gather, reshape or array constant), so it traces inside a Pallas
kernel for every backend: a parameter's column is read with :func:`head_column`, never by
indexing, and a learned table's entry at an integer index per pair with :func:`head_select`.

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

__all__ = ["HeadBias", "head_bias_at", "head_column", "head_select"]


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


def head_select(parameter: jax.Array, index: jax.Array, size: int) -> jax.Array:
    """``parameter [..., P]``'s entry ``index`` (int32, in ``[0, size)``, broadcasting) per element, without a gather.

    A binary tree of selections on the bits of ``index``, its leaves the columns ``0 .. size - 1``
    (:func:`head_column`): ``size - 1`` selections and ``⌈log2 size⌉`` bit tests per element, and at
    most ``⌈log2 size⌉`` partial results alive at once. A gather would read the entry once; this is
    what a table lookup costs where no gather lowers (a Pallas kernel's tile).

    Example:
      >>> head_select(jnp.array([[10.0, 11.0, 12.0]]), jnp.array([[2, 0, 1]]), 3)
      Array([[12., 10., 11.]], dtype=float32)
    """
    if size < 1:
        raise ValueError(f"head_select needs size >= 1 entries, got {size}")
    index = jnp.asarray(index, jnp.int32)
    depth = max(0, (size - 1).bit_length())
    bits = [((index >> level) & 1) != 0 for level in range(depth)]  # index >= 0

    def pick(low: int, level: int) -> jax.Array:  # the entry among low .. low + 2**level - 1 (and < size)
        if level == 0:
            return head_column(parameter, low)
        middle = low + (1 << (level - 1))
        if middle >= size:  # no entry in the upper half
            return pick(low, level - 1)
        return jnp.where(bits[level - 1], pick(middle, level - 1), pick(low, level - 1))

    return pick(0, depth)


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
