"""The attention core's fast paths against their plain references, and their compiled cost.

The mask is kept as parts (:class:`~posenc_jax.functional.core.masks.MaskParts`): which keys some
query sees is computed from them, not by reducing the ``[B, N, T, S]`` mask; the softmax has
no selection after its exponential; the value product is exact whatever masked values hold at no more
arithmetic than plain attention's (:func:`~posenc_jax.functional.core.products.masked_value_product`). The
conditional that stays one under ``vmap`` (:func:`~posenc_jax.functional.core.control.cond_over_batch`), whose
rare branch runs only when an example needs it, is the in-``jit`` range checks'.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled

from posenc_jax.functional import dot_product_attention
from posenc_jax.functional.core.control import cond_over_batch
from posenc_jax.functional.core.masks import MaskParts, keys_seen_by_segment, queries_seeing_by_segment
from posenc_jax.functional.core.normalizers import softmax_weights
from posenc_jax.functional.core.products import NONFINITE_KEYS, masked_value_product

LOWEST = np.finfo(np.float32).min


def _plain_softmax(scores, mask):
    """The plain masked softmax: masked scores at finfo.min, a selection after the exponential and at the end."""
    masked = jnp.where(mask, jnp.maximum(scores, LOWEST), LOWEST)
    shifted = masked - jax.lax.stop_gradient(masked.max(axis=-1, keepdims=True))
    unnormalized = jnp.where(mask, jnp.exp(shifted), 0.0)
    total = unnormalized.sum(axis=-1, keepdims=True)
    return unnormalized / jnp.where(total > 0, total, 1.0)


def test_softmax_weights_match_the_plain_masked_softmax(rng):
    scores = jnp.asarray(rng.normal(size=(2, 3, 7, 9)) * 4, jnp.float32)
    mask = jnp.asarray(rng.random((2, 1, 7, 9)) < 0.6)
    mask = mask.at[0, 0, 0].set(False)  # a fully masked row
    scores = scores.at[1, :, 1, :4].set(-jnp.inf)  # -inf scores in a row that sees finite ones too
    mask = mask.at[1, 0, 1, :5].set(True)
    scores = scores.at[1, :, 2].set(-jnp.inf)  # a row whose every score is -inf: uniform over the seen keys
    mask = mask.at[1, 0, 2].set(jnp.arange(9) % 2 == 0)
    scores = scores.at[0, :, 3].set(jnp.where(mask[0, 0, 3], scores[0, 0, 3], jnp.nan))  # NaN only where masked
    want, got = jax.jit(_plain_softmax)(scores, mask), jax.jit(softmax_weights)(scores, mask)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[0, :, 0], 0.0)
    np.testing.assert_allclose(
        got[1, :, 2], np.broadcast_to(np.where(np.arange(9) % 2 == 0, 0.2, 0.0), (3, 9)), rtol=1e-6
    )
    assert bool((got[~np.broadcast_to(mask, got.shape)] == 0).all())  # exact zeros where masked, no selection

    cotangent = jnp.asarray(rng.normal(size=scores.shape), jnp.float32)
    grad = lambda fn: jax.jit(jax.grad(lambda s: (fn(s, mask) * cotangent).sum()))(scores)
    np.testing.assert_allclose(grad(softmax_weights), grad(_plain_softmax), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(grad(softmax_weights)[0, :, 0], 0.0)


def _random_parts(rng, kind, batch=3, q_len=6, k_len=8):
    qpos = jnp.asarray(np.sort(rng.integers(0, 12, size=(batch, q_len)), axis=-1), jnp.int32)  # gapped, repeated
    kpos = jnp.asarray(np.sort(rng.integers(0, 12, size=(batch, k_len)), axis=-1), jnp.int32)
    qseg = jnp.asarray(rng.integers(0, 3, size=(batch, q_len)), jnp.int32)
    kseg = jnp.asarray(rng.integers(0, 4, size=(batch, k_len)), jnp.int32)  # segment 3 has no query
    valid = jnp.asarray(rng.random((batch, k_len)) < 0.7)
    extra = jnp.asarray(rng.random((batch, 2, q_len, k_len)) < 0.2)
    causal = dict(query_positions=qpos, key_positions=kpos)
    segments = dict(query_segment_ids=qseg, key_segment_ids=kseg)
    return {
        "causal": MaskParts(**causal),
        "causal, one position row": MaskParts(query_positions=qpos[0], key_positions=kpos),
        "padding": MaskParts(key_valid=valid),
        "causal + padding": MaskParts(**causal, key_valid=valid),
        "segments": MaskParts(**segments),
        "segments + causal": MaskParts(**segments, **causal),
        "segments + causal + padding": MaskParts(**segments, **causal, key_valid=valid),
        "extra": MaskParts(extra=extra),
        "extra + causal": MaskParts(**causal, extra=extra),
    }[kind]


KINDS = [
    "causal",
    "causal, one position row",
    "padding",
    "causal + padding",
    "segments",
    "segments + causal",
    "segments + causal + padding",
    "extra",
    "extra + causal",
]


@pytest.mark.parametrize("kind", KINDS)
def test_queries_seeing_equal_the_reduced_mask(rng, kind):
    for _ in range(5):
        parts = _random_parts(rng, kind)
        marked = jnp.asarray(rng.random((3, 8)) < 0.3)
        want = np.asarray(parts.mask() & marked[:, None, None, :]).any(axis=3)
        got = np.asarray(parts.queries_seeing(marked))
        np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)
    seen = queries_seeing_by_segment(
        jnp.array([5, 5, 9]), jnp.array([9, 1, 5, 5]), jnp.array([True, True, False, False])
    )
    np.testing.assert_array_equal(seen, [[False, False, True]])  # ids need not be small


@pytest.mark.parametrize("kind", KINDS)
def test_keys_seen_equal_the_reduced_mask(rng, kind):
    for _ in range(5):
        parts = _random_parts(rng, kind)
        mask = parts.mask()
        want = np.asarray(mask).any(axis=(1, 2))
        got = np.asarray(parts.keys_seen())
        np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)
        assert not parts.per_key() or (mask.shape[1] == mask.shape[2] == 1)


def test_per_key_masks_and_keys_seen_by_segment_without_positions(rng):
    valid = jnp.asarray([[True, False, True]])
    assert MaskParts(key_valid=valid).per_key() and MaskParts().per_key() and MaskParts().keys_seen() is None
    one_query = MaskParts(query_positions=jnp.array([2]), key_positions=jnp.arange(3))  # a decoding step
    assert one_query.per_key()
    assert not MaskParts(query_positions=jnp.arange(3), key_positions=jnp.arange(3)).per_key()
    seen = keys_seen_by_segment(jnp.array([5, 5, 9]), jnp.array([9, 1, 5, 5]))  # ids need not be small
    np.testing.assert_array_equal(seen, [[True, False, True, True]])


def test_cond_over_batch_runs_the_rare_branch_only_when_an_example_needs_it(rng):
    """Under ``vmap`` the whole batch takes one branch: ``false_fn`` (which records each run, at run time)
    does not run for a batch whose every example satisfies the predicate, as it does under ``lax.cond``."""
    runs = []

    def false_fn(x, y):  # true_fn's result where x is finite
        jax.debug.callback(lambda x: runs.append(x.shape), x)
        return jnp.where(jnp.isfinite(x), x * 2.0, 0.0) + y

    def ran(fn, *args):
        runs.clear()
        out = jax.block_until_ready(fn(*args))
        jax.effects_barrier()
        return out, len(runs)

    true_fn = lambda x, y: x * 2.0 + y
    x = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(5,)), jnp.float32)
    run = lambda x, y: cond_over_batch(jnp.isfinite(x).all(), true_fn, false_fn, x, y)
    per_example = lambda x: np.stack([run(row, y) for row in x])
    poisoned = x.at[2, 1].set(jnp.inf)  # one example sends the batch through false_fn
    batched = jax.jit(jax.vmap(run, in_axes=(0, None)))
    nested = jax.jit(jax.vmap(jax.vmap(run, in_axes=(0, None)), in_axes=(0, None)))
    for fn, shape in ((batched, (4, 5)), (nested, (2, 2, 5))):
        out, count = ran(fn, x.reshape(shape), y)
        np.testing.assert_array_equal(out.reshape(4, 5), per_example(x))
        assert count == 0
        out, count = ran(fn, poisoned.reshape(shape), y)
        np.testing.assert_array_equal(out.reshape(4, 5), per_example(poisoned))
        assert count > 0
    # The check can fail: vmap turns lax.cond with a batched predicate into a select of both branches.
    plain = jax.jit(jax.vmap(lambda x, y: jax.lax.cond(jnp.isfinite(x).all(), true_fn, false_fn, x, y), (0, None)))
    assert ran(plain, x, y)[1] > 0
    # Only the predicate batched: the unbatched operands give every example the same result.
    only_pred = jax.vmap(lambda p: cond_over_batch(p, true_fn, false_fn, x[0], y))(jnp.array([True, False]))
    np.testing.assert_array_equal(only_pred, np.stack([true_fn(x[0], y)] * 2))


def test_masked_value_product_and_its_derivatives_are_the_plain_einsums(rng):
    length = 6
    parts = MaskParts(query_positions=jnp.arange(length), key_positions=jnp.arange(length))
    weights = softmax_weights(jnp.asarray(rng.normal(size=(2, 4, length, length)), jnp.float32), parts.mask())
    value = jnp.asarray(rng.normal(size=(2, length, 2, 3)), jnp.float32)  # grouped heads: N = 4, K = 2
    plain = lambda w, v: jnp.einsum("BNTS,BSNH->BTNH", w, jnp.repeat(v, 2, axis=2))
    fast = lambda w, v: masked_value_product(w, v, parts.mask())
    np.testing.assert_allclose(fast(weights, value), plain(weights, value), rtol=1e-6, atol=1e-6)
    tangents = (jnp.asarray(rng.normal(size=weights.shape), jnp.float32), jnp.asarray(rng.normal(size=value.shape)))
    np.testing.assert_allclose(
        jax.jvp(fast, (weights, value), tangents)[1],
        jax.jvp(plain, (weights, value), tangents)[1],
        rtol=1e-5,
        atol=1e-6,
    )
    cotangent = jnp.asarray(rng.normal(size=(2, length, 4, 3)), jnp.float32)
    for got, want in zip(
        jax.vjp(fast, weights, value)[1](cotangent), jax.vjp(plain, weights, value)[1](cotangent), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # A NaN at key 3: rows before it stay exact, and the derivative is the einsum's on the finite values.
    poisoned = value.at[0, 3, 1, 2].set(jnp.nan)
    clean = value.at[0, 3, 1, 2].set(0.0)
    out = np.asarray(fast(weights, poisoned))
    np.testing.assert_allclose(out[0, :3], plain(weights, clean)[0, :3], rtol=1e-6, atol=1e-6)
    assert np.isnan(out[0, 3:, 2:, 2]).all() and np.isfinite(out[0, :, :2]).all() and np.isfinite(out[1]).all()
    np.testing.assert_allclose(out[0, 3:, 2:, :2], plain(weights, clean)[0, 3:, 2:, :2], rtol=1e-6, atol=1e-6)
    got = jax.vjp(fast, weights, poisoned)[1](cotangent)[0]
    np.testing.assert_allclose(got, jax.vjp(plain, weights, clean)[1](cotangent)[0], rtol=1e-5, atol=1e-6)
    tangent = jax.jvp(fast, (weights, poisoned), tangents)[1]
    finite_tangents = (tangents[0], tangents[1].at[0, 3, 1, 2].set(0.0))
    np.testing.assert_allclose(tangent, jax.jvp(plain, (weights, clean), finite_tangents)[1], rtol=1e-5, atol=1e-6)


def _seen_reference(weights, value, mask):
    """The rule of masked_value_product in NumPy, elementwise: ``Σ_s where(mask, w · v_finite + v̄, 0)``
    with ``v_finite`` the finite entries (others 0) and ``v̄`` the non-finite ones (others 0), IEEE sums."""
    weights, value, mask = (np.asarray(x) for x in (weights, value, mask))
    per_head = np.repeat(value, weights.shape[1] // value.shape[2], axis=2).transpose(0, 2, 1, 3)[:, :, None]
    finite = np.isfinite(per_head)
    seen = np.broadcast_to(mask, weights.shape)[..., None]  # [B, N, T, S, 1]
    with np.errstate(invalid="ignore", over="ignore"):
        terms = weights[..., None] * np.where(finite, per_head, 0) + np.where(finite, 0, per_head)
        out = np.where(seen, terms, np.float32(0)).sum(axis=3)
    return out.transpose(0, 2, 1, 3)


def _poisoned_case(rng, head_dim, *, k_len, bad_keys):
    """Weights (some seen keys of weight 0, batch row 1 negative), a mask per head, grouped heads, and
    values whose ``bad_keys`` keys of batch row 0 and ``min(bad_keys, 3)`` of row 1 hold NaN, +inf or -inf
    in some features (both infinities at one feature of two keys)."""
    batch, num_kv, group, q_len = 2, 2, 2, 7
    mask = jnp.asarray(rng.random((batch, num_kv * group, q_len, k_len)) < 0.5)
    weights = rng.random(mask.shape).astype(np.float32)
    weights[rng.random(mask.shape) < 0.15] = 0.0  # seen keys of weight 0
    weights[1] *= -1.0  # a normaliser may give negative weights
    weights = jnp.where(mask, jnp.asarray(weights), 0.0)
    value = rng.normal(size=(batch, k_len, num_kv, head_dim)).astype(np.float32)
    for b, count in enumerate((bad_keys, min(bad_keys, 3))):
        for key in rng.choice(k_len, count, replace=False):
            entries = rng.random((num_kv, head_dim)) < 0.3
            entries[rng.integers(num_kv), rng.integers(head_dim)] = True
            value[b, key][entries] = rng.choice([np.nan, np.inf, -np.inf], entries.sum())
    value[0, :2, 0, 0] = (np.inf, -np.inf)
    return weights, jnp.asarray(value), mask


@pytest.mark.parametrize("head_dim", [3, 33, 70])
def test_masked_value_product_gives_what_the_seen_values_give_bit_for_bit(rng, head_dim):
    """Every non-finite entry of the keys the row may see, and only those: NaN, +inf, -inf, both
    infinities (NaN), whatever the weight there (0, negative); grouped heads; per-head and shared masks."""
    weights, value, mask = _poisoned_case(rng, head_dim, k_len=12, bad_keys=NONFINITE_KEYS)
    want = _seen_reference(weights, value, mask)
    finite = np.isfinite(want)
    assert 0.05 < finite.mean() < 0.95 and np.isposinf(want).any() and np.isneginf(want).any()
    shared = mask[:, :1]  # a mask shared by every head, [B, 1, T, S]
    cases = [(weights, mask, want), (jnp.where(shared, weights, 0.0), shared, None)]
    for w, m, want in cases:
        want = _seen_reference(w, value, m) if want is None else want
        for got in (masked_value_product(w, value, m), jax.jit(masked_value_product)(w, value, m)):
            got = np.asarray(got)
            for test in (np.isnan, np.isposinf, np.isneginf):
                np.testing.assert_array_equal(test(got), test(want))
            np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_masked_value_product_from_mask_parts_and_past_its_exact_keys(rng, kind):
    """Past NONFINITE_KEYS keys holding non-finite values, a row that may see a further one is NaN in
    every feature; every other row is as before. From mask parts (queries seeing a key found in linear
    memory) as from the whole mask."""
    parts = _random_parts(rng, kind, k_len=24)
    mask = jnp.broadcast_to(parts.mask(), (3, 2, 6, 24))
    weights = jnp.where(mask, jnp.asarray(rng.random(mask.shape), jnp.float32), 0.0)
    value = rng.normal(size=(3, 24, 1, 5)).astype(np.float32)
    value[0, rng.choice(24, 14, replace=False), 0, rng.integers(5)] = np.nan  # past the 8th in row 0 only
    value[1, 3, 0, :2] = (np.inf, -np.inf)
    value = jnp.asarray(value)
    want = _seen_reference(weights, value, mask)
    bad = ~np.isfinite(np.asarray(value)).all(axis=(2, 3))
    further = bad & (np.cumsum(bad, axis=1) > NONFINITE_KEYS)  # [B, S]
    reached = (np.asarray(mask) & further[:, None, None, :]).any(-1).transpose(0, 2, 1)  # [B, T, N]
    for m in (parts, mask):
        got = np.asarray(jax.jit(masked_value_product)(weights, value, m))
        assert np.isnan(got[reached]).all()
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(got[~reached]), test(want[~reached]))
        finite = np.isfinite(want) & ~reached[..., None]
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)


def _attend(q, k, v):
    pos = jnp.arange(q.shape[0])
    out = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, causal=True)
    return out


def test_vmapped_attention_agrees_per_example(rng):
    q, k, v = (jnp.asarray(rng.normal(size=(3, 8, 2, 4)), jnp.float32) for _ in range(3))
    v = v.at[1, 5, 0, 2].set(jnp.nan)  # example 1's key 5 holds a NaN: rows 5.. of head 0 see it
    batched = jax.jit(jax.vmap(_attend))
    out = np.asarray(batched(q, k, v))
    for b in range(3):
        np.testing.assert_array_equal(out[b], _attend(q[b], k[b], v[b]))
    assert np.isfinite(out[[0, 2]]).all() and np.isfinite(out[1, :5]).all() and np.isnan(out[1, 5:, 0, 2]).all()

    loss = lambda q, k, v: (_attend(q, k, v) ** 2).sum()
    v = v.at[1, 5, 0, 2].set(1.0)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))
    for b in range(3):
        for got, want in zip(grads(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q[b], k[b], v[b]), strict=True):
            np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-6)


def test_vmapped_causal_attention_costs_what_plain_attention_costs():
    """Masked values never reaching an output costs no second pass: vmapped causal attention and its gradient do
    at most 1.25x the arithmetic of ``jax.nn.dot_product_attention`` (XLA's cost analysis). The value product
    behind a conditional with an exact branch, as it was, did 1.75x forward and 1.28x forward+backward."""
    q = jax.ShapeDtypeStruct((3, 64, 2, 16), jnp.float32)
    plain = lambda q, k, v: jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    flops = lambda fn: compiled(jax.jit(fn).lower(q, q, q)).cost_analysis()["flops"]
    gradient = lambda fn: jax.vmap(jax.grad(lambda q, k, v: (fn(q, k, v) ** 2).sum(), argnums=(0, 1, 2)))
    assert flops(jax.vmap(_attend)) <= 1.25 * flops(jax.vmap(plain))
    assert flops(gradient(_attend)) <= 1.25 * flops(gradient(plain))


def test_jvp_through_causal_attention(rng):
    """Forward mode works as it is (no custom rule, no context manager) and equals the plain
    attention's; a NaN in a future key's value leaves the rows before it and their tangents exact."""
    q, k, v, dq, dk, dv = (jnp.asarray(rng.normal(size=(2, 8, 2, 4)), jnp.float32) for _ in range(6))
    pos = jnp.arange(8)
    attend = lambda q, k, v: dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, causal=True)
    plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    jvp = jax.jit(lambda fn, *args: jax.jvp(fn, args[:3], args[3:]), static_argnums=0)  # one program each
    out, tangent = jvp(attend, q, k, v, dq, dk, dv)
    want_out, want_tangent = jvp(plain, q, k, v, dq, dk, dv)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tangent, want_tangent, rtol=1e-5, atol=1e-5)
    out, tangent = jax.jit(lambda v: jax.jvp(attend, (q, k, v), (dq, dk, dv)))(v.at[0, 5, 1, 3].set(jnp.nan))
    np.testing.assert_allclose(out[0, :5], want_out[0, :5], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tangent[0, :5], want_tangent[0, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[1], want_out[1], rtol=1e-5, atol=1e-6)
    assert np.isnan(out[0, 5:, 1, 3]).all() and np.isfinite(out[0, :, 0]).all()


def test_causal_attention_needs_no_more_temporary_memory_than_unmasked_attention():
    """No ``[T, S]`` mask is stored: the causal comparison is computed inside the computations that read it, so
    causal attention's compiled temporary memory is unmasked attention's, within a quarter of the mask's bytes."""
    length = 256
    spec = jax.ShapeDtypeStruct((1, length, 2, 8), jnp.float32)
    pos = jax.ShapeDtypeStruct((length,), jnp.int32)

    def temp(attend):
        return compiled(jax.jit(attend).lower(spec, spec, spec, pos)).memory_analysis().temp_size_in_bytes

    def attention(mask=None, causal=True):
        return lambda q, k, v, pos: dot_product_attention(
            q,
            k,
            v,
            query_positions=pos,
            key_positions=pos,
            causal=causal,
            mask=None if mask is None else mask(pos),
            implementation="materialize",
        )

    unmasked = temp(attention(causal=False))
    assert temp(attention()) - unmasked < length * length // 4
    # The check can fail: a causal mask built and kept whole (its comparison not fused into its readers).
    stored = lambda pos: jax.lax.optimization_barrier(pos[:, None] >= pos[None, :])
    assert temp(attention(mask=stored)) - unmasked >= length * length


def test_cond_over_batch_is_in_control_and_its_old_name_warns():
    from posenc_jax.functional.core import attention, control

    with pytest.warns(DeprecationWarning, match=r"import it from posenc_jax\.functional\.core\.control"):
        assert attention.cond_over_batch is control.cond_over_batch
