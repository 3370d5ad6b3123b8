"""The one attention function every encoding plugs into.

Scaled dot-product attention written with the seed's einsums
(``'BTNH,BSNH->BNTS'`` then ``'BNTS,BSNH->BTNH'``), composing the hooks of the
design in this order:

1. ``rotate(q, k, query_positions, key_positions) -> (q, k)`` (RoPE family);
2. scores ``s = scale * q·k`` in float32, plus the sum of every
   ``logits(q, k, query_positions, key_positions)`` term (additive biases);
3. boolean masks (causal by position, key padding, segment ids, any extra);
4. ``normalizer(scores, mask) -> weights`` (softmax by default);
5. ``out = weights · v`` plus every ``values(weights, query_positions, key_positions)`` term.

An encoding is any object with some of the methods ``rotate``, ``logits`` and
``values`` (a hook may return None to add nothing); it may declare the hooks it
fills in a ``hooks`` class attribute, and a ``score_scale(head_dim)`` method when
its method prescribes the content-score scale (DeBERTa's ``1/√(3H)``).
Logits terms are added to the *already scaled* scores: a term bilinear in q
(Shaw, Transformer-XL) applies its own scale, a bias (T5, ALiBi) is added as is.

Axis letters: B batch, T query length, S key length, N query heads, K key/value
heads (N a multiple of K: grouped-query attention, query head n uses key/value
head n // (N / K)), H head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.masks import causal_mask, combine_masks, key_padding_mask, segment_mask
from posenc_jax.functional.positions import check_positions

__all__ = ["SharedBias", "dot_product_attention", "softmax_weights"]

_ATTENTION_HOOKS = ("rotate", "logits", "values")


def softmax_weights(scores: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Masked softmax over keys: ``w = exp(s - max s) · mask / Σ exp(s - max s) · mask``.

    The default ``normalize`` hook. A row with no unmasked key gives all-zero
    weights (not NaN), and so do its gradients.

    Args:
      scores: ``[B, N, T, S]`` float32 scores.
      mask: boolean, broadcastable to ``scores`` (True = attend), or None.

    Returns:
      ``[B, N, T, S]`` float32 weights; each row sums to 1, or to 0 if fully masked.
    """
    scores = scores.astype(jnp.float32)
    if mask is None:
        return jax.nn.softmax(scores, axis=-1)
    # finfo.min rather than -inf keeps (s - max) finite on fully masked rows.
    # finfo.min also replaces -inf terms, so a row of -inf scores cannot produce NaN.
    masked = jnp.where(mask, jnp.maximum(scores, jnp.finfo(jnp.float32).min), jnp.finfo(jnp.float32).min)
    shifted = masked - jax.lax.stop_gradient(masked.max(axis=-1, keepdims=True))
    unnormalized = jnp.where(mask, jnp.exp(shifted), 0.0)
    total = unnormalized.sum(axis=-1, keepdims=True)
    return unnormalized / jnp.where(total > 0, total, 1.0)


@dataclasses.dataclass(frozen=True)
class SharedBias:
    """A bias computed once per forward and added by every layer (a ``logits`` hook).

    T5 and the other Toeplitz biases depend only on positions, so a model
    computes ``bias = T5Bias(table).bias(q_pos, k_pos)`` once and passes
    ``SharedBias(bias)`` to each layer's attention.

    Args:
      bias: float array broadcastable to ``[B, N, T, S]``.
    """

    bias: jax.Array
    hooks: ClassVar[frozenset[str]] = frozenset({"logits"})

    def logits(self, q, k, query_positions, key_positions):
        return self.bias


def _hooks_of(encoding) -> tuple[Callable | None, Callable | None, Callable | None]:
    declared = getattr(encoding, "hooks", None)
    found = tuple(getattr(encoding, name, None) for name in _ATTENTION_HOOKS)
    if declared is not None and declared and not (set(declared) & set(_ATTENTION_HOOKS)):
        raise ValueError(
            f"{type(encoding).__name__} fills the hooks {sorted(declared)}, none of which act in "
            f"attention; apply it to the token embeddings (e.g. .embed(x, positions)) instead of "
            f"passing it to dot_product_attention"
        )
    missing = sorted(set(declared or ()) & set(_ATTENTION_HOOKS) - {n for n, f in zip(_ATTENTION_HOOKS, found) if f})
    if missing:
        raise ValueError(f"{type(encoding).__name__} declares the hooks {missing} but has no such methods")
    if declared is None and not any(found):
        raise ValueError(
            f"{encoding!r} has none of the attention hooks {_ATTENTION_HOOKS}; an encoding passed "
            f"to dot_product_attention must define at least one"
        )
    return found


def _as_scores(term: jax.Array, ndim: int) -> jax.Array:
    """A logits term as float32, left-padded to the rank of the [B, N, T, S] scores."""
    term = term.astype(jnp.float32)
    return term.reshape((1,) * (ndim - term.ndim) + term.shape) if term.ndim < ndim else term


def _check_shapes(query, key, value):
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            f"query, key and value must be [B, T, N, H], [B, S, K, H], [B, S, K, H] "
            f"(or unbatched [T, N, H], ...), got {query.shape}, {key.shape}, {value.shape}"
        )
    batch, _, num_heads, head_dim = query.shape
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key and value must agree on [B, S, K], got {key.shape} and {value.shape}")
    if key.shape[0] != batch:
        raise ValueError(f"query and key batch sizes differ: {query.shape} vs {key.shape}")
    if key.shape[3] != head_dim:
        raise ValueError(f"query and key head dims differ: {head_dim} vs {key.shape[3]}")
    num_kv_heads = key.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"number of query heads N={num_heads} must be a multiple of key/value heads "
            f"K={num_kv_heads} for grouped-query attention"
        )


def _check_per_token(array, length: int, batch: int, name: str):
    shape = np.shape(array)
    if len(shape) != 2 or shape[1] != length or shape[0] not in (1, batch):
        raise ValueError(f"{name} must have shape [{batch}, {length}] (or [1, {length}]), got {shape}")


def _check_position_shape(positions, length: int, batch: int, name: str):
    if positions.shape[-1] != length or positions.ndim > 2 or (
        positions.ndim == 2 and positions.shape[0] not in (1, batch)
    ):
        raise ValueError(f"{name} must have shape [{length}] or [{batch}, {length}], got {positions.shape}")


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    query_positions=None,
    key_positions=None,
    encodings: Sequence = (),
    normalizer: Callable[[jax.Array, jax.Array | None], jax.Array] = softmax_weights,
    causal: bool = False,
    key_mask: jax.Array | None = None,
    query_segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
    mask: jax.Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    return_weights: bool = False,
):
    """Multi-head scaled dot-product attention composing position-encoding hooks.

    ``out = normalize(scale · q' k'ᵀ + Σ logits, mask) · v + Σ values`` with
    ``(q', k') = rotate(q, k)``; by default ``normalize`` is softmax and
    ``scale = 1/√H`` (Vaswani et al. 2017, arXiv:1706.03762).

    Args:
      query: ``[B, T, N, H]`` (or ``[T, N, H]``).
      key: ``[B, S, K, H]``, with N a multiple of K.
      value: ``[B, S, K, H]``.
      query_positions: integer ``[T]`` or ``[B, T]``; required when ``causal`` or
        any encoding is given.
      key_positions: integer ``[S]`` or ``[B, S]``; as above.
      encodings: objects filling ``rotate``/``logits``/``values`` hooks, applied
        in order (e.g. ``[RoPE()]``; hybrids like RoPE + ALiBi are two entries).
      normalizer: the ``normalize`` hook, ``(scores [B,N,T,S] f32, mask) -> weights``
        (see :mod:`posenc_jax.functional.normalizers`); one with ``uses_positions``
        (URPE) is also given ``query_positions`` and ``key_positions``.
      causal: mask keys whose position is after the query's position.
      key_mask: boolean ``[B, S]``, True for real (non-padding) keys.
      query_segment_ids, key_segment_ids: integer ``[B, T]`` / ``[B, S]``; a query
        attends only to keys of the same segment (packed sequences).
      mask: extra boolean mask broadcastable to ``[B, N, T, S]``, True = attend.
      scale: score scale; default ``1/√H``, or the scale an encoding prescribes.
        An explicit scale also applies to encodings whose terms share it (those
        with a ``scale`` field left at None: Shaw, Transformer-XL, DeBERTa, CoPE,
        the functional relative encoding).
      dropout_rate: dropout on the attention weights (needs ``dropout_rng``).
      dropout_rng: PRNG key for dropout.
      return_weights: also return the ``[B, N, T, S]`` float32 weights.

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
    unbatched = query.ndim == 3
    if unbatched:
        if key.ndim != 3 or value.ndim != 3:
            raise ValueError(f"unbatched query {query.shape} needs unbatched key/value, got {key.shape}, {value.shape}")
        query, key, value = query[None], key[None], value[None]
        key_mask = None if key_mask is None else jnp.asarray(key_mask)[None]
        query_segment_ids = None if query_segment_ids is None else jnp.asarray(query_segment_ids)[None]
        key_segment_ids = None if key_segment_ids is None else jnp.asarray(key_segment_ids)[None]
    _check_shapes(query, key, value)
    batch, q_len, num_heads, head_dim = query.shape
    k_len, num_kv_heads = key.shape[1], key.shape[2]
    groups = num_heads // num_kv_heads

    if scale is not None:
        # Terms that share the score scale (Shaw, Transformer-XL, DeBERTa, CoPE, functional
        # relative: a `scale` field left at None) follow an explicit scale too.
        encodings = [
            dataclasses.replace(e, scale=scale)
            if dataclasses.is_dataclass(e) and "scale" in {f.name for f in dataclasses.fields(e)} and e.scale is None
            else e
            for e in encodings
        ]
    hooks = [_hooks_of(encoding) for encoding in encodings]
    uses_positions = getattr(normalizer, "uses_positions", False)
    needs_positions = causal or bool(hooks) or uses_positions
    if needs_positions and (query_positions is None or key_positions is None):
        raise ValueError(
            "query_positions and key_positions are required with causal=True, encodings or a "
            "position-aware normalizer (URPE); "
            f"for a plain sequence pass jnp.arange({q_len}) and jnp.arange({k_len})"
        )
    if (query_positions is None) != (key_positions is None):
        raise ValueError("pass both query_positions and key_positions (for self-attention, the same array twice)")
    if query_positions is not None:
        same = key_positions is query_positions
        query_positions = check_positions(query_positions, "query_positions")
        key_positions = query_positions if same else check_positions(key_positions, "key_positions")
        _check_position_shape(query_positions, q_len, batch, "query_positions")
        _check_position_shape(key_positions, k_len, batch, "key_positions")

    if (query_segment_ids is None) != (key_segment_ids is None):
        raise ValueError(
            "pass both query_segment_ids and key_segment_ids (for self-attention, the same array twice)"
        )
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
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")

    for rotate, _, _ in hooks:
        if rotate is not None:
            query, key = rotate(query, key, query_positions, key_positions)

    if scale is None:
        prescribed = {
            float(encoding.score_scale(head_dim)) for encoding in encodings if hasattr(encoding, "score_scale")
        }
        if len(prescribed) > 1:
            raise ValueError(
                f"the encodings prescribe different score scales {sorted(prescribed)}; pass scale= explicitly"
            )
        scale = prescribed.pop() if prescribed else 1.0 / np.sqrt(head_dim)
    if groups == 1:
        scores = jnp.einsum("BTNH,BSNH->BNTS", query, key, preferred_element_type=jnp.float32)
    else:
        grouped = query.reshape(batch, q_len, num_kv_heads, groups, head_dim)
        scores = jnp.einsum("BTKGH,BSKH->BKGTS", grouped, key, preferred_element_type=jnp.float32)
        scores = scores.reshape(batch, num_heads, q_len, k_len)
    scores = scores * jnp.float32(scale)
    for _, logits, _ in hooks:
        term = None if logits is None else logits(query, key, query_positions, key_positions)
        if term is not None:
            scores = scores + _as_scores(term, scores.ndim)

    full_mask = combine_masks(
        causal_mask(query_positions, key_positions) if causal else None,
        key_padding_mask(key_mask) if key_mask is not None else None,
        segment_mask(query_segment_ids, key_segment_ids) if query_segment_ids is not None else None,
        None if mask is None else jnp.asarray(mask),
    )
    if uses_positions:
        weights = normalizer(scores, full_mask, query_positions=query_positions, key_positions=key_positions)
    else:
        weights = normalizer(scores, full_mask)
    weights = weights.astype(jnp.float32)

    if dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng PRNG key")
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights_used = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    else:
        weights_used = weights

    if groups == 1:
        out = jnp.einsum(
            "BNTS,BSNH->BTNH", weights_used.astype(value.dtype), value, preferred_element_type=jnp.float32
        )
    else:
        grouped_w = weights_used.reshape(batch, num_kv_heads, groups, q_len, k_len).astype(value.dtype)
        out = jnp.einsum("BKGTS,BSKH->BTKGH", grouped_w, value, preferred_element_type=jnp.float32)
        out = out.reshape(batch, q_len, num_heads, value.shape[3])
    for _, _, values in hooks:
        term = None if values is None else values(weights_used, query_positions, key_positions)
        if term is not None:
            out = out + term.astype(jnp.float32)
    out = out.astype(query.dtype)

    if unbatched:
        out, weights = out[0], weights[0]
    return (out, weights) if return_weights else out
