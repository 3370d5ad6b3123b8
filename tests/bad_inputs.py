"""The table of bad inputs the boundary test walks: one case per line.

Each case: ``(what, call, error type, a pattern the message must match)``. The call is a
function of no arguments; the message must name the argument (the pattern says how) and say
what is expected. ``test_boundary.py`` runs them.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from posenc_jax.functional import ALiBi, RoPE, T5Config, XPos, dot_product_attention
from posenc_jax.nn import MultiHeadAttention, Transformer, with_encoding

X = jnp.ones((1, 4, 2, 8))
P = jnp.arange(4)


def attend(q=X, k=X, v=X, **kwargs):
    return lambda: dot_product_attention(q, k, v, query_positions=P, key_positions=P, **kwargs)


def model(**kwargs):
    sizes = dict(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=16, rngs=nnx.Rngs(0))
    return lambda: Transformer(**{**sizes, **kwargs})


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
    ("layer: no heads", lambda: MultiHeadAttention(16, 0, rngs=nnx.Rngs(0)), ValueError, r"num_heads must be an integer >= 1"),
    ("layer: head_dim 0", lambda: MultiHeadAttention(16, 2, head_dim=0, rngs=nnx.Rngs(0)), ValueError, r"head_dim must be an integer >= 1"),
]
# fmt: on
