"""FIRE: functional interpolation for relative positions (Li et al. 2023).

``logits[n, t, s] += f_θ( ψ(i - j) / ψ(max(L, i)) )[n]`` with ``i = query_pos[t]``,
``j = key_pos[s]``, ``ψ(x) = log(c·x + 1)``, a learned threshold ``L > 0`` and
``f_θ`` a small MLP (one hidden ReLU layer, one output per head). Dividing by
``ψ(max(L, i))`` maps every distance seen by query i into ``[0, 1]``, so a longer
sequence interpolates rather than extrapolates. Causal: future keys (``j > i``)
get distance 0 and are expected to be masked. Distances are exact integers until
the log (rounded once to float32), so the bias is right at any int32 position.

The bias is computed on ``[rows, S]`` blocks of query rows, each rematerialised (the backward
recomputes a block instead of keeping it), its MLP as :func:`~posenc_jax.functional.kernels.fire.fire_mlp`
evaluates it: ``f`` is piecewise linear in its one input, so each pair evaluates the line of its interval
between the ``hidden`` kinks, ``O(N)`` per pair, and the backward contracts the units' masks with the
cotangent once. The paper's form, ``[rows, S, hidden]`` activations and a contraction with ``w2``
(:func:`_paper_mlp`), is the reference it is tested against, values and every parameter's gradient. A
blockwise tile evaluates the same :func:`~posenc_jax.functional.kernels.fire.fire_mlp` (on the tile's
distances alone where its queries are below L). The Pallas kernel computes it per tile from the
per-head form (the tiled form ``head``): each head's ``w2`` row and ``b2``, and the shared ``w1``,
``b1``, ``c``, ``L`` repeated per head, the MLP summed unit by unit (about five operations per
hidden unit and score, forward; the backward kernels evaluate it again and pull the tile's score
cotangent back through it for every parameter's gradient). Every form computes the MLP's input with one
function (:func:`~posenc_jax.functional.kernels.fire.normalised_distance`); they sum the MLP in
different orders, so they agree to float32 rounding.

Reference: Li et al., "Functional Interpolation for Relative Positions Improves
Long Context Transformers", ICLR 2024, arXiv:2310.04418.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.head_bias import HeadBias, head_column
from posenc_jax.functional.core.hooks import (
    AttentionContext,
    BiasHook,
    EncodingConfig,
    Placement,
    parameter,
    pytree_dataclass,
)
from posenc_jax.functional.core.positions import batched_positions, position_difference
from posenc_jax.functional.core.products import broadcasts_to
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.core.relative import by_query_blocks, relative_positions
from posenc_jax.functional.core.validation import check_count, check_key, check_number
from posenc_jax.functional.kernels.fire import fire_mlp, fire_tile, normalised_distance

__all__ = ["Fire", "FireConfig", "fire_bias", "fire_init"]

FIRE = Source.paper(
    "li2023functional",
    title="Functional Interpolation for Relative Positions Improves Long Context Transformers",
    authors="Li, Shanda and You, Chong and Guruganesh, Guru and Ainslie, Joshua and Ontanon, Santiago and "
    "Zaheer, Manzil and Sanghai, Sumit and Yang, Yiming and Kumar, Sanjiv and Bhojanapalli, Srinadh",
    year=2023,
    arxiv="2310.04418",
)


def _check_settings(hidden, c, threshold) -> None:
    check_count("hidden", hidden, fix="the width of FIRE's MLP, 32 in the paper")
    check_number("c", c, above=0, fix="the log transform's scale, 0.1 by default")
    check_number("threshold", threshold, above=0, fix="the length L below which positions are not normalised, 512")


def fire_init(key: jax.Array, num_heads: int, *, hidden: int = 32, c: float = 0.1, threshold: float = 512.0) -> dict:
    """FIRE parameters whose bias starts monotone non-increasing in distance.

    ``w1 > 0`` with kinks ``-b1/w1`` inside ``[0, 1]`` and ``w2 < 0``, so
    ``f(x) = Σ_h w2[h, n] relu(w1[h] x + b1[h]) + b2[n]`` never increases with x
    (like ALiBi and Kerple at the start); training may change that.
    """
    check_key("key", key)
    check_count("num_heads", num_heads)
    _check_settings(hidden, c, threshold)
    k1, k2, k3 = jax.random.split(key, 3)
    w1 = jax.random.uniform(k1, (hidden,), minval=0.5, maxval=2.0)
    b1 = -w1 * jax.random.uniform(k2, (hidden,))
    w2 = -jax.random.uniform(k3, (hidden, num_heads)) / np.sqrt(hidden)
    return {
        "w1": w1,
        "b1": b1,
        "w2": w2,
        "b2": jnp.zeros((num_heads,)),
        "c": jnp.asarray(c, jnp.float32),
        "threshold": jnp.asarray(threshold, jnp.float32),
    }


def _check_params(params: dict) -> None:
    missing = {"w1", "b1", "w2", "b2", "c", "threshold"} - set(params)
    if missing:
        raise ValueError(f"FIRE params are missing {sorted(missing)}")


def _fire_head(params: dict) -> HeadBias:
    """FIRE's per-head form: rows ``w1``, ``b1`` (shared, repeated per head), ``w2ᵀ`` ``[N, hidden]`` and
    ``[b2, |c|, |L|]`` ``[N, 3]``, and :func:`_fire_at`. Gradients of the repeated rows sum back to the
    shared parameters."""
    _check_params(params)
    hidden, num_heads = np.shape(params["w2"])
    per_head = lambda name: jnp.broadcast_to(jnp.asarray(params[name], jnp.float32), (num_heads, hidden))
    scalar = lambda value: jnp.broadcast_to(jnp.asarray(value, jnp.float32), (num_heads,))
    scalars = jnp.stack(
        [
            scalar(params["b2"]),
            scalar(jnp.abs(jnp.asarray(params["c"], jnp.float32))),
            scalar(jnp.abs(jnp.asarray(params["threshold"], jnp.float32))),
        ],
        axis=1,
    )
    w2 = jnp.asarray(params["w2"], jnp.float32).T
    return HeadBias((per_head("w1"), per_head("b1"), w2, scalars), functools.partial(_fire_at, hidden))


def _fire_at(hidden: int, parameters, query_positions, key_positions) -> jax.Array:
    """FIRE's bias from its per-head form: ``b2 + Σ_h w2[h] · relu(w1[h] · x + b1[h])``, unit by unit."""
    w1, b1, w2, scalars = parameters
    b2, c, threshold = (head_column(scalars, i) for i in range(3))
    # i - j, exact until rounded once to float32; future keys (masked) at 0.
    distance = jnp.maximum(-position_difference(key_positions, query_positions, dtype=jnp.float32), 0.0)
    x = normalised_distance(distance, query_positions.astype(jnp.float32), c, threshold)
    total = None
    for h in range(hidden):
        unit = jax.nn.relu(x * head_column(w1, h) + head_column(b1, h)) * head_column(w2, h)
        total = unit if total is None else total + unit
    return total + b2


def fire_bias(
    params: dict, query_positions, key_positions, *, block_elements: int | None = None, into: jax.Array | None = None
) -> jax.Array:
    """FIRE bias ``[B|1, N, T, S]`` float32 from ``params`` (see :func:`fire_init`).

    Args:
      params: ``w1`` ``[hidden]``, ``b1`` ``[hidden]``, ``w2`` ``[hidden, N]``, ``b2`` ``[N]``,
        and positive scalars ``c`` and ``threshold`` (L).
      query_positions, key_positions: integer ``[T]``/``[B, T]``, ``[S]``/``[B, S]``.
      block_elements: about how many (query, key) pairs each block of rows holds; by default ``T·S·N /
        (4·hidden)``. Each block is rematerialised: the backward recomputes its MLP inputs instead of keeping
        them.
      into: optional float32 ``[B, N, T, S]`` scores: the bias is added to them block by block,
        in place, and ``into + bias`` is returned without the bias ever stored whole.

    Example:
      >>> params = fire_init(jax.random.key(0), 4)
      >>> fire_bias(params, jnp.arange(5), jnp.arange(5)).shape
      (1, 4, 5, 5)
    """
    return _fire_bias(params, query_positions, key_positions, block_elements=block_elements, into=into, mlp=fire_mlp)


def _paper_mlp(params: dict, x: jax.Array) -> jax.Array:
    """The paper's MLP, ``[B, N, ...]`` from ``x`` ``[B, ...]``: the activations ``relu(x·w1 + b1)``
    ``[B, ..., hidden]``, then their contraction with ``w2``, plus ``b2`` (the reference of
    :func:`~posenc_jax.functional.kernels.fire.fire_mlp`)."""
    w1, b1, w2, b2 = (jnp.asarray(params[name], jnp.float32) for name in ("w1", "b1", "w2", "b2"))
    h = jax.nn.relu(x[..., None] * w1.reshape((1,) * x.ndim + (-1,)) + b1.reshape((1,) * x.ndim + (-1,)))
    out = jnp.einsum("B...h,hN->BN...", h, w2)
    return out + b2.reshape((1, -1) + (1,) * (out.ndim - 2))


def _fire_bias(params: dict, query_positions, key_positions, *, block_elements, into, mlp) -> jax.Array:
    """:func:`fire_bias` with its MLP ``mlp(params, x)`` (``[B, N, ...]`` from ``x`` ``[B, ...]``)."""
    _check_params(params)
    hidden, num_heads = np.shape(params["w2"])
    q = batched_positions(query_positions, "query_positions")
    k = batched_positions(key_positions, "key_positions")
    c = jnp.abs(jnp.asarray(params["c"], jnp.float32))
    threshold = jnp.abs(jnp.asarray(params["threshold"], jnp.float32))
    batch = max(q.shape[0], k.shape[0])
    if block_elements is None:
        block_elements = q.shape[1] * k.shape[1] * num_heads // (4 * hidden)

    @functools.partial(jax.checkpoint, static_argnums=(1,))
    def block(start, rows):
        qb = jax.lax.dynamic_slice_in_dim(q, start, rows, axis=1)  # int32 [B|1, rows]
        # i - j as an exact integer, rounded once to float32 only for the log: a float32
        # difference of float32 positions would be off by up to 8 at position 1e8.
        distance = jnp.maximum(-relative_positions(qb, k, dtype=jnp.float32), 0.0)  # [B, rows, S]
        x = normalised_distance(distance, qb.astype(jnp.float32)[:, :, None], c, threshold)
        return jnp.broadcast_to(mlp(params, x), (batch, num_heads, rows, k.shape[1]))

    out_shape = (batch, num_heads, q.shape[1], k.shape[1])
    if into is not None:
        if into.ndim != 4 or not broadcasts_to(out_shape, into.shape):
            raise ValueError(f"into must be scores [B, N, T, S] the bias {out_shape} broadcasts to, got {into.shape}")
        out_shape = tuple(into.shape)
    return by_query_blocks(block, out_shape, jnp.float32, block_elements=max(1, block_elements * num_heads), into=into)


@pytree_dataclass
class Fire(BiasHook):
    """FIRE as a ``logits`` hook; ``params`` as made by :func:`fire_init`.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 2, 8)); pos = jnp.arange(4)
      >>> fire = Fire(fire_init(jax.random.key(0), 2))
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[fire], causal=True).shape
      (1, 4, 2, 8)
    """

    params: dict = parameter()

    def bias(self, context: AttentionContext) -> jax.Array:
        """The ``[B|1, N, T, S]`` bias, to compute once and share across layers."""
        return fire_bias(self.params, context.query_positions, context.key_positions)

    def add_logits(self, scores: jax.Array, q: jax.Array, k: jax.Array, context: AttentionContext) -> jax.Array:
        """``scores + bias``, the bias added by blocks of query rows into the scores (never stored whole)."""
        return fire_bias(self.params, context.query_positions, context.key_positions, into=scores)

    def tile_logits(self, q: jax.Array, k: jax.Array, context: AttentionContext) -> jax.Array:
        """The bias of one blockwise tile (:func:`~posenc_jax.functional.kernels.fire.fire_tile`): its MLP as the
        line of each pair's interval, on the tile's distances alone where its queries are below the threshold."""
        query_positions = batched_positions(context.query_positions, "query_positions")
        key_positions = batched_positions(context.key_positions, "key_positions")
        return fire_tile(self.params, query_positions, key_positions)

    def head_bias(self, context: AttentionContext) -> HeadBias:
        """The per-head form (the Pallas kernel computes the bias per tile; every parameter gets its gradient)."""
        context.check_heads(np.shape(self.params["w2"])[1], f"FIRE's w2 [hidden, N] {np.shape(self.params['w2'])}")
        return _fire_head(self.params)


@register_encoding(
    "fire",
    description="A learned MLP of the log distance over the log query position: it interpolates, not extrapolates.",
    source=FIRE,
    forms=("causal",),
    small_settings=dict(hidden=4),
    hook=Fire,
    hooks=("logits",),
    tiled=("logits", "head"),
    cached=(),
    prepared="bias",
    fused=("rows",),
)
@pytree_dataclass
class FireConfig(EncodingConfig):
    """FIRE MLP (``hidden`` units), ``c`` and threshold ``L``; see :func:`fire_init`."""

    hidden: int = 32
    c: float = 0.1
    threshold: float = 512.0
    acts_on: ClassVar[Placement] = "shared_bias"

    def __post_init__(self):
        _check_settings(self.hidden, self.c, self.threshold)

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return fire_init(key, num_heads, hidden=self.hidden, c=self.c, threshold=self.threshold)

    def build(self, params: dict) -> Fire:
        return Fire(params)
