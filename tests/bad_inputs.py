"""The table of bad inputs the boundary test walks: one case per line.

Each case: ``(what, call, error type, a pattern the message must match)``. The call is a
function of no arguments; the message must name the argument (the pattern says how) and say
what is expected. ``test_boundary.py`` runs them.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posenc_jax.bench.cli import main as bench
from posenc_jax.functional import (
    ALiBi,
    AxialRoPE,
    ClippedBiasConfig,
    DeBERTaConfig,
    FireConfig,
    KerpleConfig,
    LearnedAbsoluteConfig,
    LongRoPEScaling,
    RoPE,
    ShawConfig,
    Sinusoidal,
    SinusoidalRelative,
    T5Config,
    TransformerXLConfig,
    XPos,
    YaRNScaling,
    alibi_bias,
    dot_product_attention,
    fire_init,
    randomized_positions,
)
from posenc_jax.functional.core.cache import KVCache
from posenc_jax.generation import generate, next_token
from posenc_jax.linen import to_linen
from posenc_jax.nn import MultiHeadAttention, Transformer, with_encoding

X = jnp.ones((1, 4, 2, 8))
P = jnp.arange(4)


def attend(q=X, k=X, v=X, **kwargs):
    return lambda: dot_product_attention(q, k, v, query_positions=P, key_positions=P, **kwargs)


def model(**kwargs):
    sizes = dict(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=16, rngs=nnx.Rngs(0))
    return lambda: Transformer(**{**sizes, **kwargs})


KEY = jax.random.key(0)


def init(config, **sizes):
    return lambda: config.init(KEY, **{**dict(num_heads=2, head_dim=8, model_dim=16), **sizes})


def longrope(**kwargs):
    settings = dict(short_factor=(1.0, 1.0), long_factor=(2.0, 2.0), original_context=8, max_context=32)
    return lambda: LongRoPEScaling(**{**settings, **kwargs})


def decoding(tokens=((0, 1, 2),), positions=((0, 1, 2),), *, caches=None, layers=1, **sizes):
    """A decode call of a causal model (``caches``: a function of the model giving them)."""

    def call():
        decoder = model(num_layers=layers, causal=True)()
        made = decoder.init_cache(1, 8) if caches is None else caches(decoder)
        return decoder.decode(jnp.asarray(tokens), jnp.asarray(positions), made)

    return call


def forward(tokens, positions=P, **kwargs):
    return lambda: model(causal=True, **kwargs)()(jnp.asarray(tokens), positions)


def cache_append(key=None, positions=None):
    cache = KVCache.empty(batch=1, max_length=8, num_kv_heads=2, head_dim=8)
    key = jnp.ones((1, 2, 2, 8)) if key is None else key
    return lambda: cache.append(key, key, jnp.arange(2)[None] if positions is None else positions)


def cache_append_twice(first, then):
    """Two appends to one cache: two tokens at positions ``first``, then one at ``then``."""

    def call():
        cache = KVCache.empty(batch=1, max_length=8, num_kv_heads=2, head_dim=8)
        cache = cache.append(jnp.ones((1, 2, 2, 8)), jnp.ones((1, 2, 2, 8)), jnp.asarray([first]))
        return cache.append(jnp.ones((1, 1, 2, 8)), jnp.ones((1, 1, 2, 8)), jnp.asarray([[then]]))

    return call


def extrapolate(*flags):
    return lambda: bench(
        ["extrapolate", "--preset", "smoke", "--no-progress", "--no-plots", "--out", "/nonexistent/x", *flags]
    )


# fmt: off
CASES = [
    # dtypes and types of the arrays
    ("integer query", attend(q=jnp.ones((1, 4, 2, 8), jnp.int32)), TypeError, r"query must be a floating array.*int32"),
    ("bool key", attend(k=jnp.ones((1, 4, 2, 8), bool)), TypeError, r"key must be a floating array.*bool"),
    ("uint8 value", attend(v=jnp.ones((1, 4, 2, 8), jnp.uint8)), TypeError, r"value must be a floating array.*uint8"),
    ("complex query", attend(q=jnp.ones((1, 4, 2, 8), jnp.complex64)), TypeError, r"query must be a floating array"),
    ("a list as query", attend(q=np.ones((1, 4, 2, 8)).tolist()), TypeError, r"query must be an array.*list"),
    ("no query", lambda: dot_product_attention(X[:, :0], X, X), ValueError, r"at least one query, got T=0"),
    # Python types of the settings
    ("causal as a string", attend(causal="yes"), TypeError, r"causal must be True or False, got 'yes'"),
    ("scale as a string", attend(scale="0.1"), TypeError, r"scale must be a number, got '0.1'"),
    ("scale as a bool", attend(scale=True), TypeError, r"scale must be a number, got True"),
    ("return_weights as 1", attend(return_weights=1), TypeError, r"return_weights must be True or False"),
    ("dropout_rate 1.5", attend(dropout_rate=1.5, dropout_rng=None), ValueError, r"dropout_rate must be in \[0, 1\)"),
    ("dropout_rate None", attend(dropout_rate=None), TypeError, r"dropout_rate must be a number, got None"),
    ("normalizer by a wrong name", attend(normalizer="softmx"), ValueError, r"unknown normalizer 'softmx'"),
    ("URPE by name, unbuilt", attend(normalizer="urpe"), ValueError, r"normalizer='urpe' has learned parameters"),
    ("normalizer not callable", attend(normalizer=3), TypeError, r"normalizer must be a normalize hook"),
    # forms that cannot mean what was asked
    ("two rotations", attend(encodings=[RoPE(), XPos()], causal=True), ValueError, r"rotate queries and keys 2 times"),
    ("RoPE twice", attend(encodings=["rope", "rope"]), ValueError, r"rotate queries and keys 2 times"),
    ("ALiBi twice", attend(encodings=[ALiBi(), ALiBi()]), ValueError, r"ALiBi is given more than once"),
    ("xPos bidirectional", attend(encodings=[XPos()], causal=False), ValueError, r"XPos is defined for causal attention only"),
    ("a scaled RoPE by name, no settings", attend(encodings=["rope-yarn"]), ValueError, r"encoding 'rope-yarn' needs the settings \['factor', 'original_context'\], which have no default: make its config with encoding_config\('rope-yarn', factor=..., original_context=...\) and pass that"),
    ("layer: a scaled RoPE by name, no settings", lambda: MultiHeadAttention(2, 16, encodings="rope-yarn", rngs=nnx.Rngs(0)), ValueError, r"encoding 'rope-yarn' needs the settings \['factor', 'original_context'\]"),
    ("a config that needs parameters", attend(encodings=[T5Config()]), ValueError, r"T5Config.*has learned parameters"),
    ("FIRE by name, unbuilt", attend(encodings="fire", causal=True), ValueError, r"FireConfig.*has learned parameters"),
    ("model: xPos bidirectional", model(encoding="xpos", causal=False), ValueError, r"XPos is defined for causal attention only"),
    ("model: FIRE bidirectional", model(encoding="fire", causal=False), ValueError, r"FireConfig is defined for causal attention only"),
    ("model: two rotations", model(encoding=["rope", "xpos"], causal=True), ValueError, r"rotate queries and keys 2 times"),
    ("model: ALiBi twice", model(encoding=["alibi", "alibi"], causal=True), ValueError, r"ALiBi is given more than once"),
    ("model: two absolute", model(encoding=["sinusoidal", "learned"], causal=True), ValueError, r"absolute encodings"),
    ("model: causal 'yes'", model(encoding="rope", causal="yes"), TypeError, r"causal must be True or False"),
    ("swap to causal-only", lambda: with_encoding(model(encoding="rope", causal=False)(), "xpos"), ValueError, r"XPos is defined for causal attention only"),
    # degenerate sizes
    ("model: no layers", model(num_layers=0, causal=True), ValueError, r"num_layers must be an integer >= 1, got 0"),
    ("model: no vocabulary", model(vocab_size=0, causal=True), ValueError, r"vocab_size must be an integer >= 1, got 0"),
    ("model: no width", model(model_dim=0, causal=True), ValueError, r"model_dim must be an integer >= 1, got 0"),
    ("model: no heads", model(num_heads=0, causal=True), ValueError, r"num_heads must be an integer >= 1, got 0"),
    ("layer: no heads", lambda: MultiHeadAttention(0, 16, rngs=nnx.Rngs(0)), ValueError, r"num_heads must be an integer >= 1"),
    ("layer: the earlier argument order", lambda: MultiHeadAttention(64, 4, rngs=nnx.Rngs(0)), ValueError, r"qkv_features=4 is not divisible by num_heads=64; .*the order is \(num_heads, in_features\), as flax.nnx.MultiHeadAttention's: for 4 heads over 64 features call MultiHeadAttention\(4, 64, ...\)"),
    ("layer: model_dim=", lambda: MultiHeadAttention(model_dim=64, num_heads=4, rngs=nnx.Rngs(0)), TypeError, r"MultiHeadAttention takes no model_dim= .*in_features, second: MultiHeadAttention\(num_heads, in_features, ...\)"),
    ("layer: head_dim=", lambda: MultiHeadAttention(4, 64, head_dim=8, rngs=nnx.Rngs(0)), TypeError, r"MultiHeadAttention takes no head_dim= .*pass qkv_features=num_heads\*head_dim .*: qkv_features=32 here"),
    ("layer: positions as the second argument", lambda: MultiHeadAttention(2, 16, rngs=nnx.Rngs(0))(jnp.ones((1, 4, 16)), jnp.arange(4), causal=True), TypeError, r"the second argument is inputs_k .*got an array of int32: pass positions as query_positions= / key_positions=, or nothing for arange"),
    ("layer: init_cache(batch, max_length)", lambda: MultiHeadAttention(2, 16, rngs=nnx.Rngs(0)).init_cache(1, 8), TypeError, r"init_cache takes the input shape \(batch..., max_length, features\), as flax's, got 1; an explicit KVCache for cache= is new_cache\(batch, max_length, dtype\)"),
    ("Linen layer: the earlier argument order", lambda: to_linen(MultiHeadAttention, 64, 4).init(KEY, jnp.ones((1, 4, 4)), causal=True), ValueError, r"qkv_features=4 is not divisible by num_heads=64; .*call MultiHeadAttention\(4, 64, ...\)"),
    ("layer: qkv_features 0", lambda: MultiHeadAttention(2, 16, 0, rngs=nnx.Rngs(0)), ValueError, r"qkv_features must be an integer >= 1"),
    # settings: finite and in range, refused when the config (or a functional form's concrete value) is made
    ("ALiBi slopes NaN", lambda: alibi_bias(2, P, P, slopes=np.array([math.nan, 0.5])), ValueError, r"slopes must be finite numbers >= 0.*nan"),
    ("ALiBi slopes negative", lambda: alibi_bias(2, P, P, slopes=np.array([-0.5, 0.5])), ValueError, r"slopes must be finite numbers >= 0.*-0.5"),
    ("xPos scale_base inf", lambda: XPos(scale_base=math.inf), ValueError, r"scale_base must be a finite number > 0, got inf"),
    ("xPos gamma inf", lambda: XPos(gamma=math.inf), ValueError, r"gamma must be a finite number > 0, got inf"),
    ("xPos base NaN", lambda: XPos(base=math.nan), ValueError, r"base must be a finite number > 1.*got nan"),
    ("xPos gamma a string", lambda: XPos(gamma="0.4"), TypeError, r"gamma must be a number, got '0.4'"),
    ("fire_init c inf", lambda: fire_init(KEY, 2, c=math.inf), ValueError, r"c must be a finite number > 0, got inf"),
    ("fire_init threshold inf", lambda: fire_init(KEY, 2, threshold=math.inf), ValueError, r"threshold must be a finite number > 0, got inf"),
    ("FIRE hidden 0", lambda: FireConfig(hidden=0), ValueError, r"hidden must be an integer >= 1, got 0"),
    ("FIRE c NaN", lambda: FireConfig(c=math.nan), ValueError, r"c must be a finite number > 0, got nan"),
    ("sinusoidal base inf", lambda: Sinusoidal(base=math.inf), ValueError, r"base must be a finite number > 1.*got inf"),
    ("functional relative base NaN", lambda: SinusoidalRelative(base=math.nan), ValueError, r"base must be a finite number > 1.*got nan"),
    ("Transformer-XL base NaN", lambda: TransformerXLConfig(base=math.nan), ValueError, r"base must be a finite number > 1.*got nan"),
    ("functional relative scale 0", lambda: SinusoidalRelative(scale=0.0), ValueError, r"scale must be a finite number > 0, got 0.0"),
    ("axial RoPE base 1", lambda: AxialRoPE(grid_width=4, base=1.0), ValueError, r"base must be a finite number > 1.*got 1.0"),
    ("clipped bias init_std NaN", lambda: ClippedBiasConfig(init_std=math.nan), ValueError, r"init_std must be a finite number >= 0, got nan"),
    ("T5 init_std negative", lambda: T5Config(init_std=-0.02), ValueError, r"init_std must be a finite number >= 0, got -0.02"),
    ("learned init_std inf", lambda: LearnedAbsoluteConfig(init_std=math.inf), ValueError, r"init_std must be a finite number >= 0"),
    ("Shaw init_std a string", lambda: ShawConfig(init_std="0.02"), TypeError, r"init_std must be a number, got '0.02'"),
    ("DeBERTa init_std NaN", lambda: DeBERTaConfig(init_std=math.nan), ValueError, r"init_std must be a finite number >= 0"),
    ("Kerple eps 1", lambda: KerpleConfig(eps=1.0), ValueError, r"eps must be a finite number > 0 and < 1, got 1.0"),
    ("LongRoPE factors as strings", longrope(short_factor=("1", "1")), TypeError, r"short_factor\[0\] must be a number, got '1'"),
    ("LongRoPE factors one string", longrope(long_factor="22"), TypeError, r"long_factor must be a tuple of numbers, got '22'"),
    ("LongRoPE factor inf", longrope(factor=math.inf), ValueError, r"LongRoPE factor must be a finite number > 0"),
    ("YaRN beta_fast inf", lambda: YaRNScaling(factor=2.0, original_context=8, beta_fast=math.inf), ValueError, r"beta_fast must be a finite number > 0, got inf"),
    # sizes an encoding's init is given, and its key
    ("init: no heads", init(T5Config(), num_heads=0), ValueError, r"num_heads must be an integer >= 1, got 0"),
    ("init: head_dim 0", init(ShawConfig(), head_dim=0), ValueError, r"head_dim must be an integer >= 1, got 0"),
    ("init: model_dim 0", init(LearnedAbsoluteConfig(), model_dim=0), ValueError, r"model_dim must be an integer >= 1, got 0"),
    ("init: key 0", lambda: T5Config().init(0, num_heads=2, head_dim=8, model_dim=16), TypeError, r"key must be a jax.random key, got 0"),
    ("fire_init: key 0", lambda: fire_init(0, 2), TypeError, r"key must be a jax.random key, got 0"),
    ("randomized positions: key 0", lambda: randomized_positions(0, 4, 16), TypeError, r"key must be a jax.random key, got 0"),
    ("attention: dropout_rng 0", attend(dropout_rate=0.1, dropout_rng=0), TypeError, r"dropout_rng must be a jax.random key, got 0"),
    ("generate: rng 0", lambda: generate(model()(), jnp.zeros((1, 2), jnp.int32), max_new_tokens=1, temperature=1.0, rng=0), TypeError, r"rng must be a jax.random key, got 0"),
    ("next_token: key 0", lambda: next_token(jnp.zeros((1, 4)), temperature=1.0, key=0), TypeError, r"key must be a jax.random key, got 0"),
    ("model: rngs 0", model(rngs=0), TypeError, r"rngs must be flax.nnx.Rngs, got 0; .*nnx.Rngs\(0\)"),
    ("layer: rngs 0", lambda: MultiHeadAttention(2, 16, rngs=0), TypeError, r"rngs must be flax.nnx.Rngs, got 0"),
    ("model: dropout_rate 1.5", model(dropout_rate=1.5), ValueError, r"dropout_rate must be a finite number >= 0 and < 1, got 1.5"),
    ("layer: dropout_rate 1.5", lambda: MultiHeadAttention(2, 16, dropout_rate=1.5, rngs=nnx.Rngs(0)), ValueError, r"dropout_rate must be .* < 1, got 1.5"),
    ("model: a float size", model(mlp_dim=16.0), TypeError, r"mlp_dim must be an integer >= 1, got 16.0"),
    # caches: sizes, and caches that do not fit the call
    ("init_cache batch 0", lambda: model(causal=True)().init_cache(0, 8), ValueError, r"batch must be an integer >= 1, got 0"),
    ("init_cache max_length 0", lambda: model(causal=True)().init_cache(1, 0), ValueError, r"max_length must be an integer >= 1, got 0"),
    ("init_cache max_length -1", lambda: model(causal=True)().init_cache(1, -1), ValueError, r"max_length must be an integer >= 1, got -1"),
    ("init_cache max_length 4.5", lambda: model(causal=True)().init_cache(1, 4.5), TypeError, r"max_length must be an integer >= 1, got 4.5"),
    ("KVCache.empty head_dim 0", lambda: KVCache.empty(1, 8, 2, 0), ValueError, r"head_dim must be an integer >= 1, got 0"),
    ("caches of another batch", decoding(caches=lambda m: m.init_cache(2, 8)), ValueError, r"caches\[0\] holds batch 2 .* this call has batch 1"),
    ("caches of another head count", decoding(caches=lambda m: model(num_heads=4, causal=True)().init_cache(1, 8)), ValueError, r"caches\[0\] holds .* 4 key/value heads of 4, .* layer 0 has 2 heads of 8"),
    ("one cache for two layers", decoding(layers=2, caches=lambda m: m.init_cache(1, 8)[:1]), ValueError, r"caches has 1 entries but the model has 2 layers"),
    ("a cache, not a list", decoding(caches=lambda m: m.init_cache(1, 8)[0]), TypeError, r"caches must be the list of KVCache"),
    ("prompt longer than the cache", decoding(caches=lambda m: m.init_cache(1, 2)), ValueError, r"3 tokens are given at once but the caches hold 2"),
    ("init_cache dtype int32", lambda: model(causal=True)().init_cache(1, 8, dtype=jnp.int32), ValueError, r"dtype must be a floating dtype for the cached keys and values, got int32"),
    ("new_cache dtype bool", lambda: MultiHeadAttention(2, 16, rngs=nnx.Rngs(0)).new_cache(1, 8, dtype=bool), ValueError, r"dtype must be a floating dtype .*, got bool"),
    ("caches of a NoPE model to a RoPE model", decoding(caches=lambda m: model(encoding="nope", causal=True)().init_cache(1, 8)), ValueError, r"caches\[0\] was made for another model: encodings \[NoPE\(\)\] there, \[RoPE\(.*\)\] here"),
    ("decode at float positions", decoding(positions=((0.0, 1.0, 2.0),)), ValueError, r"positions must have an integer dtype, got float32"),
    ("decode 1-D tokens", decoding(tokens=(0, 1, 2)), ValueError, r"tokens must be integer ids \[B, T\], got shape \(3,\)"),
    ("KVCache.append another head dim", cache_append(key=jnp.ones((1, 2, 2, 4))), ValueError, r"key must be \[B, T, K, H\] = \[1, T, 2, 8\] .*got shape \(1, 2, 2, 4\)"),
    ("KVCache.append float positions", cache_append(positions=jnp.arange(2.0)[None]), ValueError, r"positions must have an integer dtype, got float32"),
    ("KVCache.append more than it holds", cache_append(key=jnp.ones((1, 9, 2, 8))), ValueError, r"the KV cache holds 8 tokens and 9 are given at once"),
    ("KVCache.append a position already held", cache_append_twice((0, 1), 1), ValueError, r"decoding positions must come after the cached ones: row 0 .* up to 1, and a new token is at 1"),
    ("KVCache.append a position going backwards", cache_append_twice((4, 5), 2), ValueError, r"row 0 of the cache holds positions up to 5, and a new token is at 2"),
    # what a model or a layer is called with
    ("model: 1-D tokens", forward(jnp.zeros(4, jnp.int32)), ValueError, r"tokens must be integer ids \[B, T\], got shape \(4,\); add a batch axis"),
    ("model: float tokens", forward(jnp.zeros((1, 4))), TypeError, r"tokens must be integer ids \[B, T\], got dtype float32"),
    ("model: positions of another length", forward(jnp.zeros((1, 4), jnp.int32), jnp.arange(3)), ValueError, r"positions must be \[T\] or \[B, T\] for tokens \(1, 4\)"),
    ("layer: input of the wrong width", lambda: MultiHeadAttention(2, 16, rngs=nnx.Rngs(0))(jnp.ones((1, 4, 8)), causal=True), ValueError, r"inputs_q must have shape \[batch..., length, features\] with features = in_features = 16, got shape \(1, 4, 8\)"),
    ("RoPE.rotate with a list of positions", lambda: RoPE().rotate(X, X, [0, 1, 2, 3]), TypeError, r"RoPE.rotate\(q, k, context\): context must be an AttentionContext, a positions array \[T\] or \[B, T\] .* or a pair \(query_positions, key_positions\) of arrays; got a list of 4 \(int, int, int, int\)"),
    ("xPos.rotate with no positions", lambda: XPos().rotate(X, X, None), TypeError, r"XPos.rotate\(q, k, context\): context must be an AttentionContext.*; got NoneType None"),
    ("axial RoPE.rotate with three arrays", lambda: AxialRoPE(grid_width=2).rotate(X, X, (P, P, P)), TypeError, r"AxialRoPE.rotate\(q, k, context\): .*got a tuple of 3 \(array of shape \(4,\), array of shape \(4,\), array of shape \(4,\)\)"),
    ("RoPE.rotate at float positions", lambda: RoPE().rotate(X, X, jnp.arange(4.0)), ValueError, r"positions must have an integer dtype, got float32"),
    ("learned table too short", forward(jnp.zeros((1, 6), jnp.int32), jnp.arange(6), encoding=LearnedAbsoluteConfig(max_positions=4)), ValueError, r"position 5 is outside the learned table of 4 positions"),
    # facts of the data: checked at once for concrete arrays (under jit: tests/test_boundary.py)
    ("token id == vocab_size", forward([[8, 1, 2, 3]]), ValueError, r"token id 8 is outside the vocabulary \[0, 8\)"),
    ("negative token id", forward([[0, -1, 2, 3]]), ValueError, r"token id -1 is outside the vocabulary \[0, 8\)"),
    ("decode past the cache", decoding(caches=lambda m: m.decode(jnp.zeros((1, 7), jnp.int32), jnp.arange(7)[None], m.init_cache(1, 8))[1]), ValueError, r"the KV cache holds 8 tokens; 7 are filled and 3 more \(at positions 0 to 2\) do not fit: .*max_length >= 10"),
    # the benchmark's command line: one line, no traceback
    ("posenc-bench --heads 0", extrapolate("--heads", "0"), SystemExit, r"num_heads must be >= 1, got 0 \(--heads\)"),
    ("posenc-bench --model-dim 0", extrapolate("--model-dim", "0"), SystemExit, r"model_dim must be >= 1, got 0 \(--model-dim\)"),
    ("posenc-bench --layers 0", extrapolate("--layers", "0"), SystemExit, r"num_layers must be >= 1, got 0 \(--layers\)"),
    ("posenc-bench --steps 0", extrapolate("--steps", "0"), SystemExit, r"steps must be >= 1, got 0"),
]
# fmt: on
