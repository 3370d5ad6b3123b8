"""Boolean attention masks: True where a query may attend to a key.

A *mask* says which (query, key) pairs exist; a *bias* (an encoding's ``logits``
hook) is an additive float that says how much they should attend. Masks are
boolean and shaped to broadcast against the ``[B, N, T, S]`` scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax.functional.positions import batched_positions

__all__ = ["causal_mask", "combine_masks", "key_padding_mask", "segment_mask", "sequence_key_counts"]


def _batched(x: jax.Array) -> jax.Array:
    return x if x.ndim >= 2 else x[None]


def causal_mask(query_positions, key_positions) -> jax.Array:
    """``mask[b, 0, t, s] = key_pos[b, s] <= query_pos[b, t]``, ``[B|1, 1, T, S]``.

    Causality is by position, not by array index, so a query decoding at
    position 37 against a cache of keys at 0..37 sees exactly those keys, and
    packed segments whose positions restart at 0 stay causal within each segment.
    Positions are compared, not subtracted, so the mask is right for any int32 positions.

    Example:
      >>> causal_mask(jnp.arange(3), jnp.arange(3))[0, 0].astype(int)
      Array([[1, 0, 0],
             [1, 1, 0],
             [1, 1, 1]], dtype=int32)
    """
    q = batched_positions(query_positions, "query_positions")
    k = batched_positions(key_positions, "key_positions")
    return k[:, None, None, :] <= q[:, None, :, None]


def _check_segment_ids(ids, name: str) -> jax.Array:
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array [B, T] (one id per packed sequence), got dtype {ids.dtype}")
    return ids


def segment_mask(query_segment_ids, key_segment_ids) -> jax.Array:
    """``mask[b, 0, t, s] = seg_q[b, t] == seg_k[b, s]``, ``[B, 1, T, S]``, for packed rows."""
    q = _batched(_check_segment_ids(query_segment_ids, "query_segment_ids"))
    k = _batched(_check_segment_ids(key_segment_ids, "key_segment_ids"))
    return q[:, None, :, None] == k[:, None, None, :]


def key_padding_mask(key_mask) -> jax.Array:
    """``[B, S]`` booleans (True for real tokens) as a ``[B, 1, 1, S]`` mask."""
    key_mask = jnp.asarray(key_mask)
    if key_mask.dtype != jnp.bool_:
        raise ValueError(f"key_mask must be boolean [B, S] (True for real tokens), got dtype {key_mask.dtype}")
    return _batched(key_mask)[:, None, None, :]


def combine_masks(*masks) -> jax.Array | None:
    """Logical AND of the masks that are not None; None if all are None."""
    result = None
    for mask in masks:
        if mask is None:
            continue
        result = mask if result is None else jnp.logical_and(result, mask)
    return result


def sequence_key_counts(key_valid, query_segment_ids, key_segment_ids) -> jax.Array | None:
    """For each query, the number of keys of its sequence, ``[B|1, T]`` float32, or None (all S keys).

    Keys count when they are real (``key_valid``) and, with packed segments, in the query's
    segment; the causal mask does not enter (relu²/n divides by the sequence length). Linear
    memory: a sort of the key segment ids and two binary searches per query.
    """
    if query_segment_ids is None:
        if key_valid is None:
            return None
        return key_valid.sum(-1, keepdims=True).astype(jnp.float32)
    qseg = _batched(_check_segment_ids(query_segment_ids, "query_segment_ids"))
    kseg = _batched(_check_segment_ids(key_segment_ids, "key_segment_ids"))
    batch = max(qseg.shape[0], kseg.shape[0], 1 if key_valid is None else key_valid.shape[0])
    qseg = jnp.broadcast_to(qseg, (batch, qseg.shape[1]))
    kseg = jnp.broadcast_to(kseg, (batch, kseg.shape[1]))
    valid = jnp.ones(kseg.shape, bool) if key_valid is None else jnp.broadcast_to(key_valid, kseg.shape)
    # Invalid keys sort last (as the largest id); clipping both searches at the number of
    # valid keys leaves them out even when a real segment id is that largest value.
    ordered = jnp.sort(jnp.where(valid, kseg, jnp.iinfo(kseg.dtype).max), axis=-1)
    num_valid = valid.sum(-1)

    def count(sorted_ids, ids, n):
        left = jnp.minimum(jnp.searchsorted(sorted_ids, ids, side="left"), n)
        right = jnp.minimum(jnp.searchsorted(sorted_ids, ids, side="right"), n)
        return right - left

    return jax.vmap(count)(ordered, qseg, num_valid).astype(jnp.float32)
