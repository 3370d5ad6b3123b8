"""Multi-head attention with any positional encoding, as a Flax NNX module.

A thin parameter-holding wrapper: projections ``W_Q``, ``W_K``, ``W_V``, ``W_O``
and the per-layer encodings' parameters; the computation is
:func:`posenc_jax.functional.dot_product_attention`.

Decoding uses an explicit :class:`KVCache` (a pytree of arrays, positions
included), so a step compiles once and runs for any position. The cache holds what
does not change as decoding goes on: keys after rotation when every rotation of the
layer depends on each key's own position alone (RoPE, its fixed scalings, axial RoPE),
and the per-key terms of encodings that have them (:class:`CachedKeyTerm`: DeBERTa,
Transformer-XL), so a step computes them for its new tokens only, and tables that depend
on no key (:class:`CachedTable`: Transformer-XL's projected relative sinusoids), computed
by the first call that writes the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posenc_jax.functional.core.attention import IMPLEMENTATIONS, attend, forward_terms
from posenc_jax.functional.core.cache import CacheRecord, KVCache, check_cache_dtype, show_encodings
from posenc_jax.functional.core.forms import forms_of
from posenc_jax.functional.core.hooks import (
    EncodingConfig,
    Normalize,
    PreparedRotation,
    Rotate,
    attention_context,
    hook_names,
    rotates_each_token,
)
from posenc_jax.functional.core.normalizers import normalizer_config, softmax_weights
from posenc_jax.functional.core.positions import check_positions
from posenc_jax.functional.core.registry import resolve_encodings
from posenc_jax.functional.core.sharded import sequence_parallel_attention
from posenc_jax.functional.core.validation import check_count
from posenc_jax.nn.encoding import PositionEncoding, check_dropout_rate, check_rngs, check_size

__all__ = ["KVCache", "MultiHeadAttention"]


def _stores_rotated_keys(hooks: Sequence) -> bool:
    """Whether a cache may hold keys rotated: every rotate hook rotates by each token's own position alone
    (``rotates_per_token``), or does given a fixed reference position (``rotate_about``, xPos's centre)."""
    return all(
        (rotates_each_token(hook) or forms_of(hook).has("cached", "rotation_about")) and hook_names(hook) == ("rotate",)
        for hook in hooks
        if isinstance(hook, Rotate)
    )


def _cached_terms(hooks: Sequence) -> list:
    """The hooks whose per-key terms a cache stores (only where keys are stored as the hooks see them)."""
    if not _stores_rotated_keys(hooks):
        return []
    return [hook for hook in hooks if forms_of(hook).has("cached", "key_term")]


def _table_maker(hook, capacity: int, stored):
    """How a cache makes ``hook``'s table when it has none yet (None: the cache keeps no table for it)."""
    if stored is None or not forms_of(hook).has("cached", "table"):
        return None
    return functools.partial(hook.cache_table, capacity)


@dataclasses.dataclass(frozen=True)
class _OwnTokens:
    """A model's prepared rotation as the ``rotate`` hook of a layer's self-attention.

    The model prepared it for the layer's tokens, which are the attention's queries and keys, so
    it rotates them by its table whatever the context (no positions compared), where the
    attention applies any rotation.
    """

    table: PreparedRotation

    def rotate(self, q: jax.Array, k: jax.Array, context) -> tuple[jax.Array, jax.Array]:
        return self.table.rotate_prepared(q, k)


def _check_mesh(mesh, cache, implementation: str, ring: bool = False) -> None:
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
    if implementation == "materialize":
        raise ValueError(
            'mesh= computes each device\'s queries in tiles (blockwise); implementation="materialize" cannot be split: '
            'pass implementation="blockwise" or "auto"'
        )


class MultiHeadAttention(nnx.Module):
    """Multi-head (grouped-query) attention composing any encodings.

    Args:
      model_dim: D, the width of the input and output (first, unlike the ``in_features``
        of ``flax.nnx.MultiHeadAttention(num_heads, in_features)``).
      num_heads: N query heads.
      num_kv_heads: K key/value heads (default N); N must be a multiple of K.
      head_dim: H (default D / N).
      encodings: registered names or configs of the encodings this layer owns
        (e.g. ``["rope", "alibi"]``); biases shared across layers are passed per
        call instead (``shared``).
      normalizer: the ``normalize`` hook (softmax by default): a function, a name
        (``"softmax"``, ``"l2"``, ``"relu2"``, ``"urpe"``), or a config with learned
        parameters (``URPEConfig``), which this layer then holds.
      dropout_rate: dropout on the attention weights.
      use_bias: biases in the projections.
      implementation: ``"auto"`` (default), ``"materialize"`` or ``"blockwise"``, passed to
        :func:`~posenc_jax.functional.dot_product_attention` (blockwise: tiles of
        ``block_q`` × ``block_k``, memory linear in the length); a call may override it.
      block_q, block_k: blockwise tile sizes (default 512).
      rngs: ``nnx.Rngs`` with ``params`` (and ``dropout`` when training with dropout).

    Example:
      >>> mha = MultiHeadAttention(64, 4, encodings=["rope"], rngs=nnx.Rngs(0))
      >>> x = jnp.ones((2, 10, 64))
      >>> mha(x, jnp.arange(10), causal=True).shape
      (2, 10, 64)
    """

    def __init__(
        self,
        model_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        encodings: Sequence = (),
        normalizer: Callable = softmax_weights,
        dropout_rate: float = 0.0,
        use_bias: bool = False,
        implementation: str = "auto",
        block_q: int | None = None,
        block_k: int | None = None,
        rngs: nnx.Rngs,
    ):
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        check_rngs(rngs)
        check_size("model_dim", model_dim)
        check_size("num_heads", num_heads)
        check_dropout_rate(dropout_rate)
        for name, size in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if size is not None:
                check_size(name, size)
        self.implementation, self.block_q, self.block_k = implementation, block_q, block_k
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None:
            if num_heads > model_dim:
                raise ValueError(
                    f"MultiHeadAttention({model_dim}, {num_heads}) has more heads than features: its order is "
                    f"(model_dim, num_heads), unlike flax.nnx.MultiHeadAttention(num_heads, in_features); call "
                    f"MultiHeadAttention({num_heads}, {model_dim}, ...), or pass head_dim= for more heads than features"
                )
            if model_dim % num_heads:
                raise ValueError(f"model_dim={model_dim} is not divisible by num_heads={num_heads}; pass head_dim")
            head_dim = model_dim // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        if isinstance(normalizer, str):
            normalizer = normalizer_config(normalizer)
        if isinstance(normalizer, EncodingConfig):
            self.normalizer = None
            self.normalizer_params = PositionEncoding(
                normalizer, num_heads=num_heads, head_dim=head_dim, model_dim=model_dim, rngs=rngs
            )
        else:
            # A built hook with arrays (e.g. a fixed URPE table) is data of the module, not a static setting.
            has_arrays = isinstance(normalizer, Normalize) and jax.tree.leaves(normalizer)
            self.normalizer = nnx.data(normalizer) if has_arrays else normalizer
            self.normalizer_params = None
        self.dropout_rate = dropout_rate
        self.query = nnx.Linear(model_dim, num_heads * head_dim, use_bias=use_bias, rngs=rngs)
        self.key = nnx.Linear(model_dim, num_kv_heads * head_dim, use_bias=use_bias, rngs=rngs)
        self.value = nnx.Linear(model_dim, num_kv_heads * head_dim, use_bias=use_bias, rngs=rngs)
        self.out = nnx.Linear(num_heads * head_dim, model_dim, use_bias=use_bias, rngs=rngs)
        self.encodings = nnx.List(
            [
                PositionEncoding(e, num_heads=num_heads, head_dim=head_dim, model_dim=model_dim, rngs=rngs)
                for e in resolve_encodings(encodings)
            ]
        )
        for module in self.encodings:
            if module.acts_on not in ("attention", "shared_bias"):
                raise ValueError(
                    f"{type(module.config).__name__} acts on the {module.acts_on}, not in attention; give it to the "
                    f"Transformer, not the attention"
                )
        self.dropout_rngs = rngs if dropout_rate > 0 else None

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        *,
        causal: bool,
        shared: Sequence = (),
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        deterministic: bool = True,
        implementation: str | None = None,
        mesh: jax.sharding.Mesh | None = None,
        ring: bool = False,
    ):
        """Self-attention over ``x`` ``[B, T, D]`` at ``positions`` ``[T]`` or ``[B, T]``.

        Args:
          causal: mask keys after each query (by position).
          shared: extra encoding hooks for this call (a bias computed once per
            forward, e.g. ``SharedBias``).
          key_mask: ``[B, T]`` booleans, True for real tokens (with a cache: padding
            tokens are cached as invalid slots, which no query attends to).
          segment_ids: ``[B, T]`` ids of packed sequences.
          cache: a :class:`KVCache` to append to and attend over (causal decoding);
            the call then returns ``(output, new_cache)``. Make it with :meth:`init_cache`.
          deterministic: no dropout.
          implementation: overrides the layer's ``implementation`` for this call.
          mesh: a :class:`jax.sharding.Mesh` of one axis (or with a ``"sequence"`` axis): the
            call's queries are split over its devices, each computing its rows blockwise
            against all the keys (:func:`~posenc_jax.functional.core.sharded.sequence_parallel_attention`),
            so one long sequence uses every device. Equal to one device's result to float32
            rounding. Not with a cache, and not with ``implementation="materialize"``.
          ring: with ``mesh``, split the keys and values over its devices too and pass each
            device's shard round them, instead of gathering them whole on every device: each
            device then holds ``1/P`` of them (``sequence_parallel_attention``'s ``ring``).

        Returns:
          ``[B, T, D]``, or ``([B, T, D], KVCache)`` with a cache.
        """
        width = self.query.in_features
        if getattr(x, "ndim", None) != 3 or x.shape[-1] != width:
            raise ValueError(
                f"x must have shape [B, T, D] with D = model_dim = {width}, got shape {getattr(x, 'shape', type(x))}"
            )
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be True or False, got {causal!r}")
        # The one check of the positions on this call's way down: the attention and its hooks take them as they are.
        positions = check_positions(positions)
        batch, length, _ = x.shape
        if (
            positions.shape[-1] != length
            or positions.ndim > 2
            or (positions.ndim == 2 and positions.shape[0] not in (1, batch))
        ):
            raise ValueError(f"positions must be [T] or [B, T] for x of shape {x.shape}, got shape {positions.shape}")
        made_for = getattr(cache, "made_for", None)
        if made_for is not None and made_for.model is not None:
            # A model's layer attends with the model's shared biases and prepared rotations as well as its own.
            raise ValueError(
                f"this cache was made by a Transformer for its layer {made_for.layer} (encodings "
                f"{show_encodings(made_for.model)}), not for this layer alone: decode with that model's decode, or "
                f"make the cache with this layer's init_cache(batch, max_length)"
            )
        return self._attend(
            x,
            positions,
            causal=bool(causal),
            shared=shared,
            key_mask=key_mask,
            segment_ids=segment_ids,
            cache=cache,
            deterministic=deterministic,
            implementation=implementation,
            mesh=mesh,
            ring=ring,
        )

    def _forward_terms(self, positions, key_positions, *, biases: Sequence, causal: bool, batch: int, implementation):
        """What a model computes once per forward for all its layers made like this one: ``(shared, prepared)``.

        :func:`~posenc_jax.functional.core.attention.forward_terms` for this layer's encodings,
        sizes, normaliser and implementation (overridden by ``implementation`` when given), at
        positions the model checked; the model gives both to every layer's :meth:`_attend`.
        """
        return forward_terms(
            self._hooks(),
            biases,
            query_positions=positions,
            key_positions=key_positions,
            batch=batch,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            causal=causal,
            normalizer=self._normalizer(),
            implementation=self.implementation if implementation is None else implementation,
        )

    def _attend(
        self,
        x: jax.Array,
        positions: jax.Array,
        *,
        causal: bool,
        shared: Sequence = (),
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        deterministic: bool = True,
        implementation: str | None = None,
        prepared: Sequence | None = None,
        mesh: jax.sharding.Mesh | None = None,
        ring: bool = False,
    ):
        """:meth:`__call__` for ``x`` and ``positions`` already checked: a model's layers (the model checked them once).

        ``prepared``: the model's per-forward rotations (:meth:`_forward_terms`), one entry per
        encoding of this layer, None where the layer uses its own hook. They were prepared for
        the tokens at ``positions``, this layer's own queries and keys, which they rotate
        (:meth:`~posenc_jax.functional.core.hooks.PreparedRotation.rotate_prepared`) with no
        positions compared: in self-attention where the attention rotates (:class:`_OwnTokens`),
        when decoding before the new keys are cached. A cache whose keys are re-rotated at every
        step (a rotation that follows the sequence length) uses the layer's own hooks.
        """
        implementation = self.implementation if implementation is None else implementation
        _check_mesh(mesh, cache, implementation, ring)
        batch, length, _ = x.shape
        q = self.query(x).reshape(batch, length, self.num_heads, self.head_dim)
        k = self.key(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self.value(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        own = self._hooks()
        rotations = self._prepared(prepared)  # per encoding: the model's prepared rotation, or None
        query_positions = key_positions = positions
        new_cache = None
        if cache is None:
            encodings = [hook if r is None else _OwnTokens(r) for hook, r in zip(own, rotations, strict=True)]
            encodings += list(shared)
        else:
            if not causal:
                raise ValueError("a KV cache needs causal attention: bidirectional layers cannot decode step by step")
            if segment_ids is not None:
                raise ValueError("decoding with a cache takes no segment_ids: decode one sequence per row")
            self._check_cache(cache)
            positions = jnp.broadcast_to(positions, (batch, length))
            encodings, terms = own + list(shared), []
            if _stores_rotated_keys(encodings):
                # A fixed reference position for rotations that need one (xPos's centre): the first cached token's.
                reference = jnp.where(cache.length > 0, cache.positions[:, :1], positions[:, :1])
                rest = [hook for hook, ready in zip(own, rotations, strict=True) if ready is None] + list(shared)
                ready = [rotation for rotation in rotations if rotation is not None]
                q, k = self._rotate_new_tokens(q, k, positions, rest, ready, reference)
                encodings = [hook for hook in rest if not isinstance(hook, Rotate)]
                terms = _cached_terms(encodings)
            if len(terms) != len(cache.features):
                terms = []  # a cache made without this layer's per-key terms: they are computed from the keys
            features = tuple(hook.key_features(k, positions) for hook in terms)
            capacity = cache.key.shape[1]
            tables = ()
            if len(cache.tables) == len(terms):  # computed once, when the cache has none yet (KVCache.append)
                tables = tuple(
                    _table_maker(hook, capacity, stored) for hook, stored in zip(terms, cache.tables, strict=True)
                )
            # Padding (key_mask False, e.g. left padding) is stored as invalid slots: never attended.
            new_cache = cache._append(k, v, positions, valid=key_mask, features=features, tables=tables)
            k, v = new_cache.key, new_cache.value
            query_positions, key_positions = positions, new_cache.positions
            key_mask = new_cache.valid  # empty slots and padding, whatever their positions
            stored = {id(hook): hook.with_key_features(f) for hook, f in zip(terms, new_cache.features, strict=True)}
            for hook, make, table in zip(terms, tables, new_cache.tables, strict=False):
                if make is not None:  # a table this layer supplied: read it
                    stored[id(hook)] = stored[id(hook)].with_cache_table(table)
            encodings = [stored.get(id(hook), hook) for hook in encodings]
        use_dropout = self.dropout_rate > 0 and not deterministic
        arguments = dict(
            encodings=encodings,
            query_positions=query_positions,
            key_positions=key_positions,
            normalizer=self._normalizer(),
            causal=causal,
            key_mask=key_mask,
            query_segment_ids=segment_ids,
            key_segment_ids=segment_ids,
            dropout_rate=self.dropout_rate if use_dropout else 0.0,
            dropout_rng=self.dropout_rngs.dropout() if use_dropout else None,
            block_q=self.block_q,
            block_k=self.block_k,
        )
        if mesh is None:
            out = attend(q, k, v, implementation=implementation, **arguments)
        else:
            out = sequence_parallel_attention(q, k, v, mesh=mesh, ring=bool(ring), **arguments)
        out = self.out(out.reshape(batch, length, self.num_heads * self.head_dim))
        return out if cache is None else (out, new_cache)

    def _hooks(self) -> list:
        """This layer's encoding hooks, in order (built from its parameters)."""
        return [module() for module in self.encodings]

    def _normalizer(self):
        """The ``normalize`` hook (built from this layer's parameters when it has them)."""
        return self.normalizer if self.normalizer_params is None else self.normalizer_params()

    def _prepared(self, prepared: Sequence | None) -> list:
        """The model's prepared rotations, one entry per encoding of this layer (None: the layer's own hook)."""
        if prepared is None:
            return [None] * len(self.encodings)
        if len(prepared) != len(self.encodings):
            raise ValueError(
                f"prepared has {len(prepared)} entries but this layer has {len(self.encodings)} encodings; pass one "
                f"per encoding (None where the layer uses its own)"
            )
        for hook in prepared:
            if hook is not None and not isinstance(hook, PreparedRotation):
                raise TypeError(f"prepared entries must be prepared rotations (RoPE().prepare(...)), got {hook!r}")
        return list(prepared)

    def _rotate_new_tokens(self, q, k, positions, hooks, prepared, reference):
        """A decoding step's queries and new keys rotated now, when the cache holds keys rotated.

        ``prepared``: the model's prepared rotations, for these tokens; ``hooks``: the layer's other
        hooks, whose rotations rotate by ``positions`` (int32 ``[B, t]``, checked by the caller).
        ``reference`` (int32 ``[B, 1]``) is the fixed position a ``rotate_about`` hook rotates about.
        """
        for rotation in prepared:
            q, k = rotation.rotate_prepared(q, k)
        rotations = [hook for hook in hooks if isinstance(hook, Rotate)]
        if not rotations:
            return q, k
        context = attention_context(
            positions,
            positions,  # the new keys are the new tokens: one table for both
            scale=float(self.head_dim) ** -0.5,
            causal=True,
            head_dim=self.head_dim,
            num_heads=self.num_heads,
        )
        for hook in rotations:
            if forms_of(hook).has("cached", "rotation_about"):
                q, k = hook.rotate_about(q, k, context, reference)
            else:
                q, k = hook.rotate(q, k, context)
        return q, k

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

    def _check_cache(self, cache, what: str = "this cache", fix: str = "") -> None:
        """Refuses a cache made for another layer (encodings, heads, head size) or of integer keys, naming
        what differs (static facts: before tracing, nothing inside ``jit``)."""
        if not isinstance(cache, KVCache):
            raise TypeError(
                f"cache must be a KVCache made by init_cache(batch, max_length), got {type(cache).__name__}"
            )
        fix = fix or "make the cache with this layer's init_cache(batch, max_length)"
        self._cache_record(cache.key.shape[1], cache.key.dtype).check(cache, what, fix)

    def init_cache(self, batch: int, max_length: int, dtype=jnp.float32) -> KVCache:
        """An empty :class:`KVCache` of ``max_length`` slots for this layer, with room for its encodings'
        per-key terms (DeBERTa's key projections, Transformer-XL's ``u·k``) and tables (Transformer-XL's
        projected relative sinusoids, computed by the first call that writes the cache).

        ``dtype``: the cached keys' and values' dtype, a floating one (``jnp.bfloat16`` halves the
        cache); an integer or boolean dtype is refused. The cache records what it is made for (this
        layer's encodings, heads and head size: :class:`~posenc_jax.functional.core.cache.CacheRecord`),
        and a layer given a cache made for another refuses it, naming what differs."""
        check_count("batch", batch)
        check_count("max_length", max_length, fix="the number of tokens the cache holds: prompt and new tokens")
        dtype = check_cache_dtype(dtype)
        terms = _cached_terms(self._hooks())
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
