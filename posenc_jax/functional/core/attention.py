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

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, blockwise_attention, check_blockwise
from posenc_jax.functional.core.forms import Forms, declare_forms, forms_of
from posenc_jax.functional.core.hooks import (
    ATTENTION_HOOKS,
    AttentionContext,
    BiasHook,
    EncodingConfig,
    Logits,
    Normalize,
    ParameterFree,
    Rotate,
    ScoreScale,
    Values,
    attention_context,
    check_together,
    hook_names,
    parameter,
    pytree_dataclass,
)
from posenc_jax.functional.core.masks import MaskParts, key_padding_mask, sequence_key_counts
from posenc_jax.functional.core.normalizers import as_normalizer, softmax_weights
from posenc_jax.functional.core.operations import broadcast_to
from posenc_jax.functional.core.positions import check_positions
from posenc_jax.functional.core.products import (
    as_scores,
    broadcasts_to,
    content_scores,
    masked_value_product,
    value_product,
)
from posenc_jax.functional.core.registry import resolve_encodings
from posenc_jax.functional.core.validation import check_key

__all__ = [
    "IMPLEMENTATIONS",
    "MATERIALIZE_LIMIT_BYTES",
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


IMPLEMENTATIONS = ("auto", "materialize", "blockwise")
# "auto" goes blockwise when the float32 [B, N, T, S] scores would exceed this many bytes.
MATERIALIZE_LIMIT_BYTES = 1 << 30


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


declare_forms(SharedBias, Forms(prepared="bias"))


def _attention_hooks(encodings, *, causal: bool | None = None) -> list:
    """The encodings that act in attention, checked to make sense together.

    A parameter-free config that fills no hook at all (NoPE) adds nothing. ``causal=None``
    skips the check of causal-only forms (the dispatch rule, before the call is checked).
    """
    hooks = []
    for encoding in resolve_encodings(encodings):
        names = hook_names(encoding)
        if isinstance(encoding, EncodingConfig) and not isinstance(encoding, ParameterFree):
            raise ValueError(
                f"{encoding!r} has learned parameters, which dot_product_attention does not hold: pass its built "
                f"hook (config.build(config.init(key, num_heads=N, head_dim=H, model_dim=D))) or use it in a module "
                f"(MultiHeadAttention, Transformer), which holds them"
            )
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
    check_together([h for h in hooks if not isinstance(h, SharedBias)], causal=causal)
    return hooks


def _check_arrays(query, key, value) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(
                f"{name} must be an array [B, T, N, H] (or [T, N, H]), got {type(x).__name__}; wrap it with jnp.asarray"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{name} must be a floating array (float32, bfloat16, float16 or float64), got {x.dtype}; cast it, "
                f"e.g. {name}.astype(jnp.float32)"
            )


def _check_settings(causal, scale, return_weights, dropout_rate) -> None:
    for name, flag in (("causal", causal), ("return_weights", return_weights)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    for name, number in (("scale", 1.0 if scale is None else scale), ("dropout_rate", dropout_rate)):
        if isinstance(number, (bool, np.bool_)) or not isinstance(number, (int, float, np.number)):
            raise TypeError(f"{name} must be a number, got {number!r}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")


def _check_shapes(query, key, value):
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            f"query, key and value must be [B, T, N, H], [B, S, K, H], [B, S, K, H] "
            f"(or unbatched [T, N, H], ...), got {query.shape}, {key.shape}, {value.shape}"
        )
    batch, _, num_heads, head_dim = query.shape
    if num_heads < 1 or key.shape[2] < 1:
        raise ValueError(
            f"query and key/value need at least one head (N >= 1, K >= 1), got N={num_heads} and K={key.shape[2]} "
            f"(shapes {query.shape}, {key.shape})"
        )
    if head_dim < 1:
        raise ValueError(f"the head dim H must be >= 1, got {head_dim} (query shape {query.shape})")
    if query.shape[1] < 1:
        raise ValueError(f"attention needs at least one query, got T=0 (query shape {query.shape})")
    if key.shape[1] < 1:
        raise ValueError(
            f"attention needs at least one key, got S=0 (key shape {key.shape}); with a KV cache, append the "
            f"step's keys before attending"
        )
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key and value must agree on [B, S, K], got {key.shape} and {value.shape}")
    if key.shape[0] != batch:
        raise ValueError(f"query and key batch sizes differ: {query.shape} vs {key.shape}")
    if key.shape[3] != head_dim:
        raise ValueError(f"query and key head dims differ: {head_dim} vs {key.shape[3]}")
    if num_heads % key.shape[2]:
        raise ValueError(
            f"number of query heads N={num_heads} must be a multiple of key/value heads "
            f"K={key.shape[2]} for grouped-query attention"
        )


def _check_per_token(array, length: int, batch: int, name: str):
    shape = np.shape(array)
    if len(shape) != 2 or shape[1] != length or shape[0] not in (1, batch):
        raise ValueError(f"{name} must have shape [{batch}, {length}] (or [1, {length}]), got {shape}")


def _check_position_shape(positions, length: int, batch: int, name: str):
    if (
        positions.shape[-1] != length
        or positions.ndim > 2
        or (positions.ndim == 2 and positions.shape[0] not in (1, batch))
    ):
        raise ValueError(f"{name} must have shape [{length}] or [{batch}, {length}], got {positions.shape}")


def _checked_positions(query_positions, key_positions, *, needed: bool, q_len: int, k_len: int, batch: int):
    if needed and (query_positions is None or key_positions is None):
        raise ValueError(
            "query_positions and key_positions are required with causal=True or encodings; "
            f"for a plain sequence pass jnp.arange({q_len}) and jnp.arange({k_len})"
        )
    if (query_positions is None) != (key_positions is None):
        raise ValueError("pass both query_positions and key_positions (for self-attention, the same array twice)")
    if query_positions is None:
        return None, None
    same = key_positions is query_positions
    query_positions = check_positions(query_positions, "query_positions")
    # Self-attention keeps one array, so hooks can compute position tables once.
    key_positions = query_positions if same else check_positions(key_positions, "key_positions")
    _check_position_shape(query_positions, q_len, batch, "query_positions")
    _check_position_shape(key_positions, k_len, batch, "key_positions")
    return query_positions, key_positions


def _check_masks(key_mask, query_segment_ids, key_segment_ids, mask, *, q_len, k_len, batch, num_heads):
    if (query_segment_ids is None) != (key_segment_ids is None):
        raise ValueError("pass both query_segment_ids and key_segment_ids (for self-attention, the same array twice)")
    if query_segment_ids is not None:
        _check_per_token(query_segment_ids, q_len, batch, "query_segment_ids")
        _check_per_token(key_segment_ids, k_len, batch, "key_segment_ids")
    if key_mask is not None:
        _check_per_token(key_mask, k_len, batch, "key_mask")
    if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
        raise ValueError(
            f"mask must be boolean (True = attend), got dtype {jnp.asarray(mask).dtype}; "
            f"an additive float bias belongs in an encoding's logits hook (e.g. SharedBias)"
        )
    if mask is not None:
        scores = (batch, num_heads, q_len, k_len)
        if not broadcasts_to(np.shape(mask), scores):
            raise ValueError(
                f"mask of shape {np.shape(mask)} does not broadcast to the scores [B, N, T, S] = {scores}; pass a "
                f"boolean mask of shape [B|1, N|1, T|1, S|1] (True = attend)"
            )


def _score_scale(hooks, head_dim: int, scale: float | None) -> float:
    """An explicit scale, else the one an encoding prescribes (all must agree), else 1/√H."""
    if scale is not None:
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0 (default 1/√H = {head_dim**-0.5:.4g}), got {scale}")
        return scale
    prescribed = {float(hook.score_scale(head_dim)) for hook in hooks if isinstance(hook, ScoreScale)}
    if len(prescribed) > 1:
        raise ValueError(f"the encodings prescribe different score scales {sorted(prescribed)}; pass scale= explicitly")
    scale = prescribed.pop() if prescribed else float(1.0 / np.sqrt(head_dim))
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"an encoding prescribes the score scale {scale}; it must be a finite number > 0")
    return scale


def _mask_parts(context: AttentionContext, mask_parts: MaskParts | None) -> MaskParts:
    """The call's mask parts; a stage called on its own has only the context's combined mask."""
    return MaskParts(extra=context.mask) if mask_parts is None else mask_parts


def _hide_unseen_keys(x: jax.Array, seen: jax.Array | None) -> jax.Array:
    """Keys or values ``[B, S, K, H]`` zeroed where ``seen`` (``[B|1, S]``) is False (padding, empty cache slots)."""
    if seen is None:
        return x
    return jnp.where(seen[:, :, None, None], x, jnp.zeros((), x.dtype))


def attention_scores(
    query: jax.Array,
    key: jax.Array,
    hooks: Sequence,
    context: AttentionContext,
    *,
    mask_parts: MaskParts | None = None,
) -> jax.Array:
    """Stage 2: rotate q and k, then ``scale · q·k`` (float32 ``[B, N, T, S]``) plus every logits term.

    Keys that no query may see (``context.mask``) are zeroed first, so whatever they
    hold reaches neither another key's score nor a gradient. ``mask_parts`` (the parts
    ``context.mask`` was made of) lets that be found without reducing the ``[B, N, T, S]`` mask.
    """
    key = _hide_unseen_keys(key, _mask_parts(context, mask_parts).keys_seen())
    for hook in hooks:
        if isinstance(hook, Rotate):
            query, key = hook.rotate(query, key, context)
    # Terms that split into per-query and per-key features join the content product (exact:
    # the same sums, one contraction), so they are never a [B, N, T, S] buffer of their own.
    joinable = query.dtype == jnp.float32 and key.dtype == jnp.float32 and context.scale != 0
    joined = [h for h in hooks if joinable and forms_of(h).has("fused", "features")]
    # Joining copies every key with its features (S·(H + F) values per head) to spare storing the
    # term (T·S per head): worth it from T > H + F on, not when decoding a few tokens against a
    # cache (there the copy of the whole cache each step slowed the step).
    widths = sum(jax.eval_shape(lambda h=h: h.score_features(query, key, context))[1].shape[-1] for h in joined)
    if query.shape[1] <= key.shape[-1] + widths:
        joined = []
    features = [hook.score_features(query, key, context) for hook in joined]
    score_query, score_key = query, key  # the content product's operands, with any joined features
    if joined:
        per_key = [
            jnp.broadcast_to(fk[:, :, None, :], (key.shape[0], key.shape[1], key.shape[2], fk.shape[-1]))
            for _, fk in features
        ]
        score_query = jnp.concatenate([query, *(fq.astype(jnp.float32) for fq, _ in features)], axis=-1)
        score_key = jnp.concatenate([key, *(fk.astype(jnp.float32) for fk in per_key)], axis=-1)

    def content() -> jax.Array:
        return content_scores(score_query, score_key, context.scale)

    # The other hooks read q and k as they are, without the joined features.
    scores = None  # the content scores, made when the first hook needs them
    for hook in hooks:
        if any(hook is j for j in joined):
            continue
        if forms_of(hook).has("fused", "rows"):
            if scores is None and not joined and forms_of(hook).has("fused", "rows_from_content"):
                # The first term, on scores that are exactly scale · q·k: the hook makes them itself.
                scores = hook.add_logits_to_content(content, query, key, context)
            else:
                scores = hook.add_logits(content() if scores is None else scores, query, key, context)
            continue
        term = hook.logits(query, key, context) if isinstance(hook, Logits) else None
        if term is not None:
            scores = content() if scores is None else scores
            term = as_scores(term, scores.ndim)
            if not broadcasts_to(term.shape, scores.shape):
                raise ValueError(
                    f"{type(hook).__name__}'s logits term has shape {term.shape}, which does not broadcast to the "
                    f"scores [B, N, T, S] = {scores.shape}; per-head parameters must be made for N={scores.shape[1]}"
                )
            scores = scores + broadcast_to(term, scores.shape)
    return content() if scores is None else scores


def attention_weights(scores: jax.Array, mask: jax.Array | None, normalizer, context: AttentionContext) -> jax.Array:
    """Stage 3: float32 weights from the scores and the boolean mask.

    ``normalizer`` is a :class:`~posenc_jax.functional.core.hooks.Normalize` hook (it is given
    the context: URPE reads the positions), a registered name, or a plain function
    ``(scores, mask) -> weights`` (see :func:`~posenc_jax.functional.core.normalizers.as_normalizer`).
    A hook gives zero weight where the mask is False itself.
    """
    return as_normalizer(normalizer).normalize(scores, mask, context).astype(jnp.float32)


def attention_output(
    weights: jax.Array,
    value: jax.Array,
    hooks: Sequence,
    context: AttentionContext,
    *,
    mask_parts: MaskParts | None = None,
) -> jax.Array:
    """Stage 4: ``weights · v`` plus every values term, float32 ``[B, T, N, H]``.

    Masked keys (``context.mask``) never reach the output, whatever their values hold
    (see the module docstring for how this stays cheap). ``mask_parts``: the parts
    ``context.mask`` was made of, as in :func:`attention_scores`.
    """
    mask_parts = _mask_parts(context, mask_parts)
    value = _hide_unseen_keys(value, mask_parts.keys_seen())
    if context.mask is None or mask_parts.per_key():
        out = value_product(weights, value)
    else:
        # A key hidden from some queries only still enters their rows as 0 · v.
        out = masked_value_product(weights, value, mask_parts)
    for hook in hooks:
        term = hook.values(weights, context) if isinstance(hook, Values) else None
        if term is not None:
            out = out + term.astype(jnp.float32)
    return out


def _dropout(weights: jax.Array, rate: float, rng) -> jax.Array:
    if rate == 0.0:
        return weights
    if rng is None:
        raise ValueError(f"dropout_rate={rate} needs a dropout_rng PRNG key")
    check_key("dropout_rng", rng)
    keep = jax.random.bernoulli(rng, 1.0 - rate, weights.shape)
    return jnp.where(keep, weights / (1.0 - rate), 0.0)


@dataclasses.dataclass(frozen=True)
class _Call:
    """Stage 1's result: the batched inputs, the hooks that act, the mask and the context."""

    query: jax.Array
    key: jax.Array
    value: jax.Array
    hooks: list
    mask: jax.Array | None
    context: AttentionContext
    mask_parts: MaskParts | None


def _call(
    query,
    key,
    value,
    hooks,
    *,
    query_positions,
    key_positions,
    causal,
    key_mask,
    query_segment_ids,
    key_segment_ids,
    mask,
    scale,
    build_mask: bool = True,
) -> _Call:
    """Stage 1, after the entry point's checks: the call's masks checked, its mask parts and its context.

    Positions are taken as the entry point checked them (``dot_product_attention``, or a module
    that checked its own), int32 or None; the context is made here, once per call, by
    :func:`~posenc_jax.functional.core.hooks.attention_context`. With ``build_mask=False``
    (blockwise attention) the ``[B, N, T, S]`` mask is not built: the context's mask is None
    and each tile builds its own.
    """
    batch, q_len, num_heads, head_dim = query.shape
    k_len = key.shape[1]
    _check_masks(
        key_mask, query_segment_ids, key_segment_ids, mask, q_len=q_len, k_len=k_len, batch=batch, num_heads=num_heads
    )
    key_valid = None if key_mask is None else key_padding_mask(key_mask)[:, 0, 0, :]
    mask_parts = full_mask = None
    if build_mask:
        mask_parts = MaskParts(
            query_positions=query_positions if causal else None,
            key_positions=key_positions if causal else None,
            key_valid=key_valid,
            query_segment_ids=None if query_segment_ids is None else jnp.asarray(query_segment_ids),
            key_segment_ids=None if key_segment_ids is None else jnp.asarray(key_segment_ids),
            extra=None if mask is None else as_scores(jnp.asarray(mask), 4, dtype=jnp.bool_),
        )
        # Comparisons of positions and ids: XLA computes them inside each fusion that reads them.
        full_mask = mask_parts.mask()
    # Unused terms cost nothing under jit (dead code); relu²/n reads the sequence lengths.
    sequence_lengths = sequence_key_counts(key_valid, query_segment_ids, key_segment_ids)
    context = attention_context(
        query_positions,
        key_positions,
        scale=_score_scale(hooks, head_dim, scale),
        causal=bool(causal),
        head_dim=head_dim,
        num_heads=num_heads,
        key_length=k_len,
        mask=full_mask,
        sequence_lengths=sequence_lengths,
    )
    return _Call(query, key, value, hooks, full_mask, context, mask_parts)


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
      encodings: hooks filling ``rotate``/``logits``/``values`` (see
        :mod:`posenc_jax.functional.core.hooks`), applied in order (e.g. ``[RoPE()]``;
        hybrids like RoPE + ALiBi are two entries), or, as the modules take them, the
        registered names of parameter-free encodings (``["rope", "alibi"]``; see
        :func:`~posenc_jax.functional.encoding_names`). An encoding with learned
        parameters is passed built (its hook), as the function holds no parameters.
      normalizer: the ``normalize`` hook (an object with ``normalize(scores, mask,
        context)``: ``softmax_weights``, ``l2_normalized_weights``, ``ReLU2()``, a built
        ``URPE``), a registered name (``"softmax"``, ``"l2"``, ``"relu2"``), or a plain
        function ``(scores [B,N,T,S] f32, mask) -> weights`` (materialising only; see
        :mod:`posenc_jax.functional.core.normalizers`). A hook that also fills
        :class:`~posenc_jax.functional.core.hooks.TiledNormalize` runs blockwise.
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
      return_weights: also return the ``[B, N, T, S]`` float32 weights (materialising only).
      implementation: ``"materialize"`` computes the ``[B, N, T, S]`` scores in one piece;
        ``"blockwise"`` computes the same attention in tiles of ``block_q`` queries by
        ``block_k`` keys with an online softmax, in memory linear in T and S (see
        :mod:`posenc_jax.functional.core.blockwise`); ``"auto"`` (default) goes blockwise when
        the float32 scores would take more than ``MATERIALIZE_LIMIT_BYTES`` (1 GiB) and every
        hook and the normaliser have a blockwise form.
      block_q, block_k: tile sizes for the blockwise path (default 512 each; any positive
        size, dividing the lengths or not).

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
    if unbatched:
        if key.ndim != 3 or value.ndim != 3:
            raise ValueError(f"unbatched query {query.shape} needs unbatched key/value, got {key.shape}, {value.shape}")
        query, key, value = query[None], key[None], value[None]
        key_mask, query_segment_ids, key_segment_ids = (
            None if a is None else jnp.asarray(a)[None] for a in (key_mask, query_segment_ids, key_segment_ids)
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "blockwise" and return_weights:
        raise ValueError(
            "return_weights=True needs the [B, N, T, S] weights, which blockwise attention never holds; use "
            "implementation='materialize' to get them"
        )
    normalizer = as_normalizer(normalizer)
    _check_shapes(query, key, value)
    batch, q_len = query.shape[:2]
    hooks = _attention_hooks(encodings, causal=bool(causal))
    # The one check of the positions on this call's way: below, they travel in its context.
    query_positions, key_positions = _checked_positions(
        query_positions,
        key_positions,
        needed=causal or bool(hooks),
        q_len=q_len,
        k_len=key.shape[1],
        batch=batch,
    )
    out, weights = _attend(
        query,
        key,
        value,
        hooks,
        query_positions=query_positions,
        key_positions=key_positions,
        normalizer=normalizer,
        causal=causal,
        key_mask=key_mask,
        query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids,
        mask=mask,
        scale=scale,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        return_weights=return_weights,
        implementation=implementation,
        block_q=block_q,
        block_k=block_k,
    )
    if unbatched:
        out, weights = out[0], None if weights is None else weights[0]
    return (out, weights) if return_weights else out


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
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
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
      the others: as in :func:`dot_product_attention`.

    Returns:
      ``[B, T, N, H]`` in ``query``'s dtype.
    """
    hooks = _attention_hooks(encodings, causal=bool(causal))
    out, _ = _attend(
        query,
        key,
        value,
        hooks,
        query_positions=query_positions,
        key_positions=key_positions,
        normalizer=as_normalizer(normalizer),
        causal=causal,
        key_mask=key_mask,
        query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids,
        mask=None,
        scale=None,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        return_weights=False,
        implementation=implementation,
        block_q=block_q,
        block_k=block_k,
    )
    return out


def _attend(
    query,
    key,
    value,
    hooks,
    *,
    query_positions,
    key_positions,
    normalizer,
    causal,
    key_mask,
    query_segment_ids,
    key_segment_ids,
    mask,
    scale,
    dropout_rate,
    dropout_rng,
    return_weights,
    implementation,
    block_q,
    block_k,
):
    """The attention of checked, batched arguments: the dispatch, the call's context (made once), the stages.

    Returns ``(out in query's dtype, float32 weights or None)``.
    """
    batch, q_len, num_heads, _ = query.shape
    blockwise = _goes_blockwise(
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
        build_mask=not blockwise,
    )
    if blockwise:
        out = blockwise_attention(
            call.query,
            call.key,
            call.value,
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
        )
        return out.astype(query.dtype), None
    scores = attention_scores(call.query, call.key, call.hooks, call.context, mask_parts=call.mask_parts)
    weights = attention_weights(scores, call.mask, normalizer, call.context)
    out = attention_output(
        _dropout(weights, dropout_rate, dropout_rng), call.value, call.hooks, call.context, mask_parts=call.mask_parts
    )
    return out.astype(query.dtype), weights


def _goes_blockwise(
    implementation: str,
    *,
    batch: int,
    num_heads: int,
    query_length: int,
    key_length: int,
    hooks: Sequence,
    normalizer,
    return_weights: bool = False,
) -> bool:
    """The dispatch rule: :func:`goes_blockwise` by size, and ``"auto"`` materialises what has no
    blockwise form or whose weights are asked for (the caller did not ask for blockwise)."""
    tiled = goes_blockwise(
        implementation, batch=batch, num_heads=num_heads, query_length=query_length, key_length=key_length
    )
    if implementation != "auto":
        return tiled
    return tiled and not return_weights and _has_blockwise_form(hooks, normalizer)


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
    tiled = _goes_blockwise(
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
        hook.prepare(context, head_dim)
        if isinstance(hook, ParameterFree) and forms_of(hook).has("prepared", "tables")
        else None
        for hook in hooks
    ]
    return shared, prepared if any(hook is not None for hook in prepared) else None


def goes_blockwise(implementation: str, *, batch: int, num_heads: int, query_length: int, key_length: int) -> bool:
    """Whether ``implementation`` computes attention of these sizes in tiles.

    ``"auto"`` does when the float32 ``[B, N, T, S]`` scores would exceed
    ``MATERIALIZE_LIMIT_BYTES`` (and then falls back to materialising for a hook or
    normaliser without a blockwise form, which this size rule does not see; a model's
    per-forward terms follow the whole rule: :func:`forward_terms`).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation != "auto":
        return implementation == "blockwise"
    return 4 * batch * num_heads * query_length * key_length > MATERIALIZE_LIMIT_BYTES


def _has_blockwise_form(hooks, normalizer) -> bool:
    try:
        check_blockwise(hooks, normalizer)
    except ValueError:
        return False
    return True
