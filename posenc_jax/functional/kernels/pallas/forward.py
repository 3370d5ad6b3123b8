"""The forward kernel: one query tile of one head against every key tile, the bias computed per tile.

Grid ``(B, N, T / bq)``. A program holds its query tile ``[bq, H]`` and positions ``[bq, 1]``, reads
its key/value head's keys, values and positions tile by tile from the whole sequence, and keeps
the online softmax's running maximum, denominator and output. It writes the output tile and the
rows' log-sum-exp (for the backward kernels).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from posenc_jax.functional.kernels.pallas.backend import (
    MASKED,
    Layout,
    dot,
    kernel_call,
    masked_scores,
    tile_bias,
    visible,
)

__all__ = ["Operands", "forward", "key_tile", "operand_specs", "ordered_masks", "per_key_specs", "per_query_specs"]


class Operands(NamedTuple):
    """A call's arrays in the kernels' layout (heads before tokens; per-token arrays with a unit axis)."""

    q: jax.Array  # [B, N, T, H]
    k: jax.Array  # [B, K, S, H]
    v: jax.Array  # [B, K, S, H]
    query_positions: jax.Array  # int32 [B|1, T, 1]
    key_positions: jax.Array  # int32 [B|1, 1, S]
    query_segments: jax.Array | None  # int32 [B|1, T, 1]
    key_segments: jax.Array | None  # int32 [B|1, 1, S]
    key_valid: jax.Array | None  # int32 [B|1, 1, S]
    parameters: tuple  # float32 [N, 1, P] each


def _batch(batched: bool):
    return (lambda b: b) if batched else (lambda b: 0)


def per_query_specs(layout: Layout, block: int | None, grid_axis: int):
    """Block specs of the per-query arrays (positions, segments) for a grid whose ``grid_axis`` walks query
    tiles of ``block`` (None: the whole sequence, for a grid over key tiles)."""
    size = layout.q_len if block is None else block

    def spec(batched):
        batch = _batch(batched)
        return pl.BlockSpec((None, size, 1), lambda b, n, i: (batch(b), 0 if block is None else i, 0))

    specs = [spec(layout.batched_positions[0])]
    if layout.segments:
        specs.append(spec(layout.batched_segments[0]))
    return specs


def per_key_specs(layout: Layout, block: int | None):
    """Block specs of the per-key arrays (positions, segments, validity): whole, or tiles of ``block``."""
    size = layout.k_len if block is None else block

    def spec(batched):
        batch = _batch(batched)
        return pl.BlockSpec((None, 1, size), lambda b, n, j: (batch(b), 0, 0 if block is None else j))

    specs = [spec(layout.batched_positions[1])]
    if layout.segments:
        specs.append(spec(layout.batched_segments[1]))
    if layout.key_valid:
        specs.append(spec(layout.batched_valid))
    return specs


def operand_specs(layout: Layout, head_dim: int, num_parameters_shapes):
    """The forward grid's input specs: q tile, whole k and v of the head's group, per-query tiles, whole
    per-key arrays, and the head's parameter rows."""
    q = pl.BlockSpec((None, None, layout.block_q, head_dim), lambda b, n, i: (b, n, i, 0))
    kv = pl.BlockSpec((None, None, layout.k_len, head_dim), lambda b, n, i: (b, jax.lax.div(n, layout.groups), 0, 0))
    rows = [pl.BlockSpec((None, 1, size), lambda b, n, i: (n, 0, 0)) for size in num_parameters_shapes]
    return [q, kv, kv, *per_query_specs(layout, layout.block_q, 2), *per_key_specs(layout, None), *rows]


def split_refs(layout: Layout, refs):
    """``(per_query, per_key, parameters)`` refs: per_query ``(positions, segments|None)``, per_key
    ``(positions, segments|None, valid|None)``."""
    refs = list(refs)
    query_positions = refs.pop(0)
    query_segments = refs.pop(0) if layout.segments else None
    key_positions = refs.pop(0)
    key_segments = refs.pop(0) if layout.segments else None
    key_valid = refs.pop(0) if layout.key_valid else None
    return (query_positions, query_segments), (key_positions, key_segments, key_valid), refs


def key_tile(per_key, columns):
    """The per-key arrays' ``[1, bk]`` tiles at ``columns`` (None where absent)."""
    return tuple(None if ref is None else ref[:, columns] for ref in per_key)


def _forward_kernel(layout: Layout, q_ref, k_ref, v_ref, *refs):
    *refs, o_ref, lse_ref = refs
    (qpos_ref, qseg_ref), per_key, parameter_refs = split_refs(layout, refs)
    q = q_ref[...]
    q_positions = qpos_ref[...]
    q_segments = None if qseg_ref is None else qseg_ref[...]
    parameters = [ref[...] for ref in parameter_refs]
    block_q, block_k = layout.block_q, layout.block_k

    def step(j, carry):
        m, denominator, acc = carry
        columns = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        k, v = k_ref[columns, :], v_ref[columns, :]
        k_positions, k_segments, k_valid = key_tile(per_key, columns)
        mask = visible(layout, q_positions, k_positions, q_segments, k_segments, k_valid)
        s = masked_scores(layout, q, k, tile_bias(layout, parameters, q_positions, k_positions), mask)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        p = p if mask is None else jnp.where(mask, p, 0.0)
        correction = jnp.exp(m - m_new)
        denominator = correction * denominator + jnp.sum(p, axis=1, keepdims=True)
        acc = correction * acc + dot(layout, p.astype(v.dtype), v)
        return m_new, denominator, acc

    start = (
        jnp.full((block_q, 1), MASKED, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
        jnp.zeros((block_q, q.shape[-1]), jnp.float32),
    )
    m, denominator, acc = jax.lax.fori_loop(0, layout.k_len // block_k, step, start)
    seen = denominator > 0.0  # a query with no visible key gets a zero output
    denominator = jnp.where(seen, denominator, 1.0)
    o_ref[...] = (acc / denominator).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(denominator)


def forward(layout: Layout, operands: Operands):
    """The output ``[B, N, T, H]`` in q's dtype and the rows' log-sum-exp ``[B, N, T, 1]`` float32."""
    batch, num_heads, _, head_dim = operands.q.shape
    sizes = [p.shape[-1] for p in operands.parameters]
    out_shape = (
        jax.ShapeDtypeStruct(operands.q.shape, operands.q.dtype),
        jax.ShapeDtypeStruct((batch, num_heads, layout.q_len, 1), jnp.float32),
    )
    out_specs = (
        pl.BlockSpec((None, None, layout.block_q, head_dim), lambda b, n, i: (b, n, i, 0)),
        pl.BlockSpec((None, None, layout.block_q, 1), lambda b, n, i: (b, n, i, 0)),
    )
    ordered = ordered_masks(layout, operands)
    return kernel_call(
        functools.partial(_forward_kernel, layout),
        out_shape=out_shape,
        grid=(batch, num_heads, layout.q_len // layout.block_q),
        in_specs=operand_specs(layout, head_dim, sizes),
        out_specs=out_specs,
        interpret=layout.interpret,
        name="posenc_flash_forward",
    )(operands.q, operands.k, operands.v, *ordered, *operands.parameters)


def ordered_masks(layout: Layout, operands: Operands) -> list:
    """The per-query then per-key arrays in the order of :func:`split_refs`."""
    per_query = [operands.query_positions] + ([operands.query_segments] if layout.segments else [])
    per_key = [operands.key_positions] + ([operands.key_segments] if layout.segments else [])
    per_key += [operands.key_valid] if layout.key_valid else []
    return per_query + per_key
