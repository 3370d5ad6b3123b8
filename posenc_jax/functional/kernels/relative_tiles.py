"""Relative terms of one blockwise tile from the tile's distance range: clipped tables past their reach.

A clipped relative encoding (Shaw's ``R_K`` and ``R_V``, DeBERTa's c2p and p2c) reads a
table row per (query, key) pair chosen by the clipped distance. Past the clip every pair reads
the same end row, and in a long causal attention most tiles lie wholly past it: a tile of
512 × 512 whose nearest pair is farther than the clip reads one row. Such a tile's term is one
value per query row (or per key) broadcast over the tile, and a value term sums each row's
weights into one row of the table; no gather and no scatter.

:func:`saturated_side` tells, from the tile's positions, whether every distance of the tile
is past the clip on one side (exact for any positions: it compares the extreme distances);
:func:`by_saturation` then takes the caller's end-row form, and the plain per-tile form
otherwise. The encodings' tile forms (``tile_logits``, ``tile_values``) call them; the tests
hold each tile form to the plain one (``tests/test_blockwise.py``, runs and gaps).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.positions import position_difference, with_batch_axis

__all__ = ["by_saturation", "saturated_side"]


def saturated_side(query_positions: jax.Array, key_positions: jax.Array, *, reach: int) -> jax.Array:
    """0, or 1 where every distance ``j - i`` of the tile is ``<= -reach``, 2 where every one is ``>= reach``.

    ``query_positions`` ``[B|1, T]``, ``key_positions`` ``[B|1, S]`` (int32); an int32 scalar, for
    :func:`by_saturation`. The extreme distances are exact (saturating) int32 differences.

    Example:
      >>> int(saturated_side(jnp.arange(4)[None] + 100, jnp.arange(4)[None], reach=16))
      1
    """
    q, k = with_batch_axis(query_positions), with_batch_axis(key_positions)
    nearest_after = position_difference(k.min(axis=-1), q.max(axis=-1))  # the smallest j - i of each row
    farthest_after = position_difference(k.max(axis=-1), q.min(axis=-1))  # the largest
    before = jnp.all(farthest_after <= -reach)
    after = jnp.all(nearest_after >= reach)
    return jnp.where(before, 1, jnp.where(after, 2, 0)).astype(jnp.int32)


def by_saturation(side: jax.Array, plain: Callable, before: Callable, after: Callable) -> jax.Array:
    """``plain()``, or ``before()`` / ``after()`` where :func:`saturated_side` says 1 / 2 (each the same shape).

    One conditional: only the branch taken is computed.
    """
    return jax.lax.switch(side, (plain, before, after))
