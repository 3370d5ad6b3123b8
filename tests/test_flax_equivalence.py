"""posenc_jax.nn.MultiHeadAttention is flax.nnx.MultiHeadAttention with encodings; its Linen adapter is
flax.linen.MultiHeadDotProductAttention with encodings.

With no encoding (NoPE), a Flax layer's parameters copied into ours give Flax's outputs: self- and
cross-attention, masks, several batch axes, grouped-query heads, QK normalisation, bfloat16, dropout
off, and decoding token by token. With RoPE, ALiBi and T5, decoding token by token (the layer's own
cache, ``decode=True``) gives the full causal forward. The earlier signature's names fail with errors
that name the new ones.
"""

from __future__ import annotations

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posenc_jax.linen import MultiHeadDotProductAttention
from posenc_jax.nn import MultiHeadAttention

HEADS, WIDTH = 4, 16
BIAS = nnx.initializers.normal(0.5)  # nonzero biases, so that copying them is tested too


def _pair(num_heads=HEADS, in_features=WIDTH, decode=False, **kwargs):
    """Flax's layer and ours, built alike (ours from another seed), then Flax's parameters copied into ours."""
    theirs = nnx.MultiHeadAttention(num_heads, in_features, decode=decode, bias_init=BIAS, rngs=nnx.Rngs(0), **kwargs)
    ours = MultiHeadAttention(num_heads, in_features, decode=decode, bias_init=BIAS, rngs=nnx.Rngs(1), **kwargs)
    params = nnx.state(theirs, nnx.Param)
    assert jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param)) == jax.tree.map(jnp.shape, params)
    assert not np.allclose(ours.query.kernel[...], theirs.query.kernel[...])  # the copy below is what makes them equal
    nnx.update(ours, params)
    return theirs, ours


def _normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def test_self_attention_equals_flax():
    theirs, ours = _pair()
    x = _normal(0, (2, 5, WIDTH))
    np.testing.assert_allclose(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    # Causal: our flag masks by position, Flax's is_causal by the lower triangle: the same at arange positions.
    np.testing.assert_allclose(ours(x, causal=True), theirs(x, is_causal=True), atol=1e-5, rtol=1e-5)


def test_cross_attention_with_other_lengths_and_widths_equals_flax():
    theirs, ours = _pair(qkv_features=24, out_features=8, in_kv_features=12)
    q, k, v = _normal(0, (2, 5, WIDTH)), _normal(1, (2, 7, 12)), _normal(2, (2, 7, 12))
    np.testing.assert_allclose(ours(q, k, v), theirs(q, k, v), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ours(q, k), theirs(q, k), atol=1e-5, rtol=1e-5)  # inputs_v defaults to inputs_k
    assert ours(q, k, v).shape == (2, 5, 8)


def test_masks_equal_flax():
    theirs, ours = _pair()
    q, kv = _normal(0, (2, 5, WIDTH)), _normal(1, (2, 7, WIDTH))
    for seed, shape in enumerate([(2, 1, 5, 7), (2, HEADS, 5, 7), (5, 7)]):
        mask = jax.random.bernoulli(jax.random.key(seed), 0.6, shape).at[..., 0].set(True)  # every query sees a key
        np.testing.assert_allclose(ours(q, kv, mask=mask), theirs(q, kv, mask=mask), atol=1e-5, rtol=1e-5)


def test_several_batch_axes_and_none_equal_flax():
    theirs, ours = _pair()
    x = _normal(0, (3, 2, 5, WIDTH))
    mask = jax.random.bernoulli(jax.random.key(1), 0.6, (3, 2, HEADS, 5, 5)).at[..., 0].set(True)
    np.testing.assert_allclose(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ours(x, mask=mask), theirs(x, mask=mask), atol=1e-5, rtol=1e-5)
    assert ours(x[0, 0]).shape == (5, WIDTH)
    np.testing.assert_allclose(ours(x[0, 0]), ours(x[:1, :1])[0, 0], atol=1e-6)


def test_grouped_query_heads_and_qk_normalisation_equal_flax():
    for kwargs in (dict(num_kv_heads=2), dict(normalize_qk=True), dict(use_bias=False)):
        theirs, ours = _pair(**kwargs)
        x = _normal(0, (2, 6, WIDTH))
        np.testing.assert_allclose(ours(x), theirs(x), atol=1e-5, rtol=1e-5, err_msg=str(kwargs))


def test_dtypes_equal_flax():
    x = _normal(0, (2, 5, WIDTH))
    cases = [
        (dict(dtype=jnp.bfloat16), jnp.float32),  # computation in bfloat16, float32 parameters
        (dict(param_dtype=jnp.bfloat16), jnp.bfloat16),  # bfloat16 parameters and inputs: bfloat16 through
        (dict(), jnp.bfloat16),  # float32 parameters promote bfloat16 inputs to float32, as Flax's
        (dict(dtype=jnp.float32, param_dtype=jnp.bfloat16), jnp.bfloat16),
    ]
    for kwargs, input_dtype in cases:
        theirs, ours = _pair(**kwargs)
        # Mixed dtypes promote as in numpy (the suite runs with strict promotion); Flax's attention also mixes
        # bfloat16 with float32 scalars.
        with jax.numpy_dtype_promotion("standard"):
            want, got = theirs(x.astype(input_dtype)), ours(x.astype(input_dtype))
        assert got.dtype == want.dtype, (kwargs, input_dtype, got.dtype, want.dtype)
        assert ours.query.kernel[...].dtype == theirs.query.kernel[...].dtype
        # Our scores and softmax are float32 where Flax's follow the dtype: equal to bfloat16 rounding.
        tolerance = 1e-5 if got.dtype == jnp.float32 and "dtype" not in kwargs else 5e-2
        np.testing.assert_allclose(
            np.asarray(got, np.float32),
            np.asarray(want, np.float32),
            atol=tolerance,
            rtol=tolerance,
            err_msg=str(kwargs),
        )
    _, ours = _pair(param_dtype=jnp.bfloat16)
    assert ours(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "per-weight"])
def test_dropout_off_equals_flax_and_on_changes_the_output(broadcast):
    theirs, ours = _pair(dropout_rate=0.5, broadcast_dropout=broadcast)
    x = _normal(0, (2, 5, WIDTH))
    np.testing.assert_allclose(ours(x, deterministic=True), theirs(x, deterministic=True), atol=1e-5, rtol=1e-5)
    dropped = ours(x, deterministic=False, rngs=nnx.Rngs(dropout=3))
    assert not np.allclose(dropped, ours(x, deterministic=True))
    with pytest.raises(ValueError, match=r"dropout_rate=0.5: pass deterministic=True or False"):
        ours(x)


def test_decoding_token_by_token_equals_flax_decode():
    theirs, ours = _pair(decode=True, num_kv_heads=2)
    x = _normal(0, (2, 6, WIDTH))
    theirs.init_cache(x.shape)
    ours.init_cache(x.shape)
    for i in range(6):
        np.testing.assert_allclose(ours(x[:, i : i + 1]), theirs(x[:, i : i + 1]), atol=1e-5, rtol=1e-5)
    # Several batch axes, as Flax's cache.
    theirs, ours = _pair(decode=True)
    x = _normal(1, (3, 2, 4, WIDTH))
    theirs.init_cache(x.shape)
    ours.init_cache(x.shape)
    for i in range(4):
        np.testing.assert_allclose(ours(x[..., i : i + 1, :]), theirs(x[..., i : i + 1, :]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("encoding", ["rope", "alibi", "t5"])
def test_decoding_with_an_encoding_equals_the_full_causal_forward(encoding):
    layer = MultiHeadAttention(HEADS, WIDTH, encodings=[encoding], rngs=nnx.Rngs(0))
    x = _normal(0, (2, 7, WIDTH))
    full = layer(x, causal=True)
    layer.init_cache(x.shape)
    steps = [layer(x[:, :3], decode=True)]  # a prompt of three tokens, then one token a step
    steps += [layer(x[:, i : i + 1], decode=True) for i in range(3, 7)]
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5, rtol=1e-5)
    # The explicit cache gives the same steps, and a compiled step runs for every position.
    step = nnx.jit(lambda layer, x, cache: layer(x, cache=cache))
    out, cache = layer(x[:, :3], cache=layer.new_cache(2, 7))
    outs = [out]
    for i in range(3, 7):
        out, cache = step(layer, x[:, i : i + 1], cache)
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=2e-5, rtol=1e-5)


def test_positions_default_to_arange_and_may_be_given():
    layer = MultiHeadAttention(HEADS, WIDTH, encodings=["rope"], rngs=nnx.Rngs(0))
    q, kv = _normal(0, (2, 5, WIDTH)), _normal(1, (2, 7, WIDTH))
    np.testing.assert_allclose(layer(q, causal=True), layer(q, query_positions=jnp.arange(5), causal=True))
    np.testing.assert_allclose(layer(q, kv), layer(q, kv, query_positions=jnp.arange(5), key_positions=jnp.arange(7)))
    # RoPE depends on the offset between query and key only: shifting both changes nothing.
    shifted = layer(q, kv, query_positions=jnp.arange(5) + 9, key_positions=jnp.arange(7) + 9)
    np.testing.assert_allclose(shifted, layer(q, kv), atol=2e-5, rtol=1e-5)
    assert not np.allclose(layer(q, kv, query_positions=jnp.arange(5) + 3), layer(q, kv), atol=1e-3)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: MultiHeadAttention(model_dim=16, num_heads=4, rngs=nnx.Rngs(0)),
            TypeError,
            r"no model_dim=.*in_features",
        ),
        (lambda: MultiHeadAttention(4, 16, head_dim=8, rngs=nnx.Rngs(0)), TypeError, r"qkv_features=32 here"),
        (lambda: MultiHeadAttention(16, 4, rngs=nnx.Rngs(0)), ValueError, r"MultiHeadAttention\(4, 16, \.\.\.\)"),
        (lambda: MultiHeadAttention(4, 16, 10, rngs=nnx.Rngs(0)), ValueError, r"qkv_features=10 is not divisible"),
        (
            lambda: MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))(jnp.ones((1, 3, 16)), jnp.arange(3), causal=True),
            TypeError,
            r"the second argument is inputs_k .* pass positions as query_positions=",
        ),
        (
            lambda: MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))(jnp.ones((1, 3, 16)), positions=jnp.arange(3)),
            TypeError,
            r"takes no positions= .*query_positions=",
        ),
        (
            lambda: MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))(jnp.ones((1, 3, 16)), sow_weights=True),
            ValueError,
            r"sow_weights=True: .*return_weights=True",
        ),
        (
            lambda: MultiHeadAttention(4, 16, rngs=nnx.Rngs(0)).init_cache(1, 8),
            TypeError,
            r"new_cache\(batch, max_length",
        ),
        (
            lambda: MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))(jnp.ones((1, 1, 16)), decode=True),
            ValueError,
            r"call init_cache\(\(batch..., max_length, features\)\) first",
        ),
        (
            lambda: MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))(jnp.ones((1, 3, 16)), mask=jnp.ones((3, 3, 3, 3))),
            ValueError,
            r"mask must broadcast to \[batch..., heads, T, S\]",
        ),
    ],
)
def test_the_earlier_signature_and_what_is_not_supported_fail_naming_the_fix(call, error, message):
    with pytest.raises(error, match=message) as caught:
        call()
    assert "\n" not in str(caught.value)


def _linen_pair(**kwargs):
    theirs = linen.MultiHeadDotProductAttention(num_heads=HEADS, bias_init=BIAS, **kwargs)
    ours = MultiHeadDotProductAttention(num_heads=HEADS, bias_init=BIAS, **kwargs)
    return theirs, ours


def test_linen_adapter_has_flaxs_parameters_and_outputs():
    theirs, ours = _linen_pair(qkv_features=24, out_features=8)
    q, kv = _normal(0, (2, 5, WIDTH)), _normal(1, (2, 7, 12))
    variables = theirs.init(jax.random.key(0), q, kv)
    own = ours.init(jax.random.key(1), q, kv)
    assert jax.tree.map(jnp.shape, own["params"]) == jax.tree.map(jnp.shape, variables["params"])
    np.testing.assert_allclose(ours.apply(variables, q, kv), theirs.apply(variables, q, kv), atol=1e-5, rtol=1e-5)
    mask = jax.random.bernoulli(jax.random.key(2), 0.6, (2, 1, 5, 7)).at[..., 0].set(True)
    np.testing.assert_allclose(
        ours.apply(variables, q, kv, mask=mask), theirs.apply(variables, q, kv, mask=mask), atol=1e-5, rtol=1e-5
    )
    theirs, ours = _linen_pair()  # several batch axes
    x = _normal(3, (3, 2, 5, WIDTH))
    variables = theirs.init(jax.random.key(0), x)
    np.testing.assert_allclose(ours.apply(variables, x), theirs.apply(variables, x), atol=1e-5, rtol=1e-5)


def test_linen_adapter_takes_encodings_and_refuses_decode():
    layer = MultiHeadDotProductAttention(num_heads=HEADS, encodings=["rope"])
    x = _normal(0, (2, 5, WIDTH))
    variables = layer.init(jax.random.key(0), x)
    nnx_layer = MultiHeadAttention(HEADS, WIDTH, encodings=["rope"], rngs=nnx.Rngs(1))
    nnx.update(nnx_layer, variables["params"])
    np.testing.assert_allclose(layer.apply(variables, x, causal=True), nnx_layer(x, causal=True), atol=1e-6)
    with pytest.raises(ValueError, match=r"decode=True: this Linen layer does not decode; .*make_attention_fn"):
        MultiHeadDotProductAttention(num_heads=HEADS, decode=True).init(jax.random.key(0), x)
