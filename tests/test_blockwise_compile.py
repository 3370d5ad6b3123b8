"""The size of blockwise attention's compiled program: what its first call waits for.

XLA:CPU compiles each fusion of the optimised program on its own, so the first call's compile time
follows the number of fusions; a ``conditional`` in the tile loop is compiled with both branches, and in
the backward pass over again (its known half, its transpose, the zeros of the residuals a hidden tile does
not make). Over positions that are the indices, which tiles a causal query block sees is known while
tracing: query blocks are paired in one scan and no tile is skipped by a conditional. These tests pin that,
deterministically (no wall time), and that the paired blocks compute what the materialised path does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.functional import dot_product_attention
from small_encodings import small_config

B, N, H = 1, 2, 8
COMPOSITION = ("rope", "alibi", "t5")


def _hooks(names):
    hooks = []
    for i, name in enumerate(names):
        config = small_config(name)
        params = config.init(jax.random.key(i), num_heads=N, head_dim=H, model_dim=N * H)
        noise = jax.random.key(10 + i)
        params = jax.tree.map(lambda p, noise=noise: p + 0.1 * jax.random.normal(noise, p.shape), params)
        hooks.append(config.build(params))
    return hooks


def _attend(implementation, length, block, positions):
    def forward(q, k, v, hooks):
        blocks = dict(block_q=block, block_k=block) if implementation == "blockwise" else {}
        return dot_product_attention(
            q,
            k,
            v,
            query_positions=positions,
            key_positions=positions,
            encodings=hooks,
            causal=True,
            implementation=implementation,
            **blocks,
        )

    return forward


def _forward_and_backward_hlo(names, length=64, block=16, positions=None) -> str:
    """The optimised HLO of the causal blockwise forward and backward (gradients of q, k, v and the hooks)."""
    positions = jnp.arange(length) if positions is None else positions
    forward = _attend("blockwise", length, block, positions)
    grad = jax.grad(lambda *args: jnp.sum(forward(*args)), argnums=(0, 1, 2, 3))
    shape = jax.ShapeDtypeStruct((B, length, N, H), jnp.float32)
    return jax.jit(grad).lower(shape, shape, shape, _hooks(names)).compile().as_text()


@pytest.mark.parametrize("names", [(), ("rope", "alibi")])
def test_no_conditional_over_index_positions(names):
    """Causal attention over positions 0..T-1 in square tiles: no tile is skipped by a conditional.

    (A distance bias, T5's, Kerple's, keeps its run-time choice between its diagonals and its pairs: the form
    without that conditional compiled smaller but ran its tiles slower, 1.3-1.9x NoPE's forward at T=4096.)"""
    hlo = _forward_and_backward_hlo(names)
    assert " conditional(" not in hlo


def test_positions_not_known_keep_their_conditionals():
    """Positions that are not the indices (here, shifted by 100): the tiles a block sees are found at run
    time, by the conditional that skips hidden tiles."""
    hlo = _forward_and_backward_hlo(("rope", "alibi"), positions=100 + jnp.arange(64))
    assert " conditional(" in hlo


@pytest.mark.parametrize(("length", "block"), [(64, 16), (48, 16), (40, 16), (72, 16), (16, 16), (20, 32)])
def test_paired_blocks_agree_with_the_materialised_attention(length, block):
    """Query blocks paired in one scan (an even and an odd number of blocks, padded ones, a single block):
    outputs, gradients of q, k, v and the hooks' parameters, and tangents as the materialised path's."""
    hooks = _hooks(COMPOSITION)
    q, k, v, cotangent = (jax.random.normal(jax.random.key(length + i), (2, length, N, H)) for i in range(4))
    positions = jnp.arange(length)
    results = []
    for implementation in ("blockwise", "materialize"):
        # Jitted (one program each, not op by op); the positions, closed over, stay known to be the indices.
        forward = _attend(implementation, length, block, positions)
        out = jax.jit(forward)(q, k, v, hooks)
        loss = lambda *args, forward=forward: jnp.sum(forward(*args) * cotangent)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, hooks)
        jvp = lambda *x, forward=forward: jax.jvp(lambda *y: forward(*y, hooks), x, (cotangent,) * 3)[1]
        tangent = jax.jit(jvp)(q, k, v)
        results.append(jax.tree.leaves((out, grads, tangent)))
    assert float(jnp.abs(results[1][0]).max()) > 1e-2
    for got, want in zip(*results, strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_masked_non_finite_values_stay_masked_in_paired_blocks():
    """A NaN value of a key no query before it may see: the rows before it stay finite, the rows after are
    NaN, as in the materialised path."""
    length = 48
    q, k, v = (jax.random.normal(jax.random.key(i), (B, length, N, H)) for i in range(3))
    v = v.at[:, 30].set(jnp.nan)
    forward = _attend("blockwise", length, 16, jnp.arange(length))
    out = forward(q, k, v, [])
    assert bool(jnp.isfinite(out[:, :30]).all())
    assert bool(jnp.isnan(out[:, 30:]).all())


def test_the_layer_over_its_own_positions_pairs_its_blocks_under_jit():
    """The attention layer makes its positions (none given) as a constant, so under ``jit`` its causal
    blockwise program is the paired one (no tile-skipping conditional); given positions, traced, keep it."""
    from flax import nnx

    from posenc_jax.nn import MultiHeadAttention

    layer = MultiHeadAttention(
        N, N * H, encodings=["rope", "alibi"], implementation="blockwise", block_q=16, block_k=16, rngs=nnx.Rngs(0)
    )
    graph, state = nnx.split(layer)
    x = jax.ShapeDtypeStruct((B, 64, N * H), jnp.float32)

    def program(positions):
        def loss(state, x, positions):
            out = nnx.merge(graph, state)(x, query_positions=positions, causal=True)
            return jnp.sum(out)

        grad = jax.grad(loss, argnums=(0, 1))
        if positions is None:
            return jax.jit(lambda state, x: grad(state, x, None)).lower(state, x).compile().as_text()
        return jax.jit(grad).lower(state, x, positions).compile().as_text()

    assert " conditional(" not in program(None)
    assert " conditional(" in program(jax.ShapeDtypeStruct((64,), jnp.int32))
