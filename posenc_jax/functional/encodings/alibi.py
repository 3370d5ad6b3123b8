"""ALiBi: attention with linear biases (Press et al. 2022).

``logits[n, t, s] += m_n · (key_pos[s] - query_pos[t])`` for causal attention
(past keys have j - i <= 0, so the bias is a penalty linear in distance), and
``-m_n · |key_pos[s] - query_pos[t]|`` for the symmetric bidirectional variant.
The head slopes ``m_n`` are the authors' ``get_slopes``: a geometric sequence
``2^(-8/n), 2^(-16/n), ...`` for n a power of two, and for other n the slopes
of the closest lower power of two followed by every other slope of twice that.

The causal form differs from the authors' ``m · key_pos`` by a per-row constant,
which the softmax ignores. For the same reason the causal form carries no position
information at all in a bidirectional encoder (a bias linear in j shifts a whole row
equally), so the hook follows the attention it is in: ``bidirectional=None`` (the
default) is symmetric in bidirectional attention and causal in causal attention; an
explicit ``True`` or ``False`` wins. The bias is computed in float32 from positions, so it
has no length ceiling. :class:`ALiBiSlopes` takes a checkpoint's own slopes (Falcon's, MPT's).

Reference: Press, Smith and Lewis, "Train Short, Test Long: Attention with Linear
Biases Enables Input Length Extrapolation", ICLR 2022, arXiv:2108.12409.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.forms import Forms, declare_forms
from posenc_jax.functional.core.head_bias import HeadBias, head_bias_at, head_column
from posenc_jax.functional.core.hooks import AttentionContext, BiasHook, ParameterFree, Placement, pytree_dataclass
from posenc_jax.functional.core.positions import batched_positions, position_difference
from posenc_jax.functional.core.registry import Source, register_encoding

__all__ = ["ALiBi", "ALiBiSlopes", "alibi_bias", "alibi_slopes"]

ALIBI = Source.paper(
    "press2022train",
    title="Train Short, Test Long: Attention with Linear Biases Enables Input Length Extrapolation",
    authors="Press, Ofir and Smith, Noah A. and Lewis, Mike",
    year=2022,
    arxiv="2108.12409",
)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The per-head slopes of Press et al.'s ``get_slopes``, ``[num_heads]`` float64.

    Example:
      >>> alibi_slopes(8)
      array([0.5       , 0.25      , 0.125     , 0.0625    , 0.03125   ,
             0.015625  , 0.0078125 , 0.00390625])
    """
    if not isinstance(num_heads, (int, np.integer)) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"num_heads must be an integer >= 1 for ALiBi slopes, got {num_heads!r}")

    def power_of_two(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return np.asarray(power_of_two(num_heads))
    closest = 2 ** math.floor(math.log2(num_heads))
    extra = alibi_slopes(2 * closest)[0::2][: num_heads - closest]
    return np.concatenate([power_of_two(closest), extra])


def alibi_bias(num_heads: int, query_positions, key_positions, *, bidirectional: bool = False, slopes=None):
    """ALiBi bias ``[B|1, N, T, S]`` float32.

    Args:
      num_heads: N, which fixes the slopes.
      query_positions, key_positions: integer ``[T]``/``[B, T]``, ``[S]``/``[B, S]``.
      bidirectional: symmetric ``-m·|j - i|`` instead of the causal ``m·(j - i)``.
      slopes: optional ``[N]`` slopes replacing ``alibi_slopes(N)``: finite and ``>= 0``
        (checked when they are concrete; traced slopes, e.g. learned ones, are not).

    Example:
      >>> alibi_bias(1, jnp.arange(3), jnp.arange(3))[0, 0]
      Array([[ 0.        ,  0.00390625,  0.0078125 ],
             [-0.00390625,  0.        ,  0.00390625],
             [-0.0078125 , -0.00390625,  0.        ]], dtype=float32)
    """
    slopes = alibi_slopes(num_heads) if slopes is None else slopes
    if np.shape(slopes) != (num_heads,):
        raise ValueError(f"slopes must have shape [{num_heads}], got {np.shape(slopes)}")
    try:
        concrete = np.asarray(slopes, np.float64)
    except jax.errors.TracerArrayConversionError:
        concrete = None
    if concrete is not None and not (np.isfinite(concrete).all() and (concrete >= 0).all()):
        raise ValueError(
            f"slopes must be finite numbers >= 0 (a penalty per unit of distance), got {concrete.tolist()}; "
            f"leave slopes=None for Press et al.'s alibi_slopes(num_heads)"
        )
    query_positions = batched_positions(query_positions, "query_positions")
    key_positions = batched_positions(key_positions, "key_positions")
    return head_bias_at(_alibi_head(slopes, bidirectional), query_positions, key_positions)


def _alibi_head(slopes, bidirectional: bool) -> HeadBias:
    """ALiBi's per-head form: the slopes ``[N, 1]`` and :func:`_alibi_at`."""
    return HeadBias((jnp.asarray(slopes, jnp.float32).reshape(-1, 1),), functools.partial(_alibi_at, bidirectional))


def _alibi_at(bidirectional: bool, parameters, query_positions, key_positions) -> jax.Array:
    """The one definition of ALiBi's bias: ``m · (j - i)``, or ``-m · |j - i|`` bidirectional."""
    # The exact distance, rounded once to float32: right for any int32 positions.
    rel = position_difference(key_positions, query_positions, dtype=jnp.float32)
    if bidirectional:
        rel = -jnp.abs(rel)
    return head_column(parameters[0], 0) * rel


@register_encoding(
    "alibi",
    description="A per-head penalty linear in the distance, slopes a geometric sequence (no parameters).",
    source=ALIBI,
    hooks=("logits",),
    tiled=("head",),
    cached=(),
    prepared="bias",
)
@pytree_dataclass
class ALiBi(BiasHook, ParameterFree):
    """ALiBi as a ``logits`` hook; the number of heads is read from the context.

    ``bidirectional``: None follows the attention (symmetric when it is not causal),
    True forces the symmetric ``-m·|j - i|``, False the causal ``m·(j - i)``.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 6, 8)); pos = jnp.arange(4)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[ALiBi()], causal=True).shape
      (1, 4, 6, 8)
    """

    bidirectional: bool | None = None
    acts_on: ClassVar[Placement] = "shared_bias"

    def bias(self, context: AttentionContext) -> jax.Array:
        """The ``[B|1, N, T, S]`` bias, to compute once and share across layers."""
        return alibi_bias(
            context.num_heads,
            context.query_positions,
            context.key_positions,
            bidirectional=context.bidirectional(self.bidirectional),
        )

    def head_bias(self, context: AttentionContext) -> HeadBias:
        """The per-head form of :meth:`bias` (the Pallas kernel computes it per tile)."""
        return _alibi_head(alibi_slopes(context.num_heads), context.bidirectional(self.bidirectional))


@pytree_dataclass
class ALiBiSlopes(BiasHook, ParameterFree):
    """ALiBi with given per-head slopes, ``logits[n, t, s] += m_n · (j - i)`` (causal form).

    For checkpoints whose slopes are not Press et al.'s ``get_slopes(N)``: Falcon adds the
    bias before dividing the scores by √H, so its slopes are ``get_slopes(N) / √H``; MPT
    with ``alibi_bias_max`` b has ``2^(-b·k/N')``. ``bidirectional`` as in
    :class:`posenc_jax.functional.ALiBi`.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 2, 8)); pos = jnp.arange(4)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[ALiBiSlopes((0.25, 0.0625))], causal=True).shape
      (1, 4, 2, 8)
    """

    slopes: tuple[float, ...] = ()
    bidirectional: bool | None = None
    acts_on: ClassVar[Placement] = "shared_bias"

    def __post_init__(self):
        slopes = np.asarray(self.slopes, np.float64)
        if slopes.ndim != 1 or slopes.size == 0 or not np.all(np.isfinite(slopes)):
            raise ValueError(f"slopes must be a non-empty tuple of finite numbers, one per head, got {self.slopes!r}")

    def bias(self, context: AttentionContext) -> jax.Array:
        """The ``[B|1, N, T, S]`` bias, to compute once and share across layers."""
        context.check_heads(len(self.slopes), f"ALiBiSlopes ({len(self.slopes)} slopes)")
        return alibi_bias(
            len(self.slopes),
            context.query_positions,
            context.key_positions,
            bidirectional=context.bidirectional(self.bidirectional),
            slopes=np.asarray(self.slopes, np.float64),
        )


# Not registered (a checkpoint's own slopes, built by posenc_jax.hf); its forms are ALiBi's.
declare_forms(ALiBiSlopes, Forms(hooks=("logits",), tiled=(), prepared="bias"))
