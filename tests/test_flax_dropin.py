"""make_attention_fn as a drop-in for Flax's dot_product_attention (issue 55): every argument Flax
passes keeps Flax's meaning, held to Flax's own functions (NNX and Linen) with NoPE; what it cannot
honour is an error; and it runs this library's attention, never Flax's."""

import flax.linen as nn
import flax.linen.attention as linen_attention
import flax.nnx.nn.attention as nnx_attention
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import posenc_jax.nn.flax_attention as flax_attention
from posenc_jax.nn import AttentionFunction, make_attention_fn

OURS = make_attention_fn()  # NoPE: Flax's attention, computed by this library
ROPE = make_attention_fn("rope")


def _qkv(q_shape, kv_shape, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = (q_shape, kv_shape, kv_shape)
    return tuple(jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes, strict=True))


SHAPES = {
    "one batch dim": ((2, 5, 4, 8), (2, 5, 4, 8)),
    "two batch dims": ((2, 3, 5, 4, 8), (2, 3, 5, 4, 8)),
    "no batch dim": ((5, 4, 8), (5, 4, 8)),
    "more keys than queries": ((2, 3, 4, 8), (2, 7, 4, 8)),
    "fewer keys than queries": ((2, 7, 4, 8), (2, 3, 4, 8)),
}


def _mask(q, k, seed=1, empty_row=False):
    """A random [batch..., 1, T, S] mask (every row with a key unless ``empty_row``: row 1 has none)."""
    batch, t, s = q.shape[:-3], q.shape[-3], k.shape[-3]
    mask = jax.random.bernoulli(jax.random.key(seed), 0.6, (*batch, 1, t, s))
    mask = mask.at[..., 0].set(True)
    return mask.at[..., 1, :].set(False) if empty_row else mask


def _bias(q, k, seed=2):
    batch, t, n, s = q.shape[:-3], q.shape[-3], q.shape[-2], k.shape[-3]
    return jax.random.normal(jax.random.key(seed), (*batch, n, t, s))


def _flax(q, k, v, **kwargs):
    """Flax's NNX function, by its weights path (a module given): the one that applies every argument."""

    class Holder(nnx.Module):
        pass

    with jax.numpy_dtype_promotion("standard"):  # Flax's code mixes float and bool masks
        out, _ = nnx.capture(
            lambda m: nnx_attention.dot_product_attention(q, k, v, module=m, **kwargs), nnx.Intermediate
        )(Holder())
    return out


def _linen(q, k, v, **kwargs):
    with jax.numpy_dtype_promotion("standard"):
        return linen_attention.dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("extra", ["plain", "mask", "float mask", "bias", "is_causal", "mask+bias+is_causal"])
def test_nope_gives_flax_answers(shapes, extra):
    q, k, v = _qkv(*shapes)
    kwargs = {
        "plain": {},
        "mask": {"mask": _mask(q, k)},
        "float mask": {"mask": _mask(q, k).astype(jnp.float32)},
        "bias": {"bias": _bias(q, k)},
        "is_causal": {"is_causal": True},
        "mask+bias+is_causal": {"mask": _mask(q, k), "bias": _bias(q, k), "is_causal": True},
    }[extra]
    expected = _flax(q, k, v, **kwargs)
    np.testing.assert_allclose(OURS(q, k, v, **kwargs), expected, atol=2e-6)
    if "is_causal" not in kwargs:  # Linen's function has no is_causal
        np.testing.assert_allclose(OURS(q, k, v, **kwargs), _linen(q, k, v, **kwargs), atol=2e-6)


def test_is_causal_in_cross_attention_lines_up_as_flax_does():
    q, k, v = _qkv((1, 3, 2, 8), (1, 6, 2, 8))
    out = OURS(q, k, v, is_causal=True)
    # Query i sees keys 0 .. i: its output is the attention over those keys alone.
    for i in range(3):
        np.testing.assert_allclose(out[:, i : i + 1], OURS(q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1]), atol=2e-6)
    np.testing.assert_allclose(out, _flax(q, k, v, is_causal=True), atol=2e-6)


def test_a_query_with_every_key_masked_gets_the_mean_of_the_values_as_in_flax():
    q, k, v = _qkv((2, 4, 2, 8), (2, 6, 2, 8))
    mask = _mask(q, k, empty_row=True)
    out = OURS(q, k, v, mask=mask)
    np.testing.assert_allclose(out[:, 1], v.mean(axis=1), atol=2e-6)
    np.testing.assert_allclose(out, _flax(q, k, v, mask=mask), atol=2e-6)
    # With an encoding whose causal form masks by position too (the same rule holds).
    t5_like = make_attention_fn("alibi", causal=True)
    q, k, v = _qkv((2, 4, 2, 8), (2, 4, 2, 8))
    out = t5_like(q, k, v, mask=_mask(q, k, empty_row=True))
    np.testing.assert_allclose(out[:, 1], v.mean(axis=1), atol=2e-6)


def test_grouped_query_attention_gives_flax_answers():
    q, k, v = _qkv((2, 5, 4, 8), (2, 5, 2, 8))
    np.testing.assert_allclose(OURS(q, k, v), _flax(q, k, v), atol=2e-6)
    np.testing.assert_allclose(OURS(q, k, v, is_causal=True), _flax(q, k, v, is_causal=True), atol=2e-6)


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("shapes", [SHAPES["one batch dim"], SHAPES["two batch dims"]], ids=["one", "two"])
def test_dropout_draws_flax_mask(broadcast, shapes):
    q, k, v = _qkv(*shapes)
    kwargs = dict(dropout_rate=0.4, dropout_rng=jax.random.key(7), broadcast_dropout=broadcast, deterministic=False)
    np.testing.assert_allclose(OURS(q, k, v, **kwargs), _flax(q, k, v, **kwargs), atol=2e-6)
    np.testing.assert_allclose(OURS(q, k, v, **kwargs), _linen(q, k, v, **kwargs), atol=2e-6)
    # deterministic=True: no dropout whatever the rate and key.
    np.testing.assert_array_equal(OURS(q, k, v, **{**kwargs, "deterministic": True}), OURS(q, k, v))


def test_broadcast_dropout_is_one_mask_for_every_row_and_head():
    # Equal scores weigh every key 1/S, and one-hot values read each weight back out.
    b, t, n, s = 3, 4, 2, 8
    q, k = jnp.zeros((b, t, n, s)), jnp.zeros((b, s, n, s))
    v = jnp.broadcast_to(jnp.eye(s)[None, :, None, :], (b, s, n, s))
    kwargs = dict(dropout_rate=0.5, dropout_rng=jax.random.key(3), deterministic=False)
    one = OURS(q, k, v, broadcast_dropout=True, **kwargs)  # [B, T, N, S]: the dropped weights
    assert bool(jnp.all(one == one[:1, :, :1])), "one mask broadcast over the batch and the heads"
    assert 0 < int(jnp.sum(one == 0)) < one.size
    each = OURS(q, k, v, broadcast_dropout=False, **kwargs)
    assert not bool(jnp.all(each == each[:1, :, :1])), "a mask per batch row and head"


def test_nnx_sows_flax_weights():
    class Holder(nnx.Module):
        pass

    q, k, v = _qkv((2, 3, 5, 4, 8), (2, 3, 5, 4, 8))
    mask = _mask(q, k)
    _, ours = nnx.capture(lambda m: OURS(q, k, v, mask=mask, module=m), nnx.Intermediate)(Holder())
    _, theirs = nnx.capture(
        lambda m: nnx_attention.dot_product_attention(q, k, v, mask=mask, module=m), nnx.Intermediate
    )(Holder())
    (weights,) = ours["attention_weights"]
    assert weights.shape == (2, 3, 4, 5, 5)
    np.testing.assert_allclose(weights, theirs["attention_weights"][0], atol=2e-7)
    _, none = nnx.capture(lambda m: OURS(q, k, v, mask=mask), nnx.Intermediate)(Holder())
    assert not none  # no module: nothing sown


@pytest.mark.parametrize("force_fp32", [False, True])
def test_linen_sows_flax_weights_in_flax_dtype(force_fp32):
    class Layer(nn.Module):
        attention_fn: object

        @nn.compact
        def __call__(self, q, k, v):
            return self.attention_fn(q, k, v, module=self, dtype=jnp.bfloat16, force_fp32_for_softmax=force_fp32)

    q, k, v = _qkv((2, 5, 4, 8), (2, 5, 4, 8))
    out, ours = Layer(OURS).apply({}, q, k, v, mutable=["intermediates"])
    with jax.numpy_dtype_promotion("standard"):  # Flax's code mixes float32 weights and bfloat16 values
        expected, theirs = Layer(linen_attention.dot_product_attention).apply({}, q, k, v, mutable=["intermediates"])
    (weights,) = ours["intermediates"]["attention_weights"]
    assert weights.dtype == (jnp.float32 if force_fp32 else jnp.bfloat16) and out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        weights.astype(jnp.float32), theirs["intermediates"]["attention_weights"][0].astype(jnp.float32), atol=1e-2
    )
    np.testing.assert_allclose(out.astype(jnp.float32), expected.astype(jnp.float32), atol=3e-2)


def test_dtype_promotes_as_flax_does():
    q, k, v = _qkv((2, 5, 4, 8), (2, 5, 4, 8))
    assert OURS(q, k, v, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    assert OURS(q.astype(jnp.bfloat16), k, v).dtype == jnp.float32  # promoted, as Flax's
    assert OURS(*(x.astype(jnp.bfloat16) for x in (q, k, v))).dtype == jnp.bfloat16


@pytest.mark.parametrize("precision", [jax.lax.Precision.HIGHEST, "highest", (jax.lax.Precision.HIGH,) * 2])
def test_precision_reaches_every_product(precision):
    q, k, v = _qkv((2, 5, 4, 8), (2, 5, 4, 8))
    text = str(jax.make_jaxpr(lambda q, k, v: ROPE(q, k, v, precision=precision))(q, k, v))
    name = "HIGH" if isinstance(precision, tuple) else "HIGHEST"
    products = text.count("dot_general[")
    assert products >= 2 and text.count(f"precision=(Precision.{name}, Precision.{name})") == products
    assert "Precision.HIGHEST" not in str(jax.make_jaxpr(lambda q, k, v: ROPE(q, k, v))(q, k, v))


# --- what it cannot honour ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum"])
def test_replacing_the_products_is_refused(name):
    q, k, v = _qkv((1, 4, 2, 8), (1, 4, 2, 8))
    with pytest.raises(ValueError, match=f"{name} would replace posenc_jax's own score and value products"):
        OURS(q, k, v, **{name: jnp.einsum})


def test_linen_passes_its_einsums_and_gets_an_error_not_silence():
    layer = nn.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=8, attention_fn=OURS, qk_attn_weights_einsum_cls=lambda: jnp.einsum,
        attn_weights_value_einsum_cls=lambda: jnp.einsum,
    )  # fmt: skip
    with pytest.raises(ValueError, match="qk_attn_weights_einsum, attn_weights_value_einsum would replace"):
        layer.init(jax.random.key(0), jnp.ones((1, 4, 8)))


def test_complex_inputs_and_split_precisions_are_refused():
    q, k, v = _qkv((1, 4, 2, 8), (1, 4, 2, 8))
    with pytest.raises(TypeError, match="query is complex64: posenc_jax's attention takes real inputs only"):
        OURS(q.astype(jnp.complex64), k, v)
    with pytest.raises(ValueError, match="gives the two operands different precisions"):
        OURS(q, k, v, precision=(jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST))
    with pytest.raises(ValueError, match="needs a dropout_rng PRNG key"):
        OURS(q, k, v, dropout_rate=0.1)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape",
    [
        ((2, 6, 2, 8), (6, 2, 8), (6, 2, 8)),  # ranks differ
        ((2, 6, 2, 8), (3, 6, 2, 8), (3, 6, 2, 8)),  # batch dimensions differ
        ((2, 6, 2, 8), (2, 6, 2, 8), (2, 5, 2, 8)),  # key and value lengths differ
        ((2, 6, 2, 8), (2, 6, 2, 7), (2, 6, 2, 8)),  # query and key depths differ
        ((2, 6, 3, 8), (2, 6, 2, 8), (2, 6, 2, 8)),  # heads not a multiple
    ],
)
def test_bad_shapes_are_one_line_errors(q_shape, k_shape, v_shape):
    with pytest.raises(ValueError) as error:
        OURS(jnp.ones(q_shape), jnp.ones(k_shape), jnp.ones(v_shape))
    assert "\n" not in str(error.value)


# --- positions only where an encoding needs them -------------------------------------------------


def test_cross_attention_needs_positions_only_for_an_encoding():
    q, k, v = _qkv((1, 3, 2, 8), (1, 6, 2, 8))
    assert OURS(q, k, v).shape == (1, 3, 2, 8)  # NoPE: no positions needed
    with pytest.raises(ValueError, match="3 queries against 6 keys without a mask: the positions are not implied"):
        ROPE(q, k, v)
    fixed = make_attention_fn("rope", query_positions=jnp.arange(3), key_positions=jnp.arange(6))
    np.testing.assert_allclose(ROPE(q, k, v, is_causal=True), fixed(q, k, v, is_causal=True), atol=1e-6)


# --- this library's pipeline, never Flax's -----------------------------------------------------


def test_it_runs_this_librarys_attention_not_flax(monkeypatch):
    q, k, v = _qkv((2, 3, 5, 4, 8), (2, 3, 5, 4, 8))
    mask, bias = _mask(q, k), _bias(q, k)
    dropout = dict(dropout_rate=0.3, dropout_rng=jax.random.key(5), deterministic=False)
    expected = _flax(q, k, v, mask=mask, bias=bias, is_causal=True, **dropout)

    def refuse(*args, **kwargs):
        raise AssertionError("delegated to another attention function")

    for module, name in [
        (nnx_attention, "dot_product_attention"),
        (nnx_attention, "dot_product_attention_weights"),
        (linen_attention, "dot_product_attention"),
        (linen_attention, "dot_product_attention_weights"),
        (jax.nn, "dot_product_attention"),
    ]:
        monkeypatch.setattr(module, name, refuse)
    calls = []
    pipeline = flax_attention.dot_product_attention
    monkeypatch.setattr(flax_attention, "dot_product_attention", lambda *a, **kw: calls.append(1) or pipeline(*a, **kw))

    class Holder(nnx.Module):
        pass

    out, sown = nnx.capture(
        lambda m: OURS(q, k, v, mask=mask, bias=bias, is_causal=True, module=m, **dropout), nnx.Intermediate
    )(Holder())
    assert sown["attention_weights"][0].shape == (2, 3, 4, 5, 5)
    np.testing.assert_allclose(out, expected, atol=2e-6)
    fn = AttentionFunction(["alibi"], num_heads=4, head_dim=8, rngs=nnx.Rngs(0))
    assert fn(q, k, v, mask=mask).shape == q.shape
    assert len(calls) == 2


def test_inside_flax_layers_under_jit_with_dropout_and_sown_weights():
    layer = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, dropout_rate=0.2, decode=False, attention_fn=ROPE,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (2, 3, 5, 8))  # two batch dimensions
    out, sown = nnx.jit(
        lambda m, x: nnx.capture(lambda m: m(x, sow_weights=True, deterministic=False), nnx.Intermediate)(m)
    )(layer, x)
    assert out.shape == x.shape
    weights = jax.tree_util.tree_leaves(sown)[0]
    assert weights.shape == (2, 3, 2, 5, 5)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
