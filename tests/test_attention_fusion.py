"""The attention core's fast paths against their plain references, and the compiled program's shape.

The mask is kept as parts (:class:`~posenc_jax.functional.core.masks.MaskParts`): which keys some
query sees is computed from them, not by reducing the ``[B, N, T, S]`` mask; the softmax has
no selection after its exponential; the non-finite values term is a conditional that stays one
under ``vmap`` (:func:`~posenc_jax.functional.core.attention.cond_over_batch`).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.functional import dot_product_attention
from posenc_jax.functional.core.attention import cond_over_batch, masked_value_product
from posenc_jax.functional.core.masks import MaskParts, keys_seen_by_segment
from posenc_jax.functional.core.normalizers import softmax_weights

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
    want, got = _plain_softmax(scores, mask), softmax_weights(scores, mask)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[0, :, 0], 0.0)
    np.testing.assert_allclose(
        got[1, :, 2], np.broadcast_to(np.where(np.arange(9) % 2 == 0, 0.2, 0.0), (3, 9)), rtol=1e-6
    )
    assert bool((got[~np.broadcast_to(mask, got.shape)] == 0).all())  # exact zeros where masked, no selection

    cotangent = jnp.asarray(rng.normal(size=scores.shape), jnp.float32)
    grad = lambda fn: jax.grad(lambda s: (fn(s, mask) * cotangent).sum())(scores)
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


def test_cond_over_batch_stays_a_conditional_and_agrees_per_example(rng):
    true_fn = lambda x, y: x * 2.0 + y
    false_fn = lambda x, y: jnp.where(jnp.isfinite(x), x * 2.0, 0.0) + y  # true_fn's result where x is finite
    x = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(5,)), jnp.float32)
    run = lambda x, y: cond_over_batch(jnp.isfinite(x).all(), true_fn, false_fn, x, y)
    per_example = lambda x: np.stack([run(row, y) for row in x])
    batched = jax.jit(jax.vmap(run, in_axes=(0, None)))
    np.testing.assert_array_equal(batched(x, y), per_example(x))
    poisoned = x.at[2, 1].set(jnp.inf)  # one example sends the batch through false_fn
    np.testing.assert_array_equal(batched(poisoned, y), per_example(poisoned))
    assert "conditional(" in batched.lower(x, y).compile().as_text()
    nested = jax.jit(jax.vmap(jax.vmap(run, in_axes=(0, None)), in_axes=(0, None)))
    np.testing.assert_array_equal(nested(poisoned.reshape(2, 2, 5), y).reshape(4, 5), per_example(poisoned))
    assert "conditional(" in nested.lower(x.reshape(2, 2, 5), y).compile().as_text()
    # Only the predicate batched: the unbatched operands give every example the same result.
    only_pred = jax.vmap(lambda p: cond_over_batch(p, true_fn, false_fn, x[0], y))(jnp.array([True, False]))
    np.testing.assert_array_equal(only_pred, np.stack([true_fn(x[0], y)] * 2))


def test_masked_value_product_and_its_derivatives_are_the_plain_einsums(rng):
    length = 6
    parts = MaskParts(query_positions=jnp.arange(length), key_positions=jnp.arange(length))
    weights = softmax_weights(jnp.asarray(rng.normal(size=(2, 4, length, length)), jnp.float32), parts.mask())
    value = jnp.asarray(rng.normal(size=(2, length, 2, 3)), jnp.float32)  # grouped heads: N = 4, K = 2
    plain = lambda w, v: jnp.einsum("BNTS,BSNH->BTNH", w, jnp.repeat(v, 2, axis=2))
    fast = lambda w, v: masked_value_product(w, v, parts)
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
    got = jax.vjp(fast, weights, poisoned)[1](cotangent)[0]
    np.testing.assert_allclose(got, jax.vjp(plain, weights, clean)[1](cotangent)[0], rtol=1e-5, atol=1e-6)


def _attend(q, k, v):
    pos = jnp.arange(q.shape[0])
    out = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, causal=True)
    return out


def test_vmapped_attention_keeps_its_conditional_and_agrees_per_example(rng):
    q, k, v = (jnp.asarray(rng.normal(size=(3, 8, 2, 4)), jnp.float32) for _ in range(3))
    v = v.at[1, 5, 0, 2].set(jnp.nan)  # example 1's key 5 holds a NaN: rows 5.. of head 0 see it
    batched = jax.jit(jax.vmap(_attend))
    out = np.asarray(batched(q, k, v))
    for b in range(3):
        np.testing.assert_array_equal(out[b], _attend(q[b], k[b], v[b]))
    assert np.isfinite(out[[0, 2]]).all() and np.isfinite(out[1, :5]).all() and np.isnan(out[1, 5:, 0, 2]).all()
    assert "conditional(" in batched.lower(q, k, v).compile().as_text()

    loss = lambda q, k, v: (_attend(q, k, v) ** 2).sum()
    v = v.at[1, 5, 0, 2].set(1.0)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))
    for b in range(3):
        for got, want in zip(grads(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q[b], k[b], v[b]), strict=True):
            np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-6)
    assert "conditional(" in grads.lower(q, k, v).compile().as_text()


def _entry(text: str) -> str:
    return text[text.index("\nENTRY") :]


def test_compiled_causal_attention_stores_no_mask():
    """No ``pred[..., T, S]`` buffer: the causal comparison is computed inside the fusions that read it."""
    length = 64
    q = k = v = jnp.ones((1, length, 2, 8), jnp.float32)
    pos = jnp.arange(length)
    attend = jax.jit(
        lambda q, k, v, pos: dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, causal=True)
    )
    entry = _entry(attend.lower(q, k, v, pos).compile().as_text())
    stored = re.findall(rf"= pred\[[0-9,]*{length},{length}\]", entry)
    assert not stored, stored
    assert "conditional(" in entry  # the non-finite values term, skipped when every value is finite
