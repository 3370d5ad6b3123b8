"""Attention normalisers: the ``normalize`` hook, and the fixes for relative encodings' blind spot.

With softmax every row of attention weights sums to 1. On n identical tokens all
values are equal, so every position receives the same mixture, and a model whose
only positional information sits in the logits (NoPE, T5, ALiBi, RoPE, ...) gives
the same output at every position (Su 2022, on a theoretical flaw of relative
position encodings; Luo et al. 2022). Normalisers
whose row sums can vary with position lift that limit:

* :func:`softmax_weights` — ``exp(s) / Σ exp(s)`` (the default; rows sum to 1).
* :func:`l2_normalized_weights` — ``exp(s) / ‖exp(s)‖₂`` per row.
* :class:`ReLU2` — ``relu(s)² / n`` with n the sequence length, the same for every
  query row (gated attention units, Hua et al. 2022): the number of real keys of the
  query's sequence (its packed segment, without padding), or an explicit ``length``
  such as the training length. Under a causal mask row t sums ``t + 1`` terms over the
  same n, so row sums grow with position and the tie on identical tokens breaks.
  :func:`relu2_weights` is the per-row variant (n = the row's unmasked keys), whose rows
  all sum alike; it stays for comparison.
* :class:`URPE` — softmax weights multiplied elementwise by a learned Toeplitz
  matrix ``C[i, j] = c[clip(j - i, -k, k)]`` per head (Luo et al. 2022), ones at
  initialisation so it starts as softmax.

Every normaliser takes float32 scores ``[B, N, T, S]`` and a boolean mask (or None),
and gives zero weight to masked keys and zero rows for fully masked queries.

References: Luo et al., "Your Transformer May Not be as Powerful as You Expect",
NeurIPS 2022, arXiv:2205.13401; Hua et al., "Transformer Quality in Linear Time",
ICML 2022, arXiv:2202.10447.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.forms import Forms, declare_forms, declared_forms
from posenc_jax.functional.core.hooks import (
    AttentionContext,
    EncodingConfig,
    Normalize,
    Placement,
    parameter,
    pytree_dataclass,
)
from posenc_jax.functional.core.operations import broadcast_to
from posenc_jax.functional.core.relative import check_max_distance, expand_relative_bias

__all__ = [
    "NORMALIZERS",
    "FunctionNormalizer",
    "L2Normalized",
    "ReLU2PerRow",
    "Softmax",
    "as_normalizer",
    "URPE",
    "ReLU2",
    "URPEConfig",
    "l2_normalized_weights",
    "normalizer_config",
    "relu2_weights",
    "softmax_weights",
]

_MIN = jnp.finfo(jnp.float32).min


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _floor(x: jax.Array, low: float) -> jax.Array:
    """``max(x, low)`` whose tangent is ``x``'s: no mask of where it clamped is kept for the backward.

    For the softmax's floor, below which a score gets zero weight (or, in a row that has no score above it,
    a weight that the caller holds constant), so the clamped entries' gradient is zero either way.
    """
    return jnp.maximum(x, low)


@_floor.defjvp
def _floor_jvp(low, primals, tangents):
    return _floor(primals[0], low), tangents[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _shifted_exp(masked: jax.Array, shift: jax.Array, low: float) -> jax.Array:
    """``exp(masked - shift)``, with zero tangent in the rows whose ``shift`` (their maximum) is the floor ``low``.

    With ``masked`` from :func:`_floor`, a row whose every seen score is at or below the floor is uniform over
    its seen keys and gets no gradient, as ``max(s, low)`` gives it. ``shift`` is held constant (its tangent
    is ignored).
    """
    return jnp.exp(masked - shift)


@_shifted_exp.defjvp
def _shifted_exp_jvp(low, primals, tangents):
    masked, shift = primals
    out = _shifted_exp(masked, shift, low)
    return out, out * jnp.where(shift > low, tangents[0], 0.0)


def _visible(scores: jax.Array, mask: jax.Array | None) -> jax.Array:
    return jnp.ones(scores.shape, bool) if mask is None else jnp.broadcast_to(mask, scores.shape)


class _Running:
    """The tiled form shared by the normalisers with a running maximum (softmax, L2, URPE).

    A tile's weights are ``p = exp(s - m')`` with ``m'`` the running maximum of the row; the
    state ``(m, l)`` carries it and the running statistic ``l``, which the tile rescales by
    ``c = exp(m - m')`` (``c²`` for a sum of squares).
    """

    squares: ClassVar[bool] = False  # l sums p² (L2) instead of p

    def tile_init(self, rows: tuple[int, ...]):
        return jnp.full(rows, _MIN, jnp.float32), jnp.zeros(rows, jnp.float32)

    def tile_weights(self, scores, visible, state, context: AttentionContext):
        m, l = state
        # The floor keeps no mask for the backward; _shifted_exp gives no gradient to a row that has seen
        # no score above it, as max(s, finfo.min) does (a floored score elsewhere has weight exactly 0).
        masked = jnp.where(visible, _floor(scores, _MIN), _MIN)
        m_new = jax.lax.stop_gradient(jnp.maximum(m, masked.max(-1)))
        correction = jnp.exp(m - m_new)
        p = jnp.where(visible, _shifted_exp(masked, m_new[..., None], _MIN), 0.0)
        # L2 sums p², rescaled by c²; softmax and URPE sum p.
        l_new = l * correction * correction + (p * p).sum(-1) if self.squares else l * correction + p.sum(-1)
        return p, (m_new, l_new), correction

    def tile_denominator(self, state, context: AttentionContext):
        return jnp.sqrt(state[1]) if self.squares else state[1]


@pytree_dataclass
class Softmax(_Running):
    """Masked softmax over keys: ``w = exp(s - max s) · mask / Σ exp(s - max s) · mask``.

    The default ``normalize`` hook; :data:`softmax_weights` is its instance, called as a
    function ``softmax_weights(scores, mask)``. A row with no unmasked key gives all-zero
    weights (not NaN), and so do its gradients.

    Args:
      scores: ``[B, N, T, S]`` float32 scores.
      mask: boolean, broadcastable to ``scores`` (True = attend), or None.

    Returns:
      ``[B, N, T, S]`` float32 weights; each row sums to 1, or to 0 if fully masked.
    """

    def __call__(self, scores: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        scores = scores.astype(jnp.float32)
        if mask is None:
            return jax.nn.softmax(scores, axis=-1)
        # Masked scores become finfo.min; seen ones are kept at or above finfo.min / 2 (which also
        # replaces -inf), and so is the row maximum m. Then every masked key's exp(finfo.min - m)
        # underflows to exactly 0, also in a fully masked row, whose sum is 0 and whose weights
        # are 0 · (1 / tiny) = 0. Nothing is -inf, so no (s - m) is NaN. No selection follows
        # the exponential: the form XLA fuses into one pass, as jax.nn.dot_product_attention's.
        # The floor keeps no mask for the backward (its tangent passes through): a floored score in a row
        # with a seen score above the floor has weight exactly 0 (exp(finfo.min / 2 - m) underflows: m is
        # at least one float32 step, 2**104, above it), so its gradient is 0 as max's would be; a row with
        # no seen score above the floor is uniform over its seen keys, and _shifted_exp gives its scores
        # no gradient, as max does.
        masked = jnp.where(mask, _floor(scores, _MIN / 2), _MIN)
        shift = jnp.maximum(masked.max(axis=-1, keepdims=True), _MIN / 2)
        unnormalized = _shifted_exp(masked, jax.lax.stop_gradient(shift), _MIN / 2)
        total = unnormalized.sum(axis=-1, keepdims=True)
        return unnormalized * (1.0 / jnp.maximum(total, jnp.finfo(jnp.float32).tiny))

    def normalize(self, scores, mask, context: AttentionContext):
        return self(scores, mask)


@pytree_dataclass
class L2Normalized(_Running):
    """``w = e / ‖e‖₂`` with ``e = exp(s - max s)`` over the unmasked keys of each row.

    A row's weights have unit L2 norm, so their sum, ``‖e‖₁ / ‖e‖₂``, grows with the
    number of comparable keys: between 1 and √n. :data:`l2_normalized_weights` is its
    instance, called as a function ``(scores, mask) -> weights``.
    """

    squares: ClassVar[bool] = True

    def __call__(self, scores: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        scores = scores.astype(jnp.float32)
        visible = _visible(scores, mask)
        masked = jnp.where(visible, _floor(scores, _MIN), _MIN)  # as the tile's: no mask kept for the backward
        e = jnp.where(visible, _shifted_exp(masked, jax.lax.stop_gradient(masked.max(-1, keepdims=True)), _MIN), 0.0)
        norm = jnp.sqrt((e * e).sum(-1, keepdims=True))
        return e / jnp.where(norm > 0, norm, 1.0)

    def normalize(self, scores, mask, context: AttentionContext):
        return self(scores, mask)


@pytree_dataclass
class ReLU2PerRow:
    """``w = relu(s)² / n``, n = the number of unmasked keys in the row (the per-row variant).

    Not the published GAU normaliser (that is :class:`ReLU2`, n = the sequence length):
    with n counted per row, every row of a causal attention sums alike on identical tokens.
    :data:`relu2_weights` is its instance, called as a function ``(scores, mask) -> weights``.
    """

    def __call__(self, scores: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        scores = scores.astype(jnp.float32)
        visible = _visible(scores, mask)
        count = visible.sum(-1, keepdims=True).astype(jnp.float32)
        return jnp.where(visible, jnp.square(jax.nn.relu(scores)), 0.0) / jnp.maximum(count, 1.0)

    def normalize(self, scores, mask, context: AttentionContext):
        return self(scores, mask)

    def tile_init(self, rows: tuple[int, ...]):
        return jnp.zeros(rows, jnp.float32)  # the row's unmasked keys so far

    def tile_weights(self, scores, visible, state, context: AttentionContext):
        p = jnp.where(visible, jnp.square(jax.nn.relu(scores)), 0.0)
        return p, state + visible.sum(-1, dtype=jnp.float32), None

    def tile_denominator(self, state, context: AttentionContext):
        return jnp.maximum(state, 1.0)


softmax_weights = Softmax()
l2_normalized_weights = L2Normalized()
relu2_weights = ReLU2PerRow()


@pytree_dataclass
class ReLU2:
    """``w = relu(s)² / n`` with n the sequence length (gated attention units, Hua et al. 2022).

    A ``normalize`` hook. n is ``length`` when given (e.g. the training length, so that
    decoding with a cache, which does not know the final length, matches the full forward),
    else the number of real keys of the query's sequence: its packed segment without
    padding (``context.sequence_lengths``), or all S keys. The causal mask does not change
    n, so a causal row's weights sum over a growing number of keys.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 1, 2)); pos = jnp.arange(4)
      >>> out = dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, causal=True,
      ...                             normalizer=ReLU2())
      >>> [round(float(w), 3) for w in out[0, :, 0, 0]]  # row t: (t + 1) · relu(s)² / 4, s = 2/√2
      [0.5, 1.0, 1.5, 2.0]
    """

    length: int | None = None

    def __post_init__(self):
        if self.length is not None and (
            isinstance(self.length, bool) or not isinstance(self.length, (int, np.integer)) or self.length < 1
        ):
            raise ValueError(f"ReLU2 length must be a positive integer (e.g. the training length), got {self.length!r}")

    def _n(self, context: AttentionContext, fallback: int) -> jax.Array:
        """n per query row, ``[B|1, 1, T, 1]`` or a scalar."""
        if self.length is not None:
            return jnp.float32(self.length)
        if context.sequence_lengths is not None:
            return jnp.maximum(context.sequence_lengths[:, None, :, None], 1.0)
        return jnp.float32(max(context.key_length or fallback, 1))

    def normalize(self, scores, mask, context: AttentionContext):
        scores = scores.astype(jnp.float32)
        return jnp.where(_visible(scores, mask), jnp.square(jax.nn.relu(scores)), 0.0) / self._n(
            context, scores.shape[-1]
        )

    def tile_init(self, rows: tuple[int, ...]):
        return ()

    def tile_weights(self, scores, visible, state, context: AttentionContext):
        return jnp.where(visible, jnp.square(jax.nn.relu(scores)), 0.0), state, None

    def tile_denominator(self, state, context: AttentionContext):
        n = self._n(context, context.key_length)
        return n if n.ndim == 0 else n[..., 0]  # [B|1, 1, T]


@pytree_dataclass
class URPE(_Running):
    """Universal RPE: ``softmax(s) ⊙ C`` with ``C[n, i, j] = c[n, clip(j - i, -k, k) + k]``.

    ``table`` ``[N, 2k+1]`` is learned (ones at init: plain softmax). A ``normalize``
    hook: it reads the positions from the attention's context.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 5, 2, 4)); pos = jnp.arange(5)
      >>> urpe = URPE(jnp.ones((2, 7)), max_distance=3)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, normalizer=urpe).shape
      (1, 5, 2, 4)
    """

    table: jax.Array = parameter()
    max_distance: int = 16

    def __post_init__(self):
        k = check_max_distance(self.max_distance)
        if np.ndim(self.table) != 2 or np.shape(self.table)[1] != 2 * k + 1:
            raise ValueError(
                f"URPE table must have shape [N, 2*max_distance+1] = [N, {2 * k + 1}], got {np.shape(self.table)}"
            )

    def normalize(self, scores, mask, context: AttentionContext):
        if np.shape(self.table)[0] != scores.shape[1]:
            raise ValueError(f"URPE table has {np.shape(self.table)[0]} heads but the scores have {scores.shape[1]}")
        weights = softmax_weights(scores, mask)
        return weights * broadcast_to(self.tile_factor(context), weights.shape)

    def tile_factor(self, context: AttentionContext) -> jax.Array:
        """The Toeplitz factor ``C`` ``[B|1, N, T, S]`` for the context's positions (a tile's, blockwise)."""
        if context.query_positions is None or context.key_positions is None:
            raise ValueError(
                "query_positions and key_positions are required with a position-aware normalizer (URPE); for a "
                "plain sequence pass jnp.arange(T) and jnp.arange(S)"
            )
        return expand_relative_bias(self.table, context.query_positions, context.key_positions, self.max_distance)

    def tile_weights(self, scores, visible, state, context: AttentionContext):
        # The softmax's running sums, then the tile's factor: C multiplies the normalised weights.
        p, state, correction = super().tile_weights(scores, visible, state, context)
        return p * self.tile_factor(context), state, correction


@pytree_dataclass
class URPEConfig(EncodingConfig):
    """URPE with a learned ``c`` per head (``[N, 2k+1]``, ones at init), for the NNX modules."""

    max_distance: int = 16
    acts_on: ClassVar[Placement] = "normalizer"

    def __post_init__(self):
        check_max_distance(self.max_distance)

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return {"table": jnp.ones((num_heads, 2 * self.max_distance + 1), jnp.float32)}

    def build(self, params: dict) -> URPE:
        return URPE(params["table"], self.max_distance)


NORMALIZERS = {
    "softmax": softmax_weights,
    "l2": l2_normalized_weights,
    "relu2": ReLU2(),
    "urpe": URPEConfig(),
}


@pytree_dataclass
class FunctionNormalizer:
    """A plain function ``(scores, mask) -> weights`` as a ``normalize`` hook (materialising only).

    Its weights are set to zero where the mask is False (the function need not do it).
    """

    function: Callable[[jax.Array, jax.Array | None], jax.Array]

    def __repr__(self) -> str:
        return self.function.__name__ if inspect.isfunction(self.function) else repr(self.function)

    def normalize(self, scores, mask, context: AttentionContext):
        weights = self.function(scores, mask).astype(jnp.float32)
        return weights if mask is None else jnp.where(mask, weights, 0.0)


def as_normalizer(normalizer) -> Normalize:
    """The ``normalize`` hook for what a user passed: a hook, a registered name, or a plain function.

    A hook is an object whose class declares the ``normalize`` hook (``declare_forms(MyNormalizer,
    Forms(hooks=("normalize",)))``); an object of a class that declares nothing is taken as a plain
    function when it is callable, and refused otherwise. A registered name whose normaliser has learned
    parameters (``"urpe"``) is refused: build it (``URPEConfig().build(params)``) or let a module hold
    it (``MultiHeadAttention(normalizer="urpe")``).
    """
    if isinstance(normalizer, str):
        named = normalizer_config(normalizer)
        if isinstance(named, EncodingConfig):
            raise ValueError(
                f"normalizer={normalizer!r} has learned parameters; pass the built hook "
                f"({type(named).__name__}().build(params), e.g. URPE(table, max_distance)) or use it in a module "
                f"(MultiHeadAttention(..., normalizer={normalizer!r})), which holds them"
            )
        return named
    declared = declared_forms(normalizer)
    if declared is not None:
        if "normalize" not in declared.hooks:
            raise TypeError(
                f"normalizer={normalizer!r}: {type(normalizer).__name__} declares the hooks {list(declared.hooks)}, "
                f"not normalize; pass a normaliser (softmax_weights, ReLU2(), ...) or a function (scores, mask) -> "
                f"weights"
            )
        return normalizer
    if isinstance(normalizer, EncodingConfig):
        raise ValueError(
            f"normalizer={normalizer!r} is a config with learned parameters; pass its built hook "
            f"(config.build(params)) instead"
        )
    if callable(normalizer):
        return FunctionNormalizer(normalizer)
    raise TypeError(
        f"normalizer must be a normalize hook, a registered name ({', '.join(NORMALIZERS)}) or a function "
        f"(scores, mask) -> weights, got {normalizer!r}; a normaliser class of one's own declares its hook: "
        f"declare_forms({type(normalizer).__name__}, Forms(hooks=('normalize',)))"
    )


def normalizer_config(name: str):
    """The normaliser registered as ``name``: a function, or a config with learned parameters (URPE)."""
    if name not in NORMALIZERS:
        raise ValueError(f"unknown normalizer {name!r}; known normalizers: {', '.join(NORMALIZERS)}")
    return NORMALIZERS[name]


for _normalizer in (Softmax, L2Normalized, ReLU2PerRow, ReLU2, URPE):
    # softmax: exactly softmax, which the fused kernels compute themselves.
    declare_forms(_normalizer, Forms(hooks=("normalize",), tiled=("weights",), softmax=_normalizer is Softmax))
declare_forms(FunctionNormalizer, Forms(hooks=("normalize",)))
