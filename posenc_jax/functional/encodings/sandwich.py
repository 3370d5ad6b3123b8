"""Sandwich: a parameter-free bias from the dot product of sinusoidal embeddings (Chi et al. 2023).

For head ``h = 1..N``, sinusoid width ``d̄`` and relative distance ``r = key_pos - query_pos``::

    bias[h, t, s] = (Σ_{i=1}^{d̄/2} cos(r · θ_i) - d̄/2) / (h · 8 / N),    θ_i = base^(-2i/d̄)

The sum is the dot product ``p_i · p_j`` of two sinusoidal position embeddings of width
``d̄``, so the bias is 0 at distance 0, negative elsewhere, symmetric in ``r`` (one form
serves causal and bidirectional attention), and depends on positions only. Each head's
bias is compressed by ``h · 8 / N`` like ALiBi's slopes. The frequencies start at ``i = 1``
(not 0) and include ``i = d̄/2``, as in the NeMo implementation written with the authors
(``SandwichRelativePositionEmbedding``); ``d̄`` defaults to the head dim.

Computed exactly for any positions without a ``[T, S, d̄/2]`` tensor: with
``α_t = query_pos[t] · θ`` and ``β_s = key_pos[s] · θ`` reduced modulo 2π exactly
(:func:`~posenc_jax.functional.core.positions.position_angles`),
``cos(β - α) = cos α cos β + sin α sin β``, so the sum over ``i`` is one ``[T, d̄] × [d̄, S]``
matmul of per-position ``[cos, sin]`` tables. The matmul runs at full float32 precision
(TF32 or bfloat16 passes would cost ~1e-3 or more per term). Subtracting ``d̄/2`` cancels
near the diagonal and leaves a float32 rounding residue of order ``d̄ · 1e-7`` of either
sign, so the two known facts, ``bias <= 0`` and ``bias = 0`` where a key's position equals
the query's, are imposed exactly.

The one definition of the bias at a pair of positions is its per-head form (the tiled form
``head``): the per-head factor ``N / (8h)`` as a parameter row and a function of the query and key
positions that builds their ``[cos, sin]`` tables (exact phases, in int32 arithmetic) and multiplies
them. The materialising and blockwise paths call it over their positions; the Pallas kernel calls
it per tile, where the sum is one ``[bq, W] × [W, bk]`` product (``W = d̄`` rounded up to a power of
two, at least 16: Triton's shapes) at full float32 precision for each head, beside the tile's
``q kᵀ``, and the tables cost ``O((bq + bk) · W)``.

Reference: Chi, Fan, Rudnicky and Ramadge, "Dissecting Transformer Length Extrapolation
via the Lens of Receptive Field Analysis", ACL 2023, arXiv:2212.10356.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.head_bias import HeadBias, head_bias_at, head_column
from posenc_jax.functional.core.hooks import AttentionContext, BiasHook, ParameterFree, Placement, pytree_dataclass
from posenc_jax.functional.core.positions import _DIGIT_BITS, _NUM_DIGITS, batched_positions
from posenc_jax.functional.core.registry import Source, register_encoding

__all__ = ["Sandwich", "sandwich_bias", "sandwich_frequencies"]

SANDWICH = Source.paper(
    "chi2023dissecting",
    title="Dissecting Transformer Length Extrapolation via the Lens of Receptive Field Analysis",
    authors="Chi, Ta-Chung and Fan, Ting-Han and Rudnicky, Alexander I. and Ramadge, Peter J.",
    year=2023,
    arxiv="2212.10356",
)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_dim(dim, what: str = "dim") -> int:
    if not _is_int(dim) or dim < 2 or dim % 2:
        hint = f"e.g. {int(dim) + 1}" if _is_int(dim) and dim >= 2 else "e.g. the head dim"
        raise ValueError(
            f"Sandwich {what} must be an even integer >= 2 (the sinusoid width d̄, d̄/2 frequencies), "
            f"got {dim!r}; pass an even dim ({hint})"
        )
    return int(dim)


def _check_base(base) -> float:
    ok = isinstance(base, (int, float, np.integer, np.floating)) and not isinstance(base, (bool, np.bool_))
    if not ok or not math.isfinite(base) or base <= 1.0:
        raise ValueError(f"Sandwich base must be a finite number > 1 (10000.0 in the paper), got {base!r}")
    return float(base)


def sandwich_frequencies(dim: int, *, base: float = 10000.0) -> np.ndarray:
    """Sandwich's frequencies ``θ_i = base^(-2i/dim)`` for ``i = 1..dim/2``, ``[dim/2]`` float64.

    One step up the sinusoidal ladder of
    :func:`~posenc_jax.functional.core.positions.inverse_frequencies` (which starts at ``i = 0``):
    the first frequency is ``base^(-2/dim)``, the last ``1/base``.

    Example:
      >>> sandwich_frequencies(4)
      array([0.01  , 0.0001])
    """
    dim, base = _check_dim(dim), _check_base(base)
    return np.power(base, -2.0 * np.arange(1, dim // 2 + 1, dtype=np.float64) / dim)


def _check_num_heads(num_heads) -> int:
    if not _is_int(num_heads) or num_heads < 1:
        raise ValueError(f"num_heads must be an integer >= 1 for the Sandwich bias, got {num_heads!r}")
    return int(num_heads)


def _positions(positions, name: str) -> jax.Array:
    positions = batched_positions(positions, name)
    if positions.ndim != 2:
        raise ValueError(f"{name} must have shape [T] or [B, T], got shape {positions.shape}")
    return positions


def _digit_turns(theta: np.ndarray) -> tuple:
    """Per 8-bit digit of a position, each frequency's phase per unit of that digit in ``2**-32`` turns, as int32
    Python ints (the two's-complement of the uint32 phase): ``(digits, F)`` nested tuples, computed in float64."""
    turns_per_position = theta / (2.0 * math.pi)
    digits = []
    for k in range(_NUM_DIGITS):
        turns = np.round(np.mod(turns_per_position * 2.0 ** (_DIGIT_BITS * k), 1.0) * 2.0**32) % 2.0**32
        digits.append(tuple(int(t) - (1 << 32) if t >= 2**31 else int(t) for t in turns.astype(np.uint64)))
    return tuple(digits)


def _lanes(width: int, axis: int, rank: int) -> jax.Array:
    """int32 ``0 .. width - 1`` along ``axis`` (-1 or -2) of an array of ``rank`` with unit axes elsewhere."""
    shape = [1] * rank
    shape[axis] = width
    return jax.lax.broadcasted_iota(jnp.int32, tuple(shape), rank + axis)


def _phase_table(positions: jax.Array, turns: tuple, width: int, axis: int) -> jax.Array:
    """``[cos(p θ), sin(p θ)]`` of int32 positions ``[..., T, 1]`` along a new last axis (``axis=-1``:
    ``[..., T, width]``) or of ``[..., 1, S]`` along the second-to-last (``axis=-2``: ``[..., width, S]``):
    lanes ``0 .. F - 1`` the cosines, ``F .. 2F - 1`` the sines, the rest zero.

    The phase is reduced modulo one turn exactly: each 8-bit digit of ``|position|`` times the
    frequency's fixed-point turns, summed in int32 arithmetic that wraps modulo ``2**32`` (one
    turn), signed, shifted by a quarter turn in the sine lanes (``sin x = cos(x - π/2)``), then
    converted to radians once (as :func:`~posenc_jax.functional.core.positions.position_angles`
    does in uint32): one cosine per position and lane. The per-lane turns are built by selections
    from scalars, so no array constant enters a kernel.
    """
    half = len(turns[0])
    lanes = _lanes(width, axis, positions.ndim)
    magnitude = jnp.abs(positions)  # -2**31 stays -2**31: its bits are 2**31, read by logical shifts
    phase = jnp.zeros((), jnp.int32)
    for k, per_frequency in enumerate(turns):
        row = jnp.zeros(lanes.shape, jnp.int32)
        for f, turn in enumerate(per_frequency):
            row = jnp.where((lanes == f) | (lanes == f + half), np.int32(turn), row)
        digit = jax.lax.shift_right_logical(magnitude, np.int32(_DIGIT_BITS * k)) & ((1 << _DIGIT_BITS) - 1)
        phase = phase + digit * row  # wraps modulo 2**32: one turn
    phase = jnp.where(positions < 0, -phase, phase)  # the signed phase, still exact modulo one turn
    # sin x = cos(x - a quarter turn): the sine lanes' phase shifted exactly, so one cosine per lane.
    phase = jnp.where(lanes < half, phase, phase - np.int32(1 << 30))
    angles = phase.astype(jnp.float32) * jnp.float32(2.0 * math.pi / 2.0**32)  # in [-π, π)
    return jnp.where(lanes < 2 * half, jnp.cos(angles), 0.0)


def _sandwich_head(num_heads: int, dim: int, base: float) -> HeadBias:
    """Sandwich's per-head form: the factors ``1 / (h · 8 / N)`` ``[N, 1]`` and :func:`_sandwich_at`."""
    num_heads = _check_num_heads(num_heads)
    turns = _digit_turns(sandwich_frequencies(dim, base=base))
    # 1 / (h · 8 / N) for h = 1..N, computed on the host in float64.
    ratio = num_heads / (8.0 * np.arange(1, num_heads + 1, dtype=np.float64))
    return HeadBias((jnp.asarray(ratio, jnp.float32).reshape(num_heads, 1),), functools.partial(_sandwich_at, turns))


def _sandwich_at(turns: tuple, parameters, query_positions, key_positions) -> jax.Array:
    """The one definition of Sandwich's bias: ``(Σ_i cos((j - i) θ_i) - d̄/2) · ratio`` of the head, as
    ``cos α cos β + sin α sin β`` summed by one product of the positions' ``[cos, sin]`` tables."""
    half = len(turns[0])
    width = 2 * half
    if query_positions.ndim == 2:  # a kernel's tile: a power of two >= 16 (Triton's matrix products)
        width = max(16, 1 << (width - 1).bit_length())
    q_table = _phase_table(query_positions, turns, width, -1)  # [..., T, W]
    k_table = _phase_table(key_positions, turns, width, -2)  # [..., W, S]
    # Σ_i cos((β - α)_i): full float32 precision (TF32/bf16 passes would cost ~1e-3 a term).
    total = jnp.matmul(q_table, k_table, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    bias = jnp.minimum(total - jnp.float32(half), jnp.float32(0.0))  # Σ cos <= d̄/2: rounding only
    bias = jnp.where(key_positions == query_positions, jnp.float32(0.0), bias)  # every cos is 1 at r = 0
    return bias * head_column(parameters[0], 0)


def sandwich_bias(num_heads: int, query_positions, key_positions, *, dim: int, base: float = 10000.0) -> jax.Array:
    """Sandwich bias ``[B|1, N, T, S]`` float32.

    ``bias[b, h-1, t, s] = (Σ_{i=1}^{dim/2} cos(r θ_i) - dim/2) / (h · 8 / N)`` with
    ``r = key_pos[b, s] - query_pos[b, t]`` and ``θ_i = base^(-2i/dim)`` (Chi et al. 2023,
    arXiv:2212.10356). The sum is one ``[T, dim] × [dim, S]`` matmul of the positions'
    ``[cos, sin]`` tables (``cos(β - α) = cos α cos β + sin α sin β``), with phases reduced
    modulo 2π exactly, so no ``[T, S, dim/2]`` tensor is formed and large positions keep
    full accuracy.

    Args:
      num_heads: N; head ``h`` (1-based) is divided by ``h · 8 / N``.
      query_positions, key_positions: integer ``[T]``/``[B, T]`` and ``[S]``/``[B, S]``
        (batch sizes equal or 1); any offsets and gaps.
      dim: the sinusoid width d̄, even (the head dim by default in :class:`Sandwich`).
      base: the wavelength base.

    Returns:
      ``[B, N, T, S]`` float32 (B = 1 when both position arrays are 1-D), ``<= 0``, and
      exactly 0 where the key and query positions are equal.

    Example:
      >>> bias = sandwich_bias(2, jnp.arange(3), jnp.arange(4), dim=64)
      >>> bias.shape
      (1, 2, 3, 4)
      >>> np.asarray(bias[0, :, 1], np.float64).round(3)  # the query at position 1; head 2 is head 1 halved
      array([[-0.156,  0.   , -0.156, -0.57 ],
             [-0.078,  0.   , -0.078, -0.285]])
    """
    q = _positions(query_positions, "query_positions")  # [Bq, T]
    k = _positions(key_positions, "key_positions")  # [Bk, S]
    if q.shape[0] != k.shape[0] and 1 not in (q.shape[0], k.shape[0]):
        raise ValueError(
            f"query_positions {q.shape} and key_positions {k.shape} have different batch sizes; "
            "pass equal batch sizes, or 1-D positions shared by the batch"
        )
    return head_bias_at(_sandwich_head(num_heads, dim, base), q, k)


@register_encoding(
    "sandwich",
    description="The dot product of two sinusoidal embeddings minus its maximum, compressed per head (no parameters).",
    source=SANDWICH,
    forms=("causal", "bidirectional"),
    hooks=("logits",),
    tiled=("head",),
    cached=(),
    prepared="bias",
)
@pytree_dataclass
class Sandwich(BiasHook, ParameterFree):
    """Sandwich as a ``logits`` hook; the head count and head dim are read from the context.

    One form serves causal and bidirectional attention (the bias is symmetric in
    ``j - i``). ``dim``: the sinusoid width d̄ (even), None for the head dim. ``base``:
    the wavelength base of ``θ_i = base^(-2i/d̄)``.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 6, 8)); pos = jnp.arange(4)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[Sandwich()], causal=True).shape
      (1, 4, 6, 8)
      >>> Sandwich(dim=7)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: Sandwich dim must be an even integer >= 2 (...), got 7; pass an even dim (e.g. 8)
    """

    dim: int | None = None
    base: float = 10000.0
    acts_on: ClassVar[Placement] = "shared_bias"

    def __post_init__(self):
        if self.dim is not None:
            _check_dim(self.dim)
        _check_base(self.base)

    def _dim(self, context: AttentionContext) -> int:
        if self.dim is None:
            return _check_dim(context.head_dim, f"dim (None: the head dim, {context.head_dim})")
        return self.dim

    def bias(self, context: AttentionContext) -> jax.Array:
        """The ``[B|1, N, T, S]`` bias, to compute once and share across layers."""
        return sandwich_bias(
            context.num_heads, context.query_positions, context.key_positions, dim=self._dim(context), base=self.base
        )

    def head_bias(self, context: AttentionContext) -> HeadBias:
        """The per-head form of :meth:`bias` (the Pallas kernel computes it per tile)."""
        return _sandwich_head(context.num_heads, self._dim(context), self.base)
