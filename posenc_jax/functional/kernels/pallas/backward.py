"""The backward kernels: ``dq`` by query tile, ``dk``, ``dv`` and the bias parameters' gradient by key tile.

Both recompute a tile's scores and bias as the forward kernel does (the same :func:`tile_bias`)
and its weights from the saved log-sum-exp, so no ``[T, S]`` array is stored. With
``ds = p · (dp - Σ_h do·o)`` the score cotangent of a tile, the parameters' cotangent of the
tile is the pull-back of ``ds`` through the encoding's per-head function (``jax.vjp`` inside the
kernel), summed over the query tiles by the key-tile program and over key tiles, batch and
(for grouped heads) queries outside. ``dk`` and ``dv`` are written per query head and summed
over each key/value head's group outside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from posenc_jax.functional.kernels.pallas.backend import Layout, dot, kernel_call, masked_scores, tile_bias, visible
from posenc_jax.functional.kernels.pallas.forward import (
    Operands,
    key_tile,
    operand_specs,
    ordered_masks,
    per_key_specs,
    per_query_specs,
    split_refs,
)

__all__ = ["backward"]


def _weights(layout, q, k, lse, parameters, q_positions, k_positions, mask):
    """A tile's weights ``exp(s - lse)`` (zero where masked)."""
    s = masked_scores(layout, q, k, tile_bias(layout, parameters, q_positions, k_positions), mask)
    p = jnp.exp(s - lse)
    return p if mask is None else jnp.where(mask, p, 0.0)


def _dq_kernel(layout: Layout, q_ref, k_ref, v_ref, *refs):
    *refs, do_ref, lse_ref, delta_ref, dq_ref = refs
    (qpos_ref, qseg_ref), per_key, parameter_refs = split_refs(layout, refs)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_positions = qpos_ref[...]
    q_segments = None if qseg_ref is None else qseg_ref[...]
    parameters = [ref[...] for ref in parameter_refs]
    block_k = layout.block_k

    def step(j, dq):
        columns = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        k, v = k_ref[columns, :], v_ref[columns, :]
        k_positions, k_segments, k_valid = key_tile(per_key, columns)
        mask = visible(layout, q_positions, k_positions, q_segments, k_segments, k_valid)
        p = _weights(layout, q, k, lse, parameters, q_positions, k_positions, mask)
        ds = p * (dot(layout, do, v, ((1,), (1,))) - delta)
        return dq + dot(layout, ds.astype(k.dtype), k)

    dq = jax.lax.fori_loop(0, layout.k_len // block_k, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * layout.scale).astype(dq_ref.dtype)


def _dkv_kernel(layout: Layout, k_ref, v_ref, q_ref, *refs):
    count = layout.num_parameters
    refs, dparameter_refs = refs[: len(refs) - count], refs[len(refs) - count :]
    *refs, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    (qpos_ref, qseg_ref), per_key, parameter_refs = split_refs(layout, refs)
    k, v = k_ref[...], v_ref[...]
    k_positions, k_segments, k_valid = (None if ref is None else ref[...] for ref in per_key)
    parameters = [ref[...] for ref in parameter_refs]
    block_q = layout.block_q

    def step(i, carry):
        dk, dv, dparameters = carry
        rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        q, do, lse, delta = q_ref[rows, :], do_ref[rows, :], lse_ref[rows, :], delta_ref[rows, :]
        q_positions = qpos_ref[rows, :]
        q_segments = None if qseg_ref is None else qseg_ref[rows, :]
        mask = visible(layout, q_positions, k_positions, q_segments, k_segments, k_valid)
        p = _weights(layout, q, k, lse, parameters, q_positions, k_positions, mask)
        dv = dv + dot(layout, p.T.astype(do.dtype), do)
        ds = p * (dot(layout, do, v, ((1,), (1,))) - delta)
        dk = dk + dot(layout, ds.T.astype(q.dtype), q)
        if count:
            _, pull = jax.vjp(lambda rows_: tile_bias(layout, rows_, q_positions, k_positions), parameters)
            dparameters = tuple(a + b for a, b in zip(dparameters, pull(ds)[0], strict=True))
        return dk, dv, dparameters

    start = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32), tuple(map(jnp.zeros_like, parameters)))
    dk, dv, dparameters = jax.lax.fori_loop(0, layout.q_len // block_q, step, start)
    dk_ref[...] = (dk * layout.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    for ref, value in zip(dparameter_refs, dparameters, strict=True):
        ref[...] = value


def _dq(layout: Layout, operands: Operands, do, lse, delta):
    batch, num_heads, _, head_dim = operands.q.shape
    sizes = [p.shape[-1] for p in operands.parameters]
    row = pl.BlockSpec((None, None, layout.block_q, 1), lambda b, n, i: (b, n, i, 0))
    tile = pl.BlockSpec((None, None, layout.block_q, head_dim), lambda b, n, i: (b, n, i, 0))
    return kernel_call(
        functools.partial(_dq_kernel, layout),
        out_shape=jax.ShapeDtypeStruct(operands.q.shape, operands.q.dtype),
        grid=(batch, num_heads, layout.q_len // layout.block_q),
        in_specs=[*operand_specs(layout, head_dim, sizes), tile, row, row],
        out_specs=tile,
        interpret=layout.interpret,
        name="posenc_flash_backward_dq",
    )(operands.q, operands.k, operands.v, *ordered_masks(layout, operands), *operands.parameters, do, lse, delta)


def _dkv(layout: Layout, operands: Operands, do, lse, delta):
    batch, num_heads, _, head_dim = operands.q.shape
    num_k_blocks = layout.k_len // layout.block_k
    sizes = [p.shape[-1] for p in operands.parameters]
    key = pl.BlockSpec((None, None, layout.block_k, head_dim), lambda b, n, j: (b, jax.lax.div(n, layout.groups), j, 0))
    whole = pl.BlockSpec((None, None, layout.q_len, head_dim), lambda b, n, j: (b, n, 0, 0))
    rows = pl.BlockSpec((None, None, layout.q_len, 1), lambda b, n, j: (b, n, 0, 0))
    parameter_specs = [pl.BlockSpec((None, 1, size), lambda b, n, j: (n, 0, 0)) for size in sizes]
    out = pl.BlockSpec((None, None, layout.block_k, head_dim), lambda b, n, j: (b, n, j, 0))
    dparameter_specs = [pl.BlockSpec((None, None, None, 1, size), lambda b, n, j: (b, n, j, 0, 0)) for size in sizes]
    dkv_shape = jax.ShapeDtypeStruct((batch, num_heads, layout.k_len, head_dim), jnp.float32)
    dparameter_shapes = [jax.ShapeDtypeStruct((batch, num_heads, num_k_blocks, 1, s), jnp.float32) for s in sizes]
    per_query = per_query_specs(layout, None, 2)
    return kernel_call(
        functools.partial(_dkv_kernel, layout),
        out_shape=(dkv_shape, dkv_shape, *dparameter_shapes),
        grid=(batch, num_heads, num_k_blocks),
        in_specs=[key, key, whole, *per_query, *per_key_specs(layout, layout.block_k), *parameter_specs]
        + [whole, rows, rows],
        out_specs=(out, out, *dparameter_specs),
        interpret=layout.interpret,
        name="posenc_flash_backward_dkv",
    )(operands.k, operands.v, operands.q, *ordered_masks(layout, operands), *operands.parameters, do, lse, delta)


def backward(layout: Layout, operands: Operands, out, lse, dout):
    """``(dq [B, N, T, H], dk [B, K, S, H], dv [B, K, S, H], dparameters [N, 1, P] each)``."""
    delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1, keepdims=True)
    dq = _dq(layout, operands, dout, lse, delta)
    dk, dv, *dparameters = _dkv(layout, operands, dout, lse, delta)
    batch, num_heads, k_len, head_dim = dk.shape
    grouped = (batch, num_heads // layout.groups, layout.groups, k_len, head_dim)
    dk = dk.reshape(grouped).sum(2).astype(operands.k.dtype)
    dv = dv.reshape(grouped).sum(2).astype(operands.v.dtype)
    dparameters = tuple(d.sum(axis=(0, 2)) for d in dparameters)  # [N, 1, P]
    return dq, dk, dv, dparameters
