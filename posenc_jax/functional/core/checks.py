"""Stage 1 of the attention: the checks of a call's arguments, and the call's masks and context.

:func:`~posenc_jax.functional.core.attention.dot_product_attention` checks the arrays, the
settings, the shapes and the positions here; :func:`_call` checks the masks, makes the call's
mask parts and the one :class:`~posenc_jax.functional.core.hooks.AttentionContext` every hook
of the call receives. Each bad argument gets a one-line error naming the value and the fix.

Axis letters as in :mod:`posenc_jax.functional.core.attention`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.forms import forms_of
from posenc_jax.functional.core.hooks import (
    AttentionContext,
    attention_context,
)
from posenc_jax.functional.core.masks import MaskParts, key_padding_mask, sequence_key_counts
from posenc_jax.functional.core.positions import check_positions
from posenc_jax.functional.core.products import (
    as_scores,
    broadcasts_to,
)


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
    prescribed = {float(hook.score_scale(head_dim)) for hook in hooks if forms_of(hook).has("scale", "prescribed")}
    if len(prescribed) > 1:
        raise ValueError(f"the encodings prescribe different score scales {sorted(prescribed)}; pass scale= explicitly")
    scale = prescribed.pop() if prescribed else float(1.0 / np.sqrt(head_dim))
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"an encoding prescribes the score scale {scale}; it must be a finite number > 0")
    return scale


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
