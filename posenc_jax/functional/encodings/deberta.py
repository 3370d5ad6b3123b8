"""DeBERTa disentangled attention: content-to-position and position-to-content (He et al. 2021).

``logits[t, s] = scale · [ q_t·k_s + q_t·K_r[δ(t, s)] + k_s·Q_r[δ(t, s)] ]``,
``scale = 1/√(H · (1 + number of position terms))`` (``1/√(3H)`` with both).

``K_r`` and ``Q_r`` (``[2·span, N, H]``) are the shared relative embeddings
projected by the key and query projections. The slot follows DeBERTa's
reference code: the relative position is query minus key (i - j),
optionally log-bucketed (DeBERTa-v2 ``make_log_bucket_position``), and
``δ = clip(rel + span, 0, 2·span - 1)``. The position-to-content term uses the
key-to-query distance negated, which for DeBERTa's odd bucketing is the same
slot. The content term is the attention's own score; this hook adds the
other two and prescribes the ``score_scale`` for all three.

Fast path: ``q · K_rᵀ`` (``[B, N, T, 2·span]``) and ``k · Q_rᵀ``
(``[B, N, S, 2·span]``), each gathered to ``[B, N, T, S]``, one block of query
rows at a time so that only their sum is ever stored whole; no ``[T, S, H]``
tensor.

Reference: He, Liu, Gao and Chen, "DeBERTa: Decoding-enhanced BERT with
Disentangled Attention", ICLR 2021, arXiv:2006.03654.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import AttentionContext, EncodingConfig, parameter, pytree_dataclass
from posenc_jax.functional.core.positions import batched_positions
from posenc_jax.functional.core.products import key_heads_for_queries
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.core.relative import (
    by_query_blocks,
    gather_by_distance,
    gather_relative,
    gather_relative_transposed,
    relative_positions,
)
from posenc_jax.functional.core.validation import check_init_std
from posenc_jax.functional.kernels.relative_tiles import by_saturation, saturated_side

__all__ = [
    "DeBERTa",
    "DeBERTaConfig",
    "deberta_key_projection",
    "deberta_log_bucket",
    "deberta_logits",
    "deberta_relative_index",
]

DEBERTA = Source.paper(
    "he2021deberta",
    title="DeBERTa: Decoding-enhanced BERT with Disentangled Attention",
    authors="He, Pengcheng and Liu, Xiaodong and Gao, Jianfeng and Chen, Weizhu",
    year=2021,
    arxiv="2006.03654",
)

_TERMS = ("c2p", "p2c")


def deberta_log_bucket(relative_position, *, bucket_size: int, max_position: int):
    """DeBERTa-v2's ``make_log_bucket_position``: exact within ±bucket_size/2, log-spaced beyond.

    ``sign(r) · (ceil(log(|r| / mid) / log((max_position - 1) / mid) · (mid - 1)) + mid)``
    for ``|r| > mid = bucket_size // 2``, and ``r`` itself otherwise; in float32 as the
    reference computes it.

    Example:
      >>> deberta_log_bucket(jnp.array([-300, -5, 0, 5, 300]), bucket_size=256, max_position=512)
      Array([-207,   -5,    0,    5,  207], dtype=int32)
    """
    if not isinstance(bucket_size, (int, np.integer)) or bucket_size < 4:
        raise ValueError(f"bucket_size must be an integer >= 4, got {bucket_size!r}")
    mid = bucket_size // 2
    if not isinstance(max_position, (int, np.integer)) or max_position - 1 <= mid:
        raise ValueError(f"max_position must be an integer > bucket_size // 2 + 1 = {mid + 1}, got {max_position!r}")
    rel = jnp.asarray(relative_position, jnp.int32)
    sign = jnp.sign(rel)
    abs_pos = jnp.where((rel < mid) & (rel > -mid), mid - 1, jnp.abs(rel))
    log_pos = (
        jnp.ceil(
            jnp.log(abs_pos.astype(jnp.float32) / jnp.float32(mid))
            / jnp.float32(math.log((max_position - 1) / mid))
            * jnp.float32(mid - 1)
        ).astype(jnp.int32)
        + mid
    )
    return jnp.where(abs_pos <= mid, rel, log_pos * sign)


def _saturation_distance(span: int, position_buckets: int, max_relative_positions: int) -> int:
    """A distance D from which DeBERTa's slot no longer changes (0 or 2·span - 1).

    Raw distances saturate at ±span. Log buckets (with span = position_buckets)
    reach ``span - 1`` at ``|r| = max_relative_positions - 1`` and pass ``span`` just
    beyond it, so every slot is settled from ``|r| = max_relative_positions``.
    """
    if position_buckets <= 0:
        return span
    return max(max_relative_positions, span) + 1


def deberta_relative_index(
    query_positions, key_positions, *, span: int, position_buckets: int = 0, max_relative_positions: int = 512
):
    """DeBERTa's slot ``clip(bucket(query_pos - key_pos) + span, 0, 2·span - 1)``, ``[B|1, T, S]``.

    The slot saturates beyond a static distance D, so it is tabulated once for
    ``|query_pos - key_pos| <= D`` at trace time and looked up; the logarithms
    are never evaluated per (query, key) pair.
    """
    _check_span(span, position_buckets)
    reach = _saturation_distance(span, position_buckets, max_relative_positions)
    with jax.ensure_compile_time_eval():
        rel = jnp.arange(-reach, reach + 1)
        if position_buckets > 0:
            rel = deberta_log_bucket(rel, bucket_size=position_buckets, max_position=max_relative_positions)
        slots = jnp.clip(rel + span, 0, 2 * span - 1)
    query_minus_key = -relative_positions(query_positions, key_positions)
    return jnp.take(slots, jnp.clip(query_minus_key, -reach, reach) + reach, mode="clip")


def _check_tables(terms, pos_key, pos_query, *, span: int, num_heads: int, head_dim: int) -> None:
    """Raises a ValueError naming a table a term needs that is missing or of the wrong shape."""
    # c2p reads K_r only and p2c Q_r only: a term left out needs no table (None).
    needed = (("pos_key", pos_key, "c2p"), ("pos_query", pos_query, "p2c"))
    for name, table, term in needed:
        if term not in terms:
            continue
        if table is None:
            raise ValueError(
                f"DeBERTa's {term} term needs {name} [2*span, N, H]; got None (or leave {term} out of terms)"
            )
        if tuple(np.shape(table)) != (2 * span, num_heads, head_dim):
            raise ValueError(
                f"{name} must have shape [2*span={2 * span}, N={num_heads}, H={head_dim}], got {np.shape(table)}; "
                f"its length must match the span"
            )


def _by_distance(c2p, p2c, query_positions, key_positions, *, offset: int, scale: float):
    """The terms of raw clipped distances, per slot ``clip(query_pos - key_pos + offset, 0, slots - 1)``,
    gathered with a gradient that needs no scatter where positions are runs. The scale goes on the per-slot
    values, so both gradients read the score cotangent as it is."""
    factor = jnp.float32(scale)
    total = 0.0
    if c2p is not None:
        total = total + gather_by_distance(c2p * factor, query_positions, key_positions, sign=-1, offset=offset)
    if p2c is not None:
        total = total + gather_by_distance(
            p2c * factor, query_positions, key_positions, sign=-1, offset=offset, key_side=True
        )
    return total


def deberta_logits(
    q,
    k,
    query_positions,
    key_positions,
    *,
    pos_query,
    pos_key,
    span: int,
    position_buckets: int = 0,
    max_relative_positions: int = 512,
    terms: tuple[str, ...] = _TERMS,
    scale: float | None = None,
    block_elements: int | None = None,
    key_projection=None,
    causal: bool = False,
):
    """DeBERTa's c2p and p2c terms, ``[B, N, T, S]`` float32, already scaled.

    Args:
      q: ``[B, T, N, H]``; k: ``[B, S, K, H]`` (N a multiple of K).
      query_positions, key_positions: integer ``[T]``/``[B, T]``, ``[S]``/``[B, S]``.
      pos_query: ``Q_r`` ``[2·span, N, H]`` (relative embeddings through the query projection);
        read by p2c only, None without it.
      pos_key: ``K_r`` ``[2·span, N, H]`` (through the key projection); read by c2p only, None
        without it.
      span: attention span (``position_buckets`` if > 0, else ``max_relative_positions``, in DeBERTa-v2).
      position_buckets: log-bucket size; 0 for raw clipped distances.
      max_relative_positions: the log buckets' reach.
      terms: any of ``"c2p"``, ``"p2c"``.
      scale: default ``1/√(H · (1 + len(terms)))``.
      block_elements: None (the default) computes the term in one piece, whose gathers XLA
        fuses into the attention's score computation under ``jax.jit`` (no ``[B, N, T, S]``
        term is stored); a number computes it by blocks of query rows holding about that
        many scores each (a ``fori_loop``; the whole term is then stored once).
      key_projection: optional :func:`deberta_key_projection` of the keys, computed earlier
        (a KV cache stores it); p2c then reads it instead of projecting every key. It holds
        the slots of keys at or before the query only: valid in causal attention, where
        later keys are masked.
      causal: the attention masks keys after the query (by position). Every key a query
        sees is then at or before it, in the slots ``span .. 2·span - 1``: only those are
        projected (half the work); the values at masked keys are finite but meaningless.

    Example:
      >>> q = jnp.ones((1, 3, 2, 4)); r = jnp.ones((8, 2, 4))
      >>> deberta_logits(q, q, jnp.arange(3), jnp.arange(3), pos_query=r, pos_key=r, span=4).shape
      (1, 2, 3, 3)
    """
    terms = _check_terms(terms)
    head_dim, num_heads = q.shape[-1], q.shape[-2]
    _check_tables(terms, pos_key, pos_query, span=span, num_heads=num_heads, head_dim=head_dim)
    if scale is None:
        scale = _score_scale(head_dim, terms)
    query_positions = batched_positions(query_positions, "query_positions")
    # With causal attention (or cached key projections) only the slots of earlier keys are needed.
    first_slot = span if (causal or key_projection is not None) else 0
    c2p = p2c = None
    if "c2p" in terms:
        c2p = jnp.einsum("BTNH,RNH->BNTR", q, pos_key[first_slot:], preferred_element_type=jnp.float32)
    if "p2c" in terms and key_projection is not None:
        p2c = None  # read per (query, key) from the [B, S, N, span] projections below, never transposed whole
    elif "p2c" in terms:
        p2c = jnp.swapaxes(deberta_key_projection(k, pos_query, span=first_slot), 1, 2)  # [B, N, S, slots]

    def block(start, rows):
        block_positions = jax.lax.dynamic_slice_in_dim(query_positions, start, rows, axis=1)
        index = deberta_relative_index(
            block_positions,
            key_positions,
            span=span,
            position_buckets=position_buckets,
            max_relative_positions=max_relative_positions,
        )
        index = jnp.maximum(index - first_slot, 0)
        total = 0.0
        if c2p is not None:
            total = total + gather_relative(jax.lax.dynamic_slice_in_dim(c2p, start, rows, axis=2), index)
        if p2c is not None:
            total = total + gather_relative_transposed(p2c, index)
        if "p2c" in terms and key_projection is not None:
            # out[b, n, t, s] = key_projection[b, s, n, index[b, t, s]]
            per_key = jnp.take_along_axis(key_projection[:, None], index[:, :, :, None, None], axis=-1, mode="clip")
            total = total + jnp.moveaxis(per_key[..., 0], -1, 1)
        return total * jnp.float32(scale)

    batch = max(q.shape[0], query_positions.shape[0])
    out_shape = (batch, num_heads, q.shape[1], k.shape[1])
    if block_elements is None and position_buckets == 0 and key_projection is None:
        total = _by_distance(c2p, p2c, query_positions, key_positions, offset=span - first_slot, scale=scale)
        return jnp.broadcast_to(total, out_shape)
    if block_elements is None:
        return jnp.broadcast_to(block(0, q.shape[1]), out_shape)
    return by_query_blocks(block, out_shape, jnp.float32, block_elements=block_elements)


def deberta_key_projection(k, pos_query, *, span: int) -> jax.Array:
    """Each key's position-to-content projections ``k_s · Q_r[span + j]``, ``[B, S, N, span]`` float32.

    The slots ``span .. 2·span - 1`` are those of keys at or before the query (DeBERTa's
    slot is ``clip(bucket(query_pos - key_pos) + span, 0, 2·span - 1)``); they depend on the
    key alone, so a KV cache computes them once per key instead of at every step. With
    ``span=0``, all ``len(pos_query)`` slots.

    Example:
      >>> deberta_key_projection(jnp.ones((1, 5, 2, 4)), jnp.ones((8, 2, 4)), span=4).shape
      (1, 5, 2, 4)
    """
    num_heads = np.shape(pos_query)[1]
    keys = key_heads_for_queries(k, num_heads)
    return jnp.einsum("BSNH,RNH->BSNR", keys, pos_query[span:], preferred_element_type=jnp.float32)


def _check_span(span, position_buckets):
    if not isinstance(span, (int, np.integer)) or span < 1:
        raise ValueError(f"span must be an integer >= 1, got {span!r}")
    if position_buckets > 0 and span != position_buckets:
        raise ValueError(
            f"with log buckets DeBERTa's span is the bucket count (att_span = position_buckets): "
            f"span={span} != position_buckets={position_buckets}"
        )


def _check_terms(terms):
    terms = tuple(terms)
    if not terms or any(t not in _TERMS for t in terms):
        raise ValueError(f"terms must be a non-empty subset of {_TERMS}, got {terms!r}")
    return terms


def _score_scale(head_dim: int, terms) -> float:
    return 1.0 / math.sqrt(head_dim * (1 + len(terms)))


@pytree_dataclass
class DeBERTa:
    """DeBERTa disentangled attention as a ``logits`` hook that also sets the score scale.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 2, 8)); pos = jnp.arange(4)
      >>> rel = jnp.zeros((8, 2, 8))
      >>> deb = DeBERTa(pos_query=rel, pos_key=rel, span=4)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, encodings=[deb]).shape
      (1, 4, 2, 8)
    """

    pos_query: jax.Array | None = parameter(default=None)
    pos_key: jax.Array | None = parameter(default=None)
    span: int = 256
    position_buckets: int = 0
    max_relative_positions: int = 512
    terms: tuple[str, ...] = _TERMS
    scale: float | None = None
    key_projection: jax.Array | None = parameter(default=None)

    def __post_init__(self):
        _check_terms(self.terms)
        _check_span(self.span, self.position_buckets)
        for name, term in (("pos_key", "c2p"), ("pos_query", "p2c")):
            if term in self.terms and getattr(self, name) is None:
                raise ValueError(
                    f"DeBERTa's {term} term needs {name} [2*span, N, H]; pass it or leave {term} out of terms"
                )

    def key_features(self, k, key_positions):
        """What a KV cache stores per key: :func:`deberta_key_projection` (None without the p2c term)."""
        if "p2c" not in self.terms:
            return None
        return deberta_key_projection(k, self.pos_query, span=self.span)

    def with_key_features(self, features) -> DeBERTa:
        """This hook reading every key's p2c projections from ``features`` (a KV cache's); causal only."""
        return dataclasses.replace(self, key_projection=features)

    def map_key_features(self, fn) -> DeBERTa:
        """This hook with its stored key projections ``[B, S, N, span]`` replaced by ``fn`` of them (blockwise
        attention takes each key tile's)."""
        return dataclasses.replace(self, key_projection=jax.tree.map(fn, self.key_projection))

    def score_scale(self, head_dim: int) -> float:
        """``1/√(H · (1 + number of position terms))``, for the content score too."""
        return _score_scale(head_dim, self.terms) if self.scale is None else self.scale

    def logits(self, q, k, context: AttentionContext):
        if self.key_projection is not None and not context.causal:
            raise ValueError(
                "DeBERTa's cached key projections hold the slots of earlier keys only, so they need causal "
                "attention (causal=True), got causal=False"
            )
        return deberta_logits(
            q,
            k,
            context.query_positions,
            context.key_positions,
            pos_query=self.pos_query,
            pos_key=self.pos_key,
            span=self.span,
            position_buckets=self.position_buckets,
            max_relative_positions=self.max_relative_positions,
            terms=self.terms,
            scale=context.scale if self.scale is None else self.scale,
            key_projection=self.key_projection,
            causal=context.causal,
        )

    def tile_logits(self, q, k, context: AttentionContext):
        """:meth:`logits` for one blockwise tile: where every pair of the tile is past the slots' reach, all
        read one slot, so c2p is ``q_t · K_r[slot]`` per query and p2c ``k_s · Q_r[slot]`` per key."""
        plain = lambda: self.logits(q, k, context)
        shape = jax.eval_shape(plain).shape
        scale = jnp.float32(context.scale if self.scale is None else self.scale)

        def end(slot: int):
            total = jnp.zeros((), jnp.float32)
            if "c2p" in self.terms:
                per_query = jnp.einsum("BTNH,NH->BNT", q, self.pos_key[slot], preferred_element_type=jnp.float32)
                total = total + per_query[..., None]
            if "p2c" in self.terms:
                num_heads = np.shape(self.pos_query)[1]
                keys = key_heads_for_queries(k, num_heads)
                per_key = jnp.einsum("BSNH,NH->BNS", keys, self.pos_query[slot], preferred_element_type=jnp.float32)
                total = total + per_key[:, :, None, :]
            return jnp.broadcast_to(total * scale, shape)

        # Keys far before their queries (i - j large) are in the last slot, far after in slot 0.
        reach = _saturation_distance(self.span, self.position_buckets, self.max_relative_positions)
        side = saturated_side(context.query_positions, context.key_positions, reach=reach)
        return by_saturation(side, plain, lambda: end(2 * self.span - 1), lambda: end(0))

    def tile_scores(self, q, k, context: AttentionContext, content):
        """``content(q, k) + logits(q, k, context)`` for one blockwise tile: where every pair reads one slot,
        the slot's rows join the queries and keys, ``(q + a·Q_r[slot]) · (k + a·K_r[slot])`` less the
        product of the two rows (``a`` the terms' scale over the content's), so the tile is one contraction."""
        c2p, p2c = "c2p" in self.terms, "p2c" in self.terms
        if c2p and k.shape[2] != q.shape[2]:  # grouped keys: one key serves several heads' rows of K_r
            return content(q, k) + self.tile_logits(q, k, context)
        ratio = (context.scale if self.scale is None else self.scale) / context.scale
        num_heads, head_dim = q.shape[2:]

        def end(slot: int):
            q_row = (ratio * self.pos_query[slot]).reshape(1, 1, num_heads, head_dim) if p2c else None
            k_row = (ratio * self.pos_key[slot]).reshape(1, 1, num_heads, head_dim) if c2p else None
            scores = content(
                q if q_row is None else q + q_row.astype(q.dtype), k if k_row is None else k + k_row.astype(k.dtype)
            )
            if c2p and p2c:  # the rows' own product, one value per head
                scores = scores - content(q_row.astype(q.dtype), k_row.astype(k.dtype))
            return scores

        plain = lambda: content(q, k) + self.logits(q, k, context)
        reach = _saturation_distance(self.span, self.position_buckets, self.max_relative_positions)
        side = saturated_side(context.query_positions, context.key_positions, reach=reach)
        return by_saturation(side, plain, lambda: end(2 * self.span - 1), lambda: end(0))


@register_encoding(
    "deberta",
    description="Disentangled content-to-position and position-to-content terms over (log-)bucketed distances.",
    source=DEBERTA,
    small_settings=dict(span=4),
    hook=DeBERTa,
    hooks=("logits",),
    tiled=("logits", "scores"),
    cached=("key_term", "key_features"),
    prepared=None,
    scale="prescribed",
)
@pytree_dataclass
class DeBERTaConfig(EncodingConfig):
    """DeBERTa position tables ``Q_r``, ``K_r`` ``[2·span, N, H]``; span = buckets if bucketed.

    ``terms`` (DeBERTa-v2's ``pos_att_type``) picks c2p, p2c or both; only the tables the
    chosen terms read are made (``K_r`` for c2p, ``Q_r`` for p2c).
    """

    span: int = 256
    position_buckets: int = 0
    max_relative_positions: int = 512
    init_std: float = 0.02
    terms: tuple[str, ...] = _TERMS

    def __post_init__(self):
        _check_span(self.span, self.position_buckets)
        _check_terms(self.terms)
        check_init_std(self.init_std)

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        k1, k2 = jax.random.split(key)
        shape = (2 * self.span, num_heads, head_dim)
        params = {}
        if "p2c" in self.terms:
            params["pos_query"] = jax.random.normal(k1, shape, jnp.float32) * self.init_std
        if "c2p" in self.terms:
            params["pos_key"] = jax.random.normal(k2, shape, jnp.float32) * self.init_std
        return params

    def build(self, params: dict) -> DeBERTa:
        return DeBERTa(
            params.get("pos_query"),
            params.get("pos_key"),
            self.span,
            position_buckets=self.position_buckets,
            max_relative_positions=self.max_relative_positions,
            terms=tuple(self.terms),
        )
