"""``broadcast_to`` and ``sum_to_shape`` against plain broadcasting, and the cost of the attention's gradient.

A term shared by the batch (a ``[1, N, T, S]`` bias, URPE's factor) reaches the scores through
:func:`~posenc_jax.functional.kernels.broadcast.broadcast_to`, whose gradient sums the batch as slices
(XLA:CPU's strided reduction over a leading axis cost five copies of the array).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled

from posenc_jax.functional import dot_product_attention, t5_bias
from posenc_jax.functional.core import operations
from posenc_jax.functional.core.attention import SharedBias
from posenc_jax.functional.core.hooks import AttentionContext
from posenc_jax.functional.core.normalizers import URPE
from posenc_jax.functional.kernels.broadcast import broadcast_to, sum_to_shape


@pytest.mark.parametrize(
    ("full", "shape"),
    [
        ((8, 4, 5, 6), (1, 4, 5, 6)),  # a bias shared by the batch
        ((3, 4, 5, 6), (4, 5, 6)),  # the same, rank-deficient
        ((3, 4, 5, 6), (1, 1, 5, 6)),  # shared by batch and heads
        ((2, 3, 5, 1), (2, 1, 5, 1)),  # a middle axis
        ((70, 3), (1, 3)),  # longer than the slice-sum limit: one reduction
        ((2, 3), (2, 3)),  # nothing broadcast
    ],
)
@pytest.mark.parametrize("cpu_forms", [True, False], ids=["cpu-form", "plain-form"])
def test_sum_to_shape_is_the_sum_over_the_broadcast_axes(full, shape, rng, cpu_forms, monkeypatch):
    monkeypatch.setattr(
        operations, "current_backend", lambda: "cpu" if cpu_forms else "gpu"
    )  # the form another backend runs, on the CPU
    x = jnp.asarray(rng.normal(size=full), jnp.float32)
    padded = (1,) * (len(full) - len(shape)) + shape
    axes = tuple(i for i, (d, t) in enumerate(zip(padded, full, strict=True)) if d == 1 and t != 1)
    expected = np.asarray(x, np.float64).sum(axis=axes, keepdims=True).reshape(shape)
    got = jax.jit(lambda x: sum_to_shape(x, shape))(x)  # a new function: traced with this form
    assert got.shape == shape and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("shape", "full"), [((1, 4, 5, 6), (8, 4, 5, 6)), ((5, 6), (3, 4, 5, 6)), ((3, 1), (3, 7))])
@pytest.mark.parametrize("cpu_forms", [True, False], ids=["cpu-form", "plain-form"])
def test_broadcast_to_has_the_values_and_gradient_of_plain_broadcasting(shape, full, rng, cpu_forms, monkeypatch):
    monkeypatch.setattr(operations, "current_backend", lambda: "cpu" if cpu_forms else "gpu")
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    weights = jnp.asarray(rng.normal(size=full), jnp.float32)
    np.testing.assert_array_equal(broadcast_to(x, full), jnp.broadcast_to(x, full))
    ours = jax.grad(lambda x: (jnp.sin(broadcast_to(x, full)) * weights).sum())(x)
    plain = jax.grad(lambda x: (jnp.sin(jnp.broadcast_to(x, full)) * weights).sum())(x)
    np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-5)
    # Batched over a leading axis, as seeds trained together are.
    xs = jnp.stack([x, 2 * x])
    batched = jax.vmap(jax.grad(lambda x: (jnp.sin(broadcast_to(x, full)) * weights).sum()))(xs)
    np.testing.assert_allclose(
        batched[1],
        jax.grad(lambda x: (jnp.sin(jnp.broadcast_to(x, full)) * weights).sum())(2 * x),
        rtol=1e-5,
        atol=1e-5,
    )


def test_broadcast_to_refuses_a_shape_it_does_not_broadcast_to():
    with pytest.raises(ValueError, match=r"\(2, 3\) does not broadcast to \(4, 3\)"):
        broadcast_to(jnp.zeros((2, 3)), (4, 3))
    with pytest.raises(ValueError, match="does not broadcast"):
        sum_to_shape(jnp.zeros((4, 3)), (2, 3))


def _shared_bias_loss(q, k, v, table, positions, normalizer=None):
    bias = t5_bias(table, positions, positions, bidirectional=False)
    kwargs = {} if normalizer is None else {"normalizer": normalizer}
    out = dot_product_attention(
        q, k, v, encodings=[SharedBias(bias)], query_positions=positions, key_positions=positions, causal=True, **kwargs
    )
    return (out * jnp.cos(out)).sum()


def test_shared_bias_gradients_match_a_bias_broadcast_by_hand(rng):
    """The table's gradient through the attention (slice sums over the batch) against the same attention
    given the bias already broadcast to every batch row (no batch reduction at all)."""
    B, T, N, H = 3, 9, 2, 4
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32) for _ in range(3))
    table = jnp.asarray(rng.normal(size=(32, N)), jnp.float32)
    positions = jnp.arange(T)

    def by_hand(q, k, v, table):
        bias = jnp.broadcast_to(t5_bias(table, positions, positions, bidirectional=False), (B, N, T, T))
        out = dot_product_attention(
            q, k, v, encodings=[SharedBias(bias)], query_positions=positions, key_positions=positions, causal=True
        )
        return (out * jnp.cos(out)).sum()

    ours = jax.grad(_shared_bias_loss, argnums=(0, 1, 2, 3))(q, k, v, table, positions)
    plain = jax.grad(by_hand, argnums=(0, 1, 2, 3))(q, k, v, table)
    for a, b in zip(ours, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_urpe_factor_gradient_matches_plain_broadcasting(rng):
    B, T, N, H = 3, 7, 2, 4
    scores = jnp.asarray(rng.normal(size=(B, N, T, T)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(B, N, T, T)), jnp.float32)
    table = jnp.asarray(1 + 0.1 * rng.normal(size=(N, 2 * 3 + 1)), jnp.float32)
    positions = jnp.arange(T)[None]
    context = AttentionContext(positions, positions, H**-0.5, H, N, True, T, None)

    def ours(table):
        return (URPE(table, max_distance=3).normalize(scores, None, context) * weights).sum()

    def plain(table):
        factor = URPE(table, max_distance=3).tile_factor(context)
        return (jax.nn.softmax(scores, axis=-1) * jnp.broadcast_to(factor, scores.shape) * weights).sum()

    np.testing.assert_allclose(jax.grad(ours)(table), jax.grad(plain)(table), rtol=1e-4, atol=1e-5)


def test_shared_bias_gradient_sums_the_batch_at_less_cost_than_plain_broadcasting(monkeypatch):
    """The CPU form of the shared bias's gradient adds the batch's slices of the ``[B, N, T, S]`` cotangent:
    the compiled gradient reads and writes at least two such arrays fewer than the plain form's reduction over
    the batch axis (XLA's cost analysis; XLA:CPU ran that strided reduction at five copies' cost). The margin was
    four arrays before the softmax's backward stopped keeping a mask (4d3d99a), which changed both programs."""
    B, T, N, H = 4, 32, 2, 8
    spec = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    args = (spec, spec, spec, jax.ShapeDtypeStruct((32, N), jnp.float32), jax.ShapeDtypeStruct((T,), jnp.int32))

    def bytes_accessed(backend):
        monkeypatch.setattr(operations, "current_backend", lambda: backend)  # the form that backend runs
        grad = jax.jit(jax.grad(_shared_bias_loss, argnums=3))  # a new function: traced with this form
        return compiled(grad.lower(*args)).cost_analysis()["bytes accessed"]

    assert bytes_accessed("cpu") + 2 * (B * N * T * T * 4) <= bytes_accessed("gpu")


def test_cpu_forms_is_deprecated_for_the_one_place_the_backend_is_read():
    from posenc_jax.functional.kernels import backend

    with pytest.warns(DeprecationWarning, match=r"operations\.current_backend\(\) == \"cpu\""):
        assert backend.cpu_forms() == (operations.current_backend() == "cpu")
