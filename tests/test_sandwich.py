"""Sandwich (Chi et al. 2023): the fast bias against the float64 reference, its properties, the registry."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled

from posenc_jax.functional import Sandwich, dot_product_attention, encoding_config, encoding_info, sandwich_bias
from posenc_jax.functional.core.hooks import AttentionContext
from posenc_jax.functional.encodings.sandwich import SANDWICH, sandwich_frequencies
from posenc_jax.reference import sandwich as ref

# Tolerances, in units of the uncompressed sum Σ_i cos(r θ_i) - d̄/2 (a head's bias times h·8/N).
# Each of the d̄/2 cosines is cos(β - α) = cos α cos β + sin α sin β from float32 tables: a few
# float32 roundings (eps = 1.2e-7) per term, so 1e-6 per term leaves ~8 eps (measured: ~1e-7).
ATOL_PER_TERM = 1e-6
# At large positions add the phase error of position_angles' exact reduction, below 1e-6 rad for
# each of α and β: 2e-6 more per term. Plain float32 angles (p · θ rounded) miss this by 100x
# at position 100,000 (half an ulp of 1e5 is 0.004 rad); test_large_positions checks that too.
ATOL_PER_TERM_LARGE = 3e-6


def _i32(x):
    return np.asarray(x, np.int32)


def _uncompress(bias, num_heads):
    """Multiplies head h (1-based) by h·8/N, undoing Sandwich's per-head compression (float64)."""
    heads = np.arange(1, num_heads + 1, dtype=np.float64)
    return np.asarray(bias, np.float64) * (heads * 8 / num_heads)[:, None, None]


def _assert_matches_reference(got, num_heads, q_pos, k_pos, dim, atol_per_term=ATOL_PER_TERM):
    want = ref.sandwich_bias(num_heads, q_pos, k_pos, dim)
    assert got.shape == want.shape
    np.testing.assert_allclose(
        _uncompress(got, num_heads), _uncompress(want, num_heads), rtol=0, atol=atol_per_term * dim / 2
    )


# Position sets: (query positions, key positions). Causal ones have every key at or before some query
# (a prefix, a chunk of new queries after a cache, one decoded token); bidirectional ones put keys on
# both sides, with offsets and gaps.
POSITION_SETS = {
    "causal-self": (np.arange(12), np.arange(12)),
    "causal-chunk": (np.arange(15, 20), np.arange(20)),
    "causal-decode": (np.array([30]), np.arange(31)),
    "bidirectional-self": (np.arange(9) + 7, np.arange(9) + 7),
    "bidirectional-gaps": (np.array([3, 4, 9, 20, 21, 50]), np.array([0, 2, 5, 8, 13, 21, 34, 55, 89])),
    "cross": (np.arange(0, 40, 3), np.arange(100, 107)),
}


@pytest.mark.parametrize("positions", list(POSITION_SETS), ids=str)
@pytest.mark.parametrize("dim", [2, 8, 64, 128])
def test_bias_matches_the_float64_reference(positions, dim):
    q_pos, k_pos = POSITION_SETS[positions]
    heads = (1, 3, 8, 12)
    # Every head count in one compiled program (jit against eager: test_jit_equals_eager).
    biases = jax.jit(lambda q, k: [sandwich_bias(n, q, k, dim=dim) for n in heads])(_i32(q_pos), _i32(k_pos))
    for num_heads, bias in zip(heads, biases, strict=True):
        got = np.asarray(bias)
        assert got.dtype == np.float32 and got.shape == (1, num_heads, len(q_pos), len(k_pos))
        _assert_matches_reference(got[0], num_heads, q_pos, k_pos, dim)


def test_bias_matches_the_reference_for_batched_positions_with_offsets_and_gaps(rng):
    batch, num_heads, dim = 3, 5, 32
    q_pos = np.stack([np.sort(rng.choice(300, 7, replace=False)) + 50 * b for b in range(batch)])  # [B, T]
    k_pos = np.stack([np.sort(rng.choice(300, 11, replace=False)) + 50 * b for b in range(batch)])  # [B, S]
    got = np.asarray(sandwich_bias(num_heads, _i32(q_pos), _i32(k_pos), dim=dim))
    assert got.shape == (batch, num_heads, 7, 11)
    for b in range(batch):
        _assert_matches_reference(got[b], num_heads, q_pos[b], k_pos[b], dim)
    # Batched queries with shared 1-D keys, and the other way round.
    shared = np.arange(40, 60)
    got = np.asarray(sandwich_bias(num_heads, _i32(q_pos), _i32(shared), dim=dim))
    assert got.shape == (batch, num_heads, 7, 20)
    for b in range(batch):
        _assert_matches_reference(got[b], num_heads, q_pos[b], shared, dim)
    got = np.asarray(sandwich_bias(num_heads, _i32(shared), _i32(k_pos), dim=dim))
    assert got.shape == (batch, num_heads, 20, 11)
    for b in range(batch):
        _assert_matches_reference(got[b], num_heads, shared, k_pos[b], dim)


def test_mismatched_batches_are_an_error():
    with pytest.raises(ValueError, match=r"different batch sizes"):
        sandwich_bias(2, jnp.zeros((2, 3), jnp.int32), jnp.zeros((3, 4), jnp.int32), dim=8)


def test_frequencies_start_at_i_equals_one_and_end_at_one_over_base():
    theta = sandwich_frequencies(8, base=10000.0)
    np.testing.assert_allclose(theta, [10000.0 ** (-2 * i / 8) for i in (1, 2, 3, 4)], rtol=1e-15)
    assert theta[-1] == pytest.approx(1e-4, rel=1e-15)  # not the sinusoidal ladder's 10000^(-6/8)
    # The frequencies reach the bias: dim 2 has the one frequency 1/base, so r = 1000 gives cos(0.1) - 1
    # (with i from 0 it would be cos(1000) - 1).
    got = float(sandwich_bias(8, _i32([0]), _i32([1000]), dim=2)[0, 0, 0, 0])
    np.testing.assert_allclose(got, np.cos(1000 / 10000.0) - 1.0, rtol=1e-4)


# ---------------------------------------------------------------- properties


# One compiled program per shape and setting, not one per operation (jit against eager: test_jit_equals_eager).
_sandwich_bias = jax.jit(sandwich_bias, static_argnums=0, static_argnames="dim")


def _bias64(num_heads, q_pos, k_pos, dim):
    return np.asarray(_sandwich_bias(num_heads, _i32(q_pos), _i32(k_pos), dim=dim), np.float64)[0]


@pytest.mark.parametrize("dim", [8, 64, 128])
def test_zero_on_the_diagonal_and_non_positive(dim):
    for offset in (0, 1234, 100_000, 2**30):
        pos = np.array([0, 1, 2, 5, 6, 40, 41, 300]) + offset
        bias = _bias64(6, pos, pos, dim)
        assert np.all(np.diagonal(bias, axis1=-2, axis2=-1) == 0.0)
        assert np.all(bias <= 0.0)
        off_diagonal = bias[:, ~np.eye(len(pos), dtype=bool)]
        assert np.all(off_diagonal < 0.0)  # only r = 0 makes every cosine 1
    # Equal positions off the array diagonal (a repeated position) are exactly zero too.
    bias = _bias64(2, [5, 9, 9], [9, 5, 7], dim)
    assert bias[:, 0, 1].tolist() == [0.0, 0.0] and bias[:, 1, 0].tolist() == [0.0, 0.0]
    assert bias[:, 2, 0].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("dim", [2, 4])
def test_non_positive_where_the_float32_cancellation_is_worst(rng, dim):
    # At d̄ = 2 a neighbour's sum cos(1e-4) - 1 = -5e-9 is far below the float32 resolution of the
    # sum (~1e-7), so the rounding residue of Σ cos - d̄/2 has either sign; the bias must still be <= 0.
    starts = np.sort(rng.choice(2**31 - 4, 300, replace=False))
    pos = np.concatenate([starts, starts + 1, starts + 3])
    bias = _bias64(3, pos, pos, dim)
    assert np.all(bias <= 0.0)
    assert np.all(bias[:, pos[:, None] == pos[None, :]] == 0.0)


@pytest.mark.parametrize("dim", [8, 64])
def test_symmetric_in_the_distance(dim):
    q_pos, k_pos = np.array([3, 10, 11, 40]), np.array([0, 4, 10, 17, 25, 60])
    forward = _bias64(4, q_pos, k_pos, dim)
    backward = _bias64(4, k_pos, q_pos, dim)  # every distance negated
    np.testing.assert_allclose(forward, np.swapaxes(backward, -1, -2), rtol=0, atol=ATOL_PER_TERM * dim / 2)
    # Along one query row, keys at distance +r and -r get the same bias.
    row = _bias64(4, [50], np.arange(30, 71), dim)[:, 0]  # distances -20..20
    np.testing.assert_allclose(row, row[:, ::-1], rtol=0, atol=ATOL_PER_TERM * dim / 2)
    assert np.ptp(row[:, 21:], axis=-1).min() > 0.01  # the row is not constant, so this compares something


@pytest.mark.parametrize("dim", [8, 64])
def test_depends_only_on_the_distance(dim):
    q_pos, k_pos = np.array([0, 3, 4, 9]), np.array([0, 1, 2, 5, 8, 13])
    base_bias = _bias64(3, q_pos, k_pos, dim)
    for shift in (1, 17, 1000, 99_999, 2**30):
        shifted = _bias64(3, q_pos + shift, k_pos + shift, dim)
        np.testing.assert_allclose(shifted, base_bias, rtol=0, atol=ATOL_PER_TERM_LARGE * dim / 2)
    # Two pairs with the same distance at unrelated places agree; a different distance does not.
    pair = lambda q, k: _bias64(3, [q], [k], dim)[:, 0, 0]
    np.testing.assert_allclose(pair(5, 12), pair(70_000, 70_007), rtol=0, atol=ATOL_PER_TERM_LARGE * dim / 2)
    assert np.all(np.abs(pair(5, 12) - pair(5, 13)) > 1e-3)


@pytest.mark.parametrize("num_heads", [1, 2, 5, 8, 12])
def test_head_h_is_head_one_divided_by_h(num_heads):
    pos = np.arange(0, 60, 7)
    bias = _bias64(num_heads, pos, pos, 32)
    heads = np.arange(1, num_heads + 1, dtype=np.float64)[:, None, None]
    np.testing.assert_allclose(bias * heads, np.broadcast_to(bias[:1], bias.shape), rtol=1e-6, atol=0)
    # And head 1 is the uncompressed sum times N/8.
    want_head_one = ref.sandwich_bias(8, pos, pos, 32)[0] * num_heads / 8
    np.testing.assert_allclose(bias[0], want_head_one, rtol=0, atol=ATOL_PER_TERM * 16 * num_heads / 8)


def test_no_tensor_of_queries_by_keys_by_frequencies_is_formed():
    # Sin and cos per position (or per table entry) and frequency, combined by products (cos(a - b) = cos a cos b +
    # sin a sin b): the compiled bias evaluates a few per position and frequency, not one per pair, and keeps
    # no [T, S, F] buffer. XLA's cost analysis counts the functions evaluated, its memory analysis the
    # temporary buffers.
    T, S, dim = 80, 100, 64
    frequencies = dim // 2
    pairs = T * S * frequencies

    def cost(bias):
        program = compiled(jax.jit(bias).lower(_i32(np.arange(T)), _i32(np.arange(S))))
        return program.cost_analysis()["transcendentals"], program.memory_analysis().temp_size_in_bytes

    transcendentals, temp = cost(lambda q, k: sandwich_bias(1, q, k, dim=dim))
    assert transcendentals <= 4 * (T + S) * frequencies, transcendentals
    assert temp < pairs * 4 // 4, temp  # the largest is one [T, S] (or [T, 2F]) array
    # The checks can fail: the sum over frequencies of cos((q - k) θ) evaluates and stores every pair's.
    theta = jnp.asarray(sandwich_frequencies(dim), jnp.float32)
    naive = lambda q, k: jnp.cos((q[:, None, None] - k[None, :, None]).astype(jnp.float32) * theta[None, None]).sum(-1)
    transcendentals, temp = cost(naive)
    assert transcendentals >= pairs and temp >= pairs * 4


# ---------------------------------------------------------------- large positions


@pytest.mark.parametrize("dim", [8, 64, 128])
def test_large_positions_match_the_reference(dim):
    q_pos = np.array([100_000, 100_001, 100_003, 100_050, 100_500])
    k_pos = np.array([0, 7, 99_990, 100_000, 100_002, 100_003, 100_777, 123_456])
    got = np.asarray(sandwich_bias(4, _i32(q_pos), _i32(k_pos), dim=dim))[0]
    _assert_matches_reference(got, 4, q_pos, k_pos, dim, atol_per_term=ATOL_PER_TERM_LARGE)
    # The tolerance is tight enough to reject the same identity computed with plain float32 angles.
    theta = jnp.asarray(sandwich_frequencies(dim), jnp.float32)
    alpha = jnp.asarray(q_pos, jnp.float32)[:, None] * theta[None]
    beta = jnp.asarray(k_pos, jnp.float32)[:, None] * theta[None]
    naive = np.asarray(jnp.cos(alpha) @ jnp.cos(beta).T + jnp.sin(alpha) @ jnp.sin(beta).T, np.float64) - dim / 2
    exact = ref.sandwich_bias(8, q_pos, k_pos, dim)[0]  # N = 8: head 1 is the uncompressed sum
    assert np.abs(naive - exact).max() > 10 * ATOL_PER_TERM_LARGE * dim / 2


# ---------------------------------------------------------------- jit and attention


def test_jit_equals_eager():
    q_pos, k_pos = _i32(np.arange(5) + 300), _i32(np.array([0, 100, 301, 302, 1000, 5000]))
    fn = jax.jit(sandwich_bias, static_argnums=0, static_argnames=("dim", "base"))
    eager = np.asarray(sandwich_bias(6, q_pos, k_pos, dim=16))
    np.testing.assert_allclose(np.asarray(fn(6, q_pos, k_pos, dim=16)), eager, rtol=0, atol=1e-6)
    # The hook is a pytree: it can be an argument of a jitted function.
    context = AttentionContext(q_pos, k_pos, head_dim=16, num_heads=6, key_length=6)
    jitted_hook = jax.jit(lambda enc, ctx: enc.bias(ctx))(Sandwich(), context)
    np.testing.assert_allclose(np.asarray(jitted_hook), eager, rtol=0, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dim", [None, 16])
def test_in_attention_equals_explicit_bias(rng, causal, dim):
    B, T, N, H = 2, 6, 3, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32) for _ in range(3))
    pos = np.array([40, 41, 43, 44, 50, 51])  # offsets and gaps
    enc = Sandwich(dim=dim)

    def attend(q, k, v, enc):
        return dot_product_attention(
            q, k, v, query_positions=_i32(pos), key_positions=_i32(pos), encodings=[enc], causal=causal
        )

    out = jax.jit(attend)(q, k, v, enc)
    bias = ref.sandwich_bias(N, pos, pos, H if dim is None else dim)  # [N, T, S]
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    logits = np.einsum("BTNH,BSNH->BNTS", q64, k64) / np.sqrt(H) + bias[None]
    if causal:
        logits = np.where(pos[None, :] <= pos[:, None], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, np.einsum("BNTS,BSNH->BTNH", w, v64), atol=1e-5)
    # The bias is strong enough here that dropping it changes the output.
    plain = dot_product_attention(q, k, v, query_positions=_i32(pos), key_positions=_i32(pos), causal=causal)
    assert np.abs(np.asarray(out) - np.asarray(plain)).max() > 1e-3


# ---------------------------------------------------------------- registry and settings


def test_registry_entry():
    config = encoding_config("sandwich")
    assert isinstance(config, Sandwich) and config == Sandwich(dim=None, base=10000.0)
    assert encoding_config("sandwich", dim=16, base=500.0) == Sandwich(dim=16, base=500.0)
    assert config.build(config.init(jax.random.key(0), num_heads=2, head_dim=8, model_dim=16)) is config
    assert jax.tree_util.tree_leaves(config) == []
    info = encoding_info("sandwich")
    assert info.acts_on == "shared_bias" and info.hooks == ("logits",)
    assert info.forms == ("causal", "bidirectional") and info.settings == ("dim", "base")
    assert info.source is SANDWICH and info.source.arxiv == "2212.10356" and info.source.year == 2023
    assert info.source.title == "Dissecting Transformer Length Extrapolation via the Lens of Receptive Field Analysis"
    assert info.source.authors == "Chi, Ta-Chung and Fan, Ting-Han and Rudnicky, Alexander I. and Ramadge, Peter J."
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dim = 4


@pytest.mark.parametrize("dim", [7, 0, 1, -4, 8.0, True])
def test_bad_dim_names_the_value(dim):
    with pytest.raises(ValueError, match=rf"Sandwich dim must be an even integer >= 2.*got {dim!r}; pass an even dim"):
        encoding_config("sandwich", dim=dim)
    with pytest.raises(ValueError, match=rf"got {dim!r}"):
        sandwich_bias(2, _i32([0]), _i32([0]), dim=dim)


@pytest.mark.parametrize("base", [1.0, 0.5, -3.0, float("inf"), float("nan"), "10000"])
def test_bad_base_names_the_value(base):
    with pytest.raises(ValueError, match=r"Sandwich base must be a finite number > 1.*got " + repr(base)):
        Sandwich(base=base)


def test_odd_head_dim_without_an_explicit_dim_names_the_head_dim():
    context = AttentionContext(_i32([0, 1]), _i32([0, 1]), head_dim=7, num_heads=2, key_length=2)
    with pytest.raises(ValueError, match=r"the head dim, 7\) must be an even integer >= 2.*got 7"):
        Sandwich().bias(context)
    assert Sandwich(dim=6).bias(context).shape == (1, 2, 2, 2)  # an explicit dim makes it work


@pytest.mark.parametrize("num_heads", [0, -1, 2.0])
def test_bad_num_heads_names_the_value(num_heads):
    with pytest.raises(ValueError, match=rf"num_heads must be an integer >= 1.*got {num_heads!r}"):
        sandwich_bias(num_heads, _i32([0]), _i32([0]), dim=8)
