"""Boolean attention masks: True where a query may attend to a key.

A *mask* says which (query, key) pairs exist; a *bias* (an encoding's ``logits``
hook) is an additive float that says how much they should attend. Masks are
boolean and shaped to broadcast against the ``[B, N, T, S]`` scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.hooks import parameter, pytree_dataclass
from posenc_jax.functional.core.positions import batched_positions, check_positions, with_batch_axis

__all__ = [
    "MaskParts",
    "causal_mask",
    "combine_masks",
    "key_padding_mask",
    "keys_seen_by_segment",
    "queries_seeing_by_segment",
    "segment_mask",
    "sequence_key_counts",
]


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
    return _causal_mask(
        batched_positions(query_positions, "query_positions"), batched_positions(key_positions, "key_positions")
    )


def _causal_mask(query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """:func:`causal_mask` of positions already checked, ``[T]`` or ``[B|1, T]``."""
    q, k = with_batch_axis(query_positions), with_batch_axis(key_positions)
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


def keys_seen_by_segment(query_segment_ids, key_segment_ids, query_positions=None, key_positions=None) -> jax.Array:
    """Whether some query may attend to each key under the segment mask (and the causal one), ``[B, S]``.

    ``seen[b, s] = any_t seg_q[b, t] == seg_k[b, s]`` and, with positions, also
    ``key_pos[b, s] <= query_pos[b, t]``: the ``any`` over queries of
    ``segment_mask & causal_mask`` without building it. Linear memory: the queries are
    sorted by (segment, position) and each key looks up the last query of its segment,
    which holds the segment's largest query position.

    Args:
      query_segment_ids, key_segment_ids: integer ``[B|1, T]`` / ``[B|1, S]`` (or ``[T]`` / ``[S]``).
      query_positions, key_positions: integer ``[B|1, T]`` / ``[B|1, S]`` (or ``[T]`` / ``[S]``) for
        causal attention, or both None.

    Returns:
      boolean ``[B, S]``.
    """
    if query_positions is not None:
        query_positions = check_positions(query_positions, "query_positions")
        key_positions = check_positions(key_positions, "key_positions")
    return _keys_seen_by_segment(query_segment_ids, key_segment_ids, query_positions, key_positions)


def _keys_seen_by_segment(query_segment_ids, key_segment_ids, query_positions, key_positions) -> jax.Array:
    """:func:`keys_seen_by_segment` with positions (or None) already checked."""
    qseg = _batched(_check_segment_ids(query_segment_ids, "query_segment_ids"))
    kseg = _batched(_check_segment_ids(key_segment_ids, "key_segment_ids"))
    causal = query_positions is not None
    if causal:
        qpos, kpos = with_batch_axis(query_positions), with_batch_axis(key_positions)
    else:
        qpos = jnp.zeros(qseg.shape[-1:], jnp.int32)[None]
        kpos = jnp.zeros(kseg.shape[-1:], jnp.int32)[None]
    batch = max(qseg.shape[0], kseg.shape[0], qpos.shape[0], kpos.shape[0])
    qseg, qpos = (jnp.broadcast_to(a, (batch, a.shape[-1])) for a in (qseg, qpos))
    kseg, kpos = (jnp.broadcast_to(a, (batch, a.shape[-1])) for a in (kseg, kpos))

    def one(qseg, qpos, kseg, kpos):
        order = jnp.lexsort((qpos, qseg))  # by segment, then position: a segment's last query is its latest
        sorted_seg = qseg[order]
        last = jnp.searchsorted(sorted_seg, kseg, side="right", method="sort") - 1
        at = jnp.maximum(last, 0)
        seen = (last >= 0) & (sorted_seg[at] == kseg)
        return seen & (kpos <= qpos[order][at]) if causal else seen

    return jax.vmap(one)(qseg, qpos, kseg, kpos)


def queries_seeing_by_segment(
    query_segment_ids, key_segment_ids, marked, query_positions=None, key_positions=None
) -> jax.Array:
    """Whether each query may attend to some marked key under the segment mask (and the causal one), ``[B, T]``.

    ``out[b, t] = any_s marked[b, s] ∧ seg_q[b, t] == seg_k[b, s]`` and, with positions, also
    ``key_pos[b, s] <= query_pos[b, t]``: the ``any`` over keys of ``segment_mask & causal_mask``
    restricted to the marked keys, without building it. Linear memory: the marked keys are
    sorted by (segment, position) and each query looks up the first marked key of its
    segment, which holds the segment's smallest marked position.

    Args:
      query_segment_ids, key_segment_ids: integer ``[B|1, T]`` / ``[B|1, S]`` (or ``[T]`` / ``[S]``).
      marked: boolean ``[B|1, S]``.
      query_positions, key_positions: integer ``[B|1, T]`` / ``[B|1, S]`` (or ``[T]`` / ``[S]``) for
        causal attention, or both None.

    Returns:
      boolean ``[B, T]``.
    """
    if query_positions is not None:
        query_positions = check_positions(query_positions, "query_positions")
        key_positions = check_positions(key_positions, "key_positions")
    return _queries_seeing_by_segment(query_segment_ids, key_segment_ids, marked, query_positions, key_positions)


def _queries_seeing_by_segment(query_segment_ids, key_segment_ids, marked, query_positions, key_positions):
    qseg = _batched(_check_segment_ids(query_segment_ids, "query_segment_ids"))
    kseg = _batched(_check_segment_ids(key_segment_ids, "key_segment_ids"))
    marked = _batched(jnp.asarray(marked))
    causal = query_positions is not None
    if causal:
        qpos, kpos = with_batch_axis(query_positions), with_batch_axis(key_positions)
    else:
        qpos = jnp.zeros(qseg.shape[-1:], jnp.int32)[None]
        kpos = jnp.zeros(kseg.shape[-1:], jnp.int32)[None]
    batch = max(qseg.shape[0], kseg.shape[0], qpos.shape[0], kpos.shape[0], marked.shape[0])
    qseg, qpos = (jnp.broadcast_to(a, (batch, a.shape[-1])) for a in (qseg, qpos))
    kseg, kpos, marked = (jnp.broadcast_to(a, (batch, a.shape[-1])) for a in (kseg, kpos, marked))

    def one(qseg, qpos, kseg, kpos, marked):
        order = jnp.lexsort((kpos, kseg, ~marked))  # marked keys first, by segment, then position
        count = marked.sum()
        # Unmarked keys as the largest id: the ids stay sorted; a query never finds them (below `count`).
        sorted_seg = jnp.where(jnp.arange(kseg.shape[0]) < count, kseg[order], jnp.iinfo(kseg.dtype).max)
        first = jnp.searchsorted(sorted_seg, qseg, side="left", method="sort")
        at = jnp.minimum(first, kseg.shape[0] - 1)
        seen = (first < count) & (sorted_seg[at] == qseg)
        return seen & (kpos[order][at] <= qpos) if causal else seen

    return jax.vmap(one)(qseg, qpos, kseg, kpos, marked)


@pytree_dataclass
class MaskParts:
    """The pieces of an attention call's mask, kept apart so no ``[B, N, T, S]`` mask need be stored.

    :meth:`mask` combines them into the boolean mask the scores are masked with: a
    comparison of positions and of segment ids that XLA computes inside each fusion that
    reads it. What is asked of the mask beyond that elementwise use is answered from the
    parts: which keys some query may see (:meth:`keys_seen`, in linear memory except with
    an extra mask combined with other parts) and whether the mask is the same for every
    query (:meth:`per_key`).

    Args:
      query_positions, key_positions: int32 ``[T]`` / ``[S]`` or ``[B|1, T]`` / ``[B|1, S]``
        positions of a causal call, else None; checked by the call's entry point, not again here.
      key_valid: boolean ``[B|1, S]``, True for real keys, or None.
      query_segment_ids, key_segment_ids: integer ``[B|1, T]`` / ``[B|1, S]``, or None.
      extra: a boolean mask ``[B|1, N|1, T|1, S|1]`` (True = attend), or None.
    """

    query_positions: jax.Array | None = parameter(default=None)
    key_positions: jax.Array | None = parameter(default=None)
    key_valid: jax.Array | None = parameter(default=None)
    query_segment_ids: jax.Array | None = parameter(default=None)
    key_segment_ids: jax.Array | None = parameter(default=None)
    extra: jax.Array | None = parameter(default=None)

    def mask(self) -> jax.Array | None:
        """The combined boolean mask, broadcastable to ``[B, N, T, S]`` (True = attend), or None."""
        causal = self.query_positions is not None
        return combine_masks(
            _causal_mask(self.query_positions, self.key_positions) if causal else None,
            None if self.key_valid is None else self.key_valid[:, None, None, :],
            None if self.query_segment_ids is None else segment_mask(self.query_segment_ids, self.key_segment_ids),
            self.extra,
        )

    def per_key(self) -> bool:
        """Whether the mask is the same for every query and head (``[B|1, 1, 1, S]``), e.g. padding alone."""
        per_query = [self.query_positions, self.query_segment_ids]
        return all(ids is None or ids.shape[-1] == 1 for ids in per_query) and (
            self.extra is None or self.extra.shape[1] == self.extra.shape[2] == 1
        )

    def queries_seeing(self, marked: jax.Array) -> jax.Array:
        """``[B, N|1, T|1]``: whether each query may attend to some key where ``marked`` (``[B, S]``) is True.

        Equal to ``(mask() & marked[:, None, None, :]).any(axis=3)`` (the reference, used when an
        extra mask is given), computed from the parts in linear memory otherwise.
        """
        if self.key_valid is not None:
            marked = jnp.logical_and(marked, self.key_valid)
        if self.extra is not None:
            return jnp.logical_and(self.mask(), marked[:, None, None, :]).any(axis=3)
        causal = self.query_positions is not None
        if self.query_segment_ids is not None:
            seen = _queries_seeing_by_segment(
                self.query_segment_ids,
                self.key_segment_ids,
                marked,
                self.query_positions if causal else None,
                self.key_positions if causal else None,
            )
        elif causal:
            # The earliest marked key; a query at or after it sees it.
            marked, kpos = jnp.broadcast_arrays(marked, with_batch_axis(self.key_positions))
            earliest = jnp.where(marked, kpos, jnp.iinfo(kpos.dtype).max).min(axis=-1, keepdims=True)
            seen = marked.any(axis=-1, keepdims=True) & (earliest <= with_batch_axis(self.query_positions))
        else:
            seen = marked.any(axis=-1, keepdims=True)  # [B, 1]: the mask is the same for every query
        return seen[:, None, :]

    def keys_seen(self) -> jax.Array | None:
        """``[B|1, S]``: whether any query of any head may attend to each key, or None without a mask.

        Equal to ``mask().any(axis=(1, 2))`` (the reference, used when an extra mask is combined
        with other parts), computed from the parts in linear memory otherwise.
        """
        causal = self.query_positions is not None
        segments = self.query_segment_ids is not None
        if self.extra is not None:
            if not (causal or segments or self.key_valid is not None):
                return self.extra.any(axis=(1, 2))
            return self.mask().any(axis=(1, 2))
        seen = None
        if segments:
            seen = _keys_seen_by_segment(
                self.query_segment_ids,
                self.key_segment_ids,
                self.query_positions if causal else None,
                self.key_positions if causal else None,
            )
        elif causal:
            latest = with_batch_axis(self.query_positions).max(axis=-1, keepdims=True)
            seen = with_batch_axis(self.key_positions) <= latest
        if self.key_valid is not None:
            seen = self.key_valid if seen is None else jnp.logical_and(seen, self.key_valid)
        return seen
