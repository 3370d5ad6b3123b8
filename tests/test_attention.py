"""The one attention function: seed einsums, masks, grouped heads, hooks, dtypes."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.functional import Forms, RoPE, apply_rope, declare_forms, dot_product_attention
from posenc_jax.reference import seed_attention


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), dtype)


def _reference(q, k, v, mask=None, bias=None):
    """Seed einsums head by head: q [B,T,N,H], k/v [B,S,N,H], mask/bias [B,N,T,S]."""
    B, T, N, H = q.shape
    S = k.shape[1]
    per_head = lambda a, L: np.asarray(a, np.float64).transpose(0, 2, 1, 3).reshape(B * N, L, -1)
    m = None if mask is None else np.broadcast_to(mask, (B, N, T, S)).reshape(B * N, T, S)
    b = None if bias is None else np.broadcast_to(bias, (B, N, T, S)).reshape(B * N, T, S)
    out = seed_attention(per_head(q, T), per_head(k, S), per_head(v, S), mask=m, bias=b)
    return out.reshape(B, N, T, -1).transpose(0, 2, 1, 3)


def test_matches_seed_einsums_with_t_not_s(rng, maybe_jit):
    q, k, v = _normal(rng, (2, 5, 3, 8)), _normal(rng, (2, 7, 3, 8)), _normal(rng, (2, 7, 3, 8))
    out = maybe_jit(dot_product_attention)(q, k, v)
    chex.assert_shape(out, (2, 5, 3, 8))
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(out, _reference(q, k, v), atol=1e-5)


def test_causal_by_position_and_cached_decoding(rng, maybe_jit):
    q, k, v = (_normal(rng, (2, 6, 2, 8)) for _ in range(3))
    pos = jnp.arange(6)
    attend = maybe_jit(
        lambda q, k, v, qp, kp: dot_product_attention(
            q, k, v, query_positions=qp, key_positions=kp, causal=True, encodings=[RoPE()]
        )
    )
    full = attend(q, k, v, pos, pos)
    tril = np.tril(np.ones((6, 6), bool))[None, None]
    rq, rk = apply_rope(q, pos), apply_rope(k, pos)
    np.testing.assert_allclose(full, _reference(rq, rk, v, mask=tril), atol=1e-5)
    # One query at position 3 against the first four cached keys: row 3 of the full pass.
    step = attend(q[:, 3:4], k[:, :4], v[:, :4], pos[3:4], pos[:4])
    np.testing.assert_allclose(step, full[:, 3:4], atol=1e-6)


def test_key_padding_equals_dropping_the_keys(rng, maybe_jit):
    q, k, v = _normal(rng, (1, 4, 2, 8)), _normal(rng, (1, 6, 2, 8)), _normal(rng, (1, 6, 2, 8))
    key_mask = jnp.array([[True, True, False, True, False, False]])
    out = maybe_jit(lambda q, k, v, m: dot_product_attention(q, k, v, key_mask=m))(q, k, v, key_mask)
    keep = np.asarray(key_mask[0])
    np.testing.assert_allclose(out, dot_product_attention(q, k[:, keep], v[:, keep]), atol=1e-6)


def test_packed_segments_equal_separate_sequences(rng, maybe_jit):
    lengths = (3, 5, 2)
    H = 8
    seqs = [tuple(_normal(rng, (1, n, 2, H)) for _ in range(3)) for n in lengths]
    q, k, v = (jnp.concatenate([s[i] for s in seqs], axis=1) for i in range(3))
    seg = jnp.asarray(np.repeat(np.arange(1, 4), lengths))[None]
    pos = jnp.asarray(np.concatenate([np.arange(n) for n in lengths]))[None]
    attend = maybe_jit(
        lambda q, k, v, pos, seg: dot_product_attention(
            q,
            k,
            v,
            query_positions=pos,
            key_positions=pos,
            causal=True,
            encodings=[RoPE()],
            query_segment_ids=seg,
            key_segment_ids=seg,
        )
    )
    packed = attend(q, k, v, pos, seg)
    # The references compiled (eagerly, every operation would compile afresh at each length).
    one_sequence = jax.jit(
        lambda q, k, v, p: dot_product_attention(
            q, k, v, query_positions=p, key_positions=p, causal=True, encodings=[RoPE()]
        )
    )
    start = 0
    for (sq, sk, sv), n in zip(seqs, lengths, strict=True):
        alone = one_sequence(sq, sk, sv, jnp.arange(n)[None])
        np.testing.assert_allclose(packed[:, start : start + n], alone, atol=1e-6)
        start += n


def test_fully_masked_row_gives_zeros_not_nan(rng):
    q, k, v = (_normal(rng, (1, 3, 2, 4)) for _ in range(3))
    key_mask = jnp.array([[False, False, False]])
    out, weights = dot_product_attention(q, k, v, key_mask=key_mask, return_weights=True)
    np.testing.assert_array_equal(out, np.zeros_like(out))
    np.testing.assert_array_equal(weights, np.zeros_like(weights))
    # A query before every key (causal by position) is fully masked too; gradients stay finite.
    loss = lambda q, k, v: (
        dot_product_attention(
            q, k, v, query_positions=jnp.array([0, 5, 6]), key_positions=jnp.array([3, 4, 5]), causal=True
        )
        ** 2
    ).sum()
    # Jitted, one program each (the eager path: the first call above).
    out = jax.jit(
        lambda q, k, v: dot_product_attention(
            q, k, v, query_positions=jnp.array([0, 5, 6]), key_positions=jnp.array([3, 4, 5]), causal=True
        )
    )(q, k, v)
    np.testing.assert_array_equal(out[:, 0], 0.0)
    assert np.abs(np.asarray(out[:, 1:])).sum() > 0
    for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v):
        assert np.isfinite(g).all()


def test_grouped_query_heads_equal_repeated_kv_heads(rng, maybe_jit):
    q = _normal(rng, (2, 5, 8, 4))
    k, v = _normal(rng, (2, 6, 2, 4)), _normal(rng, (2, 6, 2, 4))
    pos_q, pos_k = jnp.arange(1, 6), jnp.arange(6)
    attend = maybe_jit(
        lambda q, k, v: dot_product_attention(
            q, k, v, query_positions=pos_q, key_positions=pos_k, causal=True, encodings=[RoPE()]
        )
    )
    grouped = attend(q, k, v)
    # Query head n uses key/value head n // (N / K).
    repeated = attend(q, jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2))
    chex.assert_shape(grouped, q.shape)
    np.testing.assert_allclose(grouped, repeated, atol=1e-6)
    tiled = attend(q, jnp.tile(k, (1, 1, 4, 1)), jnp.tile(v, (1, 1, 4, 1)))
    assert np.abs(np.asarray(tiled) - np.asarray(grouped)).max() > 1e-3


def test_bfloat16_inputs_float32_scores_bfloat16_output(rng, maybe_jit):
    q, k, v = (_normal(rng, (2, 16, 2, 32), jnp.bfloat16) for _ in range(3))
    out, weights = maybe_jit(lambda q, k, v: dot_product_attention(q, k, v, return_weights=True))(q, k, v)
    chex.assert_type([out, weights], [jnp.bfloat16, jnp.float32])
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)
    ref = _reference(*(np.asarray(a.astype(jnp.float32)) for a in (q, k, v)))
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, atol=2e-2)


@dataclasses.dataclass(frozen=True)
class _DistanceBias:
    """A toy logits hook: slope · (key_pos - query_pos), per head."""

    slopes: tuple

    def logits(self, q, k, context):
        rel = (context.key_positions[None, :] - context.query_positions[:, None]).astype(jnp.float32)
        return jnp.asarray(self.slopes, jnp.float32)[None, :, None, None] * rel[None, None]


declare_forms(_DistanceBias, Forms(hooks=("logits",)))


@dataclasses.dataclass(frozen=True)
class _ValueOffset:
    """A toy values hook: adds Σ_s w[t, s] · (key_pos[s]) to every feature."""

    def values(self, weights, context):
        mean_pos = jnp.einsum("BNTS,S->BTN", weights, context.key_positions.astype(jnp.float32))
        return jnp.broadcast_to(mean_pos[..., None], mean_pos.shape + (4,))


declare_forms(_ValueOffset, Forms(hooks=("values",)))


def test_logits_and_values_hooks_compose(rng, maybe_jit):
    q, k, v = (_normal(rng, (1, 5, 2, 4)) for _ in range(3))
    qp, kp = jnp.arange(5), jnp.arange(5)
    hooks = [_DistanceBias((0.5, -1.0)), _ValueOffset()]
    out, weights = maybe_jit(
        lambda q, k, v: dot_product_attention(
            q, k, v, query_positions=qp, key_positions=kp, encodings=hooks, return_weights=True
        )
    )(q, k, v)
    rel = np.arange(5)[None, :] - np.arange(5)[:, None]
    bias = np.array([0.5, -1.0])[None, :, None, None] * rel[None, None]
    want = (
        _reference(q, k, v, bias=bias)
        + np.einsum("BNTS,S->BTN", np.asarray(weights, np.float64), np.arange(5.0))[..., None]
    )
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_vmap_over_batch_equals_batched(rng):
    q, k, v = (_normal(rng, (3, 6, 2, 8)) for _ in range(3))
    pos = jnp.arange(6)
    attend = lambda q, k, v: dot_product_attention(
        q, k, v, query_positions=pos, key_positions=pos, causal=True, encodings=[RoPE()]
    )
    # Jitted, one program each (eagerly, every operation compiles on its own; maybe_jit's tests run eagerly).
    np.testing.assert_allclose(jax.jit(jax.vmap(attend))(q, k, v), jax.jit(attend)(q, k, v), atol=1e-6)


def test_dropout_needs_a_key_and_is_unbiased(rng):
    q, k, v = (_normal(rng, (1, 4, 1, 4)) for _ in range(3))
    with pytest.raises(ValueError, match="dropout_rate=0.5 needs a dropout_rng"):
        dot_product_attention(q, k, v, dropout_rate=0.5)
    keys = jax.random.split(jax.random.key(0), 4000)
    drop = jax.vmap(lambda key: dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=key))(keys)
    assert np.abs(np.asarray(drop[0]) - np.asarray(dot_product_attention(q, k, v))).max() > 1e-3
    np.testing.assert_allclose(drop.mean(0), dot_product_attention(q, k, v), atol=0.1)


def test_bad_input_names_the_value():
    q = jnp.ones((1, 4, 6, 8))
    kv = jnp.ones((1, 4, 4, 8))
    with pytest.raises(ValueError, match="N=6 must be a multiple of key/value heads K=4"):
        dot_product_attention(q, kv, kv)
    with pytest.raises(ValueError, match="query_positions and key_positions are required"):
        dot_product_attention(q, q, q, causal=True)
    with pytest.raises(ValueError, match="integer dtype, got float32"):
        dot_product_attention(q, q, q, query_positions=jnp.arange(4.0), key_positions=jnp.arange(4.0), causal=True)
    with pytest.raises(ValueError, match=r"query_positions must have shape \[4\] or \[1, 4\], got \(5,\)"):
        dot_product_attention(q, q, q, query_positions=jnp.arange(5), key_positions=jnp.arange(4), causal=True)
    with pytest.raises(ValueError, match="pass both query_segment_ids and key_segment_ids"):
        dot_product_attention(q, q, q, query_segment_ids=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="key_mask must be boolean"):
        dot_product_attention(q, q, q, key_mask=jnp.ones((1, 4)))
    with pytest.raises(ValueError, match="must be \\[B, T, N, H\\]"):
        dot_product_attention(jnp.ones((4, 8)), jnp.ones((4, 8)), jnp.ones((4, 8)))
    with pytest.raises(TypeError, match=r"object declares no hooks, .*declare_forms\(object, Forms\(hooks="):
        dot_product_attention(q, q, q, query_positions=jnp.arange(4), key_positions=jnp.arange(4), encodings=[object()])


def test_unbatched_inputs(rng):
    q, k, v = (_normal(rng, (5, 2, 4)) for _ in range(3))
    out = dot_product_attention(q, k, v)
    chex.assert_shape(out, (5, 2, 4))
    np.testing.assert_allclose(out, dot_product_attention(q[None], k[None], v[None])[0], atol=1e-7)


@dataclasses.dataclass(frozen=True)
class _MinusInfinityBias:
    def logits(self, q, k, context):
        return jnp.full((1, 1, q.shape[1], k.shape[1]), -jnp.inf)


declare_forms(_MinusInfinityBias, Forms(hooks=("logits",)))


def test_more_bad_input_is_refused_not_silently_wrong(rng):
    q = _normal(rng, (1, 3, 2, 4))
    pos = jnp.arange(3)
    with pytest.raises(ValueError, match="mask must be boolean"):
        dot_product_attention(q, q, q, mask=jnp.zeros((1, 1, 3, 3)))
    with pytest.raises(ValueError, match=r"key_mask must have shape \[1, 3\] \(or \[1, 3\]\), got \(1,\)"):
        dot_product_attention(q, q, q, key_mask=jnp.array([False]))
    with pytest.raises(ValueError, match=r"query_segment_ids must have shape \[1, 3\]"):
        dot_product_attention(
            q, q, q, query_segment_ids=jnp.zeros((1, 1), jnp.int32), key_segment_ids=jnp.zeros((1, 3), jnp.int32)
        )
    for rate in (1.0, -0.1):
        with pytest.raises(ValueError, match=f"dropout_rate must be in \\[0, 1\\), got {rate}"):
            dot_product_attention(q, q, q, dropout_rate=rate, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="pass both query_positions and key_positions"):
        dot_product_attention(q, q, q, key_positions=pos)
    with pytest.raises(ValueError, match="must fit in int32.*got 4294967299"):
        dot_product_attention(q, q, q, query_positions=np.array([0, 1, 2**32 + 3]), key_positions=pos, causal=True)


def test_minus_infinity_bias_gives_no_nan(rng):
    q = _normal(rng, (1, 3, 2, 4))
    pos = jnp.arange(3)
    out = dot_product_attention(
        q, q, q, query_positions=pos, key_positions=pos, encodings=[_MinusInfinityBias()], causal=True
    )
    assert np.isfinite(np.asarray(out)).all()


def test_encodings_by_registered_name_as_the_modules_take_them(rng):
    from posenc_jax.functional import ALiBi, encoding_config

    q, k, v = (jnp.asarray(rng.normal(size=(1, 6, 2, 8)), jnp.float32) for _ in range(3))
    pos = jnp.arange(6)

    def attend(encodings):
        return dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=encodings, causal=True)

    by_object = attend([RoPE(), ALiBi()])
    for by_name in (["rope", "alibi"], ["rope", ALiBi()]):
        np.testing.assert_array_equal(attend(by_name), by_object)
    np.testing.assert_array_equal(attend("rope"), attend([RoPE()]))  # one name is one encoding
    yarn = encoding_config("rope-yarn", factor=2.0, original_context=4)
    np.testing.assert_array_equal(attend([yarn]), attend([RoPE(scaling=yarn.scaling)]))
