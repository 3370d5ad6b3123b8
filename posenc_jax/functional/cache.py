"""A key/value cache for decoding: a pytree of arrays, positions included.

Pure: ``append`` returns a new cache. Keys are stored as projected, before any
``rotate`` hook, so an encoding that rotates by the current sequence length
(dynamic NTK, LongRoPE) rotates the whole cache at every step and decodes each
token exactly as the full forward pass of its prefix does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["EMPTY_POSITION", "KVCache"]

# Empty cache slots sit at this position: after every real query, so the causal
# mask (and every encoding's notion of "future") hides them.
EMPTY_POSITION = 2**30


class KVCache(NamedTuple):
    """Keys and values decoded so far: ``key``/``value`` ``[B, L, K, H]``, ``positions`` ``[B, L]``,
    ``length`` (int32 scalar): the slots ``0..length-1`` are filled.

    Example:
      >>> cache = KVCache.empty(batch=1, max_length=4, num_kv_heads=2, head_dim=8)
      >>> cache = cache.append(jnp.ones((1, 3, 2, 8)), jnp.ones((1, 3, 2, 8)), jnp.arange(3)[None])
      >>> int(cache.length), cache.positions.tolist()
      (3, [[0, 1, 2, 1073741824]])
    """

    key: jax.Array
    value: jax.Array
    positions: jax.Array
    length: jax.Array

    @classmethod
    def empty(cls, batch: int, max_length: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, max_length, num_kv_heads, head_dim)
        return cls(
            jnp.zeros(shape, dtype),
            jnp.zeros(shape, dtype),
            jnp.full((batch, max_length), EMPTY_POSITION, jnp.int32),
            jnp.zeros((), jnp.int32),
        )

    def append(self, key: jax.Array, value: jax.Array, positions: jax.Array) -> KVCache:
        """Writes ``[B, T, K, H]`` keys/values at positions ``[B, T]`` into the next T slots.

        Overflowing the cache is an error (raised at once for a concrete length, or when
        the computation runs under jit), never a silent overwrite.
        """
        capacity, new = self.key.shape[1], key.shape[1]

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
            update(self.key, key), update(self.value, value), update(self.positions, positions), self.length + new
        )
