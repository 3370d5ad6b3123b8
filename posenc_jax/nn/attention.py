"""Multi-head attention with any positional encoding, as a Flax NNX module shaped like ``flax.nnx.MultiHeadAttention``.

A thin parameter-holding wrapper: Flax's projections ``query``, ``key``, ``value``, ``out``
and the per-layer encodings' parameters; the computation is
:func:`posenc_jax.functional.dot_product_attention`.

Decoding uses a :class:`KVCache` (a pytree of arrays, positions included), explicit
(``new_cache``, ``cache=``) or the layer's own (``init_cache``, ``decode=True``), so a
step compiles once and runs for any position. The cache holds what
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
from flax.nnx.nn.linear import default_kernel_init

from posenc_jax.functional.core.attention import IMPLEMENTATIONS, attend, dot_product_attention, forward_terms
from posenc_jax.functional.core.cache import KVCache
from posenc_jax.functional.core.forms import Forms, declare_forms, declared_forms, forms_of
from posenc_jax.functional.core.hooks import (
    EncodingConfig,
    PreparedRotation,
    attention_context,
    hook_names,
    rotates_each_token,
)
from posenc_jax.functional.core.normalizers import normalizer_config, softmax_weights
from posenc_jax.functional.core.registry import resolve_encodings
from posenc_jax.functional.core.sharded import sequence_parallel_attention
from posenc_jax.nn.attention_cache import CachedDecoding
from posenc_jax.nn.attention_inputs import (
    check_mesh,
    check_sizes,
    dropout_key,
    flat_inputs,
    flat_keys,
    flat_mask,
    flat_per_token,
    flat_positions,
    refuse_renamed,
)
from posenc_jax.nn.encoding import PositionEncoding, check_dropout_rate, check_rngs, check_size

__all__ = ["KVCache", "MultiHeadAttention"]

_ZEROS = nnx.initializers.zeros_init()  # flax's default bias_init


def _stores_rotated_keys(hooks: Sequence) -> bool:
    """Whether a cache may hold keys rotated: every rotate hook rotates by each token's own position alone
    (``rotates_per_token``), or does given a fixed reference position (``rotate_about``, xPos's centre)."""
    return all(
        (rotates_each_token(hook) or forms_of(hook).has("cached", "rotation_about")) and hook_names(hook) == ("rotate",)
        for hook in hooks
        if "rotate" in hook_names(hook)
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


declare_forms(_OwnTokens, Forms(hooks=("rotate",)))


class MultiHeadAttention(CachedDecoding, nnx.Module):
    """Multi-head (grouped-query) attention composing any encodings, shaped like ``flax.nnx.MultiHeadAttention``.

    ``flax.nnx.MultiHeadAttention``'s signature, parameters and semantics (projections
    ``query``, ``key``, ``value`` with kernels ``[in, heads, head_dim]``, ``out`` with kernel
    ``[heads, head_dim, out]``, so a Flax layer's ``nnx.state(layer, nnx.Param)`` loads into
    this one with ``nnx.update``), plus the encodings, which need positions: ``arange`` unless
    given, or the cache's next slots when decoding. The attention itself is
    :func:`posenc_jax.functional.dot_product_attention`'s (scores and softmax in float32).

    Args:
      num_heads: N query heads.
      in_features: the width of ``inputs_q`` (and of ``inputs_k``/``inputs_v`` unless
        ``in_kv_features``).
      qkv_features: N · H, the width of the queries, keys and values (default ``in_features``);
        the head size H is ``qkv_features // num_heads``.
      out_features: the output width (default ``in_features``).
      encodings: registered names or configs of the encodings this layer owns
        (``["rope", "alibi"]``, ``"rope+alibi"``); biases shared across layers are passed per
        call instead (``shared``). Default none (NoPE).
      num_kv_heads: K key/value heads (default N); N must be a multiple of K (grouped-query).
      in_kv_features: the width of ``inputs_k`` and ``inputs_v`` (default ``in_features``).
      dtype: the computation dtype of the projections (default: inferred from inputs and
        parameters, as Flax's); the attention's scores and softmax run in float32 and return
        in the queries' dtype.
      param_dtype: the projections' parameter dtype.
      broadcast_dropout: one dropout mask ``[T, S]`` shared by every batch row and head (Flax's
        default, True); False draws one mask per attention weight.
      dropout_rate: dropout on the attention weights.
      deterministic: no dropout (a call's ``deterministic`` overrides it); needed, here or per
        call, when ``dropout_rate > 0``.
      precision: the projections' ``jax.lax.Precision``.
      kernel_init, out_kernel_init, bias_init, out_bias_init, use_bias: as Flax's (the
        ``out_*`` default to the others).
      decode: the default of a call's ``decode`` (None: False): attend with the cache that
        :meth:`init_cache` made, one or more new tokens per call.
      normalize_qk: LayerNorm the queries and keys per head (``query_ln``, ``key_ln``, no bias)
        before the encodings, as Flax's.
      normalizer: the ``normalize`` hook (softmax by default): a function, a name
        (``"softmax"``, ``"l2"``, ``"relu2"``, ``"urpe"``), or a config with learned
        parameters (``URPEConfig``), which this layer then holds.
      implementation: ``"auto"`` (default), ``"materialize"`` or ``"blockwise"``, passed to
        :func:`~posenc_jax.functional.dot_product_attention` (blockwise: tiles of
        ``block_q`` × ``block_k``, memory linear in the length); a call may override it.
      block_q, block_k: blockwise tile sizes (default 512).
      rngs: ``nnx.Rngs`` with ``params`` (and ``dropout`` when training with dropout).

    Example:
      >>> mha = MultiHeadAttention(4, 64, encodings=["rope"], rngs=nnx.Rngs(0))
      >>> x = jnp.ones((2, 10, 64))
      >>> mha(x, causal=True).shape
      (2, 10, 64)
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int | None = None,  # required (None only so that model_dim= gets its own error)
        qkv_features: int | None = None,
        out_features: int | None = None,
        *,
        encodings: Sequence = (),
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        broadcast_dropout: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        precision=None,
        kernel_init: Callable = default_kernel_init,
        out_kernel_init: Callable | None = None,
        bias_init: Callable = _ZEROS,
        out_bias_init: Callable | None = None,
        use_bias: bool = True,
        decode: bool | None = None,
        normalize_qk: bool = False,
        normalizer: Callable = softmax_weights,
        implementation: str = "auto",
        block_q: int | None = None,
        block_k: int | None = None,
        rngs: nnx.Rngs,
        **renamed,
    ):
        refuse_renamed(renamed, "MultiHeadAttention", num_heads)
        if in_features is None:
            raise TypeError(
                "MultiHeadAttention needs in_features, the input width: MultiHeadAttention(num_heads, in_features)"
            )
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        check_rngs(rngs)
        check_size("num_heads", num_heads)
        check_size("in_features", in_features)
        check_dropout_rate(dropout_rate)
        qkv_features = in_features if qkv_features is None else qkv_features
        out_features = in_features if out_features is None else out_features
        in_kv_features = in_features if in_kv_features is None else in_kv_features
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, size in (
            ("qkv_features", qkv_features),
            ("out_features", out_features),
            ("in_kv_features", in_kv_features),
            ("num_kv_heads", num_kv_heads),
        ):
            check_size(name, size)
        check_sizes(num_heads, in_features, qkv_features, num_kv_heads)
        head_dim = qkv_features // num_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.in_features, self.qkv_features, self.out_features = in_features, qkv_features, out_features
        self.in_kv_features = in_kv_features
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.broadcast_dropout, self.deterministic, self.decode = broadcast_dropout, deterministic, decode
        self.use_bias, self.normalize_qk = use_bias, normalize_qk
        self.implementation, self.block_q, self.block_k = implementation, block_q, block_k
        if isinstance(normalizer, str):
            normalizer = normalizer_config(normalizer)
        if isinstance(normalizer, EncodingConfig):
            self.normalizer = None
            self.normalizer_params = PositionEncoding(
                normalizer, num_heads=num_heads, head_dim=head_dim, model_dim=in_features, rngs=rngs
            )
        else:
            # A built hook with arrays (e.g. a fixed URPE table) is data of the module, not a static setting.
            declared = declared_forms(normalizer)
            has_arrays = declared is not None and "normalize" in declared.hooks and jax.tree.leaves(normalizer)
            self.normalizer = nnx.data(normalizer) if has_arrays else normalizer
            self.normalizer_params = None
        self.dropout_rate = dropout_rate
        projection = functools.partial(
            nnx.LinearGeneral,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            bias_init=bias_init,
            use_bias=use_bias,
            precision=precision,
            rngs=rngs,
        )
        self.query = projection(in_features, (num_heads, head_dim))
        self.key = projection(in_kv_features, (num_kv_heads, head_dim))
        self.value = projection(in_kv_features, (num_kv_heads, head_dim))
        if normalize_qk:
            norm = functools.partial(
                nnx.LayerNorm, head_dim, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )
            self.query_ln, self.key_ln = norm(), norm()
        else:
            self.query_ln = self.key_ln = nnx.data(None)
        self.out = projection(
            (num_heads, head_dim),
            out_features,
            axis=(-2, -1),
            kernel_init=out_kernel_init or kernel_init,
            bias_init=out_bias_init or bias_init,
        )
        self.encodings = nnx.List(
            [
                PositionEncoding(e, num_heads=num_heads, head_dim=head_dim, model_dim=in_features, rngs=rngs)
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
        self.kv_cache = nnx.data(None)  # decode=True's cache, made by init_cache

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        query_positions: jax.Array | None = None,
        key_positions: jax.Array | None = None,
        causal: bool = False,
        segment_ids: jax.Array | None = None,
        key_mask: jax.Array | None = None,
        shared: Sequence = (),
        cache: KVCache | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        sow_weights: bool = False,
        decode: bool | None = None,
        implementation: str | None = None,
        mesh: jax.sharding.Mesh | None = None,
        ring: bool = False,
        **renamed,
    ):
        """Attention of ``inputs_q`` ``[batch..., T, in_features]`` over ``inputs_k``/``inputs_v`` ``[batch..., S, *]``.

        Self-attention when ``inputs_k`` is None; ``inputs_v`` defaults to ``inputs_k`` (Flax's rule).

        Args:
          mask: booleans broadcastable to ``[batch..., heads, T, S]``, True where a query
            attends to a key (Flax's; with a cache, S is the cache's slots).
          query_positions, key_positions: integer ``[T]`` / ``[S]`` or ``[batch..., T]`` /
            ``[batch..., S]``, the tokens' positions for the encodings and ``causal``. Default
            ``arange`` (self-attention: the keys' are the queries'); with a cache, the cache's
            next slots (``cache.length + arange(T)``).
          causal: mask keys whose position is after the query's.
          segment_ids: ``[batch..., T]`` ids of packed sequences (self-attention).
          key_mask: ``[batch..., S]`` booleans, True for real tokens (with a cache: padding
            tokens are cached as invalid slots, which no query attends to).
          shared: extra encoding hooks for this call (a bias computed once per
            forward, e.g. ``SharedBias``).
          cache: an explicit :class:`KVCache` (from :meth:`new_cache`) to append to and attend
            over (causal decoding, batch ``[B, T, D]``); the call then returns
            ``(output, new_cache)``.
          deterministic: no dropout (default: the layer's ``deterministic``).
          rngs: ``nnx.Rngs`` (its ``dropout`` stream) or a stream for this call's dropout.
          sow_weights: refused when True: the layer does not sow its weights
            (:func:`~posenc_jax.functional.dot_product_attention` returns them).
          decode: append to the layer's own cache (:meth:`init_cache`) and attend over it,
            as Flax's ``decode=True`` (default: the layer's ``decode``).
          implementation: overrides the layer's ``implementation`` for this call.
          mesh: a :class:`jax.sharding.Mesh` of one axis (or with a ``"sequence"`` axis): the
            queries are split over its devices, each computing its rows blockwise against all the
            keys (:func:`~posenc_jax.functional.core.sharded.sequence_parallel_attention`). Not
            with a cache, and not with ``implementation="materialize"``.
          ring: with ``mesh``, split the keys and values over the devices too and pass each
            device's shard round them: each device then holds ``1/P`` of them.

        Returns:
          ``[batch..., T, out_features]``, or that and the new :class:`KVCache` with ``cache``.
        """
        refuse_renamed(renamed, "MultiHeadAttention.__call__")
        if sow_weights:
            raise ValueError(
                "sow_weights=True: this layer does not sow its attention weights; get them from "
                "posenc_jax.functional.dot_product_attention(..., return_weights=True)"
            )
        if inputs_k is None and inputs_v is not None:
            raise ValueError("inputs_v is given without inputs_k: pass inputs_k (inputs_v defaults to it)")
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError(f"causal must be True or False, got {causal!r}")
        decode = bool(self.decode) if decode is None else decode
        deterministic = self.deterministic if deterministic is None else deterministic
        if self.dropout_rate > 0 and deterministic is None:
            raise ValueError(
                f"dropout_rate={self.dropout_rate}: pass deterministic=True or False to the call or the layer"
            )
        x, batch_shape = flat_inputs(inputs_q, "inputs_q", self.in_features, "in_features")
        kv = None if inputs_k is None else flat_keys(inputs_k, inputs_v, batch_shape, self.in_kv_features)
        if decode:
            if cache is not None:
                raise ValueError(
                    "decode=True attends with the layer's own cache (init_cache); an explicit cache= is used with "
                    "decode=False"
                )
            if self.kv_cache is None:
                raise ValueError(
                    "decode=True needs the layer's cache: call init_cache((batch..., max_length, features)) first"
                )
            cache = self.kv_cache.get_value()
        if cache is not None:
            self._check_decoding(cache, kv, batch_shape, query_positions, key_positions, decode)
            causal = True
        length = x.shape[1]
        key_length = length if kv is None else kv[0].shape[1]
        indices = query_positions is None and key_positions is None and cache is None  # arange, made here
        if query_positions is None:
            # A constant, not jnp.arange's traced array: known while tracing, as the paired causal tiles need.
            query_positions = np.arange(length, dtype=np.int32)
            if cache is not None:
                query_positions = cache.length + query_positions
        else:
            # The one check of the positions on this call's way down: the attention and its hooks take them as they are.
            query_positions = flat_positions(query_positions, "query_positions", batch_shape, length)
        if key_positions is not None:
            key_positions = flat_positions(key_positions, "key_positions", batch_shape, key_length)
        elif kv is not None:
            key_positions = jnp.arange(key_length, dtype=jnp.int32)
        if cache is not None:
            key_length = cache.key.shape[1]
        if segment_ids is not None and kv is not None:
            raise ValueError("segment_ids mark packed sequences in self-attention; for cross-attention pass a mask")
        out = self.attend(
            x,
            query_positions,
            causal=bool(causal),
            shared=shared,
            key_mask=flat_per_token(key_mask, "key_mask", batch_shape, x.shape[1] if kv is None else kv[0].shape[1]),
            segment_ids=flat_per_token(segment_ids, "segment_ids", batch_shape, length),
            cache=cache,
            deterministic=bool(deterministic),
            implementation=implementation,
            mesh=mesh,
            ring=ring,
            kv=kv,
            key_positions=key_positions,
            mask=flat_mask(mask, batch_shape, self.num_heads, length, key_length),
            rngs=rngs,
            indices=indices,
        )
        if cache is not None:
            out, cache = out
        out = out.reshape(*batch_shape, length, self.out_features)
        if decode:
            self.kv_cache.set_value(cache)
            return out
        return out if cache is None else (out, cache)

    def forward_terms(self, positions, key_positions, *, biases: Sequence, causal: bool, batch: int, implementation):
        """What a model computes once per forward for all its layers made like this one: ``(shared, prepared)``.

        :func:`~posenc_jax.functional.core.attention.forward_terms` for this layer's encodings,
        sizes, normaliser and implementation (overridden by ``implementation`` when given), at
        positions the model checked; the model gives both to every layer's :meth:`attend`.
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

    def attend(
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
        kv: tuple[jax.Array, jax.Array] | None = None,
        key_positions: jax.Array | None = None,
        mask: jax.Array | None = None,
        rngs=None,
        indices: bool = False,
    ):
        """:meth:`__call__` for arguments already checked and flattened: ``x`` ``[B, T, D]`` and its ``positions``.

        A model's layers call it (the model checked the positions once). ``kv``: the keys' and
        values' inputs ``[B, S, D]`` in cross-attention (None: ``x``), at ``key_positions``
        (default ``positions``); ``mask``: booleans ``[B, heads|1, T, S]``; ``indices``: the
        positions are ``arange``, made by the caller (see :func:`~posenc_jax.functional.core.attention.attend`).

        ``prepared``: the model's per-forward rotations (:meth:`forward_terms`), one entry per
        encoding of this layer, None where the layer uses its own hook. They were prepared for
        the tokens at ``positions``, this layer's own queries and keys, which they rotate
        (:meth:`~posenc_jax.functional.core.hooks.PreparedRotation.rotate_prepared`) with no
        positions compared: in self-attention where the attention rotates (:class:`_OwnTokens`),
        when decoding before the new keys are cached. A cache whose keys are re-rotated at every
        step (a rotation that follows the sequence length) uses the layer's own hooks.
        """
        implementation = self.implementation if implementation is None else implementation
        check_mesh(mesh, cache, implementation, ring)
        if kv is not None and prepared is not None:
            raise ValueError("prepared rotations are a model's, for self-attention: pass no kv with them")
        q = self.query(x)
        k = self.key(x if kv is None else kv[0])
        v = self.value(x if kv is None else kv[1])
        if self.normalize_qk:
            q, k = self.query_ln(q), self.key_ln(k)
        batch, length = x.shape[:2]
        own = self._hooks()
        rotations = self._prepared(prepared)  # per encoding: the model's prepared rotation, or None
        query_positions = positions
        key_positions = positions if key_positions is None else key_positions
        new_cache = None
        if cache is None:
            encodings = [hook if r is None else _OwnTokens(r) for hook, r in zip(own, rotations, strict=True)]
            encodings += list(shared)
        else:
            if not causal:
                raise ValueError("a KV cache needs causal attention: bidirectional layers cannot decode step by step")
            if segment_ids is not None:
                raise ValueError("decoding with a cache takes no segment_ids: decode one sequence per row")
            self.check_cache(cache)
            positions = jnp.broadcast_to(positions, (batch, length))
            encodings, terms = own + list(shared), []
            if _stores_rotated_keys(encodings):
                # A fixed reference position for rotations that need one (xPos's centre): the first cached token's.
                reference = jnp.where(cache.length > 0, cache.positions[:, :1], positions[:, :1])
                rest = [hook for hook, ready in zip(own, rotations, strict=True) if ready is None] + list(shared)
                ready = [rotation for rotation in rotations if rotation is not None]
                q, k = self._rotate_new_tokens(q, k, positions, rest, ready, reference)
                encodings = [hook for hook in rest if "rotate" not in hook_names(hook)]
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
            new_cache = cache.append_checked(k, v, positions, valid=key_mask, features=features, tables=tables)
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
            dropout_rng=dropout_key(self.dropout_rngs if rngs is None else rngs) if use_dropout else None,
            broadcast_dropout=bool(self.broadcast_dropout),
            block_q=self.block_q,
            block_k=self.block_k,
        )
        if mesh is not None:
            out = sequence_parallel_attention(q, k, v, mesh=mesh, ring=bool(ring), mask=mask, **arguments)
        elif mask is None:
            out = attend(q, k, v, implementation=implementation, positions_are_indices=indices, **arguments)
        else:  # Flax's boolean mask [B, heads|1, T, S] too: the public attention, which takes one
            out = dot_product_attention(q, k, v, mask=mask, implementation=implementation, **arguments)
        out = self.out(out)
        return out if cache is None else (out, new_cache)

    def _cache_terms(self) -> list:
        """The hooks whose per-key terms this layer's caches store."""
        return _cached_terms(self._hooks())

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
        rotations = [hook for hook in hooks if "rotate" in hook_names(hook)]
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
