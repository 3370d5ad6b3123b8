"""A ``[..., T, S]`` result computed in blocks of query rows, or of causal prefixes, to bound its workspace.

The relative encodings' fast forms (CoPE's counts, the ladder products) build one
``[..., block, S]`` slab at a time instead of the whole ``[..., T, S]`` intermediate:
:func:`by_query_blocks` over blocks of query rows, :func:`by_causal_prefix_blocks` over causal
prefixes (a query block needs only the keys up to its last query), and
:func:`by_causal_prefixes_where` chooses between the prefix form and the whole call by a
condition. Importable from :mod:`posenc_jax.functional.core.relative` too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.operations import broadcast_to

__all__ = [
    "by_causal_prefix_blocks",
    "by_causal_prefixes_where",
    "by_query_blocks",
    "causal_prefix_stages",
    "each_stage_block",
    "in_one_block",
    "takes_causal_prefixes",
]

# A causal term of fewer values than this is computed whole, when its scores fit in one block: its prefixes
# would save a few hundred KiB and cost a larger program to compile (the hand-written gradient's loop).
PREFIXES_FROM = 1 << 16


def by_query_blocks(
    block_fn,
    out_shape,
    dtype,
    *,
    block_elements: int = 1 << 20,
    into: jax.Array | None = None,
    reads_into: bool = False,
) -> jax.Array:
    """Builds a ``[B, N, T, X]`` array from blocks of query rows, ``block_fn(start, rows)``.

    ``block_fn`` returns rows ``start .. start + rows - 1`` as ``[B, N, rows, X]`` (or
    broadcastable to it); ``rows`` is static and chosen so a block holds about
    ``block_elements`` values. The blocks are written in place into one output buffer, so
    no intermediate as large as the output is stored. The last block is shifted back to
    stay in bounds; its overlap rewrites equal values.

    With ``into`` (an ``out_shape`` array), each block is added to ``into``'s rows instead,
    in place, each row exactly once (the last block's overlap adds nothing): the result is
    ``into + blocks`` without the blocks ever stored whole, as when a logits term is added
    to the scores. With ``reads_into`` too, ``block_fn(start, rows, current)`` is also given
    those rows of ``into`` as they are before its block is added (rows the shifted last
    block shares with the block before are given with that block's values already added,
    and what it computes for them is dropped).
    """
    if reads_into and into is None:
        raise ValueError("reads_into=True reads the rows of into: pass into")
    if into is not None and tuple(into.shape) != tuple(out_shape):
        raise ValueError(f"into has shape {into.shape}, expected {tuple(out_shape)}")
    batch, heads, q_len, width = out_shape
    rows = int(max(1, min(q_len, block_elements // max(1, batch * heads * width))))
    num_blocks = -(-q_len // rows)
    if num_blocks == 1:
        whole = (block_fn(0, q_len, into) if reads_into else block_fn(0, q_len)).astype(dtype)
        return whole if into is None else into + whole

    def body(block, out):
        start = jnp.minimum(block * rows, q_len - rows)
        if into is None:
            return jax.lax.dynamic_update_slice_in_dim(out, block_fn(start, rows).astype(dtype), start, axis=2)
        current = jax.lax.dynamic_slice_in_dim(out, start, rows, axis=2)
        values = block_fn(start, rows, current) if reads_into else block_fn(start, rows)
        return jax.lax.dynamic_update_slice_in_dim(
            out, _add_fresh_rows(current, values, start, block * rows), start, axis=2
        )

    return jax.lax.fori_loop(0, num_blocks, body, jnp.zeros(out_shape, dtype) if into is None else into.astype(dtype))


def _add_fresh_rows(current: jax.Array, values: jax.Array, start, begin) -> jax.Array:
    """``current`` (rows ``start ..`` of ``[B, N, ., X]``) plus ``values`` (broadcast to it) on the rows from
    ``begin`` on: a shifted-back block adds nothing to the rows the block before it already added."""
    values = values.astype(current.dtype)
    values = broadcast_to(values.reshape((1,) * (4 - values.ndim) + values.shape), current.shape)
    fresh = (start + jnp.arange(current.shape[2])) >= begin
    return current + jnp.where(fresh[:, None], values, 0)


def by_causal_prefix_blocks(
    block_fn, into: jax.Array, *, stages: int = 4, block_elements: int = 1 << 20, prefix_ok=True
) -> jax.Array:
    """``into`` plus a causal term built by blocks of query rows, each over the keys up to its rows only.

    For self-attention where query t is key t and sees no later key: the rows ``[a, b)`` of
    stage j (the T rows cut into ``stages`` equal runs) need the keys ``0 .. b - 1`` only,
    so each stage's blocks are ``[B, N, rows, b]``, not ``[B, N, rows, S]``: with 4 stages
    5/8 of the work of :func:`by_query_blocks`. ``block_fn(start, rows, width, current)``
    returns the term of query rows ``start .. start + rows - 1`` for keys ``0 .. width - 1``,
    ``[B, N, rows, width]``, given those entries of ``into`` as they are before its block is
    added (``width``, ``rows`` static). Entries of keys past a stage's width get nothing
    added (they must be masked). Each stage is a loop over blocks of about
    ``block_elements`` values, the last shifted back within the stage (its overlap adds
    nothing), written in place into ``into``.

    ``prefix_ok``: True, or a traced boolean saying whether the prefixes hold every key a
    query sees (checked at run time by the caller). Where it is False, each block is
    computed over all S keys instead (a conditional per block, on block-sized rows, so the
    scores are never copied; blocks then hold about ``block_elements`` values at full width,
    and the all-keys branch is rematerialised in the gradient, so it stores no residuals).
    """
    batch, heads, q_len, k_len = into.shape
    if q_len != k_len:
        raise ValueError(f"causal prefix blocks pair query t with key t: T = {q_len} and S = {k_len} must be equal")
    checked = not (isinstance(prefix_ok, bool) and prefix_ok)
    out = into
    for first, last, rows in causal_prefix_stages(
        q_len, batch * heads, block_elements, stages=stages, full_width=k_len if checked else None
    ):
        width = last  # keys 0 .. last - 1: every key a row of this stage may see
        num_blocks = -(-(last - first) // rows)

        def body(block, out, first=first, last=last, rows=rows, width=width):
            begin = first + block * rows
            start = jnp.minimum(begin, last - rows)

            def add(current, width):
                return _add_fresh_rows(current, block_fn(start, rows, width, current), start, begin)

            if not checked:
                current = jax.lax.dynamic_slice(out, (0, 0, start, 0), (batch, heads, rows, width))
                return jax.lax.dynamic_update_slice(out, add(current, width), (0, 0, start, 0))
            current = jax.lax.dynamic_slice(out, (0, 0, start, 0), (batch, heads, rows, k_len))
            prefix = lambda current: current.at[..., :width].set(add(current[..., :width], width))
            every_key = jax.checkpoint(lambda current: add(current, k_len))
            return jax.lax.dynamic_update_slice(
                out, jax.lax.cond(prefix_ok, prefix, every_key, current), (0, 0, start, 0)
            )

        out = body(0, out) if num_blocks == 1 else jax.lax.fori_loop(0, num_blocks, body, out)
    return out


def causal_prefix_stages(
    q_len: int, per_key: int, block_elements: int, *, stages: int = 4, full_width: int | None = None
) -> list[tuple[int, int, int]]:
    """:func:`by_causal_prefix_blocks`' stages: ``(first, last, rows)`` for each, the query rows ``first ..
    last - 1`` taking the keys ``0 .. last - 1``, by blocks of ``rows`` rows of about ``block_elements``
    values (``per_key`` values per row and key: ``B · N``; each row ``full_width`` keys wide where given)."""
    bounds = sorted({int(round(q_len * (j + 1) / max(1, stages))) for j in range(max(1, stages))} - {0})
    out, first = [], 0
    for last in bounds:
        per_row = per_key * (last if full_width is None else full_width)
        out.append((first, last, int(max(1, min(last - first, block_elements // max(1, per_row))))))
        first = last
    return out


def takes_causal_prefixes(shape: tuple, block_elements: int) -> bool:
    """Whether a causal self-attention term of ``shape`` ``(B, N, T, S)`` is computed by causal prefixes: where
    its scores take more than one block of ``block_elements`` values, or it holds :data:`PREFIXES_FROM` values
    or more (then even one block's prefixes save memory worth a larger program: the gradient's buffers shrink
    with the keys each block reads)."""
    batch, heads, q_len, k_len = shape
    return not in_one_block(shape, block_elements) or batch * heads * q_len * k_len >= PREFIXES_FROM


def in_one_block(shape: tuple, block_elements: int) -> bool:
    """Whether :func:`by_query_blocks` computes a term of ``shape`` ``(B, N, T, S)`` in one block of rows: its
    ``T`` rows of ``B · N · S`` values each fit in ``block_elements``."""
    batch, heads, q_len, width = shape
    return q_len <= block_elements // max(1, batch * heads * width)


def each_stage_block(stages, make_step, carry):
    """``carry`` through ``make_step(first, last, rows)(block, carry)`` for every block of every stage of
    ``stages`` (:func:`causal_prefix_stages`), one after another in one loop with a branch per stage, so
    that one block's transients are freed before the next starts (unrolled, XLA:CPU may run the blocks
    side by side, holding all their transients at once). Block ``b`` of a stage starts at row
    ``min(first + b · rows, last - rows)``; what its rows share with the block before is the step's to skip.
    """
    branches, stage_of, block_of = [], [], []
    for index, (first, last, rows) in enumerate(stages):
        branches.append(make_step(first, last, rows))
        count = -(-(last - first) // rows)
        stage_of, block_of = stage_of + [index] * count, block_of + list(range(count))
    stage_of, block_of = np.asarray(stage_of, np.int32), np.asarray(block_of, np.int32)
    body = lambda i, carry: jax.lax.switch(jnp.asarray(stage_of)[i], branches, jnp.asarray(block_of)[i], carry)
    return jax.lax.fori_loop(0, len(block_of), body, carry)


def by_causal_prefixes_where(ok, make_scores, make_block, every_key, *, block_elements: int = 1 << 20) -> jax.Array:
    """The scores ``make_scores()`` plus a causal term: by :func:`by_causal_prefix_blocks`, with the block
    function ``make_block()``, where ``ok``, a run-time check that the prefixes hold every key a query
    sees; else ``every_key(scores)``, which adds the term over all keys.

    One conditional for the whole term, each branch making the scores itself: scores handed to
    a conditional would be copied into it (one more ``[B, N, T, S]`` buffer). ``make_block`` is
    called inside its branch, so what it prepares for the blocks is computed only there. The
    ``every_key`` branch is rematerialised in the gradient, so it keeps no residuals where not
    taken (a conditional keeps both branches' residuals, zero-filled for the one not taken).
    """

    def prefixes():
        return by_causal_prefix_blocks(make_block(), make_scores().astype(jnp.float32), block_elements=block_elements)

    return jax.lax.cond(ok, prefixes, jax.checkpoint(lambda: every_key(make_scores())))
