"""CoPE: contextual position encoding (Golovneva et al. 2024).

Positions are counted by the context instead of by tokens: with gates
``g[t, s] = σ(q_t · k_s / √H)`` on the keys a query may see (causal), the position
of key s for query t is ``p[t, s] = Σ_{s' >= s} g[t, s']``, a fractional count of
"relevant" keys between s and t. It is clipped to ``P - 1`` and its embedding is
interpolated from learned integer embeddings ``e[0..P-1]``; the term added to the
scores is ``q_t · e[p[t, s]]``, computed as ``z = q · eᵀ`` (``[B, N, T, P]``) and two
gathers, never as ``[T, S, H]``. In attention the term is added into the scores by
blocks of query rows (:meth:`CoPE.add_logits`), so its gates, counts and ``z`` are
never stored whole.

Keys must be in position order (as in any causal sequence or cache). The gates
count only the keys the query may see: the causal mask by position and, in an
attention, the call's whole mask (padding, a cache's empty slots, segments), so a
masked key changes no other key's position, whatever it holds. Causal only.

Reference: Golovneva et al., "Contextual Position Encoding: Learning to Count
What's Important", 2024, arXiv:2405.18719.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import AttentionContext, CausalOnly, EncodingConfig, parameter, pytree_dataclass
from posenc_jax.functional.core.masks import causal_mask, combine_masks
from posenc_jax.functional.core.positions import batched_positions
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.core.relative import (
    by_causal_prefix_blocks,
    by_causal_prefixes_where,
    by_query_blocks,
    check_max_distance,
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
        inside the run-time conditional of self-attention's prefix blocks (below), one for
        the whole term instead of one per block, which a given array would be copied into.
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
    if into is None:
        if content_scale is not None:
            raise ValueError("content_scale says what into holds: pass it with into, the content scores")
        term, _ = _cope_tile(q, k, query_positions, key_positions, embeddings, scale=scale, mask=mask, later=None)
        return term
    if content_scale is not None and not content_scale:
        raise ValueError(f"content_scale must be nonzero to read the gates from the content scores: {content_scale}")
    return _cope_added_by_blocks(
        into,
        q,
        k,
        query_positions,
        key_positions,
        embeddings,
        scale=scale,
        mask=mask,
        content_scale=content_scale,
        block_elements=block_elements,
        self_attention=query_positions is key_positions,
    )


def reverse_cumsum(x: jax.Array, *, block: int = 32) -> jax.Array:
    """``out[..., s] = Σ_{s' >= s} x[..., s']`` along the last axis, in float32 (CoPE's counts).

    By blocks of ``block`` entries: the sums within each block are one product with a
    ``[block, block]`` triangle of ones (a matrix product, at full float32 precision on
    every backend), and the totals of the later blocks, a cumulative sum over S / block
    values, are added. The same sums as ``jnp.flip(jnp.cumsum(jnp.flip(x, -1), -1), -1)``
    up to rounding, the form XLA:CPU runs as a tree of reduce-windows (about 5× slower on
    CoPE's gates, and the same again in the gradient, which is a forward cumulative sum,
    here a product with the transposed triangle). For finite values: an infinite or NaN
    entry makes its whole block NaN (CoPE's gates are in [0, 1], or NaN where a visible
    key's score already is).

    Example:
      >>> reverse_cumsum(jnp.array([1.0, 2.0, 3.0]))
      Array([6., 5., 3.], dtype=float32)
    """
    x = jnp.asarray(x, jnp.float32)
    *lead, length = x.shape
    num_blocks = -(-length // block)
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, num_blocks * block - length)])
    triangle = jnp.asarray(np.tril(np.ones((block, block), np.float32)))  # [i, j] = 1 where i >= j
    within = jnp.einsum(
        "...ki,ij->...kj",
        padded.reshape(*lead, num_blocks, block),
        triangle,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )  # Σ over the block's entries from j on
    totals = within[..., 0]  # [..., num_blocks]
    later = jax.lax.cumsum(totals, axis=totals.ndim - 1, reverse=True) - totals  # the blocks after each
    return (within + later[..., None]).reshape(*lead, num_blocks * block)[..., :length]


def _cope_added_by_blocks(
    scores,
    q,
    k,
    query_positions,
    key_positions,
    embeddings,
    *,
    scale,
    mask,
    content_scale,
    block_elements,
    self_attention=False,
):
    """``scores + cope_logits(...)``, the term computed by blocks of query rows and added in place.

    In self-attention (the same positions for queries and keys) whose positions increase
    along every row, query t sees no key after t: each block then works on the keys up to
    its last row only (:func:`by_causal_prefix_blocks`, 5/8 of the work). The positions are
    checked at run time, by one conditional around the whole term where ``scores`` is a function
    that makes them (:func:`by_causal_prefixes_where`), by one per block where it is an array;
    otherwise each block takes all keys.
    """
    q_len, k_len = q.shape[1], k.shape[1]
    expected = (q.shape[0], q.shape[2], q_len, k_len)
    make_scores = scores if callable(scores) else (lambda: scores)
    shape = tuple(jax.eval_shape(make_scores).shape)
    if len(shape) != 4 or shape[2:] != (q_len, k_len) or shape[1] != q.shape[2]:
        raise ValueError(f"into must be scores [B, N, T, S] = {expected}, got {shape}")
    query_positions = batched_positions(query_positions, "query_positions")  # [B|1, T]
    if mask is not None:
        mask = jnp.asarray(mask)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # [B|1, N|1, T|1, S|1]
    # A count is at most the number of keys a query sees (S; a sum of S gates <= 1 rounds to at most
    # S), so the interpolation reads embeddings 0 .. S + 1 at most: the others are never gathered.
    embeddings = jnp.asarray(embeddings)[..., : min(np.shape(embeddings)[-2], k_len + 2), :]

    key_positions = batched_positions(key_positions, "key_positions")  # [B|1, S]
    if content_scale is not None:  # the gates' logits are the content scores times this
        ratio = (1.0 / np.sqrt(q.shape[-1]) if scale is None else scale) / content_scale

    def block(start, rows: int, width: int, content=None) -> jax.Array:
        """The term of query rows ``start ..`` for keys ``0 .. width - 1``; ``content``, their content scores."""
        rows_of = lambda x, axis: x if x.shape[axis] == 1 else jax.lax.dynamic_slice_in_dim(x, start, rows, axis=axis)
        keys_of = lambda x, axis: x if x.shape[axis] in (1, width) else jax.lax.slice_in_dim(x, 0, width, axis=axis)
        gate_logits = None
        if content_scale is not None:
            gate_logits = content if ratio == 1.0 else content * jnp.float32(ratio)
        term, _ = _cope_tile(
            rows_of(q, 1),
            keys_of(k, 1),
            rows_of(query_positions, 1),
            keys_of(key_positions, 1),
            embeddings[..., : width + 2, :],
            scale=scale,
            mask=None if mask is None else keys_of(rows_of(mask, 2), 3),
            later=None,
            gate_logits=gate_logits,
        )
        return term

    def all_keys(scores):
        return by_query_blocks(
            lambda start, rows, content=None: block(start, rows, k_len, content),
            tuple(scores.shape),
            jnp.float32,
            block_elements=block_elements,
            into=scores,
            reads_into=content_scale is not None,
        )

    rows_per_block = block_elements // max(1, shape[0] * shape[1] * k_len)
    if not self_attention or q_len != k_len or q_len <= rows_per_block:
        return all_keys(make_scores())

    increasing = jnp.all(query_positions[:, 1:] > query_positions[:, :-1])
    if callable(scores):
        return by_causal_prefixes_where(increasing, make_scores, lambda: block, all_keys, block_elements=block_elements)
    return by_causal_prefix_blocks(
        block, scores.astype(jnp.float32), block_elements=block_elements, prefix_ok=increasing
    )


def _cope_tile(q, k, query_positions, key_positions, embeddings, *, scale, mask, later, gate_logits=None):
    """CoPE's term for a tile of keys, given ``later`` ``[B, N, T]``: the gate sums of the keys after the tile.

    ``gate_logits``: the gates' logits ``scale · q·k`` ``[B, N, T, S]`` where the caller has them.

    Returns the term and the gate sums including this tile's keys (to pass to the tile before it).
    """
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_positions = np.shape(embeddings)[-2]
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    if gate_logits is None:
        keys = jnp.repeat(k, num_heads // k.shape[-2], axis=-2) if k.shape[-2] != num_heads else k
        gate_logits = jnp.einsum("BTNH,BSNH->BNTS", q, keys, preferred_element_type=jnp.float32) * jnp.float32(scale)
    visible = combine_masks(causal_mask(query_positions, key_positions), mask)  # [B|1, N|1, T, S]
    gates = jnp.where(visible, jax.nn.sigmoid(gate_logits), 0.0)  # selected: a masked key's NaN stays out
    counts = reverse_cumsum(gates)  # Σ over keys s' >= s
    total = counts[..., 0]
    if later is not None:
        counts = counts + later[..., None]
        total = total + later
    counts = jnp.minimum(counts, num_positions - 1)
    spec = "BTNH,PH->BNTP" if np.ndim(embeddings) == 2 else "BTNH,NPH->BNTP"
    per_position = jnp.einsum(spec, q, embeddings, preferred_element_type=jnp.float32)  # [B, N, T, P]
    return interpolate_positions(per_position, counts), total


def interpolate_positions(per_position: jax.Array, counts: jax.Array) -> jax.Array:
    """``out[..., s] = (1 - w) · x[..., ⌊c⌋] + w · x[..., ⌊c⌋ + 1]`` with ``c = counts[..., s]``, ``w = c - ⌊c⌋``.

    Args:
      per_position: ``[..., P]`` values at the integer positions (CoPE's ``q · eᵀ``).
      counts: ``[..., S]`` fractional positions in ``[0, P - 1]``, the same leading shape
        (one below 0 extrapolates the line through positions 0 and 1, one above P - 1 reads P - 1).

    For ``c = P - 1`` the pair starting at ``P - 2`` is read, with weight 1 on the second.
    Where derivatives are taken, the pair is read from the values laid out flat, by offsets,
    as one gather of a window of two, so that the values' gradient, its transpose, is one
    scatter of pairs into that flat array. As ``take_along_axis`` on ``[..., P]`` (gathers
    with batch dimensions), the gradient was two scatters with batch dimensions, which
    XLA:CPU ran about 3× slower (CoPE's ``[8, 4, 512, 514]`` values: 300 ms against
    80–110 ms for value and gradient).
    A NaN count gives NaN.

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
    lower = lower.astype(jnp.int32)
    if per_position.size >= 2**31:  # flat offsets past int32
        return _interpolate_along_axis(per_position, lower, weight)
    return _interpolate(per_position, lower, weight)


def _interpolate_along_axis(per_position, lower, weight):
    at_lower = jnp.take_along_axis(per_position, lower, axis=-1, mode="clip")
    at_upper = jnp.take_along_axis(per_position, lower + 1, axis=-1, mode="clip")
    return at_lower * (1.0 - weight) + at_upper * weight


@jax.custom_jvp
def _interpolate(per_position: jax.Array, lower: jax.Array, weight: jax.Array) -> jax.Array:
    """Without derivatives, ``take_along_axis``, which XLA:CPU fuses into the consumer: CoPE's
    attention (B=1, N=8, T=1024) took 2.03× plain's time with the flat gathers, 1.68× with these."""
    return _interpolate_along_axis(per_position, lower, weight)


def _pairs(per_position, lower):
    """``[..., S, 2]``: the values at ``lower`` and ``lower + 1``, one gather of a window of two from the
    values laid out flat."""
    rows = int(np.prod(lower.shape[:-1], dtype=np.int64))
    row_start = (jnp.arange(rows, dtype=jnp.int32) * per_position.shape[-1]).reshape(*lower.shape[:-1], 1)
    return jax.lax.gather(
        per_position.reshape(-1),
        (row_start + lower)[..., None],
        jax.lax.GatherDimensionNumbers(offset_dims=(lower.ndim,), collapsed_slice_dims=(), start_index_map=(0,)),
        slice_sizes=(2,),
        mode=jax.lax.GatherScatterMode.CLIP,
    )


@_interpolate.defjvp
def _interpolate_jvp(primals, tangents):
    per_position, lower, weight = primals
    per_position_dot, _, weight_dot = tangents
    at_pair = jnp.stack([1.0 - weight, weight], axis=-1)  # the pair's weights, [..., S, 2]
    pair = _pairs(per_position, lower)
    # The tangent reads the values' tangent as the values are read: its transpose, the values'
    # gradient, is one scatter of (lower, upper) pairs into the flat table (half the updates of two
    # scalar scatters; with batch dimensions, as autodiff makes of take_along_axis, XLA:CPU ran it
    # about 3x slower).
    tangent = (_pairs(per_position_dot, lower) * at_pair).sum(axis=-1) + (pair[..., 1] - pair[..., 0]) * weight_dot
    return (pair * at_pair).sum(axis=-1), tangent


def _check_causal(context: AttentionContext) -> None:
    if not context.causal:
        raise ValueError(
            "CoPE has no bidirectional form (its gates count the keys up to each query), got causal=False; "
            "use it in causal attention (causal=True, a decoder), or another encoding in a bidirectional encoder"
        )


@pytree_dataclass
class CoPE(CausalOnly):
    """CoPE as a ``logits`` hook; ``embeddings`` ``[P, H]`` or ``[N, P, H]`` is a parameter.

    Also a :class:`~posenc_jax.functional.core.hooks.CarriedLogits`: in blockwise attention the
    gate sums of later key tiles are carried to earlier ones.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 5, 2, 4)); pos = jnp.arange(5)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[CoPE(jnp.zeros((8, 4)))], causal=True).shape
      (1, 5, 2, 4)
    """

    embeddings: jax.Array = parameter()
    scale: float | None = None

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

    def carried_logits(self, q, k, context: AttentionContext, carry):
        """One tile's term from the gate sums of the key tiles after it; the sums passed on."""
        _check_causal(context)
        scale = context.scale if self.scale is None else self.scale
        term, total = _cope_tile(
            q,
            k,
            context.query_positions,
            context.key_positions,
            self.embeddings,
            scale=scale,
            mask=context.mask,
            later=carry,
        )
        return term, total


@register_encoding(
    "cope",
    description="Positions counted by learned gates on the context, interpolated between learned embeddings.",
    source=COPE,
    forms=("causal",),
    small_settings=dict(num_positions=6),
)
@pytree_dataclass
class CoPEConfig(CausalOnly, EncodingConfig):
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
