"""FIRE's MLP as a piecewise linear function of its one input, for the materialising path and for tiles.

The paper writes ``f(x)[n] = b2[n] + Σ_h w2[h, n] · relu(w1[h] · x + b1[h])``
(:func:`~posenc_jax.functional.encodings.fire.fire_bias`'s reference form: the ``[T, S, hidden]``
activations, then a contraction with ``w2``). Its input ``x`` is a scalar per (query, key) pair, so
``f`` is piecewise linear in ``x``, with a kink where a unit switches, at ``x = -b1[h] / w1[h]``: on
each of the ``hidden + 1`` intervals between the sorted kinks, ``f(x)[n] = A[k, n] · x + B[k, n]``,
``A`` and ``B`` summed over the units active there. :func:`fire_mlp` finds each pair's interval (one
comparison per kink) and evaluates that line, ``O(N)`` per pair instead of ``O(hidden · N)``, with no
activation stored. Its backward reads the cotangent ``g`` once, in chunks of pairs (no
``[pairs, hidden]`` array larger than a chunk is stored), and pulls it back through the units' masks
``m[h] = [w1[h] · x + b1[h] > 0]`` by one contraction, ``Σ_pairs m[h] · (g[n], g[n] · x)``: ``w2``'s
gradient is ``w1[h] · Σ m g x + b1[h] · Σ m g`` (``relu(z) = z · m``), ``w1``'s and ``b1``'s are those
sums through ``w2``, ``b2``'s the sum of ``g`` (a unit always on), and ``x``'s is ``A[k] · g`` at the
pair's interval. That backward is the transpose of the lines' tangent (``kernels.autodiff.tangent_primitive``),
so forward mode (``jax.jvp``) works too. The same function up to the order
of its sums (and at a kink, where the unit is 0); ``tests/test_fire_cost.py`` holds it to the
reference form, values and every parameter's gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.relative import relative_positions, toeplitz_where_runs
from posenc_jax.functional.kernels.autodiff import tangent_primitive

__all__ = ["fire_mlp", "fire_tile", "normalised_distance"]

# Pairs per chunk of the backward's contraction: its masks are [chunk, hidden] float32 (1 MiB at 32 units).
BACKWARD_CHUNK = 1 << 13


def fire_mlp(params: dict, x: jax.Array) -> jax.Array:
    """``f(x)`` per head, ``[B, N, ...]`` float32 from ``x`` float32 ``[B, ...]``: FIRE's MLP (``w1``, ``b1``,
    ``w2``, ``b2`` of ``params``, as :func:`~posenc_jax.functional.encodings.fire.fire_init` makes them) as
    the line of ``x``'s interval between its kinks (see the module's docstring); gradients to ``x`` and the
    four weights."""
    weights = tuple(jnp.asarray(params[name], jnp.float32) for name in ("w1", "b1", "w2", "b2"))
    return _fire_mlp(weights, jnp.asarray(x, jnp.float32))


def _lines(w1, b1, w2, b2):
    """The kinks sorted ``[hidden]`` and each interval's slope ``A`` and intercept ``B``, ``[hidden + 1, N]``.

    Interval ``k`` holds the ``x`` with ``k`` kinks below them. Unit ``h`` with ``w1[h] > 0`` is active
    where ``x`` exceeds its kink, so in the intervals ``k > lo[h]``, ``lo[h]`` the number of kinks strictly
    below its own; with ``w1[h] < 0`` where ``x`` is below it, ``k <= lo[h]``; with ``w1[h] = 0`` everywhere
    or nowhere, as ``b1[h] > 0``.
    """
    hidden = w1.shape[0]
    kinks = jnp.where(w1 != 0, -b1 / jnp.where(w1 != 0, w1, 1.0), jnp.inf)
    lo = jnp.sum(kinks[None, :] < kinks[:, None], axis=1)[None, :]
    k = jnp.arange(hidden + 1)[:, None]
    rising, falling, on = (w1 > 0)[None, :], (w1 < 0)[None, :], (b1 > 0)[None, :]
    active = jnp.where(rising, k > lo, jnp.where(falling, k <= lo, on)).astype(jnp.float32)
    return jnp.sort(kinks), active @ (w1[:, None] * w2), b2[None, :] + active @ (b1[:, None] * w2)


def _interval(x, kinks):
    """How many kinks lie strictly below each ``x``, int32 (one comparison per kink, summed where made)."""
    return jnp.sum(x[..., None] > kinks.reshape((1,) * x.ndim + (-1,)), axis=-1, dtype=jnp.int32)


def _by_heads(table, k, x=None):
    """``table[k, n] (· x)`` per head ``n``, stacked at axis 1: ``[B, N, ...]`` from ``k`` ``[B, ...]``."""
    heads = jnp.moveaxis(jnp.take(table.T, k, axis=1), 0, 1)
    return heads if x is None else heads * jnp.expand_dims(x, 1)


@jax.custom_jvp
def _fire_mlp(weights, x):
    kinks, slope, intercept = _lines(*weights)
    k = _interval(x, kinks)
    return _by_heads(slope, k, x) + _by_heads(intercept, k)


_FIRE_TANGENT = tangent_primitive("fire_mlp_tangent")


@_fire_mlp.defjvp
def _fire_mlp_jvp(primals, tangents):
    """Forward mode through the lines (:func:`_fire_mlp_tangent`); reverse mode is their transpose,
    :func:`_fire_mlp_backward`, with the weights and ``x`` as its residuals."""
    weights, x = primals
    d_weights, dx = tangents
    tangent = _FIRE_TANGENT(_fire_mlp_tangent, _fire_mlp_backward, (*d_weights, dx), (weights, x))
    return _fire_mlp(weights, x), tangent


def _fire_mlp_tangent(tangents, fixed):
    """``f``'s tangent at ``x`` (the active units, so the interval, are constant between the kinks): each
    interval's line moved by the weights' tangents, plus its slope times ``x``'s tangent."""
    weights, x = fixed
    *d_weights, dx = tangents
    (kinks, slope, _), (_, d_slope, d_intercept) = jax.jvp(_lines, weights, tuple(d_weights))
    k = _interval(x, kinks)
    return _by_heads(d_slope, k, x) + _by_heads(d_intercept, k) + _by_heads(slope, k, dx)


def _fire_mlp_backward(fixed, g):
    """Reverse mode: the cotangents of ``w1``, ``b1``, ``w2``, ``b2`` and ``x`` (see the module's docstring)."""
    (w1, b1, w2, b2), x = fixed
    kinks, slope, _ = _lines(w1, b1, w2, b2)
    heads, hidden = w2.shape[1], w1.shape[0]
    g = jnp.moveaxis(g, 1, 0).reshape(heads, -1)  # [N, pairs], the pairs in x's order
    flat = x.reshape(-1)
    pairs = flat.shape[0]
    chunk = min(BACKWARD_CHUNK, pairs)

    def add(i, carry):
        # One pass over g, a chunk of pairs at a time. The last chunk is shifted back to stay in bounds: the
        # pairs it shares with the one before count once in the sums (their dx is written again, equal).
        sums, dx = carry
        start = jnp.minimum(i * chunk, pairs - chunk)
        xs = jax.lax.dynamic_slice_in_dim(flat, start, chunk)
        gs = jax.lax.dynamic_slice_in_dim(g, start, chunk, axis=1)
        fresh = (start + jnp.arange(chunk) >= i * chunk)[:, None]
        # [chunk, hidden + 1]: each unit's ReLU derivative, as the paper's form computes it, and a unit always
        # on, whose sums are b2's gradient
        mask = jnp.concatenate([xs[:, None] * w1[None, :] + b1[None, :] > 0, fresh], axis=1) & fresh
        sums = sums + jnp.concatenate([gs, gs * xs[None, :]], axis=0) @ mask.astype(jnp.float32)
        dx_chunk = jnp.sum(_by_heads(slope, _interval(xs, kinks)[None])[0] * gs, axis=0)
        return sums, jax.lax.dynamic_update_slice_in_dim(dx, dx_chunk, start, axis=0)

    carry = (jnp.zeros((2 * heads, hidden + 1), jnp.float32), jnp.zeros_like(flat))
    sums, dx = jax.lax.fori_loop(0, -(-pairs // chunk), add, carry)
    plain, times_x = sums[:heads, :hidden].T, sums[heads:, :hidden].T  # [hidden, N]: Σ m g and Σ m g x
    dw2 = w1[:, None] * times_x + b1[:, None] * plain
    dw1 = jnp.sum(w2 * times_x, axis=1)
    db1 = jnp.sum(w2 * plain, axis=1)
    return dw1, db1, dw2, sums[:heads, hidden], dx.reshape(x.shape)


def fire_tile(params: dict, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """FIRE's bias on one blockwise tile, ``[B|1, N, bq, bk]`` float32.

    Where every query of the tile is at or below the threshold L, its normaliser is ``ψ(L)``
    for all of them and the bias depends on ``i - j`` alone: on a tile of consecutive
    positions the MLP then runs on the tile's ``bq + bk - 1`` distances only
    (:func:`~posenc_jax.functional.core.relative.toeplitz_where_runs`). Elsewhere on each pair. Either
    way :func:`fire_mlp`, and the tile is one buffer, which XLA does not fuse into (and evaluate again in)
    each of the scores' consumers.
    """
    c = jnp.abs(jnp.asarray(params["c"], jnp.float32))
    threshold = jnp.abs(jnp.asarray(params["threshold"], jnp.float32))
    below = jnp.all(query_positions.astype(jnp.float32) <= threshold)

    def per_distance(distance):  # j - i, float32 [B|1, D] -> [B|1, N, D]; queries at L
        return fire_mlp(params, normalised_distance(jnp.maximum(-distance, 0.0), threshold, c, threshold))

    def plain():
        distance = jnp.maximum(-relative_positions(query_positions, key_positions, dtype=jnp.float32), 0.0)
        query = query_positions.astype(jnp.float32)[:, :, None]
        return fire_mlp(params, normalised_distance(distance, query, c, threshold))

    return toeplitz_where_runs(per_distance, plain, query_positions, key_positions, also=below)


def normalised_distance(distance, query, c, threshold) -> jax.Array:
    """FIRE's MLP input ``ψ(i - j) / ψ(max(L, i))`` with ``ψ(x) = log(c·x + 1)``, for float32 distances
    ``i - j >= 0`` and query positions ``i`` broadcasting against them, ``c`` and ``L`` positive (every form
    of FIRE computes its MLP's input here)."""
    return jnp.log1p(c * distance) / jnp.log1p(c * jnp.maximum(threshold, query))
