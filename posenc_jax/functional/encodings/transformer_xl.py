"""Transformer-XL / XLNet relative attention (Dai et al. 2019, appendix B).

``A_{t,s} = q_tᵀ k_s + q_tᵀ W_R R_{t-s} + uᵀ k_s + vᵀ W_R R_{t-s}``, scaled by ``1/√H``:

(a) content, (b) content-position, (c) global content bias u, (d) global
position bias v. ``R_d`` is the sinusoidal encoding of the distance
``d = query_pos - key_pos`` (i - j, Transformer-XL's sign) in Transformer-XL's
concatenated layout ``[sin..., cos...]``, projected per head by ``W_R``
(``[D, N, H]``). Term (a) is the attention's own score; this hook adds (b)-(d):
``u·k_s`` and ``(q_t + v)·W_R R_{t-s}``.

The paper scores each query against the S distances ``S-1, ..., 1, 0`` projected
once and moves each score to its key by :func:`rel_shift` (pad, reshape, slice),
which holds where the queries are the last T of S consecutive keys. Here the
position term is defined for any positions (caches, memory segments, gaps) by the
sinusoid product identity of :mod:`posenc_jax.functional.encodings.sinusoidal_relative`,
exact and with no ``[T, S, H]`` tensor. The paper's way where the positions allow it,
a KV cache's table of ``W_R R_d`` (:meth:`TransformerXL.cache_table`) and the terms
added into the scores by blocks of query rows are its fast forms, in
:mod:`posenc_jax.functional.kernels.transformer_xl`.

Reference: Dai et al., "Transformer-XL: Attentive Language Models beyond a
Fixed-Length Context", ACL 2019, arXiv:1901.02860; Yang et al., "XLNet", 2019,
arXiv:1906.08237.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import AttentionContext, EncodingConfig, parameter, pytree_dataclass
from posenc_jax.functional.core.positions import batched_positions, inverse_frequencies, position_angles
from posenc_jax.functional.core.products import key_heads_for_queries
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.encodings.sinusoidal_relative import key_sinusoids, sinusoidal_relative_logits
from posenc_jax.functional.kernels.row_blocks import by_query_rows
from posenc_jax.functional.kernels.transformer_xl import (
    tile_distance_table,
    tile_terms,
    transformer_xl_terms,
)

__all__ = ["TransformerXL", "TransformerXLConfig", "project_distances", "rel_shift", "transformer_xl_logits"]

TRANSFORMER_XL = Source.paper(
    "dai2019transformer",
    title="Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context",
    authors="Dai, Zihang and Yang, Zhilin and Yang, Yiming and Carbonell, Jaime and Le, Quoc V. and "
    "Salakhutdinov, Ruslan",
    year=2019,
    arxiv="1901.02860",
)


def rel_shift(x: jax.Array) -> jax.Array:
    """Transformer-XL's relative shift: pad one zero column, reshape, drop a row, reshape.

    Input ``x[..., t, c]`` holds scores against distance ``S - 1 - c`` (the ladder
    ``S-1, ..., 1, 0``) for queries that are the last T of S consecutive keys.
    Output ``y[..., t, s]`` holds the score at distance ``(S - T + t) - s``, the
    query-minus-key distance of query t and key s. Entries with ``s > S - T + t``
    (future keys) are filler and must be masked, as in the paper.

    Args:
      x: ``[..., T, S]`` with ``T <= S``.

    Returns:
      ``[..., T, S]``.
    """
    *lead, q_len, k_len = x.shape
    if q_len > k_len:
        raise ValueError(f"rel_shift needs T <= S (queries are the last T keys), got T={q_len}, S={k_len}")
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 0), (1, 0)])  # [..., T, S+1]
    padded = padded.reshape(*lead, k_len + 1, q_len)
    return padded[..., 1:, :].reshape(*lead, q_len, k_len)


def project_distances(distances, position_projection, *, base: float = 10000.0) -> jax.Array:
    """``W_R R_d``: the relative sinusoids of integer ``distances`` ``[L]`` projected per head, ``[L, N, H]``.

    ``R_d`` is ``[sin(d·ω), cos(d·ω)]`` (Transformer-XL's concatenated layout, width D) with
    ``ω = base**(-2i/D)``; ``position_projection`` is ``W_R`` ``[D, N, H]``. A KV cache stores
    it for ``d = 0 .. capacity-1`` (:meth:`TransformerXL.cache_table`).

    Example:
      >>> project_distances(jnp.arange(3), jnp.ones((4, 2, 5))).shape
      (3, 2, 5)
    """
    dim = np.shape(position_projection)[0]
    angles = position_angles(jnp.asarray(distances, jnp.int32), inverse_frequencies(dim, base=base))  # [L, D/2]
    sinusoids = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [L, D]
    return jnp.einsum("LD,DNH->LNH", sinusoids, position_projection, preferred_element_type=jnp.float32)


def _content_bias_term(k, content_bias) -> jax.Array:
    """(c) ``u · k_s`` per head, ``[B, S, N]`` (grouped key heads repeated for their queries)."""
    num_heads = np.shape(content_bias)[0]
    keys = key_heads_for_queries(k, num_heads)
    return jnp.einsum("NH,BSNH->BSN", content_bias, keys, preferred_element_type=jnp.float32)


def _position_term(shifted_q, position_projection, query_positions, key_positions, sinusoids=None, *, base):
    """(b) + (d) ``(q_t + v) · W_R R_{t-s}``, ``[B, N, T, S]``, for any positions, by the sinusoid identity:
    ``g_t = (q_t + v) W_Rᵀ`` ``[B, T, N, D]`` dotted with ``R_{t-s}``, which expands into products of the
    query's and the key's sines and cosines (``sinusoids``, the keys' ``R`` when computed earlier)."""
    g = jnp.einsum("BTNH,DNH->BTND", shifted_q, position_projection, preferred_element_type=jnp.float32)
    return sinusoidal_relative_logits(
        g, query_positions, key_positions, sign=-1, layout="half", base=base, key_features=sinusoids
    )


def _check_params(q, position_projection, content_bias, position_bias, distance_table):
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    if np.ndim(position_projection) != 3 or tuple(np.shape(position_projection)[1:]) != (num_heads, head_dim):
        raise ValueError(
            f"position_projection W_R must have shape [D, N={num_heads}, H={head_dim}], "
            f"got {np.shape(position_projection)}"
        )
    if np.shape(position_projection)[0] % 2:
        raise ValueError(f"the relative sinusoid width D must be even, got {np.shape(position_projection)[0]}")
    for name, bias in (("content_bias u", content_bias), ("position_bias v", position_bias)):
        if tuple(np.shape(bias)) != (num_heads, head_dim):
            raise ValueError(f"{name} must have shape [N={num_heads}, H={head_dim}], got {np.shape(bias)}")
    if distance_table is not None and tuple(np.shape(distance_table)[1:]) != (num_heads, head_dim):
        raise ValueError(
            f"distance_table must have shape [L, N={num_heads}, H={head_dim}] (project_distances), "
            f"got {np.shape(distance_table)}"
        )


def transformer_xl_logits(
    q,
    k,
    query_positions,
    key_positions,
    *,
    position_projection,
    content_bias,
    position_bias,
    scale: float | None = None,
    base: float = 10000.0,
    key_features: dict | None = None,
    distance_table: jax.Array | None = None,
    mask: jax.Array | None = None,
    causal: bool = False,
    into: jax.Array | None = None,
    block_elements: int = 1 << 21,
):
    """Terms (b) + (c) + (d) of Transformer-XL attention, ``scale · (u·k_s + (q_t + v)·W_R R_{t-s})``.

    ``[B, N, T, S]`` float32. The position term is exact for any positions by the sinusoid
    identity (``D / H`` times the content score's work). Where they hold (checked at run time),
    cheaper ways give the same values
    (:func:`~posenc_jax.functional.kernels.transformer_xl.transformer_xl_terms`): the paper's
    ladder and :func:`rel_shift` in causal attention whose queries are the last T of S
    consecutive keys; a ``distance_table`` in decoding with a cache.

    Args:
      q: ``[B, T, N, H]`` queries; k: ``[B, S, K, H]`` keys (N a multiple of K).
      query_positions, key_positions: integer ``[T]``/``[B, T]``, ``[S]``/``[B, S]``; keys
        may be longer than queries (memory from earlier segments).
      position_projection: ``W_R`` ``[D, N, H]`` projecting the width-D sinusoid per head.
      content_bias: ``u`` ``[N, H]``; position_bias: ``v`` ``[N, H]``.
      scale: default ``1/√H`` (the paper scales all four terms together).
      base: sinusoid base.
      key_features: optional per-key parts computed earlier (a KV cache stores them, see
        :meth:`TransformerXL.key_features`): ``"content"`` ``[B, S, N]`` (``u · k_s``) and,
        optionally, ``"sinusoids"`` ``[B, S, D]``; computed from ``k`` and ``key_positions``
        when None (the sinusoids when absent, where needed).
      distance_table: optional ``W_R R_d`` for the distances ``d = 0 .. L-1``, float32
        ``[L, N, H]`` (:func:`project_distances`; a KV cache stores it once).
      mask: optional boolean ``[B|1, N|1, T, S]`` (True = attend): keys it hides need not be
        at a distance the table holds.
      causal: the attention masks keys after each query (their entries are then filler).
      into: optional float32 scores ``[B, N, T, S]``: the term is computed by blocks of
        query rows and added to them in place (``into + term``, the term never stored whole).
        Or a function that makes them: then, in causal self-attention with the ladder's
        positions, each block of rows is computed against the keys up to its last row only
        (5/8 of the work; the scores made inside the run-time choice, so never copied).
      block_elements: with ``into``, about how many values each block of rows holds.

    Example:
      >>> q = jnp.ones((1, 3, 2, 4)); k = jnp.ones((1, 5, 2, 4))
      >>> out = transformer_xl_logits(q, k, jnp.arange(2, 5), jnp.arange(5),
      ...     position_projection=jnp.ones((6, 2, 4)), content_bias=jnp.ones((2, 4)),
      ...     position_bias=jnp.ones((2, 4)))
      >>> out.shape
      (1, 2, 3, 5)
    """
    _check_params(q, position_projection, content_bias, position_bias, distance_table)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    decoding = key_features is not None  # a step against a cache: never the ladder's layout
    if key_features is None:
        key_features = {"content": _content_bias_term(k, content_bias)}
    content = jnp.swapaxes(key_features["content"], 1, 2)[:, :, None, :]  # (c) u · k_s: [B, N, 1, S]
    shifted_q = q.astype(jnp.float32) + jnp.asarray(position_bias, jnp.float32)[None, None]  # q_t + v
    query_positions = batched_positions(query_positions, "query_positions")  # [B|1, T]
    key_positions = batched_positions(key_positions, "key_positions")  # [B|1, S]
    position_term = functools.partial(_position_term, base=base)
    if into is None and distance_table is None and not causal:  # no cheaper way applies: the plain form
        sinusoids = key_features.get("sinusoids")
        position = position_term(shifted_q, position_projection, query_positions, key_positions, sinusoids)
        return (content + position) * jnp.float32(scale)
    return transformer_xl_terms(
        content,
        shifted_q,
        query_positions,
        key_positions,
        position_projection,
        position_scores=position_term,
        key_sinusoids=functools.partial(key_sinusoids, dim=np.shape(position_projection)[0], base=base),
        project_distances=functools.partial(project_distances, base=base),
        scale=scale,
        stored_sinusoids=key_features.get("sinusoids"),
        decoding=decoding,
        distance_table=distance_table,
        mask=mask,
        causal=causal,
        into=into,
        block_elements=block_elements,
    )


@pytree_dataclass
class TransformerXL:
    """Transformer-XL relative attention terms as a ``logits`` hook.

    Holds ``W_R`` ``[D, N, H]``, ``u`` and ``v`` ``[N, H]`` (parameters of the
    caller's module).

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 2, 8)); pos = jnp.arange(4)
      >>> xl = TransformerXL(jnp.zeros((16, 2, 8)), jnp.zeros((2, 8)), jnp.zeros((2, 8)))
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[xl], causal=True).shape
      (1, 4, 2, 8)
    """

    position_projection: jax.Array = parameter()
    content_bias: jax.Array = parameter()
    position_bias: jax.Array = parameter()
    scale: float | None = None
    base: float = 10000.0
    cached_keys: dict | None = parameter(default=None)
    distance_table: jax.Array | None = parameter(default=None)
    tile_table: tuple | None = parameter(default=None)

    def key_features(self, k, key_positions) -> dict:
        """What a KV cache stores per key: ``u · k_s`` ``[B, S, N]`` (the position term reads the
        cache's table, :meth:`cache_table`, or each key's sinusoid computed from its position)."""
        return {"content": _content_bias_term(k, self.content_bias)}

    def with_key_features(self, features: dict) -> TransformerXL:
        """This hook reading the per-key parts of every key from ``features`` (a KV cache's)."""
        return dataclasses.replace(self, cached_keys=features)

    def map_key_features(self, fn) -> TransformerXL:
        """This hook with every stored per-key array ``[B, S, ...]`` replaced by ``fn`` of it (blockwise
        attention takes each key tile's)."""
        return dataclasses.replace(self, cached_keys=jax.tree.map(fn, self.cached_keys))

    def cache_table(self, capacity: int) -> jax.Array:
        """What a KV cache of ``capacity`` slots computes once: ``W_R R_d`` for ``d = 0 .. capacity-1``,
        ``[capacity, N, H]`` (:func:`project_distances`), every distance between two keys it can hold
        at consecutive positions."""
        return project_distances(jnp.arange(capacity), self.position_projection, base=self.base)

    def with_cache_table(self, table: jax.Array) -> TransformerXL:
        """This hook scoring its queries against ``table`` (:meth:`cache_table`) where every key the
        mask lets through is at a distance it holds, by the sinusoid identity otherwise."""
        return dataclasses.replace(self, distance_table=table)

    def logits(self, q, k, context: AttentionContext):
        return self._terms(q, k, context)

    def for_tiles(self, context: AttentionContext, block_q: int, block_k: int) -> TransformerXL:
        """This hook with ``W_R R_d`` projected once for every distance the call's tiles can need
        (:func:`~posenc_jax.functional.kernels.transformer_xl.tile_distance_table`; ``context``: the
        whole call's), which :meth:`tile_logits` reads."""
        table = tile_distance_table(
            context.query_positions,
            context.key_positions,
            self.position_projection,
            functools.partial(project_distances, base=self.base),
            causal=context.causal,
            tiles=(block_q, block_k),
        )
        return dataclasses.replace(self, tile_table=table)

    def tile_logits(self, q, k, context: AttentionContext):
        """One tile's terms: from the call's projected distances where the tile's positions are runs
        (:func:`~posenc_jax.functional.kernels.transformer_xl.tile_terms`: two score products' work), by
        the sinusoid identity otherwise (and without :meth:`for_tiles`'s table)."""
        return self._tile(q, k, context)

    def tile_scores(self, q, k, context: AttentionContext, content):
        """``content(q, k) + tile_logits(q, k, context)``, the terms added into the content scores by blocks of
        query rows where they lie (the tile's scores are the only tile-sized array)."""
        return self._tile(q, k, context, into=content(q, k))

    def _tile(self, q, k, context: AttentionContext, into=None):
        if self.tile_table is None:
            return self.logits(q, k, context) if into is None else into + self.logits(q, k, context)
        _check_params(q, self.position_projection, self.content_bias, self.position_bias, None)
        plain = dataclasses.replace(self, distance_table=None, tile_table=None)
        # The identity for any positions: the terms' plain form (not causal: no ladder to try in a tile), by
        # blocks of query rows in turn, so that this branch, rarely taken, needs no more memory than the table's.
        rows_context = lambda positions: dataclasses.replace(
            context, causal=False, mask=None, query_positions=positions
        )
        identity = lambda: by_query_rows(
            lambda q_rows, positions: plain._terms(q_rows, k, rows_context(positions)), q, context.query_positions
        )
        features = self.cached_keys if self.cached_keys is not None else self.key_features(k, context.key_positions)
        content = jnp.swapaxes(features["content"], 1, 2)[:, :, None, :]  # u · k_s: [B, N, 1, bk]
        shifted_q = q.astype(jnp.float32) + jnp.asarray(self.position_bias, jnp.float32)[None, None]
        scale = context.scale if self.scale is None else self.scale
        return tile_terms(
            content,
            shifted_q,
            batched_positions(context.query_positions, "query_positions"),
            batched_positions(context.key_positions, "key_positions"),
            self.tile_table,
            projection=self.position_projection,
            project=functools.partial(project_distances, base=self.base),
            scale=scale,
            identity=identity,
            into=into,
        )

    def add_logits(self, scores: jax.Array, q: jax.Array, k: jax.Array, context: AttentionContext) -> jax.Array:
        """``scores + logits``, the terms added by blocks of query rows into the scores (never stored whole)."""
        return self._terms(q, k, context, into=scores)

    def add_logits_to_content(self, content, q: jax.Array, k: jax.Array, context: AttentionContext) -> jax.Array:
        """The content scores ``content()`` plus the terms: made inside the run-time choice between causal
        prefixes and all keys (:func:`transformer_xl_logits`), so that choice never copies them."""
        return self._terms(q, k, context, into=content)

    def _terms(self, q, k, context: AttentionContext, into=None):
        return transformer_xl_logits(
            q,
            k,
            context.query_positions,
            context.key_positions,
            position_projection=self.position_projection,
            content_bias=self.content_bias,
            position_bias=self.position_bias,
            scale=context.scale if self.scale is None else self.scale,
            base=self.base,
            key_features=self.cached_keys,
            distance_table=self.distance_table,
            mask=context.mask,
            causal=context.causal,
            into=into,
        )


@register_encoding(
    "transformer-xl",
    description="Relative sinusoids of i - j projected per head, with global content and position biases u, v.",
    source=TRANSFORMER_XL,
    hook=TransformerXL,
    hooks=("logits",),
    tiled=("logits", "scores", "per_call"),
    cached=("key_term", "table", "key_features"),
    prepared=None,
    fused=("rows", "rows_from_content"),
)
@pytree_dataclass
class TransformerXLConfig(EncodingConfig):
    """Transformer-XL: ``W_R`` ``[D, N, H]`` (D = model dim by default), ``u``, ``v`` ``[N, H]`` at zero."""

    sinusoid_dim: int | None = None
    base: float = 10000.0

    def __post_init__(self):
        inverse_frequencies(2, base=self.base)  # validates the base: finite and > 1

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        dim = self.sinusoid_dim or model_dim
        if dim % 2:
            raise ValueError(f"the Transformer-XL sinusoid width must be even, got {dim}")
        return {
            "position_projection": jax.random.normal(key, (dim, num_heads, head_dim), jnp.float32) / np.sqrt(dim),
            "content_bias": jnp.zeros((num_heads, head_dim)),
            "position_bias": jnp.zeros((num_heads, head_dim)),
        }

    def build(self, params: dict) -> TransformerXL:
        return TransformerXL(
            params["position_projection"], params["content_bias"], params["position_bias"], base=self.base
        )
