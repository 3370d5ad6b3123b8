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

Reference: Chi, Fan, Rudnicky and Ramadge, "Dissecting Transformer Length Extrapolation
via the Lens of Receptive Field Analysis", ACL 2023, arXiv:2212.10356.
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import AttentionContext, BiasHook, ParameterFree, Placement, pytree_dataclass
from posenc_jax.functional.core.positions import batched_positions, position_angles
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


def _phase_table(positions: jax.Array, theta: np.ndarray) -> jax.Array:
    """``[cos(p θ), sin(p θ)]`` per position, ``[B|1, T, 2F]`` float32, phases reduced exactly."""
    angles = position_angles(positions, theta)
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


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
    num_heads = _check_num_heads(num_heads)
    theta = sandwich_frequencies(dim, base=base)
    half = theta.shape[0]
    q = _positions(query_positions, "query_positions")  # [Bq, T]
    k = _positions(key_positions, "key_positions")  # [Bk, S]
    if q.shape[0] != k.shape[0] and 1 not in (q.shape[0], k.shape[0]):
        raise ValueError(
            f"query_positions {q.shape} and key_positions {k.shape} have different batch sizes; "
            "pass equal batch sizes, or 1-D positions shared by the batch"
        )
    batch = max(q.shape[0], k.shape[0])
    q_table = jnp.broadcast_to(_phase_table(q, theta), (batch, q.shape[1], 2 * half))
    k_table = jnp.broadcast_to(_phase_table(k, theta), (batch, k.shape[1], 2 * half))
    # Σ_i cos((β - α)_i): full float32 precision (TF32/bf16 passes would cost ~1e-3 a term).
    total = jnp.einsum(
        "btf,bsf->bts", q_table, k_table, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    bias = jnp.minimum(total - jnp.float32(half), jnp.float32(0.0))  # Σ cos <= d̄/2: rounding only
    bias = jnp.where(k[:, None, :] == q[:, :, None], jnp.float32(0.0), bias)  # every cos is 1 at r = 0
    # 1 / (h · 8 / N) for h = 1..N, computed on the host in float64.
    ratio = num_heads / (8.0 * np.arange(1, num_heads + 1, dtype=np.float64))
    return bias[:, None] * jnp.asarray(ratio, jnp.float32).reshape(1, num_heads, 1, 1)


@register_encoding(
    "sandwich",
    description="The dot product of two sinusoidal embeddings minus its maximum, compressed per head (no parameters).",
    source=SANDWICH,
    forms=("causal", "bidirectional"),
    hooks=("logits",),
    tiled=(),
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

    def bias(self, context: AttentionContext) -> jax.Array:
        """The ``[B|1, N, T, S]`` bias, to compute once and share across layers."""
        if self.dim is None:
            dim = _check_dim(context.head_dim, f"dim (None: the head dim, {context.head_dim})")
        else:
            dim = self.dim
        return sandwich_bias(context.num_heads, context.query_positions, context.key_positions, dim=dim, base=self.base)
