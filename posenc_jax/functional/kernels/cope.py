"""CoPE's fast forms: counts by blocked triangles, the interpolation's gradient, the term by blocks of rows.

The encoding (:mod:`posenc_jax.functional.encodings.cope`) defines the term: gates
``σ(q·k)``, positions as reverse cumulative sums of the gates, position embeddings
interpolated at them. Here, with the plain form of each beside it:

- :func:`reverse_cumsum`, the counts, as products with a triangle of ones by blocks; the
  plain form is ``jnp.flip(jnp.cumsum(jnp.flip(x, -1), -1), -1)``;
- :func:`interpolate_pairs`, the interpolation's reads, whose gradient is one scatter of
  pairs into the values laid out flat (a linear primitive,
  :func:`~posenc_jax.functional.kernels.autodiff.linear_primitives`, so forward mode works
  too); the plain form is :func:`interpolate_pairs_plain` (``take_along_axis``, autodiff's
  gradient);
- :func:`cope_added_by_blocks`, the term added into ``[B, N, T, S]`` scores by blocks of
  query rows (its gates, counts and ``q·eᵀ`` never stored whole), in causal self-attention
  each block over the keys up to its last row; the plain form is the term computed whole
  and added. Where the gates' logits are the content scores the call makes, the gradient is
  written by hand (:func:`_added_by_prefixes`): it keeps only the content scores the blocks
  read, and recomputes each block's gates, counts and ``q·eᵀ`` one block at a time.

Backends: every form here runs on every backend. The first two were shaped on XLA:CPU and
are registered for the CPU only (:class:`~posenc_jax.functional.core.operations.Operation`),
the plain forms run on the others.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.blocks import (
    by_causal_prefix_blocks,
    by_causal_prefixes_where,
    by_query_blocks,
    causal_prefix_stages,
    each_stage_block,
    in_one_block,
    takes_causal_prefixes,
)
from posenc_jax.functional.core.masks import causal_mask, combine_masks
from posenc_jax.functional.core.operations import Operation
from posenc_jax.functional.kernels.autodiff import linear_primitives, tangent_primitive

__all__ = [
    "carried_unless_saturated",
    "cope_added_by_blocks",
    "interpolate_pairs",
    "interpolate_pairs_plain",
    "reverse_cumsum",
]


def carried_unless_saturated(tile: Callable, top: Callable, later: jax.Array, num_positions: int):
    """A blockwise tile's ``(term, sums)``: ``tile()``, or ``(top(), later)`` where every count is past the top.

    ``later`` ``[B, N, bq]``: the gate sums of the key tiles after this one (the carry). Gates are
    ``>= 0``, so where every row has counted ``P - 1`` already, every count of the tile is clipped
    to ``P - 1``: the term is ``q_t · e[P - 1]`` for each row (``top()``, ``[B, N, bq, bk]``) and no
    count can fall below the top again, so the sums passed on need not grow. The same values,
    and the same gradients (a clipped count has none): the tile's gates, counts, ``q · eᵀ`` and
    interpolation are skipped, one conditional on ``B · N · bq`` sums.
    """
    return jax.lax.cond(jnp.all(later >= num_positions - 1), lambda: (top(), later), tile)


def reverse_cumsum(x: jax.Array, *, block: int = 32) -> jax.Array:
    """``out[..., s] = Σ_{s' >= s} x[..., s']`` along the last axis, in float32 (CoPE's counts).

    By blocks of ``block`` entries: the sums within each block are one product with a
    ``[block, block]`` triangle of ones (a matrix product, at full float32 precision on
    every backend), and the totals of the later blocks, a cumulative sum over S / block
    values, are added. The same sums as ``jnp.flip(jnp.cumsum(jnp.flip(x, -1), -1), -1)``
    up to rounding, the form XLA:CPU runs as a tree of reduce-windows (slower on
    CoPE's gates, and the same again in the gradient, which is a forward cumulative sum,
    here a product with the transposed triangle). For finite values: an infinite or NaN
    entry makes its whole block NaN (CoPE's gates are in [0, 1], or NaN where a visible
    key's score already is). On the CPU only (:data:`REVERSE_CUMSUM`); on the other backends,
    the plain reversed cumulative sum.

    Example:
      >>> reverse_cumsum(jnp.array([1.0, 2.0, 3.0]))
      Array([6., 5., 3.], dtype=float32)
    """
    return REVERSE_CUMSUM(jnp.asarray(x, jnp.float32), block=block)


REVERSE_CUMSUM = Operation("reverse_cumsum", lambda x, *, block: jax.lax.cumsum(x, axis=x.ndim - 1, reverse=True))


@REVERSE_CUMSUM.implement(backend="cpu")
def _reverse_cumsum_by_blocks(x: jax.Array, *, block: int) -> jax.Array:
    return _cumsum_by_blocks(x, block=block, reverse=True)


def _cumsum_by_blocks(x: jax.Array, *, block: int, reverse: bool) -> jax.Array:
    """The cumulative sums along the last axis (from the end where ``reverse``) by blocks: a product with a
    ``[block, block]`` triangle of ones within each block, and the totals of the blocks before (after) it."""
    *lead, length = x.shape
    num_blocks = -(-length // block)
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, num_blocks * block - length)])
    ones = np.ones((block, block), np.float32)
    triangle = jnp.asarray(np.tril(ones) if reverse else np.triu(ones))  # [i, j] = 1 where i >= j (i <= j)
    within = jnp.einsum(
        "...ki,ij->...kj",
        padded.reshape(*lead, num_blocks, block),
        triangle,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )  # Σ over the block's entries from (up to) j
    totals = within[..., 0] if reverse else within[..., -1]  # [..., num_blocks]
    others = jax.lax.cumsum(totals, axis=totals.ndim - 1, reverse=reverse) - totals  # the blocks after (before)
    return (within + others[..., None]).reshape(*lead, num_blocks * block)[..., :length]


def _cumsum(x: jax.Array, *, block: int = 32) -> jax.Array:
    """``out[..., s] = Σ_{s' <= s} x[..., s']``, the transpose of :func:`reverse_cumsum` (by blocks on the CPU)."""
    return CUMSUM(jnp.asarray(x, jnp.float32), block=block)


CUMSUM = Operation("cumsum", lambda x, *, block: jax.lax.cumsum(x, axis=x.ndim - 1))
CUMSUM.implement(backend="cpu")(lambda x, *, block: _cumsum_by_blocks(x, block=block, reverse=False))


def interpolate_pairs(per_position: jax.Array, lower: jax.Array, weight: jax.Array) -> jax.Array:
    """``(1 - w) · x[..., l] + w · x[..., l + 1]`` for each ``l = lower[..., s]``, ``w = weight[..., s]``.

    ``per_position`` ``[..., P]``; ``lower`` int32 and ``weight`` ``[..., S]`` with the same
    leading shape, ``0 <= lower <= P - 2``. Where the gradient is taken, the pair is read from
    the values laid out flat, by offsets, and the values' gradient is one scatter of pairs, a
    window of two, into that flat array. As ``take_along_axis`` on ``[..., P]`` (gathers with
    batch dimensions), the gradient was two scatters with batch dimensions, which XLA:CPU ran
    slower. On the CPU only (:data:`INTERPOLATE_PAIRS`); on the other backends, the
    plain form (:func:`interpolate_pairs_plain`).

    Example:
      >>> interpolate_pairs(jnp.array([0.0, 10.0, 20.0]), jnp.array([0, 1]), jnp.array([0.5, 0.25]))
      Array([ 5. , 12.5], dtype=float32)
    """
    return INTERPOLATE_PAIRS(per_position, lower, weight)


def interpolate_pairs_plain(per_position: jax.Array, lower: jax.Array, weight: jax.Array) -> jax.Array:
    """:func:`interpolate_pairs` by ``take_along_axis``: the plain form, with autodiff's gradient."""
    at_lower = jnp.take_along_axis(per_position, lower, axis=-1, mode="clip")
    at_upper = jnp.take_along_axis(per_position, lower + 1, axis=-1, mode="clip")
    return at_lower * (1.0 - weight) + at_upper * weight


INTERPOLATE_PAIRS = Operation("interpolate_pairs", interpolate_pairs_plain)


@INTERPOLATE_PAIRS.implement(backend="cpu")
def _interpolate_flat(per_position: jax.Array, lower: jax.Array, weight: jax.Array) -> jax.Array:
    if per_position.size >= 2**31:  # flat offsets past int32
        return interpolate_pairs_plain(per_position, lower, weight)
    return _interpolate(per_position, lower, weight)


@jax.custom_jvp
def _interpolate(per_position: jax.Array, lower: jax.Array, weight: jax.Array) -> jax.Array:
    """Without a derivative, ``take_along_axis``, which XLA:CPU fuses into the consumer (faster there
    than the flat gathers the derivative uses)."""
    return interpolate_pairs_plain(per_position, lower, weight)


@_interpolate.defjvp
def _interpolate_jvp(primals, tangents):
    per_position, lower, weight = primals
    values_dot, _, weight_dot = tangents
    pairs = _read_pairs(per_position, lower)  # [..., S, 2]
    at_lower, at_upper = pairs[..., 0], pairs[..., 1]
    out = at_lower * (1.0 - weight) + at_upper * weight
    pairs_dot = _read_pairs(values_dot, lower)
    out_dot = pairs_dot[..., 0] * (1.0 - weight) + pairs_dot[..., 1] * weight + weight_dot * (at_upper - at_lower)
    return out, out_dot


def _flat_starts(per_position, lower):
    """The values laid out flat and each pair's flat offset, the leading axes of both broadcast together."""
    lead = jnp.broadcast_shapes(per_position.shape[:-1], lower.shape[:-1])
    per_position = jnp.broadcast_to(per_position, (*lead, per_position.shape[-1]))
    lower = jnp.broadcast_to(lower, (*lead, lower.shape[-1]))
    rows = int(np.prod(lead, dtype=np.int64))
    row_start = (jnp.arange(rows, dtype=jnp.int32) * per_position.shape[-1]).reshape(*lead, 1)
    return per_position.reshape(-1), row_start + lower


def _pairs(per_position, lower, *, positions: int):
    """``[..., S, 2]``: the pair ``x[..., l], x[..., l + 1]`` for each ``l = lower[..., s]``, read from the
    values laid out flat (as relative.take_along_last_axis, and why)."""
    flat, start = _flat_starts(per_position, lower)
    clip = jax.lax.GatherScatterMode.CLIP
    return jnp.stack([flat.at[start].get(mode=clip), flat.at[start + 1].get(mode=clip)], axis=-1)


def _pairs_back(pairs, lower, *, positions: int):
    """The transpose: one scatter of (lower, upper) pairs, a window of two, into the flat values (half
    the updates of two scalar scatters; with batch dimensions, as autodiff makes of take_along_axis,
    XLA:CPU ran it slower). ``[..., P]`` for ``positions`` P, the pairs' leading axes."""
    shape = (*pairs.shape[:-2], positions)
    flat, start = _flat_starts(jnp.zeros(shape, pairs.dtype), lower)
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(start.ndim,), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
    )
    into_flat = jax.lax.scatter_add(flat, start[..., None], pairs, numbers, mode=jax.lax.GatherScatterMode.CLIP)
    return into_flat.reshape(shape)


# The pair reads and their transpose: reverse mode scatters pairs once, forward mode reads them. Their one
# parameter, P, does not change when jax.vmap folds a mapped axis into the leading ones.
_pairs_primitive, _ = linear_primitives("cope_pairs", _pairs, _pairs_back)


def _read_pairs(per_position, lower):
    return _pairs_primitive(per_position, lower, positions=per_position.shape[-1])


def cope_added_by_blocks(
    scores,
    term: Callable,
    q,
    k,
    query_positions,
    key_positions,
    embeddings,
    *,
    scale,
    mask,
    content_scale,
    block_elements: int,
    self_attention: bool = False,
):
    """``scores + term(q, k, query_positions, key_positions, embeddings, mask=...)``, the term computed
    by blocks of query rows and added in place.

    ``query_positions`` ``[B|1, T]`` and ``key_positions`` ``[B|1, S]``, int32, are taken as
    checked (the encoding's entry checks them). ``term`` is CoPE's term of a block (the
    encoding's, given the block's rows of the queries, its keys and mask, and ``gate_logits``,
    the gates' logits where read from the scores, else None). With ``content_scale``,
    ``scores`` are exactly ``content_scale · q·k`` and the gates' logits are read from them
    (times ``scale / content_scale``). ``scores`` is an array or a function of no arguments
    making one.

    In self-attention (the same positions for queries and keys) whose positions increase
    along every row, query t sees no key after t: each block then works on the keys up to
    its last row only (:func:`~posenc_jax.functional.core.relative.by_causal_prefix_blocks`,
    5/8 of the work). The positions are checked at run time, by one conditional around the
    whole term where ``scores`` is a function that makes them
    (:func:`~posenc_jax.functional.core.relative.by_causal_prefixes_where`), by one per block
    where it is an array; otherwise each block takes all keys.
    """
    q_len, k_len = q.shape[1], k.shape[1]
    expected = (q.shape[0], q.shape[2], q_len, k_len)
    make_scores = scores if callable(scores) else (lambda: scores)
    shape = tuple(jax.eval_shape(make_scores).shape)
    if len(shape) != 4 or shape[2:] != (q_len, k_len) or shape[1] != q.shape[2]:
        raise ValueError(f"into must be scores [B, N, T, S] = {expected}, got {shape}")
    if mask is not None:
        mask = jnp.asarray(mask)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # [B|1, N|1, T|1, S|1]
    # A count is at most the number of keys a query sees (S; a sum of S gates <= 1 rounds to at most
    # S), so the interpolation reads embeddings 0 .. S + 1 at most: the others are never gathered.
    embeddings = jnp.asarray(embeddings)[..., : min(np.shape(embeddings)[-2], k_len + 2), :]

    # The gates' logits are the content scores times this (None: the term computes them itself).
    ratio = None if content_scale is None else (1.0 / np.sqrt(q.shape[-1]) if scale is None else scale) / content_scale
    block = _prefix_block(term, ratio, q, k, query_positions, key_positions, embeddings, mask)

    def all_keys(scores):
        return by_query_blocks(
            lambda start, rows, content=None: block(start, rows, k_len, content),
            tuple(scores.shape),
            jnp.float32,
            block_elements=block_elements,
            into=scores,
            reads_into=content_scale is not None,
        )

    gates_read = callable(scores) and content_scale is not None  # prefixes then save the scores' memory too
    small = not takes_causal_prefixes(shape, block_elements) if gates_read else in_one_block(shape, block_elements)
    if not self_attention or q_len != k_len or small:
        return all_keys(make_scores())

    increasing = jnp.all(query_positions[:, 1:] > query_positions[:, :-1])
    if gates_read:
        # One conditional, each branch making the scores itself (as by_causal_prefixes_where, and why); the
        # every-key branch rematerialised in the gradient, so it keeps no residuals where not taken.
        operands = (q, k, query_positions, key_positions, embeddings, mask)
        prefixes = lambda: _added_by_prefixes(term, ratio, block_elements, make_scores(), *operands)
        return jax.lax.cond(increasing, prefixes, jax.checkpoint(lambda: all_keys(make_scores())))
    if callable(scores):
        return by_causal_prefixes_where(increasing, make_scores, lambda: block, all_keys, block_elements=block_elements)
    return by_causal_prefix_blocks(
        block, scores.astype(jnp.float32), block_elements=block_elements, prefix_ok=increasing
    )


def _prefix_block(term: Callable, ratio: float | None, q, k, query_positions, key_positions, embeddings, mask):
    """The block function of :func:`~posenc_jax.functional.core.blocks.by_causal_prefix_blocks` (and, with
    ``width`` the keys' length, of ``by_query_blocks``) for CoPE's term: ``block(start, rows, width, current)``,
    the term of query rows ``start ..`` for keys ``0 .. width - 1``; its gates' logits are ``current``, their
    content scores, times ``ratio`` (None: the term computes them itself)."""

    def block(start, rows: int, width: int, current=None) -> jax.Array:
        rows_of = lambda x, axis: x if x.shape[axis] == 1 else jax.lax.dynamic_slice_in_dim(x, start, rows, axis=axis)
        keys_of = lambda x, axis: x if x.shape[axis] in (1, width) else jax.lax.slice_in_dim(x, 0, width, axis=axis)
        return term(
            rows_of(q, 1),
            keys_of(k, 1),
            rows_of(query_positions, 1),
            keys_of(key_positions, 1),
            embeddings[..., : width + 2, :],
            mask=None if mask is None else keys_of(rows_of(mask, 2), 3),
            gate_logits=None if ratio is None else current if ratio == 1.0 else current * jnp.float32(ratio),
        )

    return block


def _prefixes_plain(term, ratio, block_elements, scores, q, k, query_positions, key_positions, embeddings, mask):
    """``scores`` (the content scores) plus CoPE's term, its gates' logits ``ratio · scores``, by causal
    prefix blocks (:func:`~posenc_jax.functional.core.blocks.by_causal_prefix_blocks`), in place.

    Its reverse mode by hand (:func:`_added_by_prefixes`, :func:`_prefixes_backward`): it keeps the content
    scores the blocks read (the keys up to each stage's rows, 5/8 of them), recomputes each block's gates,
    counts and ``q · eᵀ`` from them, and goes through the blocks one after another in one loop, so that only
    one block's transients live at a time. Autodiff's kept each block's gates, counts, interpolation weights
    and pairs, several score-sized buffers in all. Forward mode is autodiff's. ``k`` is read for its shape
    only (the gates' logits are the scores').
    """
    block = _prefix_block(term, ratio, q, k, query_positions, key_positions, embeddings, mask)
    return by_causal_prefix_blocks(block, scores.astype(jnp.float32), block_elements=block_elements)


_added_by_prefixes = jax.custom_jvp(_prefixes_plain, nondiff_argnums=(0, 1, 2))
_PREFIXES_TANGENT = tangent_primitive("cope_prefixes_tangent")


@_added_by_prefixes.defjvp
def _prefixes_jvp(term, ratio, block_elements, primals, tangents):
    scores, q, k, query_positions, key_positions, embeddings, mask = primals
    batch, heads, q_len, _ = scores.shape
    stages = causal_prefix_stages(q_len, batch * heads, block_elements)
    read = tuple(scores[:, :, first:last, :last].astype(jnp.float32) for first, last, _ in stages)
    fixed = (read, q, k, query_positions, key_positions, embeddings, mask)

    def jvp(tangents, fixed):  # forward mode: autodiff's, at the content scores the blocks read
        read, *operands = fixed
        at = jnp.zeros(tangents[0].shape, jnp.float32)
        for (first, last, _), part in zip(stages, read, strict=True):
            at = at.at[:, :, first:last, :last].set(part)
        plain = lambda s, q, e: _prefixes_plain(
            term, ratio, block_elements, s, q, operands[1], *operands[2:4], e, operands[5]
        )
        return jax.jvp(plain, (at, operands[0], operands[4]), tuple(tangents))[1]

    transpose = functools.partial(_prefixes_backward, term, ratio, block_elements)
    out = _added_by_prefixes(term, ratio, block_elements, *primals)
    return out, _PREFIXES_TANGENT(jvp, transpose, (tangents[0], tangents[1], tangents[5]), fixed)


def _prefixes_backward(term, ratio, block_elements, residuals, cotangent):
    """Reverse mode: the cotangents of the scores, ``q`` and the embeddings."""
    read, q, k, query_positions, key_positions, embeddings, mask = residuals
    batch, heads, q_len, _ = cotangent.shape
    first_rows = np.cumsum([0] + [stage.shape[2] for stage in read])[:-1]  # each stage's first row

    def stage_block(read_stage, first: int, rows: int):
        last = read_stage.shape[-1]

        def add(block, carry):
            d_scores, d_q, d_embeddings = carry
            begin = first + block * rows
            start = jnp.minimum(begin, last - rows)
            fresh = (start + jnp.arange(rows)) >= begin  # a shifted-back block's overlap was counted once
            rows_of = lambda x, axis: x if x.shape[axis] == 1 else jax.lax.dynamic_slice_in_dim(x, start, rows, axis)
            keys_of = lambda x, axis: x if x.shape[axis] in (1, last) else jax.lax.slice_in_dim(x, 0, last, axis=axis)
            visible = combine_masks(
                causal_mask(rows_of(query_positions, 1), keys_of(key_positions, 1)),
                None if mask is None else keys_of(rows_of(mask, 2), 3),
            )
            logits = jax.lax.dynamic_slice_in_dim(read_stage, start - first, rows, axis=2)
            if ratio != 1.0:
                logits = logits * jnp.float32(ratio)
            d_rows_in = jax.lax.dynamic_slice(d_scores, (0, 0, start, 0), (batch, heads, rows, last))
            d_term = jnp.where(fresh[:, None], d_rows_in, 0.0)
            q_rows = jax.lax.dynamic_slice_in_dim(q, start, rows, axis=1)
            table = embeddings[..., : last + 2, :]
            d_logits, d_rows, d_table = _block_backward(logits, visible, q_rows, table, d_term)
            d_scores = jax.lax.dynamic_update_slice(
                d_scores, d_rows_in + d_logits * jnp.float32(ratio), (0, 0, start, 0)
            )  # the gates' logits were read from the scores
            d_q = jax.lax.dynamic_update_slice_in_dim(
                d_q, jax.lax.dynamic_slice_in_dim(d_q, start, rows, axis=1) + d_rows.astype(d_q.dtype), start, axis=1
            )
            d_embeddings = d_embeddings.at[..., : last + 2, :].add(d_table.astype(d_embeddings.dtype))
            return d_scores, d_q, d_embeddings

        return add

    # Blocks a quarter of the forward's, one after another (each block's transients freed before the next).
    stages, reads = [], {}
    for read_stage, first in zip(read, first_rows, strict=True):
        first, last = int(first), read_stage.shape[-1]
        width = dict(stages=1, full_width=last)
        stages += [(first, last, causal_prefix_stages(last - first, batch * heads, block_elements // 4, **width)[0][2])]
        reads[first] = read_stage
    make_step = lambda first, last, rows: stage_block(reads[first], first, rows)
    carry = (cotangent, jnp.zeros_like(q), jnp.zeros(jnp.shape(embeddings), jnp.float32))
    d_scores, d_q, d_embeddings = each_stage_block(stages, make_step, carry)
    return d_scores, d_q, d_embeddings.astype(jnp.result_type(embeddings))


def _block_backward(logits, visible, q_rows, table, d_term):
    """One block's share of CoPE's gradient, given its gates' logits ``[B, N, rows, w]``, what its rows see,
    its queries ``[B, rows, N, H]``, the position embeddings it reads ``[(N,) P', H]`` and its term's
    cotangent ``d_term``: ``(d_logits, d_q_rows, d_table)``.

    The term is ``(1 - w) · z[⌊c⌋] + w · z[⌊c⌋ + 1]`` of ``z = q · eᵀ`` at the counts ``c``, the reverse
    cumulative sums of the gates ``σ(logits)`` clipped to ``P' - 1``: its cotangent reaches ``z`` as one
    scatter of pairs, the weights as ``d_term · (z[⌊c⌋ + 1] - z[⌊c⌋])`` (nothing where the count is
    clipped), the gates as the forward cumulative sums of those (the reverse sums' transpose) and the
    logits times ``σ'``.
    """
    num_positions = table.shape[-2]
    spec = "BTNH,PH->BNTP" if table.ndim == 2 else "BTNH,NPH->BNTP"
    per_position = jnp.einsum(spec, q_rows, table, preferred_element_type=jnp.float32)  # z: [B, N, rows, P']
    if num_positions == 1:  # every count reads the one embedding
        d_z = d_term.sum(axis=-1, keepdims=True)
        d_logits = jnp.zeros_like(logits)
    else:
        gates = jnp.where(visible, jax.nn.sigmoid(logits), 0.0)
        counts = jnp.minimum(reverse_cumsum(gates), num_positions - 1)
        lower = jnp.clip(jnp.floor(counts), 0, num_positions - 2)
        weight = jnp.where(counts >= num_positions - 1, 1.0, counts - lower)
        lower = lower.astype(jnp.int32)
        pairs = _read_pairs(per_position, lower)  # [..., w, 2]
        d_counts = jnp.where(counts < num_positions - 1, d_term * (pairs[..., 1] - pairs[..., 0]), 0.0)
        d_logits = jnp.where(visible, _cumsum(d_counts) * gates * (1.0 - gates), 0.0)
        d_pairs = jnp.stack([d_term * (1.0 - weight), d_term * weight], axis=-1)
        d_z = _pairs_back(d_pairs, lower, positions=num_positions)
    back = "BNTP,PH->BTNH" if table.ndim == 2 else "BNTP,NPH->BTNH"
    d_q_rows = jnp.einsum(back, d_z, table, preferred_element_type=jnp.float32)
    onto = "BNTP,BTNH->PH" if table.ndim == 2 else "BNTP,BTNH->NPH"
    d_table = jnp.einsum(onto, d_z, q_rows, preferred_element_type=jnp.float32)
    return d_logits, d_q_rows, d_table
