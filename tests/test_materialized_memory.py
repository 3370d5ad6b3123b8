"""The materialised path's compiled temporary memory, forward and backward, against its budgets: plain attention
within 1.1x of ``jax.nn.dot_product_attention``'s, an encoding within 1.5x of plain attention's; and the forms
that meet them against the plain formulas they replace (values and gradients equal)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled

from posenc_jax.functional import dot_product_attention
from posenc_jax.functional.core.normalizers import l2_normalized_weights, softmax_weights
from posenc_jax.functional.encodings.fire import FireConfig
from posenc_jax.functional.encodings.kerple import KerpleConfig, kerple_bias

LENGTH, HEADS, HEAD_DIM = 256, 2, 32
LOWEST = np.finfo(np.float32).min
SPEC = jax.ShapeDtypeStruct((1, LENGTH, HEADS, HEAD_DIM), jnp.float32)


def backward_temp(attend, *extra) -> int:
    """Compiled temporary bytes of the gradient of ``sum(attend(q, k, v, *extra))`` with respect to q, k, v
    and ``extra`` (an encoding's hooks, whose parameters are leaves)."""
    argnums = tuple(range(3 + len(extra)))
    grad = jax.grad(lambda *args: jnp.sum(attend(*args)), argnums=argnums)
    return compiled(jax.jit(grad).lower(SPEC, SPEC, SPEC, *extra)).memory_analysis().temp_size_in_bytes


def _built(config):
    return config.build(config.init(jax.random.key(0), num_heads=HEADS, head_dim=HEAD_DIM, model_dim=HEADS * HEAD_DIM))


def ours(q, k, v, hooks=()):
    positions = jnp.arange(q.shape[1])
    return dot_product_attention(
        q,
        k,
        v,
        query_positions=positions,
        key_positions=positions,
        encodings=list(hooks),
        causal=True,
        implementation="materialize",
    )


def test_plain_attention_backward_memory_is_within_a_tenth_of_jax_nn():
    """The softmax keeps no mask of its floor for the backward (it would be one more score-sized array)."""
    reference = backward_temp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    assert backward_temp(ours) <= 1.1 * reference


def _max_softmax(scores, mask):
    """The softmax with the floor as ``max(s, finfo.min / 2)``, whose gradient is zero where it clamps."""
    masked = jnp.where(mask, jnp.maximum(scores, LOWEST / 2), LOWEST)
    shift = jnp.maximum(masked.max(axis=-1, keepdims=True), LOWEST / 2)
    unnormalized = jnp.exp(masked - jax.lax.stop_gradient(shift))
    return unnormalized * (1.0 / jnp.maximum(unnormalized.sum(axis=-1, keepdims=True), np.finfo(np.float32).tiny))


def _hard_scores(rng):
    """Scores and a mask with the rows a floor meets: -inf, huge negatives, fully masked, no seen score above it."""
    scores = jnp.asarray(rng.normal(size=(2, 3, 8, 9)) * 4, jnp.float32)
    mask = jnp.asarray(rng.random((2, 1, 8, 9)) < 0.6)
    mask = mask.at[:, :, 3:].set(True)
    mask = mask.at[0, 0, 0].set(False)  # fully masked
    scores = scores.at[1, :, 1, :4].set(-jnp.inf).at[1, :, 2].set(-jnp.inf)  # some -inf; all -inf
    scores = scores.at[0, :, 3, :3].set(jnp.asarray([-1e38, -3e38, LOWEST]))  # huge negatives beside finite ones
    scores = scores.at[0, :, 4].set(jnp.where(jnp.arange(9) < 5, -3e38, -jnp.inf))  # every score below the floor
    scores = scores.at[0, :, 5, 0].set(-1.6e38).at[0, :, 5, 1:].set(-jnp.inf)  # one just above, the rest -inf
    return scores, mask


def test_softmax_floor_gives_the_values_and_gradients_of_max(rng):
    scores, mask = _hard_scores(rng)
    cotangent = jnp.asarray(rng.normal(size=scores.shape), jnp.float32)
    for transform in (lambda f: f, jax.jit):
        got, want = transform(softmax_weights)(scores, mask), transform(_max_softmax)(scores, mask)
        np.testing.assert_array_equal(got, want)
        grad = lambda fn, t=transform: t(jax.grad(lambda s: (fn(s, mask) * cotangent).sum()))(scores)
        got, want = grad(softmax_weights), grad(_max_softmax)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(got == 0, want == 0)
        assert np.isfinite(got).all()
    np.testing.assert_array_equal(grad(softmax_weights)[0, :, 4], 0.0)  # held constant: uniform over its keys


def _max_l2(scores, mask):
    """The L2-normalised weights with the floor as ``max(s, finfo.min)``."""
    masked = jnp.where(mask, jnp.maximum(scores, LOWEST), LOWEST)
    e = jnp.where(mask, jnp.exp(masked - jax.lax.stop_gradient(masked.max(-1, keepdims=True))), 0.0)
    norm = jnp.sqrt((e * e).sum(-1, keepdims=True))
    return e / jnp.where(norm > 0, norm, 1.0)


def test_l2_floor_gives_the_values_and_gradients_of_max(rng):
    scores, mask = _hard_scores(rng)
    mask = jnp.broadcast_to(mask, scores.shape)
    cotangent = jnp.asarray(rng.normal(size=scores.shape), jnp.float32)
    np.testing.assert_array_equal(l2_normalized_weights(scores, mask), _max_l2(scores, mask))
    grad = lambda fn: jax.jit(jax.grad(lambda s: (fn(s, mask) * cotangent).sum()))(scores)
    got, want = grad(l2_normalized_weights), grad(_max_l2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got == 0, want == 0)
    assert np.isfinite(got).all()


def test_softmax_tile_floor_gives_the_values_and_gradients_of_max(rng):
    """The blockwise tile's running softmax: the floor at finfo.min, the tile's weights and state as with max."""
    scores, mask = _hard_scores(rng)
    rows = scores.shape[:-1]
    m = jnp.full(rows, LOWEST).at[0, :, 6].set(3.0)  # a running maximum above the tile's scores

    def reference(s):
        masked = jnp.where(mask, jnp.maximum(s, LOWEST), LOWEST)
        m_new = jax.lax.stop_gradient(jnp.maximum(m, masked.max(-1)))
        p = jnp.where(mask, jnp.exp(masked - m_new[..., None]), 0.0)
        return p, m_new

    def tiled(s):
        p, (m_new, _), _ = softmax_weights.tile_weights(s, mask, (m, jnp.zeros(rows)), None)
        return p, m_new

    for a, b in zip(tiled(scores), reference(scores), strict=True):
        np.testing.assert_array_equal(a, b)
    cotangent = jnp.asarray(rng.normal(size=scores.shape), jnp.float32)
    grad = lambda fn: jax.grad(lambda s: (fn(s)[0] * cotangent).sum())(scores)
    got, want = grad(tiled), grad(reference)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got == 0, want == 0)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_backward_memory_is_within_half_again_plain_attention(variant):
    """Kerple's gradient in r1 and r2 sums over the pairs while it recomputes the kernel: no ``[N, T, S]``
    term of the forward is kept for it."""
    hook = _built(KerpleConfig(variant=variant))
    assert backward_temp(ours, [hook]) <= 1.5 * backward_temp(ours)


def test_fire_backward_memory_is_within_half_again_plain_attention():
    """FIRE's MLP runs on blocks of query rows, each rematerialised: the backward recomputes a block's hidden
    activations (32 per pair) instead of keeping them for every pair, and a block's are a quarter of the bias."""
    assert backward_temp(ours, [_built(FireConfig())]) <= 1.5 * backward_temp(ours)


def _plain_kerple(r1, r2, query_positions, key_positions, variant):
    """Kerple's bias by the paper's formula, differentiated by autodiff."""
    q, k = jnp.atleast_2d(query_positions), jnp.atleast_2d(key_positions)
    distance = jnp.abs(k[:, None, :].astype(jnp.float32) - q[:, :, None].astype(jnp.float32))[:, None]
    r1, r2 = r1[None, :, None, None], r2[None, :, None, None]
    if variant == "log":
        return -r1 * jnp.log1p(r2 * distance)
    safe = jnp.where(distance > 0, distance, 1.0)
    return jnp.where(distance > 0, -r1 * safe**r2, 0.0)


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_bias_and_its_derivatives_are_the_formula(rng, variant):
    """Values, gradients, forward-mode tangents and vmap over parameters, at runs and at gapped per-row positions."""
    r1 = jnp.asarray(rng.uniform(0.05, 1.0, 3), jnp.float32)
    r2 = jnp.asarray(rng.uniform(0.05, 2.0 if variant == "power" else 1.0, 3), jnp.float32)
    gapped = [jnp.asarray(np.sort(rng.integers(-5, 40, (2, n))), jnp.int32) for n in (7, 9)]
    for q, k in [(jnp.arange(7), jnp.arange(9)), gapped]:
        ours_bias = lambda a, b, q=q, k=k: kerple_bias(a, b, q, k, variant=variant)
        plain = lambda a, b, q=q, k=k: _plain_kerple(a, b, q, k, variant)
        np.testing.assert_allclose(ours_bias(r1, r2), plain(r1, r2), rtol=1e-6, atol=1e-6)
        cotangent = jnp.asarray(rng.normal(size=plain(r1, r2).shape), jnp.float32)
        grad = lambda f, c=cotangent: jax.jit(jax.grad(lambda a, b: (f(a, b) * c).sum(), argnums=(0, 1)))(r1, r2)
        for got, want in zip(grad(ours_bias), grad(plain), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5)
        tangent = lambda f: jax.jvp(f, (r1, r2), (jnp.ones_like(r1), jnp.full_like(r2, -0.5)))[1]
        np.testing.assert_allclose(tangent(ours_bias), tangent(plain), rtol=1e-5, atol=1e-6)
        mapped = jax.vmap(ours_bias)(jnp.stack([r1, 0.5 * r1]), jnp.stack([r2, 0.5 * r2]))
        np.testing.assert_allclose(mapped[1], plain(0.5 * r1, 0.5 * r2), rtol=1e-6, atol=1e-6)
