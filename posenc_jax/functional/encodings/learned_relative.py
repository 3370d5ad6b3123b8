"""Learned clipped relative bias (T5-style, without buckets): one learned scalar per head and distance.

``logits[n, t, s] += table[clip(key_pos[s] - query_pos[t], -k, k) + k, n]`` with a
``[2k+1, N]`` table; distances beyond ±k share the end rows. Like T5 without the
log buckets. Computed as ``2k+1`` distinct values per head, expanded by a gather.

The materialising and blockwise paths read the table as it is: its rows are the bias at the
``2k+1`` distances, expanded by a gather. The Pallas kernel uses the per-head form (the tiled
form ``head``), the table's entry at the clipped distance read by selections
(:func:`~posenc_jax.functional.core.head_bias.head_select`), since no gather lowers in a tile:
``2k`` selections and ``⌈log2(2k+1)⌉`` bit tests per score, forward and in each backward kernel
(and as many masked sums for the table's gradient), so its cost grows with k. The tests hold the
per-head form equal to the table read directly.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.head_bias import HeadBias, head_select
from posenc_jax.functional.core.hooks import (
    AttentionContext,
    BiasHook,
    EncodingConfig,
    Placement,
    parameter,
    pytree_dataclass,
)
from posenc_jax.functional.core.positions import position_difference
from posenc_jax.functional.core.registry import register_encoding
from posenc_jax.functional.core.relative import check_max_distance, clipped_at_distances, expand_relative_bias
from posenc_jax.functional.core.validation import check_init_std
from posenc_jax.functional.encodings.shaw import SHAW

__all__ = ["ClippedBiasConfig", "ClippedRelativeBias", "clipped_relative_bias"]


def _check_table(table, max_distance):
    if np.ndim(table) != 2:
        raise ValueError(f"table must have shape [2k+1, N], got {np.shape(table)}")
    if np.shape(table)[0] != 2 * max_distance + 1:
        raise ValueError(
            f"table has {np.shape(table)[0]} rows but max_distance={max_distance} needs 2*{max_distance}+1 = "
            f"{2 * max_distance + 1}; pass a table of that length or the matching max_distance"
        )


def clipped_relative_bias(table, query_positions, key_positions, *, max_distance: int):
    """``table[clip(key_pos - query_pos, -k, k) + k, n]`` as ``[B|1, N, T, S]`` float32.

    Args:
      table: ``[2k+1, N]`` learned biases; row ``k + d`` is distance d.
      query_positions, key_positions: integer ``[T]``/``[B, T]``, ``[S]``/``[B, S]``.
      max_distance: the clip distance k >= 1.

    Example:
      >>> table = jnp.arange(5.0)[:, None]           # k = 2, one head
      >>> clipped_relative_bias(table, jnp.arange(3), jnp.arange(4), max_distance=2)[0, 0]
      Array([[2., 3., 4., 4.],
             [1., 2., 3., 4.],
             [0., 1., 2., 3.]], dtype=float32)
    """
    k = check_max_distance(max_distance)
    _check_table(table, k)
    return expand_relative_bias(_per_distance(table), query_positions, key_positions, k)


def _per_distance(table) -> jax.Array:
    """The bias at distances ``-k .. k``, ``[N, 2k+1]``: the table itself, transposed (past ``±k`` it is constant).

    The per-head form at distance d reads entry ``clip(d, -k, k) + k = d + k``, row ``d + k`` of the table, so
    the table is already the bias at every distance (``tests/test_relative.py`` holds the two forms equal).
    """
    return jnp.asarray(table, jnp.float32).T


def _clipped_head(table, max_distance: int) -> HeadBias:
    """The per-head form: the table's rows ``[N, 2k+1]`` and :func:`_clipped_at`."""
    return HeadBias((jnp.asarray(table, jnp.float32).T,), functools.partial(_clipped_at, max_distance))


def _clipped_at(max_distance: int, parameters, query_positions, key_positions) -> jax.Array:
    """The one definition of the bias: the head's entry at ``clip(j - i, -k, k) + k``."""
    index = jnp.clip(position_difference(key_positions, query_positions), -max_distance, max_distance)
    return head_select(parameters[0], index + max_distance, 2 * max_distance + 1)


@pytree_dataclass
class ClippedRelativeBias(BiasHook):
    """Learned clipped relative bias as a ``logits`` hook; ``table`` ``[2k+1, N]``.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 2, 8)); pos = jnp.arange(4)
      >>> bias = ClippedRelativeBias(jnp.zeros((5, 2)), max_distance=2)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, encodings=[bias]).shape
      (1, 4, 2, 8)
    """

    table: jax.Array = parameter()
    max_distance: int = 128

    def __post_init__(self):
        _check_table(self.table, check_max_distance(self.max_distance))

    def bias(self, context: AttentionContext) -> jax.Array:
        """The ``[B|1, N, T, S]`` bias, to compute once and share across layers."""
        return clipped_relative_bias(
            self.table, context.query_positions, context.key_positions, max_distance=self.max_distance
        )

    def distance_bias(self, distance: jax.Array, context: AttentionContext) -> jax.Array:
        """The bias at float32 distances ``[B|1, D]``, ``[B|1, N, D]``: a function of ``j - i`` alone."""
        return clipped_at_distances(_per_distance(self.table), distance, self.max_distance)

    def head_bias(self, context: AttentionContext) -> HeadBias:
        """The per-head form of :meth:`bias` (the Pallas kernel computes it per tile; the table gets its gradient)."""
        context.check_heads(np.shape(self.table)[1], f"the clipped bias's table [2k+1, N] {np.shape(self.table)}")
        return _clipped_head(self.table, self.max_distance)


@register_encoding(
    "clipped-bias",
    description="A learned scalar per head and distance, distances clipped to [-k, k].",
    source=SHAW,
    small_settings=dict(max_distance=3),
    hook=ClippedRelativeBias,
    hooks=("logits",),
    tiled=("distance", "head"),
    cached=(),
    prepared="bias",
)
@pytree_dataclass
class ClippedBiasConfig(EncodingConfig):
    """Learned clipped relative bias ``[2k+1, N]``, N(0, 0.02) at init."""

    max_distance: int = 128
    init_std: float = 0.02
    acts_on: ClassVar[Placement] = "shared_bias"

    def __post_init__(self):
        check_max_distance(self.max_distance)
        check_init_std(self.init_std)

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return {"table": jax.random.normal(key, (2 * self.max_distance + 1, num_heads), jnp.float32) * self.init_std}

    def build(self, params: dict) -> ClippedRelativeBias:
        return ClippedRelativeBias(params["table"], self.max_distance)
