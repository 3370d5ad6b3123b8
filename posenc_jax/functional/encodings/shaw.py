"""Shaw et al. 2018 relative position representations: key term R_K and value term R_V.

``A = softmax(Q (K + R_K)ᵀ / √H)`` and ``O = A (V + R_V)`` with
``R_{t,s} = P[clip(key_pos[s] - query_pos[t], -k, k)]`` for tables ``P`` of ``2k+1``
learned vectors, shared across heads (``[2k+1, H]``) or per head (``[N, 2k+1, H]``).

Memory-lean: the key term is ``Q · Pᵀ`` (``[B, N, T, 2k+1]``) gathered to
``[B, N, T, S]``; the value term buckets the attention weights into
``[B, N, T, 2k+1]`` and multiplies by ``P_V``. No ``[T, S, H]`` tensor is built.

Reference: Shaw, Uszkoreit and Vaswani, "Self-Attention with Relative Position
Representations", NAACL 2018, arXiv:1803.02155.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import AttentionContext, EncodingConfig, parameter, pytree_dataclass
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.core.relative import check_max_distance, gather_by_distance, sum_by_distance
from posenc_jax.functional.core.validation import check_init_std
from posenc_jax.functional.kernels.relative_tiles import by_saturation, saturated_side

__all__ = ["Shaw", "ShawConfig", "shaw_key_logits", "shaw_value_term"]

SHAW = Source.paper(
    "shaw2018self",
    title="Self-Attention with Relative Position Representations",
    authors="Shaw, Peter and Uszkoreit, Jakob and Vaswani, Ashish",
    year=2018,
    arxiv="1803.02155",
)


def _check_table(table, max_distance: int, head_dim: int | None, name: str) -> None:
    shape = np.shape(table)
    if len(shape) not in (2, 3):
        raise ValueError(f"{name} must have shape [2k+1, H] (shared) or [N, 2k+1, H] (per head), got {shape}")
    rows = shape[-2]
    if rows != 2 * max_distance + 1:
        raise ValueError(
            f"{name} has {rows} relative rows but max_distance={max_distance} needs 2*{max_distance}+1 = "
            f"{2 * max_distance + 1}; pass a table of that length or the matching max_distance"
        )
    if head_dim is not None and shape[-1] != head_dim:
        raise ValueError(f"{name} width {shape[-1]} does not match the head dim {head_dim}")


def shaw_key_logits(q, table, query_positions, key_positions, *, max_distance: int, scale: float | None = None):
    """Shaw's key term ``scale · q_t · P_K[clip(key_pos[s] - query_pos[t], -k, k) + k]``.

    Args:
      q: ``[B, T, N, H]`` queries.
      table: ``[2k+1, H]`` or ``[N, 2k+1, H]`` key-side relative vectors ``P_K``.
      query_positions, key_positions: integer ``[T]``/``[B, T]`` and ``[S]``/``[B, S]``.
      max_distance: the clip distance k >= 1.
      scale: default ``1/√H``, the same scale as the content scores.

    Returns:
      ``[B, N, T, S]`` float32 logits term.

    Example:
      >>> q = jnp.ones((1, 4, 2, 8)); table = jnp.ones((5, 8))
      >>> shaw_key_logits(q, table, jnp.arange(4), jnp.arange(4), max_distance=2).shape
      (1, 2, 4, 4)
    """
    k = check_max_distance(max_distance)
    _check_table(table, k, q.shape[-1], "key table")
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    spec = "BTNH,RH->BNTR" if np.ndim(table) == 2 else "BTNH,NRH->BNTR"
    per_distance = jnp.einsum(spec, q, table, preferred_element_type=jnp.float32)
    return gather_by_distance(per_distance, query_positions, key_positions, sign=1, offset=k) * jnp.float32(scale)


def shaw_value_term(
    weights, table, query_positions, key_positions, *, max_distance: int, mask=None, block_elements: int = 1 << 20
):
    """Shaw's value term ``Σ_s w[t, s] · P_V[clip(key_pos[s] - query_pos[t], -k, k) + k]``.

    Args:
      weights: ``[B, N, T, S]`` attention weights.
      table: ``[2k+1, H]`` or ``[N, 2k+1, H]`` value-side relative vectors ``P_V``.
      query_positions, key_positions: integer position arrays.
      max_distance: the clip distance k >= 1.
      mask: optional boolean mask broadcastable to ``[B, N, T, S]``; weights it hides
        are left out by selection, whatever they hold.
      block_elements: about how many weights each block of query rows holds.

    Returns:
      ``[B, T, N, H]`` float32 term to add to the attention output.
    """
    k = check_max_distance(max_distance)
    _check_table(table, k, None, "value table")
    buckets = sum_by_distance(
        weights.astype(jnp.float32),
        query_positions,
        key_positions,
        sign=1,
        offset=k,
        slots=2 * k + 1,
        mask=mask,
        block_elements=block_elements,
    )  # [B, N, T, 2k+1]
    spec = "BNTR,RH->BTNH" if np.ndim(table) == 2 else "BNTR,NRH->BTNH"
    return jnp.einsum(spec, buckets, table, preferred_element_type=jnp.float32)


@pytree_dataclass
class Shaw:
    """Shaw et al. relative positions as ``logits`` (R_K) and ``values`` (R_V) hooks.

    Either table may be None to leave that term out. Tables are parameters held
    by the caller's module.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 6, 2, 8)); pos = jnp.arange(6)
      >>> shaw = Shaw(max_distance=2, key_table=jnp.zeros((5, 8)), value_table=jnp.zeros((5, 8)))
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, encodings=[shaw]).shape
      (1, 6, 2, 8)
    """

    max_distance: int
    key_table: jax.Array | None = parameter(default=None)
    value_table: jax.Array | None = parameter(default=None)
    scale: float | None = None

    def __post_init__(self):
        check_max_distance(self.max_distance)
        if self.key_table is None and self.value_table is None:
            raise ValueError("Shaw needs a key_table, a value_table or both")
        if self.key_table is not None:
            _check_table(self.key_table, self.max_distance, None, "key table")
        if self.value_table is not None:
            _check_table(self.value_table, self.max_distance, None, "value table")

    def logits(self, q, k, context: AttentionContext):
        if self.key_table is None:
            return None
        scale = context.scale if self.scale is None else self.scale
        return shaw_key_logits(
            q,
            self.key_table,
            context.query_positions,
            context.key_positions,
            max_distance=self.max_distance,
            scale=scale,
        )

    def values(self, weights, context: AttentionContext):
        if self.value_table is None:
            return None
        return shaw_value_term(
            weights,
            self.value_table,
            context.query_positions,
            context.key_positions,
            max_distance=self.max_distance,
            mask=context.mask,
        )

    def tile_logits(self, q, k, context: AttentionContext):
        """:meth:`logits` for one blockwise tile: ``q_t · P_K[end]`` broadcast over a tile wholly past the clip."""
        if self.key_table is None:
            return None
        scale = jnp.float32(context.scale if self.scale is None else self.scale)
        plain = lambda: self.logits(q, k, context)
        shape = jax.eval_shape(plain).shape
        spec = "BTNH,H->BNT" if np.ndim(self.key_table) == 2 else "BTNH,NH->BNT"

        def end(row: int):
            per_row = jnp.einsum(spec, q, self.key_table[..., row, :], preferred_element_type=jnp.float32)
            return jnp.broadcast_to((per_row * scale)[..., None], shape)

        side = saturated_side(context.query_positions, context.key_positions, reach=self.max_distance)
        return by_saturation(side, plain, lambda: end(0), lambda: end(-1))

    def tile_scores(self, q, k, context: AttentionContext, content):
        """``content(q, k) + logits(q, k, context)`` for one blockwise tile: past the clip every key reads
        ``P_K[end]``, so it joins the keys (``q · (k_s + P_K[end])``, rescaled when ``scale`` differs from the
        content's) and the tile is one contraction."""
        if self.key_table is None:
            return content(q, k)
        if np.ndim(self.key_table) == 3 and k.shape[2] != q.shape[2]:  # grouped keys: one key, many heads' rows
            return content(q, k) + self.tile_logits(q, k, context)
        ratio = 1.0 if self.scale is None else self.scale / context.scale

        def shifted(row: int):
            end = (self.key_table[..., row, :] * ratio).astype(k.dtype)  # [H] or [N, H]
            return content(q, k + end.reshape(1, 1, -1, k.shape[-1]))

        side = saturated_side(context.query_positions, context.key_positions, reach=self.max_distance)
        return by_saturation(
            side, lambda: content(q, k) + self.logits(q, k, context), lambda: shifted(0), lambda: shifted(-1)
        )

    def tile_values(self, weights, context: AttentionContext):
        """:meth:`values` for one blockwise tile: each row's weights summed, times ``P_V[end]``, past the clip."""
        if self.value_table is None:
            return None
        spec = "BNT,H->BTNH" if np.ndim(self.value_table) == 2 else "BNT,NH->BTNH"

        def end(row: int):
            seen = weights if context.mask is None else jnp.where(context.mask, weights, jnp.zeros((), weights.dtype))
            total = seen.astype(jnp.float32).sum(axis=-1)  # [B, N, T]
            return jnp.einsum(spec, total, self.value_table[..., row, :], preferred_element_type=jnp.float32)

        side = saturated_side(context.query_positions, context.key_positions, reach=self.max_distance)
        return by_saturation(side, lambda: self.values(weights, context), lambda: end(0), lambda: end(-1))


@register_encoding(
    "shaw",
    description="Learned vectors per clipped distance added to the keys (R_K) and to the values (R_V).",
    source=SHAW,
    small_settings=dict(max_distance=3),
    hook=Shaw,
    hooks=("logits", "values"),
    tiled=("logits", "scores", "values"),
    cached=(),
    prepared=None,
)
@pytree_dataclass
class ShawConfig(EncodingConfig):
    """Shaw et al. tables ``[2k+1, H]`` (or per head ``[N, 2k+1, H]``) for keys and, optionally, values."""

    max_distance: int = 16
    value_term: bool = True
    per_head: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        check_max_distance(self.max_distance)
        check_init_std(self.init_std)

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        rows = 2 * self.max_distance + 1
        shape = (num_heads, rows, head_dim) if self.per_head else (rows, head_dim)
        k1, k2 = jax.random.split(key)
        params = {"key_table": jax.random.normal(k1, shape, jnp.float32) * self.init_std}
        if self.value_term:
            params["value_table"] = jax.random.normal(k2, shape, jnp.float32) * self.init_std
        return params

    def build(self, params: dict) -> Shaw:
        return Shaw(self.max_distance, params["key_table"], params.get("value_table"))
