"""Hugging Face configs: each one loads in one call and reproduces transformers' formulas.

The ``hf_*`` functions below transliterate transformers' code into NumPy, as written in
transformers 5.24.0 (its PyPI wheel): ``modeling_rope_utils.py`` (``_compute_*_parameters``,
``standardize_rope_params``), ``modeling_llama.py`` (``rotate_half``, ``apply_rotary_pos_emb``),
the rotary functions of GPT-J, DeepSeek-V2/V3 and gpt-oss, the ALiBi tensors and attention of
BLOOM, Falcon and MPT, ``modeling_t5.py`` (``_relative_position_bucket``, ``compute_bias`` and the
unscaled scores) and ``modeling_deberta_v2.py`` (``make_log_bucket_position``,
``build_relative_position``, ``DisentangledSelfAttention``, the encoder's LayerNorm of
``rel_embeddings``), with float32 where transformers computes in float32. Neither transformers
nor torch is needed: state dicts are NumPy arrays, torch's ``[out, in]`` Linear layout included.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.functional import AttentionContext, ScoreScale, dot_product_attention
from posenc_jax.functional.encodings.deberta import DeBERTaConfig
from posenc_jax.functional.encodings.learned_absolute import LearnedAbsoluteConfig
from posenc_jax.functional.encodings.t5 import T5Config
from posenc_jax.hf import (
    ALiBiSlopes,
    FixedScoreScale,
    RoPEOnLastFeatures,
    deberta_position_tables,
    from_hf_config,
    load_hf_position_weights,
)

# --- transformers' RoPE formulas, transliterated --------------------------------------------


def hf_dim(config):
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return int(head_dim * partial)


def hf_default(base, dim):
    return (1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)


def hf_linear(base, dim, factor):
    return hf_default(base, dim) / np.float32(factor), 1.0


def hf_dynamic(base, dim, factor, max_position_embeddings, seq_len):
    seq_len = max(seq_len, max_position_embeddings)
    base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return hf_default(base, dim), 1.0


def hf_yarn(base, dim, rope, max_position_embeddings):
    factor = rope["factor"]
    attention_factor = rope.get("attention_factor")
    mscale = rope.get("mscale")
    mscale_all_dim = rope.get("mscale_all_dim")
    original_max_position_embeddings = rope["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original_max_position_embeddings

    def get_mscale(scale, mscale=1):
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
        return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings, truncate):
        low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
        high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(min, max, dim):
        if min == max:
            max += 0.001
        linear_func = (np.arange(dim, dtype=np.float32) - min) / (max - min)
        return np.clip(linear_func, 0, 1).astype(np.float32)

    pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    truncate = rope.get("truncate", True)
    low, high = find_correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings, truncate)
    inv_freq_extrapolation_factor = 1 - linear_ramp_factor(low, high, dim // 2)
    inv_freq = (
        inv_freq_interpolation * (1 - inv_freq_extrapolation_factor)
        + inv_freq_extrapolation * inv_freq_extrapolation_factor
    )
    return inv_freq.astype(np.float32), attention_factor


def hf_longrope(base, dim, rope, max_position_embeddings, seq_len):
    long_factor = rope["long_factor"]
    short_factor = rope["short_factor"]
    factor = rope.get("factor")
    attention_factor = rope.get("attention_factor")
    original_max_position_embeddings = rope["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original_max_position_embeddings
    if attention_factor is None:
        if factor <= 1.0:
            attention_factor = 1.0
        else:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))
    if seq_len and seq_len > original_max_position_embeddings:
        ext_factors = np.asarray(long_factor, np.float32)
    else:
        ext_factors = np.asarray(short_factor, np.float32)
    inv_freq_shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    return (1.0 / (ext_factors * base**inv_freq_shape)).astype(np.float32), attention_factor


def hf_llama3(base, dim, rope):
    inv_freq = hf_default(base, dim)
    factor = rope["factor"]
    low_freq_factor = rope["low_freq_factor"]
    high_freq_factor = rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama).astype(np.float32), 1.0


def hf_rope_parameters(config, seq_len=None):
    """transformers' (inv_freq, attention_factor) for a config, after its standardisation."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if rope_type in ("llama3", "yarn", "longrope"):
        if "original_max_position_embeddings" in config:
            rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    dim = hf_dim(config)
    if rope_type == "default":
        return hf_default(base, dim), 1.0
    if rope_type == "linear":
        return hf_linear(base, dim, rope["factor"])
    if rope_type == "dynamic":
        return hf_dynamic(base, dim, rope["factor"], config["max_position_embeddings"], seq_len or 0)
    if rope_type == "yarn":
        return hf_yarn(base, dim, rope, config["max_position_embeddings"])
    if rope_type == "longrope":
        return hf_longrope(base, dim, rope, config["max_position_embeddings"], seq_len)
    return hf_llama3(base, dim, rope)


def hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return np.concatenate((-x2, x1), axis=-1)


def hf_apply_rotary(q, positions, inv_freq, attention_scaling):
    """``apply_rotary_pos_emb`` on ``q`` ``[B, T, N, H]`` (partial: the first 2·len(inv_freq) features)."""
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate((freqs, freqs), axis=-1)
    cos, sin = np.cos(emb) * attention_scaling, np.sin(emb) * attention_scaling
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rot = 2 * inv_freq.shape[0]
    q_rot, q_pass = q[..., :rot], q[..., rot:]
    return np.concatenate((q_rot * cos + hf_rotate_half(q_rot) * sin, q_pass), axis=-1)


# --- configs as published (sizes from the models' config.json) -------------------------------

LLAMA_3_1_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
QWEN_YARN = {  # Qwen2.5 with its documented YaRN extension (rope_scaling added as the model card says)
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
}
DEEPSEEK_YARN = {  # DeepSeek-V2-Lite's rope block (mscale / mscale_all_dim) on a plain 64-wide RoPE head
    "model_type": "llama",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "head_dim": 64,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
    },
}
GPT_OSS_YARN = {  # gpt-oss's rope block in transformers 5 style (rope_parameters, truncate false), one layer type
    "model_type": "llama",
    "hidden_size": 2880,
    "num_attention_heads": 64,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}
PHI3_LONGROPE = {  # Phi-3-mini-128k: 48 factors per list, original context outside rope_scaling
    "model_type": "phi3",
    "hidden_size": 3072,
    "num_attention_heads": 32,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.01 * i for i in range(48)],
        "long_factor": [1.0 + 1.5 * i for i in range(48)],
    },
}
PARTIAL = {  # Phi-2 / StableLM style: only part of the head rotates
    "model_type": "stablelm",
    "hidden_size": 2560,
    "num_attention_heads": 32,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000,
    "max_position_embeddings": 4096,
}
LINEAR = {
    "model_type": "llama",
    "hidden_size": 512,
    "num_attention_heads": 8,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
}
DYNAMIC = {
    "model_type": "llama",
    "hidden_size": 512,
    "num_attention_heads": 8,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
}

FIXED_LENGTH = {
    "llama3": LLAMA_3_1_8B,
    "yarn-qwen": QWEN_YARN,
    "yarn-deepseek-mscale": DEEPSEEK_YARN,
    "yarn-gpt-oss-untruncated": GPT_OSS_YARN,
    "partial": PARTIAL,
    "linear": LINEAR,
}


@pytest.mark.parametrize("config", FIXED_LENGTH.values(), ids=FIXED_LENGTH.keys())
def test_rope_configs_reproduce_transformers_frequencies(config):
    loaded = from_hf_config(config)
    (rope,) = loaded.encodings
    assert loaded.family == "rope" and rope.layout == "half" and loaded.scale == loaded.head_dim**-0.5
    want_freq, want_factor = hf_rope_parameters(config)
    freq, factor = rope.frequencies(loaded.head_dim)
    np.testing.assert_allclose(freq, want_freq, rtol=2e-6)
    assert factor == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("config", FIXED_LENGTH.values(), ids=FIXED_LENGTH.keys())
def test_rope_configs_rotate_as_apply_rotary_pos_emb(config, rng):
    loaded = from_hf_config(config)
    (rope,) = loaded.encodings
    head_dim = loaded.head_dim
    q = rng.standard_normal((1, 12, 2, head_dim)).astype(np.float32)
    positions = np.arange(12) + 5
    inv_freq, factor = hf_rope_parameters(config)
    context = AttentionContext(query_positions=jnp.asarray(positions), key_positions=jnp.asarray(positions))
    ours, _ = rope.rotate(jnp.asarray(q), jnp.asarray(q), context)
    np.testing.assert_allclose(ours, hf_apply_rotary(q, positions, inv_freq, factor), atol=2e-5)


def test_the_llama3_config_loads_in_one_call():
    loaded = from_hf_config(LLAMA_3_1_8B)
    (rope,) = loaded.encodings
    assert (loaded.head_dim, loaded.num_heads, rope.base, rope.rotary_dim) == (128, 32, 500000.0, None)
    s = rope.scaling
    assert (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_context) == (8.0, 1.0, 4.0, 8192)


def test_yarn_fields_reach_the_scaling():
    deepseek = from_hf_config(DEEPSEEK_YARN).encodings[0].scaling
    assert (deepseek.mscale, deepseek.mscale_all_dim, deepseek.original_context) == (0.707, 0.707, 4096)
    assert deepseek.attention_factor() == pytest.approx(1.0)  # equal mscales cancel
    gpt_oss = from_hf_config(GPT_OSS_YARN).encodings[0]
    assert gpt_oss.base == 150000.0 and gpt_oss.scaling.truncate is False
    explicit = dict(QWEN_YARN, rope_scaling=dict(QWEN_YARN["rope_scaling"], attention_factor=1.25))
    assert from_hf_config(explicit).encodings[0].scaling.attention_factor() == 1.25
    # No factor: max_position_embeddings / original context, as transformers 5 derives it.
    derived = dict(GPT_OSS_YARN, rope_parameters={k: v for k, v in GPT_OSS_YARN["rope_parameters"].items()})
    derived["rope_parameters"]["factor"] = None
    assert from_hf_config(derived).encodings[0].scaling.factor == 131072 / 4096


@pytest.mark.parametrize("seq_len", [1000, 4096, 4097, 20000])
def test_longrope_reproduces_transformers_at_each_length(seq_len):
    loaded = from_hf_config(PHI3_LONGROPE)
    (rope,) = loaded.encodings
    assert rope.scaling.original_context == 4096 and rope.scaling.max_context == 131072
    want_freq, want_factor = hf_rope_parameters(PHI3_LONGROPE, seq_len=seq_len)
    freq, factor = rope.frequencies(loaded.head_dim, seq_len)
    np.testing.assert_allclose(freq, want_freq, rtol=2e-6)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_longrope_optional_factor_sets_the_attention_factor():
    config = dict(PHI3_LONGROPE, rope_scaling=dict(PHI3_LONGROPE["rope_scaling"], factor=8.0))
    del config["original_max_position_embeddings"]
    config["rope_scaling"]["original_max_position_embeddings"] = 4096
    (rope,) = from_hf_config(config).encodings
    assert rope.scaling.factor == 8.0
    assert rope.frequencies(96, 100)[1] == pytest.approx(hf_rope_parameters(config, 100)[1], rel=1e-12)
    assert rope.frequencies(96, 100)[1] == pytest.approx(math.sqrt(1 + math.log(8) / math.log(4096)))


SMALL_LONGROPE = {
    "model_type": "phi3",
    "hidden_size": 32,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.2, 2.5, 3.0],
        "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0],
    },
}
SMALL_DYNAMIC = dict(DYNAMIC, hidden_size=32, num_attention_heads=2, max_position_embeddings=16)


@pytest.mark.parametrize("config", [SMALL_LONGROPE, SMALL_DYNAMIC], ids=["longrope", "dynamic"])
@pytest.mark.parametrize("length", [10, 16, 40])
def test_length_dependent_rotation_follows_the_current_length(config, length, rng):
    # transformers' dynamic update takes the length as max(position_ids) + 1.
    (rope,) = from_hf_config(config).encodings
    q = rng.standard_normal((1, length, 2, 16)).astype(np.float32)
    positions = np.arange(length)
    inv_freq, factor = hf_rope_parameters(config, seq_len=length)
    context = AttentionContext(query_positions=jnp.asarray(positions), key_positions=jnp.asarray(positions))
    ours, _ = rope.rotate(jnp.asarray(q), jnp.asarray(q), context)
    np.testing.assert_allclose(ours, hf_apply_rotary(q, positions, inv_freq, factor), atol=2e-5)


@pytest.mark.parametrize("seq_len", [1000, 2048, 3000, 9000])
def test_dynamic_ntk_frequencies(seq_len):
    (rope,) = from_hf_config(DYNAMIC).encodings
    want_freq, _ = hf_rope_parameters(DYNAMIC, seq_len=seq_len)
    np.testing.assert_allclose(rope.frequencies(64, seq_len)[0], want_freq, rtol=2e-6)


def test_head_dim_field_wins_over_hidden_size():
    config = {"model_type": "llama", "hidden_size": 5120, "num_attention_heads": 32, "head_dim": 128, "rope_theta": 1e6}
    loaded = from_hf_config(config)
    assert loaded.head_dim == 128
    np.testing.assert_allclose(loaded.encodings[0].frequencies(128)[0], hf_default(1e6, 128), rtol=2e-6)


def test_layer_typed_rope_parameters_need_a_layer_type():
    config = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    with pytest.raises(ValueError, match=r"differ by type \['full_attention', 'sliding_attention'\]"):
        from_hf_config(config)
    full = from_hf_config(config, layer_type="full_attention").encodings[0]
    assert full.base == 1e6 and full.scaling.factor == 8.0
    assert from_hf_config(config, layer_type="sliding_attention").encodings[0].scaling is None


@pytest.mark.parametrize(
    "config, message",
    [
        ({"hidden_size": 64, "num_attention_heads": 4}, "the config has no model_type"),
        (dict(LINEAR, rope_scaling={"rope_type": "su-perb", "factor": 2.0}), "rope_type 'su-perb' is not supported"),
        (dict(LINEAR, rope_scaling={"rope_type": "linear"}), "no 'factor', which linear RoPE scaling needs"),
        (dict(PARTIAL, partial_rotary_factor=0.3125), r"80 \* 0.3125 gives 25 rotated features"),
        (dict(LINEAR, rope_scaling={"rope_type": "linear", "factor": 0.5}), "factor must be a number >= 1"),
        (dict(SMALL_LONGROPE, hidden_size=64), "short_factor has 8 entries but the rotary dim 32 needs 16"),
    ],
)
def test_bad_configs_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config(config)


def test_config_objects_load_like_dicts():
    class Config:  # a transformers config is an object with the same fields
        def __init__(self, **fields):
            self.__dict__.update(fields)

    from_object = from_hf_config(Config(**LLAMA_3_1_8B))
    assert from_object == from_hf_config(LLAMA_3_1_8B)


# --- T5 ------------------------------------------------------------------------------------


def hf_t5_relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).astype(np.int64) * num_buckets
        relative_position = np.abs(relative_position)
    else:
        relative_position = -np.minimum(relative_position, np.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    with np.errstate(divide="ignore", invalid="ignore"):
        relative_position_if_large = max_exact + (
            np.log(relative_position.astype(np.float32) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).astype(np.int64)
    relative_position_if_large = np.minimum(relative_position_if_large, num_buckets - 1)
    relative_buckets += np.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


def hf_t5_attention(q, k, v, table, *, is_decoder, num_buckets, max_distance):
    """T5Attention.forward for self-attention: unscaled scores + compute_bias, softmax, values."""
    query_length, key_length = q.shape[1], k.shape[1]
    context_position = np.arange(query_length)[:, None]
    memory_position = np.arange(key_length)[None, :]
    relative_position = memory_position - context_position
    buckets = hf_t5_relative_position_bucket(
        relative_position, bidirectional=not is_decoder, num_buckets=num_buckets, max_distance=max_distance
    )
    position_bias = table[buckets].transpose(2, 0, 1)[None]  # [1, N, T, S]
    if is_decoder:  # the decoder's causal mask, added to the bias
        position_bias = position_bias + np.where(memory_position <= context_position, 0.0, -1e30)
    scores = np.einsum("btnh,bsnh->bnts", q, k) + position_bias
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", weights, v)


T5_SMALL = {
    "model_type": "t5",
    "d_model": 512,
    "d_kv": 64,
    "num_heads": 8,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "is_encoder_decoder": True,
}


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_t5_config_reproduces_t5_attention(decoder, rng):
    loaded = from_hf_config(T5_SMALL, decoder=decoder)
    t5, fixed = loaded.encodings
    assert isinstance(t5, T5Config) and t5.bidirectional is (not decoder) and loaded.scale == 1.0
    assert fixed == FixedScoreScale(1.0) and (loaded.head_dim, loaded.num_heads) == (64, 8)
    length, heads, head_dim = 200, 2, 8  # past max_distance: every bucket kind is used
    q, k, v = (rng.standard_normal((1, length, heads, head_dim)).astype(np.float32) for _ in range(3))
    table = rng.standard_normal((32, heads)).astype(np.float32)
    hooks = [t5.build({"table": jnp.asarray(table)}), fixed.build({})]
    pos = jnp.arange(length)
    ours = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=hooks, causal=decoder)
    want = hf_t5_attention(q, k, v, table, is_decoder=decoder, num_buckets=32, max_distance=128)
    np.testing.assert_allclose(ours, want, atol=2e-5)


def test_t5_decoder_flag_comes_from_the_config():
    assert from_hf_config(dict(T5_SMALL, is_decoder=True)).encodings[0].bidirectional is False
    assert from_hf_config(T5_SMALL).encodings[0].bidirectional is True


# --- DeBERTa-v2 ----------------------------------------------------------------------------


def hf_make_log_bucket_position(relative_pos, bucket_size, max_position):
    sign = np.sign(relative_pos)
    mid = bucket_size // 2
    abs_pos = np.where((relative_pos < mid) & (relative_pos > -mid), mid - 1, np.abs(relative_pos))
    log_pos = (
        np.ceil(
            np.log(abs_pos.astype(np.float32) / np.float32(mid))
            / np.log(np.float32((max_position - 1) / mid))
            * np.float32(mid - 1)
        )
        + mid
    )
    return np.where(abs_pos <= mid, relative_pos.astype(np.float32), log_pos * sign)


def hf_build_relative_position(query_size, key_size, bucket_size=-1, max_position=-1):
    q_ids, k_ids = np.arange(query_size), np.arange(key_size)
    rel_pos_ids = q_ids[:, None] - k_ids[None, :]
    if bucket_size > 0 and max_position > 0:
        rel_pos_ids = hf_make_log_bucket_position(rel_pos_ids, bucket_size, max_position)
    return rel_pos_ids.astype(np.int64)[None]


def hf_deberta_v2_attention(hidden, w, rel_embeddings, *, heads, pos_att_type, share_att_key, buckets, max_relative):
    """DisentangledSelfAttention.forward (no mask, no dropout) with Linear layers as x @ W + b."""

    def linear(x, name):
        return x @ w[name + "_kernel"] + w[name + "_bias"]

    def transpose_for_scores(x):  # [B, T, N*H] -> [B*N, T, H]
        b, t, _ = x.shape
        return x.reshape(b, t, heads, -1).transpose(0, 2, 1, 3).reshape(b * heads, t, -1)

    query_layer = transpose_for_scores(linear(hidden, "query"))
    key_layer = transpose_for_scores(linear(hidden, "key"))
    value_layer = transpose_for_scores(linear(hidden, "value"))
    scale_factor = 1 + ("c2p" in pos_att_type) + ("p2c" in pos_att_type)
    scale = np.sqrt(np.float32(query_layer.shape[-1] * scale_factor))
    attention_scores = query_layer @ (key_layer.transpose(0, 2, 1) / scale)
    length = hidden.shape[1]
    relative_pos = hf_build_relative_position(length, length, bucket_size=buckets, max_position=max_relative)
    att_span = buckets if buckets > 0 else max_relative
    rel = rel_embeddings[0 : att_span * 2, :][None]
    pos_key_layer = (
        transpose_for_scores(linear(rel, "key" if share_att_key else "pos_key")) if ("c2p" in pos_att_type) else None
    )
    pos_query_layer = (
        transpose_for_scores(linear(rel, "query" if share_att_key else "pos_query"))
        if ("p2c" in pos_att_type)
        else None
    )
    repeat = query_layer.shape[0] // heads
    score = 0
    if "c2p" in pos_att_type:
        pos_key_layer = np.tile(pos_key_layer, (repeat, 1, 1))
        c2p_att = query_layer @ pos_key_layer.transpose(0, 2, 1)
        c2p_pos = np.clip(relative_pos + att_span, 0, att_span * 2 - 1)
        index = np.broadcast_to(c2p_pos[0], (query_layer.shape[0], length, length))
        score = score + np.take_along_axis(c2p_att, index, axis=-1) / scale
    if "p2c" in pos_att_type:
        pos_query_layer = np.tile(pos_query_layer, (repeat, 1, 1))
        r_pos = relative_pos
        p2c_pos = np.clip(-r_pos + att_span, 0, att_span * 2 - 1)
        p2c_att = key_layer @ pos_query_layer.transpose(0, 2, 1)
        index = np.broadcast_to(p2c_pos[0], (query_layer.shape[0], length, length))
        score = score + np.take_along_axis(p2c_att, index, axis=-1).transpose(0, 2, 1) / scale
    attention_scores = attention_scores + score
    probs = np.exp(attention_scores - attention_scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    context = probs @ value_layer  # [B*N, T, H]
    b = hidden.shape[0]
    return context.reshape(b, heads, length, -1).transpose(0, 2, 1, 3)  # [B, T, N, H]


DEBERTA_V3_BASE = {
    "model_type": "deberta-v2",
    "hidden_size": 768,
    "num_attention_heads": 12,
    "max_position_embeddings": 512,
    "relative_attention": True,
    "position_buckets": 256,
    "norm_rel_ebd": "layer_norm",
    "share_att_key": True,
    "pos_att_type": "p2c|c2p",
    "position_biased_input": False,
    "max_relative_positions": -1,
}


def test_the_deberta_v3_config_loads_in_one_call():
    loaded = from_hf_config(DEBERTA_V3_BASE)
    (deberta,) = loaded.encodings
    assert deberta == DeBERTaConfig(span=256, position_buckets=256, max_relative_positions=512, terms=("p2c", "c2p"))
    assert loaded.family == "deberta-v2" and loaded.head_dim == 64
    assert loaded.scale == pytest.approx((64 * 3) ** -0.5)  # both terms: 1/sqrt(3H)
    v2 = dict(DEBERTA_V3_BASE, position_biased_input=True, position_buckets=-1, pos_att_type=["c2p"])
    absolute, deberta = from_hf_config(v2).encodings
    assert absolute == LearnedAbsoluteConfig(max_positions=512)
    assert (deberta.span, deberta.position_buckets, deberta.terms) == (512, 0, ("c2p",))


@pytest.mark.parametrize("pos_att_type", ["c2p|p2c", "c2p", "p2c"])
@pytest.mark.parametrize("share_att_key", [True, False], ids=["shared-key", "own-projections"])
@pytest.mark.parametrize("buckets, max_relative", [(8, 24), (-1, 6)], ids=["log-buckets", "clipped"])
def test_deberta_v2_config_reproduces_disentangled_attention(pos_att_type, share_att_key, buckets, max_relative, rng):
    heads, head_dim, length = 2, 4, 40
    width = heads * head_dim
    config = {
        "model_type": "deberta-v2",
        "hidden_size": width,
        "num_attention_heads": heads,
        "max_position_embeddings": 512,
        "relative_attention": True,
        "position_buckets": buckets,
        "max_relative_positions": max_relative,
        "pos_att_type": pos_att_type,
        "share_att_key": share_att_key,
        "position_biased_input": False,
    }
    loaded = from_hf_config(config)
    (deberta,) = loaded.encodings
    span = deberta.span
    w = {}
    for name in ("query", "key", "value", "pos_key", "pos_query"):
        w[name + "_kernel"] = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        w[name + "_bias"] = rng.standard_normal(width).astype(np.float32) * 0.1
    hidden = rng.standard_normal((2, length, width)).astype(np.float32)
    rel_embeddings = rng.standard_normal((2 * span + 3, width)).astype(np.float32)
    want = hf_deberta_v2_attention(
        hidden,
        w,
        rel_embeddings,
        heads=heads,
        pos_att_type=deberta.terms,
        share_att_key=share_att_key,
        buckets=buckets,
        max_relative=max_relative,
    )
    key_side, query_side = ("key", "query") if share_att_key else ("pos_key", "pos_query")
    tables = deberta_position_tables(
        rel_embeddings[: 2 * span],
        num_heads=heads,
        terms=deberta.terms,
        key_kernel=w[key_side + "_kernel"],
        key_bias=w[key_side + "_bias"],
        query_kernel=w[query_side + "_kernel"],
        query_bias=w[query_side + "_bias"],
    )
    assert set(tables) == {"c2p": {"pos_key"}, "p2c": {"pos_query"}}.get(pos_att_type, {"pos_key", "pos_query"})
    q, k, v = (
        (hidden @ w[n + "_kernel"] + w[n + "_bias"]).reshape(2, length, heads, head_dim)
        for n in ("query", "key", "value")
    )
    pos = jnp.arange(length)
    ours = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[deberta.build(tables)])
    np.testing.assert_allclose(ours, want, atol=2e-5)


def test_deberta_single_term_needs_only_its_table():
    config = DeBERTaConfig(span=4, terms=("c2p",))
    import jax

    params = config.init(jax.random.key(0), num_heads=2, head_dim=8, model_dim=16)
    assert set(params) == {"pos_key"}
    with pytest.raises(ValueError, match="p2c term needs pos_query"):
        DeBERTaConfig(span=4, terms=("p2c",)).build(params)


def test_deberta_v1_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="DeBERTa v1 configs are not supported"):
        from_hf_config(dict(DEBERTA_V3_BASE, model_type="deberta"))


@pytest.mark.parametrize("config", [T5_SMALL, DEBERTA_V3_BASE, LLAMA_3_1_8B], ids=["t5", "deberta-v3", "llama3"])
def test_loaded_encodings_build_a_transformer(config):
    from flax import nnx

    from posenc_jax.nn import Transformer

    loaded = from_hf_config(config)
    model = Transformer(
        vocab_size=8,
        model_dim=16,
        num_layers=1,
        num_heads=2,
        mlp_dim=32,
        encoding=list(loaded.encodings),
        causal=False,
        rngs=nnx.Rngs(0),
    )
    logits = model(jnp.zeros((1, 6), jnp.int32), jnp.arange(6))
    assert logits.shape == (1, 6, 8) and bool(jnp.all(jnp.isfinite(logits)))


# --- the families as shipped ---------------------------------------------------------------------
#
# Each dict below is a model's config.json as published on the Hugging Face Hub: every field
# that bears on positions or the score scale, the sizes, and a few fields that do not (which the
# loader must pass over). Long LongRoPE factor lists keep their published length (one factor per
# rotary frequency) but not their values. The expected values are the formulas of transformers
# 5.24.0 (its PyPI wheel): modeling_rope_utils.py (standardize_rope_params, _compute_*_parameters),
# each family's configuration_*.py (defaults, layer_types) and modeling_*.py (rotary function,
# attention scaling, ALiBi tensor), transliterated into NumPy below where a number is compared.


def _factors(count, step):
    return [round(1.0 + step * i, 4) for i in range(count)]


LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "max_position_embeddings": 4096,
    "pretraining_tp": 1,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "vocab_size": 32000,
}
LLAMA_3_8B = dict(LLAMA_2_7B, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
LLAMA_3_2_1B = {
    "model_type": "llama",
    "head_dim": 64,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 16,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
}
MISTRAL_7B_V01 = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
}
MISTRAL_7B_V03 = dict(MISTRAL_7B_V01, rope_theta=1000000.0, sliding_window=None)
MISTRAL_NEMO = {  # head_dim 128 although 5120 / 32 = 160
    "model_type": "mistral",
    "head_dim": 128,
    "hidden_size": 5120,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 40,
    "max_position_embeddings": 1024000,
    "rope_theta": 1000000.0,
    "sliding_window": None,
}
MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "num_local_experts": 8,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "sliding_window": None,
}
QWEN2_5_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_sliding_window": False,
}
QWEN2_5_7B_YARN = dict(  # the model card's long-context setting
    QWEN2_5_7B, rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
)
QWEN1_5_MOE = {
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": 24,
    "max_position_embeddings": 8192,
    "max_window_layers": 21,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
}
QWEN3_0_6B = {  # head_dim 128 although 1024 / 16 = 64
    "model_type": "qwen3",
    "head_dim": 128,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_hidden_layers": 28,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "head_dim": 128,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_hidden_layers": 48,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "use_sliding_window": False,
}
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": 27,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
}
DEEPSEEK_V3 = {  # rope_interleave is absent: transformers' default, True
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
}
GEMMA_2_9B = {
    "model_type": "gemma2",
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_size": 3584,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_hidden_layers": 42,
    "max_position_embeddings": 8192,
    "query_pre_attn_scalar": 256,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "sliding_window_size": 4096,
    "cache_implementation": "hybrid",
}
GEMMA_2_27B = dict(
    GEMMA_2_9B,
    head_dim=128,
    hidden_size=4608,
    num_attention_heads=32,
    num_key_value_heads=16,
    num_hidden_layers=46,
    query_pre_attn_scalar=144,
)
GEMMA_3_1B = {
    "model_type": "gemma3_text",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_size": 1152,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 26,
    "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
}
GEMMA_3_27B = {  # the multimodal file: text_config holds only what differs from Gemma3TextConfig's defaults
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "mm_tokens_per_image": 256,
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "model_type": "gemma3_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model"},
}
GEMMA_3_4B_V5 = {  # Gemma 3 4B's text config as transformers 5 writes it: per-layer-type rope_parameters
    "model_type": "gemma3_text",
    "head_dim": 256,
    "hidden_size": 2560,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 34,
    "max_position_embeddings": 131072,
    "query_pre_attn_scalar": 256,
    "sliding_window": 1024,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)],
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
PHI_3_MINI_4K = {
    "model_type": "phi3",
    "hidden_size": 3072,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
}
PHI_3_5_MINI = dict(
    PHI_3_MINI_4K,
    max_position_embeddings=131072,
    rope_scaling={"long_factor": _factors(48, 0.9), "short_factor": _factors(48, 0.01), "type": "longrope"},
    sliding_window=262144,
)
PHI_4 = {
    "model_type": "phi3",
    "hidden_size": 5120,
    "num_attention_heads": 40,
    "num_key_value_heads": 10,
    "num_hidden_layers": 40,
    "max_position_embeddings": 16384,
    "original_max_position_embeddings": 16384,
    "rope_scaling": None,
    "rope_theta": 250000,
    "sliding_window": None,
}
PHI_4_MINI = {  # 3/4 of each 128-wide head rotates: 48 LongRoPE factors
    "model_type": "phi3",
    "hidden_size": 3072,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.75,
    "rope_scaling": {"long_factor": _factors(48, 0.5), "short_factor": _factors(48, 0.02), "type": "longrope"},
    "rope_theta": 10000.0,
    "sliding_window": 262144,
}
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "head_dim": 64,
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 24,
    "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
}
PYTHIA_70M = {
    "model_type": "gpt_neox",
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_hidden_layers": 6,
    "max_position_embeddings": 2048,
    "rotary_emb_base": 10000,
    "rotary_pct": 0.25,
    "use_parallel_residual": True,
}
GPT_NEOX_20B = dict(PYTHIA_70M, hidden_size=6144, num_attention_heads=64, num_hidden_layers=44)
GPT_J_6B = {
    "model_type": "gptj",
    "n_embd": 4096,
    "n_head": 16,
    "n_layer": 28,
    "n_positions": 2048,
    "rotary": True,
    "rotary_dim": 64,
    "scale_attn_weights": True,
}
FALCON_7B = {
    "model_type": "falcon",
    "alibi": False,
    "hidden_size": 4544,
    "multi_query": True,
    "new_decoder_architecture": False,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "parallel_attn": True,
}
FALCON_40B = dict(FALCON_7B, hidden_size=8192, new_decoder_architecture=True, num_attention_heads=128, num_kv_heads=8)
FALCON_RW_1B = {
    "model_type": "falcon",
    "alibi": True,
    "bias": True,
    "hidden_size": 2048,
    "multi_query": False,
    "new_decoder_architecture": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 24,
    "parallel_attn": False,
}
BLOOM_560M = {
    "model_type": "bloom",
    "hidden_size": 1024,
    "n_head": 16,
    "n_layer": 24,
    "offset_alibi": 100,
    "pretraining_tp": 1,
    "slow_but_exact": False,
}
BLOOM_176B = dict(BLOOM_560M, hidden_size=14336, n_head=112, n_layer=70, pretraining_tp=4)
MPT_7B = {
    "model_type": "mpt",
    "attn_config": {
        "alibi": True,
        "alibi_bias_max": 8,
        "attn_impl": "torch",
        "attn_pdrop": 0,
        "attn_type": "multihead_attention",
        "attn_uses_sequence_id": False,
        "clip_qkv": None,
        "prefix_lm": False,
        "qk_ln": False,
        "softmax_scale": None,
    },
    "d_model": 4096,
    "learned_pos_emb": True,
    "logit_scale": None,
    "max_seq_len": 2048,
    "n_heads": 32,
    "n_layers": 32,
    "no_bias": True,
}
MPT_30B = dict(MPT_7B, d_model=7168, n_heads=64, n_layers=48, max_seq_len=8192)
T5_SMALL_ORIGINAL = {  # t5-small: no relative_attention_max_distance (default 128), a legacy n_positions
    "model_type": "t5",
    "d_kv": 64,
    "d_model": 512,
    "num_heads": 8,
    "num_layers": 6,
    "n_positions": 512,
    "relative_attention_num_buckets": 32,
    "is_encoder_decoder": True,
}
FLAN_T5_BASE = {
    "model_type": "t5",
    "d_kv": 64,
    "d_model": 768,
    "feed_forward_proj": "gated-gelu",
    "num_heads": 12,
    "num_layers": 12,
    "num_decoder_layers": 12,
    "n_positions": 512,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "is_encoder_decoder": True,
}
MT5_SMALL = {
    "model_type": "mt5",
    "d_kv": 64,
    "d_model": 512,
    "num_heads": 6,
    "num_layers": 8,
    "relative_attention_num_buckets": 32,
    "is_encoder_decoder": True,
}
DEBERTA_V2_XLARGE = {
    "model_type": "deberta-v2",
    "attention_head_size": 64,
    "conv_kernel_size": 3,
    "hidden_size": 1536,
    "layer_norm_eps": 1e-7,
    "max_position_embeddings": 512,
    "max_relative_positions": -1,
    "norm_rel_ebd": "layer_norm",
    "num_attention_heads": 24,
    "pos_att_type": "p2c|c2p",
    "position_biased_input": False,
    "position_buckets": 256,
    "relative_attention": True,
    "share_att_key": True,
}


def hf_mscale(factor, mscale):
    """DeepSeek's yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


HALF, INTER = "half", "interleaved"
SLIDE, FULL = "sliding_attention", "full_attention"
# (config, layer_type): family, layout, qk head size, rotated features, base, scaling, score scale, K, window.
SHIPPED = {
    "llama-2-7b": (LLAMA_2_7B, None, "rope", HALF, 128, 128, 1e4, None, 128**-0.5, 32, None),
    "llama-3-8b": (LLAMA_3_8B, None, "rope", HALF, 128, 128, 5e5, None, 128**-0.5, 8, None),
    "llama-3.1-8b": (LLAMA_3_1_8B, None, "rope", HALF, 128, 128, 5e5, "llama3", 128**-0.5, 8, None),
    "llama-3.2-1b": (LLAMA_3_2_1B, None, "rope", HALF, 64, 64, 5e5, "llama3", 64**-0.5, 8, None),
    "mistral-7b-v0.1": (MISTRAL_7B_V01, None, "rope", HALF, 128, 128, 1e4, None, 128**-0.5, 8, 4096),
    "mistral-7b-v0.3": (MISTRAL_7B_V03, None, "rope", HALF, 128, 128, 1e6, None, 128**-0.5, 8, None),
    "mistral-nemo": (MISTRAL_NEMO, None, "rope", HALF, 128, 128, 1e6, None, 128**-0.5, 8, None),
    "mixtral-8x7b": (MIXTRAL_8X7B, None, "rope", HALF, 128, 128, 1e6, None, 128**-0.5, 8, None),
    "qwen2.5-7b": (QWEN2_5_7B, None, "rope", HALF, 128, 128, 1e6, None, 128**-0.5, 4, None),
    "qwen2.5-7b-yarn": (QWEN2_5_7B_YARN, None, "rope", HALF, 128, 128, 1e6, "yarn", 128**-0.5, 4, None),
    "qwen1.5-moe": (QWEN1_5_MOE, None, "rope", HALF, 128, 128, 1e6, None, 128**-0.5, 16, None),
    "qwen3-0.6b": (QWEN3_0_6B, None, "rope", HALF, 128, 128, 1e6, None, 128**-0.5, 8, None),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, None, "rope", HALF, 128, 128, 1e6, None, 128**-0.5, 4, None),
    "deepseek-v2-lite": (
        DEEPSEEK_V2_LITE,
        None,
        "rope",
        INTER,
        192,
        64,
        1e4,
        "yarn",
        192**-0.5 * hf_mscale(40, 0.707) ** 2,
        16,
        None,
    ),
    "deepseek-v3": (
        DEEPSEEK_V3,
        None,
        "rope",
        INTER,
        192,
        64,
        1e4,
        "yarn",
        192**-0.5 * hf_mscale(40, 1.0) ** 2,
        128,
        None,
    ),
    "gemma-2-9b-sliding": (GEMMA_2_9B, SLIDE, "rope", HALF, 256, 256, 1e4, None, 256**-0.5, 8, 4096),
    "gemma-2-9b-full": (GEMMA_2_9B, FULL, "rope", HALF, 256, 256, 1e4, None, 256**-0.5, 8, None),
    "gemma-2-27b-full": (GEMMA_2_27B, FULL, "rope", HALF, 128, 128, 1e4, None, 144**-0.5, 16, None),
    "gemma-3-1b-sliding": (GEMMA_3_1B, SLIDE, "rope", HALF, 256, 256, 1e4, None, 256**-0.5, 1, 512),
    "gemma-3-1b-full": (GEMMA_3_1B, FULL, "rope", HALF, 256, 256, 1e6, None, 256**-0.5, 1, None),
    "gemma-3-27b-sliding": (GEMMA_3_27B, SLIDE, "rope", HALF, 128, 128, 1e4, None, 168**-0.5, 16, 1024),
    "gemma-3-27b-full": (GEMMA_3_27B, FULL, "rope", HALF, 128, 128, 1e6, "linear", 168**-0.5, 16, None),
    "gemma-3-4b-v5-sliding": (GEMMA_3_4B_V5, SLIDE, "rope", HALF, 256, 256, 1e4, None, 256**-0.5, 4, 1024),
    "gemma-3-4b-v5-full": (GEMMA_3_4B_V5, FULL, "rope", HALF, 256, 256, 1e6, "linear", 256**-0.5, 4, None),
    "phi-3-mini-4k": (PHI_3_MINI_4K, None, "rope", HALF, 96, 96, 1e4, None, 96**-0.5, 32, 2047),
    "phi-3.5-mini": (PHI_3_5_MINI, None, "rope", HALF, 96, 96, 1e4, "longrope", 96**-0.5, 32, 262144),
    "phi-4": (PHI_4, None, "rope", HALF, 128, 128, 2.5e5, None, 128**-0.5, 10, None),
    "phi-4-mini": (PHI_4_MINI, None, "rope", HALF, 128, 96, 1e4, "longrope", 128**-0.5, 8, 262144),
    "gpt-oss-20b-sliding": (GPT_OSS_20B, SLIDE, "rope", HALF, 64, 64, 1.5e5, "yarn", 64**-0.5, 8, 128),
    "gpt-oss-20b-full": (GPT_OSS_20B, FULL, "rope", HALF, 64, 64, 1.5e5, "yarn", 64**-0.5, 8, None),
    "pythia-70m": (PYTHIA_70M, None, "rope", HALF, 64, 16, 1e4, None, 64**-0.5, 8, None),
    "gpt-neox-20b": (GPT_NEOX_20B, None, "rope", HALF, 96, 24, 1e4, None, 96**-0.5, 64, None),
    "gpt-j-6b": (GPT_J_6B, None, "rope", INTER, 256, 64, 1e4, None, 256**-0.5, 16, None),
    "falcon-7b": (FALCON_7B, None, "rope", HALF, 64, 64, 1e4, None, 64**-0.5, 1, None),
    "falcon-40b": (FALCON_40B, None, "rope", HALF, 64, 64, 1e4, None, 64**-0.5, 8, None),
    "falcon-rw-1b": (FALCON_RW_1B, None, "alibi", None, 64, None, None, None, 64**-0.5, 32, None),
    "bloom-560m": (BLOOM_560M, None, "alibi", None, 64, None, None, None, 64**-0.5, 16, None),
    "bloom-176b": (BLOOM_176B, None, "alibi", None, 128, None, None, None, 128**-0.5, 112, None),
    "mpt-7b": (MPT_7B, None, "alibi", None, 128, None, None, None, 128**-0.5, 32, None),
    "mpt-30b": (MPT_30B, None, "alibi", None, 112, None, None, None, 112**-0.5, 64, None),
    "t5-small": (T5_SMALL_ORIGINAL, None, "t5", None, 64, None, None, None, 1.0, 8, None),
    "flan-t5-base": (FLAN_T5_BASE, None, "t5", None, 64, None, None, None, 1.0, 12, None),
    "mt5-small": (MT5_SMALL, None, "t5", None, 64, None, None, None, 1.0, 6, None),
    "deberta-v3-base": (DEBERTA_V3_BASE, None, "deberta-v2", None, 64, None, None, None, (64 * 3) ** -0.5, 12, None),
    "deberta-v2-xlarge": (
        DEBERTA_V2_XLARGE,
        None,
        "deberta-v2",
        None,
        64,
        None,
        None,
        None,
        (64 * 3) ** -0.5,
        24,
        None,
    ),
}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load_as_transformers_sets_them_up(name):
    config, layer_type, family, layout, head_dim, rotary, base, scaling, scale, kv_heads, window = SHIPPED[name]
    loaded = from_hf_config(config, layer_type=layer_type)
    assert loaded.family == family and loaded.head_dim == head_dim and loaded.num_kv_heads == kv_heads
    assert loaded.scale == pytest.approx(scale, rel=1e-12)
    assert loaded.sliding_window == window
    assert loaded.causal is (family in ("rope", "alibi"))
    rope = loaded.rope
    if family != "rope":
        assert rope is None and loaded.rotary_dim is None
        return
    assert (rope.layout, loaded.rotary_dim, rope.base) == (layout, rotary, base)
    assert (None if rope.scaling is None else rope.scaling.name) == scaling
    freq, _ = loaded.encodings[0].frequencies(loaded.head_dim)
    assert freq.shape == (rotary // 2,)


def test_deepseek_v3_interleaves_on_its_64_rotary_features_with_the_mscale_squared_scale():
    loaded = from_hf_config(DEEPSEEK_V3)
    # 192^-0.5 · (0.1 · ln 40 + 1)^2, transformers' yarn_apply_mscale.
    assert loaded.scale == pytest.approx(0.13523, abs=1e-5)
    assert isinstance(loaded.encodings[0], RoPEOnLastFeatures) and loaded.encodings[0].num_features == 64
    assert loaded.rope.layout == "interleaved" and loaded.rope.rotary_dim is None
    assert loaded.rope.scaling.attention_factor() == 1.0  # mscale == mscale_all_dim
    half = from_hf_config(dict(DEEPSEEK_V3, rope_interleave=False))
    assert half.rope.layout == "half"


def test_gemma3_layer_types_pick_their_rope_and_window():
    sliding = from_hf_config(GEMMA_3_27B, layer_type="sliding_attention")
    full = from_hf_config(GEMMA_3_27B, layer_type="full_attention")
    assert sliding.rope.base == 10000.0 and sliding.rope.scaling is None and sliding.sliding_window == 1024
    assert full.rope.base == 1e6 and full.rope.scaling.factor == 8.0 and full.sliding_window is None
    assert sliding.scale == full.scale == pytest.approx(168**-0.5)
    # Gemma3TextConfig's layer pattern: every sixth layer is global.
    assert sliding.layer_types == tuple(FULL if (i + 1) % 6 == 0 else SLIDE for i in range(62))
    with pytest.raises(ValueError, match=r"differ by type \['full_attention', 'sliding_attention'\]"):
        from_hf_config(GEMMA_3_27B)
    with pytest.raises(ValueError, match=r"'chunked_attention' is not one of .* \['full_attention', 'sliding"):
        from_hf_config(GEMMA_3_27B, layer_type="chunked_attention")


def test_gemma2_reports_its_soft_capping_and_gpt_oss_its_sinks():
    gemma2 = from_hf_config(GEMMA_2_9B, layer_type="sliding_attention")
    assert gemma2.logit_softcap == 50.0 and any("attn_logit_softcapping" in note for note in gemma2.notes)
    assert from_hf_config(GEMMA_3_1B, layer_type="full_attention").logit_softcap is None
    assert any("sinks" in note for note in from_hf_config(GPT_OSS_20B, layer_type="full_attention").notes)


def test_qwen_windows_follow_use_sliding_window_and_max_window_layers():
    windowed = dict(QWEN2_5_7B, use_sliding_window=True, max_window_layers=20, sliding_window=4096)
    loaded = from_hf_config(windowed, layer_type="sliding_attention")
    assert loaded.layer_types == tuple(SLIDE if i >= 20 else FULL for i in range(28))
    assert loaded.sliding_window == 4096
    assert from_hf_config(QWEN2_5_7B).layer_types == (FULL,) * 28  # use_sliding_window false: no window


# --- each family's rotary function, transliterated (transformers 5.24.0) -------------------------


def hf_text_fields(config):
    if config.get("model_type") == "gemma3":
        return dict(config["text_config"])
    return dict(config)


def hf_rope_view(config, layer_type):
    """The Llama-style view hf_rope_parameters reads: the config after the family's standardisation."""
    c = hf_text_fields(config)
    mt = c.get("model_type")
    if mt == "gemma3_text":  # Gemma3TextConfig.convert_rope_params_to_dict
        if isinstance(c.get("rope_parameters"), dict) and layer_type in c["rope_parameters"]:
            rope = dict(c["rope_parameters"][layer_type])
        elif layer_type == SLIDE:
            rope = {"rope_type": "default", "rope_theta": c.get("rope_local_base_freq", 10000.0)}
        else:
            rope = dict(c.get("rope_scaling") or {"rope_type": "default"})
            rope.setdefault("rope_theta", c.get("rope_theta", 1e6))
        c.setdefault("head_dim", 256)
        c.setdefault("max_position_embeddings", 131072)
    elif mt == "gpt_neox":  # GPTNeoXConfig: rotary_emb_base, rotary_pct
        rope = {"rope_type": "default", "rope_theta": c["rotary_emb_base"], "partial_rotary_factor": c["rotary_pct"]}
    else:
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rope.setdefault("rope_theta", c.get("rope_theta", 10000.0))
        if c.get("partial_rotary_factor") is not None:
            rope.setdefault("partial_rotary_factor", c["partial_rotary_factor"])
    if mt in ("deepseek_v2", "deepseek_v3"):
        c["head_dim"] = c["qk_rope_head_dim"]  # DeepseekV3Config.__post_init__
    c["rope_parameters"], c["rope_scaling"] = rope, None
    return c


def hf_rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return np.stack((-x2, x1), axis=-1).reshape(x.shape)


def hf_gptj_rotary(q, positions, rotary_dim):
    """GPT-J: create_sinusoidal_positions, then apply_rotary_pos_emb on the first rotary_dim features."""
    inv_freq = 1.0 / (10000 ** (np.arange(0, rotary_dim, 2, dtype=np.int64) / rotary_dim))
    sinusoid = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)
    sin, cos = np.sin(sinusoid), np.cos(sinusoid)
    sin = np.repeat(sin[None, :, None, :], 2, axis=3)
    cos = np.repeat(cos[None, :, None, :], 2, axis=3)
    rot, rest = q[..., :rotary_dim], q[..., rotary_dim:]
    return np.concatenate((rot * cos + hf_rotate_every_two(rot) * sin, rest), axis=-1)


def hf_deepseek_v3_rotary(q, positions, inv_freq, factor, nope):
    """DeepSeek-V3, rope_interleave: apply_rotary_pos_emb_interleave on q[..., nope:], then cat(q_pass, q_rot)."""
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    cos, sin = (np.cos(freqs) * factor)[None, :, None, :], (np.sin(freqs) * factor)[None, :, None, :]
    rot = q[..., nope:]
    q1, q2 = rot[..., 0::2], rot[..., 1::2]
    return np.concatenate((q[..., :nope], q1 * cos - q2 * sin, q2 * cos + q1 * sin), axis=-1)


def hf_deepseek_v2_rotary(q, positions, inv_freq, factor, nope):
    """DeepSeek-V2: apply_rotary_emb, complex products of (q[2i], q[2i+1]) with polar(1, p·θ)·factor."""
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    cis = np.exp(1j * freqs.astype(np.float64)) * factor
    rot = q[..., nope:].astype(np.float64)
    pairs = rot[..., 0::2] + 1j * rot[..., 1::2]
    out = pairs * cis[None, :, None, :]
    rotated = np.stack((out.real, out.imag), axis=-1).reshape(rot.shape).astype(np.float32)
    return np.concatenate((q[..., :nope], rotated), axis=-1)


def hf_gpt_oss_rotary(q, positions, inv_freq, factor):
    """gpt-oss: _apply_rotary_emb, torch.chunk into halves."""
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    cos, sin = (np.cos(freqs) * factor)[None, :, None, :], (np.sin(freqs) * factor)[None, :, None, :]
    first, second = np.split(q, 2, axis=-1)
    return np.concatenate((first * cos - second * sin, second * cos + first * sin), axis=-1)


def hf_family_rotate(config, layer_type, q, positions):
    """transformers' rotated queries ``[1, T, N, H]`` for a shipped config."""
    c = hf_text_fields(config)
    mt = c.get("model_type")
    if mt == "gptj":
        return hf_gptj_rotary(q, positions, c["rotary_dim"])
    inv_freq, factor = hf_rope_parameters(hf_rope_view(config, layer_type), seq_len=int(positions.max()) + 1)
    if mt == "deepseek_v3":
        return hf_deepseek_v3_rotary(q, positions, inv_freq, factor, c["qk_nope_head_dim"])
    if mt == "deepseek_v2":
        return hf_deepseek_v2_rotary(q, positions, inv_freq, factor, c["qk_nope_head_dim"])
    if mt == "gpt_oss":
        return hf_gpt_oss_rotary(q, positions, inv_freq, factor)
    return hf_apply_rotary(q, positions, inv_freq, factor)


ROPE_SHIPPED = [name for name, case in SHIPPED.items() if case[2] == "rope"]


@pytest.mark.parametrize("name", ROPE_SHIPPED)
def test_shipped_rope_configs_rotate_as_their_family_does(name, rng):
    config, layer_type = SHIPPED[name][:2]
    loaded = from_hf_config(config, layer_type=layer_type)
    q = rng.standard_normal((1, 12, 2, loaded.head_dim)).astype(np.float32)
    k = rng.standard_normal((1, 12, 2, loaded.head_dim)).astype(np.float32)
    positions = np.arange(12) + 5
    hook, *rest = loaded.hooks()  # and the checkpoint's score scale where it is not 1/√H
    assert rest in ([], [FixedScoreScale(loaded.scale)])
    ours_q, ours_k = hook.rotate(jnp.asarray(q), jnp.asarray(k), loaded.context(positions, positions))
    want_q, want_k = (hf_family_rotate(config, layer_type, x, positions) for x in (q, k))
    if loaded.model_type == "deepseek_v3":
        # transformers writes the rotated pairs de-interleaved (evens, then odds); the scores are the same.
        nope = loaded.head_dim - loaded.rotary_dim
        order = np.concatenate([np.arange(nope), nope + np.arange(0, 64, 2), nope + np.arange(1, 64, 2)])
        np.testing.assert_allclose(
            np.einsum("btnh,bsnh->bnts", ours_q, ours_k), np.einsum("btnh,bsnh->bnts", want_q, want_k), atol=2e-4
        )
        ours_q, ours_k = np.asarray(ours_q)[..., order], np.asarray(ours_k)[..., order]
    np.testing.assert_allclose(ours_q, want_q, atol=2e-5)
    np.testing.assert_allclose(ours_k, want_k, atol=2e-5)


@pytest.mark.parametrize("name", SHIPPED)
def test_the_loaded_encodings_carry_the_score_scale(name):
    """Whatever is built from the encodings alone scores with the checkpoint's scale."""
    config, layer_type = SHIPPED[name][:2]
    loaded = from_hf_config(config, layer_type=layer_type)
    sizes = dict(num_heads=loaded.num_heads, head_dim=loaded.head_dim, model_dim=loaded.num_heads * loaded.head_dim)
    hooks = [e.build(e.init(jax.random.key(0), **sizes)) for e in loaded.encodings if e.acts_on != "embeddings"]
    prescribed = {hook.score_scale(loaded.head_dim) for hook in hooks if isinstance(hook, ScoreScale)}
    assert len(prescribed) <= 1
    assert (prescribed.pop() if prescribed else loaded.head_dim**-0.5) == pytest.approx(loaded.scale, rel=1e-12)


@pytest.mark.parametrize("name", ["gemma-2-27b-full", "deepseek-v3", "llama-3.1-8b"])
def test_a_layer_built_from_the_loaded_encodings_needs_no_scale_forwarded(name, rng):
    from flax import nnx

    from posenc_jax.nn import MultiHeadAttention

    config, layer_type = SHIPPED[name][:2]
    loaded = from_hf_config(config, layer_type=layer_type)
    head_dim, heads, length = loaded.head_dim, 2, 5
    layer = MultiHeadAttention(heads, 32, heads * head_dim, encodings=loaded.encodings, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((1, length, 32)), jnp.float32)
    pos = jnp.arange(length)
    q, k, v = (proj(x) for proj in (layer.query, layer.key, layer.value))
    rotation = [hook for hook in loaded.hooks() if not isinstance(hook, FixedScoreScale)]
    want = dot_product_attention(
        q, k, v, query_positions=pos, key_positions=pos, encodings=rotation, scale=loaded.scale, causal=True
    )
    want = layer.out(want)
    np.testing.assert_allclose(layer(x, causal=True), want, atol=1e-5)
    # The functional form, from the built hooks alone, and with the keyword arguments.
    hooks = loaded.hooks()
    alone = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=hooks, causal=True)
    np.testing.assert_allclose(alone, dot_product_attention(q, k, v, **loaded.attention_kwargs(pos)), atol=1e-6)


def hf_softmax_attention(scores, v, allowed):
    scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", weights, v)


@pytest.mark.parametrize(
    "config, layer_type",
    [
        (dict(GEMMA_3_1B, sliding_window=5), SLIDE),  # the window shrunk to 5 so 16 tokens cross it
        (GEMMA_3_27B, FULL),
        (DEEPSEEK_V3, None),
        (dict(MISTRAL_7B_V01, sliding_window=4), None),
    ],
    ids=["gemma3-sliding", "gemma3-full", "deepseek-v3", "mistral-window"],
)
def test_attention_kwargs_give_the_checkpoints_attention(config, layer_type, rng):
    """eager_attention_forward: softmax(scaling · q'k'ᵀ + causal and window mask) v, with q', k' rotated."""
    loaded = from_hf_config(config, layer_type=layer_type)
    length, heads, head_dim = 16, 2, loaded.head_dim
    q, k = (rng.standard_normal((1, length, heads, head_dim)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, length, heads, 32)).astype(np.float32)
    positions = np.arange(length) + 3
    ours = dot_product_attention(q, k, v, **loaded.attention_kwargs(jnp.asarray(positions)))
    rq, rk = (hf_family_rotate(config, layer_type, x, positions) for x in (q, k))
    scores = np.einsum("btnh,bsnh->bnts", rq, rk) * loaded.scale
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    allowed = j <= i
    if loaded.sliding_window is not None:
        allowed &= j > i - loaded.sliding_window  # masking_utils.sliding_window_overlay
    np.testing.assert_allclose(ours, hf_softmax_attention(scores, v, allowed), atol=3e-5)


# --- ALiBi families, transliterated --------------------------------------------------------------


def hf_bloom_alibi_slopes(num_heads):
    """build_alibi_tensor's slopes (BLOOM and Falcon), in float64 (transformers rounds them to bfloat16)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = base ** np.arange(1, 1 + closest)
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, num_heads - closest)
        slopes = np.concatenate([slopes, extra_base ** np.arange(1, 1 + 2 * remaining, 2)])
    return slopes


def hf_alibi_attention(config, q, k, v):
    """BLOOM (baddbmm: alibi + q·k/√H), Falcon (sdpa: (q·k + alibi)/√H) and MPT (q·k·scale + alibi)."""
    t = q.shape[1]
    heads, head_dim = q.shape[2], q.shape[3]
    content = np.einsum("btnh,bsnh->bnts", q, k)
    keys = np.arange(t, dtype=np.float64)
    if config["model_type"] == "mpt":
        bias_max = config["attn_config"]["alibi_bias_max"]
        padded = 2 ** math.ceil(math.log2(heads))
        slopes = 1.0 / 2.0 ** (np.arange(1, padded + 1) * (bias_max / padded))
        if padded != heads:
            slopes = np.concatenate([slopes[1::2], slopes[::2]])[:heads]
        alibi = slopes[:, None, None] * np.arange(1 - t, 1)[None, None, :]
        scale = config["attn_config"]["softmax_scale"] or head_dim**-0.5
        scores = content * scale + alibi
    else:
        alibi = hf_bloom_alibi_slopes(heads)[:, None, None] * keys[None, None, :]  # slope · (cumsum(mask) - 1)
        scores = content / math.sqrt(head_dim) + alibi
        if config["model_type"] == "falcon":
            scores = (content + alibi) / math.sqrt(head_dim)
    allowed = np.arange(t)[None, :] <= np.arange(t)[:, None]
    return hf_softmax_attention(scores, v, allowed)


@pytest.mark.parametrize(
    "config",
    [
        BLOOM_560M,
        dict(BLOOM_560M, n_head=12, hidden_size=768),
        MPT_7B,
        FALCON_RW_1B,
        dict(
            MPT_7B,
            n_heads=12,
            d_model=768,
            attn_config=dict(MPT_7B["attn_config"], alibi_bias_max=16, softmax_scale=0.1),
        ),
    ],
    ids=["bloom-560m", "bloom-12-heads", "mpt-7b", "falcon-rw-1b", "mpt-12-heads-bias-max-16"],
)
def test_alibi_configs_give_the_checkpoints_attention(config, rng):
    loaded = from_hf_config(config)
    heads, head_dim, length = loaded.num_heads, loaded.head_dim, 24
    q, k, v = (rng.standard_normal((1, length, heads, head_dim)).astype(np.float32) for _ in range(3))
    ours = dot_product_attention(q, k, v, **loaded.attention_kwargs(jnp.arange(length)))
    np.testing.assert_allclose(ours, hf_alibi_attention(config, q, k, v), atol=3e-5)


def test_falcon_slopes_are_divided_by_sqrt_head_dim_and_bloom_176b_has_press_slopes():
    (falcon,) = from_hf_config(FALCON_RW_1B).encodings
    np.testing.assert_allclose(falcon.slopes, hf_bloom_alibi_slopes(32) / 8.0, rtol=1e-12)
    (bloom,) = from_hf_config(BLOOM_176B).encodings
    context = AttentionContext.from_positions(jnp.arange(3), jnp.arange(3), causal=True, scale=1.0, num_heads=112)
    np.testing.assert_allclose(bloom.bias(context)[0, :, 2, 1], hf_bloom_alibi_slopes(112) * -1.0, rtol=1e-6)


# --- checkpoint weights --------------------------------------------------------------------------


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_t5_weights_load_from_a_state_dict(decoder, rng):
    heads, head_dim, length = 8, 4, 150
    config = dict(FLAN_T5_BASE, num_heads=heads, d_kv=head_dim)
    tables = {side: rng.standard_normal((32, heads)).astype(np.float32) for side in ("encoder", "decoder")}
    state = {f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight": t for side, t in tables.items()}
    state["shared.weight"] = np.zeros((4, 8), np.float32)
    params = load_hf_position_weights(config, state, decoder=decoder)
    loaded = from_hf_config(config, decoder=decoder)
    q, k, v = (rng.standard_normal((1, length, heads, head_dim)).astype(np.float32) for _ in range(3))
    ours = dot_product_attention(q, k, v, **loaded.attention_kwargs(jnp.arange(length), params=params))
    want = hf_t5_attention(
        q, k, v, tables["decoder" if decoder else "encoder"], is_decoder=decoder, num_buckets=32, max_distance=128
    )
    np.testing.assert_allclose(ours, want, atol=2e-5)


def hf_layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


@pytest.mark.parametrize("share_att_key", [True, False], ids=["v3-shared-key", "own-projections"])
def test_deberta_weights_load_from_a_state_dict(share_att_key, rng):
    heads, head_dim, length, layer = 2, 4, 30, 1
    width = heads * head_dim
    config = dict(
        DEBERTA_V3_BASE, hidden_size=width, num_attention_heads=heads, position_buckets=8, share_att_key=share_att_key
    )
    config["max_relative_positions"], config["position_biased_input"] = 24, True
    w = {}
    for name in ("query", "key", "value", "pos_key", "pos_query"):
        w[name + "_kernel"] = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        w[name + "_bias"] = rng.standard_normal(width).astype(np.float32) * 0.1
    rel_embeddings = rng.standard_normal((16, width)).astype(np.float32)
    norm_w, norm_b = 1 + 0.1 * rng.standard_normal(width), 0.1 * rng.standard_normal(width)
    absolute = rng.standard_normal((512, width)).astype(np.float32)
    prefix = f"deberta.encoder.layer.{layer}.attention.self."
    state = {
        "deberta.encoder.rel_embeddings.weight": rel_embeddings,
        "deberta.encoder.LayerNorm.weight": norm_w.astype(np.float32),
        "deberta.encoder.LayerNorm.bias": norm_b.astype(np.float32),
        "deberta.embeddings.position_embeddings.weight": absolute,
        "deberta.encoder.layer.0.attention.self.key_proj.weight": np.zeros((width, width), np.float32),
    }
    for name in ("query", "key", "pos_key", "pos_query"):  # torch's Linear: weight [out, in]
        state[prefix + name + "_proj.weight"] = w[name + "_kernel"].T
        state[prefix + name + "_proj.bias"] = w[name + "_bias"]
    params = load_hf_position_weights(config, state, layer=layer)
    loaded = from_hf_config(config)
    np.testing.assert_array_equal(params[0]["table"], absolute)
    hidden = rng.standard_normal((1, length, width)).astype(np.float32)
    normed = hf_layer_norm(rel_embeddings, norm_w, norm_b, 1e-7).astype(
        np.float32
    )  # DebertaV2Encoder.get_rel_embedding
    want = hf_deberta_v2_attention(
        hidden,
        w,
        normed,
        heads=heads,
        pos_att_type=("p2c", "c2p"),
        share_att_key=share_att_key,
        buckets=8,
        max_relative=24,
    )
    q, k, v = (
        (hidden @ w[n + "_kernel"] + w[n + "_bias"]).reshape(1, length, heads, head_dim)
        for n in ("query", "key", "value")
    )
    ours = dot_product_attention(q, k, v, **loaded.attention_kwargs(jnp.arange(length), params=params))
    np.testing.assert_allclose(ours, want, atol=2e-5)
    with pytest.raises(ValueError, match="pass layer= the layer index"):
        load_hf_position_weights(config, state)
    with pytest.raises(ValueError, match="no key ending with 'encoder.rel_embeddings.weight'"):
        load_hf_position_weights(config, {k: v for k, v in state.items() if "rel_embeddings" not in k}, layer=layer)


def test_parameterised_encodings_ask_for_their_weights():
    with pytest.raises(ValueError, match=r"encodings\[0\] \(T5Config\) has parameters: pass"):
        from_hf_config(T5_SMALL_ORIGINAL).attention_kwargs(jnp.arange(4))
    assert load_hf_position_weights(LLAMA_3_1_8B, {}) == ({},)


# --- errors that name the field ------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(LLAMA_2_7B, rope_scaling={"factor": 2.0}), r"has \['factor'\] but no 'rope_type' \(or 'type'\)"),
        (dict(LLAMA_2_7B, hidden_size=4100), "hidden_size=4100 is not a multiple of num_attention_heads=32"),
        (dict(LLAMA_2_7B, num_attention_heads=0), "num_attention_heads must be an integer >= 1"),
        (dict(LLAMA_2_7B, partial_rotary_factor=1.5), r"partial_rotary_factor must be a number in \(0, 1\]"),
        (dict(LLAMA_2_7B, partial_rotary_factor=0.0), r"partial_rotary_factor must be a number in \(0, 1\]"),
        (dict(PYTHIA_70M, rotary_pct=-0.25), r"rotary_pct must be a number in \(0, 1\]"),
        (dict(LLAMA_2_7B, rope_interleave=True), r"rope_interleave=True, which bear\(s\) on positions"),
        (dict(LLAMA_2_7B, position_embedding_type="relative_key"), "position_embedding_type='relative_key'"),
        (
            dict(LLAMA_2_7B, rope_scaling={"rope_type": "linear", "factor": 2.0, "mrope_section": [16, 24, 24]}),
            r"has \['mrope_section'\], which rope_type 'linear' does not have",
        ),
        (dict(LLAMA_2_7B, rope_scaling={"rope_type": "mrope"}), "rope_type 'mrope' is not supported"),
        (
            dict(LLAMA_3_1_8B, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
            "has both rope_parameters=.* and rope_scaling=.*, which differ",
        ),
        (dict(GEMMA_3_1B, use_bidirectional_attention=True), "use_bidirectional_attention=True"),
        (dict(GEMMA_2_9B, sliding_window_size=2048), "sliding_window_size=2048 differs from sliding_window=4096"),
        (dict(GPT_J_6B, rotary_dim=None), "rotary_dim is null"),
        (dict(MPT_7B, attn_config=dict(MPT_7B["attn_config"], prefix_lm=True)), "prefix_lm=True"),
        (dict(MPT_7B, attn_config=dict(MPT_7B["attn_config"], rope_theta=1e4)), r"attn_config has \['rope_theta'\]"),
        (dict(BLOOM_560M, n_head=0), "n_head must be an integer >= 1"),
        (dict(T5_SMALL_ORIGINAL, relative_attention_bias_type="log"), "relative_attention_bias_type='log'"),
    ],
)
def test_configs_the_loader_cannot_reproduce_are_errors_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config(config)


@pytest.mark.parametrize("config", [LLAMA_2_7B, T5_SMALL_ORIGINAL, BLOOM_560M, DEBERTA_V3_BASE])
def test_a_layer_type_the_config_lacks_is_an_error_listing_its_types(config):
    with pytest.raises(ValueError, match=r"'sliding_attention' is not one of this config's layer types \['full"):
        from_hf_config(config, layer_type="sliding_attention")
    assert from_hf_config(config, layer_type="full_attention") == from_hf_config(config)


# --- AttentionContext.from_positions -------------------------------------------------------------


def test_from_positions_needs_causal_and_scale():
    pos = jnp.arange(4)
    with pytest.raises(TypeError):
        AttentionContext.from_positions(pos, pos, scale=1.0)
    with pytest.raises(TypeError):
        AttentionContext.from_positions(pos, pos, causal=True)
    with pytest.raises(ValueError, match="causal must be True or False, got 1"):
        AttentionContext.from_positions(pos, pos, causal=1, scale=1.0)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        AttentionContext.from_positions(pos, pos, causal=True, scale=None)
    with pytest.raises(ValueError, match="query_positions must have an integer dtype"):
        AttentionContext.from_positions(pos.astype(jnp.float32), pos, causal=True, scale=1.0)
    context = AttentionContext.from_positions(pos, pos, causal=False, scale=np.float32(0.5), num_heads=2)
    assert context.key_positions is context.query_positions and context.key_length == 4
    assert (context.scale, context.causal, context.num_heads) == (0.5, False, 2)


def test_hooks_called_by_hand_match_the_attention(rng):
    """A context from positions gives a hook the same term the attention gives it (T5 follows causal)."""
    table = jnp.asarray(rng.standard_normal((32, 2)).astype(np.float32))
    hook = T5Config(bidirectional=None).build({"table": table})
    pos = jnp.arange(40)
    causal = hook.logits(None, None, AttentionContext.from_positions(pos, pos, causal=True, scale=1.0))
    both = hook.logits(None, None, AttentionContext.from_positions(pos, pos, causal=False, scale=1.0))
    assert not np.allclose(causal, both)
    np.testing.assert_allclose(
        causal,
        T5Config(bidirectional=False)
        .build({"table": table})
        .bias(AttentionContext.from_positions(pos, pos, causal=False, scale=1.0)),
    )


def hf_as_transformers_5(config):
    """The config as transformers 5 saves it: convert_rope_params_to_dict and standardize_rope_params."""
    c = hf_text_fields(config)
    mt = c["model_type"]
    if "rope_parameters" in c:  # already so
        return c
    if mt == "gemma3_text":
        full = dict(c.pop("rope_scaling", None) or {"rope_type": "default"})
        full.setdefault("rope_theta", c.pop("rope_theta", 1e6))
        sliding = {"rope_type": "default", "rope_theta": c.pop("rope_local_base_freq", 1e4)}
        c["rope_parameters"] = {"full_attention": full, "sliding_attention": sliding}
        return c
    rope = dict(c.pop("rope_scaling", None) or {})
    theta, partial = c.pop("rope_theta", 10000.0), c.pop("partial_rotary_factor", None)
    if mt == "gpt_neox":  # GPTNeoXConfig pops its own names
        theta, partial = c.pop("rotary_emb_base"), c.pop("rotary_pct")
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", theta)
    if partial is not None:
        rope.setdefault("partial_rotary_factor", partial)
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        original = c.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = original or rope.get(
            "original_max_position_embeddings", c["max_position_embeddings"]
        )
    c["rope_parameters"] = rope
    return c


@pytest.mark.parametrize("name", [name for name in ROPE_SHIPPED if SHIPPED[name][0] is not GPT_J_6B])
def test_transformers_5_files_load_as_transformers_4_files(name):
    config, layer_type = SHIPPED[name][:2]
    v4, v5 = (
        from_hf_config(config, layer_type=layer_type),
        from_hf_config(hf_as_transformers_5(config), layer_type=layer_type),
    )
    assert "rope_parameters" in hf_as_transformers_5(config) and "rope_scaling" not in hf_as_transformers_5(config)
    for field in ("encodings", "scale", "head_dim", "rotary_dim", "num_kv_heads", "sliding_window", "layer_type"):
        assert getattr(v5, field) == getattr(v4, field), field


def test_transformers_5_objects_to_dict_load_as_their_files():
    """What a transformers 5.24 config object's to_dict() adds: DeepSeek's head_dim and qk_head_dim,
    Gemma 3's _sliding_window_pattern, every generic field in MPT's attn_config."""
    deepseek = dict(DEEPSEEK_V3, head_dim=64, qk_head_dim=192)
    assert from_hf_config(deepseek).scale == from_hf_config(DEEPSEEK_V3).scale
    with pytest.raises(ValueError, match="qk_head_dim=128 contradicts"):
        from_hf_config(dict(DEEPSEEK_V3, qk_head_dim=128))
    gemma = {k: v for k, v in GEMMA_3_1B.items() if k != "sliding_window_pattern"}
    gemma["_sliding_window_pattern"] = 2
    assert from_hf_config(gemma, layer_type=SLIDE).layer_types[:4] == (SLIDE, FULL, SLIDE, FULL)
    generic = {"architectures": None, "model_type": "", "return_dict": True, "id2label": {0: "LABEL_0"}}
    mpt = dict(MPT_7B, attn_config=dict(MPT_7B["attn_config"], **generic))
    assert from_hf_config(mpt).encodings == from_hf_config(MPT_7B).encodings


def test_decoder_is_for_t5_only():
    with pytest.raises(ValueError, match="decoder= is for T5's encoder and decoder; model_type 'llama'"):
        from_hf_config(LLAMA_2_7B, decoder=True)
    assert from_hf_config(MT5_SMALL, decoder=True).causal is True


# --- issue 56: values that would load as a wrong answer are refused at load --------------------------

SMALL_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 1e4}
SMALL_PHI3_LONGROPE = {
    "model_type": "phi3",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "original_max_position_embeddings": 16,
    "rope_scaling": {"type": "longrope", "short_factor": ["1.0"] * 8, "long_factor": [2.0] * 8},
}


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(SMALL_LLAMA, num_key_value_heads=3), r"num_key_value_heads=3 does not divide num_attention_heads=4"),
        (dict(SMALL_LLAMA, num_key_value_heads=0), r"num_key_value_heads must be an integer >= 1 .*got 0"),
        (dict(SMALL_LLAMA, num_key_value_heads=True), r"num_key_value_heads must be an integer .*got True, a bool"),
        (dict(FALCON_40B, num_kv_heads=3), r"num_kv_heads=3 does not divide num_attention_heads=128"),
        (
            dict(MPT_7B, attn_config=dict(MPT_7B["attn_config"], attn_type="grouped_query_attention", kv_n_heads=5)),
            r"attn_config.kv_n_heads=5 does not divide n_heads=32",
        ),
        ({k: v for k, v in SMALL_LLAMA.items() if k != "model_type"}, r"the config has no model_type"),
        (dict(SMALL_LLAMA, model_type="mamba"), r"model_type 'mamba' is not a family this loader knows"),
        (dict(T5_SMALL_ORIGINAL, model_type="umt5"), r"model_type 'umt5' is not a family this loader knows"),
        (SMALL_PHI3_LONGROPE, r"rope_scaling.short_factor\[0\] must be a number .*got '1.0', a string"),
        (dict(SMALL_LLAMA, head_dim=15), r"head_dim=15 is odd: RoPE rotates pairs of features"),
        (
            dict(SMALL_LLAMA, hidden_size=60),
            r"hidden_size / num_attention_heads = 60 / 4 = 15 is odd: RoPE rotates pairs",
        ),
        (dict(DEEPSEEK_V3, qk_rope_head_dim=63), r"qk_rope_head_dim=63 is odd: RoPE rotates pairs of features"),
        (dict(SMALL_LLAMA, rope_theta=True), r"rope_theta must be a number > 1 .*got True, a bool"),
        (dict(SMALL_LLAMA, rope_theta="1e4"), r"rope_theta must be a number > 1 .*got '1e4', a string"),
        (dict(FALCON_RW_1B, alibi="false"), r"alibi must be true or false .*got 'false', a string"),
    ],
)
def test_config_values_that_would_load_as_a_wrong_answer_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message) as error:
        from_hf_config(config)
    assert "\n" not in str(error.value)


def test_the_hooks_the_loader_builds_declare_their_forms():
    """They live beside their encodings and declare their forms there, as registered encodings do:
    ALiBiSlopes' bias is computed once per forward and shared across layers (and per tile from the tile's
    positions), RoPEOnLastFeatures' keys are cached rotated (as its RoPE's), FixedScoreScale prescribes the
    score scale and adds no term (in tiles too)."""
    from posenc_jax.functional import RoPE
    from posenc_jax.functional.core.forms import Forms, forms_of

    declared = {
        FixedScoreScale(2.0): Forms(hooks=("logits",), tiled=(), scale="prescribed"),
        ALiBiSlopes((0.5, 0.25)): Forms(hooks=("logits",), tiled=(), prepared="bias"),
        RoPEOnLastFeatures(RoPE(), num_features=8): Forms(hooks=("rotate",), cached=("rotation",)),
    }
    for hook, forms in declared.items():
        assert type(hook).__dict__.get("_declared_forms") == forms, type(hook).__name__
        assert forms_of(hook) == forms, type(hook).__name__
