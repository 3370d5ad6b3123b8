"""Attention normalisers: the ``normalize`` hook, and the fixes for relative encodings' blind spot.

With softmax every row of attention weights sums to 1. On n identical tokens all
values are equal, so every position receives the same mixture, and a model whose
only positional information sits in the logits (NoPE, T5, ALiBi, RoPE, ...) gives
the same output at every position (Su 2022, on a theoretical flaw of relative
position encodings; Luo et al. 2022). Normalisers
whose row sums can vary with position lift that limit:

* :func:`softmax_weights` — ``exp(s) / Σ exp(s)`` (the default; rows sum to 1).
* :func:`l2_normalized_weights` — ``exp(s) / ‖exp(s)‖₂`` per row.
* :class:`ReLU2` — ``relu(s)² / n`` with n the sequence length, the same for every
  query row (gated attention units, Hua et al. 2022): the number of real keys of the
  query's sequence (its packed segment, without padding), or an explicit ``length``
  such as the training length. Under a causal mask row t sums ``t + 1`` terms over the
  same n, so row sums grow with position and the tie on identical tokens breaks.
  :func:`relu2_weights` is the per-row variant (n = the row's unmasked keys), whose rows
  all sum alike; it stays for comparison.
* :class:`URPE` — softmax weights multiplied elementwise by a learned Toeplitz
  matrix ``C[i, j] = c[clip(j - i, -k, k)]`` per head (Luo et al. 2022), ones at
  initialisation so it starts as softmax.

Every normaliser takes float32 scores ``[B, N, T, S]`` and a boolean mask (or None),
and gives zero weight to masked keys and zero rows for fully masked queries.

References: Luo et al., "Your Transformer May Not be as Powerful as You Expect",
NeurIPS 2022, arXiv:2205.13401; Hua et al., "Transformer Quality in Linear Time",
ICML 2022, arXiv:2202.10447.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.attention import softmax_weights
from posenc_jax.functional.broadcast import broadcast_to
from posenc_jax.functional.hooks import AttentionContext, EncodingConfig, Placement, parameter, pytree_dataclass
from posenc_jax.functional.relative import check_max_distance, expand_relative_bias

__all__ = [
    "NORMALIZERS",
    "URPE",
    "ReLU2",
    "URPEConfig",
    "l2_normalized_weights",
    "normalizer_config",
    "relu2_weights",
    "softmax_weights",
]

_MIN = jnp.finfo(jnp.float32).min


def l2_normalized_weights(scores: jax.Array, mask: jax.Array | None) -> jax.Array:
    """``w = e / ‖e‖₂`` with ``e = exp(s - max s)`` over the unmasked keys of each row.

    A row's weights have unit L2 norm, so their sum, ``‖e‖₁ / ‖e‖₂``, grows with the
    number of comparable keys: between 1 and √n.
    """
    scores = scores.astype(jnp.float32)
    visible = jnp.ones(scores.shape, bool) if mask is None else jnp.broadcast_to(mask, scores.shape)
    masked = jnp.where(visible, jnp.maximum(scores, _MIN), _MIN)
    e = jnp.where(visible, jnp.exp(masked - jax.lax.stop_gradient(masked.max(-1, keepdims=True))), 0.0)
    norm = jnp.sqrt((e * e).sum(-1, keepdims=True))
    return e / jnp.where(norm > 0, norm, 1.0)


def relu2_weights(scores: jax.Array, mask: jax.Array | None) -> jax.Array:
    """``w = relu(s)² / n``, n = the number of unmasked keys in the row (the per-row variant).

    Not the published GAU normaliser (that is :class:`ReLU2`, n = the sequence length):
    with n counted per row, every row of a causal attention sums alike on identical tokens.
    """
    scores = scores.astype(jnp.float32)
    visible = jnp.ones(scores.shape, bool) if mask is None else jnp.broadcast_to(mask, scores.shape)
    count = visible.sum(-1, keepdims=True).astype(jnp.float32)
    return jnp.where(visible, jnp.square(jax.nn.relu(scores)), 0.0) / jnp.maximum(count, 1.0)


@pytree_dataclass
class ReLU2:
    """``w = relu(s)² / n`` with n the sequence length (gated attention units, Hua et al. 2022).

    A ``normalize`` hook. n is ``length`` when given (e.g. the training length, so that
    decoding with a cache, which does not know the final length, matches the full forward),
    else the number of real keys of the query's sequence: its packed segment without
    padding (``context.sequence_lengths``), or all S keys. The causal mask does not change
    n, so a causal row's weights sum over a growing number of keys.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 1, 2)); pos = jnp.arange(4)
      >>> out = dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, causal=True,
      ...                             normalizer=ReLU2())
      >>> [round(float(w), 3) for w in out[0, :, 0, 0]]  # row t: (t + 1) · relu(s)² / 4, s = 2/√2
      [0.5, 1.0, 1.5, 2.0]
    """

    length: int | None = None

    def __post_init__(self):
        if self.length is not None and (not isinstance(self.length, (int, np.integer)) or self.length < 1):
            raise ValueError(f"ReLU2 length must be a positive integer (e.g. the training length), got {self.length!r}")

    def normalize(self, scores, mask, context: AttentionContext):
        scores = scores.astype(jnp.float32)
        visible = jnp.ones(scores.shape, bool) if mask is None else jnp.broadcast_to(mask, scores.shape)
        if self.length is not None:
            n = jnp.float32(self.length)
        elif context.sequence_lengths is not None:
            n = jnp.maximum(context.sequence_lengths[:, None, :, None], 1.0)  # [B|1, 1, T, 1]
        else:
            n = jnp.float32(max(context.key_length, 1) if context.key_length else scores.shape[-1])
        return jnp.where(visible, jnp.square(jax.nn.relu(scores)), 0.0) / n


@pytree_dataclass
class URPE:
    """Universal RPE: ``softmax(s) ⊙ C`` with ``C[n, i, j] = c[n, clip(j - i, -k, k) + k]``.

    ``table`` ``[N, 2k+1]`` is learned (ones at init: plain softmax). A ``normalize``
    hook: it reads the positions from the attention's context.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 5, 2, 4)); pos = jnp.arange(5)
      >>> urpe = URPE(jnp.ones((2, 7)), max_distance=3)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, normalizer=urpe).shape
      (1, 5, 2, 4)
    """

    table: jax.Array = parameter()
    max_distance: int = 16

    def __post_init__(self):
        k = check_max_distance(self.max_distance)
        if np.ndim(self.table) != 2 or np.shape(self.table)[1] != 2 * k + 1:
            raise ValueError(
                f"URPE table must have shape [N, 2*max_distance+1] = [N, {2 * k + 1}], got {np.shape(self.table)}"
            )

    def normalize(self, scores, mask, context: AttentionContext):
        if np.shape(self.table)[0] != scores.shape[1]:
            raise ValueError(f"URPE table has {np.shape(self.table)[0]} heads but the scores have {scores.shape[1]}")
        weights = softmax_weights(scores, mask)
        return weights * broadcast_to(self.tile_factor(context), weights.shape)

    def tile_factor(self, context: AttentionContext) -> jax.Array:
        """The Toeplitz factor ``C`` ``[B|1, N, T, S]`` for the context's positions (a tile's, blockwise)."""
        return expand_relative_bias(self.table, context.query_positions, context.key_positions, self.max_distance)


@pytree_dataclass
class URPEConfig(EncodingConfig):
    """URPE with a learned ``c`` per head (``[N, 2k+1]``, ones at init), for the NNX modules."""

    max_distance: int = 16
    acts_on: ClassVar[Placement] = "normalizer"

    def __post_init__(self):
        check_max_distance(self.max_distance)

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return {"table": jnp.ones((num_heads, 2 * self.max_distance + 1), jnp.float32)}

    def build(self, params: dict) -> URPE:
        return URPE(params["table"], self.max_distance)


NORMALIZERS = {
    "softmax": softmax_weights,
    "l2": l2_normalized_weights,
    "relu2": ReLU2(),
    "urpe": URPEConfig(),
}


def normalizer_config(name: str):
    """The normaliser registered as ``name``: a function, or a config with learned parameters (URPE)."""
    if name not in NORMALIZERS:
        raise ValueError(f"unknown normalizer {name!r}; known normalizers: {', '.join(NORMALIZERS)}")
    return NORMALIZERS[name]
