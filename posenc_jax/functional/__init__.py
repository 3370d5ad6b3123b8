"""Pure-function positional encodings and the one attention function.

Everything here is plain ``jax.numpy`` (no Flax). Each encoding lives in its own
module with its functions, its hook (a pytree dataclass filling the hooks of
:mod:`posenc_jax.functional.core.hooks`), its config and its registration; the attention
composes the hooks. Helpers (position checks, relative gathers, phase tables) stay
importable from their modules (``posenc_jax.functional.core.relative``, ``.positions``, ...).
"""

# The attention, its hooks and the registry.
# The encodings, one module each (importing a module registers its encoding).
# The kernels: importing them registers the fast forms of core's operations.
from posenc_jax.functional import kernels  # noqa: F401
from posenc_jax.functional.core.attention import SharedBias, dot_product_attention
from posenc_jax.functional.core.cache import CachedKeyTerm, KVCache
from posenc_jax.functional.core.forms import Forms, declare_forms
from posenc_jax.functional.core.hooks import (
    AttentionContext,
    BiasHook,
    Embed,
    EncodingConfig,
    Logits,
    Normalize,
    ParameterFree,
    PositionBias,
    PositionSampler,
    Rotate,
    ScoreScale,
    Values,
    hook_names,
    parameter,
    pytree_dataclass,
)
from posenc_jax.functional.core.masks import causal_mask, combine_masks, key_padding_mask, segment_mask
from posenc_jax.functional.core.normalizers import (
    NORMALIZERS,
    URPE,
    ReLU2,
    URPEConfig,
    l2_normalized_weights,
    normalizer_config,
    relu2_weights,
    softmax_weights,
)
from posenc_jax.functional.core.registry import (
    EncodingInfo,
    Source,
    encoding_config,
    encoding_info,
    encoding_names,
    register_encoding,
)
from posenc_jax.functional.core.sharded import sequence_parallel_attention
from posenc_jax.functional.encodings.alibi import ALiBi, alibi_bias, alibi_slopes
from posenc_jax.functional.encodings.axial_rope import AxialRoPE, apply_rope_2d
from posenc_jax.functional.encodings.cope import CoPE, CoPEConfig, cope_logits
from posenc_jax.functional.encodings.deberta import DeBERTa, DeBERTaConfig, deberta_log_bucket, deberta_logits
from posenc_jax.functional.encodings.fire import Fire, FireConfig, fire_bias, fire_init
from posenc_jax.functional.encodings.kerple import Kerple, KerpleConfig, kerple_bias
from posenc_jax.functional.encodings.learned_absolute import (
    LearnedAbsolute,
    LearnedAbsoluteConfig,
    learned_position_embedding,
)
from posenc_jax.functional.encodings.learned_relative import (
    ClippedBiasConfig,
    ClippedRelativeBias,
    clipped_relative_bias,
)
from posenc_jax.functional.encodings.nope import NoPE
from posenc_jax.functional.encodings.randomized import RandomizedPositions, randomized_positions
from posenc_jax.functional.encodings.rope import RoPE, RotaryTable, apply_rope, apply_rope_qk
from posenc_jax.functional.encodings.rope_scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    NTKScaling,
    YaRNScaling,
)
from posenc_jax.functional.encodings.sandwich import Sandwich, sandwich_bias
from posenc_jax.functional.encodings.shaw import Shaw, ShawConfig, shaw_key_logits, shaw_value_term
from posenc_jax.functional.encodings.sinusoidal import Sinusoidal, sinusoidal_encoding
from posenc_jax.functional.encodings.sinusoidal_relative import SinusoidalRelative, sinusoidal_relative_logits
from posenc_jax.functional.encodings.t5 import T5Bias, T5Config, t5_bias, t5_relative_bucket
from posenc_jax.functional.encodings.transformer_xl import (
    TransformerXL,
    TransformerXLConfig,
    rel_shift,
    transformer_xl_logits,
)
from posenc_jax.functional.encodings.xpos import XPos, apply_xpos_qk

__all__ = [
    # attention, hooks, masks, normalisers, registry
    "AttentionContext",
    "BiasHook",
    "Embed",
    "EncodingConfig",
    "EncodingInfo",
    "CachedKeyTerm",
    "KVCache",
    "Forms",
    "Logits",
    "NORMALIZERS",
    "Normalize",
    "ParameterFree",
    "PositionBias",
    "PositionSampler",
    "Rotate",
    "ScoreScale",
    "SharedBias",
    "Source",
    "URPE",
    "ReLU2",
    "URPEConfig",
    "Values",
    "causal_mask",
    "combine_masks",
    "declare_forms",
    "dot_product_attention",
    "encoding_config",
    "encoding_info",
    "encoding_names",
    "hook_names",
    "key_padding_mask",
    "l2_normalized_weights",
    "normalizer_config",
    "parameter",
    "pytree_dataclass",
    "register_encoding",
    "relu2_weights",
    "segment_mask",
    "sequence_parallel_attention",
    "softmax_weights",
    # encodings
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
    "RandomizedPositions",
    "RoPE",
    "RotaryTable",
    "Sandwich",
    "Shaw",
    "ShawConfig",
    "Sinusoidal",
    "SinusoidalRelative",
    "T5Bias",
    "T5Config",
    "TransformerXL",
    "TransformerXLConfig",
    "XPos",
    "YaRNScaling",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "apply_rope_2d",
    "apply_rope_qk",
    "apply_xpos_qk",
    "clipped_relative_bias",
    "cope_logits",
    "deberta_log_bucket",
    "deberta_logits",
    "fire_bias",
    "fire_init",
    "kerple_bias",
    "learned_position_embedding",
    "randomized_positions",
    "rel_shift",
    "sandwich_bias",
    "shaw_key_logits",
    "shaw_value_term",
    "sinusoidal_encoding",
    "sinusoidal_relative_logits",
    "t5_bias",
    "t5_relative_bucket",
    "transformer_xl_logits",
]
