"""Transformer-XL / XLNet relative attention (Dai et al. 2019, appendix B).

``logits[t, s] = scale · [ q_t·k_s + q_t·W_R R_{t-s} + u·k_s + v·W_R R_{t-s} ]``

(a) content, (b) content-position, (c) global content bias u, (d) global
position bias v. ``R_d`` is the sinusoidal encoding of the distance
``d = query_pos - key_pos`` (i - j, Transformer-XL's sign) in Transformer-XL's
concatenated layout ``[sin..., cos...]``, projected per head by ``W_R``
(``[D, N, H]``). Term (a) is the attention's own score; this hook adds (b)-(d).

Fast path: (b) + (d) is ``((q_t + v) W_Rᵀ) · R_{t-s}``, evaluated with the
sinusoid product identity of :mod:`posenc_jax.functional.encodings.sinusoidal_relative`,
exact for any positions (caches, memory segments, gaps) and with no
``[T, S, H]`` tensor. :func:`rel_shift` is the paper's pad-reshape-slice
shift, for code that computes position scores against a ``[S]`` ladder of
distances as the original implementation does. In attention the terms are
added into the scores by blocks of query rows (:meth:`TransformerXL.add_logits`),
so no ``[B, N, T, S]`` term is stored. Decoding with a KV cache scores the query against
``W_R R_d`` projected once for every distance the cache can hold (the cache's table, see
:meth:`TransformerXL.cache_table`), the work of one content score.

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
from posenc_jax.functional.core.positions import (
    batched_positions,
    inverse_frequencies,
    position_angles,
    position_difference,
)
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.core.relative import (
    by_causal_prefixes_where,
    by_query_blocks,
    consecutive_rows,
    take_along_last_axis,
)
from posenc_jax.functional.encodings.sinusoidal_relative import key_sinusoids, sinusoidal_relative_logits
from posenc_jax.functional.kernels.autodiff import custom_gradients, plain_autodiff

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


def _check_params(q, position_projection, content_bias, position_bias):
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
    """Terms (b) + (c) + (d) of Transformer-XL attention, ``[B, N, T, S]`` float32.

    Three exact ways to the position term: for any positions, the sinusoid product
    identity, a contraction over the sinusoid width D for every (query, key) pair
    (``D / H`` times the content score's work); in causal attention whose queries are the
    last T of S consecutive keys (training, evaluation), the paper's own way, checked at
    run time: the sinusoids of the S distances projected once (``[S, N, H]``), scored
    against every query (the work of one content score) and moved into place by
    :func:`rel_shift`; given a ``distance_table`` (decoding with a cache), each query scored
    against the table and each key's score picked by its distance, when every key the
    mask lets through is at a distance the table holds (checked at run time).

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
        query rows and added to them in place, and ``into + term`` is returned without the
        term ever stored whole (a conditional's ``[B, N, T, S]`` result would be). Or a
        function that makes them: then, in causal self-attention (T = S) with the ladder's
        positions (checked at run time, by one conditional that makes the scores in each
        branch, so nothing is copied into it), each block of rows is computed against the
        keys up to its last row only (:func:`by_causal_prefix_blocks`, 5/8 of the work).
      block_elements: with ``into``, about how many values each block of rows holds.

    Example:
      >>> q = jnp.ones((1, 3, 2, 4)); k = jnp.ones((1, 5, 2, 4))
      >>> out = transformer_xl_logits(q, k, jnp.arange(2, 5), jnp.arange(5),
      ...     position_projection=jnp.ones((6, 2, 4)), content_bias=jnp.ones((2, 4)),
      ...     position_bias=jnp.ones((2, 4)))
      >>> out.shape
      (1, 2, 3, 5)
    """
    _check_params(q, position_projection, content_bias, position_bias)
    head_dim = q.shape[-1]
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    dim = np.shape(position_projection)[0]
    cached = key_features is not None  # a decoding step against a cache: never the ladder's layout
    if key_features is None:
        key_features = {"content": _content_bias_term(k, content_bias)}  # the sinusoids made where needed
    content = jnp.swapaxes(key_features["content"], 1, 2)[:, :, None, :]  # [B, N, 1, S]
    shifted_q = q.astype(jnp.float32) + jnp.asarray(position_bias, jnp.float32)[None, None]
    query_positions = batched_positions(query_positions, "query_positions")  # [B|1, T]
    key_positions = batched_positions(key_positions, "key_positions")
    if distance_table is not None and tuple(np.shape(distance_table)[1:]) != tuple(q.shape[2:]):
        raise ValueError(
            f"distance_table must have shape [L, N={q.shape[2]}, H={q.shape[3]}] (project_distances), "
            f"got {np.shape(distance_table)}"
        )

    q_len, k_len = q.shape[1], k.shape[1]
    make_scores = into if callable(into) else None
    expected = (q.shape[0], q.shape[2], q_len, k_len)
    made = None if make_scores is None else tuple(jax.eval_shape(make_scores).shape)
    if made is not None and made != expected:
        raise ValueError(f"into must make scores [B, N, T, S] = {expected}, got {made}")
    standard = projected = distances = in_table = None
    if distance_table is not None:
        distances = position_difference(query_positions[:, :, None], key_positions[:, None, :])  # [B|1, T, S]
        held = (distances >= 0) & (distances < distance_table.shape[0])
        in_table = jnp.all(held if mask is None else held[:, None] | ~jnp.asarray(mask, jnp.bool_))

    def sinusoids_of_keys() -> jax.Array:
        """``R`` of every key position, ``[B|1, S, D]``: the cache's, or computed from the positions."""
        given = key_features.get("sinusoids")
        return key_sinusoids(key_positions, dim, base=base) if given is None else given

    def by_identity(start, rows: int, sinusoids=None) -> jax.Array:
        """The position term of query rows ``start ..`` by the sinusoid identity: ``[B, N, rows, S]``."""
        q_rows = jax.lax.dynamic_slice_in_dim(shifted_q, start, rows, axis=1)
        row_positions = jax.lax.dynamic_slice_in_dim(query_positions, start, rows, axis=1)
        sinusoids = sinusoids_of_keys() if sinusoids is None else sinusoids
        return _identity_term(dim, base, 0, q_rows, position_projection, row_positions, key_positions, sinusoids)

    if causal and q_len <= k_len and not cached:
        # Queries are the last T of S consecutive keys, in every row: then the ladder, projected once.
        last_keys = jnp.all(position_difference(query_positions[:, :1], key_positions[:, :1]) == k_len - q_len)
        standard = consecutive_rows(query_positions) & consecutive_rows(key_positions) & last_keys
        project = functools.partial(_project_ladder, k_len, position_projection=position_projection, base=base)
        shape = (q.shape[0], q.shape[2], q_len, k_len)
        if make_scores is not None and q_len == k_len and q_len > block_elements // max(1, shape[0] * shape[1] * k_len):
            # Self-attention with the ladder's positions: each block against the keys up to its last row.
            def ladder_blocks():
                projected = project()  # distances S-1 .. 0; a block of width w reads its last w: w-1 .. 0

                def block(start, rows: int, width: int, current=None) -> jax.Array:
                    q_rows = jax.lax.dynamic_slice_in_dim(shifted_q, start, rows, axis=1)
                    position = _position_term_by_ladder(q_rows, projected[k_len - width :], start, width)
                    return (content[..., :width] + position) * jnp.float32(scale)

                return block

            def every_key(scores):
                sinusoids = sinusoids_of_keys()
                terms = lambda start, rows: (content + by_identity(start, rows, sinusoids)) * jnp.float32(scale)
                return by_query_blocks(terms, shape, jnp.float32, block_elements=block_elements, into=scores)

            return by_causal_prefixes_where(
                standard, make_scores, ladder_blocks, every_key, block_elements=block_elements
            )
        projected = jax.lax.cond(standard, project, lambda: jnp.zeros((k_len, *q.shape[2:]), jnp.float32))
    if make_scores is not None:
        into = make_scores()
    # Computed once here (not per block) when the call computes them; a cache's decoding step computes
    # them only where its table cannot serve.
    sinusoids = None if cached else sinusoids_of_keys()

    def rows_term(start, rows: int) -> jax.Array:
        """The term of query rows ``start .. start + rows - 1``: ``[B, N, rows, S]``."""
        q_rows = jax.lax.dynamic_slice_in_dim(shifted_q, start, rows, axis=1)
        identity = functools.partial(by_identity, start, rows, sinusoids)
        if in_table is not None:
            row_distances = jax.lax.dynamic_slice_in_dim(distances, start, rows, axis=1)
            by_table = _position_term_by_table(q_rows, distance_table, row_distances)
            row_positions = jax.lax.dynamic_slice_in_dim(query_positions, start, rows, axis=1)
            operands = (q_rows, position_projection, row_positions, key_positions, key_features.get("sinusoids"))
            position = _identity_unless(dim, base, ~in_table, by_table, operands)
        elif standard is None:
            position = identity()
        else:
            ladder = lambda: _position_term_by_ladder(q_rows, projected, start, q_len)
            position = jax.lax.cond(standard, ladder, identity)
        return (content + position) * jnp.float32(scale)

    if into is None:
        return rows_term(0, q_len)
    return by_query_blocks(rows_term, tuple(into.shape), jnp.float32, block_elements=block_elements, into=into)


def _identity_term(
    dim: int, base: float, offset, shifted_q, position_projection, query_positions, key_positions, sinusoids
):
    """The position term by the sinusoid identity, ``[B, N, T, S]``, with ``offset`` (zero) added to every
    position: the distances, and so the term, are unchanged."""
    query_positions, key_positions = query_positions + offset, key_positions + offset
    g = jnp.einsum("BTNH,DNH->BTND", shifted_q, position_projection, preferred_element_type=jnp.float32)
    return sinusoidal_relative_logits(
        g,
        query_positions,
        key_positions,
        sign=-1,
        layout="half",
        base=base,
        key_features=key_sinusoids(key_positions, dim, base=base) if sinusoids is None else sinusoids,
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _identity_unless(dim: int, base: float, use_identity, by_table, operands):
    """``by_table``, or the identity's term (:func:`_identity_term` of ``operands``) where ``use_identity``.

    A loop of one pass or none, not a conditional: in a decoding step, XLA:CPU ran the
    conditional beside the whole-cache copies of the score and value products, which then
    took longer (a step 1.46× and 1.51× NoPE's at 684 and 1024 cache slots, paired, 15 rounds;
    1.05× and 1.03× as this loop). The loop's counter (0 in its one pass) is added to the
    positions, so XLA cannot hoist the identity out of the loop and run it every step. A loop
    with a run-time trip count has no reverse-mode derivative: the derivatives are those of a
    selection between the two (below), so ``jax.grad`` and ``jax.jvp`` work as they did.
    """
    body = lambda i, current: _identity_term(dim, base, i, *operands)
    return jax.lax.fori_loop(0, use_identity.astype(jnp.int32), body, by_table)


@_identity_unless.defjvp
def _identity_unless_jvp(dim, base, primals, tangents):
    use_identity, by_table, operands = primals
    _, table_dot, operands_dot = tangents

    def chosen(by_table, operands):
        # A selection, not a conditional: JAX (0.10) cannot transpose a conditional inside a custom JVP rule
        # under vmap with a batched predicate (grad of vmap raised). The identity then runs whenever the step
        # is differentiated, which a decoding step rarely is.
        return jnp.where(use_identity, _identity_term(dim, base, 0, *operands), by_table)

    with plain_autodiff():  # forward mode through the identity: its custom-VJP operations in their plain form
        return jax.jvp(chosen, (by_table, operands), (table_dot, operands_dot))


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


def _project_ladder(key_length: int, *, position_projection, base: float) -> jax.Array:
    """``W_R R_d`` for the distances ``S-1, ..., 1, 0`` (the ladder): ``[S, N, H]``."""
    return project_distances(jnp.arange(key_length - 1, -1, -1), position_projection, base=base)


def _scores_against(shifted_q, projected) -> jax.Array:
    """``[B, N, T, L]``: each query against each of ``projected`` ``[L, N, H]`` (shared by the batch).

    Written as the content score's product, with ``projected`` broadcast over the batch (a copy
    of B·L·N·H values, as many as the keys): XLA:CPU computes ``'BTNH,LNH->BNTL'`` (or its
    heads-first form) as ``[N, L, T]`` and then transposes the whole product, ~1.7× its time
    at T = L = 1024.
    """
    keys = jnp.broadcast_to(projected[None], (shifted_q.shape[0], *projected.shape))
    return jnp.einsum("BTNH,BLNH->BNTL", shifted_q, keys, preferred_element_type=jnp.float32)


def _position_term_by_table(shifted_q, table, distances) -> jax.Array:
    """``(q + v) · W_R R_{i-j}`` read from ``table`` (``W_R R_d`` for ``d = 0 .. L-1``): ``[B, N, rows, S]``.

    ``shifted_q`` ``[B, rows, N, H]``; ``distances`` int32 ``[B|1, rows, S]`` (query minus key).
    Each query is scored against all L projected distances (one product the size of a content
    score against L keys) and each key's score picked by its distance (clipped into the table:
    the caller checks that every key it does not mask is inside).
    """
    scores = jnp.einsum(  # a few query rows (decoding): no product worth broadcasting the table for
        "BNTH,NLH->BNTL", jnp.swapaxes(shifted_q, 1, 2), jnp.swapaxes(table, 0, 1), preferred_element_type=jnp.float32
    )
    index = jnp.clip(distances, 0, table.shape[0] - 1)[:, None]  # [B|1, 1, rows, S]
    index = jnp.broadcast_to(index, (scores.shape[0], 1) + index.shape[2:])
    return jnp.take_along_axis(scores, index, axis=-1)


def _position_term_by_ladder(shifted_q, projected, first_row, q_len: int) -> jax.Array:
    """``(q + v) · W_R R_{i-j}`` for queries that are the last T of S consecutive keys: ``[B, N, rows, S]``.

    ``shifted_q`` ``[B, rows, N, H]`` holds query rows ``first_row ..`` of the call's T; ``projected``
    (:func:`_project_ladder`) the sinusoids of the distances ``S-1, ..., 1, 0`` projected by ``W_R``
    once. Each query is scored against the ladder and each score moved to its key as
    :func:`rel_shift` does (by one gather); entries of keys after the query are filler (masked in
    causal attention).
    """
    scores = _scores_against(shifted_q, projected)
    first_row = jnp.asarray(first_row, jnp.int32)
    if not custom_gradients():
        return _gather_ladder_columns(scores, first_row, q_len)
    return _shift_to_keys(scores, first_row, q_len)


def _ladder_columns(first_row, rows: int, q_len: int, k_len: int) -> jax.Array:
    """``[rows, S]``: the ladder column of key s for query t = first_row + r, ``T - 1 - t + s``
    (distance ``S - T + t - s``), capped at ``S - 1``."""
    query = first_row + jnp.arange(rows)[:, None]
    return jnp.minimum(jnp.arange(k_len)[None, :] - query + (q_len - 1), k_len - 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _shift_to_keys(scores: jax.Array, first_row: jax.Array, q_len: int) -> jax.Array:
    """:func:`rel_shift`'s result by one gather, for query rows ``first_row ..`` of T = ``q_len``:
    ``out[..., r, s] = scores[..., r, min(T - 1 - (first_row + r) + s, S - 1)]``.

    A gather XLA fuses into its consumer; its transpose (below) is a gather and a masked
    sum, not the scatter autodiff would make of it.
    """
    return _gather_ladder_columns(scores, first_row, q_len)


def _gather_ladder_columns(scores, first_row, q_len: int, flat: bool = False) -> jax.Array:
    rows, k_len = scores.shape[-2:]
    columns = _ladder_columns(first_row, rows, q_len, k_len)[None, None]
    if flat:
        return take_along_last_axis(scores, columns)
    return jnp.take_along_axis(scores, columns, axis=-1)


def _shift_forward(scores, first_row, q_len):
    # With the gradient, the flat gather (as relative.gather_by_distance's forward, and why).
    return _gather_ladder_columns(scores, first_row, q_len, flat=True), first_row


def _shift_backward(q_len, first_row, cotangent):
    rows, k_len = cotangent.shape[-2:]
    query = first_row + jnp.arange(rows)[:, None]  # [rows, 1]: the query index t of each row
    keys = jnp.arange(k_len)[None, :]
    # Column c < S - 1 of row t receives key s = c - (T - 1 - t) alone; column S - 1 receives every key
    # from S - T + t on (the capped ones).
    source = keys - (q_len - 1) + query  # [rows, S]
    inside = (source >= 0) & (keys < k_len - 1)
    moved = take_along_last_axis(cotangent, source[None, None])  # clipped into [0, S)
    grad = jnp.where(inside[None, None], moved, 0.0)
    capped = keys >= (k_len - q_len) + query  # [rows, S]
    tail = jnp.where(capped[None, None], cotangent, 0.0).sum(axis=-1)  # [B, N, rows]
    return grad.at[..., k_len - 1].add(tail), None


_shift_to_keys.defvjp(_shift_forward, _shift_backward)


def _content_bias_term(k, content_bias) -> jax.Array:
    """``u · k_s`` per head, ``[B, S, N]`` (grouped key heads repeated for their queries)."""
    num_heads = np.shape(content_bias)[0]
    keys = jnp.repeat(k, num_heads // k.shape[-2], axis=-2) if k.shape[-2] != num_heads else k
    return jnp.einsum("NH,BSNH->BSN", content_bias, keys, preferred_element_type=jnp.float32)


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
