"""The two products of attention: the content scores ``scale · q·k`` and the value product ``w · v``.

Both with grouped-query heads (query head n reads key/value head ``n // (N / K)``), float32
accumulation, and the einsums of the survey pseudocode (``'BTNH,BSNH->BNTS'``,
``'BNTS,BSNH->BTNH'``). Shared by the materialising and the blockwise attention.
"""

from __future__ import annotations

import einops
import jax
import jax.numpy as jnp

from posenc_jax.functional.core.relative import by_query_blocks

__all__ = ["as_scores", "broadcasts_to", "content_scores", "selected_product", "value_product"]


def as_scores(term: jax.Array, ndim: int, dtype=jnp.float32) -> jax.Array:
    """A logits term (or a mask) as ``dtype``, left-padded to the rank of the [B, N, T, S] scores."""
    term = term.astype(dtype)
    return term.reshape((1,) * (ndim - term.ndim) + term.shape) if term.ndim < ndim else term


def broadcasts_to(shape: tuple, target: tuple) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` (without growing ``target``)."""
    return len(shape) <= len(target) and all(d in (1, t) for d, t in zip(shape[::-1], target[::-1], strict=False))


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


def selected_product(weights: jax.Array, value: jax.Array, mask: jax.Array, *, block_elements: int = 1 << 22):
    """``out[b,t,n] = Σ_s where(mask[b,n,t,s], w[b,n,t,s] · v[b,s,n], 0)``, float32 ``[B, T, N, H]``.

    Exact whatever the masked values hold; elementwise, by blocks of query rows holding
    about ``block_elements`` products, so only used when a value is not finite.
    """
    batch, num_heads, q_len, k_len = weights.shape
    head_dim = value.shape[-1]
    per_head = jnp.repeat(value, num_heads // value.shape[2], axis=2).astype(jnp.float32)
    per_head = einops.rearrange(per_head, "B S N H -> B N 1 S H")

    def block(start, rows):
        w = jax.lax.dynamic_slice_in_dim(weights, start, rows, axis=2)[..., None]  # [B, N, rows, S, 1]
        m = jax.lax.dynamic_slice_in_dim(mask, start, rows, axis=2)[..., None]  # [B|1, N|1, rows, S, 1]
        return jnp.where(m, w * per_head, 0.0).sum(axis=3)  # [B, N, rows, H]

    mask = jnp.broadcast_to(mask, mask.shape[:2] + (q_len, k_len))
    out = by_query_blocks(
        block, (batch, num_heads, q_len, head_dim), jnp.float32, block_elements=max(1, block_elements // k_len)
    )
    return einops.rearrange(out, "B N T H -> B T N H")


def value_product(weights: jax.Array, value: jax.Array) -> jax.Array:
    """``weights · v``: ``[B, N, T, S]`` by ``[B, S, K, H]``, float32 ``[B, T, N, H]`` (grouped heads)."""
    num_kv_heads = value.shape[2]
    grouped = einops.rearrange(weights, "B (K G) T S -> B K G T S", K=num_kv_heads).astype(value.dtype)
    # v as [B, K, S, H] (a copy of v, not of the weights): with 'BSKH' XLA:CPU computes the product
    # transposed, copying the weights to [.., S, T] (a fused transposing pass over [B, N, T, S]).
    by_head = einops.rearrange(value, "B S K H -> B K S H")
    out = jnp.einsum("BKGTS,BKSH->BKGTH", grouped, by_head, preferred_element_type=jnp.float32)
    return einops.rearrange(out, "B K G T H -> B T (K G) H")
