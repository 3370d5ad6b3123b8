"""Stages 2 to 4 of the materialising attention: scores, weights, output.

2. **scores** (:func:`attention_scores`): every ``rotate`` hook, then ``s = scale · q·k`` in
   float32 plus every ``logits`` term (the terms that split into per-query and per-key features
   joined to the content product);
3. **weights** (:func:`attention_weights`): the ``normalize`` hook (softmax by default) on the
   scores and the boolean mask;
4. **output** (:func:`attention_output`): ``weights · v`` plus every ``values`` term, masked keys
   never reaching the output whatever they hold (see :mod:`posenc_jax.functional.core.attention`).

Axis letters as in :mod:`posenc_jax.functional.core.attention`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.forms import forms_of
from posenc_jax.functional.core.hooks import AttentionContext, hook_names
from posenc_jax.functional.core.masks import MaskParts
from posenc_jax.functional.core.normalizers import as_normalizer
from posenc_jax.functional.core.operations import broadcast_to
from posenc_jax.functional.core.products import (
    as_scores,
    broadcasts_to,
    content_scores,
    masked_value_product,
    value_product,
)
from posenc_jax.functional.core.validation import check_key


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
        if "rotate" in hook_names(hook):
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
        term = hook.logits(query, key, context) if "logits" in hook_names(hook) else None
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
        term = hook.values(weights, context) if "values" in hook_names(hook) else None
        if term is not None:
            out = out + term.astype(jnp.float32)
    return out


def _dropout(weights: jax.Array, rate: float, rng, broadcast: bool = False) -> jax.Array:
    """Dropout on ``weights`` ``[B, N, T, S]``: one mask per weight, or with ``broadcast`` one ``[T, S]`` mask
    for every batch row and head (Flax's ``broadcast_dropout``)."""
    if rate == 0.0:
        return weights
    if rng is None:
        raise ValueError(f"dropout_rate={rate} needs a dropout_rng PRNG key")
    check_key("dropout_rng", rng)
    shape = (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast else weights.shape
    keep = jax.random.bernoulli(rng, 1.0 - rate, shape)
    return jnp.where(keep, weights / (1.0 - rate), 0.0)
