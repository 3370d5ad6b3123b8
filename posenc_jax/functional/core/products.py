"""The two products of attention: the content scores ``scale · q·k`` and the value product ``w · v``.

Both with grouped-query heads (query head n reads key/value head ``n // (N / K)``), float32
accumulation, and the einsums of the survey pseudocode (``'BTNH,BSNH->BNTS'``,
``'BNTS,BSNH->BTNH'``). Shared by the materialising and the blockwise attention.
"""

from __future__ import annotations

import einops
import jax
import jax.numpy as jnp

from posenc_jax.functional.core.masks import MaskParts

__all__ = [
    "NONFINITE_KEYS",
    "as_scores",
    "broadcasts_to",
    "content_scores",
    "key_heads_for_queries",
    "masked_value_product",
    "value_product",
]


def as_scores(term: jax.Array, ndim: int, dtype=jnp.float32) -> jax.Array:
    """A logits term (or a mask) as ``dtype``, left-padded to the rank of the [B, N, T, S] scores."""
    term = term.astype(dtype)
    return term.reshape((1,) * (ndim - term.ndim) + term.shape) if term.ndim < ndim else term


def broadcasts_to(shape: tuple, target: tuple) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` (without growing ``target``)."""
    return len(shape) <= len(target) and all(d in (1, t) for d, t in zip(shape[::-1], target[::-1], strict=False))


def key_heads_for_queries(key: jax.Array, num_heads: int) -> jax.Array:
    """``[B, S, K, H]`` keys as ``[B, S, N, H]``: each key/value head repeated for its ``N / K`` query heads."""
    return key if key.shape[-2] == num_heads else jnp.repeat(key, num_heads // key.shape[-2], axis=-2)


def content_scores(query: jax.Array, key: jax.Array, scale: float) -> jax.Array:
    """``scale · q·k``: ``[B, T, N, H]`` by ``[B, S, K, H]``, float32 ``[B, N, T, S]`` (grouped heads)."""
    if query.shape[2] == key.shape[2]:
        # Not the grouped form with G = 1: XLA:CPU computes that one as [S, T] and transposes it.
        if query.dtype == jnp.float32:
            return jnp.einsum("BTNH,BSNH->BNTS", query * jnp.float32(scale), key, preferred_element_type=jnp.float32)
        scores = jnp.einsum("BTNH,BSNH->BNTS", query, key, preferred_element_type=jnp.float32)
        return scores * jnp.float32(scale)
    grouped = einops.rearrange(query, "B T (K G) H -> B T K G H", K=key.shape[2])
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", grouped, key, preferred_element_type=jnp.float32)
    return einops.rearrange(scores, "B K G T S -> B (K G) T S") * jnp.float32(scale)


# Keys per batch row whose non-finite entries reach the rows that see them feature by feature.
NONFINITE_KEYS = 8


def masked_value_product(weights: jax.Array, value: jax.Array, mask: jax.Array | MaskParts) -> jax.Array:
    """``out[b,t,n] = Σ_s w[b,n,t,s] · v[b,s,n]`` over the keys ``mask`` lets row t see, float32 ``[B, T, N, H]``.

    Masked values never reach a row, whatever they hold, and there is no conditional.
    ``0 · NaN`` is NaN, so the plain einsum would let a masked key's non-finite value poison
    every row. Here the einsum takes the values with their non-finite entries as 0, and
    each row gets what the non-finite entries of the keys it may see bring, feature by
    feature: with ``v̄ = where(isfinite(v), 0, v)`` and ``P`` the first ``NONFINITE_KEYS``
    (8) keys of the batch row whose value vector holds one,

        out[t] = Σ_s w[t, s] · where(isfinite(v), v, 0)[s]  +  Σ_{s ∈ P} where(mask[t, s], v̄[s], 0)

    so a feature is ``+inf`` or ``-inf`` where the row sees that infinity, and NaN where it
    sees a NaN or both infinities: what the plain product gives a row whose weights on those
    keys are positive (a weight of exactly 0 there would give NaN for ``0 · inf``, a negative
    one the other infinity). The second term reads ``P`` gathered columns of the mask and
    none of the weights, an elementwise ``[B, N, T, P, H]`` term. Past ``P`` such keys (values
    mostly NaN), a row that may see a further one is NaN in every feature: which rows is
    ``any_s mask[t, s] ∧ u[s]`` with ``u[s]`` true for those keys, from the mask's parts in
    linear memory (:meth:`~posenc_jax.functional.core.masks.MaskParts.queries_seeing`), or one
    reduction of a mask given whole. Rows that see no non-finite value get the einsum's result
    alone, and the derivative is the einsum's on the finite values (the rows a non-finite
    value reaches are NaN or infinite).

    Args:
      weights: ``[B, N, T, S]`` weights, zero where masked.
      value: ``[B, S, K, H]`` (grouped heads: query head n reads value head ``n // (N / K)``).
      mask: boolean, broadcastable to ``[B, N, T, S]``, True where row t may see key s, or the
        :class:`~posenc_jax.functional.core.masks.MaskParts` it is made of.

    Returns:
      float32 ``[B, T, N, H]``.

    Example:
      >>> w = jnp.array([[[[1.0, 0.0], [0.5, 0.5]]]])  # [1, 1, 2, 2]: row 0 sees key 0 only
      >>> v = jnp.array([[[[1.0]], [[jnp.nan]]]])  # [1, 2, 1, 1]: key 1 holds NaN
      >>> masked_value_product(w, v, jnp.tril(jnp.ones((2, 2), bool)))[0, :, 0, 0]
      Array([ 1., nan], dtype=float32)
    """
    finite = jnp.isfinite(value)
    out = value_product(weights, jnp.where(finite, value, jnp.zeros((), value.dtype)))
    return out + _seen_nonfinite(jax.lax.stop_gradient(value), finite, mask, weights.shape[1], weights.shape[2])


def _seen_nonfinite(value: jax.Array, finite: jax.Array, mask, num_heads: int, q_len: int) -> jax.Array:
    """The second term of :func:`masked_value_product` and its NaN past ``P`` keys, float32 ``[B, T, N, H]``."""
    batch, k_len, num_kv_heads, head_dim = value.shape
    group = num_heads // num_kv_heads
    bad = ~finite.all(axis=(2, 3))  # [B, S]: the key's value vector holds a non-finite entry
    picked = min(NONFINITE_KEYS, k_len)
    first = jnp.where(bad, k_len - jnp.arange(k_len, dtype=jnp.int32)[None], 0)  # earlier keys score higher
    score, keys = jax.lax.top_k(first, picked)  # [B, P]: the first keys that hold one, then any (score 0)
    nonfinite = jnp.where(finite, jnp.zeros((), value.dtype), value)
    nonfinite = jnp.take_along_axis(nonfinite, keys[:, :, None, None], axis=1).astype(jnp.float32)  # [B, P, K, H]
    parts = mask if isinstance(mask, MaskParts) else None
    mask = as_scores(mask if parts is None else parts.mask(), 4, dtype=jnp.bool_)  # [B|1, N|1, T|1, S]
    columns = jnp.broadcast_to(mask, (batch, *mask.shape[1:3], k_len))
    sees = jnp.take_along_axis(columns, keys[:, None, None, :], axis=3) & (score > 0)[:, None, None, :]
    # Keys that hold one past the first P: after the P-th, when there are P of them.
    further = bad & (jnp.arange(k_len)[None] > keys[:, -1:]) & (score[:, -1:] > 0)
    # [B, N|1, T|1]: the rows that may see one of them.
    reached = (mask & further[:, None, None, :]).any(axis=3) if parts is None else parts.queries_seeing(further)
    if mask.shape[1] == 1:
        sees, reached = sees[:, :, None], reached[:, :, None]  # [B, 1, 1, T, P], [B, 1, 1, T]
    else:
        sees = einops.rearrange(sees, "B (K G) T P -> B K G T P", K=num_kv_heads)
        reached = einops.rearrange(reached, "B (K G) T -> B K G T", K=num_kv_heads)
    nonfinite = einops.rearrange(nonfinite, "B P K H -> B K 1 1 P H")
    term = jnp.zeros((batch, num_kv_heads, 1, q_len, head_dim), jnp.float32)
    for p in range(picked):  # P terms of [B, K, G|1, T, H], one fused pass
        term = term + jnp.where(sees[..., p, None], nonfinite[..., p, :], 0.0)
    term = jnp.where(reached[..., None], jnp.nan, term)
    term = jnp.broadcast_to(term, (batch, num_kv_heads, group, q_len, head_dim))
    return einops.rearrange(term, "B K G T H -> B T (K G) H")


def value_product(weights: jax.Array, value: jax.Array) -> jax.Array:
    """``weights · v``: ``[B, N, T, S]`` by ``[B, S, K, H]``, float32 ``[B, T, N, H]`` (grouped heads)."""
    num_kv_heads = value.shape[2]
    grouped = einops.rearrange(weights, "B (K G) T S -> B K G T S", K=num_kv_heads).astype(value.dtype)
    # v as [B, K, S, H] (a copy of v, not of the weights): with 'BSKH' XLA:CPU computes the product
    # transposed, copying the weights to [.., S, T] (a fused transposing pass over [B, N, T, S]).
    by_head = einops.rearrange(value, "B S K H -> B K S H")
    out = jnp.einsum("BKGTS,BKSH->BKGTH", grouped, by_head, preferred_element_type=jnp.float32)
    return einops.rearrange(out, "B K G T H -> B T (K G) H")
