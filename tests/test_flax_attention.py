"""Flax's own attention layers with this library's encodings: decoding through Flax's cache
gives the full forward's outputs, in NNX and in Linen."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posenc_jax.functional import T5Bias
from posenc_jax.nn import AttentionFunction, make_attention_fn
from posenc_jax.nn.flax_attention import call_positions

B, T, D, N = 2, 9, 16, 2
X = jax.random.normal(jax.random.key(0), (B, T, D))
TABLE = jax.random.normal(jax.random.key(1), (32, N))

FIXED = {"rope": ["rope"], "alibi": ["alibi"], "t5": [T5Bias(TABLE)], "rope+alibi": ["rope", "alibi"]}


def _nnx_layer(attention_fn):
    return nnx.MultiHeadAttention(
        num_heads=N, in_features=D, qkv_features=D, decode=False, attention_fn=attention_fn, rngs=nnx.Rngs(2)
    )


def _nnx_full_then_steps(layer):
    full = layer(X)
    layer.init_cache(X.shape)
    steps = [layer(X[:, i : i + 1], decode=True) for i in range(T)]
    return full, jnp.concatenate(steps, axis=1)


@pytest.mark.parametrize("encodings", FIXED.values(), ids=FIXED.keys())
def test_nnx_multi_head_attention_decodes_like_its_full_forward(encodings):
    full, steps = _nnx_full_then_steps(_nnx_layer(make_attention_fn(encodings, causal=True)))
    np.testing.assert_allclose(steps, full, atol=2e-5)


@pytest.mark.parametrize("encodings", [["t5"], ["rope", "t5"], ["kerple-log"]])
def test_nnx_attention_function_holds_learned_parameters_and_decodes(encodings):
    fn = AttentionFunction(encodings, num_heads=N, head_dim=D // N, causal=True, rngs=nnx.Rngs(3))
    layer = _nnx_layer(fn)
    params = nnx.state(layer, nnx.Param)
    assert any("attention_fn" in str(path) for path, _ in jax.tree_util.tree_leaves_with_path(params))
    full, steps = _nnx_full_then_steps(layer)
    np.testing.assert_allclose(steps, full, atol=2e-5)


def test_nnx_encoding_parameters_get_gradients():
    layer = _nnx_layer(AttentionFunction(["t5"], num_heads=N, head_dim=D // N, causal=True, rngs=nnx.Rngs(3)))
    grads = nnx.grad(lambda m: m(X).sum())(layer)
    assert float(jnp.abs(grads.attention_fn.encodings[0].table[...]).sum()) > 0


@pytest.mark.parametrize("encodings", FIXED.values(), ids=FIXED.keys())
def test_linen_multi_head_attention_decodes_like_its_full_forward(encodings):
    fn = make_attention_fn(encodings, causal=True)
    full_layer = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=D, attention_fn=fn)
    params = full_layer.init(jax.random.key(4), X)["params"]
    full = full_layer.apply({"params": params}, X)
    decoder = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=D, attention_fn=fn, decode=True)
    cache = decoder.init(jax.random.key(4), X)["cache"]
    steps = []
    for i in range(T):
        out, variables = decoder.apply({"params": params, "cache": cache}, X[:, i : i + 1], mutable=["cache"])
        cache = variables["cache"]
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5)


def test_the_encoding_changes_the_output():  # the checks above would pass vacuously otherwise
    plain, _ = _nnx_full_then_steps(_nnx_layer(make_attention_fn([], causal=True)))
    rope, _ = _nnx_full_then_steps(_nnx_layer(make_attention_fn(["rope"], causal=True)))
    assert not np.allclose(plain, rope, atol=1e-3)


def test_positions_are_taken_per_call():
    q = jnp.zeros((2, 1, 2, 4))
    k = jnp.zeros((2, 6, 2, 4))
    mask = (jnp.arange(6)[None, :] <= jnp.array([[3], [5]]))[:, None, None, :]  # two rows at cache index 3 and 5
    q_pos, k_pos = call_positions(q, k, mask)
    assert q_pos.tolist() == [[3], [5]] and k_pos.tolist() == list(range(6))
    same, same_keys = call_positions(k, k, None)
    assert same is same_keys and same.tolist() == list(range(6))
    with pytest.raises(ValueError, match="1 queries against 6 keys without a mask"):
        call_positions(q, k, None)
    with pytest.raises(ValueError, match="pass both query_positions and key_positions"):
        call_positions(q, k, mask, query_positions=jnp.arange(1))


def test_learned_encodings_by_name_are_refused_with_the_ways_out():
    with pytest.raises(ValueError, match="has parameters; .*AttentionFunction.*T5Bias\\(table\\)"):
        make_attention_fn(["t5"])
