"""Sinusoidal, learned and NoPE absolute encodings against the seeds (001, 002, 003)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.functional import (
    LearnedAbsolute,
    NoPE,
    Sinusoidal,
    dot_product_attention,
    hook_names,
    learned_position_embedding,
    sinusoidal_encoding,
)
from posenc_jax.reference import d2l_positional_encoding


@pytest.mark.parametrize("dim", [2, 32, 100])
def test_sinusoidal_matches_d2l_table(dim, maybe_jit):
    # d2l §11.6: its PositionalEncoding with max_len=1000 (its default).
    fn = maybe_jit(lambda p: sinusoidal_encoding(p, dim))
    got = fn(jnp.arange(1000))
    chex.assert_shape(got, (1000, dim))
    chex.assert_type(got, jnp.float32)
    np.testing.assert_allclose(got, d2l_positional_encoding(1000, dim), atol=2e-6, rtol=0)


def test_sinusoidal_any_positions_no_ceiling(maybe_jit):
    # Offsets, gaps, negative and very large positions, batched [B, T]: each row is the
    # d2l formula at that position (evaluated here in float64 at the position itself).
    positions = jnp.array([[0, 5, 7, 1_000_000], [-3, 2, 2, 123_456_789]])
    got = maybe_jit(lambda p: sinusoidal_encoding(p, 16))(positions)
    chex.assert_shape(got, (2, 4, 16))
    freq = np.power(10000.0, -np.arange(0, 16, 2) / 16)
    angles = np.asarray(positions, np.float64)[..., None] * freq
    want = np.zeros((2, 4, 16))
    want[..., 0::2], want[..., 1::2] = np.sin(angles), np.cos(angles)
    np.testing.assert_allclose(got, want, atol=3e-6, rtol=0)


def _shift_matrix(k, dim, base=10000.0):
    """M_k of the shift-by-k proof: the block rotation taking PE(t) to PE(t+k), built from k alone."""
    M = np.zeros((dim, dim))
    for i, w in enumerate(np.power(base, -np.arange(0, dim, 2) / dim)):
        c, s = np.cos(k * w), np.sin(k * w)
        # [sin((t+k)w), cos((t+k)w)] = [[c, s], [-s, c]] @ [sin(tw), cos(tw)]  (d2l eq. 11.6.3)
        M[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[c, s], [-s, c]]
    return M


@pytest.mark.parametrize("k", [1, 7, -13, 250])
def test_shift_is_a_rotation_independent_of_t(k):
    dim = 32
    P = np.asarray(sinusoidal_encoding(jnp.arange(-300, 2300), dim), np.float64)
    t = np.arange(300, 2000)  # indices into P, i.e. positions 0..1699
    M = _shift_matrix(k, dim)
    np.testing.assert_allclose(P[t] @ M.T, P[t + k], atol=2e-5)
    # M_k is orthogonal with determinant 1: a rotation.
    np.testing.assert_allclose(M @ M.T, np.eye(dim), atol=1e-12)
    assert np.linalg.det(M) == pytest.approx(1.0)
    # The shift-by-k proof solves, for each sin/cos pair, for the 2x2 map (u1, v1; u2, v2) taking
    # PE(t) to PE(t+k). Fitting it by least squares on early positions alone recovers M_k's
    # block, and that same block maps late positions too: the map does not depend on t.
    early, late = np.arange(300, 1100), np.arange(1500, 2000)
    for i in range(dim // 2):
        cols = slice(2 * i, 2 * i + 2)
        fitted, *_ = np.linalg.lstsq(P[early, cols], P[early + k, cols], rcond=None)
        np.testing.assert_allclose(fitted.T, M[cols, cols], atol=1e-3)
        np.testing.assert_allclose(P[late, cols] @ fitted, P[late + k, cols], atol=1e-4)


def test_neighbour_similarity_symmetric_depends_only_on_offset_and_decays():
    # <PE(t), PE(t+k)> = sum_i cos(k w_i) is symmetric in k, the same for every t,
    # and decays as |k| grows over the first offsets.
    dim = 128
    P = np.asarray(sinusoidal_encoding(jnp.arange(0, 600), dim), np.float64)
    ks = np.arange(1, 40)
    for t in (100, 250, 400):
        fwd = np.array([P[t] @ P[t + k] for k in ks])
        bwd = np.array([P[t] @ P[t - k] for k in ks])
        np.testing.assert_allclose(fwd, bwd, atol=1e-4)
        w = np.power(10000.0, -np.arange(0, dim, 2) / dim)
        np.testing.assert_allclose(fwd, np.cos(np.outer(ks, w)).sum(1), atol=1e-4)
        # Decay: strictly decreasing over the nearest offsets, then a decaying envelope
        # with small ripples (the sum of cosines is not monotone everywhere).
        assert P[t] @ P[t] == pytest.approx(dim / 2, abs=1e-4)
        assert np.all(np.diff(np.concatenate([[dim / 2], fwd[:5]])) < 0)
        assert np.all(fwd < dim / 2)
        assert fwd[20:].max() < fwd[:10].min()


def test_sinusoidal_bad_input():
    with pytest.raises(ValueError, match="even integer >= 2.*got 7"):
        sinusoidal_encoding(jnp.arange(4), 7)
    with pytest.raises(ValueError, match="integer dtype, got float32"):
        sinusoidal_encoding(jnp.arange(4.0), 8)


def test_sinusoidal_vmap_equals_batched_and_embed(maybe_jit):
    positions = jnp.arange(24).reshape(3, 8) * 3
    batched = sinusoidal_encoding(positions, 16)
    mapped = jax.vmap(lambda p: sinusoidal_encoding(p, 16))(positions)
    np.testing.assert_array_equal(batched, mapped)
    x = jnp.full((3, 8, 16), 0.5, jnp.bfloat16)
    out = maybe_jit(Sinusoidal().embed)(x, positions)
    chex.assert_type(out, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float32), 0.5 + np.asarray(batched), atol=1e-2)


def test_learned_lookup_and_gradient(rng, maybe_jit):
    table = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    positions = jnp.array([[0, 3, 15], [2, 2, 9]])
    got = maybe_jit(learned_position_embedding)(table, positions)
    chex.assert_shape(got, (2, 3, 8))
    np.testing.assert_array_equal(got, np.asarray(table)[np.asarray(positions)])
    x = jnp.ones((2, 3, 8))
    grad = jax.grad(lambda t: (LearnedAbsolute(t).embed(x, positions) ** 2).sum())(table)
    assert np.isfinite(grad).all()
    # Only looked-up rows receive gradient; row 2 is used twice.
    used = {0, 3, 15, 2, 9}
    for row in range(16):
        assert (np.abs(grad[row]).sum() > 0) == (row in used)


@pytest.mark.parametrize("bad", [16, 40, -1])
def test_learned_out_of_table_is_an_error_not_a_clip(bad):
    table = jnp.zeros((16, 4))
    positions = jnp.array([0, 1, bad])
    with pytest.raises(ValueError, match=f"position {bad} is outside the learned table of 16"):
        learned_position_embedding(table, positions)
    # Under jit the positions are traced; the check runs on the host and still fails loudly.
    with pytest.raises(Exception, match=f"position {bad} is outside the learned table of 16"):
        jax.block_until_ready(jax.jit(learned_position_embedding)(table, positions))


def test_nope_fills_no_hook_and_adds_nothing_to_attention(rng):
    assert hook_names(NoPE()) == ()
    q, k, v = (jnp.asarray(rng.normal(size=(2, 5, 2, 4)), jnp.float32) for _ in range(3))
    pos = jnp.arange(5)
    plain = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, causal=True)
    nope = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, causal=True, encodings=[NoPE()])
    np.testing.assert_array_equal(plain, nope)


def test_absolute_encodings_are_rejected_by_attention():
    q = jnp.ones((1, 3, 1, 4))
    with pytest.raises(ValueError, match="Sinusoidal fills the hooks \\['embed'\\]"):
        dot_product_attention(
            q, q, q, query_positions=jnp.arange(3), key_positions=jnp.arange(3), encodings=[Sinusoidal()]
        )


def test_embed_positions_must_fit_the_tokens():
    x = jnp.zeros((2, 5, 8))
    for enc in (Sinusoidal(), LearnedAbsolute(jnp.zeros((16, 8)))):
        with pytest.raises(ValueError, match=r"positions of shape \(1,\) do not fit x of shape \(2, 5, 8\)"):
            enc.embed(x, jnp.arange(1))
    with pytest.raises(ValueError, match=r"positions of shape \(2, 5\) do not fit x of shape \(5, 8\)"):
        Sinusoidal().embed(jnp.zeros((5, 8)), jnp.zeros((2, 5), jnp.int32))
