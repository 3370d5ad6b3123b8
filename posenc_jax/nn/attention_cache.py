"""How :class:`~posenc_jax.nn.MultiHeadAttention` makes and checks its caches.

Two ways to decode, as in Flax and beyond it: an explicit :class:`KVCache` that a call takes
and returns (``new_cache``, then ``cache=``), which a compiled step threads through; or the
layer's own cache in an ``nnx.Cache`` variable (``init_cache``, then ``decode=True``), as
``flax.nnx.MultiHeadAttention`` decodes. Both hold the same :class:`KVCache`, with the
:class:`~posenc_jax.functional.core.cache.CacheRecord` of the layer it was made for.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posenc_jax.functional.core.cache import CacheRecord, KVCache, check_cache_dtype, show_encodings
from posenc_jax.functional.core.forms import forms_of
from posenc_jax.functional.core.validation import check_count

__all__ = ["CachedDecoding"]


class CachedDecoding:
    """The cache methods of :class:`~posenc_jax.nn.MultiHeadAttention` (a mixin: the layer supplies
    ``num_heads``, ``num_kv_heads``, ``head_dim``, ``encodings`` and ``_cache_terms()``)."""

    def _check_decoding(self, cache, kv, batch_shape, query_positions, key_positions, decode: bool) -> None:
        """A call with a cache: self-attention of this layer's cache, one batch axis for an explicit one."""
        if kv is not None:
            raise ValueError("a cache holds this layer's own tokens: decoding takes no inputs_k/inputs_v")
        if key_positions is not None:
            raise ValueError("with a cache the keys' positions are the cache's: pass no key_positions")
        if decode and query_positions is not None:
            raise ValueError(
                "decode=True places new tokens at the cache's next slots; to choose their positions, decode with "
                "an explicit cache (new_cache(batch, max_length)) and query_positions="
            )
        if not decode and len(batch_shape) != 1:
            raise ValueError(f"an explicit cache decodes inputs [B, T, D] (one batch axis), got batch {batch_shape}")
        made_for = getattr(cache, "made_for", None)
        if made_for is not None and made_for.model is not None:
            # A model's layer attends with the model's shared biases and prepared rotations as well as its own.
            raise ValueError(
                f"this cache was made by a Transformer for its layer {made_for.layer} (encodings "
                f"{show_encodings(made_for.model)}), not for this layer alone: decode with that model's decode, or "
                f"make the cache with this layer's new_cache(batch, max_length)"
            )
        if isinstance(cache, KVCache) and cache.key.shape[0] != math.prod(batch_shape):
            fix = "init_cache((batch..., max_length, features))" if decode else "new_cache(batch, max_length)"
            raise ValueError(
                f"the cache holds batch {cache.key.shape[0]} but the inputs have batch axes {batch_shape}; make it "
                f"with {fix} for these inputs"
            )

    def _cache_record(self, max_length: int, dtype) -> CacheRecord:
        """What a cache of this layer is made for (:class:`CacheRecord`): its encodings and heads."""
        return CacheRecord(
            encodings=tuple(repr(module.config) for module in self.encodings),
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=np.dtype(dtype).name,
            max_length=max_length,
        )

    def check_cache(self, cache, what: str = "this cache", fix: str = "") -> None:
        """Refuses a cache made for another layer (encodings, heads, head size) or of integer keys, naming
        what differs (static facts: before tracing, nothing inside ``jit``)."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache made by new_cache(batch, max_length), got {type(cache).__name__}")
        fix = fix or "make the cache with this layer's new_cache(batch, max_length)"
        self._cache_record(cache.key.shape[1], cache.key.dtype).check(cache, what, fix)

    def new_cache(self, batch: int, max_length: int, dtype=jnp.float32) -> KVCache:
        """An empty explicit :class:`KVCache` of ``max_length`` slots for this layer, passed to a call as ``cache=``.

        It has room for the encodings' per-key terms (DeBERTa's key projections, Transformer-XL's
        ``u·k``) and tables (Transformer-XL's projected relative sinusoids, computed by the first
        call that writes the cache). ``dtype``: the cached keys' and values' dtype, a floating
        one (``jnp.bfloat16`` halves the cache); an integer or boolean dtype is refused. The cache
        records what it is made for (this layer's encodings, heads and head size:
        :class:`~posenc_jax.functional.core.cache.CacheRecord`), and a layer given a cache made for
        another refuses it, naming what differs.

        Example:
          >>> from posenc_jax.nn import MultiHeadAttention
          >>> mha = MultiHeadAttention(2, 16, encodings=["rope"], rngs=nnx.Rngs(0))
          >>> cache = mha.new_cache(1, 8)
          >>> out, cache = mha(jnp.ones((1, 3, 16)), cache=cache)  # positions 0, 1, 2
          >>> out, cache = mha(jnp.ones((1, 1, 16)), cache=cache)  # position 3
          >>> int(cache.length)
          4
        """
        check_count("batch", batch)
        check_count("max_length", max_length, fix="the number of tokens the cache holds: prompt and new tokens")
        dtype = check_cache_dtype(dtype)
        terms = self._cache_terms()
        key = jax.ShapeDtypeStruct((batch, 1, self.num_kv_heads, self.head_dim), dtype)
        positions = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
        features = tuple(jax.eval_shape(hook.key_features, key, positions) for hook in terms)
        tables = tuple(
            jax.eval_shape(functools.partial(hook.cache_table, max_length))
            if forms_of(hook).has("cached", "table")
            else None
            for hook in terms
        )
        return KVCache.empty(
            batch,
            max_length,
            self.num_kv_heads,
            self.head_dim,
            dtype,
            features=features,
            tables=tables,
            made_for=self._cache_record(max_length, dtype),
        )

    def init_cache(self, input_shape: Sequence[int], dtype=jnp.float32) -> None:
        """Makes the layer's own cache for ``decode=True``, as ``flax.nnx.MultiHeadAttention.init_cache``.

        ``input_shape``: ``(batch..., max_length, features)``, the shape of the whole sequence
        the cache holds. The cache is a :class:`KVCache` (the one :meth:`new_cache` makes, its
        batch axes flattened) in an ``nnx.Cache`` variable; each ``decode=True`` call appends its
        tokens at the next positions and attends causally over the cache.

        Example:
          >>> from posenc_jax.nn import MultiHeadAttention
          >>> mha = MultiHeadAttention(2, 16, encodings=["rope"], decode=True, rngs=nnx.Rngs(0))
          >>> mha.init_cache((1, 8, 16))
          >>> mha(jnp.ones((1, 1, 16))).shape
          (1, 1, 16)
        """
        if isinstance(input_shape, (int, np.integer)):
            raise TypeError(
                f"init_cache takes the input shape (batch..., max_length, features), as flax's, got {input_shape!r}; "
                f"an explicit KVCache for cache= is new_cache(batch, max_length, dtype)"
            )
        shape = tuple(input_shape)
        if len(shape) < 2:
            raise ValueError(f"input_shape must be (batch..., max_length, features), got {shape}")
        cache = self.new_cache(math.prod(shape[:-2]), shape[-2], dtype)
        self.kv_cache = nnx.Cache(cache)
