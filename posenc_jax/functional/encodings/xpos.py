"""xPos: RoPE with an exponential decay of the scores with distance (Sun et al. 2022).

Each rotation pair i gets a decay base ``ζ_i = (2i/R + γ) / (1 + γ)`` in (0, 1);
queries are scaled by ``ζ_i ** ((m - c) / scale_base)`` and keys by
``ζ_i ** (-(n - c) / scale_base)`` after RoPE, so the score of query m and key n
carries ``ζ_i ** ((m - n) / scale_base)``: it depends on positions only through
``n - m`` and decays for past keys. The centre ``c`` (the midpoint of the query
positions) cancels in every score and keeps the scale factors near 1; each factor
is clamped to ``e^±60``, so far from the centre (about ``60 / |ln ζ_i| · scale_base``
positions) the decay saturates instead of overflowing. The scaled q and k are kept in
float32 when the input is float16, whose range is too narrow for them. Layout of pairs
as in :mod:`posenc_jax.functional.encodings.rope`.

Reference: Sun et al., "A Length-Extrapolatable Transformer", ACL 2023,
arXiv:2212.10554 (γ = 0.4, scale_base = 512 as in the authors' code).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.forms import Forms, declare_forms
from posenc_jax.functional.core.hooks import (
    AttentionContext,
    ParameterFree,
    parameter,
    pytree_dataclass,
    rotation_context,
)
from posenc_jax.functional.core.positions import (
    batched_positions,
    check_positions,
    inverse_frequencies,
    position_difference,
)
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.core.validation import check_number
from posenc_jax.functional.encodings.rope import (
    Layout,
    _check_head,
    _check_layout,
    _rotate,
    rope_inverse_frequencies,
    rope_tables,
)

__all__ = ["XPos", "XPosAbout", "apply_xpos_qk", "xpos_centre", "xpos_decay_bases"]

XPOS = Source.paper(
    "sun2022length",
    title="A Length-Extrapolatable Transformer",
    authors="Sun, Yutao and Dong, Li and Patra, Barun and Ma, Shuming and Huang, Shaohan and Benhaim, Alon and "
    "Chaudhary, Vishrav and Song, Xia and Wei, Furu",
    year=2022,
    arxiv="2212.10554",
)


def xpos_decay_bases(rotary_dim: int, *, gamma: float = 0.4) -> np.ndarray:
    """``ζ_i = (2i/R + γ) / (1 + γ)`` for ``i < R/2``, float64."""
    rope_inverse_frequencies(rotary_dim)  # validates rotary_dim
    gamma = check_number("gamma", gamma, above=0, fix="0.4 in the paper")
    return (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim + gamma) / (1 + gamma)


def xpos_centre(query_positions: jax.Array) -> jax.Array:
    """The default centre, the midpoint ``⌊(min + max) / 2⌋`` of each example's query positions: ``[B|1, 1]``."""
    q_batched = batched_positions(query_positions)
    low, high = q_batched.min(axis=-1, keepdims=True), q_batched.max(axis=-1, keepdims=True)
    # floor((low + high) / 2) without forming low + high, which can leave int32.
    return low // 2 + high // 2 + (low % 2 + high % 2) // 2


def _wide_enough(x):
    """``x`` in float32 if its dtype cannot hold xPos's scale factors (float16), else as is."""
    if jnp.finfo(x.dtype).maxexp < jnp.finfo(jnp.float32).maxexp:  # float16: largest value 65504
        return x.astype(jnp.float32)
    return x


def apply_xpos_qk(
    q,
    k,
    query_positions,
    key_positions,
    *,
    base: float = 10000.0,
    scale_base: float = 512.0,
    gamma: float = 0.4,
    layout: Layout = "interleaved",
    centre=None,
):
    """Rotates and scales queries ``[..., T, N, H]`` and keys ``[..., S, K, H]`` as xPos does.

    ``centre`` (integer ``[B|1, 1]``, default the midpoint of the query positions) is the
    position where the scale factors are 1. It cancels in every score, so any centre gives
    the same scores as long as no factor reaches the ``e^±60`` clamp (about
    ``60 / |ln ζ_i| · scale_base`` positions from it); a KV cache keeps keys scaled about
    one fixed centre, so each key is rotated once.

    Returns q and k in their dtype, except a dtype with a narrower range than float32
    (float16, whose largest value is 65504): the scale factors reach ``e^±12`` over a
    span of 10k tokens (and ``e^±60`` by design), which would overflow there and turn
    the scores into NaN, so such q and k come back in float32 and the attention scores
    them in float32. bfloat16 has float32's range and stays bfloat16.

    Example:
      >>> q = jnp.ones((1, 6, 2, 8))
      >>> [a.shape for a in apply_xpos_qk(q, q, jnp.arange(6), jnp.arange(6))]
      [(1, 6, 2, 8), (1, 6, 2, 8)]
    """
    _check_layout(layout)
    rotary_dim = _check_head(q, None, "q")
    _check_head(k, rotary_dim, "k")
    check_number("scale_base", scale_base, above=0, fix="512 in the paper")
    query_positions = check_positions(query_positions, "query_positions")
    key_positions = check_positions(key_positions, "key_positions")
    freq = rope_inverse_frequencies(rotary_dim, base=base)
    log_zeta = jnp.asarray(np.log(xpos_decay_bases(rotary_dim, gamma=gamma)), jnp.float32)
    centre = xpos_centre(query_positions) if centre is None else jnp.asarray(centre, jnp.int32).reshape(-1, 1)

    def tables(positions, sign):
        cos, sin = rope_tables(positions, freq)
        offset = position_difference(batched_positions(positions), centre, dtype=jnp.float32)
        offset = offset[..., None] / jnp.float32(scale_base)  # [B|1, T, 1]
        # Clamped in log space so far-away (e.g. empty cache) slots stay finite.
        scale = jnp.exp(jnp.clip(sign * offset * log_zeta.reshape(1, 1, -1), -60.0, 60.0))
        if positions.ndim == 1 and centre.shape[0] == 1:
            scale = scale[0]
        else:
            cos, sin = jnp.broadcast_to(cos, scale.shape), jnp.broadcast_to(sin, scale.shape)
        return cos * scale, sin * scale

    q, k = _wide_enough(q), _wide_enough(k)
    q_cos, q_sin = tables(query_positions, 1.0)
    k_cos, k_sin = tables(key_positions, -1.0)
    return _rotate(q, q_cos, q_sin, layout), _rotate(k, k_cos, k_sin, layout)


@register_encoding(
    "xpos",
    description="RoPE with a per-frequency exponential decay of the scores with distance.",
    source=XPOS,
    forms=("causal",),
    hooks=("rotate",),
    tiled=(),
    cached=("rotation_about",),
    prepared=None,
    fused=("per_call",),
)
@pytree_dataclass
class XPos(ParameterFree):
    """xPos as a ``rotate`` hook (causal use, as in the paper).

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 6, 2, 8)); pos = jnp.arange(6)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[XPos()], causal=True).shape
      (1, 6, 2, 8)
    """

    base: float = 10000.0
    scale_base: float = 512.0
    gamma: float = 0.4
    layout: Layout = "interleaved"

    def __post_init__(self):
        _check_layout(self.layout)
        inverse_frequencies(2, base=self.base)  # validates the base
        check_number("scale_base", self.scale_base, above=0, fix="512 in the paper")
        check_number("gamma", self.gamma, above=0, fix="0.4 in the paper")

    def rotate(
        self, q: jax.Array, k: jax.Array, context: AttentionContext | jax.Array | tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        """Rotates and scales q ``[..., T, N, H]`` and k ``[..., S, K, H]``; ``context`` as in :meth:`RoPE.rotate`
        (an :class:`AttentionContext`, one positions array, or ``(query_positions, key_positions)``)."""
        return self.rotate_about(q, k, context, None)

    def per_token_for(self, context: AttentionContext | jax.Array | tuple[jax.Array, jax.Array]) -> XPosAbout:
        """This xPos with its centre fixed at the call's (the midpoint of ``context``'s query positions):
        each token's rotation then depends on its own position alone (what blockwise tiles rotate by)."""
        context = rotation_context(context, "XPos.per_token_for")
        return XPosAbout(xpos_centre(context.query_positions), self)

    def rotate_about(self, q, k, context: AttentionContext | jax.Array | tuple[jax.Array, jax.Array], centre):
        """:meth:`rotate` with the scale factors 1 at ``centre`` (``[B|1, 1]``; None: the queries' midpoint).

        With a fixed centre each key's rotation depends on its own position alone, so a KV
        cache may hold keys rotated (see :func:`apply_xpos_qk` for the range where the
        centre cancels exactly).
        """
        context = rotation_context(context, "XPos.rotate")
        return apply_xpos_qk(
            q,
            k,
            context.query_positions,
            context.key_positions,
            base=self.base,
            scale_base=self.scale_base,
            gamma=self.gamma,
            layout=self.layout,
            centre=centre,
        )


@pytree_dataclass
class XPosAbout:
    """xPos with its scale factors 1 at a fixed ``centre`` (:meth:`XPos.per_token_for`): each token is
    rotated and scaled by its own position alone.

    Attributes:
      centre: integer ``[B|1, 1]``, the position where the scale factors are 1.
      xpos: the :class:`XPos` settings.
    """

    centre: jax.Array = parameter()
    xpos: XPos = dataclasses.field(default_factory=XPos)
    rotates_per_token: ClassVar[bool] = True

    def rotate(self, q: jax.Array, k: jax.Array, context) -> tuple[jax.Array, jax.Array]:
        """:meth:`XPos.rotate_about` the fixed :attr:`centre`."""
        return self.xpos.rotate_about(q, k, context, self.centre)


declare_forms(XPosAbout, Forms(hooks=("rotate",), cached=("rotation",)))  # the per-token form per_token_for returns
