"""RoPE against Su's pseudocode and the properties the paper proves."""

import math
import re

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from compiled import compiled

from posenc_jax.functional import RoPE, RotaryTable, apply_rope, apply_rope_qk
from posenc_jax.functional.core.hooks import AttentionContext
from posenc_jax.functional.core.positions import position_angles
from posenc_jax.functional.encodings.rope import rope_inverse_frequencies
from posenc_jax.reference import rope_by_rotation_matrices, su_rope


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), dtype)


def _interleave_permutation(rotary_dim):
    """perm with x_interleaved = x_half[..., perm]: pair (i, i + R/2) becomes (2i, 2i + 1)."""
    half = rotary_dim // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)


@pytest.mark.parametrize(
    "positions",
    [np.arange(16), np.arange(16) + 4000, np.array([[0, 1, 5, 9, 9, 30, 31, 200] * 2, list(range(100, 116))])],
    ids=["arange", "offset", "batched-gaps"],
)
def test_matches_su_pseudocode(rng, maybe_jit, positions):
    qw = _normal(rng, (2, 16, 3, 64))
    got = maybe_jit(apply_rope)(qw, jnp.asarray(positions))
    chex.assert_shape(got, qw.shape)
    chex.assert_type(got, jnp.float32)
    np.testing.assert_allclose(got, su_rope(np.asarray(qw), positions), atol=2e-5, rtol=0)


def test_matches_rotation_matrices(rng):
    x = _normal(rng, (12, 1, 16))
    positions = np.array([0, 1, 2, 3, 50, 51, 700, 701, 5000, 5001, 12345, 99999])
    got = apply_rope(x, jnp.asarray(positions))[:, 0]
    np.testing.assert_allclose(got, rope_by_rotation_matrices(np.asarray(x[:, 0]), positions), atol=3e-5)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_scores_depend_only_on_relative_position(rng, layout, maybe_jit):
    q, k = _normal(rng, (1, 20, 2, 32)), _normal(rng, (1, 20, 2, 32))
    rope = maybe_jit(
        lambda q, k, qp, kp: RoPE(layout=layout).rotate(q, k, AttentionContext(query_positions=qp, key_positions=kp))
    )

    def scores(qp, kp):
        rq, rk = rope(q, k, jnp.asarray(qp), jnp.asarray(kp))
        return np.einsum("BTNH,BSNH->BNTS", np.asarray(rq, np.float64), np.asarray(rk, np.float64))

    pos = np.arange(20)
    base = scores(pos, pos)
    for shift in (1, 37, 10_000):
        np.testing.assert_allclose(scores(pos + shift, pos + shift), base, atol=1e-3)
    # Scores do change when the relative offsets change, so the check above can fail.
    assert np.abs(scores(pos, 2 * pos) - base).max() > 0.1
    # Each score equals the score of the same vectors placed at (0, n - m).
    m, n = 5, 13
    rq, _ = rope(q, k, jnp.asarray([m] * 20), jnp.asarray([m] * 20))
    _, rk = rope(q, k, jnp.asarray([n] * 20), jnp.asarray([n] * 20))
    rq0, _ = rope(q, k, jnp.zeros(20, jnp.int32), jnp.zeros(20, jnp.int32))
    _, rk0 = rope(q, k, jnp.full(20, n - m), jnp.full(20, n - m))
    np.testing.assert_allclose((rq * rk).sum(-1), (rq0 * rk0).sum(-1), atol=1e-4)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_preserves_norms(rng, layout):
    x = _normal(rng, (3, 10, 4, 64))
    y = apply_rope(x, jnp.arange(30).reshape(3, 10) * 997, layout=layout)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    assert np.abs(np.asarray(y) - np.asarray(x)).max() > 0.1  # it did rotate


@pytest.mark.parametrize("rotary_dim", [None, 16])
def test_layouts_are_the_same_map_up_to_a_permutation(rng, rotary_dim):
    head_dim = 32
    R = rotary_dim or head_dim
    perm = np.concatenate([_interleave_permutation(R), np.arange(R, head_dim)])
    x_half = _normal(rng, (2, 9, 3, head_dim))
    x_inter = x_half[..., perm]
    positions = jnp.arange(9) * 13 + 2
    half = apply_rope(x_half, positions, layout="half", rotary_dim=rotary_dim)
    inter = apply_rope(x_inter, positions, layout="interleaved", rotary_dim=rotary_dim)
    np.testing.assert_allclose(half[..., perm], inter, atol=1e-6)
    # ...and not the same map without the permutation.
    assert (
        np.abs(
            np.asarray(apply_rope(x_half, positions, layout="interleaved", rotary_dim=rotary_dim)) - np.asarray(half)
        ).max()
        > 0.1
    )


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_partial_rotary(rng, layout):
    x = _normal(rng, (2, 7, 2, 64))
    positions = jnp.arange(7) + 3
    y = apply_rope(x, positions, rotary_dim=16, layout=layout)
    np.testing.assert_array_equal(y[..., 16:], x[..., 16:])
    np.testing.assert_allclose(y[..., :16], apply_rope(x[..., :16], positions, layout=layout), atol=1e-6)


def test_qk_in_one_pass_equals_separate_calls(rng, maybe_jit):
    q = _normal(rng, (2, 6, 8, 32))
    k = _normal(rng, (2, 10, 2, 32))  # grouped-query: fewer key heads, longer keys (a cache)
    qp, kp = jnp.arange(4, 10), jnp.arange(10)
    rq, rk = maybe_jit(lambda q, k, qp, kp: apply_rope_qk(q, k, qp, kp, layout="half"))(q, k, qp, kp)
    chex.assert_shape([rq, rk], [q.shape, k.shape])
    np.testing.assert_allclose(rq, apply_rope(q, qp, layout="half"), atol=1e-6)
    np.testing.assert_allclose(rk, apply_rope(k, kp, layout="half"), atol=1e-6)
    same_q, same_k = apply_rope_qk(q, q, qp, qp)
    np.testing.assert_array_equal(same_q, same_k)


def test_vmap_equals_batched_and_gradients_finite(rng):
    x = _normal(rng, (4, 8, 2, 16))
    positions = jnp.arange(32).reshape(4, 8) * 7
    np.testing.assert_allclose(jax.vmap(apply_rope)(x, positions), apply_rope(x, positions), atol=1e-6)
    grad = jax.grad(lambda x: (apply_rope(x, positions) ** 3).sum())(x)
    assert np.isfinite(grad).all()
    # RoPE is orthogonal, so the gradient of <a, RoPE(x)> is the inverse rotation of a.
    a = _normal(rng, x.shape)
    g = jax.grad(lambda x: (a * apply_rope(x, positions)).sum())(x)
    np.testing.assert_allclose(apply_rope(g, positions), a, atol=1e-5)


def test_compiles_once_for_new_position_values(rng):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def rotate(x, positions):
        return apply_rope(x, positions)

    x = _normal(rng, (1, 4, 1, 8))
    for start in (0, 100, 100_000):
        rotate(x, jnp.arange(start, start + 4))


def test_phases_exact_modulo_two_pi():
    # The float32 product p·θ is off by ~ulp(p·θ) (0.004 rad at 1e5); our phases are exact.
    freq = rope_inverse_frequencies(64)
    positions = np.array([0, 1, -1, 4095, 100_000, 1_234_567, -98_765_432, 2**31 - 1], np.int64)
    got = np.asarray(position_angles(jnp.asarray(positions, jnp.int32), freq), np.float64)
    want = np.outer(positions.astype(np.float64), freq)
    wrapped_error = np.angle(np.exp(1j * (got - want)))
    assert np.abs(wrapped_error).max() < 2e-6
    assert np.all(np.abs(got) <= math.pi + 1e-6)
    naive = np.float32(positions[4]) * freq.astype(np.float32)
    assert np.abs(np.angle(np.exp(1j * (naive.astype(np.float64) - want[4])))).max() > 1e-3


def test_phases_with_traced_frequencies_fall_back_to_float32():
    freq = jnp.asarray(rope_inverse_frequencies(8), jnp.float32)
    got = jax.jit(position_angles)(jnp.arange(5), freq)
    np.testing.assert_allclose(got, np.outer(np.arange(5), np.asarray(freq)), rtol=1e-6)


def _bf16_ulp(x):
    x = np.abs(np.asarray(x, np.float64))
    exponent = np.floor(np.log2(np.maximum(x, np.finfo(np.float32).tiny)))
    return 2.0 ** (exponent - 7)  # bfloat16 keeps 8 significant bits


def _float32_slack(ref, layout):
    """2e-6 times the norm of the rotation pair each element belongs to."""
    if layout == "interleaved":
        pair = np.repeat(np.hypot(ref[..., 0::2], ref[..., 1::2]), 2, axis=-1)
    else:
        half = ref.shape[-1] // 2
        norm = np.hypot(ref[..., :half], ref[..., half:])
        pair = np.concatenate([norm, norm], axis=-1)
    return 2e-6 * pair


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_bfloat16_at_position_100k_is_as_good_as_rounding(rng, layout):
    x = _normal(rng, (1, 16, 4, 128), jnp.bfloat16)
    positions = 100_000 + np.arange(16)
    out = apply_rope(x, jnp.asarray(positions), layout=layout)
    chex.assert_type(out, jnp.bfloat16)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    if layout == "interleaved":
        ref = su_rope(x64, positions)
    else:
        perm = _interleave_permutation(128)
        ref = np.empty_like(x64)
        ref[..., perm] = su_rope(x64[..., perm], positions)
    err = np.abs(np.asarray(out.astype(jnp.float32), np.float64) - ref)
    rounding = np.abs(ref.astype(ml_dtypes.bfloat16).astype(np.float64) - ref)
    # Elementwise: within half an ulp of bfloat16, plus float32 noise relative to the size of
    # the rotated pair (a small output can come from cancelling larger inputs). That is, the
    # output is the exact rotation correctly rounded to bfloat16, up to float32 noise.
    assert np.all(err <= 0.5 * _bf16_ulp(ref) + _float32_slack(ref, layout))
    assert err.max() <= rounding.max() * (1 + 2**-6)


def test_naive_float32_phase_would_fail_the_bfloat16_check(rng):
    # Guards the test above: a float32 product p·θ (what most ports do) misses the bound.
    x = np.asarray(_normal(rng, (1, 16, 4, 128), jnp.bfloat16).astype(jnp.float32), np.float64)
    positions = 100_000 + np.arange(16)
    freq = rope_inverse_frequencies(128).astype(np.float32)
    angles = (positions.astype(np.float32)[:, None] * freq).astype(np.float64)
    cos, sin = np.repeat(np.cos(angles), 2, -1)[None, :, None], np.repeat(np.sin(angles), 2, -1)[None, :, None]
    x2 = np.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)
    naive = (x * cos + x2 * sin).astype(ml_dtypes.bfloat16).astype(np.float64)
    ref = su_rope(x, positions)
    assert np.any(np.abs(naive - ref) > 0.5 * _bf16_ulp(ref) + _float32_slack(ref, "interleaved"))


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="head_dim must be even for RoPE, got 63"):
        apply_rope(jnp.ones((1, 4, 2, 63)), jnp.arange(4))
    with pytest.raises(ValueError, match="rotary_dim must be an even integer >= 2 for RoPE, got 15"):
        apply_rope(jnp.ones((1, 4, 2, 64)), jnp.arange(4), rotary_dim=15)
    with pytest.raises(ValueError, match="rotary_dim must be <= head_dim 64, got 128"):
        apply_rope(jnp.ones((1, 4, 2, 64)), jnp.arange(4), rotary_dim=128)
    with pytest.raises(ValueError, match="integer dtype, got float32"):
        apply_rope(jnp.ones((1, 4, 2, 64)), jnp.arange(4.0))
    with pytest.raises(ValueError, match="positions have length 5 but x has T = 4"):
        apply_rope(jnp.ones((1, 4, 2, 64)), jnp.arange(5))
    with pytest.raises(ValueError, match="inverse_frequency must have shape \\[2\\]"):
        apply_rope_qk(
            jnp.ones((1, 4, 2, 8)),
            jnp.ones((1, 4, 2, 8)),
            jnp.arange(4),
            jnp.arange(4),
            rotary_dim=4,
            inverse_frequency=np.ones(4),
        )
    with pytest.raises(ValueError, match="more batch axes than x"):
        apply_rope(jnp.ones((4, 2, 8)), jnp.zeros((3, 4), jnp.int32))
    with pytest.raises(ValueError, match="inverse_frequency must be finite"):
        apply_rope(jnp.ones((1, 4, 2, 8)), jnp.arange(4), inverse_frequency=np.array([1.0, np.nan, 0.1, 0.01]))
    with pytest.raises(ValueError, match="layout must be one of .*got 'neox'"):
        RoPE(layout="neox")
    with pytest.raises(ValueError, match="rotary_dim must be an even integer >= 2 for RoPE, got 7"):
        RoPE(rotary_dim=7)


def _trig_output_sizes(fn, *args) -> list[int]:
    """The output sizes (elements) of the compiled computations of ``fn`` that evaluate sin or cos."""
    text = compiled(jax.jit(fn).lower(*args)).as_text()
    sizes = []
    for computation in text.split("\n\n"):
        if re.search(r"\b(sine|cosine)\(", computation):
            result = computation.strip().split("\n")[0].split("->")[-1]
            shapes = re.findall(r"\[([\d,]*)\]", result)
            sizes.append(max(math.prod(int(d) for d in dims.split(",") if d) for dims in shapes))
    return sizes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_compiled_program_computes_the_table_once_per_position(dtype, layout):
    # sin and cos run on [T, R/2] tables only, never inside the [B, T, N, H] rotation loops
    # (XLA:CPU counts them as cheap and would otherwise recompute them per element of q and k).
    q = jnp.zeros((2, 64, 4, 32), dtype)
    k = jnp.zeros((2, 64, 2, 32), dtype)
    positions = jnp.arange(64)
    sizes = _trig_output_sizes(lambda q, k, p: apply_rope_qk(q, k, p, p, layout=layout), q, k, positions)
    assert sizes and max(sizes) <= 64 * 32, sizes  # the [T, R] table (or its [T, R/2] halves)

    # The check can fail: the plain elementwise formulation puts sin/cos in the big loops.
    def elementwise(q, p):
        angles = position_angles(p, rope_inverse_frequencies(32))[None, :, None]
        first, second = q[..., 0::2], q[..., 1::2]
        return jnp.stack([first * jnp.cos(angles) - second * jnp.sin(angles), second * jnp.cos(angles)], -1)

    assert max(_trig_output_sizes(elementwise, q.astype(jnp.float32), positions)) >= 2 * 64 * 4 * 16


@pytest.mark.parametrize("call", ["forward", "blockwise forward", "decoding step"])
def test_model_computes_the_table_once_for_all_layers(call, monkeypatch):
    """The model prepares the cos/sin table once per call and each layer rotates its own tokens by it: the
    table is built once whatever the number of layers, the attention's implementation, prefill or decoding.
    Counted while tracing (XLA would merge identical per-layer copies, so the compiled program cannot tell)."""
    from flax import nnx

    import posenc_jax.functional.encodings.rope as rope_module
    import posenc_jax.nn.attention as attention_module
    from posenc_jax.nn import Transformer

    built, table = [], rope_module._table
    monkeypatch.setattr(rope_module, "_table", lambda *args, **kwargs: built.append(1) or table(*args, **kwargs))

    def tables_built(num_layers):
        model = Transformer(
            vocab_size=16,
            model_dim=64,
            num_layers=num_layers,
            num_heads=2,
            mlp_dim=64,
            encoding="rope",
            implementation="blockwise" if call == "blockwise forward" else "auto",
            block_q=64,
            block_k=64,
            rngs=nnx.Rngs(0),
        )
        graphdef, state = nnx.split(model)
        tokens, positions = jnp.zeros((2, 128), jnp.int32), jnp.arange(128)
        built.clear()
        if call != "decoding step":
            jax.make_jaxpr(lambda state, t, p: nnx.merge(graphdef, state)(t, p))(state, tokens, positions)
        else:
            step = lambda state, t, p, c: nnx.merge(graphdef, state).decode(t, p, c)
            jax.make_jaxpr(step)(state, tokens, jnp.broadcast_to(positions, tokens.shape), model.init_cache(2, 256))
        return len(built)

    assert tables_built(1) == tables_built(3) == 1
    # The count can fail: layers that ignore the model's prepared table build their own, one or more each.
    prepared = attention_module.MultiHeadAttention._prepared
    monkeypatch.setattr(attention_module.MultiHeadAttention, "_prepared", lambda self, ready: prepared(self, None))
    assert tables_built(3) > tables_built(1) > 1


@pytest.mark.parametrize("scaling", [None, "yarn", "dynamic-ntk"])
def test_prepared_table_rotates_as_rope_and_falls_back_for_other_positions(rng, scaling):
    from posenc_jax.functional import encoding_config

    rope = RoPE() if scaling is None else encoding_config(f"rope-{scaling}", factor=4.0, original_context=8)
    q, k = _normal(rng, (2, 12, 4, 16)), _normal(rng, (2, 12, 2, 16))
    positions = jnp.broadcast_to(jnp.arange(12) + 5, (2, 12))
    hook = rope.prepare(positions, head_dim=16)
    assert isinstance(hook, RotaryTable) and hook.rotates_per_token == (scaling != "dynamic-ntk")
    context = AttentionContext(query_positions=positions, key_positions=positions)
    for got, want in zip(
        jax.jit(lambda h, q, k, c: h.rotate(q, k, c))(hook, q, k, context), rope.rotate(q, k, context), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # Other positions (a cache's keys): rotated from the context, not by the stored table.
    keys = jnp.broadcast_to(jnp.arange(12) * 3, (2, 12))
    other = AttentionContext(query_positions=positions, key_positions=keys)
    for got, want in zip(hook.rotate(q, k, other), rope.rotate(q, k, other), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="head_dim must be even for RoPE, got 15"):
        rope.prepare(positions, head_dim=15)


def _rotate_hooks():
    from posenc_jax.functional import AxialRoPE, XPos, YaRNScaling
    from posenc_jax.hf import RoPEOnLastFeatures

    yarn = RoPE(scaling=YaRNScaling(factor=4.0, original_context=8))
    return {
        "rope": RoPE(),
        "rope-yarn": yarn,
        "rotary-table": yarn.prepare(jnp.arange(10) + 5, head_dim=16),
        "xpos": XPos(),
        "axial": AxialRoPE(grid_width=4),
        "rope-on-last-features": RoPEOnLastFeatures(RoPE(layout="half"), num_features=8),
    }


@pytest.mark.parametrize("name", list(_rotate_hooks()))
def test_rotate_hooks_take_positions_or_a_pair_as_a_context(rng, maybe_jit, name):
    hook = _rotate_hooks()[name]
    q, k = _normal(rng, (2, 10, 4, 16)), _normal(rng, (2, 10, 2, 16))
    positions = jnp.arange(10) + 5
    rotate = maybe_jit(lambda q, k, where: hook.rotate(q, k, where))
    want = hook.rotate(q, k, AttentionContext(query_positions=positions, key_positions=positions))
    for got, expected in zip(rotate(q, k, positions), want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-6)
    # A decoding step: one new query against every key.
    step = AttentionContext(query_positions=positions[-1:], key_positions=positions)
    want = hook.rotate(q[:, -1:], k, step)
    for where in ((positions[-1:], positions), [np.asarray(positions[-1:]), np.asarray(positions)]):
        for got, expected in zip(rotate(q[:, -1:], k, where), want, strict=True):
            np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("scaling", [None, "yarn"])
def test_rotate_then_jax_nn_attention_equals_our_attention(rng, scaling):
    """The rotation-only path: RoPE (scaled or not) in front of another attention kernel."""
    from posenc_jax.functional import YaRNScaling, dot_product_attention

    rope = RoPE() if scaling is None else RoPE(scaling=YaRNScaling(factor=4.0, original_context=8))
    factor = rope.frequencies(16)[1]
    assert factor == (1.0 if scaling is None else pytest.approx(0.1 * math.log(4.0) + 1))
    q, k, v = _normal(rng, (2, 10, 4, 16)), _normal(rng, (2, 10, 2, 16)), _normal(rng, (2, 10, 2, 16))
    pos = jnp.arange(10) + 5
    q_rot, k_rot = rope.rotate(q, k, pos)
    # The attention factor multiplies the rotated q and k (the scores by its square).
    np.testing.assert_allclose(jnp.linalg.norm(q_rot, axis=-1), factor * jnp.linalg.norm(q, axis=-1), rtol=1e-5)
    ours = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, causal=True, encodings=[rope])
    theirs = jax.nn.dot_product_attention(q_rot, k_rot, v, is_causal=True)
    np.testing.assert_allclose(theirs, ours, atol=2e-5)
    # A decoding step: the last query against all keys, rotated with the pair of positions.
    q_step, k_all = rope.rotate(q[:, -1:], k, (pos[-1:], pos))
    ours = dot_product_attention(
        q[:, -1:], k, v, query_positions=pos[-1:], key_positions=pos, causal=True, encodings=[rope]
    )
    np.testing.assert_allclose(jax.nn.dot_product_attention(q_step, k_all, v), ours, atol=2e-5)
