"""A key/value cache for decoding: a pytree of arrays, positions and slot validity included.

Pure: ``append`` returns a new cache. Keys are stored as projected, before any
``rotate`` hook, so an encoding that rotates by the current sequence length
(dynamic NTK, LongRoPE) rotates the whole cache at every step and decodes each
token exactly as the full forward pass of its prefix does.

Which slots hold a real token is tracked explicitly (``valid``), and the attention
takes it as a key mask: an empty slot, or a padding token appended with
``valid=False`` (left padding), is never attended to, at any position. (Marking empty
slots with a far-future position instead would fail for queries at or beyond it.)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["KVCache"]


class KVCache(NamedTuple):
    """Keys and values decoded so far: ``key``/``value`` ``[B, L, K, H]``, ``positions`` ``[B, L]``,
    ``valid`` ``[B, L]`` (True where a slot holds a real token: the key mask of the cache),
    ``length`` (int32 scalar): the slots ``0..length-1`` are filled. Empty slots hold
    position 0 and are not valid.

    Example:
      >>> cache = KVCache.empty(batch=1, max_length=4, num_kv_heads=2, head_dim=8)
      >>> cache = cache.append(jnp.ones((1, 3, 2, 8)), jnp.ones((1, 3, 2, 8)), jnp.arange(3)[None])
      >>> int(cache.length), cache.positions.tolist(), cache.valid.tolist()
      (3, [[0, 1, 2, 0]], [[True, True, True, False]])
    """

    key: jax.Array
    value: jax.Array
    positions: jax.Array
    valid: jax.Array
    length: jax.Array

    @classmethod
    def empty(cls, batch: int, max_length: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, max_length, num_kv_heads, head_dim)
        return cls(
            jnp.zeros(shape, dtype),
            jnp.zeros(shape, dtype),
            jnp.zeros((batch, max_length), jnp.int32),
            jnp.zeros((batch, max_length), jnp.bool_),
            jnp.zeros((), jnp.int32),
        )

    def append(self, key: jax.Array, value: jax.Array, positions: jax.Array, valid=None) -> KVCache:
        """Writes ``[B, T, K, H]`` keys/values at positions ``[B, T]`` into the next T slots.

        ``valid`` (boolean ``[B, T]``, default all True) marks real tokens; a slot written
        with False (padding) is masked like an empty one.

        Overflowing the cache is an error (raised at once for a concrete length, or when
        the computation runs under jit), never a silent overwrite.
        """
        capacity, new = self.key.shape[1], key.shape[1]
        if valid is None:
            valid = jnp.ones(key.shape[:2], jnp.bool_)
        elif jnp.asarray(valid).dtype != jnp.bool_:
            raise ValueError(
                f"valid must be boolean [B, T] (True for real tokens), got dtype {jnp.asarray(valid).dtype}"
            )
        valid = jnp.broadcast_to(jnp.asarray(valid), key.shape[:2])

        def check(length):
            if int(length) + new > capacity:
                raise ValueError(
                    f"the KV cache holds {capacity} tokens; {int(length)} are filled and {new} more do not fit: "
                    f"make it larger with init_cache(batch, max_length)"
                )

        try:
            check(np.asarray(self.length))
        except jax.errors.TracerArrayConversionError:
            jax.debug.callback(check, self.length)

        def update(buffer, new):
            return jax.lax.dynamic_update_slice_in_dim(buffer, new.astype(buffer.dtype), self.length, axis=1)

        return KVCache(
            update(self.key, key),
            update(self.value, value),
            update(self.positions, positions),
            update(self.valid, valid),
            self.length + new,
        )
