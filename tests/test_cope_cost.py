"""CoPE's term added into the content scores by causal prefixes: the hand-written gradient against
autodiff's, and the temporary memory of the materialised forward and backward against plain attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from term_checks import materialised_backward_temp

from posenc_jax.functional import CoPE, cope_logits


def _normal(rng, shape, scale=1.0):
    return jnp.asarray(scale * rng.normal(size=shape), jnp.float32)


@pytest.mark.parametrize(
    "per_head, masked, gate_scale, num_positions",
    [(False, False, None, 40), (True, True, 0.3, 40), (False, True, None, 5)],
    ids=["shared", "per-head-masked-own-scale", "clipped-counts"],
)
def test_prefix_gradient_is_autodiffs(per_head, masked, gate_scale, num_positions):
    """Self-attention with increasing positions, the scores made by the call (so the causal prefixes and
    their hand-written gradient): values, gradients and tangents of q, k and the embeddings as autodiff gives them
    through the whole term added, for a cotangent on every key up to each query (masked ones too, which
    attention would leave out), with grouped heads and several blocks per stage, the last shifted
    back. Few embeddings clip the counts (no gradient there)."""
    rng = np.random.default_rng(3)
    length, heads, dim = 24, 4, 8
    q, k = _normal(rng, (2, length, heads, dim)), _normal(rng, (2, length, 2, dim))
    emb = _normal(rng, (heads, num_positions, dim) if per_head else (num_positions, dim), 0.5)
    positions = jnp.asarray(np.cumsum(rng.integers(1, 4, size=(2, length)), axis=-1))
    mask = jnp.asarray(rng.random((2, 1, 1, length)) > 0.2) if masked else None
    visible = positions[:, None, None, :] <= positions[:, None, :, None]  # the prefixes add nothing past them
    weights = jnp.where(visible, _normal(rng, (2, heads, length, length)), 0.0)
    content_scale = 0.35

    def loss(q, k, emb, prefixes):
        content = lambda: jnp.einsum("BTNH,BSNH->BNTS", q, jnp.repeat(k, 2, axis=2)) * content_scale
        kw = dict(scale=gate_scale, mask=mask)
        if prefixes:  # blocks of 5 and 4 rows in stages of 6 (the gradient's of 1 to 4): the last shifted back
            out = cope_logits(
                q, k, positions, positions, emb, into=content, content_scale=content_scale,
                block_elements=2 * heads * length * 4, **kw,
            )  # fmt: skip
        else:
            out = content() + cope_logits(q, k, positions, positions + 0, emb, **kw)
        return (jnp.sin(out) * weights).sum(), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    want_grads, want = grad(q, k, emb, False)
    got_grads, got = grad(q, k, emb, True)
    np.testing.assert_allclose(jnp.where(visible, got, 0.0), jnp.where(visible, want, 0.0), rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    tangents = (_normal(rng, q.shape), _normal(rng, k.shape), _normal(rng, emb.shape))  # forward mode too
    tangent = jax.jit(
        lambda prefixes: jax.jvp(lambda *a: loss(*a, prefixes)[0], (q, k, emb), tangents)[1], static_argnums=0
    )
    np.testing.assert_allclose(tangent(True), tangent(False), rtol=1e-4, atol=1e-4)


def test_materialised_backward_within_one_and_a_half_times_plain():
    """At T = 1,024 with 8 heads (four stages of causal prefixes), the gradient keeps the content scores
    the blocks read and recomputes each block's gates, counts and ``q · eᵀ``, one block at a time: the
    forward and backward's temporaries within 1.5x plain attention's (autodiff's gradient, keeping every
    block's gates, counts, weights and pairs, needed 2.6x)."""
    heads, dim = 8, 16
    hook = CoPE(_normal(np.random.default_rng(2), (1024, dim), 0.5))
    assert materialised_backward_temp([hook], 1024, heads, dim) <= 1.5 * materialised_backward_temp(
        [], 1024, heads, dim
    )
