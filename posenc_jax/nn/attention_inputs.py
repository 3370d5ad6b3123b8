"""What :class:`~posenc_jax.nn.MultiHeadAttention` receives, as ``flax.nnx.MultiHeadAttention`` reads it.

Inputs are ``[batch..., length, features]`` with any number of batch axes (none included);
the attention runs on them flattened to one batch axis and gives its output back in their
shape. Masks are Flax's: booleans broadcastable to ``[batch..., heads, T, S]``, True where a
query attends to a key. Arguments of the layer's earlier signature (``model_dim``,
``head_dim``, positions as the second argument) are refused with their new names.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posenc_jax.functional.core.positions import check_positions

# Names the layer took before it took flax.nnx.MultiHeadAttention's, and what to pass instead.
_RENAMED_INIT = {
    "model_dim": "the input width is in_features, second: MultiHeadAttention(num_heads, in_features, ...)",
    "head_dim": "pass qkv_features=num_heads*head_dim (the head size is qkv_features // num_heads)",
}
_RENAMED_CALL = {
    "positions": "pass query_positions= (and key_positions= for cross-attention), or nothing for arange",
    "x": "the input is inputs_q, the first argument",
    "is_causal": "pass causal=True (keys after each query's position are masked: flax's is_causal at the "
    "default positions)",
}


def refuse_renamed(renamed: dict, what: str, num_heads: int | None = None) -> None:
    """A one-line ``TypeError`` for a keyword the layer does not take, naming the new one where it was renamed."""
    table = _RENAMED_INIT if what == "MultiHeadAttention" else _RENAMED_CALL
    for name, value in renamed.items():
        if name not in table:
            raise TypeError(f"{what} got an unexpected keyword argument {name!r}")
        hint = table[name]
        if name == "head_dim" and isinstance(value, int) and isinstance(num_heads, int):
            hint += f": qkv_features={num_heads * value} here"
        raise TypeError(f"{what} takes no {name}= (its signature is flax.nnx.MultiHeadAttention's): {hint}")


def refuse_integer_inputs(inputs_k) -> None:
    """The old call ``mha(x, positions, causal=True)`` passes integer positions where ``inputs_k`` now goes."""
    dtype = getattr(inputs_k, "dtype", None)
    if dtype is None:
        dtype = np.asarray(inputs_k).dtype
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(
            f"the second argument is inputs_k (the keys' inputs, as in flax.nnx.MultiHeadAttention), got an array of "
            f"{np.dtype(dtype).name}: pass positions as query_positions= / key_positions=, or nothing for arange"
        )


def check_sizes(num_heads: int, in_features: int, qkv_features: int, num_kv_heads: int) -> None:
    """``qkv_features`` splits into ``num_heads`` heads, and the query heads into key/value groups."""
    if qkv_features % num_heads:
        hint = "pass qkv_features= a multiple of num_heads"
        if num_heads > in_features:
            hint += (
                f"; the order is (num_heads, in_features), as flax.nnx.MultiHeadAttention's: for {in_features} heads "
                f"over {num_heads} features call MultiHeadAttention({in_features}, {num_heads}, ...)"
            )
        raise ValueError(f"qkv_features={qkv_features} is not divisible by num_heads={num_heads}; {hint}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")


def dropout_key(rngs) -> jax.Array:
    """A dropout key from an ``nnx.Rngs`` (its ``dropout`` stream) or a stream; None has none to give."""
    if rngs is None:
        raise ValueError("dropout needs random keys: pass rngs= to the call (an nnx.Rngs with a dropout stream)")
    return rngs.dropout() if isinstance(rngs, nnx.Rngs) else rngs()


def flat_inputs(x, name: str, width: int, setting: str) -> tuple[jax.Array, tuple[int, ...]]:
    """``x`` ``[batch..., length, width]`` as ``[B, length, width]`` (B the batch axes' product) and its batch shape."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 2 or shape[-1] != width:
        raise ValueError(
            f"{name} must have shape [batch..., length, features] with features = {setting} = {width}, got shape "
            f"{shape if shape is not None else type(x).__name__}"
        )
    return jnp.reshape(x, (-1, *shape[-2:])), tuple(shape[:-2])


def flat_keys(inputs_k, inputs_v, batch_shape: tuple, width: int) -> tuple[jax.Array, jax.Array]:
    """Cross-attention's ``inputs_k`` and ``inputs_v`` (default ``inputs_k``) as ``[B, S, width]`` each."""
    refuse_integer_inputs(inputs_k)
    inputs_v = inputs_k if inputs_v is None else inputs_v
    k, k_batch = flat_inputs(inputs_k, "inputs_k", width, "in_kv_features")
    v, v_batch = flat_inputs(inputs_v, "inputs_v", width, "in_kv_features")
    if k_batch != batch_shape or v_batch != batch_shape or v.shape[1] != k.shape[1]:
        raise ValueError(
            f"inputs_k and inputs_v must be [batch..., S, features] with inputs_q's batch axes {batch_shape} and one "
            f"length S, got shapes {inputs_k.shape} and {inputs_v.shape}"
        )
    return k, v


def flat_positions(positions, name: str, batch_shape: tuple, length: int) -> jax.Array:
    """Integer positions ``[length]`` or ``[batch..., length]`` (the one check) as ``[length]`` or ``[B, length]``."""
    positions = check_positions(positions)
    if positions.shape[-1:] != (length,) or (
        positions.ndim > 1 and positions.shape[:-1] != batch_shape and positions.shape[:-1] != (1,) * len(batch_shape)
    ):
        raise ValueError(
            f"{name} must be [length] or [batch..., length] = {[*batch_shape, length]}, got shape {positions.shape}"
        )
    return positions if positions.ndim == 1 else jnp.broadcast_to(positions, (*batch_shape, length)).reshape(-1, length)


def flat_per_token(array, name: str, batch_shape: tuple, length: int):
    """A per-token array (``key_mask``, ``segment_ids``) ``[batch..., length]`` as ``[B, length]`` (None stays None)."""
    if array is None:
        return None
    array = jnp.asarray(array)
    if array.shape[-1:] != (length,) or array.ndim != len(batch_shape) + 1:
        raise ValueError(f"{name} must be [batch..., length] = {[*batch_shape, length]}, got shape {array.shape}")
    return jnp.broadcast_to(array, (*batch_shape, length)).reshape(-1, length)


def flat_mask(mask, batch_shape: tuple, num_heads: int, query_length: int, key_length: int):
    """Flax's ``mask`` (broadcastable to ``[batch..., heads, T, S]``, True = attend) as bool ``[B, heads|1, T, S]``."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    heads = mask.shape[-3] if mask.ndim >= 3 else 1
    full = (*batch_shape, heads, query_length, key_length)
    if heads not in (1, num_heads) or mask.ndim > len(full):
        raise ValueError(
            f"mask must broadcast to [batch..., heads, T, S] = {[*batch_shape, num_heads, query_length, key_length]} "
            f"(heads 1 or {num_heads}), got shape {mask.shape}"
        )
    try:
        mask = jnp.broadcast_to(mask, full)
    except ValueError:
        raise ValueError(
            f"mask must broadcast to [batch..., heads, T, S] = {[*batch_shape, num_heads, query_length, key_length]}, "
            f"got shape {mask.shape}"
        ) from None
    return mask.astype(jnp.bool_).reshape(math.prod(batch_shape), heads, query_length, key_length)


def check_mesh(mesh, cache, implementation: str, ring: bool = False) -> None:
    """A sequence-parallel call's static facts: a mesh, no cache, an implementation that tiles."""
    if not isinstance(ring, (bool, np.bool_)):
        raise TypeError(f"ring must be True or False, got {ring!r}")
    if mesh is None:
        if ring:
            raise ValueError("ring=True passes the keys round the devices of a mesh: pass mesh= too")
        return
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (or None), got {type(mesh).__name__}")
    if cache is not None:
        raise ValueError("mesh= splits one forward pass's queries over devices; decoding with a cache takes no mesh")
    if implementation in ("materialize", "pallas"):
        raise ValueError(
            f"mesh= computes each device's queries in tiles (blockwise); implementation={implementation!r} is not "
            'split over a mesh: pass implementation="blockwise" or "auto"'
        )
