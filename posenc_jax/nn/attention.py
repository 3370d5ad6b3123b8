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

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from posenc_jax.functional.core.attention import IMPLEMENTATIONS, dot_product_attention
from posenc_jax.functional.core.cache import CachedKeyTerm, CachedTable, KVCache
from posenc_jax.functional.core.hooks import (
    AttentionContext,
    EncodingConfig,
    Normalize,
    PerTokenRotation,
    Rotate,
    RotatesAbout,
    hook_names,
    one_or_more,
)
from posenc_jax.functional.core.normalizers import normalizer_config, softmax_weights
from posenc_jax.functional.core.positions import check_positions
from posenc_jax.functional.core.validation import check_count
from posenc_jax.nn.encoding import PositionEncoding, check_dropout_rate, check_rngs, check_size

__all__ = ["KVCache", "MultiHeadAttention"]


def _stores_rotated_keys(hooks: Sequence) -> bool:
    """Whether a cache may hold keys rotated: every rotate hook rotates by each token's own position alone
    (``rotates_per_token``), or does given a fixed reference position (``rotate_about``, xPos's centre)."""
    return all(
        ((isinstance(hook, PerTokenRotation) and hook.rotates_per_token) or isinstance(hook, RotatesAbout))
        and hook_names(hook) == ("rotate",)
        for hook in hooks
        if isinstance(hook, Rotate)
    )


def _cached_terms(hooks: Sequence) -> list:
    """The hooks whose per-key terms a cache stores (only where keys are stored as the hooks see them)."""
    if not _stores_rotated_keys(hooks):
        return []
    return [hook for hook in hooks if isinstance(hook, CachedKeyTerm)]


def _table_maker(hook, capacity: int, stored):
    """How a cache makes ``hook``'s table when it has none yet (None: the cache keeps no table for it)."""
    if stored is None or not isinstance(hook, CachedTable):
        return None
    return functools.partial(hook.cache_table, capacity)


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
                for e in one_or_more(encodings)
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
        prepared: Sequence | None = None,
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
          prepared: hooks computed once for the whole forward pass by the model, one per
            encoding of this layer (None where the layer builds its own), e.g. RoPE with
            its table (:meth:`~posenc_jax.functional.RoPE.prepare`).

        Returns:
          ``[B, T, D]``, or ``([B, T, D], KVCache)`` with a cache.
        """
        width = self.query.in_features
        if getattr(x, "ndim", None) != 3 or x.shape[-1] != width:
            raise ValueError(
                f"x must have shape [B, T, D] with D = model_dim = {width}, got shape {getattr(x, 'shape', type(x))}"
            )
        batch, length, _ = x.shape
        q = self.query(x).reshape(batch, length, self.num_heads, self.head_dim)
        k = self.key(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self.value(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        encodings = self._hooks(prepared) + list(shared)
        query_positions = positions
        key_positions = positions
        new_cache = None
        if cache is not None:
            if not causal:
                raise ValueError("a KV cache needs causal attention: bidirectional layers cannot decode step by step")
            if segment_ids is not None:
                raise ValueError("decoding with a cache takes no segment_ids: decode one sequence per row")
            positions = jnp.broadcast_to(check_positions(positions), (batch, length))
            # A fixed reference position for rotations that need one (xPos's centre): the first cached token's.
            reference = jnp.where(cache.length > 0, cache.positions[:, :1], positions[:, :1])
            q, k, encodings, terms = self._rotate_new_tokens(q, k, positions, encodings, reference)
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
            new_cache = cache.append(k, v, positions, valid=key_mask, features=features, tables=tables)
            k, v = new_cache.key, new_cache.value
            query_positions, key_positions = positions, new_cache.positions
            key_mask = new_cache.valid  # empty slots and padding, whatever their positions
            stored = {id(hook): hook.with_key_features(f) for hook, f in zip(terms, new_cache.features, strict=True)}
            for hook, make, table in zip(terms, tables, new_cache.tables, strict=False):
                if make is not None:  # a table this layer supplied: read it
                    stored[id(hook)] = stored[id(hook)].with_cache_table(table)
            encodings = [stored.get(id(hook), hook) for hook in encodings]
        use_dropout = self.dropout_rate > 0 and not deterministic
        out = dot_product_attention(
            q,
            k,
            v,
            query_positions=query_positions,
            key_positions=key_positions,
            encodings=encodings,
            normalizer=self.normalizer if self.normalizer_params is None else self.normalizer_params(),
            causal=causal,
            key_mask=key_mask,
            query_segment_ids=segment_ids,
            key_segment_ids=segment_ids,
            dropout_rate=self.dropout_rate if use_dropout else 0.0,
            dropout_rng=self.dropout_rngs.dropout() if use_dropout else None,
            implementation=self.implementation if implementation is None else implementation,
            block_q=self.block_q,
            block_k=self.block_k,
        )
        out = self.out(out.reshape(batch, length, self.num_heads * self.head_dim))
        return out if cache is None else (out, new_cache)

    def _hooks(self, prepared: Sequence | None) -> list:
        """This layer's encoding hooks, in order; a model's prepared hook replaces the layer's own."""
        if prepared is None:
            return [module() for module in self.encodings]
        if len(prepared) != len(self.encodings):
            raise ValueError(
                f"prepared has {len(prepared)} entries but this layer has {len(self.encodings)} encodings; pass one "
                f"per encoding (None where the layer builds its own)"
            )
        return [module() if hook is None else hook for module, hook in zip(self.encodings, prepared, strict=True)]

    def _rotate_new_tokens(self, q, k, positions, hooks, reference):
        """A decoding step's queries and new keys rotated now, when a cache may hold keys rotated.

        ``reference`` (int32 ``[B, 1]``) is the fixed position a ``rotate_about`` hook rotates about.

        Returns ``(q, k, hooks left for the attention, hooks whose per-key terms the cache stores)``.
        """
        if not _stores_rotated_keys(hooks):
            return q, k, hooks, []
        context = AttentionContext(
            query_positions=positions,
            key_positions=positions,  # the new keys are the new tokens: one table for both
            scale=float(self.head_dim) ** -0.5,
            head_dim=self.head_dim,
            num_heads=self.num_heads,
            causal=True,
            key_length=k.shape[1],
        )
        for hook in hooks:
            if isinstance(hook, Rotate) and isinstance(hook, RotatesAbout):
                q, k = hook.rotate_about(q, k, context, reference)
            elif isinstance(hook, Rotate):
                q, k = hook.rotate(q, k, context)
        rest = [hook for hook in hooks if not isinstance(hook, Rotate)]
        return q, k, rest, _cached_terms(rest)

    def init_cache(self, batch: int, max_length: int, dtype=jnp.float32) -> KVCache:
        """An empty :class:`KVCache` of ``max_length`` slots for this layer, with room for its encodings'
        per-key terms (DeBERTa's key projections, Transformer-XL's ``u·k``) and tables (Transformer-XL's
        projected relative sinusoids, computed by the first call that writes the cache)."""
        check_count("batch", batch)
        check_count("max_length", max_length, fix="the number of tokens the cache holds: prompt and new tokens")
        terms = _cached_terms(self._hooks(None))
        key = jax.ShapeDtypeStruct((batch, 1, self.num_kv_heads, self.head_dim), dtype)
        positions = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
        features = tuple(jax.eval_shape(hook.key_features, key, positions) for hook in terms)
        tables = tuple(
            jax.eval_shape(functools.partial(hook.cache_table, max_length)) if isinstance(hook, CachedTable) else None
            for hook in terms
        )
        return KVCache.empty(
            batch, max_length, self.num_kv_heads, self.head_dim, dtype, features=features, tables=tables
        )
