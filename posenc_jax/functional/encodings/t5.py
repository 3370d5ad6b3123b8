"""T5 relative position buckets and learned bias (Raffel et al. 2020).

``logits[n, t, s] += table[bucket(key_pos[s] - query_pos[t]), n]`` with T5's
reference bucketing: distances below ``max_exact = num_buckets / 2`` (per
direction) get their own bucket, larger ones share log-spaced buckets up to
``max_distance``, beyond which everything falls in the last bucket.
Bidirectional buckets split the range between past and future keys; causal
ones give every future key bucket 0.

The hook follows the attention it is in: with ``bidirectional=None`` (the default) a
causal attention uses T5's causal buckets and a bidirectional one the bidirectional
buckets; an explicit setting wins.

Fast path: buckets saturate past ``±max_distance``, so the bias has only
``2·max_distance + 1`` distinct values per head; they are read from the table
once (``[N, 2M+1]``, at the distances' buckets) and expanded by a gather. Compute the bias once per forward and
share it across layers with :class:`posenc_jax.functional.SharedBias`.

Reference: Raffel et al., "Exploring the Limits of Transfer Learning with a
Unified Text-to-Text Transformer", JMLR 2020, arXiv:1910.10683
(``_relative_position_bucket`` in Mesh TensorFlow / T5).
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

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
from posenc_jax.functional.core.positions import position_difference
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.core.relative import clipped_at_distances, expand_relative_bias
from posenc_jax.functional.core.validation import check_init_std

__all__ = ["T5Bias", "T5Config", "t5_bias", "t5_relative_bucket"]

T5 = Source.paper(
    "raffel2020exploring",
    title="Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer",
    authors="Raffel, Colin and Shazeer, Noam and Roberts, Adam and Lee, Katherine and Narang, Sharan and "
    "Matena, Michael and Zhou, Yanqi and Li, Wei and Liu, Peter J.",
    year=2020,
    arxiv="1910.10683",
    venue="Journal of Machine Learning Research",
)


def _check_bucket_config(num_buckets, max_distance, bidirectional):
    if not isinstance(num_buckets, (int, np.integer)) or num_buckets < 2:
        raise ValueError(f"num_buckets must be an integer >= 2, got {num_buckets!r}")
    if bidirectional and num_buckets < 4:
        raise ValueError(
            "bidirectional T5 buckets need num_buckets >= 4 (half per direction, half of those exact), "
            f"got {num_buckets}"
        )
    if not isinstance(max_distance, (int, np.integer)) or max_distance < num_buckets:
        raise ValueError(
            f"max_distance must be an integer >= num_buckets={num_buckets} (log buckets span up to it), "
            f"got {max_distance!r}"
        )


def t5_relative_bucket(
    relative_position, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
):
    """T5's ``_relative_position_bucket`` for ``relative_position = key_pos - query_pos``.

    Args:
      relative_position: integer array of distances j - i, any shape.
      bidirectional: split buckets between past and future keys; if False, all
        future keys share bucket 0 (causal).
      num_buckets: total buckets (>= 2; >= 4 when bidirectional).
      max_distance: distance from which all keys share the last bucket (>= num_buckets).

    Returns:
      int32 buckets in ``[0, num_buckets)``, same shape.

    Example:
      >>> t5_relative_bucket(jnp.array([-200, -3, 0, 3, 200]), num_buckets=32, max_distance=128)
      Array([15,  3,  0, 19, 31], dtype=int32)
    """
    _check_bucket_config(num_buckets, max_distance, bidirectional)
    n = -jnp.asarray(relative_position, jnp.int32)
    ret = jnp.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        ret = ret + (n < 0).astype(jnp.int32) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # float32 as in the reference; n is clamped to >= 1 only to keep log() finite where unused.
    ratio = jnp.maximum(n, 1).astype(jnp.float32) / jnp.float32(max_exact)
    val_if_large = max_exact + (
        jnp.log(ratio) / jnp.float32(math.log(max_distance / max_exact)) * jnp.float32(num_buckets - max_exact)
    ).astype(jnp.int32)
    val_if_large = jnp.minimum(val_if_large, num_buckets - 1)
    return ret + jnp.where(is_small, n, val_if_large)


def t5_bias(
    table,
    query_positions,
    key_positions,
    *,
    bidirectional: bool = True,
    max_distance: int = 128,
):
    """T5's learned relative bias ``table[bucket(key_pos - query_pos), n]``, ``[B|1, N, T, S]``.

    Args:
      table: ``[num_buckets, N]`` learned biases.
      query_positions, key_positions: integer ``[T]``/``[B, T]``, ``[S]``/``[B, S]``.
      bidirectional: see :func:`t5_relative_bucket`.
      max_distance: see :func:`t5_relative_bucket`.

    Returns:
      ``[B|1, N, T, S]`` float32 bias (not scaled: T5 adds it to unscaled scores,
      and this library adds logits terms after scaling, so it goes in as is).

    Example:
      >>> t5_bias(jnp.zeros((32, 4)), jnp.arange(6), jnp.arange(6)).shape
      (1, 4, 6, 6)
    """
    per_distance = _per_distance(table, bidirectional=bidirectional, max_distance=max_distance)
    return expand_relative_bias(per_distance, query_positions, key_positions, max_distance)


def _per_distance(table, *, bidirectional: bool, max_distance: int) -> jax.Array:
    """The bias at distances ``-M .. M`` (``M = max_distance``), ``[N, 2M+1]``: past ``±M`` it is constant.

    The table's rows read at each distance's bucket: the buckets of ``-M .. M`` are known while tracing
    (:func:`_distance_buckets`), so this is one gather at constant indices, its gradient a sum into the
    table's rows (the per-head form :func:`_t5_at`, for the Pallas kernel, selects per bucket instead; the
    tests hold the two equal).
    """
    if np.ndim(table) != 2:
        raise ValueError(f"table must have shape [num_buckets, N], got {np.shape(table)}")
    buckets = _distance_buckets(np.shape(table)[0], bidirectional, max_distance)
    return jnp.take(jnp.asarray(table, jnp.float32).T, buckets, axis=1, mode="clip")


@functools.lru_cache(maxsize=64)
def _distance_buckets(num_buckets: int, bidirectional: bool, max_distance: int) -> np.ndarray:
    """The buckets of the distances ``-M .. M``, int32 ``[2M+1]``, computed once, outside any trace."""
    distances = np.arange(-max_distance, max_distance + 1, dtype=np.int32)
    with jax.ensure_compile_time_eval():
        buckets = t5_relative_bucket(
            distances, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
        )
    return np.asarray(buckets, np.int32)


def _t5_head(table, *, bidirectional: bool, max_distance: int) -> HeadBias:
    """T5's per-head form: the table's rows ``[N, num_buckets]`` and :func:`_t5_at`."""
    num_buckets = np.shape(table)[0]
    at = functools.partial(_t5_at, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    return HeadBias((jnp.asarray(table, jnp.float32).T,), at)


def _t5_at(parameters, query_positions, key_positions, *, bidirectional, num_buckets, max_distance) -> jax.Array:
    """The one definition of T5's bias: the table's entry at the distance's bucket, a selection per bucket."""
    buckets = t5_relative_bucket(
        position_difference(key_positions, query_positions),
        bidirectional=bidirectional,
        num_buckets=num_buckets,
        max_distance=max_distance,
    )
    (rows,) = parameters
    bias = jnp.where(buckets == 0, head_column(rows, 0), jnp.float32(0.0))
    for bucket in range(1, num_buckets):
        bias = jnp.where(buckets == bucket, head_column(rows, bucket), bias)
    return bias


@pytree_dataclass
class T5Bias(BiasHook):
    """T5 relative bias as a ``logits`` hook; ``table`` ``[num_buckets, N]`` is a parameter.

    ``bidirectional``: None follows the attention's ``causal``; True or False fixes the buckets.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 2, 8)); pos = jnp.arange(4)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[T5Bias(jnp.zeros((32, 2)))]).shape
      (1, 4, 2, 8)
    """

    table: jax.Array = parameter()
    bidirectional: bool | None = None
    max_distance: int = 128

    def __post_init__(self):
        if np.ndim(self.table) != 2:
            raise ValueError(f"table must have shape [num_buckets, N], got {np.shape(self.table)}")
        _check_bucket_config(np.shape(self.table)[0], self.max_distance, self.bidirectional is not False)

    def bias(self, context: AttentionContext) -> jax.Array:
        """The ``[B|1, N, T, S]`` bias, to compute once and share across layers."""
        context.check_heads(np.shape(self.table)[1], f"the T5 table [num_buckets, N] {np.shape(self.table)}")
        return t5_bias(
            self.table,
            context.query_positions,
            context.key_positions,
            bidirectional=context.bidirectional(self.bidirectional),
            max_distance=self.max_distance,
        )

    def distance_bias(self, distance: jax.Array, context: AttentionContext) -> jax.Array:
        """The bias at float32 distances ``[B|1, D]``, ``[B|1, N, D]``: a function of ``j - i`` alone."""
        context.check_heads(np.shape(self.table)[1], f"the T5 table [num_buckets, N] {np.shape(self.table)}")
        bidirectional = context.bidirectional(self.bidirectional)
        per_distance = _per_distance(self.table, bidirectional=bidirectional, max_distance=self.max_distance)
        return clipped_at_distances(per_distance, distance, self.max_distance)

    def head_bias(self, context: AttentionContext) -> HeadBias:
        """The per-head form of :meth:`bias` (the Pallas kernel computes it per tile; the table gets its gradient)."""
        context.check_heads(np.shape(self.table)[1], f"the T5 table [num_buckets, N] {np.shape(self.table)}")
        bidirectional = context.bidirectional(self.bidirectional)
        return _t5_head(self.table, bidirectional=bidirectional, max_distance=self.max_distance)


@register_encoding(
    "t5",
    description="A learned scalar per head and log-spaced bucket of the distance, shared by all layers.",
    source=T5,
    small_settings=dict(num_buckets=8, max_distance=16),
    hook=T5Bias,
    hooks=("logits",),
    tiled=("distance", "head"),
    cached=(),
    prepared="bias",
)
@pytree_dataclass
class T5Config(EncodingConfig):
    """T5 bucket table ``[num_buckets, N]``; ``bidirectional=None`` follows the attention."""

    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool | None = None
    init_std: float = 0.02
    acts_on: ClassVar[Placement] = "shared_bias"

    def __post_init__(self):
        _check_bucket_config(self.num_buckets, self.max_distance, self.bidirectional is not False)
        check_init_std(self.init_std)

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return {"table": jax.random.normal(key, (self.num_buckets, num_heads), jnp.float32) * self.init_std}

    def build(self, params: dict) -> T5Bias:
        return T5Bias(params["table"], bidirectional=self.bidirectional, max_distance=self.max_distance)
