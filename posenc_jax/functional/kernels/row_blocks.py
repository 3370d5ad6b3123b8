"""A tile by blocks of its query rows: the block size, rows read each from its own offset, a term computed
block by block, and blocks added into a tile's scores where they lie.

Transformer-XL's tile form (:mod:`posenc_jax.functional.kernels.transformer_xl`) scores each block of query
rows against the block's own distances (:func:`row_block` rows at a time), moves each score to its key
(:func:`skew_rows`) and adds the blocks into the tile's content scores in place (:func:`add_rows`); the
identity it falls back on is computed block by block (:func:`by_query_rows`). The plain forms: slicing,
``jnp.concatenate`` and ``+``; the tests hold each to them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.positions import with_batch_axis

__all__ = ["add_rows", "by_query_rows", "row_block", "skew_rows"]


def skew_rows(x: jax.Array, cols: int) -> jax.Array:
    """``out[..., r, c] = x[..., r, R - 1 - r + c]``: row r read from column ``R - 1 - r`` on, ``[..., R, cols]``.

    ``x`` ``[..., R, R + cols - 1]``. A slice of the rows laid out flat and reshapes (no gather;
    the transpose is a pad): row r, read at stride ``R + cols - 2``, starts ``R - 1 - r`` entries in.

    Example:
      >>> skew_rows(jnp.arange(8.0).reshape(2, 4), 3)
      Array([[1., 2., 3.],
             [4., 5., 6.]], dtype=float32)
    """
    *lead, rows, width = x.shape
    if width != rows + cols - 1:
        raise ValueError(f"skew_rows needs [..., R, R + cols - 1] = [..., {rows}, {rows + cols - 1}], got {x.shape}")
    if rows == 1:
        return x
    flat = x.reshape(*lead, rows * width)[..., rows - 1 : rows - 1 + rows * (width - 1)]
    return flat.reshape(*lead, rows, width - 1)[..., :cols]


def row_block(block_q: int) -> int:
    """How many query rows a tile is scored by at once: 128 (or 64, 32) where that divides a larger tile."""
    return next((rows for rows in (128, 64, 32) if block_q > rows and block_q % rows == 0), block_q)


def by_query_rows(rows_terms: Callable, q, query_positions) -> jax.Array:
    """A tile's ``[B, N, bq, bk]`` from ``rows_terms(q_rows, positions_rows)`` ``[B, N, m, bk]`` of each block
    of ``m`` query rows (:func:`row_block` of them), one block after another.

    A loop whose step's gradient computes its forward again: the terms' intermediates (the identity's
    ``[m, N, D]`` projected queries) are a block's, not the tile's. For the identity a tile falls back on,
    which a conditional's memory counts (the costlier branch's) though tiles of runs never take it.
    ``q`` ``[B, bq, N, H]``; ``query_positions`` ``[B|1, bq]``.
    """
    block_q = q.shape[1]
    rows = row_block(block_q)
    if rows == block_q:
        return rows_terms(q, query_positions)
    blocks = block_q // rows
    q_rows = jnp.moveaxis(q.reshape(q.shape[0], blocks, rows, *q.shape[2:]), 1, 0)
    positions = with_batch_axis(query_positions)
    positions = jnp.moveaxis(positions.reshape(positions.shape[0], blocks, rows), 1, 0)
    out = jax.lax.map(jax.checkpoint(lambda part: rows_terms(*part)), (q_rows, positions))  # [blocks, B, N, m, bk]
    out = jnp.moveaxis(out, 0, 2)
    return out.reshape(*out.shape[:2], block_q, out.shape[-1])


@jax.custom_jvp
def add_rows(scores, blocks: tuple) -> jax.Array:
    """``scores`` with ``blocks`` (each ``[B, N, m, S]``, in order down the rows) added where they lie, in place;
    the tangent (and so the gradient) that of ``scores + concatenate(blocks)``."""
    first = 0
    for block in blocks:
        current = jax.lax.dynamic_slice_in_dim(scores, first, block.shape[2], axis=2)
        scores = jax.lax.dynamic_update_slice_in_dim(scores, current + block, first, axis=2)
        first += block.shape[2]
    return scores


@add_rows.defjvp
def _add_rows_jvp(primals, tangents):
    (scores, blocks), (scores_dot, blocks_dot) = primals, tangents
    return add_rows(scores, blocks), scores_dot + jnp.concatenate(blocks_dot, axis=2)
