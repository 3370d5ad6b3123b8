"""Relative encodings: fast paths against the pseudocode references, any positions."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled
from term_checks import TermOnly, causal_attention_temp, score_buffer_bytes

from posenc_jax.functional import (
    ClippedRelativeBias,
    DeBERTa,
    SharedBias,
    Shaw,
    SinusoidalRelative,
    T5Bias,
    TransformerXL,
    deberta_log_bucket,
    deberta_logits,
    dot_product_attention,
    rel_shift,
    shaw_value_term,
    t5_relative_bucket,
    transformer_xl_logits,
)
from posenc_jax.functional.core import operations
from posenc_jax.functional.core.hooks import AttentionContext
from posenc_jax.functional.core.positions import batched_positions
from posenc_jax.functional.core.products import content_scores
from posenc_jax.functional.core.relative import (
    bucket_relative,
    by_query_blocks,
    clipped_relative_index,
    diagonal_sums,
    distance_slots,
    expand_relative_bias,
    gather_by_distance,
    relative_positions,
    sum_by_distance,
    toeplitz,
    toeplitz_where_runs,
)
from posenc_jax.functional.encodings.transformer_xl import project_distances
from posenc_jax.reference import relative as ref

B, T, S, N, H = 2, 5, 7, 2, 8

POSITIONS = {
    # queries are the last T of S keys, as with a cache or Transformer-XL memory
    "arange": (np.arange(S - T, S), np.arange(S)),
    "offset": (np.arange(S - T, S) + 1000, np.arange(S) + 1000),
    "gaps": (np.array([3, 9, 10, 22, 40]), np.array([0, 3, 4, 9, 10, 22, 40])),
    "far": (np.array([0, 700, 1500, 3000, 9000]), np.array([0, 5, 690, 1490, 2000, 5000, 12000])),
    "batched": (
        np.array([[2, 3, 4, 5, 6], [10, 11, 30, 31, 32]]),
        np.array([[0, 1, 2, 3, 4, 5, 6], [0, 5, 10, 11, 12, 30, 32]]),
    ),
}


def _normal(rng, shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _rows(positions, b):
    positions = np.asarray(positions)
    return positions[b] if positions.ndim == 2 else positions


def _causal(qp, kp):
    return np.asarray(kp)[None, :] <= np.asarray(qp)[:, None]


def _reference_attention(q, k, v, qp, kp, causal, extra_logits, scale=None):
    """softmax(scale·qk + extra) v per (batch, head), float64; extra_logits(b, qp_b, kp_b) -> [N, T, S]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scale = 1 / np.sqrt(H) if scale is None else scale
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        qb, kb = _rows(qp, b), _rows(kp, b)
        logits = np.einsum("iNH,jNH->Nij", q[b], k[b]) * scale + extra_logits(b, qb, kb)
        mask = _causal(qb, kb)[None] if causal else np.ones(logits.shape, bool)
        attn = ref._softmax(logits, mask)
        out[b] = np.einsum("Nij,jNH->iNH", attn, v[b])
    return out


def _attend(encoding, q, k, v, qp, kp, causal, jit):
    fn = lambda q, k, v, qp, kp: dot_product_attention(
        q, k, v, query_positions=qp, key_positions=kp, encodings=[encoding], causal=causal
    )
    out = (jax.jit(fn) if jit else fn)(q, k, v, jnp.asarray(qp), jnp.asarray(kp))
    chex.assert_shape(out, q.shape)
    return out


@pytest.fixture
def qkv(rng):
    return _normal(rng, (B, T, N, H)), _normal(rng, (B, S, N, H)), _normal(rng, (B, S, N, H))


@pytest.mark.parametrize("positions", POSITIONS, ids=list(POSITIONS))
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_shaw_matches_seed_pseudocode(rng, qkv, positions, causal, per_head):
    q, k, v = qkv
    k_clip = 2
    shape = (N, 2 * k_clip + 1, H) if per_head else (2 * k_clip + 1, H)
    P_K, P_V = _normal(rng, shape), _normal(rng, shape)
    qp, kp = POSITIONS[positions]
    out = _attend(Shaw(k_clip, P_K, P_V), q, k, v, qp, kp, causal, jit=causal)
    want = np.zeros(q.shape)
    for b in range(B):
        qb, kb = _rows(qp, b), _rows(kp, b)
        for n in range(N):
            pk = np.asarray(P_K[n] if per_head else P_K)
            pv = np.asarray(P_V[n] if per_head else P_V)
            mask = _causal(qb, kb)[None] if causal else None
            want[b, :, n] = ref.shaw_attention(
                q[b, :, n][None], k[b, :, n][None], v[b, :, n][None], pk, pv, qb, kb, k_clip, mask
            )[0]
    np.testing.assert_allclose(out, want, atol=2e-5)


def test_shaw_value_term_alone_and_key_term_alone(rng, qkv):
    q, k, v = qkv
    qp, kp = POSITIONS["gaps"]
    P = _normal(rng, (7, H))
    for key_table, value_table in ((P, None), (None, P)):
        out = _attend(Shaw(3, key_table, value_table), q, k, v, qp, kp, False, jit=False)
        want = np.stack(
            [
                np.stack(
                    [
                        ref.shaw_attention(
                            q[b, :, n][None], k[b, :, n][None], v[b, :, n][None], key_table, value_table, qp, kp, 3
                        )[0]
                        for n in range(N)
                    ],
                    1,
                )
                for b in range(B)
            ]
        )
        np.testing.assert_allclose(out, want, atol=2e-5)


@pytest.mark.parametrize("keys_at", [0, 97, 160], ids=["far-before", "across", "far-after"])
def test_shaw_tile_scores_with_its_own_scale_per_head_tables_and_grouped_keys(rng, keys_at):
    """Shaw's tile past the clip joins ``P_K[end]`` to the keys, rescaled to its own ``scale``; with a table
    per head and grouped keys it cannot (one key serves several heads' rows) and adds the term instead."""
    qpos, kpos = jnp.arange(100, 104), jnp.arange(keys_at, keys_at + 6)
    context = AttentionContext.from_positions(qpos, kpos, causal=False, scale=0.125, num_heads=4)
    q = _normal(rng, (1, 4, 4, 8))
    content = lambda q, k: content_scores(q, k, 0.125)
    for kv_heads, table in ((4, _normal(rng, (4, 7, 8))), (2, _normal(rng, (4, 7, 8))), (2, _normal(rng, (7, 8)))):
        k = _normal(rng, (1, 6, kv_heads, 8))
        shaw = Shaw(3, table, None, scale=0.3)
        want = content(q, k) + shaw.logits(q, k, context)
        np.testing.assert_allclose(shaw.tile_scores(q, k, context, content), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keys_at", [0, 97, 160], ids=["far-before", "across", "far-after"])
def test_deberta_tile_scores_for_each_term_own_scale_and_grouped_keys(rng, keys_at):
    """DeBERTa's tile past the slots' reach joins the slot's rows to the queries (p2c) and keys (c2p), less
    their own product; with grouped keys c2p cannot join the keys and its term is added instead."""
    qpos, kpos = jnp.arange(100, 104), jnp.arange(keys_at, keys_at + 6)
    context = AttentionContext.from_positions(qpos, kpos, causal=False, scale=0.125, num_heads=4)
    q = _normal(rng, (1, 4, 4, 8))
    content = lambda q, k: content_scores(q, k, 0.125)
    tables = dict(pos_query=_normal(rng, (8, 4, 8)), pos_key=_normal(rng, (8, 4, 8)))
    for terms in (("c2p",), ("p2c",), ("c2p", "p2c")):
        for kv_heads in (4, 2):
            k = _normal(rng, (1, 6, kv_heads, 8))
            deberta = DeBERTa(**tables, span=4, terms=terms, scale=0.2)
            want = content(q, k) + deberta.logits(q, k, context)
            np.testing.assert_allclose(deberta.tile_scores(q, k, context, content), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positions", POSITIONS, ids=list(POSITIONS))
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_functional_relative_matches_materialised_sinusoid(qkv, positions, causal):
    q, k, v = qkv
    qp, kp = POSITIONS[positions]
    out = _attend(SinusoidalRelative(), q, k, v, qp, kp, causal, jit=causal)
    extra = lambda b, qb, kb: np.stack(
        [ref.functional_relative_logits(np.asarray(q[b, :, n])[None], qb, kb)[0] for n in range(N)]
    )
    np.testing.assert_allclose(out, _reference_attention(q, k, v, qp, kp, causal, extra), atol=2e-5)


@pytest.mark.parametrize("positions", POSITIONS, ids=list(POSITIONS))
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_transformer_xl_matches_four_term_reference(rng, qkv, positions, causal):
    q, k, v = qkv
    D = 12
    W_R, u, vb = _normal(rng, (D, N, H)), _normal(rng, (N, H)), _normal(rng, (N, H))
    qp, kp = POSITIONS[positions]
    out = _attend(TransformerXL(W_R, u, vb), q, k, v, qp, kp, causal, jit=causal)
    want = np.zeros(q.shape)
    for b in range(B):
        qb, kb = _rows(qp, b), _rows(kp, b)
        logits = ref.transformer_xl_logits(q[b], k[b], W_R, u, vb, qb, kb)
        mask = _causal(qb, kb)[None] if causal else np.ones(logits.shape, bool)
        want[b] = np.einsum("Nij,jNH->iNH", ref._softmax(logits, mask), np.asarray(v[b], np.float64))
    np.testing.assert_allclose(out, want, atol=2e-5)


def test_rel_shift_is_transformer_xl_pad_reshape_slice(rng):
    # Scores against the distance ladder S-1, ..., 0 for the last T of S consecutive keys,
    # shifted, equal the scores at distance (S - T + t) - s wherever the key is not in the future.
    q, W_R, vb = _normal(rng, (T, N, H)), _normal(rng, (12, N, H)), _normal(rng, (N, H))
    ladder = ref.sinusoid(np.arange(S - 1, -1, -1), 12, layout="half")  # [S, D]
    R = np.einsum("cD,DNH->NcH", ladder, np.asarray(W_R, np.float64))
    raw = np.einsum("iNH,NcH->Nic", np.asarray(q, np.float64) + np.asarray(vb, np.float64), R)  # [N, T, S]
    shifted = np.asarray(rel_shift(jnp.asarray(raw)))
    for t in range(T):
        for s in range(S - T + t + 1):
            dist = (S - T + t) - s
            want = np.einsum(
                "NH,NH->N",
                np.asarray(q[t], np.float64) + np.asarray(vb, np.float64),
                np.einsum("D,DNH->NH", ref.sinusoid(dist, 12, layout="half"), np.asarray(W_R, np.float64)),
            )
            np.testing.assert_allclose(shifted[:, t, s], want, atol=1e-5)
    with pytest.raises(ValueError, match="rel_shift needs T <= S"):
        rel_shift(jnp.zeros((4, 3)))


@pytest.mark.parametrize("first_row, rows", [(0, T), (2, 3)], ids=["all-rows", "a-block"])
def test_transformer_xl_ladder_shift_by_a_gather_is_rel_shift(rng, first_row, rows):
    """The fast form's shift (kernels: one gather for a block of query rows, a gather and a masked sum in its
    gradient) equals the paper's pad-reshape-slice :func:`rel_shift` on every key up to the query: values and
    gradients, and forward mode (the shift is linear: its tangent is the shifted tangent)."""
    from posenc_jax.functional.kernels.transformer_xl import shift_ladder_scores

    scores = _normal(rng, (B, N, T, S))
    block = lambda x: jax.lax.slice_in_dim(x, first_row, first_row + rows, axis=-2)
    seen = block(jnp.asarray(np.arange(S)[None, :] <= (S - T + np.arange(T))[:, None]))  # [rows, S]
    weights = _normal(rng, (B, N, rows, S))
    plain = lambda x: jnp.where(seen, block(rel_shift(x)), 0.0)
    fast = lambda x: jnp.where(seen, shift_ladder_scores(block(x), first_row, T), 0.0)
    np.testing.assert_array_equal(jax.jit(fast)(scores), plain(scores))
    want = jax.grad(lambda x: (plain(x) * weights).sum())(scores)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda x: (fast(x) * weights).sum()))(scores), want, atol=1e-6)
    tangent = jnp.asarray(np.random.default_rng(1).normal(size=scores.shape), jnp.float32)
    np.testing.assert_allclose(jax.jvp(fast, (scores,), (tangent,))[1], plain(tangent), atol=1e-6)  # it is linear


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20), (4, 4), (64, 1000)])
def test_t5_buckets_match_reference(bidirectional, num_buckets, max_distance):
    rel = np.arange(-3000, 3001)
    got = np.asarray(
        t5_relative_bucket(
            jnp.asarray(rel), bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
        )
    )
    want = ref.t5_relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    np.testing.assert_array_equal(got, want)
    assert got.min() >= 0 and got.max() == num_buckets - 1


@pytest.mark.parametrize("positions", POSITIONS, ids=list(POSITIONS))
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_t5_bias_matches_reference(rng, qkv, positions, causal):
    q, k, v = qkv
    table = _normal(rng, (16, N))
    qp, kp = POSITIONS[positions]
    enc = T5Bias(table, bidirectional=not causal, max_distance=20)
    out = _attend(enc, q, k, v, qp, kp, causal, jit=causal)
    extra = lambda b, qb, kb: ref.t5_bias(table, qb, kb, not causal, 20)
    np.testing.assert_allclose(out, _reference_attention(q, k, v, qp, kp, causal, extra), atol=2e-5)
    # Computed once and shared: the same result through SharedBias.
    context = AttentionContext(
        query_positions=jnp.asarray(qp), key_positions=jnp.asarray(kp), num_heads=N, causal=causal
    )
    shared = _attend(SharedBias(enc.bias(context)), q, k, v, qp, kp, causal, jit=False)
    np.testing.assert_allclose(shared, out, atol=1e-6)


@pytest.mark.parametrize("positions", POSITIONS, ids=list(POSITIONS))
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_clipped_bias_matches_seed_003(rng, qkv, positions, causal):
    q, k, v = qkv
    table = _normal(rng, (7, N))
    qp, kp = POSITIONS[positions]
    out = _attend(ClippedRelativeBias(table, 3), q, k, v, qp, kp, causal, jit=causal)
    extra = lambda b, qb, kb: ref.clipped_relative_bias(table, qb, kb, 3)
    np.testing.assert_allclose(out, _reference_attention(q, k, v, qp, kp, causal, extra), atol=2e-5)


def test_deberta_log_buckets_match_reference():
    rel = np.arange(-5000, 5001)
    for bucket_size, max_position in ((256, 512), (16, 64), (32, 1024)):
        got = np.asarray(deberta_log_bucket(jnp.asarray(rel), bucket_size=bucket_size, max_position=max_position))
        np.testing.assert_array_equal(got, ref.deberta_log_bucket_position(rel, bucket_size, max_position))
        np.testing.assert_array_equal(got, -got[::-1])  # odd: p2c may reuse c2p's slot


@pytest.mark.parametrize("positions", POSITIONS, ids=list(POSITIONS))
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("buckets", [0, 8], ids=["clipped", "log-buckets"])
def test_deberta_matches_reference(rng, qkv, positions, causal, buckets):
    q, k, v = qkv
    span = 4 if buckets == 0 else buckets
    pos_query, pos_key = _normal(rng, (2 * span, N, H)), _normal(rng, (2 * span, N, H))
    qp, kp = POSITIONS[positions]
    enc = DeBERTa(pos_query, pos_key, span, position_buckets=buckets, max_relative_positions=24)
    out = _attend(enc, q, k, v, qp, kp, causal, jit=causal)
    extra = lambda b, qb, kb: ref.deberta_c2p_p2c(q[b], k[b], pos_query, pos_key, qb, kb, span, buckets, 24)
    want = _reference_attention(q, k, v, qp, kp, causal, extra, scale=1 / np.sqrt(3 * H))
    np.testing.assert_allclose(out, want, atol=2e-5)


def test_grouped_query_heads_with_relative_terms(rng):
    q = _normal(rng, (1, T, 4, H))
    k, v = _normal(rng, (1, S, 2, H)), _normal(rng, (1, S, 2, H))
    qp, kp = jnp.arange(S - T, S), jnp.arange(S)
    encs = [
        DeBERTa(_normal(rng, (8, 4, H)), _normal(rng, (8, 4, H)), 4),
        TransformerXL(_normal(rng, (6, 4, H)), _normal(rng, (4, H)), _normal(rng, (4, H))),
        Shaw(2, _normal(rng, (5, H)), _normal(rng, (5, H))),
    ]
    for enc in encs:
        grouped = dot_product_attention(q, k, v, query_positions=qp, key_positions=kp, encodings=[enc])
        repeated = dot_product_attention(
            q, jnp.repeat(k, 2, 2), jnp.repeat(v, 2, 2), query_positions=qp, key_positions=kp, encodings=[enc]
        )
        np.testing.assert_allclose(grouped, repeated, atol=1e-5)


def test_bucket_relative_is_the_transpose_of_the_gather(rng):
    w = jnp.asarray(rng.random((2, 3, 37, 11)), jnp.float32)
    qp, kp = jnp.asarray(rng.integers(0, 30, (2, 37))), jnp.asarray(rng.integers(0, 30, (2, 11)))
    idx = clipped_relative_index(qp, kp, 4)
    want = np.zeros((2, 3, 37, 9))
    for b in range(2):
        for t in range(37):
            for s in range(11):
                want[b, :, t, int(idx[b, t, s])] += np.asarray(w[b, :, t, s])
    for block in (1 << 20, 40, 11):  # one block; several with an overlapping last block
        np.testing.assert_allclose(bucket_relative(w, idx, 9, block_elements=block), want, atol=1e-6)


def test_gradients_are_finite(rng, qkv):
    q, k, v = qkv
    qp, kp = jnp.asarray(POSITIONS["gaps"][0]), jnp.asarray(POSITIONS["gaps"][1])

    def loss(params):
        encs = [
            Shaw(2, params["pk"], params["pv"]),
            TransformerXL(params["wr"], params["u"], params["v"]),
            T5Bias(params["t5"], max_distance=16),
            ClippedRelativeBias(params["clip"], 3),
            DeBERTa(params["dq"], params["dk"], 4),
            SinusoidalRelative(),
        ]
        total = 0.0
        for enc in encs:
            out = dot_product_attention(q, k, v, query_positions=qp, key_positions=kp, encodings=[enc], causal=True)
            total = total + (out**2).sum()
        return total

    params = {
        "pk": _normal(rng, (5, H)),
        "pv": _normal(rng, (5, H)),
        "wr": _normal(rng, (6, N, H)),
        "u": _normal(rng, (N, H)),
        "v": _normal(rng, (N, H)),
        "t5": _normal(rng, (8, N)),
        "clip": _normal(rng, (7, N)),
        "dq": _normal(rng, (8, N, H)),
        "dk": _normal(rng, (8, N, H)),
    }
    grads = jax.jit(jax.grad(loss))(params)
    for name, g in grads.items():
        assert np.isfinite(g).all(), name
        assert np.abs(np.asarray(g)).sum() > 0, name


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="max_distance must be an integer >= 1.*got 0"):
        Shaw(0, jnp.zeros((1, 8)))
    with pytest.raises(ValueError, match="key table has 5 relative rows but max_distance=3 needs 2\\*3\\+1 = 7"):
        Shaw(3, jnp.zeros((5, 8)))
    with pytest.raises(ValueError, match="table has 6 rows but max_distance=2 needs 2\\*2\\+1 = 5"):
        ClippedRelativeBias(jnp.zeros((6, 2)), 2)
    with pytest.raises(ValueError, match="max_distance must be an integer >= 1.*got -1"):
        ClippedRelativeBias(jnp.zeros((6, 2)), -1)
    with pytest.raises(ValueError, match="num_buckets must be an integer >= 2, got 1"):
        T5Bias(jnp.zeros((1, 2)), bidirectional=False)
    with pytest.raises(ValueError, match="max_distance must be an integer >= num_buckets=32.*got 16"):
        T5Bias(jnp.zeros((32, 2)), max_distance=16)
    with pytest.raises(ValueError, match="pos_query must have shape \\[2\\*span=8, N=2, H=8\\]"):
        dot_product_attention(
            jnp.ones((1, 3, 2, 8)),
            jnp.ones((1, 3, 2, 8)),
            jnp.ones((1, 3, 2, 8)),
            query_positions=jnp.arange(3),
            key_positions=jnp.arange(3),
            encodings=[DeBERTa(jnp.zeros((6, 2, 8)), jnp.zeros((8, 2, 8)), 4)],
        )
    with pytest.raises(ValueError, match="position_projection W_R must have shape \\[D, N=2, H=8\\]"):
        dot_product_attention(
            jnp.ones((1, 3, 2, 8)),
            jnp.ones((1, 3, 2, 8)),
            jnp.ones((1, 3, 2, 8)),
            query_positions=jnp.arange(3),
            key_positions=jnp.arange(3),
            encodings=[TransformerXL(jnp.zeros((6, 2, 4)), jnp.zeros((2, 8)), jnp.zeros((2, 8)))],
        )
    with pytest.raises(ValueError, match="Shaw needs a key_table, a value_table or both"):
        Shaw(2)


def test_blockwise_paths_equal_one_block(rng):
    # Long rows are processed in blocks of query rows (with an overlapping last block);
    # force several blocks and compare with a single one.
    q, k = _normal(rng, (2, 23, N, H)), _normal(rng, (2, 19, N, H))
    qp, kp = jnp.asarray(rng.integers(0, 60, (2, 23))), jnp.asarray(rng.integers(0, 60, (2, 19)))
    r = _normal(rng, (8, N, H))
    one = deberta_logits(q, k, qp, kp, pos_query=r, pos_key=r, span=4)
    for block in (N * 19 * 5, N * 19):
        np.testing.assert_allclose(
            deberta_logits(q, k, qp, kp, pos_query=r, pos_key=r, span=4, block_elements=block), one, atol=1e-6
        )
    w = jax.nn.softmax(_normal(rng, (2, N, 23, 19)), axis=-1)
    table = _normal(rng, (7, H))
    one = shaw_value_term(w, table, qp, kp, max_distance=3)
    np.testing.assert_allclose(
        shaw_value_term(w, table, qp, kp, max_distance=3, block_elements=19 * 2 * N * 3), one, atol=1e-6
    )


def test_by_query_blocks_places_every_block_at_its_start():

    def block(start, rows):  # values that depend on where the block starts
        return (start + jnp.arange(rows, dtype=jnp.float32)).reshape(1, 1, rows, 1)

    for q_len, budget in ((10, 4), (10, 3), (7, 7), (9, 1)):
        out = by_query_blocks(block, (1, 1, q_len, 1), jnp.float32, block_elements=budget)
        np.testing.assert_array_equal(out[0, 0, :, 0], np.arange(q_len))


def test_by_query_blocks_into_adds_every_row_exactly_once():
    def block(start, rows):  # [1, 2, rows, 3]: broadcast over the batch of two
        r = start + jnp.arange(rows, dtype=jnp.float32)
        return (r[:, None] * 10.0 + jnp.arange(3.0)[None, :]).reshape(1, 1, rows, 3) * jnp.array([1.0, -1.0]).reshape(
            1, 2, 1, 1
        )

    into = jnp.asarray(np.random.default_rng(0).normal(size=(2, 2, 10, 3)), jnp.float32)
    whole = block(0, 10)
    for budget in (4 * 2 * 2 * 3, 3 * 2 * 2 * 3, 7 * 2 * 2 * 3, 1, 10**6):  # 4, 3, 7, 1 rows (a shifted last block)
        out = jax.jit(
            lambda x, budget=budget: by_query_blocks(block, x.shape, jnp.float32, block_elements=budget, into=x)
        )(into)
        np.testing.assert_allclose(out, into + whole, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="expected"):
        by_query_blocks(block, (2, 2, 9, 3), jnp.float32, into=into)


def test_by_query_blocks_reads_into_gives_each_block_its_own_rows():
    """With reads_into, a block that reads its rows of ``into`` (a term made from the scores, as CoPE's
    gates are) gives the same as computing it from the whole of ``into`` first: every fresh row is read
    before anything is added to it, whatever the block size (a shifted last block included)."""

    into = jnp.asarray(np.random.default_rng(1).normal(size=(2, 2, 10, 3)), jnp.float32)
    term = lambda x: jnp.tanh(x) * 3.0 + x[..., :1]  # depends on the rows' values, not on the offset
    for budget in (4 * 2 * 2 * 3, 3 * 2 * 2 * 3, 7 * 2 * 2 * 3, 1, 10**6):
        got = jax.jit(
            lambda x, budget=budget: by_query_blocks(
                lambda start, rows, current: term(current),
                x.shape,
                jnp.float32,
                block_elements=budget,
                into=x,
                reads_into=True,
            )
        )(into)
        np.testing.assert_allclose(got, into + term(into), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="pass into"):
        by_query_blocks(lambda start, rows, current: 0.0, (2, 2, 10, 3), jnp.float32, reads_into=True)


@pytest.mark.parametrize("q_len", [1, 7, 12])
def test_by_causal_prefix_blocks_adds_the_causal_term_over_each_stage_prefix(q_len):
    """Each stage's blocks see the keys up to the stage's last row only; a causal term (nothing after the
    query) then comes out as over all keys: for 1 to 5 stages, blocks of one row to a whole stage (the
    last block of a stage shifted back), each row read before its term is added."""
    from posenc_jax.functional.core.relative import by_causal_prefix_blocks

    into = jnp.asarray(np.random.default_rng(q_len).normal(size=(2, 3, q_len, q_len)), jnp.float32)
    causal = np.tril(np.ones((q_len, q_len), bool))
    want = into + jnp.where(causal, jnp.tanh(into) * 2.0 + 1.0, 0.0)
    widths = []

    def block(start, rows, width, current):
        widths.append(width)
        query = start + jnp.arange(rows)[:, None]
        return jnp.where(jnp.arange(width)[None, :] <= query, jnp.tanh(current) * 2.0 + 1.0, 0.0)

    for stages in (1, 2, 3, 4, 5):
        for budget in (1, 2 * 3 * 5, 10**6):
            widths.clear()
            got = jax.jit(
                lambda x, stages=stages, budget=budget: by_causal_prefix_blocks(
                    block, x, stages=stages, block_elements=budget
                )
            )(into)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            assert max(widths) == q_len and (min(widths) < q_len or stages == 1 or q_len == 1)
    # Checked at run time: where the prefixes hold every key (True) the same; where not (False), every
    # block over all keys, so a term on keys after the query is added too.
    everywhere = lambda start, rows, width, current: jnp.tanh(current) * 2.0 + 1.0
    for budget in (1, 2 * 3 * 5, 10**6):
        for ok in (True, False):
            got = jax.jit(
                lambda x, ok, budget=budget: by_causal_prefix_blocks(block, x, block_elements=budget, prefix_ok=ok)
            )(into, jnp.asarray(ok))
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            got = jax.jit(
                lambda x, ok, budget=budget: by_causal_prefix_blocks(everywhere, x, block_elements=budget, prefix_ok=ok)
            )(into, jnp.asarray(ok))
            full = into + jnp.tanh(into) * 2.0 + 1.0
            if not ok:
                np.testing.assert_allclose(got, full, rtol=1e-6, atol=1e-6)
            elif q_len > 1:
                assert np.abs(np.asarray(got - full)).max() > 0.1  # the prefixes leave later keys alone
    with pytest.raises(ValueError, match="T = 3 and S = 4 must be equal"):
        by_causal_prefix_blocks(block, jnp.zeros((1, 1, 3, 4)))


def test_deberta_slots_saturate_where_claimed():
    from posenc_jax.functional.encodings.deberta import _saturation_distance

    for span, buckets, max_pos in (
        (4, 0, 512),
        (256, 256, 512),
        (8, 8, 24),
        (4, 4, 4096),
        (32, 32, 1024),
        (16, 16, 17),
    ):
        reach = _saturation_distance(span, buckets, max_pos)
        assert reach <= max(max_pos, span) + 1
        rel = np.arange(-3 * reach - 100, 3 * reach + 101)
        bucketed = ref.deberta_log_bucket_position(rel, buckets, max_pos) if buckets else rel
        slot = np.clip(bucketed + span, 0, 2 * span - 1)
        assert np.all(slot[rel >= reach] == 2 * span - 1) and np.all(slot[rel <= -reach] == 0)
    with pytest.raises(ValueError, match="span=300 != position_buckets=256"):
        DeBERTa(jnp.zeros((600, 1, 4)), jnp.zeros((600, 1, 4)), 300, position_buckets=256)


def test_explicit_scale_reaches_terms_that_share_it(rng, qkv):
    q, k, v = qkv
    qp, kp = POSITIONS["arange"]
    table = _normal(rng, (5, H))
    for enc in (Shaw(2, table, None), SinusoidalRelative()):
        scaled = dot_product_attention(
            q, k, v, query_positions=jnp.asarray(qp), key_positions=jnp.asarray(kp), encodings=[enc], scale=0.1
        )
        explicit = dot_product_attention(
            q,
            k,
            v,
            query_positions=jnp.asarray(qp),
            key_positions=jnp.asarray(kp),
            encodings=[dataclasses.replace(enc, scale=0.1)],
            scale=0.1,
        )
        np.testing.assert_allclose(scaled, explicit, atol=1e-6)
        default = dot_product_attention(
            q, k, v, query_positions=jnp.asarray(qp), key_positions=jnp.asarray(kp), encodings=[enc]
        )
        assert np.abs(np.asarray(scaled) - np.asarray(default)).max() > 1e-3


def _gather_gradient(per_distance, query_positions, key_positions, k, cotangent):
    """The plain autodiff gradient of the table lookup (the scatter), the reference for the custom VJP."""

    def lookup(p):
        index = clipped_relative_index(query_positions, key_positions, k)
        return jnp.moveaxis(jnp.take(p, index, axis=1, mode="clip"), 0, 1)

    return jax.vjp(lookup, per_distance)[1](cotangent)[0]


@pytest.mark.parametrize(
    "query_positions, key_positions",
    [
        (np.arange(9), np.arange(9)),  # self-attention
        (np.arange(4) + 1000, np.arange(11) + 993),  # offsets, T != S
        (np.array([[0, 1, 2, 3], [50, 51, 52, 53]]), np.array([[0, 1, 2, 3, 4, 5], [40, 41, 42, 43, 44, 45]])),
        (np.array([2**31 - 4, 2**31 - 3, 2**31 - 2]), np.arange(-(2**31), -(2**31) + 5)),  # distances past int32
        (np.array([0, 3, 4, 9]), np.arange(10)),  # gapped: the scatter path
        (np.array([[0, 1, 2, 3], [5, 5, 6, 7]]), np.arange(6)),  # one row not a run: the scatter path
    ],
    ids=["self", "offsets", "batched-runs", "int32-limits", "gaps", "repeat"],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_table_gradient_equals_plain_autodiff(rng, query_positions, key_positions, jit):
    k = 3
    per_distance = jnp.asarray(rng.normal(size=(2, 2 * k + 1)), jnp.float32)
    qp, kp = jnp.asarray(query_positions, jnp.int32), jnp.asarray(key_positions, jnp.int32)
    shape = expand_relative_bias(per_distance, qp, kp, k).shape
    cotangent = jnp.asarray(rng.normal(size=shape), jnp.float32)
    grad_fn = jax.grad(lambda p, qp, kp: (expand_relative_bias(p, qp, kp, k) * cotangent).sum())
    got = (jax.jit(grad_fn) if jit else grad_fn)(per_distance, qp, kp)
    want = _gather_gradient(per_distance, batched_positions(qp), batched_positions(kp), k, cotangent)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(want)).max() > 0.1  # a gradient that can be wrong


def test_table_gradient_under_vmap_and_in_a_model_loss(rng):
    k = 4
    per_distance = jnp.asarray(rng.normal(size=(3, 2 * k + 1)), jnp.float32)
    positions = jnp.asarray(np.arange(24).reshape(3, 8) + np.array([[0], [7], [100]]), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(3, 3, 8, 8)), jnp.float32)

    def loss(p, pos, w):
        return (jnp.tanh(expand_relative_bias(p, pos, pos, k)) * w).sum()

    per_row = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(per_distance, positions, weights[:, None])
    for row in range(3):
        row_positions, row_weights = positions[row : row + 1], weights[row][None]
        plain = jax.grad(lambda p, pos, w: (jnp.tanh(_expand_plain(p, pos, k)) * w).sum())
        np.testing.assert_allclose(per_row[row], plain(per_distance, row_positions, row_weights), rtol=1e-5, atol=1e-5)


def _expand_plain(per_distance, positions, k):
    index = clipped_relative_index(positions, positions, k)
    return jnp.moveaxis(jnp.take(per_distance, index, axis=1, mode="clip"), 0, 1)


def test_diagonal_sums_match_numpy(rng):
    x = rng.normal(size=(2, 5, 8))
    got = np.asarray(diagonal_sums(jnp.asarray(x, jnp.float32)))
    want = np.stack([[np.trace(row, offset=c - 4) for c in range(12)] for row in x])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_toeplitz_lays_out_diagonals_and_is_the_transpose_of_their_sums(rng):
    diagonals = jnp.asarray(rng.normal(size=(2, 3, 11)), jnp.float32)  # T + S - 1 = 4 + 8 - 1
    matrix = np.asarray(toeplitz(diagonals, 4, 8))
    for t in range(4):
        for s in range(8):
            np.testing.assert_array_equal(matrix[..., t, s], np.asarray(diagonals)[..., s - t + 3])
    x = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)
    np.testing.assert_allclose(jnp.vdot(toeplitz(diagonals, 4, 8), x), jnp.vdot(diagonals, diagonal_sums(x)), rtol=1e-5)


@pytest.mark.parametrize(
    "query_positions, key_positions",
    [(np.arange(4) + 1000, np.arange(11) + 993), (np.array([0, 3, 4, 9]), np.arange(10))],
    ids=["runs", "gaps"],
)
def test_table_forward_mode_equals_plain_autodiff(rng, query_positions, key_positions):
    """jax.jvp through the expansion, with no context manager, and its transpose is reverse mode."""
    k = 3
    per_distance = jnp.asarray(rng.normal(size=(2, 2 * k + 1)), jnp.float32)
    tangent = jnp.asarray(rng.normal(size=per_distance.shape), jnp.float32)
    qp, kp = jnp.asarray(query_positions, jnp.int32), jnp.asarray(key_positions, jnp.int32)
    ours = jax.jvp(lambda p: jnp.sin(expand_relative_bias(p, qp, kp, k)), (per_distance,), (tangent,))
    plain = jax.jvp(
        lambda p: jnp.sin(_gather_expand(p, batched_positions(qp), batched_positions(kp), k)),
        (per_distance,),
        (tangent,),
    )
    for a, b in zip(ours, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Under vmap (seeds trained together): the tangent of a linear map is the map of the tangent.
    batched = jax.vmap(lambda p: jax.jvp(lambda p: expand_relative_bias(p, qp, kp, k), (p,), (tangent,))[1])(
        jnp.stack([per_distance, 2 * per_distance])
    )
    want = _gather_expand(tangent, batched_positions(qp), batched_positions(kp), k)
    np.testing.assert_allclose(batched, jnp.stack([want, want]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positions", POSITIONS, ids=list(POSITIONS))
def test_toeplitz_where_runs_equals_the_bias_pair_by_pair(rng, positions):
    """Values, reverse-mode and forward-mode gradients of the tile form equal the plain bias's, on runs and gaps."""
    qp, kp = (batched_positions(jnp.asarray(p, jnp.int32)) for p in POSITIONS[positions])
    weights = jnp.asarray(rng.normal(size=(qp.shape[0], N, T, S)), jnp.float32)
    slope = jnp.asarray(rng.uniform(0.5, 2.0, size=(N,)), jnp.float32)

    def per_distance(slope, distance):  # [B|1, D] -> [B|1, N, D], nonlinear in the distance
        return -slope[None, :, None] * jnp.log1p(jnp.abs(distance)[:, None]) ** 1.5

    def plain(slope):
        return per_distance(slope, relative_positions(qp, kp, dtype=jnp.float32).reshape(qp.shape[0], -1)).reshape(
            qp.shape[0], N, T, S
        )

    def tile(slope):
        return toeplitz_where_runs(lambda d: per_distance(slope, d), lambda: plain(slope), qp, kp)

    loss = lambda f: lambda slope: jnp.sum(jnp.sin(f(slope)) * weights)
    np.testing.assert_allclose(jax.jit(tile)(slope), plain(slope), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(loss(tile)))(slope), jax.grad(loss(plain))(slope), rtol=1e-5, atol=1e-5)
    tangent = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    for a, b in zip(jax.jvp(tile, (slope,), (tangent,)), jax.jvp(plain, (slope,), (tangent,)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _gather_expand(per_distance, query_positions, key_positions, k):
    index = clipped_relative_index(query_positions, key_positions, k)
    return jnp.moveaxis(jnp.take(per_distance, index, axis=1, mode="clip"), 0, 1)


@pytest.mark.parametrize(
    "query_positions, key_positions",
    [
        (np.arange(2, 7), np.arange(7)),
        (np.arange(5) + 300, np.arange(5) + 300),
        (np.array([0, 1, 4, 5, 6]), np.arange(7)),
    ],
    ids=["last-keys", "self-offset", "gaps"],
)
def test_transformer_xl_causal_ladder_equals_the_identity_with_gradients(rng, query_positions, key_positions):
    # Causal attention with queries the last T of S consecutive keys takes the paper's ladder and shift;
    # other positions the sinusoid identity. On the keys a query sees, values and gradients agree.
    q = jnp.asarray(rng.normal(size=(2, 5, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, len(key_positions), N, H)), jnp.float32)
    params = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((12, N, H), (N, H), (N, H))]
    qp, kp = jnp.asarray(query_positions), jnp.asarray(key_positions)
    seen = jnp.asarray(key_positions[None, :] <= query_positions[:, None])
    weights = jnp.asarray(rng.normal(size=(2, N, 5, len(key_positions))), jnp.float32)

    def loss(q, k, w_r, u, v, causal):
        logits = transformer_xl_logits(
            q, k, qp, kp, position_projection=w_r, content_bias=u, position_bias=v, causal=causal
        )
        return (jnp.where(seen, logits, 0.0) * weights).sum()

    for causal_grad, identity_grad in zip(
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), static_argnums=5)(q, k, *params, True),
        jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, *params, False),
        strict=True,
    ):
        np.testing.assert_allclose(causal_grad, identity_grad, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(loss(q, k, *params, True), loss(q, k, *params, False), rtol=1e-5)


_EMPTY = -1  # an empty cache slot: position 0, masked


def _slots(*rows):
    """Key positions ``[B, S]`` and the key mask of cache slots (``_EMPTY``: position 0, masked)."""
    positions = np.array(rows)
    return jnp.asarray(np.where(positions == _EMPTY, 0, positions)), jnp.asarray(positions != _EMPTY)


@pytest.mark.parametrize(
    "query_positions, key_slots, table_length, by_table",
    [
        ([[9], [9]], _slots(list(range(10)), list(range(10))), 16, True),  # a decoding step
        ([[4], [2]], _slots([0, 1, 2, 3, 4, _EMPTY], [_EMPTY, _EMPTY, 0, 1, 2, _EMPTY]), 6, True),  # left padding
        ([[1005], [1003]], _slots([1000, 1001, 1002, 1003, 1004, 1005, _EMPTY], [1000] * 4 + [_EMPTY] * 3), 7, True),
        ([[30], [30]], _slots([0, 5, 10, 15, 20, 25, 30], list(range(24, 31))), 8, False),  # a gap: 30 > 7
        ([[5], [5]], _slots(list(range(6)), [0, 1, 2, 3, 4, 5]), 5, False),  # distance 5 not in a 5-row table
    ],
    ids=["decode", "left-padded", "offset-empty-slots", "gaps", "table-too-short"],
)
def test_transformer_xl_distance_table_equals_the_identity(rng, query_positions, key_slots, table_length, by_table):
    """A KV cache's table of ``W_R R_d`` (d = 0 .. L-1): the same term as the sinusoid identity on
    every key the mask lets through; keys at distances outside the table, unless masked, take
    the identity. Which way was taken shows by corrupting the table: only the table way moves."""
    key_positions, key_mask = key_slots
    qp = jnp.asarray(query_positions)
    q = _normal(rng, (2, 1, N, H))
    k = _normal(rng, (2, key_positions.shape[1], N, H))
    w_r, u, v = (_normal(rng, shape) for shape in ((12, N, H), (N, H), (N, H)))
    mask = (key_mask[:, None, :] & (key_positions[:, None, :] <= qp[:, :, None]))[:, None]  # [B, 1, 1, S]
    kw = dict(content_bias=u, position_bias=v, causal=True)
    table = project_distances(jnp.arange(table_length), w_r)

    def logits(q, w_r, **extra):
        return transformer_xl_logits(q, k, qp, key_positions, position_projection=w_r, **kw, **extra)

    shape = jax.eval_shape(lambda: logits(q, w_r)).shape
    seen = np.broadcast_to(np.asarray(mask), shape)
    weights = jnp.where(jnp.asarray(seen), _normal(rng, shape), 0.0)
    tangent = _normal(rng, q.shape)
    # Per-key features as a cache stores them (no sinusoids).
    features = TransformerXL(w_r, u, v).key_features(k, key_positions)
    assert set(features) == {"content"}

    @jax.jit  # every comparison in one compiled program
    def run(q, w_r, table):
        loss = lambda q, w_r, table: (logits(q, w_r, distance_table=table, mask=mask) * weights).sum()
        plain = lambda q, w_r: (logits(q, w_r) * weights).sum()
        by_table = lambda q, w_r: loss(q, w_r, project_distances(jnp.arange(table_length), w_r))
        return dict(
            want=logits(q, w_r),
            step=logits(q, w_r, distance_table=table, mask=mask),
            corrupted=logits(q, w_r, distance_table=table + 1.0, mask=mask),
            cached=logits(q, w_r, key_features=features, distance_table=table, mask=mask),
            got_grads=jax.grad(by_table, argnums=(0, 1))(q, w_r),
            want_grads=jax.grad(plain, argnums=(0, 1))(q, w_r),
            got_tangent=jax.jvp(lambda q: loss(q, w_r, table), (q,), (tangent,))[1],  # forward mode
            want_tangent=jax.jvp(lambda q: plain(q, w_r), (q,), (tangent,))[1],
        )

    out = {name: jax.tree.map(np.asarray, value) for name, value in run(q, w_r, table).items()}
    want = out["want"]
    np.testing.assert_allclose(out["step"][seen], want[seen], rtol=1e-5, atol=1e-5)
    # Which way was taken shows by corrupting the table: only the table way moves.
    assert (np.abs(out["corrupted"] - want)[seen].max() > 0.1) == by_table
    np.testing.assert_allclose(out["cached"][seen], want[seen], rtol=1e-5, atol=1e-5)
    # Derivatives, reverse and forward mode, through whichever way was taken (the choice is a loop of one
    # pass or none, whose derivatives are the conditional's): as the identity's, on the keys seen.
    for got, expected in zip(out["got_grads"], out["want_grads"], strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["got_tangent"], out["want_tangent"], rtol=1e-4, atol=1e-4)


@pytest.mark.long
def test_transformer_xl_decoding_choice_differentiates_under_vmap(rng):
    """The gradient of a batch of decoding steps (``vmap``), one inside the table and one outside it (a
    batched choice): as the identity's. (A conditional in the choice's derivative rule could not be
    transposed here.)"""
    q, k = _normal(rng, (1, 1, N, H)), _normal(rng, (1, 5, N, H))
    w_r, u, v = (_normal(rng, shape) for shape in ((12, N, H), (N, H), (N, H)))
    features = TransformerXL(w_r, u, v).key_features(k, None)
    kw = dict(content_bias=u, position_bias=v, causal=True)

    def step(w_r, qp, table):
        extra = {} if table is None else dict(key_features=features, distance_table=table)
        return transformer_xl_logits(q, k, qp, jnp.arange(5), position_projection=w_r, **kw, **extra).sum()

    steps = jnp.asarray([[4], [40]])  # distance 40 is past the 8-row table

    @jax.jit  # both gradients in one program
    def gradients(w_r):
        got = jax.grad(
            lambda w_r: jax.vmap(step, (None, 0, None))(w_r, steps, project_distances(jnp.arange(8), w_r)).sum()
        )(w_r)
        return got, jax.grad(lambda w_r: jax.vmap(step, (None, 0, None))(w_r, steps, None).sum())(w_r)

    got, want = gradients(w_r)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cpu_forms", [True, False], ids=["cpu-form", "plain-form"])
def test_transformer_xl_decoding_choice_gives_the_identitys_logits_in_every_backends_form(rng, cpu_forms, monkeypatch):
    """The table-or-identity choice of a decoding step (on the CPU a loop of one pass or none, on the other
    backends a conditional): a step inside the cache's table and one past it give the identity's logits."""
    monkeypatch.setattr(operations, "current_backend", lambda: "cpu" if cpu_forms else "gpu")
    q, k = _normal(rng, (2, 1, N, H)), _normal(rng, (2, 9, N, H))
    w_r, u, v = (_normal(rng, shape) for shape in ((12, N, H), (N, H), (N, H)))
    kw = dict(position_projection=w_r, content_bias=u, position_bias=v, causal=True)
    features = TransformerXL(w_r, u, v).key_features(k, None)  # as a cache stores them
    table = project_distances(jnp.arange(16), w_r)

    def step(qp, table):  # a new function each time: traced with this backend's form
        extra = {} if table is None else dict(key_features=features, distance_table=table)
        return transformer_xl_logits(q, k, qp, jnp.arange(9), **kw, **extra)

    for query_position in (8, 40):  # distance 40 - 8 = 32 is past the 16-row table: the identity
        qp = jnp.full((2, 1), query_position)
        got = jax.jit(step)(qp, table)
        np.testing.assert_allclose(got, step(qp, None), rtol=1e-5, atol=1e-5)


def test_transformer_xl_distance_table_refuses_a_wrong_shape(rng):
    q, k = _normal(rng, (1, 1, N, H)), _normal(rng, (1, 3, N, H))
    w_r, u, v = (_normal(rng, shape) for shape in ((12, N, H), (N, H), (N, H)))
    with pytest.raises(ValueError, match=r"distance_table must have shape \[L, N=2"):
        transformer_xl_logits(
            q,
            k,
            jnp.array([2]),
            jnp.arange(3),
            position_projection=w_r,
            content_bias=u,
            position_bias=v,
            distance_table=jnp.zeros((5, N + 1, H)),
        )


def test_functional_relative_joined_to_the_content_product_stores_no_term():
    """Joined to q and k as features, the functional relative term costs causal attention no temporary memory
    beyond plain attention's, where the term computed and added keeps a [B, N, T, S] buffer (the check can
    fail). Decoding one query adds the term: no key is copied with features, as a joined product would need
    (shown by a product over keys widened by as many features as they have)."""
    from posenc_jax.functional import SinusoidalRelative, dot_product_attention

    hook = SinusoidalRelative()
    length = 256  # > H + F: joined
    plain, buffer = causal_attention_temp(list, length), score_buffer_bytes(length)
    assert causal_attention_temp(lambda: [hook], length) - plain < buffer / 4
    assert causal_attention_temp(lambda: [TermOnly(hook)], length) - plain >= buffer / 2

    batch, keys, kv_heads, head_dim = 2, 2048, 2, 8
    key = jax.ShapeDtypeStruct((batch, keys, kv_heads, head_dim), jnp.float32)
    query = jax.ShapeDtypeStruct((batch, 1, 4, head_dim), jnp.float32)
    kp = jnp.arange(keys) * 3

    def temp(encoding, widen=lambda x: x):
        def step(q, k, v):
            return dot_product_attention(
                widen(q), widen(k), v, query_positions=kp[-1:], key_positions=kp, encodings=[encoding]
            )

        return compiled(jax.jit(step).lower(query, key, key)).memory_analysis().temp_size_in_bytes

    added = temp(TermOnly(hook))
    key_bytes = batch * keys * kv_heads * head_dim * 4
    assert temp(hook) - added < key_bytes / 4
    copied = temp(TermOnly(hook), widen=lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=-1))
    assert copied - added >= key_bytes


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_functional_relative_joined_to_the_content_product_equals_its_term_added(scale, kv_heads):
    """Float32 attention appends the functional relative term's features to q and k (one
    contraction); the same values and gradients as the term computed and added."""
    from posenc_jax.functional import SinusoidalRelative, dot_product_attention

    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(2, 20, 4, 8)), jnp.float32)  # T = 20 > H + F = 16: joined
    k, v = (jnp.asarray(rng.normal(size=(2, 22, kv_heads, 8)), jnp.float32) for _ in range(2))
    qp, kp = jnp.arange(2, 22) * 3, jnp.arange(22) * 3
    hook = SinusoidalRelative(scale=scale)

    def attend(q, k, v, joined):
        out = dot_product_attention(
            q, k, v, query_positions=qp, key_positions=kp, encodings=[hook if joined else TermOnly(hook)], causal=True
        )
        return (out * jnp.sin(out)).sum(), out

    grad = jax.jit(jax.grad(attend, argnums=(0, 1, 2), has_aux=True), static_argnums=3)

    @functools.partial(jax.jit, static_argnums=1)
    def decode(q, joined):  # one query against the keys
        encodings = [hook if joined else TermOnly(hook)]
        return dot_product_attention(q, k, v, query_positions=qp[-1:], key_positions=kp, encodings=encodings)

    step = q[:, -1:]
    np.testing.assert_allclose(decode(step, True), decode(step, False), atol=2e-6)
    want_grads, want = grad(q, k, v, False)
    got_grads, got = grad(q, k, v, True)
    np.testing.assert_allclose(got, want, atol=2e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)
    attend_with = jax.jit(  # one program per call below, not one per operation
        lambda q, k, v, hook: dot_product_attention(
            q, k, v, query_positions=qp, key_positions=kp, encodings=[hook], causal=True
        )
    )
    # A KV cache's stored key sinusoids take the same path.
    out = attend_with(q, k, v, hook.with_key_features(hook.key_features(k, kp)))
    np.testing.assert_allclose(out, want, atol=2e-6)
    # bfloat16 keeps the term added (the features would be rounded to bfloat16 in the product).
    half = attend_with(*(x.astype(jnp.bfloat16) for x in (q, k, v)), hook)
    np.testing.assert_allclose(half.astype(jnp.float32), want, atol=0.1)


def test_functional_relative_term_is_not_a_buffer_of_its_own():
    from posenc_jax.functional import SinusoidalRelative

    one_buffer = score_buffer_bytes(1024)
    plain = causal_attention_temp(list, 1024)
    assert causal_attention_temp(lambda: [SinusoidalRelative()], 1024) - plain < one_buffer / 4
    # The term added: about one more buffer.
    assert causal_attention_temp(lambda: [TermOnly(SinusoidalRelative())], 1024) - plain >= 0.75 * one_buffer


@pytest.mark.parametrize(
    "query_positions, key_positions, causal",
    [
        (np.arange(2, 11), np.arange(11), True),
        (np.arange(9) + 300, np.arange(11) + 298, True),
        (np.array([0, 1, 4, 5, 6, 9, 12, 13, 14]), np.arange(11) * 2, True),
        (np.array([[2, 3, 4, 5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 6, 7, 8, 9]]), np.arange(11), True),
        (np.arange(2, 11), np.arange(11), False),
    ],
    ids=["ladder", "ladder-offset", "gaps", "batched-mixed", "bidirectional"],
)
def test_transformer_xl_terms_added_by_blocks_equal_the_term_added(rng, query_positions, key_positions, causal):
    """``into=``: the terms computed by blocks of query rows (five blocks of two rows, the last
    shifted back) and added into the scores; the same values and gradients as the whole term added."""
    q = _normal(rng, (2, 9, N, H))
    k = _normal(rng, (2, 11, N, H))
    scores = _normal(rng, (2, N, 9, 11))
    params = [_normal(rng, shape) for shape in ((12, N, H), (N, H), (N, H))]
    qp, kp = jnp.asarray(query_positions), jnp.asarray(key_positions)
    weights = _normal(rng, (2, N, 9, 11))

    def loss(scores, q, k, w_r, u, v, blocks):
        kw = dict(position_projection=w_r, content_bias=u, position_bias=v, causal=causal)
        if blocks:
            out = transformer_xl_logits(q, k, qp, kp, into=scores, block_elements=2 * N * 11 * 2, **kw)
        else:
            out = scores + transformer_xl_logits(q, k, qp, kp, **kw)
        return (jnp.sin(out) * weights).sum(), out

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True), static_argnums=6)
    want_grads, want = grad(scores, q, k, *params, False)
    got_grads, got = grad(scores, q, k, *params, True)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "positions, prefixes",
    [
        (np.arange(12), True),
        (np.array([[5 + t for t in range(12)], [100 + t for t in range(12)]]), True),
        (np.array([0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12]), False),  # a gap: the ladder does not hold
        (np.array([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]]), False),
    ],
    ids=["consecutive", "offsets", "gap", "repeated-in-one-row"],
)
def test_transformer_xl_causal_prefixes_equal_the_term_added(rng, positions, prefixes):
    """``into=`` a function making the scores: in causal self-attention with the ladder's positions, blocks
    of rows against the keys up to their last row (four stages here); otherwise every key by the identity.
    On the keys each query sees, values and gradients as with the whole term added."""
    q, k = _normal(rng, (2, 12, N, H)), _normal(rng, (2, 12, N, H))
    params = [_normal(rng, shape) for shape in ((12, N, H), (N, H), (N, H))]
    pos = jnp.asarray(positions)
    rows = np.broadcast_to(positions, (2, 12))
    seen = jnp.asarray(rows[:, None, :] <= rows[:, :, None])[:, None]  # [B, 1, T, S]
    weights = _normal(rng, (2, N, 12, 12))

    def loss(q, k, w_r, u, v, pos, prefix):
        kw = dict(position_projection=w_r, content_bias=u, position_bias=v, causal=True)
        content = lambda: jnp.einsum("BTNH,BSNH->BNTS", q, k) * 0.5
        if prefix:  # rows per block: 2 of 12 (N · 12 · 2 values), so more than one block
            out = transformer_xl_logits(q, k, pos, pos, into=content, block_elements=2 * N * 12 * 2, **kw)
        else:
            out = content() + transformer_xl_logits(q, k, pos, pos, **kw)
        return (jnp.where(seen, jnp.sin(out), 0.0) * weights).sum(), out

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(5)), has_aux=True), static_argnums=6)
    want_grads, want = grad(q, k, *params, pos, False)
    got_grads, got = grad(q, k, *params, pos, True)
    np.testing.assert_allclose(jnp.where(seen, got, 0.0), jnp.where(seen, want, 0.0), rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    # Which way was taken: the prefixes add nothing past a stage's keys (query 0 is in the first stage, of
    # keys 0 .. 2), the identity adds the term to every entry.
    content = jnp.einsum("BTNH,BSNH->BNTS", q, k) * 0.5
    untouched = np.asarray(got[:, :, 0, 3:] == content[:, :, 0, 3:])
    assert untouched.all() if prefixes else not untouched.any()


def test_transformer_xl_refuses_scores_of_the_wrong_shape(rng):
    q, k = _normal(rng, (2, 12, N, H)), _normal(rng, (2, 12, N, H))
    kw = dict(position_projection=_normal(rng, (12, N, H)), content_bias=_normal(rng, (N, H)), causal=True)
    pos = jnp.arange(12)
    with pytest.raises(
        ValueError, match=r"into must make scores \[B, N, T, S\] = \(2, 2, 12, 12\), got \(2, 1, 12, 12\)"
    ):
        transformer_xl_logits(
            q, k, pos, pos, position_bias=kw["content_bias"], into=lambda: jnp.zeros((2, 1, 12, 12)), **kw
        )


def test_transformer_xl_in_attention_by_blocks_equals_its_term_added():
    """Attention adds Transformer-XL's terms into the scores by blocks of rows (two blocks here, the
    last shifted back); values and gradients as with the whole term computed and added."""
    rng = np.random.default_rng(11)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 1000, 4, 16)), jnp.float32) for _ in range(3))
    params = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((32, 4, 16), (4, 16), (4, 16))]
    pos = jnp.arange(1000)

    def attend(q, k, v, params, blocks):
        hook = TransformerXL(*params)
        out = dot_product_attention(
            q,
            k,
            v,
            query_positions=pos,
            key_positions=pos,
            encodings=[hook if blocks else TermOnly(hook)],
            causal=True,
        )
        return (out * jnp.cos(out)).sum(), out

    assert 4 * 1000 * 1000 > 1 << 21  # more than one block of the default size
    grad = jax.jit(jax.grad(attend, argnums=(0, 1, 2, 3), has_aux=True), static_argnums=4)
    (want_q, want_k, want_v, want_p), want = grad(q, k, v, params, False)
    (got_q, got_k, got_v, got_p), got = grad(q, k, v, params, True)
    # The causal prefixes score each block against a shorter ladder: logits up to ~30 differ in the last
    # bits (both within 1e-5 of a float64 evaluation).
    np.testing.assert_allclose(got, want, atol=1e-5)
    for g, w in zip((got_q, got_k, got_v, *got_p), (want_q, want_k, want_v, *want_p), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_transformer_xl_term_is_not_a_buffer_of_its_own():
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((32, 4, 16), (4, 16), (4, 16))]
    one_buffer = score_buffer_bytes(1024)
    plain = causal_attention_temp(list, 1024)
    assert causal_attention_temp(lambda: [TransformerXL(*params)], 1024) - plain < one_buffer / 4
    # The term stored: one more buffer.
    assert causal_attention_temp(lambda: [TermOnly(TransformerXL(*params))], 1024) - plain >= 0.75 * one_buffer


_DISTANCE_POSITIONS = [
    (np.arange(9), np.arange(9)),  # self-attention
    (np.arange(4) + 1000, np.arange(11) + 993),  # offsets, T != S
    (np.array([[0, 1, 2, 3], [50, 51, 52, 53]]), np.array([[0, 1, 2, 3, 4, 5], [40, 41, 42, 43, 44, 45]])),
    (np.array([7]), np.arange(8)),  # one query against a cache: decoding
    (np.array([2**31 - 4, 2**31 - 3, 2**31 - 2]), np.arange(-(2**31), -(2**31) + 5)),  # distances past int32
    (np.array([0, 3, 4, 9]), np.arange(10)),  # gapped: the scatter path
    (np.array([[0, 1, 2, 3], [5, 5, 6, 7]]), np.arange(6)),  # one row not a run: the scatter path
]
_DISTANCE_IDS = ["self", "offsets", "batched-runs", "decoding", "int32-limits", "gaps", "repeat"]
_SLOT_MAPS = [
    (1, 3, 7, False),
    (-1, 0, 4, False),
    (-1, 4, 8, True),
    (1, 0, 2, False),
    (-1, 0, 1, True),
    (1, 2, 5, True),
    (-1, 0, 2, True),
]
_SLOT_MAP_IDS = ["shaw", "deberta-causal", "deberta-p2c", "two-slots", "one-slot", "key-side-plus", "key-two-slots"]


def _slot_one_hot(query_positions, key_positions, sign, offset, slots):
    """The slot of every (query, key) pair from the definition, in int64 numpy: one-hot ``[B|1, T, S, R]``."""
    qp = np.asarray(query_positions, np.int64).reshape(-1, np.shape(query_positions)[-1])
    kp = np.asarray(key_positions, np.int64).reshape(-1, np.shape(key_positions)[-1])
    slot = np.clip(sign * (kp[:, None, :] - qp[:, :, None]) + offset, 0, slots - 1)
    return jnp.asarray(np.arange(slots) == slot[..., None], jnp.float32)


def _reference_gather(x, one_hot, key_side):
    """``out[b,n,t,s] = x[b,n,t (or s),slot(t,s)]`` as a contraction with the one-hot slots."""
    return jnp.einsum("BNSR,BTSR->BNTS" if key_side else "BNTR,BTSR->BNTS", x, one_hot)


def _float64_one_hot(query_positions, key_positions, sign, offset, slots, batch):
    """``_slot_one_hot`` in float64 numpy, broadcast to ``batch`` rows: ``[batch, T, S, R]``."""
    one_hot = np.asarray(_slot_one_hot(query_positions, key_positions, sign, offset, slots), np.float64)
    return np.broadcast_to(one_hot, (batch, *one_hot.shape[1:]))


def _distance_cases(sign, offset, slots):
    """Each set of :data:`_DISTANCE_POSITIONS`: its id, its positions in int32 and its one-hot slots in
    float64, ``[B, T, S, R]`` with B the batch its positions broadcast to."""
    for name, (query_positions, key_positions) in zip(_DISTANCE_IDS, _DISTANCE_POSITIONS, strict=True):
        qp, kp = jnp.asarray(query_positions, jnp.int32), jnp.asarray(key_positions, jnp.int32)
        batch = max(batched_positions(qp).shape[0], batched_positions(kp).shape[0])
        yield name, qp, kp, _float64_one_hot(query_positions, key_positions, sign, offset, slots, batch)


@pytest.mark.parametrize(("sign", "offset", "slots", "key_side"), _SLOT_MAPS, ids=_SLOT_MAP_IDS)
def test_gather_by_distance_and_its_gradient_follow_the_definition(rng, sign, offset, slots, key_side):
    """Value, value beside its pullback, gradient, pullback and tangent, against the one-hot definition in
    float64, on every set of positions (:data:`_DISTANCE_POSITIONS`) in one compiled program."""
    cases = list(_distance_cases(sign, offset, slots))
    inputs = []
    for _, qp, kp, one_hot in cases:
        rows = kp.shape[-1] if key_side else qp.shape[-1]
        x, tangent = (np.asarray(rng.normal(size=(one_hot.shape[0], 2, rows, slots)), np.float32) for _ in range(2))
        cotangent = np.asarray(rng.normal(size=(one_hot.shape[0], 2, qp.shape[-1], kp.shape[-1])), np.float32)
        inputs.append((x, cotangent, tangent))

    @jax.jit
    def everything(inputs):  # the positions are constants of the program, as in a model's
        results = []
        for (_, qp, kp, _), (x, cotangent, tangent) in zip(cases, inputs, strict=True):
            gather = lambda x, qp=qp, kp=kp: gather_by_distance(x, qp, kp, sign=sign, offset=offset, key_side=key_side)
            with_grad, pullback = jax.vjp(gather, x)
            gradient = jax.grad(lambda x, gather=gather, c=cotangent: (gather(x) * c).sum())(x)
            results.append(
                (gather(x), with_grad, gradient, pullback(cotangent)[0], jax.jvp(gather, (x,), (tangent,))[1])
            )
        return results

    value_spec, gradient_spec = (
        ("BNSR,BTSR->BNTS", "BNTS,BTSR->BNSR") if key_side else ("BNTR,BTSR->BNTS", "BNTS,BTSR->BNTR")
    )
    for (name, _, _, one_hot), (x, cotangent, tangent), result in zip(cases, inputs, everything(inputs), strict=True):
        out, with_grad, gradient, pulled, forward = result
        # out[b,n,t,s] = x[b,n,t (or s),slot(t,s)]; its gradient sums the cotangent into each pair's slot.
        want = np.einsum(value_spec, x.astype(np.float64), one_hot)
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6, err_msg=name)
        # The value computed with the gradient comes from the forward rule (a flat gather): the same values.
        np.testing.assert_array_equal(with_grad, out, err_msg=name)
        plain = np.einsum(gradient_spec, cotangent.astype(np.float64), one_hot)
        assert np.abs(plain).max() > 0.1, name  # a gradient that can be wrong
        np.testing.assert_allclose(gradient, plain, rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(pulled, plain, rtol=1e-5, atol=1e-5, err_msg=name)
        # Forward mode: the gather of the tangent.
        want = np.einsum(value_spec, tangent.astype(np.float64), one_hot)
        np.testing.assert_allclose(forward, want, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(("sign", "offset", "slots"), [(1, 2, 5), (-1, 1, 3), (1, 0, 2), (-1, 0, 1)])
def test_sum_by_distance_and_its_gradient_follow_the_definition(rng, sign, offset, slots):
    """Value, gradient and tangent, against the one-hot definition in float64, on every set of positions
    (:data:`_DISTANCE_POSITIONS`) in one compiled program; weights the mask hides are NaN and must reach no
    slot and no gradient."""
    cases = list(_distance_cases(sign, offset, slots))
    weights, masks, inputs = [], [], []
    for _, qp, kp, one_hot in cases:
        shape = (one_hot.shape[0], 2, qp.shape[-1], kp.shape[-1])
        w, tangent = (np.asarray(rng.normal(size=shape), np.float32) for _ in range(2))
        mask = rng.random((1, 1, qp.shape[-1], kp.shape[-1])) < 0.7
        cotangent = np.asarray(rng.normal(size=(*shape[:-1], slots)), np.float32)
        weights.append(w)
        masks.append(mask)
        inputs.append((np.where(mask, w, np.nan).astype(np.float32), cotangent, tangent))

    @jax.jit
    def everything(inputs):  # the positions and masks are constants of the program
        results = []
        for (_, qp, kp, _), mask, (w, cotangent, tangent) in zip(cases, masks, inputs, strict=True):
            summed = lambda w, qp=qp, kp=kp, mask=mask: sum_by_distance(
                w, qp, kp, sign=sign, offset=offset, slots=slots, mask=jnp.asarray(mask)
            )
            gradient = jax.grad(lambda w, summed=summed, c=cotangent: (summed(w) * c).sum())(w)
            results.append((summed(w), gradient, jax.jvp(summed, (w,), (tangent,))[1]))
        return results

    for (name, _, _, one_hot), w, mask, (_, cotangent, tangent), (out, gradient, forward) in zip(
        cases, weights, masks, inputs, everything(inputs), strict=True
    ):
        reference = lambda w, mask=mask, one_hot=one_hot: np.einsum(
            "BNTS,BTSR->BNTR", np.where(mask, w.astype(np.float64), 0.0), one_hot
        )
        np.testing.assert_allclose(out, reference(w), rtol=1e-5, atol=1e-5, err_msg=name)
        plain = np.where(mask, np.einsum("BNTR,BTSR->BNTS", cotangent.astype(np.float64), one_hot), 0.0)
        assert np.abs(plain).max() > 0.1, name
        np.testing.assert_allclose(gradient, plain, rtol=1e-5, atol=1e-5, err_msg=name)
        # Forward mode: the sums of the tangent.
        np.testing.assert_allclose(forward, reference(tangent), rtol=1e-5, atol=1e-5, err_msg=name)


def test_distance_maps_differentiate_to_second_order_and_under_vmap(rng):
    """Hessians (forward over reverse) and the gradient of a vmapped call, through the gather by slot and
    the sum by slot (linear primitives, each the other's transpose), equal the one-hot definition's."""
    qp, kp = jnp.arange(3, 7), jnp.arange(8)
    one_hot = _slot_one_hot(qp, kp, 1, 2, 5)
    x = jnp.asarray(rng.normal(size=(2, 1, 4, 5)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(2, 1, 4, 8)), jnp.float32)
    ours = lambda x, w: (
        (jnp.sin(gather_by_distance(x, qp, kp, sign=1, offset=2)) * w).sum()
        + (jnp.cos(sum_by_distance(w, qp, kp, sign=1, offset=2, slots=5)) * x).sum()
    )
    plain = lambda x, w: (
        (jnp.sin(_reference_gather(x, one_hot, False)) * w).sum()
        + (jnp.cos(jnp.einsum("BNTS,BTSR->BNTR", w, one_hot)) * x).sum()
    )
    mapped = lambda f: jax.grad(lambda x: jax.vmap(f, in_axes=(0, None))(x, weights).sum())
    stacked = jnp.stack([x, 2 * x])

    @jax.jit  # ours and the definition, in one program
    def both(x, weights, stacked):
        return [
            (jax.hessian(f, argnums=0)(x, weights), jax.hessian(f, argnums=1)(x, weights), mapped(f)(stacked))
            for f in (ours, plain)
        ]

    (*got, got_mapped), (*want, want_mapped) = both(x, weights, stacked)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_mapped, want_mapped, rtol=1e-5, atol=1e-5)


def test_distance_gradients_map_over_a_batch_of_positions(rng):
    """vmap over per-example positions (one run, one gapped) gives the batched call's gradients."""
    qp = jnp.array([[3, 4, 5, 6], [0, 2, 3, 7]])
    kp = jnp.array([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]])
    x = jnp.asarray(rng.normal(size=(2, 2, 4, 5)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(2, 2, 4, 8)), jnp.float32)

    def loss(x, qp, kp, c):
        return (gather_by_distance(x, qp, kp, sign=1, offset=2) * c).sum()

    mapped = jax.jit(jax.vmap(jax.grad(loss)))(x[:, None], qp[:, None], kp[:, None], cotangent[:, None])[:, 0]
    np.testing.assert_allclose(mapped, jax.grad(loss)(x, qp, kp, cotangent), rtol=1e-6, atol=1e-6)
    one_hot = _slot_one_hot(qp, kp, 1, 2, 5)
    plain = jax.grad(lambda x: (_reference_gather(x, one_hot, False) * cotangent).sum())(x)
    np.testing.assert_allclose(mapped, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gapped", [False, True], ids=["runs", "scatter"])
def test_bfloat16_sums_accumulate_in_float32_on_both_paths(gapped):
    kp = jnp.arange(2048).at[5].set(4) if gapped else jnp.arange(2048)
    weights = jnp.ones((1, 1, 1, 2048), jnp.bfloat16)
    out = sum_by_distance(weights, jnp.array([0]), kp, sign=1, offset=1, slots=3)
    assert out.dtype == jnp.bfloat16
    # 2047 keys in the far slot: a bfloat16 accumulator would stop at 256.
    np.testing.assert_allclose(np.asarray(out[0, 0, 0], np.float32), [0.0, 1.0, 2048.0], rtol=1e-2)
    gradient = jax.grad(
        lambda x: gather_by_distance(x, jnp.array([0]), kp, sign=1, offset=1).astype(jnp.float32).sum()
    )(jnp.ones((1, 1, 1, 3), jnp.bfloat16))
    assert gradient.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gradient[0, 0, 0], np.float32), [0.0, 1.0, 2048.0], rtol=1e-2)


def test_distance_helpers_take_empty_sequences():
    pos = jnp.arange(4)
    empty = jnp.zeros((0,), jnp.int32)
    table = jnp.ones((1, 1, 0, 5))
    assert gather_by_distance(table, empty, pos, sign=1, offset=2).shape == (1, 1, 0, 4)
    grad = jax.grad(lambda x: gather_by_distance(x, pos[:3], empty, sign=1, offset=2).sum())(jnp.ones((1, 1, 3, 5)))
    np.testing.assert_array_equal(grad, 0.0)
    summed = sum_by_distance(jnp.ones((1, 1, 3, 0)), pos[:3], empty, sign=1, offset=2, slots=5)
    np.testing.assert_array_equal(summed, jnp.zeros((1, 1, 3, 5)))


def test_distance_slots_refuse_a_bad_slot_map():
    with pytest.raises(ValueError, match="sign must be 1 or -1"):
        distance_slots(jnp.arange(3), jnp.arange(3), sign=2, offset=0, slots=3)
    with pytest.raises(ValueError, match="sign must be 1 or -1"):
        distance_slots(jnp.arange(3), jnp.arange(3), sign=True, offset=0, slots=3)
    with pytest.raises(ValueError, match=r"offset .* in \[0, slots=3\), got 3"):
        distance_slots(jnp.arange(3), jnp.arange(3), sign=1, offset=3, slots=3)


@pytest.mark.parametrize("cpu_forms", [True, False], ids=["cpu-form", "plain-form"])
@pytest.mark.parametrize("transposed", [False, True])
def test_take_along_last_axis_matches_take_along_axis(transposed, cpu_forms, monkeypatch):
    """The flat gather equals ``take_along_axis`` with the index broadcast (over the heads, over the
    batch, and values shared by the batch), clips slots into [0, L) (a negative one reads slot 0) and reads
    a key-side table per (query, key) pair when transposed, in the CPU's form (one gather from the values
    laid out flat) and in the plain form the other backends run."""
    from posenc_jax.functional.core.relative import take_along_last_axis

    monkeypatch.setattr(operations, "current_backend", lambda: "cpu" if cpu_forms else "gpu")

    rng = np.random.default_rng(int(transposed))
    batch, heads, q_len, k_len, slots = 2, 3, 5, 4, 6
    rows = k_len if transposed else q_len
    values = jnp.asarray(rng.normal(size=(batch, heads, rows, slots)), jnp.float32)
    for index_batch, values_batch in ((batch, batch), (1, batch), (batch, 1)):
        table = values[:values_batch]
        index = jnp.asarray(rng.integers(-2, slots + 2, size=(index_batch, 1, q_len, k_len)), jnp.int32)
        got = jax.jit(lambda x, i: take_along_last_axis(x, i, transposed=transposed))(table, index)
        full = jnp.broadcast_to(jnp.clip(index, 0, slots - 1), (max(index_batch, values_batch), heads, q_len, k_len))
        source = jnp.broadcast_to(table, (full.shape[0],) + table.shape[1:])
        if transposed:
            want = jnp.take_along_axis(jnp.swapaxes(source, -1, -2), full, axis=-2, mode="clip")
        else:
            want = jnp.take_along_axis(source, full, axis=-1, mode="clip")
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="does not fit values"):
        take_along_last_axis(values, jnp.zeros((7, 1, q_len, k_len), jnp.int32), transposed=transposed)  # batch 7
