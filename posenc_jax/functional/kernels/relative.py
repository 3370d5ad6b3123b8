"""Fast forms of the relative operations of :mod:`posenc_jax.functional.core.relative`.

Each function here is registered as a form of one of core's operations
(:class:`~posenc_jax.functional.core.operations.Operation`); the plain form is core's, beside
the operation, and the tests hold the two equal (``tests/test_relative.py``):

- the Toeplitz bias from its ``T + S - 1`` diagonals where positions are runs, its gradient
  the sums along the diagonals (:data:`~posenc_jax.functional.core.relative.TOEPLITZ_WHERE_RUNS`), every backend;
- the clipped-distance bias expanded from its table
  (:data:`~posenc_jax.functional.core.relative.EXPAND_RELATIVE_BIAS`), its tangent the gather by
  clipped distance below, so that the table's gradient is the sums by distance, every backend;
- the gather by clipped distance and its transpose, the sum by distance, as linear primitives
  (:func:`~posenc_jax.functional.kernels.autodiff.linear_primitives`) whose gradients gather
  where positions are runs and scatter otherwise, every backend;
- ``take_along_last_axis`` as one scalar gather from the values laid out flat, on the CPU only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from posenc_jax.functional.core import relative
from posenc_jax.functional.core.positions import position_difference
from posenc_jax.functional.core.relative import (
    _consecutive_rows,
    _expand_by_gather,
    _gather_plain,
    _sums_by_scatter,
    take_along_last_axis,
    toeplitz,
)
from posenc_jax.functional.kernels.autodiff import linear_primitives

__all__: list[str] = []


@relative.TAKE_ALONG_LAST_AXIS.implement(backend="cpu")
def _take_flat(values, index, *, out_shape: tuple, transposed: bool) -> jax.Array:
    """One scalar gather from ``values`` laid out flat, at offsets computed from iotas.

    XLA fuses it into its consumer and writes the output in the consumer's layout.
    ``take_along_axis`` with a broadcast index is a gather with batch dimensions that XLA:CPU
    lays out index first (``[T·S, B, N]``) and then transposes: a strided pass over the whole
    output. Past int32 flat offsets, or with nothing to read, the plain form.
    """
    lead, length = tuple(values.shape[:-1]), values.shape[-1]
    if values.size >= 2**31 or length == 0:
        return relative.TAKE_ALONG_LAST_AXIS.plain(values, index, out_shape=out_shape, transposed=transposed)
    row = jnp.zeros((), jnp.int32)
    for axis, size in enumerate(lead):  # the flat row of every output entry, from iotas
        source = len(out_shape) - 1 if (transposed and axis == len(lead) - 1) else axis
        row = row * size + (jax.lax.broadcasted_iota(jnp.int32, out_shape, source) if size > 1 else 0)
    flat = row * length + jnp.clip(index, 0, length - 1).astype(jnp.int32)
    return values.reshape(-1).at[flat].get(mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@relative.TOEPLITZ_WHERE_RUNS.implement()
def _toeplitz_where_runs(per_distance, plain, q, k, *, also) -> jax.Array:
    """The bias from its diagonals where positions are runs (and ``also``), else ``plain()``: one conditional."""
    q_len, k_len = q.shape[-1], k.shape[-1]
    shape = jax.eval_shape(plain).shape
    # Diagonal c holds the pairs with s - t = c - (T - 1); its first pair is (t, s) below. The values are
    # made outside the conditional, so that XLA cannot fuse their making into the tile's copy (it would
    # evaluate them T · S times again).
    diagonal = jnp.arange(q_len + k_len - 1)
    t, s = jnp.maximum(q_len - 1 - diagonal, 0), jnp.maximum(diagonal - (q_len - 1), 0)
    distance = position_difference(k[:, s], q[:, t], dtype=jnp.float32)  # [B|1, T + S - 1]
    values = per_distance(distance).astype(jnp.float32)  # [B|1, N, T + S - 1]
    runs = _consecutive_rows(q) & _consecutive_rows(k) & also
    return jax.lax.cond(
        runs,
        lambda values: jnp.broadcast_to(_toeplitz_tile(values, q_len, k_len), shape),
        lambda values: plain().astype(jnp.float32),
        values,
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _toeplitz_tile(diagonals: jax.Array, rows: int, cols: int) -> jax.Array:
    """:func:`~posenc_jax.functional.core.relative.toeplitz` as ``rows`` slices of ``cols`` consecutive
    diagonals, so that the tile is one copy.

    Row t is ``diagonals[..., rows - 1 - t :][..., :cols]``: one gather of contiguous slices,
    not ``rows · cols`` scalar reads nor ``toeplitz``'s copies ``rows + cols`` wide. Its
    tangent is ``toeplitz`` of the tangent (linear), whose transpose, which reverse mode
    takes, is ``diagonal_sums``: no scatter.
    """
    *lead, width = diagonals.shape
    flat = diagonals.reshape(-1, width)  # one slice per row of each leading row, laid out [..., rows, cols]
    starts = (rows - 1) - jnp.arange(rows, dtype=jnp.int32)
    row_slices = jax.vmap(lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, cols), in_axes=(None, 0))
    return jax.vmap(row_slices, in_axes=(0, None))(flat, starts).reshape(*lead, rows, cols)


@_toeplitz_tile.defjvp
def _toeplitz_tile_jvp(rows: int, cols: int, primals, tangents):
    return _toeplitz_tile(primals[0], rows, cols), toeplitz(tangents[0], rows, cols)


def _gathered(per_distance, q, k, *mask, sign, offset, slots, key_side, block_elements):
    """The gather by slot (``take_along_last_axis``, on the CPU the flat gather: in a program with the
    gradient, XLA:CPU does not fuse the gather into the scores and stores it, and take_along_axis's
    index-first layout then costs a transposing pass); entries the mask hides are zero."""
    out = _gather_plain(per_distance, q, k, sign, offset, key_side, flat=True)
    return jnp.where(mask[0], out, jnp.zeros((), out.dtype)) if mask else out


def _summed(weights, q, k, *mask, sign, offset, slots, key_side, block_elements):
    """The sums by slot, its transpose (key-side: the same map seen from the keys, distances negated)."""
    mask = mask[0] if mask else None
    if key_side:
        mask = None if mask is None else jnp.swapaxes(mask, -1, -2)
        return _sums(jnp.swapaxes(weights, -1, -2), k, q, -sign, offset, slots, block_elements, mask)
    return _sums(weights, q, k, sign, offset, slots, block_elements, mask)


# The gather by slot and the sum by slot, each the other's transpose: reverse mode gathers where plain
# autodiff would scatter (a gather's transpose), and forward mode works.
_gather_primitive, _sum_primitive = linear_primitives("gather_by_distance", _gathered, _summed)


def _slot_map(sign, offset, slots, key_side, block_elements=relative._SCATTER_BLOCK) -> dict:
    return dict(sign=sign, offset=offset, slots=slots, key_side=key_side, block_elements=block_elements)


@relative.EXPAND_RELATIVE_BIAS.implement()
@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _expand(per_distance, query_positions, key_positions, k: int) -> jax.Array:
    return _expand_by_gather(per_distance, query_positions, key_positions, k)


@_expand.defjvp
def _expand_jvp(k: int, primals, tangents):
    # The bias is linear in the table: its tangent is the gather by clipped distance of the table's tangent,
    # shared by the batch and the queries ([1, N, 1, 2k+1]). Reverse mode takes that primitive's transpose,
    # the sums by distance: where positions are runs, two masked row sums for the end slots and a gather of
    # the interior ones ([B|1, N, T, 2k+1], summed over the queries), no scatter of T·S cotangents and no
    # copy of them; gapped positions scatter.
    per_distance, query_positions, key_positions = primals
    slot_map = _slot_map(1, k, 2 * k + 1, False)
    tangent = _gather_primitive(tangents[0][None, :, None, :], query_positions, key_positions, **slot_map)
    return _expand(per_distance, query_positions, key_positions, k), tangent


@relative.GATHER_BY_DISTANCE.implement()
@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def _gather_by_distance(per_distance, q, k, sign, offset, key_side):
    # Without a derivative, take_along_axis, which XLA:CPU fuses into the consumer.
    return _gather_plain(per_distance, q, k, sign, offset, key_side)


@_gather_by_distance.defjvp
def _gather_by_distance_jvp(sign, offset, key_side, primals, tangents):
    per_distance, q, k = primals
    slot_map = _slot_map(sign, offset, per_distance.shape[-1], key_side)
    return _gather_primitive(per_distance, q, k, **slot_map), _gather_primitive(tangents[0], q, k, **slot_map)


@relative.SUM_BY_DISTANCE.implement()
def _sum_by_distance(weights, q, k, mask=None, *, sign, offset, slots, block_elements):
    fixed = () if mask is None else (mask,)
    return _sum_primitive(weights, q, k, *fixed, **_slot_map(sign, offset, slots, False, block_elements))


def _sums_over_runs(weights, q, k, sign: int, offset: int, slots: int, mask=None):
    """The sums by distance where every row of positions is a run: no scatter."""
    if mask is not None:
        weights = jnp.where(mask, weights, jnp.zeros((), weights.dtype))
    if slots == 1:
        return weights.sum(axis=-1, keepdims=True)
    _, _, q_len, k_len = weights.shape
    reach = q_len + k_len + slots  # a row offset beyond this puts every pair in one end slot either way
    row_offset = jnp.clip(position_difference(k[:, :1], q[:, :1]), -reach, reach)[:, :, None]  # [B|1, 1, 1]
    t = jnp.arange(q_len, dtype=jnp.int32)[None, :, None]  # [1, T, 1]
    s = jnp.arange(k_len, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    r = jnp.arange(slots, dtype=jnp.int32)[None, None, :]  # [1, 1, R]
    # The slot before clipping, sign·(key_pos - query_pos) + offset, at every (t, s): [B|1, T, S].
    value = sign * (row_offset + s - t) + offset
    zero = jnp.zeros((), weights.dtype)
    # Both end slots in one reduction with two outputs: as two reductions, XLA:CPU stored the weights
    # once more (their third and fourth readers besides the value product and the gather).
    low, high = jax.lax.reduce(
        (jnp.where((value <= 0)[:, None], weights, zero), jnp.where((value >= slots - 1)[:, None], weights, zero)),
        (zero, zero),
        lambda x, y: (x[0] + y[0], x[1] + y[1]),
        (3,),
    )  # [B, N, T] each
    key = t + sign * (r - offset) - row_offset  # the key of slot r in row t: [B|1, T, R]
    inside = (key >= 0) & (key < k_len) & (r > 0) & (r < slots - 1)
    interior = take_along_last_axis(weights, key[:, None])  # clipped into [0, S)
    interior = jnp.where(inside[:, None], interior, zero)
    r = r[:, None]  # [1, 1, 1, R]
    return interior + jnp.where(r == 0, low[..., None], zero) + jnp.where(r == slots - 1, high[..., None], zero)


def _sums(weights, q, k, sign, offset, slots, block_elements=relative._SCATTER_BLOCK, mask=None):
    """Float32 sums by slot, by runs or by scatter as the positions allow; the weights' dtype.

    The mask goes into the conditional as it is and is applied inside each branch, where it
    fuses: a masked copy of the weights as the conditional's operand would be stored whole.
    """
    runs = _consecutive_rows(q) & _consecutive_rows(k)
    summed = jax.lax.cond(
        runs,
        lambda w, m: _sums_over_runs(w, q, k, sign, offset, slots, m),
        lambda w, m: _sums_by_scatter(w, q, k, sign, offset, slots, block_elements, m),
        weights.astype(jnp.float32),
        mask,
    )
    return summed.astype(weights.dtype)
