"""The one attention function every encoding plugs into.

Scaled dot-product attention written with the survey pseudocode's einsums
(``'BTNH,BSNH->BNTS'`` then ``'BNTS,BSNH->BTNH'``), in four named stages:

1. **checks and context**: :func:`dot_product_attention` checks the arrays, shapes and
   positions (a module calls :func:`attend`, having checked its own), then :func:`_call` checks
   the masks and makes the call's mask and the
   :class:`~posenc_jax.functional.core.hooks.AttentionContext` every hook receives, once;
2. **scores** (:func:`attention_scores`): every ``rotate`` hook, then
   ``s = scale · q·k`` in float32 plus every ``logits`` term;
3. **weights** (:func:`attention_weights`): the boolean masks (causal by position, key
   padding, segment ids, any extra) and the ``normalize`` hook (softmax by default);
4. **output** (:func:`attention_output`): ``weights · v`` plus every ``values`` term.

Which path computes a call (``implementation``) is :mod:`~posenc_jax.functional.core.dispatch`'s rule.
Stage 1's checks and context are in :mod:`~posenc_jax.functional.core.checks`, stages 2 to 4 in
:mod:`~posenc_jax.functional.core.stages` (their public functions are importable from here too),
and the blockwise path's one tile loop in :mod:`~posenc_jax.functional.core.tiles`.

Masked keys never reach the output, whatever they hold. Weights are zeroed by
selection (``jnp.where``), but ``0 · NaN`` is NaN, so the value product must not
merely multiply masked values by zero weights either. What is exact and cheap:

* keys that no query of the call may see (key padding, a KV cache's empty slots, a
  fully masked key): their keys and values are replaced by zeros with one ``where``
  on ``[B, S, K, H]`` before the scores and before the product; when the mask is per
  key (``[B, 1, 1, S]``, e.g. ``key_mask`` alone, or a single decoding step) that is
  the whole story and the product is the plain einsum;
* keys that some queries see and others do not (causal, segments, a general mask):
  their values are read by the product of every row, so a non-finite value there
  would poison the rows that mask it. :func:`masked_value_product` is the einsum of
  the weights with the values' non-finite entries replaced by 0, plus, for each row,
  the non-finite entries of the keys it may see (``±inf``, or NaN for a NaN or both
  infinities), feature by feature for the first 8 keys holding one (8 gathered columns
  of the mask); a row that may see a further such key is NaN (which rows, from the mask
  parts in linear memory). No conditional: the same program for every input, under
  ``jit``, ``vmap``, ``grad`` and ``jvp``.

The causal, padding and segment masks are not stored. The mask is kept as its parts
(:class:`~posenc_jax.functional.core.masks.MaskParts`: positions for causality, key padding,
segment ids, an extra mask); the combined mask is a
comparison XLA computes inside each fusion that reads it; which keys some query sees,
and which queries see some key of a given set, come from the parts in linear memory, and
the value product gathers the few columns of the mask it needs. The softmax has no
selection after its exponential (masked scores are ``finfo.min``, seen ones at least
``finfo.min / 2``, so masked exponentials underflow to 0), the form XLA fuses into one
pass: on XLA:CPU the forward of causal attention is the score product, the masking, and
one fusion of the softmax with the value product (the weights are not stored).

Logits terms are added to the *already scaled* scores: a term bilinear in q (Shaw,
Transformer-XL) applies the context's scale itself, a bias (T5, ALiBi) is added as is.
The hooks are the protocols of :mod:`posenc_jax.functional.core.hooks`.

Axis letters: B batch, T query length, S key length, N query heads, K key/value
heads (N a multiple of K: grouped-query attention, query head n uses key/value
head n // (N / K)), H head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, blockwise_attention
from posenc_jax.functional.core.checks import (
    _Call,
    _call,
    _check_arrays,
    _check_settings,
    _check_shapes,
    _checked_positions,
    _score_scale,
)
from posenc_jax.functional.core.dispatch import (
    AUTO_TILED_FROM_LENGTH,
    FUSED_ATTENTION,
    IMPLEMENTATIONS,
    MATERIALIZE_LIMIT_BYTES,
    MATERIALIZE_LIMIT_BYTES_BY_BACKEND,
    PALLAS_ATTENTION,
    goes_blockwise,
    goes_blockwise_for,
    plain_scores,
)
from posenc_jax.functional.core.forms import Forms, declare_forms, forms_of
from posenc_jax.functional.core.hooks import (
    ATTENTION_HOOKS,
    AttentionContext,
    BiasHook,
    EncodingConfig,
    Normalize,
    attention_context,
    builds_itself,
    check_together,
    hook_names,
    parameter,
    pytree_dataclass,
)
from posenc_jax.functional.core.normalizers import as_normalizer, softmax_weights
from posenc_jax.functional.core.products import masked_value_product
from posenc_jax.functional.core.registry import resolve_encodings
from posenc_jax.functional.core.stages import _dropout, attention_output, attention_scores, attention_weights

__all__ = [
    "IMPLEMENTATIONS",
    "AUTO_TILED_FROM_LENGTH",
    "FUSED_ATTENTION",
    "MATERIALIZE_LIMIT_BYTES",
    "MATERIALIZE_LIMIT_BYTES_BY_BACKEND",
    "PALLAS_ATTENTION",
    "SharedBias",
    "attention_output",
    "attention_scores",
    "attend",
    "attention_weights",
    "dot_product_attention",
    "forward_terms",
    "goes_blockwise",
    "masked_value_product",
]


def __getattr__(name: str):
    # Deprecated: cond_over_batch moved to posenc_jax.functional.core.control.
    if name == "cond_over_batch":
        import warnings

        from posenc_jax.functional.core import control

        warnings.warn(
            "posenc_jax.functional.core.attention.cond_over_batch is deprecated: import it from "
            "posenc_jax.functional.core.control",
            DeprecationWarning,
            stacklevel=2,
        )
        return control.cond_over_batch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@pytree_dataclass
class SharedBias(BiasHook):
    """A bias computed once per forward and added by every layer (a ``logits`` hook).

    T5 and the other position-only biases (:class:`~posenc_jax.functional.core.hooks.PositionBias`)
    depend only on positions, so a model computes ``bias = hook.bias(context)`` once and
    passes ``SharedBias(bias)`` to each layer's attention.

    Args:
      bias: float array broadcastable to ``[B, N, T, S]``.
    """

    value: jax.Array = parameter()

    def bias(self, context: AttentionContext) -> jax.Array:
        return self.value


# One whole [.., T, S] array: no tile form (the tiles would each read the whole array; a model gives the
# tiles the hook itself instead: forward_terms), so blockwise attention refuses it and "auto" materialises.
# Several may be given together (one per bias): repeatable.
declare_forms(SharedBias, Forms(hooks=("logits",), tiled=None, prepared="bias", repeatable=True))


def _attention_hooks(encodings, *, causal: bool | None = None) -> list:
    """The encodings that act in attention, checked to make sense together.

    A parameter-free config that fills no hook at all (NoPE) adds nothing. The hooks each fills are
    those its class declared (:func:`~posenc_jax.functional.core.hooks.hook_names`): an object whose
    class declared none is refused here, naming ``declare_forms``. ``causal=None`` skips the check of
    causal-only forms (the dispatch rule, before the call is checked).
    """
    hooks = []
    for encoding in resolve_encodings(encodings):
        if isinstance(encoding, EncodingConfig) and not builds_itself(encoding):
            raise ValueError(
                f"{encoding!r} has learned parameters, which dot_product_attention does not hold: pass its built "
                f"hook (config.build(config.init(key, num_heads=N, head_dim=H, model_dim=D))) or use it in a module "
                f"(MultiHeadAttention, Transformer), which holds them"
            )
        names = hook_names(encoding)
        if set(names) & set(ATTENTION_HOOKS):
            hooks.append(encoding)
        elif not names and isinstance(encoding, EncodingConfig):
            continue
        elif names:
            raise ValueError(
                f"{type(encoding).__name__} fills the hooks {list(names)}, none of which act in attention; apply "
                f"it to the token embeddings (e.g. .embed(x, positions)) instead of passing it to "
                f"dot_product_attention"
            )
        else:
            raise ValueError(
                f"{encoding!r} fills none of the attention hooks {ATTENTION_HOOKS}; an encoding passed to "
                f"dot_product_attention must define at least one (see posenc_jax.functional.core.hooks)"
            )
    check_together(hooks, causal=causal)
    return hooks


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    query_positions=None,
    key_positions=None,
    encodings: Sequence = (),
    normalizer: Normalize | str | Callable[[jax.Array, jax.Array | None], jax.Array] = softmax_weights,
    causal: bool = False,
    key_mask: jax.Array | None = None,
    query_segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
    mask: jax.Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = False,
    return_weights: bool = False,
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
):
    """Multi-head scaled dot-product attention composing position-encoding hooks.

    ``out = normalize(scale · q' k'ᵀ + Σ logits, mask) · v + Σ values`` with
    ``(q', k') = rotate(q, k)``; by default ``normalize`` is softmax and
    ``scale = 1/√H`` (Vaswani et al. 2017, arXiv:1706.03762).

    Args:
      query: ``[B, T, N, H]`` (or ``[T, N, H]``).
      key: ``[B, S, K, H]``, with N a multiple of K.
      value: ``[B, S, K, H]``.
      query_positions: integer ``[T]`` or ``[B, T]``; required when ``causal`` or any
        encoding is given, and by a normaliser that reads positions (URPE).
      key_positions: integer ``[S]`` or ``[B, S]``; as above.
      encodings: hooks (:mod:`posenc_jax.functional.core.hooks`) applied in order (``[RoPE()]``;
        RoPE + ALiBi is two entries), or registered names of parameter-free encodings
        (``["rope", "alibi"]``); one with learned parameters is passed built (its hook).
      normalizer: the ``normalize`` hook (an object with ``normalize(scores, mask,
        context)``: ``softmax_weights``, ``l2_normalized_weights``, ``ReLU2()``, a built
        ``URPE``), a registered name (``"softmax"``, ``"l2"``, ``"relu2"``), or a plain
        function ``(scores [B,N,T,S] f32, mask) -> weights`` (materialising only; see
        :mod:`posenc_jax.functional.core.normalizers`). One whose class declares
        ``tiled=("weights",)`` runs blockwise.
      causal: mask keys whose position is after the query's position; encodings with
        a causal and a bidirectional form follow it unless set explicitly.
      key_mask: boolean ``[B, S]``, True for real (non-padding) keys.
      query_segment_ids, key_segment_ids: integer ``[B, T]`` / ``[B, S]``; a query
        attends only to keys of the same segment (packed sequences).
      mask: extra boolean mask broadcastable to ``[B, N, T, S]``, True = attend.
      scale: score scale; default ``1/√H``, or the scale an encoding prescribes.
        Encodings whose terms share the score scale (Shaw, Transformer-XL, DeBERTa,
        CoPE, the functional relative encoding) read it from the context.
      dropout_rate: dropout on the attention weights (needs ``dropout_rng``).
      dropout_rng: PRNG key for dropout.
      broadcast_dropout: one dropout mask ``[T, S]`` for every batch row and head (Flax's
        ``broadcast_dropout``); default False, one mask per weight.
      return_weights: also return the ``[B, N, T, S]`` float32 weights (materialising only).
      implementation: ``"materialize"`` computes the ``[B, N, T, S]`` scores in one piece;
        ``"blockwise"`` computes the same attention in tiles of ``block_q`` queries by
        ``block_k`` keys with an online softmax, in memory linear in T and S (see
        :mod:`posenc_jax.functional.core.blockwise`); ``"pallas"`` (opt-in): the flash-attention
        kernels of :mod:`posenc_jax.functional.kernels.pallas`; ``"auto"`` (default): blockwise
        above the backend's measured size, cuDNN on a GPU for plain attention of rotated q and k,
        else materialised, by the rule of :mod:`posenc_jax.functional.core.dispatch`.
      block_q, block_k: tile sizes for the blockwise path (default 512 each; any positive
        size, dividing the lengths or not), and for ``"pallas"`` (powers of two >= 16, default 128).

    Returns:
      ``[B, T, N, H]`` output in ``query``'s dtype (and the weights if asked).
      Scores, normalisation and value terms are computed in float32. A query
      with no key to attend to gets a zero output.

    Example:
      >>> q = k = v = jnp.ones((2, 5, 4, 8))
      >>> pos = jnp.arange(5)
      >>> dot_product_attention(q, k, v, query_positions=pos, key_positions=pos,
      ...                       causal=True).shape
      (2, 5, 4, 8)
    """
    _check_arrays(query, key, value)
    _check_settings(causal, scale, return_weights, dropout_rate)
    unbatched = query.ndim == 3
    query, key, value, per_token = _batched(query, key, value, (key_mask, query_segment_ids, key_segment_ids))
    _check_implementation(implementation, return_weights)
    normalizer = as_normalizer(normalizer)
    _check_shapes(query, key, value)
    hooks = _attention_hooks(encodings, causal=bool(causal))
    (batch, q_len), k_len = query.shape[:2], key.shape[1]  # the positions' one check on this call's way
    positions = _checked_positions(
        query_positions, key_positions, needed=causal or bool(hooks), q_len=q_len, k_len=k_len, batch=batch
    )
    settings = (scale, (dropout_rate, dropout_rng, bool(broadcast_dropout)), return_weights, implementation)
    call = (query, key, value, hooks, positions, normalizer, causal, (*per_token, mask), *settings, (block_q, block_k))
    out, weights = _attend(*call, positions_are_indices=None)  # read from the positions if they are concrete
    if unbatched:
        out, weights = out[0], None if weights is None else weights[0]
    return (out, weights) if return_weights else out


def _batched(query, key, value, per_token):
    """``query``, ``key``, ``value`` and the per-token arrays (None or ``[T]``/``[S]`` unbatched) with a batch
    axis of 1 when ``query`` is unbatched ``[T, N, H]``; as they are otherwise."""
    if query.ndim != 3:
        return query, key, value, per_token
    if key.ndim != 3 or value.ndim != 3:
        raise ValueError(f"unbatched query {query.shape} needs unbatched key/value, got {key.shape}, {value.shape}")
    return query[None], key[None], value[None], tuple(None if a is None else jnp.asarray(a)[None] for a in per_token)


def _check_implementation(implementation, return_weights) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation in ("blockwise", "pallas") and return_weights:
        raise ValueError(
            f"return_weights=True needs the [B, N, T, S] weights, which {implementation} attention never holds; use "
            "implementation='materialize' to get them"
        )


def attend(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    encodings: Sequence,
    query_positions: jax.Array,
    key_positions: jax.Array,
    normalizer,
    causal: bool,
    key_mask: jax.Array | None = None,
    query_segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    broadcast_dropout: bool = False,
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    positions_are_indices: bool = False,
) -> jax.Array:
    """:func:`dot_product_attention` for a module that has checked its arguments itself.

    The modules (:class:`~posenc_jax.nn.MultiHeadAttention`, and through it the Transformer)
    check their positions once, where they enter, and make q, k and v ``[B, T, N, H]`` /
    ``[B, S, K, H]`` by their own projections; this runs the attention on them without
    checking the positions again. The encodings, masks and implementation are checked as in
    :func:`dot_product_attention`, and the context is made as there.

    Args:
      query_positions, key_positions: int32 ``[T]`` / ``[S]`` or ``[B, T]`` / ``[B, S]`` as
        :func:`~posenc_jax.functional.core.positions.check_positions` returned them, fitting
        the query and key lengths (the same array twice in self-attention).
      positions_are_indices: the module made the positions itself as ``arange`` (none given, no
        cache): a fact its traced arrays cannot show, which lets ``"auto"`` hand causal attention
        with no term in the scores to a fused kernel (on a GPU: cuDNN).
      the others: as in :func:`dot_product_attention`.

    Returns:
      ``[B, T, N, H]`` in ``query``'s dtype.
    """
    hooks = _attention_hooks(encodings, causal=bool(causal))
    positions = (query_positions, key_positions)
    masks = (key_mask, query_segment_ids, key_segment_ids, None)
    normalizer, dropout = as_normalizer(normalizer), (dropout_rate, dropout_rng, bool(broadcast_dropout))
    out, _ = _attend(
        query,
        key,
        value,
        hooks,
        positions,
        normalizer,
        causal,
        masks,
        None,
        dropout,
        False,
        implementation,
        (block_q, block_k),
        positions_are_indices=positions_are_indices,
    )
    return out


def _attend(
    query,
    key,
    value,
    hooks,
    positions,
    normalizer,
    causal,
    masks,
    scale,
    dropout,
    return_weights,
    implementation,
    blocks,
    *,
    positions_are_indices: bool | None = False,
):
    """The attention of checked, batched arguments: the dispatch, the call's context (made once), the stages.

    ``positions``: ``(query_positions, key_positions)``; ``masks``: ``(key_mask, query_segment_ids,
    key_segment_ids, mask)``; ``dropout``: ``(rate, rng, broadcast)``; ``blocks``: ``(block_q, block_k)``;
    ``positions_are_indices``: whether the positions are ``arange``, None: read them (``dispatch.plain_scores``).
    Returns ``(out in query's dtype, float32 weights or None)``.
    """
    (query_positions, key_positions), (key_mask, query_segment_ids, key_segment_ids, mask) = positions, masks
    dropout_rate, dropout_rng, broadcast_dropout = dropout
    batch, q_len, num_heads, _ = query.shape
    blockwise = goes_blockwise_for(
        implementation,
        batch=batch,
        num_heads=num_heads,
        query_length=q_len,
        key_length=key.shape[1],
        hooks=hooks,
        normalizer=normalizer,
        return_weights=return_weights,
    )
    call = _call(
        query,
        key,
        value,
        hooks,
        query_positions=query_positions,
        key_positions=key_positions,
        causal=causal,
        key_mask=key_mask,
        query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids,
        mask=mask,
        scale=scale,
        build_mask=not blockwise and implementation != "pallas",
    )
    if implementation == "pallas":
        return PALLAS_ATTENTION(call, normalizer, masks, dropout, blocks).astype(query.dtype), None
    if (
        implementation == "auto"
        and FUSED_ATTENTION.implemented()
        and plain_scores(call, normalizer, masks, dropout_rate, return_weights, positions_are_indices)
    ):
        # The rotations are done (stage 1): what is left is a fused kernel's plain attention, in the inputs' dtype.
        q, k, v = call.query.astype(query.dtype), call.key.astype(key.dtype), call.value.astype(value.dtype)
        fused = FUSED_ATTENTION(q, k, v, causal=bool(causal), scale=call.context.scale)
        if fused is not None:
            return fused.astype(query.dtype), None
    if blockwise:
        out = _blockwise_call(
            call, call.key, call.value, normalizer, masks, *blocks, dropout_rate, dropout_rng, broadcast_dropout
        )
        return out.astype(query.dtype), None
    scores = attention_scores(call.query, call.key, call.hooks, call.context, mask_parts=call.mask_parts)
    weights = attention_weights(scores, call.mask, normalizer, call.context)
    out = attention_output(
        _dropout(weights, dropout_rate, dropout_rng, broadcast_dropout),
        call.value,
        call.hooks,
        call.context,
        mask_parts=call.mask_parts,
    )
    return out.astype(query.dtype), weights


def _blockwise_call(
    call: _Call,
    key,
    value,
    normalizer,
    masks,
    block_q,
    block_k,
    dropout_rate,
    dropout_rng,
    broadcast_dropout,
    ring=None,
) -> jax.Array:
    """Stage 1's ``call`` (made with ``build_mask=False``) computed in tiles: the blockwise attention of one
    device (``key``, ``value``: the call's), or of one device of a ring (``key``, ``value``: its shard) or of
    a sequence-parallel split (its queries). ``masks``: ``(key_mask, query_segment_ids, key_segment_ids,
    mask)``; ``block_q``, ``block_k``: None for the defaults. Float32 ``[B, T, N, H]``."""
    key_mask, query_segment_ids, key_segment_ids, mask = masks
    return blockwise_attention(
        call.query,
        key,
        value,
        hooks=call.hooks,
        normalizer=normalizer,
        context=call.context,
        key_mask=key_mask,
        query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids,
        mask=mask,
        block_q=DEFAULT_BLOCK_Q if block_q is None else block_q,
        block_k=DEFAULT_BLOCK_K if block_k is None else block_k,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        broadcast_dropout=broadcast_dropout,
        ring=ring,
    )


def forward_terms(
    hooks: Sequence,
    biases: Sequence,
    *,
    query_positions: jax.Array,
    key_positions: jax.Array,
    batch: int,
    num_heads: int,
    head_dim: int,
    causal: bool,
    normalizer=softmax_weights,
    implementation: str = "auto",
) -> tuple[list, list | None]:
    """What a model computes once per forward and gives every layer: ``(shared, prepared)``.

    ``shared``: the position-only biases (T5, ALiBi, ...: :class:`~posenc_jax.functional.core.hooks.PositionBias`
    hooks with one set of parameters for the whole model) in the form each layer adds them: a
    :class:`SharedBias` computed now when the layers materialise their scores, the hooks
    themselves when they go blockwise (each tile computes its own: a ``[B, N, T, S]`` bias
    would undo the tiling). The choice is the attention's dispatch rule, as each layer will
    make it. ``prepared``: for each of a layer's ``hooks``, the hook with its tables computed
    now when it is parameter-free and fills
    :class:`~posenc_jax.functional.core.hooks.PreparesTables` (RoPE), else None; None when
    there is none. A prepared hook is valid for the tokens at ``query_positions``: a layer
    rotates its own tokens by it (self-attention, or a decoding step's new tokens).

    Both are computed from one context, made here.

    Args:
      hooks: one layer's attention hooks (every layer has the same encodings).
      biases: the shared :class:`~posenc_jax.functional.core.hooks.PositionBias` hooks.
      query_positions, key_positions: int32 positions the model checked (the same array
        twice in a full forward; a decoding step's new tokens and the cache's keys).
      batch, num_heads, head_dim: B, N, H of the layers' attention.
      causal: the layers' attention direction.
      normalizer, implementation: the layers' (they enter the dispatch rule).

    Example:
      >>> from posenc_jax.functional import ALiBi, RoPE
      >>> pos = jnp.arange(6)
      >>> shared, prepared = forward_terms(
      ...     [RoPE()], [ALiBi()], query_positions=pos, key_positions=pos,
      ...     batch=1, num_heads=2, head_dim=8, causal=True)
      >>> type(shared[0]).__name__, shared[0].value.shape, type(prepared[0]).__name__
      ('SharedBias', (1, 2, 6, 6), 'RotaryTable')
    """
    context = attention_context(
        query_positions,
        key_positions,
        scale=_score_scale([*hooks, *biases], head_dim, None),
        causal=causal,
        head_dim=head_dim,
        num_heads=num_heads,
    )
    tiled = implementation == "pallas" or goes_blockwise_for(
        implementation,
        batch=batch,
        num_heads=num_heads,
        query_length=query_positions.shape[-1],
        key_length=context.key_length,
        hooks=[*hooks, *biases],
        normalizer=as_normalizer(normalizer),
    )
    shared = [bias if tiled else SharedBias(bias.bias(context)) for bias in biases]
    prepared = [
        hook.prepare(context, head_dim) if builds_itself(hook) and forms_of(hook).has("prepared", "tables") else None
        for hook in hooks
    ]
    return shared, prepared if any(hook is not None for hook in prepared) else None
