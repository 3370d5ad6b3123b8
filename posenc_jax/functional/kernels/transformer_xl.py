"""Transformer-XL's terms by their fast forms: the paper's ladder, a cache's table, blocks of query rows.

The encoding (:mod:`posenc_jax.functional.encodings.transformer_xl`) defines the terms
``scale · (u·k_s + (q_t + v)·W_R R_{t-s})`` and computes the position part by the sinusoid
product identity, exact for any positions, a contraction over the sinusoid width D for
every (query, key) pair. :func:`transformer_xl_terms` computes the same values, choosing at
run time the cheaper way the positions allow:

- the ladder, the paper's own way: for causal queries that are the last T of S consecutive
  keys, ``W_R R_d`` for the S distances ``S-1, ..., 1, 0`` projected once (``[S, N, H]``),
  scored against every query (the work of one content score) and moved to its key as
  :func:`~posenc_jax.functional.encodings.transformer_xl.rel_shift` moves it, by one gather
  whose gradient is a gather and a masked sum, not the scatter autodiff would make;
- the table, for decoding with a KV cache: each query scored against ``W_R R_d`` for
  ``d = 0 .. L-1`` and each key's score picked by its distance, where every key the mask
  lets through is at a distance the table holds;
- blocks: the terms added into ``[B, N, T, S]`` scores by blocks of query rows, so the terms
  are never stored whole; in causal self-attention each block against the keys up to its
  last row only (:func:`~posenc_jax.functional.core.relative.by_causal_prefix_blocks`), with a
  gradient that takes the blocks' shares one after another (:func:`_add_ladder_terms`);
- tiles, for blockwise attention: ``W_R R_d`` projected once per call for every distance the
  call's tiles can need (:func:`tile_distance_table`), and each tile whose positions are runs
  scored against the ``bq + bk - 1`` of them it needs, each score moved to its key by a skew
  of the rows (:func:`tile_terms`; :mod:`~posenc_jax.functional.kernels.row_blocks`: a slice and
  reshapes, whose transpose is a pad), by blocks of 128 query rows: about 1.25 score products per tile of 512, where the
  identity does ``D / H`` of them.

The plain forms beside them: the identity (the encoding's, which every way falls back to),
:func:`~posenc_jax.functional.encodings.transformer_xl.rel_shift`, and the float64 reference
:func:`posenc_jax.reference.relative.transformer_xl_logits`; the tests hold each way to them.

Backends: every form here runs on every backend. Two were shaped on XLA:CPU and are registered
for the CPU only (:class:`~posenc_jax.functional.core.operations.Operation`), the plain form runs
on the others: the ladder's scores written as the content score's batched product
(:func:`_scores_against`; elsewhere the plain product) and the table-or-identity choice as a
loop of one pass or none (:func:`_identity_unless`; elsewhere a conditional).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.blocks import causal_prefix_stages, each_stage_block, takes_causal_prefixes
from posenc_jax.functional.core.operations import Operation
from posenc_jax.functional.core.positions import position_difference, with_batch_axis
from posenc_jax.functional.core.relative import (
    _consecutive_rows,
    by_causal_prefix_blocks,
    by_query_blocks,
    take_along_last_axis,
)
from posenc_jax.functional.kernels.autodiff import linear_primitives, tangent_primitive
from posenc_jax.functional.kernels.row_blocks import add_rows, row_block, skew_rows

__all__ = [
    "shift_ladder_scores",
    "tile_distance_table",
    "tile_terms",
    "transformer_xl_terms",
]

# Positions whose distances reach this far take the identity in a tile (the table's index arithmetic is
# exact well inside int32).
_REACH = 1 << 30


def transformer_xl_terms(
    content: jax.Array,
    shifted_q: jax.Array,
    query_positions: jax.Array,
    key_positions: jax.Array,
    position_projection: jax.Array,
    *,
    position_scores: Callable,
    key_sinusoids: Callable,
    project_distances: Callable,
    scale: float,
    stored_sinusoids: jax.Array | None = None,
    decoding: bool = False,
    distance_table: jax.Array | None = None,
    mask: jax.Array | None = None,
    causal: bool = False,
    into=None,
    block_elements: int = 1 << 21,
) -> jax.Array:
    """``scale · (content + (q_t + v)·W_R R_{t-s})``, ``[B, N, T, S]`` float32, by the fastest exact way.

    Args:
      content: ``u · k_s`` ``[B, N, 1, S]``; shifted_q: ``q + v`` float32 ``[B, T, N, H]``.
      query_positions, key_positions: int32 ``[B|1, T]``, ``[B|1, S]``, checked (the encoding's entry checks them).
      position_projection: ``W_R`` ``[D, N, H]``.
      position_scores: the identity, ``position_scores(shifted_q, W_R, query_positions,
        key_positions, sinusoids)`` ``[B, N, T, S]`` for any positions (sinusoids None: from
        the key positions).
      key_sinusoids: ``key_sinusoids(key_positions)``, the keys' ``R`` ``[B|1, S, D]``.
      project_distances: ``project_distances(distances, W_R)``, ``W_R R_d`` ``[L, N, H]``.
      scale: the factor of all terms.
      stored_sinusoids: the keys' sinusoids a cache stored, or None (computed where needed).
      decoding: a step against a KV cache, never the ladder's layout.
      distance_table, mask, causal, into, block_elements: as
        :func:`~posenc_jax.functional.encodings.transformer_xl.transformer_xl_logits`.
    """
    batch, q_len, num_heads = shifted_q.shape[:3]
    k_len = content.shape[-1]
    expected = (batch, num_heads, q_len, k_len)
    make_scores = _score_maker(into, expected)
    standard = projected = None
    distances, in_table = _table_reach(distance_table, query_positions, key_positions, mask)

    def sinusoids_of_keys() -> jax.Array:
        return key_sinusoids(key_positions) if stored_sinusoids is None else stored_sinusoids

    def by_identity(start, rows: int, sinusoids=None) -> jax.Array:
        """The position term of query rows ``start ..`` by the identity: ``[B, N, rows, S]``."""
        q_rows = jax.lax.dynamic_slice_in_dim(shifted_q, start, rows, axis=1)
        row_positions = jax.lax.dynamic_slice_in_dim(query_positions, start, rows, axis=1)
        sinusoids = sinusoids_of_keys() if sinusoids is None else sinusoids
        return position_scores(q_rows, position_projection, row_positions, key_positions, sinusoids)

    if causal and q_len <= k_len and not decoding:
        # Queries are the last T of S consecutive keys, in every row: then the ladder, projected once.
        last_keys = jnp.all(position_difference(query_positions[:, :1], key_positions[:, :1]) == k_len - q_len)
        standard = _consecutive_rows(query_positions) & _consecutive_rows(key_positions) & last_keys
        project = lambda: project_distances(jnp.arange(k_len - 1, -1, -1), position_projection)  # S-1 .. 0
        if make_scores is not None and q_len == k_len and takes_causal_prefixes(expected, block_elements):
            # Self-attention with the ladder's positions: each block against the keys up to its last row.
            operands = (content, shifted_q, project, sinusoids_of_keys, by_identity)
            return _ladder_by_prefixes(standard, make_scores, operands, scale=scale, block_elements=block_elements)
        projected = jax.lax.cond(standard, project, lambda: jnp.zeros((k_len, *shifted_q.shape[2:]), jnp.float32))
    if make_scores is not None:
        into = make_scores()
    # Computed once here (not per block) when the call computes them; a cache's decoding step computes
    # them only where its table cannot serve.
    sinusoids = None if decoding else sinusoids_of_keys()

    def rows_term(start, rows: int) -> jax.Array:
        """The terms of query rows ``start .. start + rows - 1``: ``[B, N, rows, S]``."""
        q_rows = jax.lax.dynamic_slice_in_dim(shifted_q, start, rows, axis=1)
        identity = functools.partial(by_identity, start, rows, sinusoids)
        if in_table is not None:
            row_distances = jax.lax.dynamic_slice_in_dim(distances, start, rows, axis=1)
            by_table = _position_term_by_table(q_rows, distance_table, row_distances)
            row_positions = jax.lax.dynamic_slice_in_dim(query_positions, start, rows, axis=1)
            operands = (q_rows, position_projection, row_positions, key_positions, stored_sinusoids)
            position = _identity_unless(position_scores, key_sinusoids, ~in_table, by_table, operands)
        elif standard is None:
            position = identity()
        else:
            ladder = lambda: _position_term_by_ladder(q_rows, projected, start, q_len)
            position = jax.lax.cond(standard, ladder, identity)
        return (content + position) * jnp.float32(scale)

    if into is None:
        return rows_term(0, q_len)
    return by_query_blocks(rows_term, tuple(into.shape), jnp.float32, block_elements=block_elements, into=into)


def _score_maker(into, expected: tuple):
    """``into`` when it is a function making the scores (checked to make ``expected``), else None."""
    make_scores = into if callable(into) else None
    made = None if make_scores is None else tuple(jax.eval_shape(make_scores).shape)
    if made is not None and made != expected:
        raise ValueError(f"into must make scores [B, N, T, S] = {expected}, got {made}")
    return make_scores


def _table_reach(distance_table, query_positions, key_positions, mask):
    """``(distances [B|1, T, S], whether every seen distance is in the table)``; ``(None, None)`` without one."""
    if distance_table is None:
        return None, None
    distances = position_difference(query_positions[:, :, None], key_positions[:, None, :])  # [B|1, T, S]
    held = (distances >= 0) & (distances < distance_table.shape[0])
    return distances, jnp.all(held if mask is None else held[:, None] | ~jnp.asarray(mask, jnp.bool_))


def _ladder_by_prefixes(standard, make_scores, operands, *, scale: float, block_elements: int) -> jax.Array:
    """Self-attention's terms made into ``make_scores()`` block by block, each block against the keys up to
    its last row by the ladder where ``standard`` (the ladder's positions), else against every key by the
    identity. ``operands``: ``(content, shifted_q, project, sinusoids_of_keys, by_identity)``."""
    content, shifted_q, project, sinusoids_of_keys, by_identity = operands
    k_len = content.shape[-1]
    expected = (shifted_q.shape[0], shifted_q.shape[2], shifted_q.shape[1], k_len)

    def ladder():
        return _add_ladder_terms(make_scores(), content, shifted_q, project(), scale, block_elements)

    def every_key():
        sinusoids = sinusoids_of_keys()
        terms = lambda start, rows: (content + by_identity(start, rows, sinusoids)) * jnp.float32(scale)
        return by_query_blocks(terms, expected, jnp.float32, block_elements=block_elements, into=make_scores())

    # As by_causal_prefixes_where: each branch makes the scores (no copy), the identity's rematerialised.
    return jax.lax.cond(standard, ladder, jax.checkpoint(every_key))


def _ladder_block(content, q_rows, projected, start, width: int, scale: float) -> jax.Array:
    """The terms of rows ``start ..`` against keys ``0 .. width - 1``, from ``projected``'s last ``width`` rows."""
    k_len = projected.shape[0]
    position = _position_term_by_ladder(q_rows, projected[k_len - width :], start, width)
    return (content[..., :width] + position) * jnp.float32(scale)


def _add_ladder_terms_plain(scores, content, shifted_q, projected, scale: float, block_elements: int) -> jax.Array:
    """``scores`` plus the terms by the ladder, each block of rows against the keys up to its rows, in place.
    Its reverse mode (:func:`_add_ladder_terms`), the terms being linear, keeps ``content``, ``shifted_q`` and
    ``projected`` only and takes each block's share from the cotangent one block after another."""

    def block(start, rows: int, width: int, current=None) -> jax.Array:
        q_rows = jax.lax.dynamic_slice_in_dim(shifted_q, start, rows, axis=1)
        return _ladder_block(content, q_rows, projected, start, width, scale)

    return by_causal_prefix_blocks(block, scores.astype(jnp.float32), block_elements=block_elements)


_add_ladder_terms = jax.custom_jvp(_add_ladder_terms_plain, nondiff_argnums=(4, 5))
_LADDER_TANGENT = tangent_primitive("transformer_xl_ladder_tangent")


@_add_ladder_terms.defjvp
def _add_ladder_terms_jvp(scale, block_elements, primals, tangents):
    def jvp(tangents, fixed):  # forward mode: the scores' tangent plus the terms' (autodiff's)
        terms = lambda *operands: _add_ladder_terms_plain(jnp.zeros_like(tangents[0]), *operands, scale, block_elements)
        return tangents[0] + jax.jvp(terms, tuple(fixed), tuple(tangents[1:]))[1]

    transpose = functools.partial(_add_ladder_terms_backward, scale, block_elements)
    out = _add_ladder_terms(*primals, scale, block_elements)
    return out, _LADDER_TANGENT(jvp, transpose, tuple(tangents), tuple(primals[1:]))


def _add_ladder_terms_backward(scale, block_elements, residuals, cotangent):
    """Reverse mode: the cotangents of the scores, ``content``, ``shifted_q`` and ``projected``."""
    _, shifted_q, projected = residuals
    batch, heads, q_len, k_len = cotangent.shape

    def stage_block(first: int, last: int, rows: int):
        """Adds the share of one block of rows of the stage ``first .. last - 1`` (keys ``0 .. last - 1``)."""

        def add(block, grads):
            d_content, d_q, d_projected = grads
            begin = first + block * rows
            start = jnp.minimum(begin, last - rows)
            query = start + jnp.arange(rows)[:, None]  # [rows, 1]
            fresh = query >= begin  # a shifted-back block's overlap was added once
            keys = jnp.arange(last)[None, :]
            # Each key's cotangent moved back to its ladder column (as _shifted_back, one buffer): column c < last - 1
            # of query t holds key c - (last - 1) + t; the last (distance 0), every key from t on (the tail).
            source = keys - (last - 1) + query
            source = jnp.where(fresh & (keys < last - 1) & (source >= 0), source, k_len)  # k_len: none (0)
            d_ladder = cotangent.at[:, :, query, source].get(mode="fill", fill_value=0.0)  # [B, N, rows, last]
            row_cotangent = jnp.where(fresh, cotangent[:, :, query[:, 0], :last], 0.0)
            tail = jnp.where(keys >= query, row_cotangent, 0.0).sum(axis=-1)  # [B, N, rows]: the last column's
            d_content = d_content.at[..., :last].add(row_cotangent.sum(axis=2, keepdims=True) * jnp.float32(scale))
            ladder = projected[k_len - last :]  # distances last - 1 .. 0
            q_rows = jax.lax.dynamic_slice_in_dim(shifted_q, start, rows, axis=1)
            d_rows = jnp.einsum("BNTL,LNH->BTNH", d_ladder, ladder) + jnp.einsum("BNT,NH->BTNH", tail, ladder[-1])
            d_q = d_q.at[:, query[:, 0]].add(d_rows * jnp.float32(scale))
            d_ladder_rows = jnp.einsum("BNTL,BTNH->LNH", d_ladder, q_rows, preferred_element_type=jnp.float32)
            d_ladder_rows = d_ladder_rows.at[-1].add(jnp.einsum("BNT,BTNH->NH", tail, q_rows))
            return d_content, d_q, d_projected.at[k_len - last :].add(d_ladder_rows * jnp.float32(scale))

        return add

    stages = causal_prefix_stages(q_len, batch * heads, block_elements)
    grads = each_stage_block(stages, stage_block, jax.tree.map(jnp.zeros_like, residuals))
    return cotangent, *grads


def _identity_at(position_scores, key_sinusoids, offset, shifted_q, projection, query_positions, key_positions, given):
    """The identity's term with ``offset`` (zero) added to every position: the distances, and so the term,
    are unchanged."""
    query_positions, key_positions = query_positions + offset, key_positions + offset
    sinusoids = key_sinusoids(key_positions) if given is None else given
    return position_scores(shifted_q, projection, query_positions, key_positions, sinusoids)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _identity_unless(position_scores, key_sinusoids, use_identity, by_table, operands):
    """``by_table``, or the identity's term (:func:`_identity_at` of ``operands``) where ``use_identity``.

    A loop of one pass or none, not a conditional: in a decoding step, XLA:CPU ran the
    conditional beside the whole-cache copies of the score and value products, which then
    took longer. The loop's counter (0 in its one pass) is added to the
    positions, so XLA cannot hoist the identity out of the loop and run it every step. A loop
    with a run-time trip count has no reverse-mode derivative: the derivatives are those of a
    selection between the two (below), so ``jax.grad`` and ``jax.jvp`` work as they would
    through a conditional.

    On the CPU only (:data:`IDENTITY_UNLESS`); on the other backends, the conditional.
    """
    return IDENTITY_UNLESS(position_scores, key_sinusoids, use_identity, by_table, operands)


def _identity_by_conditional(position_scores, key_sinusoids, use_identity, by_table, operands):
    identity = lambda: _identity_at(position_scores, key_sinusoids, 0, *operands)
    return jax.lax.cond(use_identity, identity, lambda: by_table)


IDENTITY_UNLESS = Operation("transformer_xl_identity_unless", _identity_by_conditional)


@IDENTITY_UNLESS.implement(backend="cpu")
def _identity_by_loop(position_scores, key_sinusoids, use_identity, by_table, operands):
    body = lambda i, current: _identity_at(position_scores, key_sinusoids, i, *operands)
    return jax.lax.fori_loop(0, use_identity.astype(jnp.int32), body, by_table)


@_identity_unless.defjvp
def _identity_unless_jvp(position_scores, key_sinusoids, primals, tangents):
    use_identity, by_table, operands = primals
    _, table_dot, operands_dot = tangents

    def chosen(by_table, operands):
        # A selection, not a conditional: JAX (0.10) cannot transpose a conditional inside a custom JVP rule
        # under vmap with a batched predicate (grad of vmap raised). The identity then runs whenever the step
        # is differentiated, which a decoding step rarely is.
        return jnp.where(use_identity, _identity_at(position_scores, key_sinusoids, 0, *operands), by_table)

    return jax.jvp(chosen, (by_table, operands), (table_dot, operands_dot))


def _scores_against(shifted_q, projected) -> jax.Array:
    """``[B, N, T, L]``: each query against each of ``projected`` ``[L, N, H]`` (shared by the batch).

    Written as the content score's product, with ``projected`` broadcast over the batch (a copy
    of B·L·N·H values, as many as the keys): XLA:CPU computes ``'BTNH,LNH->BNTL'`` (or its
    heads-first form) as ``[N, L, T]`` and then transposes the whole product. On the CPU only
    (:data:`SCORES_AGAINST`); on the other backends, the plain product.
    """
    return SCORES_AGAINST(shifted_q, projected)


SCORES_AGAINST = Operation(
    "transformer_xl_scores_against",
    lambda shifted_q, projected: jnp.einsum("BTNH,LNH->BNTL", shifted_q, projected, preferred_element_type=jnp.float32),
)


@SCORES_AGAINST.implement(backend="cpu")
def _scores_against_batched(shifted_q, projected) -> jax.Array:
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
    the sinusoids of the distances ``S-1, ..., 1, 0`` projected by ``W_R`` once. Each query is
    scored against the ladder and each score moved to its key (:func:`shift_ladder_scores`);
    entries of keys after the query are filler (masked in causal attention).
    """
    return shift_ladder_scores(_scores_against(shifted_q, projected), first_row, q_len)


def shift_ladder_scores(scores: jax.Array, first_row, q_len: int) -> jax.Array:
    """``rel_shift``'s result, for query rows ``first_row ..`` of T = ``q_len``, by one gather.

    ``scores`` ``[..., rows, S]`` holds each query's scores against the distance ladder
    ``S-1, ..., 1, 0``; ``out[..., r, s] = scores[..., r, min(T - 1 - (first_row + r) + s, S - 1)]``,
    the score at the query-minus-key distance ``S - T + t - s`` of query ``t = first_row + r``
    and key s, as :func:`~posenc_jax.functional.encodings.transformer_xl.rel_shift` gives it for
    every key up to the query (later keys are filler, masked). A gather XLA fuses into its
    consumer; its transpose is a gather and a masked sum, not the scatter autodiff would make of
    it (:func:`~posenc_jax.functional.kernels.autodiff.linear_primitives`).

    Example:
      >>> scores = jnp.arange(8.0).reshape(2, 4)  # T = 2 queries against S = 4 ladder distances 3 .. 0
      >>> shift_ladder_scores(scores, 0, 2)  # entry [t, s]: distance 2 + t - s (ladder column 1 - t + s)
      Array([[1., 2., 3., 3.],
             [4., 5., 6., 7.]], dtype=float32)
    """
    return _shift_to_keys(scores, jnp.asarray(first_row, jnp.int32), q_len)


def _ladder_columns(first_row, rows: int, q_len: int, k_len: int) -> jax.Array:
    """``[rows, S]``: the ladder column of key s for query t = first_row + r, ``T - 1 - t + s``
    (distance ``S - T + t - s``), capped at ``S - 1``."""
    query = first_row + jnp.arange(rows)[:, None]
    return jnp.minimum(jnp.arange(k_len)[None, :] - query + (q_len - 1), k_len - 1)


def _gather_ladder_columns(scores, first_row, q_len: int, flat: bool = False) -> jax.Array:
    rows, k_len = scores.shape[-2:]
    columns = _ladder_columns(first_row, rows, q_len, k_len)[(None,) * (scores.ndim - 2)]
    if flat:
        return take_along_last_axis(scores, columns)
    return jnp.take_along_axis(scores, columns, axis=-1)


def _shifted(scores, first_row, *, q_len: int) -> jax.Array:
    # With a derivative, the flat gather (as relative.gather_by_distance's, and why).
    return _gather_ladder_columns(scores, first_row, q_len, flat=True)


def _shifted_back(cotangent, first_row, *, q_len: int) -> jax.Array:
    """The shift's transpose: each key's cotangent moved back to its ladder column, by a gather."""
    rows, k_len = cotangent.shape[-2:]
    lead = (None,) * (cotangent.ndim - 2)
    query = first_row + jnp.arange(rows)[:, None]  # [rows, 1]: the query index t of each row
    keys = jnp.arange(k_len)[None, :]
    # Column c < S - 1 of row t receives key s = c - (T - 1 - t) alone; column S - 1 receives every key
    # from S - T + t on (the capped ones).
    source = keys - (q_len - 1) + query  # [rows, S]
    inside = (source >= 0) & (keys < k_len - 1)
    moved = take_along_last_axis(cotangent, source[lead])  # clipped into [0, S)
    grad = jnp.where(inside[lead], moved, 0.0)
    capped = keys >= (k_len - q_len) + query  # [rows, S]
    tail = jnp.where(capped[lead], cotangent, 0.0).sum(axis=-1)  # [..., rows]
    return grad.at[..., k_len - 1].add(tail)


# The shift and its transpose, each the other's: reverse mode gathers, forward mode works.
_shift, _ = linear_primitives("transformer_xl_shift", _shifted, _shifted_back)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _shift_to_keys(scores: jax.Array, first_row: jax.Array, q_len: int) -> jax.Array:
    """:func:`shift_ladder_scores`; without a derivative, ``take_along_axis``, which XLA:CPU fuses."""
    return _gather_ladder_columns(scores, first_row, q_len)


@_shift_to_keys.defjvp
def _shift_to_keys_jvp(q_len, primals, tangents):
    scores, first_row = primals
    return _shift(scores, first_row, q_len=q_len), _shift(tangents[0], first_row, q_len=q_len)


def tile_distance_table(
    query_positions, key_positions, position_projection, project_distances: Callable, *, causal: bool, tiles: tuple
) -> tuple[jax.Array, jax.Array]:
    """``(top, table)``: ``W_R R_d`` for the distances ``top, top - 1, ...`` (descending), once per call.

    ``top`` is the call's largest distance (query minus key), an int32 scalar; ``table`` float32
    ``[L, N, H]``. ``L`` covers every tile of runs: ``T + S - 1`` distances; in causal attention
    the ``max(T, S) + max(bq, bk) - 1`` from ``top`` down to the lowest a visible tile of the
    call's grid reads (``tiles``: ``(bq, bk)``; a tile whose keys all come after its queries is
    skipped, and a tile the table does not reach takes the identity).
    """
    q, k = with_batch_axis(query_positions), with_batch_axis(key_positions)
    q_len, k_len = q.shape[-1], k.shape[-1]
    rows = max(q_len, k_len) + max(tiles) - 1 if causal else q_len + k_len - 1
    top = position_difference(q.max(), k.min())
    distances = top - jnp.arange(rows, dtype=jnp.int32)  # wraps only where the tiles take the identity
    return top, project_distances(distances, position_projection)


def tile_terms(
    content,
    shifted_q,
    query_positions,
    key_positions,
    table,
    *,
    projection,
    project,
    scale: float,
    identity: Callable,
    into=None,
):
    """One tile's ``scale · (content + (q_t + v)·W_R R_{t-s})``, ``[B, N, bq, bk]`` float32, from the call's table;
    ``into + `` that where ``into`` (the tile's scores) is given, added block of rows by block of rows in place.

    Where the tile's positions are runs (each row counting up by one, the same offset in every
    batch row) and its distances ``highest .. highest - bq - bk + 2`` lie in ``table`` (``(top,
    rows)``: ``W_R R_d`` descending from ``top``, :func:`tile_distance_table`): by blocks of ``m``
    query rows (128 in a tile of 512), each block's ``m + bk - 1`` distances, a slice of the table,
    scored against its queries and moved to their keys by :func:`skew_rows`: ``(m + bk - 1) / bk``
    score products in all. Otherwise ``identity()``, the encoding's form for any positions. One
    conditional: only the branch taken runs.

    The tile's slice of the table carries its derivative to ``projection`` (``W_R``) directly,
    ``project(distances, dW_R)`` (:func:`_table_slice`), so a tile's gradient is a ``[D, N, H]``
    sum, not a table-sized one for each tile.

    Args:
      content: ``u · k_s`` ``[B, N, 1, bk]``; shifted_q: ``q + v`` float32 ``[B, bq, N, H]``.
      query_positions, key_positions: the tile's, int32 ``[B|1, bq]``, ``[B|1, bk]``.
      projection: ``W_R`` ``[D, N, H]``; project: ``project(distances, W_R)``, ``W_R R_d`` ``[L, N, H]``.
    """
    top, rows_of_table = table
    block_q, block_k = shifted_q.shape[1], content.shape[-1]
    width = block_q + block_k - 1
    if width > rows_of_table.shape[0]:
        return identity()
    q, k = with_batch_axis(query_positions), with_batch_axis(key_positions)
    highest = position_difference(q[:, -1], k[:, 0])  # [B|1]: the tile's largest distance, where runs
    start = position_difference(top, highest)  # the table's row of it
    fits = (
        _consecutive_rows(q)
        & _consecutive_rows(k)
        & jnp.all(start == start[0])
        & (start[0] >= 0)
        & (start[0] <= rows_of_table.shape[0] - width)
        & (jnp.abs(top) < _REACH)
        & jnp.all(jnp.abs(highest) < _REACH)
    )
    rows = row_block(block_q)

    def by_table():
        distances = highest[0] - jnp.arange(width, dtype=jnp.int32)  # the slice's, largest first
        window = _table_slice(project, projection, rows_of_table, start[0], distances)
        if into is not None:
            return _add_position_by_rows(into, content, shifted_q, window, block_k, rows, scale)
        return (content + _position_by_rows(shifted_q, window, block_k, rows)) * jnp.float32(scale)

    return jax.lax.cond(fits, by_table, identity if into is None else lambda: into + identity())


@functools.partial(jax.checkpoint, static_argnums=(2, 3))
def _position_by_rows(shifted_q, window, block_k: int, rows: int) -> jax.Array:
    """A tile's ``(q_t + v)·W_R R_{t-s}`` ``[B, N, bq, bk]`` from its ``bq + bk - 1`` projected distances
    ``window`` (largest first), by blocks of ``rows`` query rows.

    Each block of rows against its own ``rows + bk - 1`` distances: the position product is
    ``(rows + bk - 1) / bk`` score products, not the whole tile's ``(bq + bk - 1) / bk``. A checkpoint: the
    gradient keeps ``shifted_q`` and ``window``, not a copy of each block's slice of the window (the
    products being linear, nothing is computed again for the gradient but those slices). The blocks are
    joined unrolled (a loop writing them into the tile in place holds less in the forward but is slower).
    """
    block_q = shifted_q.shape[1]

    def block(first):  # [B, N, rows, bk]: query rows first .. first + rows - 1
        offset = block_q - rows - first  # the window's row of this block's largest distance
        q_rows = jax.lax.dynamic_slice_in_dim(shifted_q, first, rows, axis=1)
        return skew_rows(
            _scores_against(q_rows, jax.lax.dynamic_slice_in_dim(window, offset, rows + block_k - 1)), block_k
        )

    if rows == block_q:
        return block(0)
    return jnp.concatenate([block(first) for first in range(0, block_q, rows)], axis=2)


def _add_position_by_rows(scores, content, shifted_q, window, block_k: int, rows: int, scale: float) -> jax.Array:
    """``scores + scale · (content + (q_t + v)·W_R R_{t-s})``: :func:`_position_by_rows`'s blocks of rows each
    added into the scores where they lie (:func:`~posenc_jax.functional.kernels.row_blocks.add_rows`: no
    tile-sized term of their own)."""
    block_q = shifted_q.shape[1]
    blocks = []
    for first in range(0, block_q, rows):  # the window's rows of this block's distances start at bq - rows - first
        own = _position_by_rows(shifted_q[:, first : first + rows], window[block_q - rows - first :], block_k, rows)
        blocks.append((content + own) * jnp.float32(scale))
    return add_rows(scores, tuple(blocks))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _table_slice(project, projection, table, start, distances):
    """``table``'s rows ``start ..`` (``W_R R_d`` at ``distances``), read; their tangent ``project(distances,
    dW_R)``, ``W_R``'s alone (the table is ``W_R``'s projection: its own tangent is not read)."""
    return jax.lax.dynamic_slice_in_dim(table, start, distances.shape[0], axis=0)


@_table_slice.defjvp
def _table_slice_jvp(project, primals, tangents):
    projection, table, start, distances = primals
    return _table_slice(project, projection, table, start, distances), project(distances, tangents[0])
