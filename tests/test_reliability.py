"""Reliability: masked keys never leak, positions over the whole int32 range, exact FIRE
distances, xPos in half precision, the KV cache's empty slots, and settings that are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posenc_jax.bench.presets import runs_on as _runs_on
from posenc_jax.bench.tasks import make_task
from posenc_jax.functional import (
    ALiBi,
    CoPE,
    Kerple,
    RoPE,
    SharedBias,
    Shaw,
    T5Bias,
    XPos,
    dot_product_attention,
    encoding_config,
)
from posenc_jax.functional.core.cache import KVCache
from posenc_jax.functional.core.hooks import AttentionContext
from posenc_jax.functional.core.masks import causal_mask
from posenc_jax.functional.core.normalizers import URPE, normalizer_config
from posenc_jax.functional.core.positions import position_difference
from posenc_jax.functional.core.relative import expand_relative_bias, relative_positions
from posenc_jax.functional.encodings.alibi import alibi_bias, alibi_slopes
from posenc_jax.functional.encodings.fire import fire_bias, fire_init
from posenc_jax.functional.encodings.kerple import kerple_bias
from posenc_jax.functional.encodings.shaw import shaw_value_term
from posenc_jax.functional.encodings.xpos import apply_xpos_qk
from posenc_jax.nn import Transformer
from posenc_jax.reference import beyond_seeds as reference
from small_encodings import small_config

INT32_MAX = 2**31 - 1
# Positions at both ends of int32 and around zero; pairwise differences need 33 bits.
EXTREMES = np.array([-(2**31), -(2**31) + 1, -(2**30) - 1, -1, 0, 1, 2**30, 2**31 - 2, 2**31 - 1], np.int64)


def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), dtype)


# ---------------------------------------------------------------- positions: the whole int32 range


def test_position_differences_do_not_wrap():
    a, b = np.meshgrid(EXTREMES, EXTREMES, indexing="ij")
    true = a - b  # int64: exact
    a32, b32 = jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32)
    np.testing.assert_array_equal(position_difference(a32, b32), np.clip(true, -INT32_MAX, INT32_MAX))
    np.testing.assert_array_equal(position_difference(a32, b32, dtype=jnp.float32), true.astype(np.float32))
    rel = relative_positions(jnp.asarray(EXTREMES, jnp.int32), jnp.asarray(EXTREMES, jnp.int32))[0]
    np.testing.assert_array_equal(np.sign(rel), np.sign(b - a))  # never the wrong side


def test_causal_mask_and_attention_at_the_ends_of_int32(rng):
    assert not bool(causal_mask(jnp.array([-1]), jnp.array([INT32_MAX]))[0, 0, 0, 0])
    assert bool(causal_mask(jnp.array([INT32_MAX]), jnp.array([-(2**31)]))[0, 0, 0, 0])
    q = EXTREMES.astype(np.int32)
    want = EXTREMES[None, :] <= EXTREMES[:, None]
    np.testing.assert_array_equal(causal_mask(q, q)[0, 0], want)
    # A query at -1 sees the key at -5 and not the one at 2**31 - 1.
    x, v = _normal(rng, (1, 1, 1, 4)), _normal(rng, (1, 2, 1, 4))
    out = dot_product_attention(
        x, v, v, query_positions=jnp.array([-1]), key_positions=jnp.array([INT32_MAX, -5]), causal=True
    )
    np.testing.assert_allclose(out[0, 0], v[0, 1], atol=1e-6)


def test_linear_and_log_biases_at_the_ends_of_int32():
    q, k = np.array([INT32_MAX, -(2**31)]), np.array([-(2**31), INT32_MAX])
    distance = (k[None, :] - q[:, None]).astype(np.float64)  # key - query: up to ±(2**32 - 1)
    slopes = alibi_slopes(8)[:, None, None]
    np.testing.assert_allclose(alibi_bias(8, q, k)[0], slopes * distance, rtol=1e-6)
    np.testing.assert_allclose(alibi_bias(8, q, k, bidirectional=True)[0], -slopes * np.abs(distance), rtol=1e-6)
    r1, r2 = np.array([1.0, 0.5]), np.array([0.1, 1.0])
    want = -r1[:, None, None] * np.log1p(r2[:, None, None] * np.abs(distance))
    np.testing.assert_allclose(kerple_bias(jnp.asarray(r1), jnp.asarray(r2), q, k)[0], want, rtol=1e-6)


def test_clipped_tables_saturate_at_the_far_end():
    table = jnp.arange(5.0)[None]  # [N=1, 2k+1], k = 2: value = clipped distance + 2
    bias = expand_relative_bias(table, jnp.array([-1, INT32_MAX]), jnp.array([INT32_MAX, -(2**31)]), 2)
    np.testing.assert_array_equal(bias[0, 0], [[4.0, 0.0], [2.0, 0.0]])


def test_xpos_and_dynamic_rope_at_the_last_int32_positions(rng):
    q, k = _normal(rng, (1, 8, 1, 8)), _normal(rng, (1, 8, 1, 8))
    offsets = jnp.arange(8)

    def scores(positions):
        rq, rk = apply_xpos_qk(q, k, positions, positions)
        return np.einsum("TH,SH->TS", np.asarray(rq[0, :, 0], np.float64), np.asarray(rk[0, :, 0], np.float64))

    # Scores depend on offsets only; at the end of int32 the centre must not wrap around.
    np.testing.assert_allclose(scores(offsets + (INT32_MAX - 7)), scores(offsets), rtol=1e-4, atol=1e-5)
    # Dynamic NTK reads the length max(position) + 1, which must not wrap to -2**31 either.
    scaling = encoding_config("rope-dynamic-ntk", factor=2.0, original_context=4)
    last = jnp.array([INT32_MAX])
    context = AttentionContext(query_positions=last, key_positions=last)
    scaled = scaling.rotate(q[:, :1], k[:, :1], context)
    plain = RoPE().rotate(q[:, :1], k[:, :1], context)
    assert np.abs(np.asarray(scaled[0]) - np.asarray(plain[0])).max() > 1e-2


def test_alibi_hook_in_attention_at_the_ends_of_int32(rng):
    x = _normal(rng, (1, 2, 8, 4))
    pos = jnp.array([-(2**31), INT32_MAX])
    _, weights = dot_product_attention(
        x, x, x, query_positions=pos, key_positions=pos, encodings=[ALiBi(bidirectional=True)], return_weights=True
    )
    # 2**32 - 1 apart, every head's penalty (>= 1.7e7) leaves each query with itself.
    np.testing.assert_allclose(weights[0, :, [0, 1], [0, 1]], 1.0, atol=1e-6)


# ---------------------------------------------------------------- FIRE: exact distances


@pytest.mark.parametrize("start", [10**8, INT32_MAX - 40], ids=["1e8", "int32-end"])
def test_fire_matches_the_float64_formula_at_large_positions(start):
    params = fire_init(jax.random.key(0), 4)
    query_positions = start + 3 * np.arange(12)  # gaps, past the threshold L = 512
    key_positions = start - 5 + np.arange(16)
    got = np.asarray(fire_bias(params, query_positions, key_positions))[0]
    want = reference.fire_bias(params, query_positions, key_positions)
    spread = want.max() - want.min()
    assert spread > 1e-2  # the bias varies over these distances: the comparison means something
    np.testing.assert_allclose(got, want, atol=1e-6 + 1e-5 * spread)


# ---------------------------------------------------------------- masked keys never leak

B, T, N, K, H = 2, 6, 4, 2, 8
POS = jnp.arange(T)
POISONED = 3  # the key whose key or value vector is poisoned


def _mask_settings(kind):
    """Attention keyword arguments hiding key POISONED from some rows (or all), and the [B, N, T, S] mask."""
    if kind == "key_mask":
        key_mask = np.ones((B, T), bool)
        key_mask[:, POISONED] = False
        kwargs = dict(key_mask=jnp.asarray(key_mask))
        mask = np.broadcast_to(key_mask[:, None, None, :], (B, N, T, T))
    elif kind == "causal":
        kwargs = dict(causal=True)
        mask = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, N, T, T))
    elif kind == "segments":
        seg = jnp.asarray([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]])
        kwargs = dict(query_segment_ids=seg, key_segment_ids=seg)
        mask = np.broadcast_to((seg[:, :, None] == seg[:, None, :])[:, None], (B, N, T, T))
    else:  # a general per-head mask, each row keeping its diagonal key
        mask = np.random.default_rng(1).random((B, N, T, T)) < 0.5
        mask = mask | np.eye(T, dtype=bool)
        kwargs = dict(mask=jnp.asarray(mask))
    return kwargs, np.asarray(mask)


def _built(name, rng):
    config = small_config(name)
    return config.build(config.init(jax.random.key(0), num_heads=N, head_dim=H, model_dim=N * H))


def _poison(x, value):
    return x.at[:, POISONED].set(value)


MASK_KINDS = ["key_mask", "causal", "segments", "general"]


def _normalizers(rng):
    urpe = URPE(jnp.asarray(rng.uniform(0.5, 1.5, (N, 7)), jnp.float32), max_distance=3)
    return {
        "softmax": normalizer_config("softmax"),
        "l2": normalizer_config("l2"),
        "relu2": normalizer_config("relu2"),
        "urpe": urpe,
    }


@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_a_masked_keys_value_never_reaches_the_output(rng, kind, poison):
    q, k = _normal(rng, (B, T, N, H)), _normal(rng, (B, T, K, H))
    v = _normal(rng, (B, T, K, H))
    kwargs, mask = _mask_settings(kind)
    shaw = Shaw(max_distance=2, value_table=_normal(rng, (5, H)))  # a values hook as well
    sees = mask[..., POISONED].transpose(0, 2, 1)  # [B, T, N]: whether the row may attend to the key

    def attend(v, normalizer):
        return dot_product_attention(
            q, k, v, query_positions=POS, key_positions=POS, encodings=[shaw], normalizer=normalizer, **kwargs
        )

    for name, normalizer in _normalizers(rng).items():
        clean, poisoned = np.asarray(attend(v, normalizer)), np.asarray(attend(_poison(v, poison), normalizer))
        np.testing.assert_allclose(poisoned[~sees], clean[~sees], rtol=1e-5, atol=1e-6, err_msg=name)
        assert np.isfinite(poisoned[~sees]).all(), name
        if name != "relu2":  # relu² gives some visible keys weight 0, and 0 · inf is NaN by IEEE
            assert not np.isfinite(poisoned[sees]).any(), name  # a row that sees the key sees what it holds


@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize(
    "normalizer, encoding",
    [
        ("softmax", "none"),
        ("l2", "none"),
        ("relu2", "none"),
        ("softmax", "cope"),
        ("relu2", "cope"),
        ("softmax", "deberta"),
        ("softmax", "transformer-xl"),
        ("softmax", "xpos"),
    ],
)
def test_a_masked_keys_key_vector_never_reaches_other_scores_or_gradients(rng, normalizer, encoding, poison):
    q, k, v = _normal(rng, (B, T, N, H)), _normal(rng, (B, T, N, H)), _normal(rng, (B, T, N, H))
    kwargs, _ = _mask_settings("key_mask")  # key POISONED is padding
    hooks = [] if encoding == "none" else [_built(encoding, rng)]
    if encoding == "cope":  # embeddings that are not zero, so the gate counts matter
        hooks = [CoPE(_normal(rng, (4, H)))]

    def attend(q, k, v):
        return dot_product_attention(
            q,
            k,
            v,
            query_positions=POS,
            key_positions=POS,
            encodings=hooks,
            normalizer=normalizer_config(normalizer),
            causal=True,
            return_weights=True,
            **kwargs,
        )

    clean_out, clean_weights = attend(q, k, v)
    out, weights = attend(q, _poison(k, poison), v)
    np.testing.assert_allclose(weights, clean_weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, clean_out, rtol=1e-5, atol=1e-6)
    grads = jax.grad(lambda q, k, v: (attend(q, k, v)[0] ** 2).sum(), argnums=(0, 1, 2))(q, _poison(k, poison), v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()


def test_shaw_value_term_selects_the_weights_the_mask_keeps(rng):
    weights = jnp.asarray(rng.random((1, 2, 4, 4)), jnp.float32)
    mask = jnp.asarray(np.tril(np.ones((4, 4), bool)))[None, None]
    table = _normal(rng, (5, H))
    clean = shaw_value_term(jnp.where(mask, weights, 0.0), table, POS[:4], POS[:4], max_distance=2)
    poisoned = shaw_value_term(jnp.where(mask, weights, jnp.nan), table, POS[:4], POS[:4], max_distance=2, mask=mask)
    np.testing.assert_allclose(poisoned, clean, rtol=1e-6)


# ---------------------------------------------------------------- xPos in half precision


@pytest.mark.parametrize("length", [20_000, 100_000])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_xpos_in_half_precision_over_long_spans(rng, dtype, length):
    positions = np.arange(length)
    q, k = _normal(rng, (1, length, 1, 4), dtype), _normal(rng, (1, length, 1, 4), dtype)
    rq, rk = apply_xpos_qk(q, k, positions, positions)
    assert np.isfinite(np.asarray(rq, np.float32)).all() and np.isfinite(np.asarray(rk, np.float32)).all()
    # The scale is computed in float32 and kept there for float16 (bfloat16 has float32's range).
    rq32, rk32 = apply_xpos_qk(q.astype(jnp.float32), k.astype(jnp.float32), positions, positions)
    if dtype == jnp.float16:
        assert rq.dtype == rk.dtype == jnp.float32
        np.testing.assert_array_equal(rq, rq32)
        np.testing.assert_array_equal(rk, rk32)
    else:
        assert rq.dtype == rk.dtype == jnp.bfloat16
    # Scores of pairs spread over the span, where no factor is clamped, against float64.
    centre = (length - 1) // 2
    picked = centre + np.array([-length // 5, -10, 0, 3, length // 5])
    q64, k64 = (np.asarray(x[0, picked, 0], np.float64) for x in (q, k))
    want_q, want_k = reference.xpos_qk(q64, k64, picked, picked, centre)
    want = want_q @ want_k.T
    size = np.abs(want_q) @ np.abs(want_k).T  # the scale of each score's terms
    got = np.asarray(rq[0, picked, 0], np.float64) @ np.asarray(rk[0, picked, 0], np.float64).T
    tolerance = 1e-2 if dtype == jnp.bfloat16 else 1e-4
    assert np.all(np.abs(got - want) <= tolerance * size)


def test_xpos_attention_in_float16_over_20k_tokens(rng):
    x = _normal(rng, (1, 2, 2, 8), jnp.float16)
    pos = jnp.array([0, 19_999])
    out = dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, encodings=[XPos()], causal=True)
    assert out.dtype == jnp.float16 and np.isfinite(np.asarray(out, np.float32)).all()
    want = dot_product_attention(
        *(x.astype(jnp.float32),) * 3, query_positions=pos, key_positions=pos, encodings=[XPos()], causal=True
    )
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-3)


# ---------------------------------------------------------------- the KV cache's empty slots


def test_cache_tracks_valid_slots():
    cache = KVCache.empty(batch=2, max_length=5, num_kv_heads=1, head_dim=2)
    ones = jnp.ones((2, 2, 1, 2))
    cache = cache.append(ones, ones, jnp.asarray([[0, 0], [0, 1]]), valid=jnp.asarray([[False, True], [True, True]]))
    cache = cache.append(ones[:, :1], ones[:, :1], jnp.asarray([[1], [2]]))
    np.testing.assert_array_equal(cache.valid, [[False, True, True, False, False], [True, True, True, False, False]])
    with pytest.raises(ValueError, match="valid must be boolean"):
        cache.append(ones, ones, jnp.zeros((2, 2), jnp.int32), valid=jnp.ones((2, 2)))


@pytest.mark.parametrize("name", ["rope", "alibi", "xpos", "cope"])
def test_decoding_at_and_beyond_2_30_equals_the_forward(rng, name):
    model = Transformer(
        vocab_size=16,
        model_dim=16,
        num_layers=1,
        num_heads=2,
        mlp_dim=32,
        encoding=small_config(name),
        causal=True,
        rngs=nnx.Rngs(0),
    )
    tokens = jnp.asarray(rng.integers(0, 16, (2, 6)), jnp.int32)
    # Row 0 from 2**30, row 1 to the last int32 position.
    positions = jnp.asarray([2**30, INT32_MAX - 5])[:, None] + jnp.arange(6)[None]
    full = nnx.jit(lambda model, tokens, positions: model(tokens, positions))(model, tokens, positions)
    step = nnx.jit(lambda model, tokens, positions, caches: model.decode(tokens, positions, caches))
    logits, caches = step(model, tokens[:, :3], positions[:, :3], model.init_cache(2, 8))
    outputs = [logits]
    for t in range(3, 6):
        logits, caches = step(model, tokens[:, t : t + 1], positions[:, t : t + 1], caches)
        outputs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outputs, axis=1), full, atol=2e-4, rtol=1e-4)


# ---------------------------------------------------------------- settings that are refused


def _attend(q=None, k=None, **kwargs):
    q = jnp.ones((1, 3, 2, 8)) if q is None else q
    k = q if k is None else k
    kwargs.setdefault("query_positions", jnp.arange(q.shape[1]))
    kwargs.setdefault("key_positions", jnp.arange(k.shape[1]))
    return lambda: dot_product_attention(q, k, k, **kwargs)


def _scaled_rope(name, **settings):
    return lambda: _attend(encodings=[encoding_config(name, **settings)])()


# (what is refused, a call, the error it must raise: the value and the fix). Add rows freely.
REFUSED = [
    ("scale nan", _attend(scale=float("nan")), r"scale must be a finite number > 0 .*got nan"),
    ("scale 0", _attend(scale=0.0), r"scale must be a finite number > 0 .*got 0.0"),
    ("scale -1", _attend(scale=-1.0), r"scale must be a finite number > 0 .*got -1.0"),
    (
        "YaRN factor inf",
        _scaled_rope("rope-yarn", factor=float("inf"), original_context=4),
        r"scaling factor must be a number >= 1 and finite .*got inf",
    ),
    (
        "PI factor nan",
        _scaled_rope("rope-pi", factor=float("nan")),
        r"scaling factor must be a number >= 1 and finite .*got nan",
    ),
    ("RoPE base inf", lambda: RoPE(base=float("inf")), r"base must be a finite number > 1 .*got inf"),
    (
        "RoPE base inf in attention",
        lambda: _attend(encodings=[RoPE(base=float("inf"), rotary_dim=8)])(),
        r"base must be a finite number > 1 .*got inf",
    ),
    (
        "LongRoPE negative factors",
        _scaled_rope(
            "rope-longrope",
            short_factor=(1.0, -1.0, 1.0, 1.0),
            long_factor=(2.0,) * 4,
            original_context=4,
            max_context=16,
        ),
        r"LongRoPE short_factor must be finite numbers > 0 .*got \(1.0, -1.0, 1.0, 1.0\)",
    ),
    (
        "LongRoPE nan factor",
        _scaled_rope(
            "rope-longrope",
            short_factor=(1.0,) * 4,
            long_factor=(2.0, float("nan"), 2.0, 2.0),
            original_context=4,
            max_context=16,
        ),
        r"LongRoPE long_factor must be finite numbers > 0",
    ),
    (
        "CoPE bidirectional",
        _attend(encodings=[CoPE(jnp.zeros((4, 8)))], causal=False),
        r"CoPE is defined for causal attention only; pass causal=True",
    ),
    ("N=0 heads", _attend(jnp.ones((1, 3, 0, 8))), r"at least one head \(N >= 1, K >= 1\), got N=0 and K=0"),
    ("K=0 heads", _attend(jnp.ones((1, 3, 2, 8)), jnp.ones((1, 3, 0, 8))), r"got N=2 and K=0"),
    (
        "T5 table for 4 heads, N=2",
        _attend(encodings=[T5Bias(jnp.zeros((8, 4)), max_distance=16)]),
        r"the T5 table \[num_buckets, N\] \(8, 4\) has 4 heads but the attention has N=2 query heads; make it for 2",
    ),
    (
        "Kerple for 4 heads, N=2",
        _attend(encodings=[Kerple(jnp.ones(4), jnp.ones(4))]),
        r"Kerple's r1 \[N\] \(4,\) has 4 heads but the attention has N=2 query heads",
    ),
    (
        "a shared bias for 4 heads, N=2",
        _attend(encodings=[SharedBias(jnp.zeros((1, 4, 3, 3)))]),
        r"SharedBias's logits term has shape \(1, 4, 3, 3\), which does not broadcast to the scores "
        r"\[B, N, T, S\] = \(1, 2, 3, 3\)",
    ),
    (
        "mask [1, 1, 3, 4] for S=3",
        _attend(mask=jnp.ones((1, 1, 3, 4), bool)),
        r"mask of shape \(1, 1, 3, 4\) does not broadcast to the scores \[B, N, T, S\] = \(1, 2, 3, 3\)",
    ),
    ("mask of rank 5", _attend(mask=jnp.ones((1, 1, 1, 3, 3), bool)), r"mask of shape \(1, 1, 1, 3, 3\)"),
    (
        "S=0 with causal",
        _attend(k=jnp.ones((1, 0, 2, 8)), causal=True),
        r"attention needs at least one key, got S=0 \(key shape \(1, 0, 2, 8\)\)",
    ),
    ("S=0", _attend(k=jnp.ones((1, 0, 2, 8))), r"at least one key, got S=0"),
    (
        "odd head dim with RoPE",
        _attend(jnp.ones((1, 3, 2, 7)), encodings=[RoPE()]),
        r"head_dim must be even for RoPE, got 7 .*use an even head dim",
    ),
]


@pytest.mark.parametrize("call, message", [row[1:] for row in REFUSED], ids=[row[0] for row in REFUSED])
def test_nonsense_settings_are_refused_with_the_value_and_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_benchmark_runs_causal_only_encodings_on_decoder_tasks_only():
    # Read from the metadata: CoPE, xPos and FIRE have no bidirectional form.
    for name in ("cope", "xpos", "fire"):
        assert not _runs_on(make_task("probe"), name) and not _runs_on(make_task("parity"), f"rope+{name}")
        assert _runs_on(make_task("counting_copy"), name)
    assert _runs_on(make_task("probe"), "rope") and _runs_on(make_task("probe"), "t5+randomized")
