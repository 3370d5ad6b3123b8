"""ALiBi, Kerple, FIRE, RoPE scalings, xPos, axial RoPE, CoPE, randomized positions, the registry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled
from term_checks import TermOnly, causal_attention_temp, score_buffer_bytes

from posenc_jax.functional import (
    ALiBi,
    AxialRoPE,
    CoPE,
    DynamicNTKScaling,
    FireConfig,
    Forms,
    Kerple,
    KerpleConfig,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    NTKScaling,
    RandomizedPositions,
    RoPE,
    SinusoidalRelative,
    YaRNScaling,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    apply_rope_2d,
    apply_xpos_qk,
    declare_forms,
    dot_product_attention,
    encoding_config,
    fire_bias,
    randomized_positions,
)
from posenc_jax.functional.core.hooks import AttentionContext
from posenc_jax.functional.encodings.rope import rope_inverse_frequencies
from posenc_jax.reference import beyond_seeds as ref
from posenc_jax.reference import su_rope


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), dtype)


# ---------------------------------------------------------------- ALiBi


@pytest.mark.parametrize("num_heads", range(1, 65))
def test_alibi_slopes_match_get_slopes(num_heads):
    np.testing.assert_allclose(alibi_slopes(num_heads), ref.alibi_get_slopes(num_heads), rtol=1e-15)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_alibi_bias_is_linear_in_distance_with_the_slopes(bidirectional):
    qp, kp = jnp.array([3, 7, 8, 20]), jnp.array([0, 1, 5, 8, 9, 30])
    bias = np.asarray(alibi_bias(12, qp, kp, bidirectional=bidirectional))[0]
    rel = np.asarray(kp)[None, :] - np.asarray(qp)[:, None]
    dist = -np.abs(rel) if bidirectional else rel
    np.testing.assert_allclose(bias, np.asarray(ref.alibi_get_slopes(12))[:, None, None] * dist[None], rtol=1e-6)
    # Along any row, equal steps in key position give equal steps in bias (linear in j - i).
    row = np.asarray(alibi_bias(12, jnp.array([50]), jnp.arange(0, 50, 7)))[0, :, 0]
    np.testing.assert_allclose(np.diff(row, 2, axis=-1), 0.0, atol=1e-5)


def test_alibi_in_attention_equals_explicit_bias(rng):
    q, k, v = (_normal(rng, (2, 6, 5, 8)) for _ in range(3))
    pos = jnp.arange(6) + 40
    out = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[ALiBi()], causal=True)
    bias = np.asarray(ref.alibi_get_slopes(5))[:, None, None] * (np.arange(6)[None, :] - np.arange(6)[:, None])[None]
    logits = np.einsum("BTNH,BSNH->BNTS", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(8) + bias
    logits = np.where(np.tril(np.ones((6, 6), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, np.einsum("BNTS,BSNH->BTNH", w, np.asarray(v, np.float64)), atol=1e-5)


# ---------------------------------------------------------------- Kerple and FIRE


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_formula_and_monotone_at_init(variant):
    cfg = KerpleConfig(variant=variant)
    params = cfg.init(jax.random.key(1), num_heads=4, head_dim=8, model_dim=32)
    enc = cfg.build(params)
    pos = jnp.arange(200)
    bias = np.asarray(enc.bias(AttentionContext(query_positions=pos, key_positions=pos, num_heads=4)))[0]
    d = np.abs(np.arange(200)[None, :] - np.arange(200)[:, None]).astype(np.float64)
    r1, r2 = (np.asarray(params[n], np.float64)[:, None, None] for n in ("r1", "r2"))
    want = -r1 * np.log1p(r2 * d) if variant == "log" else -r1 * d**r2
    np.testing.assert_allclose(bias, want, rtol=1e-5, atol=1e-5)
    row = bias[:, 199, ::-1]  # distance 0, 1, 2, ... from the last query
    assert np.all(np.diff(row, axis=-1) < 0)


def test_fire_matches_formula_is_monotone_at_init_and_blockwise_consistent():
    cfg = FireConfig()
    params = cfg.init(jax.random.key(2), num_heads=3, head_dim=8, model_dim=24)
    qp, kp = jnp.array([0, 5, 100, 600, 2000]), jnp.arange(0, 2001, 97)
    got = np.asarray(fire_bias(params, qp, kp))[0]
    np.testing.assert_allclose(got, ref.fire_bias(params, qp, kp), atol=1e-5)
    np.testing.assert_allclose(np.asarray(fire_bias(params, qp, kp, block_elements=7))[0], got, atol=1e-6)
    pos = jnp.arange(300)
    bias = np.asarray(cfg.build(params).bias(AttentionContext(query_positions=pos, key_positions=pos, num_heads=3)))[0]
    row = bias[:, 299, ::-1]  # distance 0, 1, 2, ... from the last query
    assert np.all(np.diff(row, axis=-1) <= 1e-7)
    assert row[:, 0].min() > row[:, -1].max()  # it does decrease


def test_fire_adds_its_bias_into_the_scores_by_blocks_as_the_stored_bias_would():
    """The materialising attention adds FIRE's bias by blocks of query rows (``add_logits``):
    the same output and gradients as the bias computed whole and added, with no stored bias."""
    from posenc_jax.functional import Fire, SharedBias, dot_product_attention

    params = FireConfig(threshold=64.0).init(jax.random.key(3), num_heads=4, head_dim=8, model_dim=32)
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 300, 4, 8)), jnp.float32) for _ in range(3))
    pos = jnp.arange(300) * 3  # past the threshold: the bias depends on the query position too

    def attend(params, q, k, v, stored):
        hook = SharedBias(fire_bias(params, pos, pos)) if stored else Fire(params)
        out = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[hook], causal=True)
        return (out * jnp.cos(out)).sum(), out

    grad = jax.jit(jax.grad(attend, argnums=(0, 1), has_aux=True), static_argnums=4)
    (want_params, want_q), want = grad(params, q, k, v, True)
    (got_params, got_q), got = grad(params, q, k, v, False)
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_allclose(got_q, want_q, atol=2e-5)
    for name in ("w1", "b1", "w2", "b2", "c", "threshold"):
        np.testing.assert_allclose(got_params[name], want_params[name], rtol=2e-4, atol=2e-5, err_msg=name)
    # Several blocks of rows (300 rows of 4 heads by 300 keys; by default a block's 32 hidden activations
    # are a quarter of the bias: 300 · 4 / (4 · 32) = 9 rows), the last shifted back: the blocked path
    # is the one compared above.
    # No stored bias: the blocked bias adds much less than the [B, N, T, S] buffer a stored one adds.
    p = jnp.arange(2048)
    one_buffer = score_buffer_bytes(2048)
    plain = causal_attention_temp(list, 2048)
    assert causal_attention_temp(lambda: [Fire(params)], 2048) - plain < one_buffer / 2
    assert causal_attention_temp(lambda: [SharedBias(fire_bias(params, p, p))], 2048) - plain >= 0.9 * one_buffer


# ---------------------------------------------------------------- RoPE scalings


def test_position_interpolation_at_p_equals_plain_rope_at_p_over_s(rng):
    x = _normal(rng, (1, 8, 2, 32))
    positions = np.arange(8) * 1000 + 3
    s = 4.0
    got = apply_rope(x, jnp.asarray(positions), inverse_frequency=LinearScaling(s).inverse_frequencies(32, 10000.0))
    np.testing.assert_allclose(got, su_rope(np.asarray(x), positions / s), atol=3e-5)


def test_yarn_is_plain_rope_for_high_frequencies_and_pi_for_low():
    R, base, s, L = 128, 10000.0, 8.0, 4096
    yarn = YaRNScaling(factor=s, original_context=L)
    freq = yarn.inverse_frequencies(R, base)
    plain = rope_inverse_frequencies(R, base=base)
    keep = yarn.extrapolation_weight(R, base)
    rotations = L * plain / (2 * np.pi)  # turns over the original context
    assert np.all(keep[rotations > 32] == 1.0) and np.all(keep[rotations < 1] == 0.0)
    assert (keep == 1).sum() > 5 and (keep == 0).sum() > 5
    np.testing.assert_allclose(freq[keep == 1], plain[keep == 1], rtol=1e-15)
    np.testing.assert_allclose(freq[keep == 0], plain[keep == 0] / s, rtol=1e-15)
    want, mscale = ref.yarn_inverse_frequencies(R, base, s, L)
    np.testing.assert_allclose(freq, want, rtol=1e-15)
    assert yarn.attention_factor() == pytest.approx(0.1 * np.log(s) + 1) == pytest.approx(mscale)


def test_yarn_attention_factor_scales_scores_by_its_square(rng):
    q, k = _normal(rng, (1, 5, 1, 16)), _normal(rng, (1, 5, 1, 16))
    pos = jnp.arange(5)
    yarn = YaRNScaling(factor=4.0, original_context=64)
    rq, rk = RoPE(scaling=yarn).rotate(q, k, AttentionContext(query_positions=pos, key_positions=pos))
    freq = yarn.inverse_frequencies(16, 10000.0)
    pq, pk = apply_rope(q, pos, inverse_frequency=freq), apply_rope(k, pos, inverse_frequency=freq)
    np.testing.assert_allclose((rq * rk).sum(-1), (pq * pk).sum(-1) * yarn.attention_factor() ** 2, rtol=1e-5)


def test_ntk_keeps_the_highest_frequency_and_divides_the_lowest_by_s():
    plain = rope_inverse_frequencies(64)
    ntk = NTKScaling(factor=8.0).inverse_frequencies(64, 10000.0)
    assert ntk[0] == plain[0]
    assert ntk[-1] == pytest.approx(plain[-1] / 8.0, rel=1e-12)
    assert np.all(ntk <= plain)


def test_dynamic_ntk_is_plain_rope_below_the_original_context():
    dyn = DynamicNTKScaling(factor=4.0, original_context=512)
    plain = rope_inverse_frequencies(64)
    for length in (1, 100, 512):
        np.testing.assert_array_equal(dyn.inverse_frequencies(64, 10000.0, length), plain)
    longer = dyn.inverse_frequencies(64, 10000.0, 2048)
    assert np.all(longer[1:] < plain[1:])
    # At length = s · L_orig the base grows by (s·s - (s - 1)) ** (R / (R - 2)).
    np.testing.assert_allclose(longer, rope_inverse_frequencies(64, base=10000.0 * 13.0 ** (64 / 62)), rtol=1e-12)


def test_llama3_matches_reference_and_its_bands():
    cfg = Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192)
    got = cfg.inverse_frequencies(128, 500000.0)
    np.testing.assert_allclose(got, ref.llama3_inverse_frequencies(128, 500000.0, 8.0, 1.0, 4.0, 8192), rtol=1e-14)
    plain = rope_inverse_frequencies(128, base=500000.0)
    wavelength = 2 * np.pi / plain
    np.testing.assert_array_equal(got[wavelength < 8192 / 4], plain[wavelength < 8192 / 4])
    np.testing.assert_allclose(got[wavelength > 8192], plain[wavelength > 8192] / 8, rtol=1e-15)


def test_longrope_switches_lists_at_the_original_context():
    short, long = tuple(np.linspace(1, 2, 8)), tuple(np.linspace(1, 16, 8))
    cfg = LongRoPEScaling(short, long, original_context=4096, max_context=131072)
    plain = rope_inverse_frequencies(16)
    np.testing.assert_allclose(cfg.inverse_frequencies(16, 10000.0, 4096), plain / np.array(short))
    np.testing.assert_allclose(cfg.inverse_frequencies(16, 10000.0, 4097), plain / np.array(long))
    assert cfg.attention_factor() == pytest.approx(np.sqrt(1 + np.log(32) / np.log(4096)))


# ---------------------------------------------------------------- xPos, axial RoPE


def test_xpos_matches_reference_and_depends_only_on_offsets(rng):
    q, k = _normal(rng, (1, 10, 2, 16)), _normal(rng, (1, 10, 2, 16))
    pos = jnp.arange(10) + 300
    rq, rk = apply_xpos_qk(q, k, pos, pos)
    centre = (300 + 309) // 2
    for n in range(2):
        wq, wk = ref.xpos_qk(q[0, :, n], k[0, :, n], np.asarray(pos), np.asarray(pos), centre)
        np.testing.assert_allclose(rq[0, :, n], wq, atol=2e-5)
        np.testing.assert_allclose(rk[0, :, n], wk, atol=2e-5)

    def scores(p):
        a, b = apply_xpos_qk(q, k, p, p)
        return np.einsum("BTNH,BSNH->BNTS", np.asarray(a, np.float64), np.asarray(b, np.float64))

    base = scores(jnp.arange(10))
    for shift in (7, 5000, 100_000):
        np.testing.assert_allclose(scores(jnp.arange(10) + shift), base, atol=1e-4)
    # Long sequences stay finite thanks to the centre.
    a, b = apply_xpos_qk(q, k, jnp.arange(10) + 10**7, jnp.arange(10) + 10**7)
    assert np.isfinite(np.asarray(a)).all() and np.isfinite(np.asarray(b)).all()
    # The decay: for features in one rotation pair i only, the xPos score is the RoPE score
    # times ζ_i ** ((m - n) / 512), smaller the farther back the key.
    zeta = (np.arange(0, 16, 2) / 16 + 0.4) / 1.4
    for i in (0, 5):
        single = np.zeros((1, 64, 1, 16), np.float32)
        single[..., 2 * i], single[..., 2 * i + 1] = 1.0, 0.5
        single = jnp.asarray(single)
        a, b = apply_xpos_qk(single, single, jnp.arange(64), jnp.arange(64))
        ra, rb = apply_rope(single, jnp.arange(64)), apply_rope(single, jnp.arange(64))
        xpos_row = np.einsum("H,SH->S", np.asarray(a[0, -1, 0], np.float64), np.asarray(b[0, :, 0], np.float64))
        rope_row = np.einsum("H,SH->S", np.asarray(ra[0, -1, 0], np.float64), np.asarray(rb[0, :, 0], np.float64))
        np.testing.assert_allclose(xpos_row, rope_row * zeta[i] ** ((63 - np.arange(64)) / 512), rtol=1e-4, atol=1e-6)


def test_axial_rope_on_one_row_is_1d_rope_on_the_first_half(rng):
    x = _normal(rng, (2, 6, 3, 32))
    xy = jnp.stack([jnp.arange(6), jnp.zeros(6, jnp.int32)], -1)
    got = apply_rope_2d(x, xy)
    np.testing.assert_allclose(got[..., :16], apply_rope(x[..., :16], jnp.arange(6)), atol=1e-6)
    np.testing.assert_array_equal(got[..., 16:], x[..., 16:])
    # The hook decodes row-major flat positions into (x, y).
    pos = jnp.arange(12)
    q = _normal(rng, (1, 12, 2, 16))
    rq, _ = AxialRoPE(grid_width=4).rotate(q, q, AttentionContext(query_positions=pos, key_positions=pos))
    grid = jnp.stack([pos % 4, pos // 4], -1)
    np.testing.assert_allclose(rq, apply_rope_2d(q, grid), atol=1e-6)


# ---------------------------------------------------------------- CoPE


def test_cope_matches_authors_module(rng):
    q, k, v = (_normal(rng, (2, 7, 3, 8)) for _ in range(3))
    emb = _normal(rng, (5, 8))
    pos = jnp.arange(7) + 11
    out = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[CoPE(emb)], causal=True)
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    mask = np.tril(np.ones((7, 7), bool))
    want = np.zeros(q.shape)
    for b in range(2):
        for n in range(3):
            logits = q64[b, :, n] @ k64[b, :, n].T / np.sqrt(8)
            with np.errstate(divide="ignore"):
                logits = logits + np.log(mask)
            logits = logits + ref.cope(q64[b, :, n][None], logits[None], np.asarray(emb, np.float64).T, 5)[0]
            w = np.exp(logits - logits.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            want[b, :, n] = w @ v64[b, :, n]
    np.testing.assert_allclose(out, want, atol=2e-5)


def _fast_form_matches(loss, *args, value_tolerance=None):
    """``loss(*args, fast) -> (scalar, out)``: with ``fast`` True, ``out`` and the gradients with respect to
    every argument equal those with ``fast`` False (the reference form). Returns the fast form's gradients."""
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))), has_aux=True), static_argnums=len(args))
    want_grads, want = grad(*args, False)
    got_grads, got = grad(*args, True)
    np.testing.assert_allclose(got, want, **(value_tolerance or dict(rtol=1e-5, atol=1e-5)))
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    return got_grads


@pytest.mark.parametrize("num_positions", [4, 40], ids=["clipped", "more-than-keys"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
@pytest.mark.parametrize("mask_kind", [None, "keys", "pairs"])
def test_cope_term_added_by_blocks_equals_the_term_added(rng, num_positions, per_head, mask_kind):
    """``into=``: CoPE's term computed by blocks of query rows (five blocks of two rows, the last
    shifted back) and added into the scores; the same values and gradients as the whole term added.
    With 40 embeddings for 11 keys the blocks read only the first 13 (a count is at most S)."""
    from posenc_jax.functional import cope_logits

    q = _normal(rng, (2, 9, 4, 8))
    k = _normal(rng, (2, 11, 2, 8))  # grouped heads
    scores = _normal(rng, (2, 4, 9, 11))
    emb = _normal(rng, (4, num_positions, 8) if per_head else (num_positions, 8))
    qp, kp = jnp.arange(2, 11) * 3 + 5, jnp.arange(11) * 3 + 5
    mask = {
        None: None,
        "keys": jnp.asarray(rng.random((2, 1, 1, 11)) > 0.2),
        "pairs": jnp.asarray(rng.random((2, 1, 9, 11)) > 0.3),
    }[mask_kind]
    weights = _normal(rng, (2, 4, 9, 11))

    def loss(scores, q, k, emb, blocks):
        if blocks:
            out = cope_logits(q, k, qp, kp, emb, mask=mask, into=scores, block_elements=2 * 4 * 11 * 2)
        else:
            out = scores + cope_logits(q, k, qp, kp, emb, mask=mask)
        return (jnp.sin(out) * weights).sum(), out

    # The counts are float32 sums whose order of summation (a matrix product per block of keys) may differ
    # between a block of rows and the whole: equal to float32 rounding of counts up to 11, which the
    # gradient through the gates and the interpolation amplifies a little.
    got_grads = _fast_form_matches(loss, scores, q, k, emb)
    if num_positions == 40:
        assert np.abs(np.asarray(got_grads[3])[..., 13:, :]).max() == 0.0
        assert np.abs(np.asarray(got_grads[3])[..., :12, :]).max() > 0.0
    with pytest.raises(ValueError, match="into must be scores"):
        cope_logits(q, k, qp, kp, emb, into=scores[:, :, :5])


@pytest.mark.parametrize("repeat", [False, True], ids=["increasing", "repeated"])
def test_cope_in_attention_by_blocks_equals_its_term_added(repeat):
    """Attention adds CoPE's term into the scores by blocks of rows, with key padding; values and
    gradients as with the whole term computed and added. Increasing positions take the blocks over
    each stage's prefix of keys; a repeated position at the first stage's end (query 249 sees key
    250) must take the blocks over all keys, chosen at run time."""
    rng = np.random.default_rng(12)
    q, k, v = (_normal(rng, (1, 1000, 4, 16)) for _ in range(3))
    emb = 0.5 * _normal(rng, (2000, 16))
    pos = jnp.arange(1000) - jnp.where(jnp.arange(1000) >= 250, 1, 0) if repeat else jnp.arange(1000)
    key_mask = jnp.arange(1000)[None] < 990

    def attend(q, k, v, emb, blocks):
        hook = CoPE(emb)
        out = dot_product_attention(
            q,
            k,
            v,
            query_positions=pos,
            key_positions=pos,
            encodings=[hook if blocks else TermOnly(hook)],
            causal=True,
            key_mask=key_mask,
            implementation="materialize",  # the scores built, the term added into them by blocks of rows
        )
        return (out * jnp.cos(out)).sum(), out

    assert 4 * 1000 * 1000 > 1 << 21  # more than one block of the default size
    _fast_form_matches(attend, q, k, v, emb, value_tolerance=dict(atol=2e-6))


@pytest.mark.parametrize("gate_scale", [None, 0.3], ids=["attention-scale", "own-scale"])
def test_cope_gates_read_from_the_content_scores(rng, gate_scale):
    """``content_scale``: the gates' logits are read from ``into`` (the content scores) instead of a second
    ``q·k``; values and gradients (through both uses of q and k) as with the gates computed, by blocks of
    two rows with the last shifted back and grouped heads. Scores that are not the content scores change
    the gates, so the path cannot quietly compute its own."""
    from posenc_jax.functional import cope_logits

    q = _normal(rng, (2, 9, 4, 8))
    k = _normal(rng, (2, 11, 2, 8))
    emb = _normal(rng, (12, 8))
    qp, kp = jnp.arange(2, 11), jnp.arange(11)
    weights = _normal(rng, (2, 4, 9, 11))
    content_scale = 0.2

    def content(q, k):
        return jnp.einsum("BTNH,BSNH->BNTS", q, jnp.repeat(k, 2, axis=2)) * content_scale

    def loss(q, k, emb, read):
        scores = content(q, k)
        if read:
            out = cope_logits(
                q,
                k,
                qp,
                kp,
                emb,
                scale=gate_scale,
                into=scores,
                content_scale=content_scale,
                block_elements=2 * 4 * 11 * 2,
            )
        else:
            out = scores + cope_logits(q, k, qp, kp, emb, scale=gate_scale)
        return (jnp.sin(out) * weights).sum(), out

    _fast_form_matches(loss, q, k, emb)
    shifted = content(q, k) + 1.0
    read = cope_logits(q, k, qp, kp, emb, scale=gate_scale, into=shifted, content_scale=content_scale)
    assert np.abs(np.asarray(read - (shifted + cope_logits(q, k, qp, kp, emb, scale=gate_scale)))).max() > 1e-2
    with pytest.raises(ValueError, match="pass it with into"):
        cope_logits(q, k, qp, kp, emb, content_scale=content_scale)
    with pytest.raises(ValueError, match="content_scale must be nonzero"):
        cope_logits(q, k, qp, kp, emb, into=shifted, content_scale=0.0)


class _Offset:
    """A plain ``logits`` hook adding a fixed ``[N, T, S]`` term."""

    def __init__(self, term):
        self.term = term

    def logits(self, q, k, context):
        return self.term[None]


declare_forms(_Offset, Forms(hooks=("logits",)))


@pytest.mark.parametrize("kind", ["increasing", "repeated"])
def test_cope_self_attention_by_causal_prefixes_equals_the_whole_term(rng, kind):
    """Self-attention (one positions array for queries and keys) with positions increasing along each
    row: CoPE's blocks work on the keys up to their last row only. Values and gradients equal the whole
    term's, with gaps in the positions, per-example positions, key padding, grouped heads and several
    blocks per stage. With a repeated position a query sees a key after it, so the check at run time
    must take the blocks over all keys: the same equality then holds only if it does."""
    from posenc_jax.functional import cope_logits

    q_len = 24
    q = _normal(rng, (2, q_len, 4, 8))
    k = _normal(rng, (2, q_len, 2, 8))
    emb = _normal(rng, (30, 8))
    steps = rng.integers(1, 4, size=(2, q_len))
    if kind == "repeated":
        steps[1, 6] = 0  # query 5 of example 1, the first stage's last row, sees key 6
    positions = jnp.asarray(np.cumsum(steps, axis=-1))
    mask = rng.random((2, 1, 1, q_len)) > 0.2
    mask[1, ..., 5:7] = True  # the two keys at one position are not padding
    mask = jnp.asarray(mask)
    weights = _normal(rng, (2, 4, q_len, q_len))
    content_scale = 0.35

    def loss(q, k, emb, prefixes):
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, jnp.repeat(k, 2, axis=2)) * content_scale
        if prefixes:
            out = cope_logits(
                q,
                k,
                positions,
                positions,
                emb,
                mask=mask,
                into=scores,
                content_scale=content_scale,
                block_elements=2 * 4 * 24 * 3,
            )
        else:
            out = scores + cope_logits(q, k, positions, positions + 0, emb, mask=mask)
        visible = mask & (positions[:, None, None, :] <= positions[:, None, :, None])
        return (jnp.where(visible, jnp.sin(out), 0.0) * weights).sum(), jnp.where(visible, out, 0.0)

    _fast_form_matches(loss, q, k, emb)


def test_cope_in_attention_computes_q_dot_k_once():
    """In attention, CoPE's gates read the content scores: its term adds its own products (``q·eᵀ`` and the
    counts' triangle) to plain attention's, not a second ``q·k``. With another term added first, the scores
    are no longer the content alone and CoPE computes its own ``q·k``, giving the same attention: that
    costs one ``q·k`` product more (XLA's cost analysis), which the order CoPE-first saves."""
    rng = np.random.default_rng(3)
    q, k, v = (_normal(rng, (1, 40, 2, 8)) for _ in range(3))
    pos = jnp.arange(40)
    emb = _normal(rng, (16, 8))

    def attend(*hooks):
        return lambda q, k, v: dot_product_attention(
            q, k, v, query_positions=pos, key_positions=pos, encodings=list(hooks), causal=True
        )

    flops = lambda f: compiled(jax.jit(f).lower(q, k, v)).cost_analysis()["flops"]
    bias = _Offset(_normal(rng, (2, 40, 40)))
    reading_the_scores = flops(attend(CoPE(emb))) - flops(attend())
    computing_its_own = flops(attend(bias, CoPE(emb))) - flops(attend(bias))
    q_dot_k = 2 * 2 * 40 * 40 * 8  # 2 N T S H
    assert computing_its_own - reading_the_scores >= q_dot_k, (reading_the_scores, computing_its_own)
    np.testing.assert_allclose(attend(CoPE(emb), bias)(q, k, v), attend(bias, CoPE(emb))(q, k, v), rtol=1e-5, atol=1e-5)


def test_cope_after_joined_features_reads_the_plain_query():
    """A term joined to the content product as features (the functional relative encoding, at T > H + F)
    widens q and k only for that product: CoPE after it reads q and k as they are."""
    rng = np.random.default_rng(4)
    q, k, v = (_normal(rng, (1, 64, 2, 8)) for _ in range(3))
    pos = jnp.arange(64)
    emb = _normal(rng, (16, 8))
    attend = lambda *hooks: dot_product_attention(
        q, k, v, query_positions=pos, key_positions=pos, encodings=list(hooks), causal=True
    )
    np.testing.assert_allclose(
        attend(SinusoidalRelative(), CoPE(emb)),
        attend(TermOnly(SinusoidalRelative()), TermOnly(CoPE(emb))),
        rtol=1e-5,
        atol=1e-5,
    )


def test_cope_term_is_not_stored_in_attention():
    length = 2048  # eight blocks of the default size
    emb = _normal(np.random.default_rng(0), (4096, 16))
    one_buffer = score_buffer_bytes(length)
    plain = causal_attention_temp(list, length)
    assert causal_attention_temp(lambda: [CoPE(emb)], length) - plain < one_buffer / 4
    # The whole term: its gate logits, counts and [B, N, T, P] table, each a buffer or more.
    assert causal_attention_temp(lambda: [TermOnly(CoPE(emb))], length) - plain >= 2 * one_buffer


# ---------------------------------------------------------------- randomized positions


def test_randomized_positions_sorted_unique_in_range():
    for seed in range(5):
        p = np.asarray(randomized_positions(jax.random.key(seed), 40, 2048, batch_size=8))
        assert p.shape == (8, 40)
        assert np.all(np.diff(p, axis=-1) > 0) and p.min() >= 0 and p.max() < 2048
        assert len({tuple(row) for row in p}) == 8  # independent per example
    shared = RandomizedPositions(2048)(jax.random.key(0), 40, train=True, batch_size=4)
    assert np.all(np.asarray(shared) == np.asarray(shared)[0])
    np.testing.assert_array_equal(
        RandomizedPositions(64, evaluation="arange")(jax.random.key(0), 10, train=False), np.arange(10)
    )
    # By default evaluation samples too, as the authors' code does.
    evaluated = np.asarray(RandomizedPositions(64)(jax.random.key(0), 10, train=False))
    assert np.all(np.diff(evaluated) > 0) and evaluated.max() < 64 and evaluated.max() > 9
    tight = np.asarray(randomized_positions(jax.random.key(0), 16, 16))
    np.testing.assert_array_equal(tight, np.arange(16))
    draws = np.stack([np.asarray(randomized_positions(jax.random.key(s), 4, 100)) for s in range(300)])
    assert draws.max() > 90 and draws.min() < 10  # draws cover the range, not just its start


# ---------------------------------------------------------------- bad input


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="scaling factor must be a number >= 1.*got 0.5"):
        LinearScaling(0.5)
    with pytest.raises(ValueError, match="scaling factor must be a number >= 1.*got 0.9"):
        encoding_config("rope-yarn", factor=0.9, original_context=512)
    with pytest.raises(ValueError, match="unknown encoding 'rope-yarnn'; known encodings: alibi, .*rope-yarn"):
        encoding_config("rope-yarnn")
    with pytest.raises(ValueError, match="head_dim must be divisible by 4 for axial 2-D RoPE.*got 18"):
        apply_rope_2d(jnp.ones((1, 4, 1, 18)), jnp.zeros((4, 2), jnp.int32))
    with pytest.raises(ValueError, match="max_length=10 is smaller than the sequence length 16"):
        randomized_positions(jax.random.key(0), 16, 10)
    with pytest.raises(ValueError, match="max_length=10 is smaller than the sequence length 16"):
        RandomizedPositions(10)(jax.random.key(0), 16, train=False)
    with pytest.raises(ValueError, match="Kerple r2 must be in \\(0, 2.0\\]"):
        Kerple(jnp.ones(2), jnp.full(2, 3.0), variant="power")
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1 for ALiBi slopes, got 0"):
        alibi_slopes(0)
    with pytest.raises(ValueError, match="bad settings \\['bogus'\\] for encoding 't5'; its settings are"):
        encoding_config("t5", bogus=1)


@pytest.mark.parametrize("length", [0, 1, 5, 31, 32, 33, 100])
def test_cope_reverse_cumsum_is_the_sum_over_later_keys(length):
    """CoPE's counts by blocks (a triangle product per block, then the later blocks' totals): the
    sums ``Σ_{s' >= s} x[s']`` in float64 numpy, and the gradient of a reverse cumulative sum
    (a forward cumulative sum of the cotangent)."""
    from posenc_jax.functional.encodings import cope
    from posenc_jax.functional.kernels.cope import reverse_cumsum

    assert cope.reverse_cumsum is reverse_cumsum  # the encoding's name for the kernel

    rng = np.random.default_rng(length)
    x = rng.random((2, 3, length)).astype(np.float32)
    want = np.flip(np.cumsum(np.flip(x.astype(np.float64), -1), -1), -1)
    got = jax.jit(reverse_cumsum)(jnp.asarray(x))
    assert got.shape == x.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    cotangent = rng.normal(size=x.shape).astype(np.float32)
    (grad,) = jax.vjp(reverse_cumsum, jnp.asarray(x))[1](jnp.asarray(cotangent))
    np.testing.assert_allclose(grad, np.cumsum(cotangent.astype(np.float64), -1), rtol=1e-5, atol=1e-5)
    # bfloat16 gates sum in float32.
    half = reverse_cumsum(jnp.asarray(x, jnp.bfloat16))
    assert half.dtype == jnp.float32


def _interpolate_by_take_along_axis(per_position, counts):
    """CoPE's interpolation as the authors write it (floor and ceil gathered), the check for the flat pair gather."""
    top = per_position.shape[-1] - 1
    counts = jnp.minimum(counts, top)
    lower = jnp.floor(counts)
    weight = counts - lower
    lower = lower.astype(jnp.int32)
    upper = jnp.minimum(lower + 1, top)
    at_lower = jnp.take_along_axis(per_position, lower, axis=-1)
    at_upper = jnp.take_along_axis(per_position, upper, axis=-1)
    return at_lower * (1.0 - weight) + at_upper * weight


@pytest.mark.parametrize("num_positions", [1, 2, 3, 9])
def test_cope_interpolation_by_flat_pairs_matches_floor_and_ceil(num_positions):
    """The pair gather (and its one scatter of pairs) equals the floor/ceil gathers in value and in both
    gradients, at fractional counts, at exact integers (a saturated gate's count), at the top
    position P - 1 and past it (clipped as CoPE clips), with leading axes like CoPE's [B, N, T]."""
    from posenc_jax.functional.encodings.cope import interpolate_positions

    rng = np.random.default_rng(num_positions)
    per_position = jnp.asarray(rng.normal(size=(2, 3, 4, num_positions)), jnp.float32)
    counts = rng.uniform(0, num_positions + 1, size=(2, 3, 4, 7)).astype(np.float32)
    counts[..., :3] = np.array([0.0, num_positions - 1, min(1, num_positions - 1)], np.float32)  # integers
    counts = jnp.asarray(counts)
    clipped = lambda f: lambda x, c: f(x, jnp.minimum(c, num_positions - 1))  # CoPE clips its counts first
    got = jax.jit(clipped(interpolate_positions))(per_position, counts)
    want = _interpolate_by_take_along_axis(per_position, counts)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # numpy, from the paper's formula: e[⌊p⌋] (⌈p⌉ - p) + e[⌈p⌉] (p - ⌊p⌋), and e[p] where p is an integer.
    c = np.minimum(np.asarray(counts, np.float64), num_positions - 1)
    x = np.asarray(per_position, np.float64)
    floor, ceil = np.floor(c).astype(int), np.ceil(c).astype(int)
    at_floor, at_ceil = np.take_along_axis(x, floor, -1), np.take_along_axis(x, ceil, -1)
    numpy_value = np.where(floor == ceil, at_floor, at_floor * (ceil - c) + at_ceil * (c - floor))
    np.testing.assert_allclose(got, numpy_value, rtol=1e-5, atol=1e-5)
    cotangent = jnp.asarray(rng.normal(size=counts.shape), jnp.float32)
    with_grad, pullback = jax.vjp(clipped(interpolate_positions), per_position, counts)
    np.testing.assert_allclose(with_grad, got, rtol=1e-6, atol=1e-6)  # the forward rule's flat pairs
    grads = pullback(cotangent)
    want_grads = jax.vjp(clipped(_interpolate_by_take_along_axis), per_position, counts)[1](cotangent)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert np.any(np.asarray(grads[1]) != 0) or num_positions == 1  # the counts' gradient is not vacuous


@pytest.mark.parametrize("shape", [(7,), (2, 3, 4, 7)], ids=["one-row", "cope-axes"])
def test_cope_pair_reads_equal_their_plain_form(shape):
    """The kernel's pair reads (a linear primitive: one scatter of pairs into the flat values as its
    transpose) equal their plain form (``take_along_axis``, autodiff's gradient) in value, gradients and
    forward mode, in the values and the weights."""
    from posenc_jax.functional.kernels.cope import interpolate_pairs, interpolate_pairs_plain

    rng = np.random.default_rng(len(shape))
    per_position = jnp.asarray(rng.normal(size=shape[:-1] + (5,)), jnp.float32)
    lower = jnp.asarray(rng.integers(0, 4, size=shape), jnp.int32)
    weight = jnp.asarray(rng.uniform(size=shape), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=shape), jnp.float32)
    got, pullback = jax.vjp(lambda x, w: interpolate_pairs(x, lower, w), per_position, weight)
    want, plain_pullback = jax.vjp(lambda x, w: interpolate_pairs_plain(x, lower, w), per_position, weight)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(pullback(cotangent), plain_pullback(cotangent), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    tangent = jax.jvp(lambda x: interpolate_pairs(x, lower, weight), (per_position,), (per_position,))[1]
    np.testing.assert_allclose(tangent, want, rtol=1e-6, atol=1e-6)  # linear in the values
    tangents = (jnp.asarray(rng.normal(size=per_position.shape), jnp.float32), jnp.asarray(rng.normal(size=shape)))
    tangents = (tangents[0], tangents[1].astype(jnp.float32))
    got = jax.jvp(lambda x, w: interpolate_pairs(x, lower, w), (per_position, weight), tangents)
    want = jax.jvp(lambda x, w: interpolate_pairs_plain(x, lower, w), (per_position, weight), tangents)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    second = lambda f: jax.hessian(lambda w: (f(per_position, lower, w) ** 3).sum())(weight)  # through the jvp rule
    np.testing.assert_allclose(second(interpolate_pairs), second(interpolate_pairs_plain), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lower_mapped", [True, False], ids=["all-mapped", "indices-shared"])
def test_cope_pair_reads_under_vmap_equal_their_plain_form(lower_mapped):
    """jax.vmap of the pair reads' value, gradient (its transpose, batched) and tangent, with the indices
    and weights mapped too or shared by every mapped entry (batch axis of 1): the plain form's."""
    from posenc_jax.functional.kernels.cope import interpolate_pairs, interpolate_pairs_plain

    rng = np.random.default_rng(7)
    mapped, batch, keys, positions = 3, 1, 6, 5
    per_position = jnp.asarray(rng.normal(size=(mapped, batch, positions)), jnp.float32)
    lower = jnp.asarray(rng.integers(0, positions - 1, size=(mapped, batch, keys)), jnp.int32)
    weight = jnp.asarray(rng.uniform(size=(mapped, batch, keys)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(mapped, batch, keys)), jnp.float32)
    axes = (0, 0, 0, 0) if lower_mapped else (0, None, None, 0)
    lower, weight = (lower, weight) if lower_mapped else (lower[0], weight[0])

    def each(f):
        def one(x, lower, weight, c):
            value, pullback = jax.vjp(lambda x: f(x, lower, weight), x)
            return value, pullback(c)[0], jax.jvp(lambda x: f(x, lower, weight), (x,), (2 * x,))[1]

        return jax.jit(jax.vmap(one, in_axes=axes))(per_position, lower, weight, cotangent)

    for got, want in zip(each(interpolate_pairs), each(interpolate_pairs_plain), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(each(interpolate_pairs_plain)[1]).max()) > 0.1  # a gradient that can be wrong


def test_cope_interpolation_keeps_nan_and_checks_shapes():
    """A NaN count (a visible key's NaN score) gives NaN, not another position's value; mismatched leading
    axes are refused with both shapes named."""
    from posenc_jax.functional.encodings.cope import interpolate_positions

    per_position = jnp.arange(12.0).reshape(2, 6)
    counts = jnp.array([[0.5, jnp.nan], [jnp.nan, 5.0]])
    got = np.asarray(interpolate_positions(per_position, counts))
    np.testing.assert_array_equal(np.isnan(got), [[False, True], [True, False]])
    np.testing.assert_allclose(got[[0, 1], [0, 1]], [0.5, 11.0])
    with pytest.raises(ValueError, match=r"per_position \(2, 6\) and counts \(3, 2\)"):
        interpolate_positions(per_position, jnp.zeros((3, 2)))
