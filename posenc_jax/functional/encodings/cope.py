"""CoPE: contextual position encoding (Golovneva et al. 2024).

Positions are counted by the context instead of by tokens. With gates on the keys a
query may see (causal),

``g[t, s] = σ(q_t · k_s / √H)``, ``p[t, s] = Σ_{s' = s}^{t} g[t, s']``,

the position of key s for query t is a fractional count of "relevant" keys between s
and t (a reverse cumulative sum of the gates). It is clipped to ``P - 1`` and its
embedding is interpolated from learned integer embeddings ``e[0..P-1]``; the term added
to the scores is

``q_t · e[p] = (1 - w) · z[t, ⌊p⌋] + w · z[t, ⌊p⌋ + 1]``, ``w = p - ⌊p⌋``, ``z = q · eᵀ``,

computed as ``z`` (``[B, N, T, P]``) and two gathers, never as ``[T, S, H]``.

Keys must be in position order (as in any causal sequence or cache). The gates
count only the keys the query may see: the causal mask by position and, in an
attention, the call's whole mask (padding, a cache's empty slots, segments), so a
masked key changes no other key's position, whatever it holds. Causal only.

The counts by blocked triangle products, the interpolation's gradient and the term
added into the scores by blocks of query rows (:meth:`CoPE.add_logits`, its gates,
counts and ``z`` never stored whole) are fast forms, in :mod:`posenc_jax.functional.kernels.cope`.

Reference: Golovneva et al., "Contextual Position Encoding: Learning to Count
What's Important", 2024, arXiv:2405.18719.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import AttentionContext, EncodingConfig, parameter, pytree_dataclass
from posenc_jax.functional.core.masks import causal_mask, combine_masks
from posenc_jax.functional.core.positions import batched_positions
from posenc_jax.functional.core.products import key_heads_for_queries
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.core.relative import check_max_distance
from posenc_jax.functional.kernels.cope import (
    carried_unless_saturated,
    cope_added_by_blocks,
    interpolate_pairs,
    reverse_cumsum,
)

__all__ = ["CoPE", "CoPEConfig", "cope_logits", "interpolate_positions", "reverse_cumsum"]

COPE = Source.paper(
    "golovneva2024contextual",
    title="Contextual Position Encoding: Learning to Count What's Important",
    authors="Golovneva, Olga and Wang, Tianlu and Weston, Jason and Sukhbaatar, Sainbayar",
    year=2024,
    arxiv="2405.18719",
)


def cope_logits(
    q,
    k,
    query_positions,
    key_positions,
    embeddings,
    *,
    scale: float | None = None,
    mask=None,
    into: jax.Array | None = None,
    content_scale: float | None = None,
    block_elements: int = 1 << 21,
):
    """CoPE's logits term ``q_t · e[p[t, s]]``, ``[B, N, T, S]`` float32.

    Args:
      q: ``[B, T, N, H]``; k: ``[B, S, K, H]`` (N a multiple of K).
      query_positions, key_positions: integer positions (for the causal gates).
      embeddings: ``[P, H]`` shared or ``[N, P, H]`` per-head position embeddings.
      scale: gate logit scale, default ``1/√H`` (the scores' own scale).
      mask: optional boolean mask broadcastable to ``[B, N, T, S]`` (True = attend);
        keys it hides get no gate, on top of the causal mask by position.
      into: optional float32 scores ``[B, N, T, S]``: the term is computed by blocks of
        query rows (each block's gates, counts and ``q · eᵀ`` are block-sized) and added to
        them in place; ``into + term`` is returned without any ``[B, N, T, S]`` intermediate
        stored whole. Or a function of no arguments returning them: they are then made
        inside the run-time conditional of self-attention's prefix blocks, one for the whole
        term instead of one per block, which a given array would be copied into
        (:func:`~posenc_jax.functional.kernels.cope.cope_added_by_blocks`).
      content_scale: with ``into``, a promise that ``into`` is exactly the content scores
        ``content_scale · q·k`` and nothing else (the first term an attention adds): the
        gates' logits are then read from it (times ``scale / content_scale``) instead of a
        second product ``q·k``, which also spares that product's two transposes in the
        gradient. Gates from the content scores are what the authors' code does.
      block_elements: with ``into``, about how many (query, key) values each block holds.

    Example:
      >>> q = jnp.ones((1, 5, 2, 4))
      >>> cope_logits(q, q, jnp.arange(5), jnp.arange(5), jnp.zeros((8, 4))).shape
      (1, 2, 5, 5)
    """
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    if (
        np.ndim(embeddings) not in (2, 3)
        or np.shape(embeddings)[-1] != head_dim
        or (np.ndim(embeddings) == 3 and np.shape(embeddings)[0] != num_heads)
    ):
        raise ValueError(
            f"CoPE embeddings must have shape [P, H={head_dim}] or [N={num_heads}, P, H], got {np.shape(embeddings)}"
        )
    term = lambda *tile, **kw: _cope_tile(*tile, scale=scale, **kw)[0]
    if into is None:
        if content_scale is not None:
            raise ValueError("content_scale says what into holds: pass it with into, the content scores")
        return term(q, k, query_positions, key_positions, embeddings, mask=mask)
    if content_scale is not None and not content_scale:
        raise ValueError(f"content_scale must be nonzero to read the gates from the content scores: {content_scale}")
    return cope_added_by_blocks(
        into,
        term,
        q,
        k,
        batched_positions(query_positions, "query_positions"),  # [B|1, T]
        batched_positions(key_positions, "key_positions"),  # [B|1, S]
        embeddings,
        scale=scale,
        mask=mask,
        content_scale=content_scale,
        block_elements=block_elements,
        self_attention=query_positions is key_positions,
    )


def _cope_tile(
    q, k, query_positions, key_positions, embeddings, *, scale, mask, later=None, gate_logits=None, per_position=None
):
    """CoPE's term for a tile of keys, given ``later`` ``[B, N, T]``: the gate sums of the keys after the tile.

    ``gate_logits``: the gates' logits ``scale · q·k`` ``[B, N, T, S]`` where the caller has them;
    ``per_position``: ``z = q · eᵀ`` ``[B, N, T, P]`` where the caller has it (:func:`_position_logits`).

    Returns the term and the gate sums including this tile's keys (to pass to the tile before it).
    """
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_positions = np.shape(embeddings)[-2]
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    if gate_logits is None:
        keys = key_heads_for_queries(k, num_heads)
        gate_logits = jnp.einsum("BTNH,BSNH->BNTS", q, keys, preferred_element_type=jnp.float32) * jnp.float32(scale)
    visible = combine_masks(causal_mask(query_positions, key_positions), mask)  # [B|1, N|1, T, S]
    gates = jnp.where(visible, jax.nn.sigmoid(gate_logits), 0.0)  # selected: a masked key's NaN stays out
    counts = reverse_cumsum(gates)  # Σ over keys s' >= s
    total = counts[..., 0]
    if later is not None:
        counts = counts + later[..., None]
        total = total + later
    counts = jnp.minimum(counts, num_positions - 1)
    if per_position is None:
        per_position = _position_logits(q, embeddings)
    return interpolate_positions(per_position, counts), total


def _position_logits(q, embeddings) -> jax.Array:
    """``z = q · eᵀ``: each query against each position embedding, ``[B, N, T, P]`` float32.

    ``q`` ``[B, T, N, H]``; ``embeddings`` ``[P, H]`` shared or ``[N, P, H]`` per head.
    """
    spec = "BTNH,PH->BNTP" if np.ndim(embeddings) == 2 else "BTNH,NPH->BNTP"
    return jnp.einsum(spec, q, embeddings, preferred_element_type=jnp.float32)


def interpolate_positions(per_position: jax.Array, counts: jax.Array) -> jax.Array:
    """``out[..., s] = (1 - w) · x[..., ⌊c⌋] + w · x[..., ⌊c⌋ + 1]`` with ``c = counts[..., s]``, ``w = c - ⌊c⌋``.

    Args:
      per_position: ``[..., P]`` values at the integer positions (CoPE's ``q · eᵀ``).
      counts: ``[..., S]`` fractional positions in ``[0, P - 1]``, the same leading shape
        (one below 0 extrapolates the line through positions 0 and 1, one above P - 1 reads P - 1).

    For ``c = P - 1`` the pair starting at ``P - 2`` is read, with weight 1 on the second.
    A NaN count gives NaN. The pairs are read by
    :func:`~posenc_jax.functional.kernels.cope.interpolate_pairs` (a gradient of one scatter).

    Example:
      >>> interpolate_positions(jnp.array([0.0, 10.0, 20.0]), jnp.array([0.5, 2.0, 1.25]))
      Array([ 5. , 20. , 12.5], dtype=float32)
    """
    num_positions = per_position.shape[-1]
    if per_position.shape[:-1] != counts.shape[:-1]:
        raise ValueError(f"per_position {per_position.shape} and counts {counts.shape} differ before the last axis")
    if num_positions == 1:
        return jnp.broadcast_to(per_position, counts.shape)
    lower = jnp.clip(jnp.floor(counts), 0, num_positions - 2)  # the pair's first position: never another row's
    # Weight 1 at the top position, a constant there, as the clip to P - 1 makes the count: its
    # gradient stays 0. (NaN >= P - 1 is false: a NaN count keeps a NaN weight.)
    weight = jnp.where(counts >= num_positions - 1, 1.0, counts - lower)
    return interpolate_pairs(per_position, lower.astype(jnp.int32), weight)


def _check_causal(context: AttentionContext) -> None:
    if not context.causal:
        raise ValueError(
            "CoPE has no bidirectional form (its gates count the keys up to each query), got causal=False; "
            "use it in causal attention (causal=True, a decoder), or another encoding in a bidirectional encoder"
        )


@pytree_dataclass
class CoPE:
    """CoPE as a ``logits`` hook; ``embeddings`` ``[P, H]`` or ``[N, P, H]`` is a parameter.

    Also a :class:`~posenc_jax.functional.core.hooks.CarriedLogits`: in blockwise attention the
    gate sums of later key tiles are carried to earlier ones, and ``z = q · eᵀ`` is computed once
    per query block (:meth:`for_query_block`) and read by each of its key tiles.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 5, 2, 4)); pos = jnp.arange(5)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[CoPE(jnp.zeros((8, 4)))], causal=True).shape
      (1, 5, 2, 4)
    """

    embeddings: jax.Array = parameter()
    scale: float | None = None
    # z = q · eᵀ [B, N, bq, P] of one query block (blockwise attention), from for_query_block.
    query_block_logits: jax.Array | None = parameter(default=None)

    def logits(self, q, k, context: AttentionContext):
        return self._term(q, k, context)

    def add_logits(self, scores: jax.Array, q: jax.Array, k: jax.Array, context: AttentionContext) -> jax.Array:
        """``scores + logits``, the term added by blocks of query rows into the scores (its gates,
        counts and ``q · eᵀ`` never stored whole)."""
        return self._term(q, k, context, into=scores)

    def add_logits_to_content(self, content, q: jax.Array, k: jax.Array, context: AttentionContext):
        """The content scores ``content()`` (exactly ``context.scale · q·k``) plus the term: the gates'
        logits are read from them, not from a second product ``q·k``, and they are made inside the
        run-time choice of blocks (so that choice never copies them)."""
        if not context.scale:
            return self.add_logits(content(), q, k, context)
        return self._term(q, k, context, into=content, content_scale=context.scale)

    def _term(self, q, k, context: AttentionContext, into=None, content_scale=None):
        _check_causal(context)
        scale = context.scale if self.scale is None else self.scale
        return cope_logits(
            q,
            k,
            context.query_positions,
            context.key_positions,
            self.embeddings,
            scale=scale,
            mask=context.mask,
            into=into,
            content_scale=content_scale,
        )

    def init_carry(self, q, context: AttentionContext):
        """No gate counted yet: zeros ``[B, N, T]`` for a block of queries (blockwise attention)."""
        return jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    def for_query_block(self, q, context: AttentionContext) -> CoPE:
        """This hook with ``z = q · eᵀ`` of a block of queries ``q`` ``[B, bq, N, H]`` computed once, which
        :meth:`carried_logits` reads for each key tile the block visits (instead of computing it per tile)."""
        return dataclasses.replace(self, query_block_logits=_position_logits(q, self.embeddings))

    def carried_logits(self, q, k, context: AttentionContext, carry):
        """One tile's term from the gate sums of the key tiles after it; the sums passed on."""
        return self._carried(q, k, context, carry, None)

    def carried_logits_from_content(self, content, q, k, context: AttentionContext, carry):
        """:meth:`carried_logits` with the gates' logits read from the tile's content scores."""
        return self._carried(q, k, context, carry, content)

    def _carried(self, q, k, context: AttentionContext, carry, content):
        _check_causal(context)
        scale = context.scale if self.scale is None else self.scale
        gate_logits = None
        if content is not None and self.scale is not None:
            gate_logits = content * jnp.float32(self.scale / context.scale)
        elif content is not None:
            gate_logits = content

        def tile():
            return _cope_tile(
                q,
                k,
                context.query_positions,
                context.key_positions,
                self.embeddings,
                scale=scale,
                mask=context.mask,
                later=carry,
                gate_logits=gate_logits,
                per_position=self.query_block_logits,
            )

        def top():  # every count at P - 1: q_t · e[P - 1]
            if self.query_block_logits is not None:
                per_row = self.query_block_logits[..., -1]
                return jnp.broadcast_to(per_row[..., None], (*per_row.shape, k.shape[1]))
            spec = "BTNH,H->BNT" if np.ndim(self.embeddings) == 2 else "BTNH,NH->BNT"
            per_row = jnp.einsum(spec, q, self.embeddings[..., -1, :], preferred_element_type=jnp.float32)
            return jnp.broadcast_to(per_row[..., None], (*per_row.shape, k.shape[1]))

        # The tile's term checkpointed: its gradient keeps the tile's inputs, not its gates, counts and
        # interpolation weights (fewer tile-sized buffers held through the step's backward).
        return carried_unless_saturated(jax.checkpoint(tile), top, carry, np.shape(self.embeddings)[-2])


@register_encoding(
    "cope",
    description="Positions counted by learned gates on the context, interpolated between learned embeddings.",
    source=COPE,
    forms=("causal",),
    small_settings=dict(num_positions=6),
    hook=CoPE,
    hooks=("logits",),
    tiled=("carried", "carried_from_content", "per_query_block"),
    cached=(),
    prepared=None,
    fused=("rows", "rows_from_content"),
)
@pytree_dataclass
class CoPEConfig(EncodingConfig):
    """CoPE position embeddings ``[P, H]`` (or ``[N, P, H]``), zeros at init as in the authors' code."""

    num_positions: int = 64
    per_head: bool = False

    def __post_init__(self):
        check_max_distance(self.num_positions, "num_positions")

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        shape = (num_heads, self.num_positions, head_dim) if self.per_head else (self.num_positions, head_dim)
        return {"embeddings": jnp.zeros(shape)}

    def build(self, params: dict) -> CoPE:
        return CoPE(params["embeddings"])

    def for_lengths(self, *, train_length: int, max_length: int, head_dim: int) -> CoPEConfig:
        """Room to count to twice the training length (at least 16)."""
        return dataclasses.replace(self, num_positions=max(16, 2 * train_length))
