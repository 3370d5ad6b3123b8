"""FIRE's fast MLP (piecewise linear in its one input: the line of each pair's interval between the kinks,
and one masked contraction for the backward) against the paper's form, values and every parameter's
gradient, in the materialising path and in tiles; and what it saves, read from the compiled programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled

import posenc_jax.functional.kernels.fire as kernel
from posenc_jax.functional.encodings.fire import _fire_bias, _paper_mlp, fire_bias, fire_init
from posenc_jax.functional.kernels.fire import fire_mlp, fire_tile

PARAMS = ("w1", "b1", "w2", "b2", "c", "threshold")


def _awkward_params():
    """Units of every kind: rising (w1 > 0), falling (w1 < 0), constant (w1 = 0, on and off), two sharing a
    kink, kinks outside [0, 1]; w2 of both signs; L = 8 so that most queries are past it."""
    params = fire_init(jax.random.key(1), 3, hidden=8, threshold=8.0)
    params["w1"] = jnp.array([1.5, -0.7, 0.0, 0.0, 2.0, 1.0, 0.5, -3.0])
    params["b1"] = jnp.array([-0.6, 0.3, 0.2, -0.1, -0.8, -0.4, 0.2, 4.0])
    params["w2"] = params["w2"] * jnp.array([1.0, -2.0, 1.0, 3.0, -1.0, 1.0, 2.0, -1.0])[:, None]
    params["b2"] = jnp.array([0.1, -0.2, 0.3])
    return params


def _paper_bias(params, query_positions, key_positions, block_elements=None):
    return _fire_bias(params, query_positions, key_positions, block_elements=block_elements, into=None, mlp=_paper_mlp)


def _assert_same(fast, paper, weights, params):
    """Values to float32 rounding, and the gradient of ``sum(weights · bias)`` in every parameter, each to
    float32 rounding of its sums over the pairs (relative to its largest entry, or 1)."""
    with_grads = lambda f: jax.jit(lambda p: (lambda out, pull: (out, pull(weights)[0]))(*jax.vjp(f, p)))
    (fast_values, fast_grads), (values, grads) = with_grads(fast)(params), with_grads(paper)(params)
    np.testing.assert_allclose(fast_values, values, rtol=1e-5, atol=1e-6)
    for name in PARAMS:
        scale = np.abs(grads[name]).max()
        assert scale > 1e-3, name  # every parameter's gradient means something
        np.testing.assert_allclose(fast_grads[name], grads[name], rtol=2e-5, atol=2e-5 * max(scale, 1.0), err_msg=name)


def test_fast_bias_equals_the_papers_form(monkeypatch):
    """Batched, gapped positions, T != S, blocks of rows that do not divide T, and the backward's chunks of
    pairs (the last one shifted back) that do not divide the pairs (the tiles' tests below take one chunk)."""
    monkeypatch.setattr(kernel, "BACKWARD_CHUNK", 7)
    params = _awkward_params()
    query_positions = jnp.stack([jnp.arange(3, 60, 3), jnp.arange(0, 19)])  # [2, 19]
    key_positions = jnp.arange(0, 34, 2)  # [17]
    weights = jax.random.normal(jax.random.key(2), (2, 3, 19, 17))
    fast = lambda p: fire_bias(p, query_positions, key_positions, block_elements=50)
    paper = lambda p: _paper_bias(p, query_positions, key_positions, block_elements=50)
    _assert_same(fast, paper, weights, params)


@pytest.mark.parametrize("start", [0, 5], ids=["below-L-diagonals", "across-L-pairs"])
def test_tile_equals_the_papers_form(start):
    """A tile of consecutive positions below L (its MLP on the tile's distances) and one across it (per pair)."""
    params = _awkward_params()
    query_positions, key_positions = start + jnp.arange(6), start - 3 + jnp.arange(9)
    weights = jax.random.normal(jax.random.key(3), (1, 3, 6, 9))
    fast = lambda p: fire_tile(p, query_positions[None], key_positions[None])
    paper = lambda p: _paper_bias(p, query_positions, key_positions)
    _assert_same(fast, paper, weights, params)


def test_mlp_is_piecewise_linear_between_its_kinks():
    """At the kinks themselves and just beside them the line of each interval is the paper's sum."""
    params = _awkward_params()
    kinks = -params["b1"][params["w1"] != 0] / params["w1"][params["w1"] != 0]
    x = jnp.concatenate([kinks, kinks + 1e-3, kinks - 1e-3, jnp.linspace(-2.0, 3.0, 41)])[None]
    np.testing.assert_allclose(fire_mlp(params, x), _paper_mlp(params, x), rtol=1e-5, atol=1e-5)


def test_forward_mode_equals_the_papers_form():
    """``jax.jvp`` through the fast MLP (a tangent primitive whose transpose is the backward): every parameter's
    and the input's tangent at once, against the paper's form; and its transpose, checked by ``jax.linear_transpose``
    of the same tangent map, agrees with reverse mode."""
    params = _awkward_params()
    x = jnp.linspace(-0.5, 1.5, 23).reshape(1, 23)
    keys = jax.random.split(jax.random.key(4), len(PARAMS) + 1)
    tangents = {
        name: jax.random.normal(key, jnp.shape(params[name])) for name, key in zip(PARAMS, keys[:-1], strict=True)
    }
    dx = jax.random.normal(keys[-1], x.shape)
    fast_out, fast_dot = jax.jvp(fire_mlp, (params, x), (tangents, dx))
    out, dot = jax.jvp(_paper_mlp, (params, x), (tangents, dx))
    np.testing.assert_allclose(fast_out, out, rtol=1e-5, atol=1e-6)
    assert np.abs(dot).max() > 1e-2
    np.testing.assert_allclose(fast_dot, dot, rtol=1e-4, atol=1e-5)
    cotangent = jax.random.normal(keys[0], out.shape)
    along = lambda t: jax.jvp(fire_mlp, (params, x), t)[1]
    transposed = jax.linear_transpose(along, (tangents, dx))(cotangent)
    pulled = jax.vjp(fire_mlp, params, x)[1](cotangent)
    for got, want in zip(jax.tree.leaves(transposed), jax.tree.leaves(pulled), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _cost(f, *args):
    program = compiled(jax.jit(f).lower(*args))
    return program.cost_analysis()["flops"], program.memory_analysis().temp_size_in_bytes


def test_fast_forward_is_under_half_the_papers_flops():
    """The forward evaluates one line per pair and head, not 32 units per head (8 heads)."""
    params = fire_init(jax.random.key(0), 8)
    x = jax.ShapeDtypeStruct((1, 64, 64), jnp.float32)
    fast, _ = _cost(lambda x: fire_mlp(params, x), x)
    paper, _ = _cost(lambda x: _paper_mlp(params, x), x)
    assert fast < 0.5 * paper


def test_tile_backward_keeps_no_activations():
    """The backward keeps no ``[pairs, hidden]`` activations or their cotangent: a tile's temporaries under 40%
    of the paper form's on the tile as one block (about a quarter, with 8 heads of 32 units)."""
    params = fire_init(jax.random.key(0), 8)
    query_positions, key_positions = 1024 + jnp.arange(128), 896 + jnp.arange(128)
    tile = lambda p: jnp.sum(jnp.sin(fire_tile(p, query_positions[None], key_positions[None])))
    paper_tile = lambda p: jnp.sum(jnp.sin(_paper_bias(p, query_positions, key_positions, 1 << 20)))  # one block
    _, fast = _cost(jax.grad(tile), params)
    _, paper = _cost(jax.grad(paper_tile), params)
    assert fast < 0.4 * paper
