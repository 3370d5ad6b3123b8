"""Hugging Face configs: each one loads in one call and reproduces transformers' formulas.

The ``hf_*`` functions below transliterate transformers' code into NumPy, as written in
``modeling_rope_utils.py`` (transformers 5: ``_compute_*_parameters``), ``modeling_llama.py``
(``rotate_half``, ``apply_rotary_pos_emb``), ``modeling_t5.py`` (``_relative_position_bucket``,
``compute_bias`` and the unscaled scores) and ``modeling_deberta_v2.py``
(``make_log_bucket_position``, ``build_relative_position``, ``DisentangledSelfAttention``),
with float32 where transformers computes in float32. Neither transformers nor torch is needed.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.functional import AttentionContext, dot_product_attention
from posenc_jax.functional.deberta import DeBERTaConfig
from posenc_jax.functional.learned_absolute import LearnedAbsoluteConfig
from posenc_jax.functional.t5 import T5Config
from posenc_jax.hf import FixedScoreScale, deberta_position_tables, from_hf_config

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
    "hidden_size": 512,
    "num_attention_heads": 8,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
}
DYNAMIC = {
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
    config = {"hidden_size": 5120, "num_attention_heads": 32, "head_dim": 128, "rope_theta": 1e6}
    loaded = from_hf_config(config)
    assert loaded.head_dim == 128
    np.testing.assert_allclose(loaded.encodings[0].frequencies(128)[0], hf_default(1e6, 128), rtol=2e-6)


def test_layer_typed_rope_parameters_need_a_layer_type():
    config = {
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
        ({"hidden_size": 64, "num_attention_heads": 4}, "found no position settings"),
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
