"""Pure-function positional encodings and the one attention function.

Everything here is plain ``jax.numpy`` (no Flax): functions that run under
``jax.jit`` and ``jax.vmap``, and small frozen dataclasses that fill the hooks
(``embed``, ``rotate``, ``logits``, ``values``, ``normalize``) of
:func:`dot_product_attention`.
"""

from posenc_jax.functional.absolute import (
    LearnedAbsolute,
    NoPE,
    Sinusoidal,
    learned_position_embedding,
    sinusoidal_encoding,
)
from posenc_jax.functional.attention import dot_product_attention, softmax_weights
from posenc_jax.functional.masks import causal_mask, combine_masks, key_padding_mask, segment_mask
from posenc_jax.functional.positions import check_positions, inverse_frequencies, position_angles
from posenc_jax.functional.rope import RoPE, apply_rope, apply_rope_qk, rope_inverse_frequencies, rope_tables

__all__ = [
    "LearnedAbsolute",
    "NoPE",
    "RoPE",
    "Sinusoidal",
    "apply_rope",
    "apply_rope_qk",
    "causal_mask",
    "check_positions",
    "combine_masks",
    "dot_product_attention",
    "inverse_frequencies",
    "key_padding_mask",
    "learned_position_embedding",
    "position_angles",
    "rope_inverse_frequencies",
    "rope_tables",
    "segment_mask",
    "sinusoidal_encoding",
    "softmax_weights",
]
