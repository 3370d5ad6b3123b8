"""FIRE's bias for one blockwise tile, its MLP evaluated one hidden unit at a time.

:func:`~posenc_jax.functional.encodings.fire.fire_bias` writes the MLP as the paper does: the
``[T, S, hidden]`` activations, then a contraction with ``w2`` (by blocks of query rows, so
the activations are never stored whole). On a tile that contraction's operand is still
``[bq, bk, hidden]``, stored, and read again by its gradient. Written as a sum over the hidden
units, ``f(x)[n] = b2[n] + Σ_h w2[h, n] · relu(w1[h] · x + b1[h])`` is one elementwise
computation XLA fuses whole: no activation is stored, and the gradient recomputes each unit
where it needs it (``benchmarks/blockwise.py`` measures the tile's time and temporaries).

The same values up to the order of the sums; ``tests/test_blockwise.py`` holds blockwise FIRE
(through this form) to the materialising path (through the plain one), values and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.relative import relative_positions, toeplitz_where_runs

__all__ = ["fire_bias_by_units", "fire_tile"]


def fire_tile(params: dict, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """FIRE's bias on one blockwise tile, ``[B|1, N, bq, bk]`` float32.

    Where every query of the tile is at or below the threshold L, its normaliser is ``ψ(L)``
    for all of them and the bias depends on ``i - j`` alone: on a tile of consecutive
    positions the MLP then runs on the tile's ``bq + bk - 1`` distances only
    (:func:`~posenc_jax.functional.core.relative.toeplitz_where_runs`). Elsewhere
    :func:`fire_bias_by_units`. Either way the tile is one buffer, which XLA does not fuse into
    (and evaluate again in) each of the scores' consumers.
    """
    threshold = jnp.abs(jnp.asarray(params["threshold"], jnp.float32))
    below = jnp.all(query_positions.astype(jnp.float32) <= threshold)

    def per_distance(distance):  # j - i, float32 [B|1, D] -> [B|1, N, D]; queries at L
        level = jnp.broadcast_to(threshold, distance.shape)
        return _mlp(params, jnp.maximum(-distance, 0.0), level, axis=1)

    plain = lambda: fire_bias_by_units(params, query_positions, key_positions)
    return toeplitz_where_runs(per_distance, plain, query_positions, key_positions, also=below)


def fire_bias_by_units(params: dict, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """FIRE's bias ``[B|1, N, T, S]`` float32 with its MLP summed unit by unit (see the module's docstring).

    ``params`` as :func:`~posenc_jax.functional.encodings.fire.fire_init` makes them;
    positions int32 ``[B|1, T]`` and ``[B|1, S]``.
    """
    distance = jnp.maximum(-relative_positions(query_positions, key_positions, dtype=jnp.float32), 0.0)  # i - j
    # Rematerialised: the gradient recomputes each unit inside its own sums instead of storing 32 of them.
    mlp = jax.checkpoint(lambda params, distance, query: _mlp(params, distance, query, axis=1))
    return mlp(params, distance, query_positions.astype(jnp.float32)[:, :, None])


def _mlp(params: dict, distance: jax.Array, query: jax.Array, *, axis: int) -> jax.Array:
    """``f(ψ(i - j) / ψ(max(L, i)))`` per head, the heads stacked at ``axis``, summed unit by unit."""
    hidden, num_heads = np.shape(params["w2"])
    c = jnp.abs(jnp.asarray(params["c"], jnp.float32))
    threshold = jnp.abs(jnp.asarray(params["threshold"], jnp.float32))
    w1, b1, w2, b2 = (jnp.asarray(params[name], jnp.float32) for name in ("w1", "b1", "w2", "b2"))
    x = jnp.log1p(c * distance) / jnp.log1p(c * jnp.maximum(threshold, query))
    heads = [jnp.zeros_like(x) + b2[n] for n in range(num_heads)]
    for h in range(hidden):
        unit = jax.nn.relu(x * w1[h] + b1[h])
        heads = [out + w2[h, n] * unit for n, out in enumerate(heads)]
    return jnp.stack(heads, axis=axis)
