"""Relative positions and the gather/scatter patterns every relative encoding shares.

Convention: the relative distance of query t and key s is ``key_pos[s] - query_pos[t]``
(j - i), as in T5's reference code. A key in the past has a negative distance.
Distances never wrap around: any two int32 positions are supported, the int32
distance saturates at ``±(2**31 - 1)`` where the true one does not fit (see
:func:`~posenc_jax.functional.core.positions.position_difference`).

Positions are explicit arrays, so they may have offsets and gaps; the distance
matrix is then not Toeplitz in the array indices. The memory-lean patterns here
hold for any positions and never build a ``[T, S, H]`` tensor:

* a table indexed by clipped distance (``[..., 2k+1]`` values per query row) is
  expanded to ``[..., T, S]`` by a gather (:func:`gather_relative`);
* attention weights are summed into ``[..., T, 2k+1]`` buckets by a scatter-add
  (:func:`bucket_relative`), the transpose of that gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.blocks import by_causal_prefix_blocks, by_causal_prefixes_where, by_query_blocks
from posenc_jax.functional.core.operations import Operation
from posenc_jax.functional.core.positions import batched_positions, position_difference, with_batch_axis

__all__ = [
    "bucket_relative",
    "by_causal_prefix_blocks",
    "by_causal_prefixes_where",
    "by_query_blocks",
    "check_max_distance",
    "clipped_at_distances",
    "clipped_relative_index",
    "consecutive_rows",
    "diagonal_sums",
    "toeplitz",
    "toeplitz_where_runs",
    "distance_slots",
    "expand_relative_bias",
    "gather_by_distance",
    "gather_relative",
    "gather_relative_transposed",
    "relative_positions",
    "sum_by_distance",
    "take_along_last_axis",
]


def relative_positions(query_positions, key_positions, *, dtype=jnp.int32) -> jax.Array:
    """``rel[b, t, s] = key_pos[b, s] - query_pos[b, t]`` (j - i), ``[B|1, T, S]``.

    For any int32 positions, without wrap-around: int32 distances are exact up to
    ``±(2**31 - 1)`` and saturate there (past every clip distance); ``dtype=jnp.float32``
    gives the exact distance rounded once to float32, for encodings linear or
    logarithmic in it (ALiBi, Kerple, FIRE).

    Example:
      >>> relative_positions(jnp.arange(3), jnp.arange(4))[0]
      Array([[ 0,  1,  2,  3],
             [-1,  0,  1,  2],
             [-2, -1,  0,  1]], dtype=int32)
    """
    q = batched_positions(query_positions, "query_positions")
    k = batched_positions(key_positions, "key_positions")
    return _relative_positions(q, k, dtype=dtype)


def _relative_positions(query_positions, key_positions, *, dtype=jnp.int32) -> jax.Array:
    """:func:`relative_positions` of positions already checked (``[T]`` or ``[B|1, T]``)."""
    q, k = with_batch_axis(query_positions), with_batch_axis(key_positions)
    return position_difference(k[:, None, :], q[:, :, None], dtype=dtype)


def check_max_distance(max_distance, name: str = "max_distance") -> int:
    """Validates a clip distance k >= 1 and returns it as an int."""
    if not isinstance(max_distance, (int, np.integer)) or isinstance(max_distance, bool) or max_distance < 1:
        raise ValueError(
            f"{name} must be an integer >= 1 (distances are clipped to [-{name}, {name}]), got {max_distance!r}"
        )
    return int(max_distance)


def clipped_relative_index(query_positions, key_positions, max_distance: int, *, sign: int = 1) -> jax.Array:
    """``clip(sign · (key_pos - query_pos), -k, k) + k``, int32 ``[B|1, T, S]`` in ``[0, 2k]``.

    ``sign=-1`` gives the query-minus-key convention (i - j) of Transformer-XL and DeBERTa.
    """
    k = check_max_distance(max_distance)
    return distance_slots(query_positions, key_positions, sign=sign, offset=k, slots=2 * k + 1)


def take_along_last_axis(values: jax.Array, index: jax.Array, *, transposed: bool = False) -> jax.Array:
    """``out[..., j] = values[..., clip(index[..., j], 0, L - 1)]``, ``index``'s leading axes broadcasting.

    ``values`` ``[*lead, L]``; ``index`` int, its leading axes and ``lead`` broadcasting
    against each other (a slot map shared by the batch or the heads stays ``[1, 1, T, S]``;
    values shared by the batch stay ``[1, ...]``). With ``transposed``,
    the row read is the index's last coordinate instead: ``out[..., i, j] = values[..., j,
    index[..., i, j]]`` for ``values`` ``[..., S, L]`` (a key-side table read per (query,
    key) pair without transposing it).

    The plain form is ``take_along_axis``; on the CPU, ``kernels/`` registers one scalar gather
    from ``values`` laid out flat (:data:`TAKE_ALONG_LAST_AXIS`).

    Example:
      >>> take_along_last_axis(jnp.arange(6.0).reshape(2, 3), jnp.array([[2, 0]]))
      Array([[2., 0.],
             [5., 3.]], dtype=float32)
    """
    values, index = jnp.asarray(values), jnp.asarray(index)
    lead = tuple(values.shape[:-1])
    index = index.reshape((1,) * (len(lead) + 1 - index.ndim) + index.shape)
    try:
        if transposed:
            out_lead = tuple(np.broadcast_shapes(lead[:-1] + tuple(index.shape[-2:-1]), index.shape[:-1]))
            fits = lead[-1:] == tuple(index.shape[-1:])
        else:
            out_lead = tuple(np.broadcast_shapes(lead, index.shape[:-1]))
            fits = True
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"index {index.shape} does not fit values {values.shape}"
            + (" (transposed: values [..., S, L] for index [..., T, S])" if transposed else "")
        )
    out_shape = out_lead + tuple(index.shape[-1:])
    return TAKE_ALONG_LAST_AXIS(values, index, out_shape=out_shape, transposed=transposed)


def _take_along_axis(values, index, *, out_shape: tuple, transposed: bool) -> jax.Array:
    """:func:`take_along_last_axis`'s plain form, the arguments checked, ``out_shape`` computed."""
    # Clipped first: take_along_axis would read a negative slot from the end, not slot 0.
    index = jnp.broadcast_to(jnp.clip(index, 0, max(values.shape[-1] - 1, 0)), out_shape)
    if transposed:
        return jnp.take_along_axis(jnp.swapaxes(values, -1, -2), index, axis=-2, mode="clip")
    return jnp.take_along_axis(values, index, axis=-1, mode="clip")


TAKE_ALONG_LAST_AXIS = Operation("take_along_last_axis", _take_along_axis)


def gather_relative(per_distance: jax.Array, index: jax.Array) -> jax.Array:
    """Expands per-distance scores to ``[B, N, T, S]``: ``out[b,n,t,s] = x[b,n,t,index[b,t,s]]``.

    Args:
      per_distance: ``[B, N, T, R]`` values for each query and each of R relative slots.
      index: int ``[B|1, T, S]`` slot of every (query, key) pair (clipped into ``[0, R)``).
    """
    return jnp.take_along_axis(per_distance, index[:, None, :, :], axis=-1, mode="clip")


def gather_relative_transposed(per_distance: jax.Array, index: jax.Array) -> jax.Array:
    """``out[b,n,t,s] = x[b,n,s,index[b,t,s]]`` for key-side values ``x`` ``[B, N, S, R]``."""
    return jnp.take_along_axis(jnp.swapaxes(per_distance, -1, -2), index[:, None, :, :], axis=-2, mode="clip")


def bucket_relative(
    weights: jax.Array, index, num_slots: int, *, mask=None, block_elements: int = 1 << 20
) -> jax.Array:
    """Sums attention weights by relative slot: ``out[b,n,t,r] = Σ_{s: index[b,t,s]=r} w[b,n,t,s]``.

    The transpose of :func:`gather_relative`: ``[B, N, T, S]`` weights become
    ``[B, N, T, R]`` without a ``[T, S, R]`` one-hot. Rows are processed in blocks
    of about ``block_elements`` weights, so the scatter's temporaries stay a
    small fraction of one ``[T, S]`` array.

    Args:
      weights: ``[B, N, T, S]`` attention weights.
      index: int ``[B|1, T, S]`` slot of every (query, key) pair, in ``[0, R)``; or a
        function ``(start, rows) -> [B|1, rows, S]`` giving the slots of query rows
        ``start .. start + rows - 1``, so that the full index is never stored.
      num_slots: R.
      mask: optional boolean mask broadcastable to ``[B, N, T, S]``; the weights it hides
        are left out by selection (a NaN weight there does not reach any bucket).
      block_elements: scatter temporaries budget, in elements.
    """
    batch, heads, q_len, k_len = weights.shape
    if callable(index):
        index_rows = index
    else:
        index_rows = lambda start, rows: jax.lax.dynamic_slice_in_dim(index, start, rows, axis=1)

    if mask is not None:
        mask = jnp.asarray(mask)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        mask = jnp.broadcast_to(mask, mask.shape[:2] + (q_len, k_len))

    def block_sum(start, rows):
        w = jax.lax.dynamic_slice_in_dim(weights, start, rows, axis=2)  # [B, N, rows, S]
        if mask is not None:
            w = jnp.where(jax.lax.dynamic_slice_in_dim(mask, start, rows, axis=2), w, jnp.zeros((), w.dtype))
        idx = index_rows(start, rows)  # [B|1, rows, S]
        flat_row = jnp.arange(batch * heads * rows, dtype=jnp.int32).reshape(batch, heads, rows, 1)
        segment = (flat_row * num_slots + idx[:, None]).reshape(-1)
        summed = jax.ops.segment_sum(w.reshape(-1), segment, num_segments=batch * heads * rows * num_slots)
        return summed.reshape(batch, heads, rows, num_slots)

    # The block size is set by the [rows, S] weights, not by the [rows, R] output.
    block_rows_elements = block_elements * num_slots // max(1, k_len)
    return by_query_blocks(
        block_sum, (batch, heads, q_len, num_slots), weights.dtype, block_elements=max(1, block_rows_elements)
    )


def expand_relative_bias(per_distance: jax.Array, query_positions, key_positions, max_distance: int) -> jax.Array:
    """Expands per-distance biases ``[N, 2k+1]`` to ``[B|1, N, T, S]``.

    ``bias[b, n, t, s] = per_distance[n, clip(key_pos - query_pos, -k, k) + k]``:
    the Toeplitz pattern of T5 and learned clipped biases, computed once from
    ``2k+1`` distinct values and expanded by a gather, for any positions.

    Gradient: the plain transpose of that gather scatters every one of the ``T·S`` (per
    batch row) cotangents into the table. The form ``kernels/`` registers
    (:data:`EXPAND_RELATIVE_BIAS`) sums the cotangent by clipped distance (:func:`sum_by_distance`),
    with no scatter where every row of positions is a run of consecutive integers (the usual
    training batch); both give the plain autodiff gradient (``tests/test_relative.py`` compares them).
    """
    k = check_max_distance(max_distance)
    q = batched_positions(query_positions, "query_positions")
    kp = batched_positions(key_positions, "key_positions")
    return EXPAND_RELATIVE_BIAS(per_distance.astype(jnp.float32), q, kp, k)


def clipped_at_distances(per_distance: jax.Array, distance: jax.Array, max_distance: int) -> jax.Array:
    """``per_distance[n, clip(d, -k, k) + k]`` at distances ``[B|1, D]``: ``[B|1, N, D]`` float32.

    The per-distance form of :func:`expand_relative_bias` (a :class:`~posenc_jax.functional.core.hooks.DistanceBias`
    hook's ``distance_bias``, and the diagonals of its Toeplitz form). ``distance`` is int32, or exact integer
    distances rounded once to float32 as blockwise attention passes them; they are clipped before the cast,
    so any int32 distance reads the right slot (exact while ``k < 2**24``).

    Example:
      >>> clipped_at_distances(jnp.arange(5.0)[None], jnp.array([[-9.0, -1.0, 0.0, 7.0]]), 2)
      Array([[[0., 1., 2., 4.]]], dtype=float32)
    """
    k = check_max_distance(max_distance)
    slot = jnp.clip(distance, -k, k).astype(jnp.int32) + k  # [B|1, D]
    return jnp.moveaxis(jnp.take(per_distance.astype(jnp.float32), slot, axis=1, mode="clip"), 0, 1)


def _expand_by_gather(per_distance, query_positions, key_positions, k: int) -> jax.Array:
    index = _distance_slots(query_positions, key_positions, sign=1, offset=k, slots=2 * k + 1)  # [B|1, T, S]
    bias = jnp.take(per_distance, index, axis=1, mode="clip")  # [N, B|1, T, S]
    return jnp.moveaxis(bias, 0, 1)


# The plain form: autodiff's gradient scatters into the table (kernels/ registers one that sums diagonals).
EXPAND_RELATIVE_BIAS = Operation("expand_relative_bias", _expand_by_gather)


def consecutive_rows(positions) -> jax.Array:
    """Whether every row of ``positions`` (``[T]`` or ``[B, T]``) counts up by exactly one: a boolean scalar.

    Then distances depend on array indices alone (``key_pos[s] - query_pos[t]`` is a row
    offset plus ``s - t``), which lets Toeplitz shortcuts replace gathers and scatters.

    Example:
      >>> bool(consecutive_rows(jnp.arange(5) + 7)), bool(consecutive_rows(jnp.array([0, 1, 3])))
      (True, False)
    """
    return _consecutive_rows(batched_positions(positions))


def _consecutive_rows(positions: jax.Array) -> jax.Array:
    """:func:`consecutive_rows` of positions already checked."""
    positions = with_batch_axis(positions)
    if positions.shape[-1] < 2:
        return jnp.bool_(True)
    return jnp.all(position_difference(positions[:, 1:], positions[:, :-1]) == 1)


def diagonal_sums(x: jax.Array) -> jax.Array:
    """``out[..., c] = Σ_t x[..., t, c - (T - 1) + t]``: sums along the ``T + S - 1`` diagonals of ``[..., T, S]``.

    Diagonal ``c`` holds the entries with ``s - t = c - (T - 1)``. Computed by a skew: the
    rows, last first, padded with T zeros and read back ``T + S - 1`` wide, so diagonal c
    becomes column c; then one sum over rows. No scatter.

    Example:
      >>> diagonal_sums(jnp.arange(6.0).reshape(2, 3))  # [[0, 1, 2], [3, 4, 5]]
      Array([3., 4., 6., 2.], dtype=float32)
    """
    *lead, rows, cols = x.shape
    width = rows + cols - 1
    padded = jnp.pad(x[..., ::-1, :], [(0, 0)] * len(lead) + [(0, 0), (0, rows)])  # [..., T, S + T]
    flat = padded.reshape(*lead, rows * (cols + rows))[..., : rows * width]
    return flat.reshape(*lead, rows, width).sum(axis=-2)


def toeplitz(diagonals: jax.Array, rows: int, cols: int) -> jax.Array:
    """``out[..., t, s] = diagonals[..., s - t + rows - 1]``, ``[..., rows, cols]``: :func:`diagonal_sums` transposed.

    Each row is a copy of the ``rows + cols - 1`` values, laid out ``rows + cols`` wide so that
    row t starts ``rows - 1 - t`` entries in (a reshape of the copies, padded), rows then read
    last first. No gather: the transpose of each step is a step of :func:`diagonal_sums`.

    Example:
      >>> toeplitz(jnp.arange(4.0), 2, 3)  # diagonals s - t = -1, 0, 1, 2
      Array([[1., 2., 3.],
             [0., 1., 2.]], dtype=float32)
    """
    *lead, width = diagonals.shape
    copies = jnp.broadcast_to(diagonals[..., None, :], (*lead, rows, width)).reshape(*lead, rows * width)
    padded = jnp.pad(copies, [(0, 0)] * len(lead) + [(0, rows * (cols + rows) - rows * width)])
    return padded.reshape(*lead, rows, cols + rows)[..., :cols][..., ::-1, :]


def toeplitz_where_runs(per_distance, plain, query_positions, key_positions, *, also=True) -> jax.Array:
    """A bias of the distance alone, ``[B|1, N, T, S]``: from its ``T + S - 1`` distances where positions are runs.

    Where every row of ``query_positions`` ``[B|1, T]`` and ``key_positions`` ``[B|1, S]``
    counts up by one, the bias is constant along diagonals: ``per_distance`` is evaluated at
    the ``T + S - 1`` distances (float32 ``[B|1, T + S - 1]``, each the exact distance of a pair
    on its diagonal rounded once, as ``relative_positions(..., dtype=jnp.float32)``; it returns
    ``[B|1, N, T + S - 1]``) and laid out by :func:`toeplitz`. Otherwise ``plain()``, the bias
    computed pair by pair (the plain form: always; the diagonals' form is the one ``kernels/``
    registers for :data:`TOEPLITZ_WHERE_RUNS`). One conditional on a check of ``T + S`` positions: a blockwise
    tile evaluates its bias at ``bq + bk - 1`` distances instead of ``bq · bk``. ``also``: a further
    run-time condition for the diagonals' form (a bias that depends on the distance alone only
    where it holds, FIRE's below its threshold). Either way the bias is a buffer of its own, the
    conditional's output: what made it is never fused, and evaluated again, into its consumers.

    Example:
      >>> f = lambda d: -jnp.abs(d)[:, None]  # [B|1, 1, D]
      >>> plain = lambda: -jnp.abs(relative_positions(jnp.arange(2), jnp.arange(3), dtype=jnp.float32))[:, None]
      >>> toeplitz_where_runs(f, plain, jnp.arange(2)[None], jnp.arange(3)[None])[0, 0]
      Array([[-0., -1., -2.],
             [-1., -0., -1.]], dtype=float32)
    """
    q, k = with_batch_axis(query_positions), with_batch_axis(key_positions)
    return TOEPLITZ_WHERE_RUNS(per_distance, plain, q, k, also=also)


# The plain form computes the bias pair by pair; kernels/ registers the diagonals' form.
TOEPLITZ_WHERE_RUNS = Operation(
    "toeplitz_where_runs", lambda per_distance, plain, q, k, *, also: plain().astype(jnp.float32)
)


def distance_slots(query_positions, key_positions, *, sign: int, offset: int, slots: int) -> jax.Array:
    """``clip(sign · (key_pos - query_pos) + offset, 0, slots - 1)``, int32 ``[B|1, T, S]``.

    The slot map of Shaw (``sign=1, offset=k, slots=2k+1``) and of DeBERTa's raw clipped
    distances (``sign=-1``, the query-minus-key convention), without int32 overflow.

    Example:
      >>> distance_slots(jnp.arange(3), jnp.arange(3), sign=1, offset=1, slots=3)[0]
      Array([[1, 2, 2],
             [0, 1, 2],
             [0, 0, 1]], dtype=int32)
    """
    _check_slot_map(sign, offset, slots)
    q = batched_positions(query_positions, "query_positions")
    k = batched_positions(key_positions, "key_positions")
    return _distance_slots(q, k, sign=sign, offset=offset, slots=slots)


def _distance_slots(query_positions, key_positions, *, sign: int, offset: int, slots: int) -> jax.Array:
    """:func:`distance_slots` of positions already checked, the slot map already checked."""
    rel = _relative_positions(query_positions, key_positions)
    return jnp.clip(sign * rel, -offset, slots - 1 - offset) + offset


def _check_slot_map(sign, offset, slots):
    if isinstance(sign, bool) or sign not in (1, -1):
        raise ValueError(f"sign must be 1 or -1 (the direction of key_pos - query_pos), got {sign!r}")
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < 1:
        raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or not 0 <= offset < slots:
        raise ValueError(f"offset (the slot of distance 0) must be an integer in [0, slots={slots}), got {offset!r}")


# Scatter temporaries budget of the gapped-positions path, in elements.
_SCATTER_BLOCK = 1 << 20


def gather_by_distance(
    per_distance: jax.Array, query_positions, key_positions, *, sign: int, offset: int, key_side: bool = False
) -> jax.Array:
    """``out[b,n,t,s] = x[b,n,t,slot(t,s)]`` with ``slot = clip(sign·(key_pos[s] - query_pos[t]) + offset, 0, R-1)``.

    :func:`gather_relative` for a clipped-distance slot map, with a gradient that needs no
    scatter: where every row of positions is a run of consecutive integers, each interior
    slot r of query t is read by exactly one key, ``s = t + sign·(r - offset) - d`` with
    ``d = key_pos[0] - query_pos[0]``, so the gradient is a gather of the cotangent and the
    two end slots are masked row sums (:func:`sum_by_distance`); gapped positions keep the
    scatter. Both are plain autodiff's gradient (``tests/test_relative.py``); forward mode is
    the gather of the tangent. That gradient is the form ``kernels/`` registers
    (:data:`GATHER_BY_DISTANCE`, :mod:`posenc_jax.functional.kernels.relative`); the plain
    form's is autodiff's scatter.

    Args:
      per_distance: ``[B, N, T, R]`` values per query and slot (``[B, N, S, R]`` per key
        with ``key_side``: then ``out[b,n,t,s] = x[b,n,s,slot(t,s)]``, DeBERTa's p2c).
      query_positions, key_positions: integer ``[T]``/``[B, T]`` and ``[S]``/``[B, S]``.
      sign, offset: the slot map; ``R = per_distance.shape[-1]`` slots.
      key_side: the values belong to keys, not queries.

    Returns:
      ``[B, N, T, S]``, ``per_distance``'s dtype.

    Example:
      >>> x = jnp.arange(3.0).reshape(1, 1, 1, 3) * jnp.ones((1, 1, 3, 1))
      >>> gather_by_distance(x, jnp.arange(3), jnp.arange(3), sign=1, offset=1)[0, 0]
      Array([[1., 2., 2.],
             [0., 1., 2.],
             [0., 0., 1.]], dtype=float32)
    """
    slots = per_distance.shape[-1]
    _check_slot_map(sign, offset, slots)
    q = batched_positions(query_positions, "query_positions")
    k = batched_positions(key_positions, "key_positions")
    if q.shape[1] == 0 or k.shape[1] == 0:
        return _gather_plain(per_distance, q, k, sign, offset, key_side)
    return GATHER_BY_DISTANCE(per_distance, q, k, sign, offset, key_side)


def sum_by_distance(
    weights: jax.Array,
    query_positions,
    key_positions,
    *,
    sign: int,
    offset: int,
    slots: int,
    mask=None,
    block_elements: int = _SCATTER_BLOCK,
) -> jax.Array:
    """``out[b,n,t,r] = Σ_{s: slot(t,s) = r} w[b,n,t,s]``: the transpose of :func:`gather_by_distance`.

    Where positions are runs, a gather of the interior slots and two masked row sums (no
    scatter); otherwise :func:`bucket_relative`'s blocked scatter. Sums accumulate in
    float32 whatever the weights' dtype. Its gradient is the gather. ``mask``
    (broadcastable to ``[B, N, T, S]``) leaves hidden weights out by selection, whatever
    they hold; ``block_elements`` bounds the scatter's temporaries.

    Returns:
      ``[B, N, T, slots]``, the weights' dtype.

    Example:
      >>> w = jnp.ones((1, 1, 3, 3))
      >>> sum_by_distance(w, jnp.arange(3), jnp.arange(3), sign=1, offset=1, slots=3)[0, 0]
      Array([[0., 1., 2.],
             [1., 1., 1.],
             [2., 1., 0.]], dtype=float32)
    """
    _check_slot_map(sign, offset, slots)
    q = batched_positions(query_positions, "query_positions")
    k = batched_positions(key_positions, "key_positions")
    if mask is not None:  # [B|1, N|1, T|1, S|1]; applied inside each path, so no masked copy is stored
        mask = jnp.asarray(mask)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if weights.shape[-2] == 0 or weights.shape[-1] == 0:  # no query or no key: every sum is empty
        return jnp.zeros((*weights.shape[:-1], slots), weights.dtype)
    return SUM_BY_DISTANCE(weights, q, k, mask, sign=sign, offset=offset, slots=slots, block_elements=block_elements)


def _gather_plain(per_distance, q, k, sign, offset, key_side, flat=False):
    index = _distance_slots(q, k, sign=sign, offset=offset, slots=per_distance.shape[-1])
    if flat:
        return take_along_last_axis(per_distance, index[:, None], transposed=key_side)
    return (gather_relative_transposed if key_side else gather_relative)(per_distance, index)


def _sums_by_scatter(weights, q, k, sign: int, offset: int, slots: int, block_elements: int, mask=None):
    def index_rows(start, rows):
        block = jax.lax.dynamic_slice_in_dim(q, start, rows, axis=1)
        return _distance_slots(block, k, sign=sign, offset=offset, slots=slots)

    return bucket_relative(weights, index_rows, slots, mask=mask, block_elements=block_elements)


def _plain_sums(weights, q, k, mask=None, *, sign, offset, slots, block_elements):
    summed = _sums_by_scatter(weights.astype(jnp.float32), q, k, sign, offset, slots, block_elements, mask)
    return summed.astype(weights.dtype)


# The plain forms, autodiff's gradients (a scatter, and a gather); kernels/ registers a pair of linear
# primitives, each the other's transpose, that gather where positions are runs.
GATHER_BY_DISTANCE = Operation("gather_by_distance", _gather_plain)
SUM_BY_DISTANCE = Operation("sum_by_distance", _plain_sums)
