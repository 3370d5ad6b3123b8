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
from posenc_jax.functional.alibi import ALiBi, alibi_bias, alibi_slopes
from posenc_jax.functional.attention import SharedBias, dot_product_attention, softmax_weights
from posenc_jax.functional.cope import CoPE, cope_logits
from posenc_jax.functional.deberta import DeBERTa, deberta_log_bucket, deberta_logits, deberta_relative_index
from posenc_jax.functional.fire import Fire, fire_bias, fire_init
from posenc_jax.functional.kerple import Kerple, kerple_bias
from posenc_jax.functional.learned_relative import ClippedRelativeBias, clipped_relative_bias
from posenc_jax.functional.masks import causal_mask, combine_masks, key_padding_mask, segment_mask
from posenc_jax.functional.normalizers import (
    NORMALIZERS,
    URPE,
    URPEConfig,
    l2_normalized_weights,
    normalizer_config,
    relu2_weights,
)
from posenc_jax.functional.parameter_free import ParameterFree
from posenc_jax.functional.positions import batched_positions, check_positions, inverse_frequencies, position_angles
from posenc_jax.functional.randomized import RandomizedPositions, randomized_positions
from posenc_jax.functional.relative import (
    bucket_relative,
    by_query_blocks,
    clipped_relative_index,
    expand_relative_bias,
    gather_relative,
    gather_relative_transposed,
    relative_positions,
)
from posenc_jax.functional.registry import (
    ClippedBiasConfig,
    CoPEConfig,
    DeBERTaConfig,
    FireConfig,
    KerpleConfig,
    LearnedAbsoluteConfig,
    ShawConfig,
    T5Config,
    TransformerXLConfig,
    encoding_config,
    encoding_names,
    register_encoding,
)
from posenc_jax.functional.rope import (
    AxialRoPE,
    RoPE,
    apply_rope,
    apply_rope_2d,
    apply_rope_qk,
    rope_inverse_frequencies,
    rope_tables,
)
from posenc_jax.functional.rope_scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    NTKScaling,
    YaRNScaling,
)
from posenc_jax.functional.shaw import Shaw, shaw_key_logits, shaw_value_term
from posenc_jax.functional.sinusoidal_relative import SinusoidalRelative, sinusoidal_relative_logits
from posenc_jax.functional.t5 import T5Bias, t5_bias, t5_relative_bucket
from posenc_jax.functional.transformer_xl import TransformerXL, rel_shift, transformer_xl_logits
from posenc_jax.functional.xpos import XPos, apply_xpos_qk, xpos_decay_bases

__all__ = [
    "ALiBi",
    "AxialRoPE",
    "ClippedBiasConfig",
    "ClippedRelativeBias",
    "CoPE",
    "CoPEConfig",
    "DeBERTa",
    "DeBERTaConfig",
    "DynamicNTKScaling",
    "Fire",
    "FireConfig",
    "Kerple",
    "KerpleConfig",
    "LearnedAbsolute",
    "LearnedAbsoluteConfig",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPEScaling",
    "NTKScaling",
    "NoPE",
    "ParameterFree",
    "RandomizedPositions",
    "RoPE",
    "SharedBias",
    "Shaw",
    "ShawConfig",
    "Sinusoidal",
    "SinusoidalRelative",
    "T5Bias",
    "T5Config",
    "TransformerXL",
    "NORMALIZERS",
    "URPE",
    "URPEConfig",
    "TransformerXLConfig",
    "XPos",
    "YaRNScaling",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "apply_rope_2d",
    "apply_rope_qk",
    "apply_xpos_qk",
    "batched_positions",
    "bucket_relative",
    "by_query_blocks",
    "causal_mask",
    "check_positions",
    "clipped_relative_bias",
    "clipped_relative_index",
    "combine_masks",
    "cope_logits",
    "deberta_log_bucket",
    "deberta_logits",
    "deberta_relative_index",
    "dot_product_attention",
    "encoding_config",
    "encoding_names",
    "expand_relative_bias",
    "fire_bias",
    "fire_init",
    "gather_relative",
    "gather_relative_transposed",
    "inverse_frequencies",
    "kerple_bias",
    "key_padding_mask",
    "l2_normalized_weights",
    "learned_position_embedding",
    "normalizer_config",
    "position_angles",
    "randomized_positions",
    "register_encoding",
    "rel_shift",
    "relu2_weights",
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
    "xpos_decay_bases",
]
