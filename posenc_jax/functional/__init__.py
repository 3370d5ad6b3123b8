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
from posenc_jax.functional.attention import SharedBias, dot_product_attention, softmax_weights
from posenc_jax.functional.deberta import DeBERTa, deberta_log_bucket, deberta_logits, deberta_relative_index
from posenc_jax.functional.learned_relative import ClippedRelativeBias, clipped_relative_bias
from posenc_jax.functional.masks import causal_mask, combine_masks, key_padding_mask, segment_mask
from posenc_jax.functional.positions import check_positions, inverse_frequencies, position_angles
from posenc_jax.functional.relative import (
    bucket_relative,
    clipped_relative_index,
    expand_relative_bias,
    gather_relative,
    gather_relative_transposed,
    relative_positions,
)
from posenc_jax.functional.rope import RoPE, apply_rope, apply_rope_qk, rope_inverse_frequencies, rope_tables
from posenc_jax.functional.shaw import Shaw, shaw_key_logits, shaw_value_term
from posenc_jax.functional.sinusoidal_relative import SinusoidalRelative, sinusoidal_relative_logits
from posenc_jax.functional.t5 import T5Bias, t5_bias, t5_relative_bucket
from posenc_jax.functional.transformer_xl import TransformerXL, rel_shift, transformer_xl_logits

__all__ = [
    "ClippedRelativeBias",
    "DeBERTa",
    "LearnedAbsolute",
    "NoPE",
    "RoPE",
    "SharedBias",
    "Shaw",
    "Sinusoidal",
    "SinusoidalRelative",
    "T5Bias",
    "TransformerXL",
    "apply_rope",
    "apply_rope_qk",
    "bucket_relative",
    "causal_mask",
    "check_positions",
    "clipped_relative_bias",
    "clipped_relative_index",
    "combine_masks",
    "deberta_log_bucket",
    "deberta_logits",
    "deberta_relative_index",
    "dot_product_attention",
    "expand_relative_bias",
    "gather_relative",
    "gather_relative_transposed",
    "inverse_frequencies",
    "key_padding_mask",
    "learned_position_embedding",
    "position_angles",
    "rel_shift",
    "relative_positions",
    "rope_inverse_frequencies",
    "rope_tables",
    "segment_mask",
    "shaw_key_logits",
    "shaw_value_term",
    "sinusoidal_encoding",
    "sinusoidal_relative_logits",
    "softmax_weights",
    "t5_bias",
    "t5_relative_bucket",
    "transformer_xl_logits",
]
