"""A key/value cache for decoding: a pytree of arrays, positions and slot validity included.

Pure: ``append`` returns a new cache. What a decoding step would otherwise recompute
for every cached key is stored once, when the key arrives:

* keys after rotation, when every ``rotate`` hook of the layer rotates a key by its own
  position alone (RoPE and its fixed scalings, axial RoPE: ``rotates_per_token``) or by
  its own position and a fixed reference (xPos, scaled about the first cached token's
  position instead of the queries' centre, which cancels in every score); otherwise
  (dynamic NTK and LongRoPE follow the current length) keys are stored as projected and
  rotated again at every step, so each token decodes exactly as the full forward pass of
  its prefix does;
* per-key terms of the layer's encodings (``features``): DeBERTa's position-to-content
  projections of each key, Transformer-XL's content-bias term of each key (see
  :class:`CachedKeyTerm`);
* tables of the layer's encodings that depend on no key (``tables``), computed by the
  first write that supplies them (the layer's attention always does) and kept after:
  Transformer-XL's relative sinusoids projected once for every distance the cache can
  hold (see :class:`CachedTable`), so a step scores its query against them instead of
  recomputing a sinusoid per key. Like the stored keys, a table holds the parameters of
  the call that wrote it: a gradient taken through a decoding step with the cache held
  fixed does not reach them.

Which slots hold a real token is tracked explicitly (``valid``), and the attention
takes it as a key mask: an empty slot, or a padding token appended with
``valid=False`` (left padding), is never attended to, at any position. (Marking empty
slots with a far-future position instead would fail for queries at or beyond it.)

A cache carries what it was made for (``made_for``, a :class:`CacheRecord`: the layer's
encodings and heads, and the model's encodings and layer when a model made it), a static
part of the pytree, so a layer or model given a cache made for another one refuses it
before tracing (:meth:`CacheRecord.check`), at no cost inside ``jit``: the keys of a RoPE
layer read by a layer without RoPE would otherwise give wrong outputs without a word.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.forms import FormInterface
from posenc_jax.functional.core.positions import check_positions
from posenc_jax.functional.core.validation import check_count, check_values

__all__ = ["CacheRecord", "CachedKeyTerm", "CachedTable", "KVCache", "check_cache_dtype", "show_encodings"]


class CachedKeyTerm(metaclass=FormInterface):
    """A ``logits`` hook with a per-key part that a KV cache can store.

    ``key_features(k, key_positions)`` gives, for keys ``[B, S, K, H]`` at positions
    ``[B, S]``, a pytree of float arrays ``[B, S, ...]`` (or None when there is nothing to
    store) that depends on each key and its position alone; ``with_key_features(features)``
    is the same hook reading those arrays for all S keys of an attention call instead of
    recomputing them from the keys. The two must give the same logits.
    """

    _form: ClassVar[str] = "cached.key_term"

    def key_features(self, k: jax.Array, key_positions: jax.Array): ...

    def with_key_features(self, features): ...


class CachedTable(metaclass=FormInterface):
    """A :class:`CachedKeyTerm` with a part that depends on no key, which a KV cache computes once.

    ``cache_table(capacity)`` gives a pytree of arrays for a cache of ``capacity`` slots,
    from the hook's parameters alone (e.g. a projection for every distance the cache can
    hold); a cache computes it once, at the first write that supplies it (with the
    parameters of that call, as it stores the keys of that call), and keeps it.
    ``with_cache_table(table)`` is the same hook reading it. With and without the table the
    hook must give the same logits (for the parameters the table was computed with).
    """

    _form: ClassVar[str] = "cached.table"

    def cache_table(self, capacity: int): ...

    def with_cache_table(self, table): ...


def check_cache_dtype(dtype):
    """``dtype`` as a NumPy dtype, or an error naming it: a cache stores keys and values, which are
    floating point (``float32``, ``bfloat16``, ``float16``); an integer or boolean cache would round
    them to whole numbers and decode wrong logits without a word."""
    try:
        resolved = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise TypeError(
            f"dtype must be a floating dtype for the cached keys and values, got {dtype!r}; pass jnp.float32 "
            f"(or jnp.bfloat16 to halve the cache)"
        ) from None
    if not jnp.issubdtype(resolved, jnp.floating):
        raise ValueError(
            f"dtype must be a floating dtype for the cached keys and values, got {resolved.name}: the keys and "
            f"values would be rounded to {resolved.name} and decode wrong logits; pass jnp.float32 (or jnp.bfloat16 "
            f"to halve the cache)"
        )
    return resolved


def show_encodings(encodings) -> str:
    """Encodings (configs' reprs) as a message shows them: ``[RoPE(...), ALiBi(...)]``."""
    return f"[{', '.join(encodings)}]"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class CacheRecord:
    """What a :class:`KVCache` was made for: a static part of its pytree (no arrays), compared before tracing.

    Attributes:
      encodings: the layer's own encodings, as their configs' reprs (``("RoPE(...)",)``; ``()``: none).
      num_heads, num_kv_heads, head_dim: the layer's query heads, key/value heads and head size.
      dtype: the cached keys' and values' dtype, by name.
      max_length: the slots the cache was made with.
      model: the encodings of the :class:`~posenc_jax.nn.Transformer` that made it (all of them,
        those outside the attention included), or None when a layer made it.
      layer: the model's layer it was made for (None when a layer made it).

    Example:
      >>> record = CacheRecord(("RoPE(theta=10000.0)",), 4, 2, 8, "float32", 16)
      >>> record.differences(CacheRecord((), 4, 2, 8, "float32", 16))
      ['encodings [RoPE(theta=10000.0)] there, [] here']
    """

    encodings: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_length: int
    model: tuple[str, ...] | None = None
    layer: int | None = None

    def differences(self, here: CacheRecord, fields=("encodings", "num_heads", "num_kv_heads", "head_dim")) -> list:
        """``field <this record's> there, <here's> here`` for each of ``fields`` that differs."""
        show = lambda value: show_encodings(value) if isinstance(value, tuple) else value
        return [
            f"{name} {show(getattr(self, name))} there, {show(getattr(here, name))} here"
            for name in fields
            if getattr(self, name) != getattr(here, name)
        ]

    def check(self, cache: KVCache, what: str, fix: str) -> None:
        """Refuses ``cache`` (one line naming what differs, then ``fix``) when it was made for another layer
        than the one this record describes, or when its arrays are not those it was made with.

        ``what`` names the cache in the message (``"this cache"``, ``"caches[1]"``). A cache made by
        :meth:`KVCache.empty` without a record carries none: only its arrays are checked then (a
        floating dtype; the shapes are the caller's to check).
        """
        check_cache_arrays(cache, what, fix)
        if cache.made_for is None:
            return
        differences = cache.made_for.differences(self)
        if differences:
            raise ValueError(f"{what} was made for another layer: {'; '.join(differences)}; {fix}")


def check_cache_arrays(cache: KVCache, what: str, fix: str) -> None:
    """A cache's keys and values are floating point, and have the dtype and slots its record says (static facts)."""
    dtype = np.dtype(cache.key.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or cache.value.dtype != cache.key.dtype:
        raise ValueError(
            f"{what} holds keys of dtype {dtype.name} and values of dtype {np.dtype(cache.value.dtype).name}: a "
            f"cache's keys and values are of one floating dtype (rounded to whole numbers they would decode wrong "
            f"logits); {fix}"
        )
    record = cache.made_for
    if record is None:
        return
    if record.dtype != dtype.name or record.max_length != cache.key.shape[1]:
        raise ValueError(
            f"{what} was made with {record.max_length} slots of {record.dtype} but holds {cache.key.shape[1]} of "
            f"{dtype.name}: its arrays were changed after init_cache made it; {fix}"
        )


# How a cache too small for a call is made larger, by whoever made it (a model, or a layer either way).
_MAKE_LARGER = (
    "(a model's init_cache(batch, max_length), a layer's new_cache(batch, max_length) or "
    "init_cache((batch, max_length, features)))"
)


class KVCache(NamedTuple):
    """Keys and values decoded so far: ``key``/``value`` ``[B, L, K, H]``, ``positions`` ``[B, L]``,
    ``valid`` ``[B, L]`` (True where a slot holds a real token: the key mask of the cache),
    ``length`` (int32 scalar): the slots ``0..length-1`` are filled. Empty slots hold
    position 0 and are not valid. ``features``: a tuple of pytrees of ``[B, L, ...]`` arrays,
    the per-key terms of the layer's encodings (:class:`CachedKeyTerm`), zero where a slot
    is empty or padding. ``tables``: one entry per entry of ``features``, the hook's
    :class:`CachedTable` pytree (None for a hook without one), computed by the first
    :meth:`append` that supplies them and unchanged after; ``tables_ready`` (boolean
    scalar): whether they have been computed (until then they hold zeros). ``made_for``: the
    :class:`CacheRecord` of the layer (and model) the cache was made for, a static part of the
    pytree (``init_cache`` writes it; None for a cache made by hand with :meth:`empty`).

    Example:
      >>> cache = KVCache.empty(batch=1, max_length=4, num_kv_heads=2, head_dim=8)
      >>> cache = cache.append(jnp.ones((1, 3, 2, 8)), jnp.ones((1, 3, 2, 8)), jnp.arange(3)[None])
      >>> int(cache.length), cache.positions.tolist(), cache.valid.tolist()
      (3, [[0, 1, 2, 0]], [[True, True, True, False]])

      Decoding in one's own layer: rotate the new tokens' q and k, append k and v, attend over
      the cache with its positions and its ``valid`` slots as the key mask. (RoPE rotates each
      key by its own position, so keys are stored rotated; a length-dependent scaling would
      store them unrotated and pass ``encodings=[rope]`` to the attention instead.)

      >>> from posenc_jax.functional import RoPE, dot_product_attention
      >>> rope = RoPE()
      >>> @jax.jit
      ... def attend(q, k, v, positions, cache):  # q, k, v [B, T, N, H] of the new tokens, positions [B, T]
      ...     q, k = rope.rotate(q, k, positions)
      ...     cache = cache.append(k, v, positions)
      ...     out = dot_product_attention(q, cache.key, cache.value, query_positions=positions,
      ...                                 key_positions=cache.positions, key_mask=cache.valid, causal=True)
      ...     return out, cache
      >>> x = jax.random.normal(jax.random.key(0), (1, 5, 2, 16))
      >>> cache = KVCache.empty(batch=1, max_length=8, num_kv_heads=2, head_dim=16)
      >>> _, cache = attend(x[:, :4], x[:, :4], x[:, :4], jnp.arange(4)[None], cache)  # the prompt
      >>> step, cache = attend(x[:, 4:], x[:, 4:], x[:, 4:], jnp.arange(4, 5)[None], cache)  # one new token
      >>> pos = jnp.arange(5)
      >>> full = dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, encodings=[rope], causal=True)
      >>> bool(jnp.allclose(step[:, 0], full[:, 4], atol=1e-5)), int(cache.length)
      (True, 5)
    """

    key: jax.Array
    value: jax.Array
    positions: jax.Array
    valid: jax.Array
    length: jax.Array
    features: tuple = ()
    tables: tuple = ()
    tables_ready: jax.Array | bool = False
    made_for: CacheRecord | None = None

    @classmethod
    def empty(
        cls,
        batch: int,
        max_length: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.float32,
        features=(),
        tables=(),
        made_for: CacheRecord | None = None,
    ) -> KVCache:
        """An empty cache of ``max_length`` slots.

        ``dtype``: the keys' and values' dtype, a floating one (an integer or boolean dtype is
        refused: it would round them). ``features``: a tuple of pytrees of
        ``jax.ShapeDtypeStruct`` ``[B, 1, ...]`` (the per-key terms of one key, e.g. from
        ``jax.eval_shape``), each stored ``[B, L, ...]``. ``tables``: empty, or one pytree of
        ``jax.ShapeDtypeStruct`` (or None) per entry of ``features``, the shapes of the
        :class:`CachedTable` parts (zeros until the first write). ``made_for``: the layer's
        :class:`CacheRecord` (a layer's ``init_cache`` gives it; by hand, None).
        """
        check_count("batch", batch)
        check_count("max_length", max_length, fix="the number of tokens the cache holds: prompt and new tokens")
        check_count("num_kv_heads", num_kv_heads)
        check_count("head_dim", head_dim)
        dtype = check_cache_dtype(dtype)
        if made_for is not None:
            if not isinstance(made_for, CacheRecord):
                raise TypeError(f"made_for must be a CacheRecord (or None), got {type(made_for).__name__}")
            made = (made_for.num_kv_heads, made_for.head_dim, made_for.dtype, made_for.max_length)
            if made != (num_kv_heads, head_dim, dtype.name, max_length):
                raise ValueError(
                    f"made_for records {made_for.num_kv_heads} key/value heads of {made_for.head_dim}, "
                    f"{made_for.max_length} slots of {made_for.dtype}, but the cache has {num_kv_heads} of {head_dim}, "
                    f"{max_length} of {dtype.name}; give the record of the cache made here"
                )
        if tables and len(tables) != len(features):
            raise ValueError(
                f"tables needs one entry per entry of features ({len(features)}), got {len(tables)}; pass None "
                f"for a term without a table"
            )
        shape = (batch, max_length, num_kv_heads, head_dim)
        stored = tuple(
            jax.tree.map(lambda s: jnp.zeros((batch, max_length) + tuple(s.shape[2:]), s.dtype), spec)
            for spec in features
        )
        return cls(
            jnp.zeros(shape, dtype),
            jnp.zeros(shape, dtype),
            jnp.zeros((batch, max_length), jnp.int32),
            jnp.zeros((batch, max_length), jnp.bool_),
            jnp.zeros((), jnp.int32),
            stored,
            tuple(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec) for spec in tables),
            jnp.zeros((), jnp.bool_),
            made_for,
        )

    def append(
        self, key: jax.Array, value: jax.Array, positions: jax.Array, valid=None, features=(), tables=()
    ) -> KVCache:
        """Writes ``[B, T, K, H]`` keys/values at positions ``[B, T]`` into the next T slots.

        ``valid`` (boolean ``[B, T]``, default all True) marks real tokens; a slot written
        with False (padding) is masked like an empty one. ``features`` (one pytree of
        ``[B, T, ...]`` arrays per entry of the cache's ``features``) are the new keys'
        per-key terms; they are stored as zeros where a token is not valid. ``tables``
        (empty, or one per entry of the cache's ``tables``: a function of no arguments
        giving that table, or None) are computed when the cache has none yet
        (``tables_ready`` False) and kept otherwise; a write without ``tables`` leaves them
        as they are, computed or not.

        Keys and values must be ``[B, T, K, H]`` with the cache's B, K and H, and positions
        integers ``[B, T]`` (or ``[T]``): anything else is refused by name before tracing.
        Overflowing the cache is an error, never a silent overwrite: at once when ``T``
        exceeds the capacity or the cache's length is concrete, else when the computation
        runs under jit (:func:`~posenc_jax.functional.core.validation.check_values`). So is a
        new (valid) token placed at or before a position the row already holds: positions
        only move forward in a cache.
        """
        return self.append_checked(key, value, check_positions(positions), valid, features, tables)

    def append_checked(self, key, value, positions: jax.Array, valid=None, features=(), tables=()) -> KVCache:
        """:meth:`append` of int32 positions already checked (a layer's, checked once where they entered);
        everything else is checked as there."""
        batch, capacity, heads, head_dim = self.key.shape
        for name, array in (("key", key), ("value", value)):
            shape = getattr(array, "shape", None)
            if shape is None or len(shape) != 4 or (shape[0], shape[2], shape[3]) != (batch, heads, head_dim):
                raise ValueError(
                    f"{name} must be [B, T, K, H] = [{batch}, T, {heads}, {head_dim}] for this cache (batch {batch}, "
                    f"{heads} key/value heads of {head_dim}), got shape {shape}; make the cache for this layer and "
                    f"batch with its new_cache(batch, max_length) (a model's: init_cache(batch, max_length))"
                )
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"key and value must have one length T, got {key.shape} and {value.shape}")
        new = key.shape[1]
        if new > capacity:
            raise ValueError(
                f"the KV cache holds {capacity} tokens and {new} are given at once: make it larger "
                f"{_MAKE_LARGER} with max_length >= {new} (prompt and new tokens)"
            )
        if positions.shape[-1] != new or positions.ndim > 2 or (positions.ndim == 2 and positions.shape[0] != batch):
            raise ValueError(f"positions must be [B, T] = [{batch}, {new}] (or [T]), got shape {positions.shape}")
        positions = jnp.broadcast_to(positions, (batch, new))
        if valid is None:
            valid = jnp.ones(key.shape[:2], jnp.bool_)
        elif jnp.asarray(valid).dtype != jnp.bool_:
            raise ValueError(
                f"valid must be boolean [B, T] (True for real tokens), got dtype {jnp.asarray(valid).dtype}"
            )
        valid = jnp.broadcast_to(jnp.asarray(valid), key.shape[:2])

        def check(length, positions):
            if int(length) + new > capacity:
                first, last = int(positions.min()), int(positions.max())
                at = f"position {first}" if first == last else f"positions {first} to {last}"
                raise ValueError(
                    f"the KV cache holds {capacity} tokens; {int(length)} are filled and {new} more (at {at}) do not "
                    f"fit: make it larger {_MAKE_LARGER} with max_length >= {int(length) + new}"
                )

        check_values(check, self.length, within=(0, capacity - new + 1), context=(positions,))

        # Positions say where each token is, and a key is seen by the queries at or after it: a new
        # token placed at or before one already cached would hide it, or be hidden by it, silently.
        unset = jnp.iinfo(jnp.int32).max
        first_new = jnp.min(jnp.where(valid, positions, unset), axis=1)  # [B]
        last_cached = jnp.max(jnp.where(self.valid, self.positions, -1), axis=1)  # [B]

        def check_order(first, last):
            behind = np.flatnonzero(first <= last)
            if behind.size:
                b = int(behind[0])
                raise ValueError(
                    f"decoding positions must come after the cached ones: row {b} of the cache holds positions up "
                    f"to {int(last[b])}, and a new token is at {int(first[b])}; give each new token its place after "
                    f"them (e.g. the cache's length), or start a new cache to decode from an earlier point"
                )

        check_values(check_order, first_new, within=(last_cached + 1, None), context=(last_cached,))

        if len(features) != len(self.features):
            raise ValueError(
                f"this cache stores {len(self.features)} per-key terms but {len(features)} were given; make the "
                f"cache with the layer's new_cache or init_cache (or Transformer.init_cache)"
            )

        if tables and len(tables) != len(self.tables):
            raise ValueError(
                f"this cache stores {len(self.tables)} tables but {len(tables)} were given; make the cache with "
                f"the layer's new_cache or init_cache (or Transformer.init_cache)"
            )
        kept, ready = self.tables, jnp.asarray(self.tables_ready, jnp.bool_)
        if tables:
            kept = tuple(
                old if make is None else jax.lax.cond(ready, lambda old=old: old, make)
                for old, make in zip(self.tables, tables, strict=True)
            )
            ready = jnp.ones((), jnp.bool_)

        def update(buffer, new):
            return jax.lax.dynamic_update_slice_in_dim(buffer, new.astype(buffer.dtype), self.length, axis=1)

        def update_feature(buffer, new):
            keep = valid.reshape(valid.shape + (1,) * (new.ndim - 2))
            return update(buffer, jnp.where(keep, new, jnp.zeros((), new.dtype)))

        return KVCache(
            update(self.key, key),
            update(self.value, value),
            update(self.positions, positions),
            update(self.valid, valid),
            self.length + new,
            tuple(jax.tree.map(update_feature, old, fresh) for old, fresh in zip(self.features, features, strict=True)),
            kept,
            ready,
            self.made_for,
        )
