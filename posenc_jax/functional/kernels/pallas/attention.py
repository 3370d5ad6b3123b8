"""Flash attention with position biases computed per tile: the arrays laid out for the kernels, and the
custom derivative joining the forward and backward kernels."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.head_bias import HeadBias
from posenc_jax.functional.core.tiles import _pad_to as _pad  # the tile loop's padding, as sharded.py uses it
from posenc_jax.functional.kernels.pallas.backend import Layout, interpret_mode
from posenc_jax.functional.kernels.pallas.backward import backward
from posenc_jax.functional.kernels.pallas.forward import Operands, forward

__all__ = ["DEFAULT_BLOCK", "flash_attention", "joined_head_bias"]

# Tiles of 128 queries by 128 keys: powers of two (Triton) and multiples of (8, 128) (Mosaic).
DEFAULT_BLOCK = 128


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(layout: Layout, operands: Operands):
    return forward(layout, operands)[0]


def _flash_forward(layout: Layout, operands: Operands):
    out, lse = forward(layout, operands)
    return out, (operands, out, lse)


def _flash_backward(layout: Layout, residuals, dout):
    operands, out, lse = residuals
    dq, dk, dv, dparameters = backward(layout, operands, out, lse, dout)
    return (Operands(dq, dk, dv, None, None, None, None, None, dparameters),)


_flash.defvjp(_flash_forward, _flash_backward)


def joined_head_bias(heads: Sequence[HeadBias]) -> HeadBias | None:
    """The sum of several per-head biases as one (None for none)."""
    heads = list(heads)
    if not heads:
        return None
    if len(heads) == 1:
        return heads[0]
    counts = [len(head.parameters) for head in heads]

    def function(parameters, query_positions, key_positions):
        total, start = None, 0
        for head, count in zip(heads, counts, strict=True):
            term = head.function(tuple(parameters[start : start + count]), query_positions, key_positions)
            total, start = (term if total is None else total + term), start + count
        return total

    return HeadBias(tuple(p for head in heads for p in head.parameters), function)


def _block(block: int | None, length: int) -> int:
    """The tile size: ``block`` (default 128), no larger than the length's next power of two (at least 16)."""
    block = DEFAULT_BLOCK if block is None else int(block)
    if block < 16 or block & (block - 1):
        raise ValueError(f"the pallas kernel's tiles must be powers of two >= 16 (Triton), got {block}")
    return min(block, max(16, 1 << max(0, math.ceil(math.log2(length)))))


def _per_token(x, length: int, *, key_side: bool):
    """An int32 ``[T]``/``[B, T]`` array as ``[B|1, T, 1]`` (queries) or ``[B|1, 1, S]`` (keys), padded."""
    x = jnp.atleast_2d(jnp.asarray(x, jnp.int32))
    x = _pad(x, length, 1, edge=True)
    return x[:, None, :] if key_side else x[:, :, None]


def _parameter_rows(parameter):
    """``[N, P]`` as ``[N, 1, P']`` float32, P' the next power of two (Triton's block shapes)."""
    parameter = jnp.asarray(parameter, jnp.float32)
    width = 1 << max(0, math.ceil(math.log2(parameter.shape[-1])))
    return _pad(parameter, width, 1)[:, None, :]


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    query_positions,
    key_positions,
    head_bias: HeadBias | None = None,
    causal: bool = False,
    scale: float | None = None,
    query_segment_ids=None,
    key_segment_ids=None,
    key_mask=None,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: bool | None = None,
    precision: jax.lax.Precision | None = None,
) -> jax.Array:
    """Softmax attention ``softmax(scale · q kᵀ + bias, mask) · v`` by the Pallas flash-attention kernels.

    The bias is ``head_bias``'s function on each tile's query and key positions (no ``[T, S]`` array
    is built, forward or backward); its parameters get gradients. A query with no visible key gets
    a zero output. Keys padded away by ``key_mask`` are zeroed first; a key hidden from some queries
    only (causal, segments) must hold finite values (its weight there is zero, and ``0 · NaN`` is NaN).

    Args:
      query: ``[B, T, N, H]``; key, value: ``[B, S, K, H]`` with N a multiple of K.
      query_positions, key_positions: int32 ``[T]``/``[B, T]``, ``[S]``/``[B, S]``.
      head_bias: the per-head form of the bias (:func:`joined_head_bias` joins several), or None.
      causal: mask keys whose position is after the query's.
      scale: score scale (default ``1/√H``).
      query_segment_ids, key_segment_ids: int ``[B, T]``/``[B, S]``: attend within a segment only.
      key_mask: bool ``[B, S]``, True for real keys.
      block_q, block_k: tile sizes, powers of two >= 16 (default 128; smaller for short sequences).
      interpret: Pallas' interpret mode; None: on the CPU only
        (:func:`~posenc_jax.functional.kernels.pallas.backend.interpret_mode`).
      precision: the matrix products' precision (None: the backend's default, which on a recent NVIDIA
        GPU multiplies float32 in TF32, as the materialising path's einsums do there).

    Returns:
      ``[B, T, N, H]`` in query's dtype.
    """
    batch, q_len, num_heads, head_dim = query.shape
    k_len, kv_heads = key.shape[1], key.shape[2]
    block_q, block_k = _block(block_q, q_len), _block(block_k, k_len)
    q_pad, k_pad = -(-q_len // block_q) * block_q, -(-k_len // block_k) * block_k
    valid = None if key_mask is None else jnp.asarray(key_mask, jnp.int32)
    if key_mask is not None:  # padding keys reach no query: zeroed, whatever they hold
        seen = jnp.asarray(key_mask, bool)[:, :, None, None]
        key, value = jnp.where(seen, key, jnp.zeros((), key.dtype)), jnp.where(seen, value, jnp.zeros((), value.dtype))
    if k_pad != k_len:
        valid = jnp.ones((1, k_len), jnp.int32) if valid is None else valid
        valid = _pad(valid, k_pad, 1)
    segments = query_segment_ids is not None
    operands = Operands(
        q=_pad(jnp.swapaxes(query, 1, 2), q_pad, 2),
        k=_pad(jnp.swapaxes(key, 1, 2), k_pad, 2),
        v=_pad(jnp.swapaxes(value, 1, 2), k_pad, 2),
        query_positions=_per_token(query_positions, q_pad, key_side=False),
        key_positions=_per_token(key_positions, k_pad, key_side=True),
        query_segments=_per_token(query_segment_ids, q_pad, key_side=False) if segments else None,
        key_segments=_per_token(key_segment_ids, k_pad, key_side=True) if segments else None,
        key_valid=None if valid is None else valid[:, None, :],
        parameters=() if head_bias is None else tuple(_parameter_rows(p) for p in head_bias.parameters),
    )
    layout = Layout(
        block_q=block_q,
        block_k=block_k,
        q_len=q_pad,
        k_len=k_pad,
        groups=num_heads // kv_heads,
        causal=bool(causal),
        scale=float(1.0 / math.sqrt(head_dim) if scale is None else scale),
        segments=segments,
        key_valid=valid is not None,
        function=None if head_bias is None else head_bias.function,
        num_parameters=len(operands.parameters),
        batched_positions=(operands.query_positions.shape[0] > 1, operands.key_positions.shape[0] > 1),
        batched_segments=(
            segments and operands.query_segments.shape[0] > 1,
            segments and operands.key_segments.shape[0] > 1,
        ),
        batched_valid=valid is not None and valid.shape[0] > 1,
        interpret=interpret_mode(interpret),
        precision=None if precision is None else jax.lax.Precision(precision),
    )
    out = _flash(layout, operands)
    return jnp.swapaxes(out[:, :, :q_len], 1, 2)
