"""Transformer-XL's terms added into the scores by causal prefixes: the hand-written gradient against
autodiff's, and the temporary memory of the materialised forward and backward against plain attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from term_checks import materialised_backward_temp

from posenc_jax.functional import TransformerXL
from posenc_jax.functional.core.blocks import by_causal_prefix_blocks
from posenc_jax.functional.kernels.transformer_xl import _add_ladder_terms, _ladder_block


def _normal(rng, shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


@pytest.mark.parametrize("block_elements", [2 * 3 * 12 * 2, 1 << 20], ids=["shifted-back-blocks", "one-per-stage"])
def test_ladder_terms_gradient_is_autodiffs(block_elements):
    """Values, gradients of every input (the scores, ``u·k``, ``q + v``, the projected ladder) and tangents
    as autodiff gives them through the plain form, the same blocks by ``by_causal_prefix_blocks``, for a cotangent on
    every entry (the keys past each query too, which attention would mask)."""
    rng = np.random.default_rng(0)
    batch, heads, length, dim = 2, 3, 12, 4
    scores = _normal(rng, (batch, heads, length, length))
    content = _normal(rng, (batch, heads, 1, length))
    shifted_q = _normal(rng, (batch, length, heads, dim))
    projected = _normal(rng, (length, heads, dim))
    cotangent = _normal(rng, scores.shape)

    def plain(scores, content, shifted_q, projected):
        def block(start, rows, width, current=None):
            q_rows = jax.lax.dynamic_slice_in_dim(shifted_q, start, rows, axis=1)
            return _ladder_block(content, q_rows, projected, start, width, 0.5)

        return by_causal_prefix_blocks(block, scores, block_elements=block_elements)

    fast = lambda *args: _add_ladder_terms(*args, 0.5, block_elements)
    args = (scores, content, shifted_q, projected)
    value_and_pullback = lambda f: jax.jit(lambda *a: (f(*a), jax.vjp(f, *a)[1](cotangent)))
    want, want_grads = value_and_pullback(plain)(*args)
    got, got_grads = value_and_pullback(fast)(*args)
    np.testing.assert_array_equal(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    tangents = tuple(_normal(rng, np.shape(a)) for a in args)  # forward mode: autodiff's
    tangent = lambda f: jax.jit(lambda *a: jax.jvp(f, a, tangents)[1])(*args)
    np.testing.assert_allclose(tangent(fast), tangent(plain), rtol=1e-5, atol=1e-5)


def test_materialised_backward_within_one_and_a_half_times_plain():
    """At T = 1,024 with 8 heads (four stages of causal prefixes, a block each), the terms' backward holds
    one block's transients at a time: the forward and backward's temporaries within 1.5x plain attention's
    (autodiff's gradient, holding every block's at once, was above 1.5x)."""
    rng = np.random.default_rng(1)
    heads, dim = 8, 16
    hook = TransformerXL(_normal(rng, (32, heads, dim)), _normal(rng, (heads, dim)), _normal(rng, (heads, dim)))
    assert materialised_backward_temp([hook], 1024, heads, dim) <= 1.5 * materialised_backward_temp(
        [], 1024, heads, dim
    )
