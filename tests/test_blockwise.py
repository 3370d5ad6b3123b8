"""Blockwise attention equals the materialising path, for every encoding and normaliser.

Each case runs both implementations in one jitted function on the same awkward inputs:
T != S, gapped and offset positions, grouped-query heads, key padding, packed segments, and
block sizes that do not divide the lengths; forward to 1e-5 and gradients (queries, keys,
values and the encoding's parameters) to 1e-4, relative to the largest entry. The float64
references are checked for the blockwise path in ``test_properties.py``.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled

from posenc_jax.functional import (
    URPE,
    ALiBi,
    CoPE,
    ReLU2,
    dot_product_attention,
    encoding_info,
    encoding_names,
    l2_normalized_weights,
    relu2_weights,
    softmax_weights,
)
from posenc_jax.functional.core.hooks import AttentionContext, MaterializeOnly
from posenc_jax.functional.encodings.transformer_xl import project_distances
from posenc_jax.functional.kernels.transformer_xl import tile_terms
from small_encodings import causal_settings, one_per_path, small_config

B, T, S, N, K, H = 2, 9, 11, 4, 2, 8
ATTENTION_NAMES = [n for n in encoding_names() if encoding_info(n).acts_on in ("attention", "shared_bias")]
NAMES = one_per_path(ATTENTION_NAMES)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32)
    # Cross-attention with gapped, offset positions: queries at 7, 9, ..., keys at 1, 3, ...
    query_positions = jnp.asarray(7 + 2 * np.arange(T))
    key_positions = jnp.asarray(1 + 2 * np.arange(S))
    key_mask = jnp.ones((B, S), bool).at[1, -3:].set(False)
    query_segments = jnp.asarray([[0] * 5 + [1] * 4, [0] * 9])
    key_segments = jnp.asarray([[0] * 6 + [1] * 5, [0] * 11])
    return (
        q,
        k,
        v,
        dict(
            query_positions=query_positions,
            key_positions=key_positions,
            key_mask=key_mask,
            query_segment_ids=query_segments,
            key_segment_ids=key_segments,
        ),
    )


def _both(hook_of, params, q, k, v, weight, block_q=4, block_k=3, settings=({},), **kwargs):
    """Outputs and gradients of both implementations, in one compiled function: for each of ``settings``
    (keyword arguments on top of ``kwargs``: the causal and bidirectional forms, say), the materialising
    path's and then the blockwise path's."""

    def run(implementation, setting, params, q, k, v):
        extra = dict(block_q=block_q, block_k=block_k) if implementation == "blockwise" else {}
        out = dot_product_attention(
            q, k, v, encodings=hook_of(params), implementation=implementation, **extra, **kwargs, **setting
        )
        return jnp.sum(out * weight), out

    @jax.jit
    def both(params, q, k, v):
        results = []
        for setting in settings:
            for implementation in ("materialize", "blockwise"):
                (_, out), grads = jax.value_and_grad(
                    lambda *a, i=implementation, s=setting: run(i, s, *a), argnums=(0, 1, 2, 3), has_aux=True
                )(params, q, k, v)
                results.append((out, grads))
        return results

    return both(params, q, k, v)


def _assert_close(want, got, tol, what):
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    assert np.isfinite(got).all(), what
    size = max(np.abs(want).max(), 1e-6)
    np.testing.assert_allclose(got / size, want / size, atol=tol, rtol=0, err_msg=what)


def _check(results, what):
    (want, want_grads), (got, got_grads) = results
    _assert_close(want, got, 1e-5, f"{what}: forward")
    # Relative to the largest gradient entry: a parameter whose exact gradient is zero (a
    # per-head constant under softmax) has only rounding noise to compare.
    size = max(float(np.abs(np.asarray(leaf)).max()) for leaf in jax.tree.leaves(want_grads))
    for i, (a, b) in enumerate(zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads), strict=True)):
        assert np.isfinite(np.asarray(b)).all(), f"{what}: gradient {i}"
        np.testing.assert_allclose(
            np.asarray(b) / size, np.asarray(a) / size, atol=1e-4, err_msg=f"{what}: gradient {i}"
        )


def _check_forms(hook_of, params, q, k, v, weight, causals, what, **kwargs):
    """:func:`_both` for each of ``causals`` in one compiled program; each form checked on its own."""
    results = _both(hook_of, params, q, k, v, weight, settings=[dict(causal=causal) for causal in causals], **kwargs)
    for i, causal in enumerate(causals):
        _check(results[2 * i : 2 * i + 2], f"{what} ({'causal' if causal else 'bidirectional'})")


@pytest.mark.parametrize("name", NAMES)
def test_every_encoding_blockwise_equals_materialising(name):
    """Each of the encoding's forms (:func:`causal_settings`), in one compiled program."""
    config = small_config(name)
    params = config.init(jax.random.key(1), num_heads=N, head_dim=H, model_dim=N * H)
    if name == "cope":  # zeros at init would make its term vanish: give it something to carry
        params = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape) * 0.5, params)
    q, k, v, kwargs = _inputs()
    weight = jax.random.normal(jax.random.key(3), (B, T, N, H))
    _check_forms(lambda p: [config.build(p)], params, q, k, v, weight, causal_settings(name), name, **kwargs)


# Encodings with a tile form of their own (from the tile's distance range where its positions are runs),
# beside their plain per-tile form: both are compared with the materialising path. Row 0 counts up by one from
# 100 (every tile a run: the tile forms, past a clip on either side and across it); row 1 has a gap (its
# tiles across the gap take the plain form). A tile form against its reference alone, unbatched positions
# included, is test_contract.py's.
TILE_FORMS = ["kerple-log", "kerple-power", "functional-relative", "shaw", "deberta", "fire", "cope", "transformer-xl"]
RUNS = jnp.asarray(100 + np.arange(S))
RUNS_AND_GAPS = jnp.stack([RUNS, jnp.asarray(np.r_[0:4, 9:16])])


@pytest.mark.parametrize("name", TILE_FORMS)
def test_tile_forms_equal_materialising_on_runs_and_gaps(name):
    """Self-attention (T = S) on consecutive positions and on gaps: tiles past a clip on either side (far
    before and, bidirectional, far after their queries), tiles across it, and Toeplitz tiles; each of the
    encoding's forms, in one compiled program."""
    # CoPE counting to 3 only: most of its tiles are past the top (one row read), the others not.
    config = small_config(name, **(dict(num_positions=3) if name == "cope" else {}))
    params = config.init(jax.random.key(1), num_heads=N, head_dim=H, model_dim=N * H)
    if name == "cope":  # zeros at init would make its term vanish
        params = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape) * 0.5, params)
    q, k, v, _ = _inputs()
    q = jnp.concatenate([q, q[:, :2]], axis=1)  # T = S
    weight = jax.random.normal(jax.random.key(3), (B, S, N, H))
    _check_forms(
        lambda p: [config.build(p)],
        params,
        q,
        k,
        v,
        weight,
        causal_settings(name),  # every form: none of these is a rotation
        f"{name} on runs and gaps",
        query_positions=RUNS_AND_GAPS,
        key_positions=RUNS_AND_GAPS,
    )


@pytest.mark.parametrize("causal", [True, False])
def test_transformer_xl_tiles_read_the_calls_table_where_runs(causal):
    """A tile of runs takes the call's projected distances (its identity fallback here gives NaN, so the
    table's branch is the one taken) and equals the encoding's logits; a tile with a gap takes the identity."""
    config = small_config("transformer-xl")
    params = config.init(jax.random.key(1), num_heads=N, head_dim=H, model_dim=N * H)
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(jax.random.key(2), p.shape), params)
    hook = config.build(params)
    q, k = (jax.random.normal(jax.random.key(i), (B, 6, N, H)) for i in (4, 5))
    whole = AttentionContext.from_positions(jnp.arange(40)[None], jnp.arange(40)[None], scale=0.3, causal=causal)
    tiled = hook.for_tiles(whole, 6, 6)
    # A tile of 64 query rows is scored by blocks of 32 rows, each against its own distances.
    long_q = jax.random.normal(jax.random.key(6), (B, 64, N, H))
    long_whole = AttentionContext.from_positions(jnp.arange(90)[None], jnp.arange(90)[None], scale=0.3, causal=causal)
    long_tiled = long_whole.tile(20 + jnp.arange(64)[None], 30 + jnp.arange(6)[None])
    want = hook.logits(long_q, k, dataclasses.replace(long_tiled, causal=False))
    got = hook.for_tiles(long_whole, 64, 6).tile_logits(long_q, k, long_tiled)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg="a tile of 64 rows")
    for q0, k0 in ((30, 24), (12, 12), (0, 34)):
        context = whole.tile(q0 + jnp.arange(6)[None], k0 + jnp.arange(6)[None])
        want = hook.logits(q, k, dataclasses.replace(context, causal=False))
        got = tile_terms(
            jnp.swapaxes(hook.key_features(k, None)["content"], 1, 2)[:, :, None, :],
            q + params["position_bias"][None, None],
            context.query_positions,
            context.key_positions,
            tiled.tile_table,
            projection=params["position_projection"],
            project=project_distances,
            scale=0.3,
            identity=lambda shape=want.shape: jnp.full(shape, jnp.nan),
        )
        visible = k0 <= q0 + 5 if causal else True  # a causal call's table need not reach hidden tiles
        if visible:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"tile at {q0}, {k0}")
            np.testing.assert_allclose(tiled.tile_logits(q, k, context), want, rtol=1e-5, atol=1e-5)
    gap = whole.tile(jnp.asarray([[0, 1, 2, 3, 9, 10]]), 3 + jnp.arange(6)[None])
    want = hook.logits(q, k, dataclasses.replace(gap, causal=False))
    np.testing.assert_allclose(tiled.tile_logits(q, k, gap), want, rtol=1e-5, atol=1e-5)


def test_transformer_xl_scores_form_adds_its_rows_into_the_content_with_the_same_derivatives():
    """The scores form on a tile of 64 query rows (two blocks of 32, each added into the content scores where
    it lies, in place) equals the content plus the tile's terms: values, the gradients of q, k and every
    parameter, and forward-mode tangents."""
    config = small_config("transformer-xl")
    params = config.init(jax.random.key(1), num_heads=N, head_dim=H, model_dim=N * H)
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(jax.random.key(2), p.shape), params)
    whole = AttentionContext.from_positions(jnp.arange(90)[None], jnp.arange(90)[None], scale=0.3, causal=True)
    tile = whole.tile(20 + jnp.arange(64)[None], 30 + jnp.arange(6)[None])
    q, k, cotangent = (
        jax.random.normal(jax.random.key(i), s) for i, s in ((6, (B, 64, N, H)), (5, (B, 6, N, H)), (7, (B, N, 64, 6)))
    )
    content = lambda q, k: jnp.einsum("BTNH,BSNH->BNTS", q, k) * 0.3

    def scores(params, q, k, form):
        hook = config.build(params).for_tiles(whole, 64, 6)
        if form == "scores":
            return hook.tile_scores(q, k, tile, content)
        return content(q, k) + hook.tile_logits(q, k, tile)

    results = []
    for form in ("scores", "logits"):
        loss = lambda *args, form=form: jnp.sum(scores(*args, form) * cotangent)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, q, k)
        tangent = jax.jvp(lambda q, k, form=form: scores(params, q, k, form), (q, k), (q[::-1], k[::-1]))[1]
        results.append(jax.tree.leaves((scores(params, q, k, form), grads, tangent)))
    assert float(jnp.abs(results[1][0]).max()) > 1e-2
    for got, want in zip(*results, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["kerple-power", "fire", "cope", "shaw", "deberta", "rope", "transformer-xl"])
def test_tile_forms_forward_mode_equals_materialising(name):
    """jax.jvp through the tiles' own forms (no context manager), on a run with tiles of every kind:
    the tangent of the materialising path, with respect to q, k and v at once."""
    config = small_config(name, **(dict(num_positions=3) if name == "cope" else {}))
    params = config.init(jax.random.key(1), num_heads=N, head_dim=H, model_dim=N * H)
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(jax.random.key(2), p.shape), params)
    hooks = [config.build(params)]
    q, k, v, _ = _inputs()
    pos = RUNS
    q = jnp.concatenate([q, q[:, :2]], axis=1)  # T = S
    tangents = tuple(jax.random.normal(jax.random.key(7 + i), x.shape) for i, x in enumerate((q, k, v)))

    def attend(implementation, q, k, v):
        return dot_product_attention(
            q,
            k,
            v,
            query_positions=pos,
            key_positions=pos,
            encodings=hooks,
            causal=True,
            implementation=implementation,
            **(dict(block_q=4, block_k=4) if implementation == "blockwise" else {}),
        )

    # Each path's tangent one compiled program (run eagerly, every operation would compile on its own).
    tangent = jax.jit(
        lambda implementation, x, t: jax.jvp(functools.partial(attend, implementation), x, t)[1], static_argnums=0
    )
    got = tangent("blockwise", (q, k, v), tangents)
    want = tangent("materialize", (q, k, v), tangents)
    assert float(jnp.abs(want).max()) > 1e-2  # a tangent that can be wrong
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


NORMALIZERS = {
    "softmax": softmax_weights,
    "l2": l2_normalized_weights,
    "relu2 (sequence length)": ReLU2(),
    "relu2 (explicit n)": ReLU2(length=16),
    "relu2 (per row)": relu2_weights,
}


@pytest.mark.parametrize("normalizer", list(NORMALIZERS) + ["urpe"])
def test_every_normalizer_blockwise_equals_materialising(normalizer):
    """Causal and bidirectional, in one compiled program."""
    q, k, v, kwargs = _inputs(seed=4)
    weight = jax.random.normal(jax.random.key(5), (B, T, N, H))
    forms = [True, False]
    if normalizer == "urpe":  # the table's gradient: below
        table = 1.0 + 0.3 * jax.random.normal(jax.random.key(6), (N, 7))
        urpe = URPE(table, max_distance=3)
        _check_forms(lambda table: [ALiBi()], table, q, k, v, weight, forms, normalizer, normalizer=urpe, **kwargs)
    else:
        normalize = NORMALIZERS[normalizer]
        _check_forms(lambda _: [ALiBi()], {}, q, k, v, weight, forms, normalizer, normalizer=normalize, **kwargs)


def test_urpe_table_gradient_blockwise_equals_materialising():
    q, k, v, kwargs = _inputs(seed=7)
    weight = jax.random.normal(jax.random.key(8), (B, T, N, H))

    def loss(table, implementation):
        extra = dict(block_q=4, block_k=3) if implementation == "blockwise" else {}
        out = dot_product_attention(
            q,
            k,
            v,
            normalizer=URPE(table, max_distance=3),
            causal=True,
            implementation=implementation,
            **extra,
            **kwargs,
        )
        return jnp.sum(out * weight)

    table = 1.0 + 0.3 * jax.random.normal(jax.random.key(9), (N, 7))
    grad = jax.jit(jax.grad(loss), static_argnums=1)  # one program each, not op by op
    want = grad(table, "materialize")
    got = grad(table, "blockwise")
    _assert_close(want, got, 1e-4, "URPE table gradient")


@pytest.mark.parametrize(("block_q", "block_k"), [(3, 11), (9, 1), (64, 64)], ids=["divides", "one-key", "one-tile"])
def test_block_sizes_that_divide_the_lengths_or_cover_them(block_q, block_k):
    config = small_config("shaw")
    params = config.init(jax.random.key(1), num_heads=N, head_dim=H, model_dim=N * H)
    q, k, v, kwargs = _inputs(seed=10)
    weight = jax.random.normal(jax.random.key(11), (B, T, N, H))
    results = _both(
        lambda p: [config.build(p)], params, q, k, v, weight, block_q=block_q, block_k=block_k, causal=True, **kwargs
    )
    _check(results, f"blocks {block_q}x{block_k}")


def test_self_attention_with_an_extra_mask_and_unbatched_positions():
    rng = np.random.default_rng(12)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 10, 2, 8)), jnp.float32) for _ in range(3))
    pos = jnp.arange(10)
    extra = jnp.asarray(rng.random((1, 2, 10, 10)) < 0.7)
    outs = [
        dot_product_attention(
            q,
            k,
            v,
            query_positions=pos,
            key_positions=pos,
            causal=True,
            mask=extra,
            implementation=impl,
            block_q=3,
            block_k=4,
        )
        if impl == "blockwise"
        else dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, causal=True, mask=extra)
        for impl in ("materialize", "blockwise")
    ]
    _assert_close(outs[0], outs[1], 1e-5, "extra mask")


def test_masked_nan_keys_never_leak_and_empty_rows_are_zero():
    q, k, v, kwargs = _inputs(seed=13)
    # Padding holds NaN; and a key hidden from some queries only (by the causal mask) holds inf in v.
    k = jnp.where(kwargs["key_mask"][:, :, None, None], k, jnp.nan)
    v = jnp.where(kwargs["key_mask"][:, :, None, None], v, jnp.nan)
    v = v.at[0, 10].set(jnp.inf)  # key position 21: seen only by queries at 21 and later
    want = dot_product_attention(q, k, v, causal=True, **kwargs)
    got = dot_product_attention(q, k, v, causal=True, implementation="blockwise", block_q=4, block_k=3, **kwargs)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite], atol=1e-5)
    assert not finite.all() and finite[1].all()  # the inf reaches exactly the rows that see it
    # Query 0 (position 7) sees keys 1, 3, 5, 7 of its segment; a query before every key sees none.
    early = dot_product_attention(
        q,
        k,
        v,
        query_positions=jnp.zeros(T, jnp.int32),
        key_positions=kwargs["key_positions"] + 1,
        causal=True,
        key_mask=kwargs["key_mask"],
        implementation="blockwise",
        block_q=4,
        block_k=3,
    )
    np.testing.assert_array_equal(np.asarray(early), 0.0)


def test_auto_goes_blockwise_by_size_and_length_only(monkeypatch):
    """``auto``'s size rule: blockwise above the backend's budget of float32 scores, but never for a
    sequence within one default tile, however large the batch (the loop would be the materialised
    computation and its overhead); the CPU's budget is the measured 8 MiB."""
    import posenc_jax.functional.core.attention as attention

    assert attention.MATERIALIZE_LIMIT_BYTES_BY_BACKEND["cpu"] == 8 << 20
    monkeypatch.setitem(attention.MATERIALIZE_LIMIT_BYTES_BY_BACKEND, jax.default_backend(), 8 << 20)
    rule = functools.partial(attention.goes_blockwise, "auto")
    assert rule(batch=1, num_heads=4, query_length=1024, key_length=1024)  # 16 MiB, two tiles
    assert not rule(batch=1, num_heads=2, query_length=1024, key_length=1024)  # 8 MiB: within the budget
    assert not rule(batch=4096, num_heads=8, query_length=512, key_length=512)  # 32 GiB, but one tile
    assert rule(batch=64, num_heads=64, query_length=1, key_length=1024)  # a decoding step: 16 MiB of scores
    assert attention.goes_blockwise("blockwise", batch=1, num_heads=1, query_length=2, key_length=2)
    assert not attention.goes_blockwise("materialize", batch=64, num_heads=64, query_length=4096, key_length=4096)


def test_auto_goes_blockwise_above_the_budget(monkeypatch):
    import posenc_jax.functional.core.attention as attention
    import posenc_jax.functional.core.dispatch as dispatch

    q, k, v, kwargs = _inputs(seed=14)
    plain = dot_product_attention(q, k, v, causal=True, **kwargs)
    monkeypatch.setitem(attention.MATERIALIZE_LIMIT_BYTES_BY_BACKEND, jax.default_backend(), 16)
    monkeypatch.setattr(dispatch, "AUTO_TILED_FROM_LENGTH", 0)
    tiled, blockwise = [], attention.blockwise_attention
    monkeypatch.setattr(attention, "blockwise_attention", lambda *a, **kw: tiled.append(1) or blockwise(*a, **kw))
    auto = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, causal=True, **kwargs))(q, k, v)
    assert tiled  # the auto choice went blockwise
    _assert_close(plain, auto, 1e-5, "auto")
    # A normaliser without a tiled form falls back to materialising under "auto" ...
    tiled.clear()
    custom = lambda s, m: softmax_weights(s, m)
    jax.jit(lambda q, k, v: dot_product_attention(q, k, v, normalizer=custom, **kwargs))(q, k, v)
    assert not tiled


def test_a_models_shared_bias_follows_the_attentions_dispatch_rule(monkeypatch):
    # forward_terms computes a shared bias once ([B, N, T, S]) where the layers will materialise and
    # leaves it to the tiles where they go blockwise, by the rule the attention itself applies.
    import posenc_jax.functional.core.attention as attention
    import posenc_jax.functional.core.dispatch as dispatch
    from posenc_jax.functional import SharedBias

    positions = jnp.arange(6)
    terms = lambda implementation, hooks=(), normalizer=softmax_weights: attention.forward_terms(
        hooks,
        [ALiBi()],
        query_positions=positions,
        key_positions=positions,
        batch=1,
        num_heads=2,
        head_dim=8,
        causal=True,
        normalizer=normalizer,
        implementation=implementation,
    )[0][0]
    assert isinstance(terms("materialize"), SharedBias) and isinstance(terms("auto"), SharedBias)
    assert isinstance(terms("blockwise"), ALiBi)
    monkeypatch.setitem(attention.MATERIALIZE_LIMIT_BYTES_BY_BACKEND, jax.default_backend(), 16)
    monkeypatch.setattr(dispatch, "AUTO_TILED_FROM_LENGTH", 0)
    assert isinstance(terms("auto"), ALiBi)  # over the budget: the tiles compute it
    # ... unless something of the layer has no tiled form: "auto" then materialises, and so does the bias.
    assert isinstance(terms("auto", normalizer=lambda s, m: softmax_weights(s, m)), SharedBias)

    class Whole(MaterializeOnly, ALiBi):
        pass

    assert isinstance(terms("auto", hooks=[Whole()]), SharedBias)


def test_what_cannot_run_in_tiles_is_refused_by_name():
    q, k, v, kwargs = _inputs(seed=15)
    with pytest.raises(ValueError, match="the normalizer <lambda> has no blockwise form"):
        dot_product_attention(q, k, v, normalizer=lambda s, m: s, implementation="blockwise", **kwargs)

    class Opaque(MaterializeOnly, ALiBi):
        pass

    Opaque.__name__ = "Opaque"
    with pytest.raises(ValueError, match="Opaque cannot be computed per tile"):
        dot_product_attention(q, k, v, encodings=[Opaque()], implementation="blockwise", **kwargs)
    with pytest.raises(ValueError, match="return_weights=True needs the"):
        dot_product_attention(q, k, v, implementation="blockwise", return_weights=True, **kwargs)
    with pytest.raises(ValueError, match="implementation must be one of"):
        dot_product_attention(q, k, v, implementation="flash", **kwargs)
    with pytest.raises(ValueError, match="block_k must be a positive integer, got 0"):
        dot_product_attention(q, k, v, implementation="blockwise", block_k=0, **kwargs)
    with pytest.raises(ValueError, match="CoPE is defined for causal attention only"):
        dot_product_attention(
            q, k, v, encodings=[CoPE(jnp.zeros((6, H)))], implementation="blockwise", causal=False, **kwargs
        )


def test_dropout_in_tiles_keeps_the_expectation():
    q, k, v, kwargs = _inputs(seed=16)
    plain = dot_product_attention(q, k, v, causal=True, **kwargs)

    def dropped(key):
        return dot_product_attention(
            q,
            k,
            v,
            causal=True,
            implementation="blockwise",
            block_q=4,
            block_k=3,
            dropout_rate=0.3,
            dropout_rng=key,
            **kwargs,
        )

    mean = jnp.mean(jax.vmap(jax.jit(dropped))(jax.random.split(jax.random.key(0), 400)), axis=0)
    np.testing.assert_allclose(np.asarray(mean), np.asarray(plain), atol=0.12)
    assert not np.allclose(np.asarray(dropped(jax.random.key(1))), np.asarray(plain), atol=1e-3)


@pytest.mark.parametrize("implementation", ["materialize", "blockwise"])
def test_broadcast_dropout_draws_one_mask_for_every_row_and_head(implementation):
    """With ``broadcast_dropout`` (Flax's default in its layers) the dropped weights are the same ``[T, S]``
    pattern in every batch row and head; without, they differ. Read through values that are one-hot per key:
    each output row is then its weights after dropout (equal scores: 1/S kept, scaled, or 0)."""
    batch, length, heads = 2, 12, 3
    q = k = jnp.zeros((batch, length, heads, length))
    v = jnp.broadcast_to(jnp.eye(length)[None, :, None, :], (batch, length, heads, length))

    def dropped(broadcast):
        return dot_product_attention(
            q,
            k,
            v,
            implementation=implementation,
            block_q=4,
            block_k=5,
            dropout_rate=0.5,
            dropout_rng=jax.random.key(3),
            broadcast_dropout=broadcast,
        )

    one = np.asarray(dropped(True)) > 0  # [B, T, N, S]: which weights were kept
    assert 0.3 < one.mean() < 0.7
    assert all(np.array_equal(one[b, :, n], one[0, :, 0]) for b in range(batch) for n in range(heads))
    each = np.asarray(dropped(False)) > 0
    assert not all(np.array_equal(each[b, :, n], each[0, :, 0]) for b in range(batch) for n in range(heads))


def _temp_bytes(length, gradient=False, **kwargs):
    shape = jax.ShapeDtypeStruct((1, length, 2, 16), jnp.float32)
    pos = jnp.arange(length)

    def f(q, k, v):
        return dot_product_attention(
            q, k, v, query_positions=pos, key_positions=pos, causal=True, encodings=[ALiBi()], **kwargs
        )

    if gradient:
        f = jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v)), argnums=(0, 1, 2))
    return compiled(jax.jit(f).lower(shape, shape, shape)).memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("gradient", [False, True], ids=["forward", "gradient"])
def test_blockwise_temp_memory_grows_linearly(gradient):
    small = _temp_bytes(1024, gradient, implementation="blockwise", block_q=128, block_k=128)
    large = _temp_bytes(4096, gradient, implementation="blockwise", block_q=128, block_k=128)
    materialized = _temp_bytes(4096, gradient, implementation="materialize")
    assert large <= 4.5 * small, (small, large)
    assert materialized > 10 * large, (materialized, large)


@pytest.mark.long
def test_transformer_and_attention_module_pass_the_choice_down():
    from flax import nnx

    from posenc_jax.nn import MultiHeadAttention, Transformer

    tokens = jax.random.randint(jax.random.key(0), (2, 13), 0, 16)
    pos = jnp.arange(13) + 3
    key_mask = jnp.ones((2, 13), bool).at[1, -4:].set(False)
    model = Transformer(
        vocab_size=16,
        model_dim=32,
        num_layers=2,
        num_heads=4,
        mlp_dim=32,
        encoding=["t5", "shaw"],
        causal=True,
        block_q=4,
        block_k=5,
        rngs=nnx.Rngs(0),
    )
    # Each forward compiled whole (eager, the model's every operation would compile on its own).
    forward = lambda implementation=None: nnx.jit(
        lambda m: m(tokens, pos, key_mask=key_mask, implementation=implementation)
    )
    want, got = forward("materialize")(model), forward("blockwise")(model)
    _assert_close(want, got, 1e-5, "Transformer")
    tiled = Transformer(
        vocab_size=16,
        model_dim=32,
        num_layers=2,
        num_heads=4,
        mlp_dim=32,
        encoding=["t5", "shaw"],
        causal=True,
        implementation="blockwise",
        block_q=4,
        block_k=5,
        rngs=nnx.Rngs(0),
    )
    _assert_close(want, forward()(tiled), 1e-5, "Transformer(implementation='blockwise')")
    with pytest.raises(ValueError, match="implementation must be one of"):
        MultiHeadAttention(4, 32, implementation="fast", rngs=nnx.Rngs(0))
    mha = MultiHeadAttention(4, 32, encodings=["alibi"], implementation="blockwise", block_q=3, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 13, 32))
    call = nnx.jit(
        lambda m, implementation: m(x, query_positions=pos, causal=True, implementation=implementation),
        static_argnums=1,
    )
    _assert_close(call(mha, "materialize"), call(mha, None), 1e-5, "module")
