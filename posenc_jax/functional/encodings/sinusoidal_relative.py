"""Functional (sinusoidal) relative encoding: a fixed sinusoid of the distance as R.

``logits[t, s] = scale · q_t · PE(key_pos[s] - query_pos[t])`` where ``PE`` is the
parameter-free sinusoidal table of d2l §11.6 evaluated at the relative distance
(the functional relative encoding of the RoPE derivation tutorial, used as Shaw's R without parameters).

Computed without any ``[T, S, H]`` tensor, exactly, for any positions: with
``α = query_pos · ω`` and ``β = key_pos · ω``, ``sin(β - α)`` and ``cos(β - α)``
expand into products of per-query and per-key sines and cosines, so
``g_t · PE(β - α)`` becomes one ``[T, H] × [H, S]`` contraction of rotated query
features with the keys' sinusoids. Transformer-XL's position term uses the same
identity with the other sign (query minus key).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.forms import Forms, declare_forms
from posenc_jax.functional.core.hooks import AttentionContext, ParameterFree, parameter, pytree_dataclass
from posenc_jax.functional.core.positions import check_positions, inverse_frequencies, position_angles
from posenc_jax.functional.core.registry import register_encoding
from posenc_jax.functional.core.validation import check_number
from posenc_jax.functional.encodings.sinusoidal import VASWANI

__all__ = ["SinusoidalRelative", "key_sinusoids", "sinusoidal_relative_logits"]


def _batched(x):
    return x if x.ndim == 3 else x[None]


def sinusoidal_relative_logits(
    g: jax.Array,
    query_positions,
    key_positions,
    *,
    sign: int = 1,
    layout: Literal["interleaved", "half"] = "interleaved",
    base: float = 10000.0,
    key_features: jax.Array | None = None,
) -> jax.Array:
    """``out[b, n, t, s] = g[b, t, n] · PE(sign · (key_pos[s] - query_pos[t]))``, ``[B, N, T, S]``.

    ``PE(d)`` is the sinusoidal encoding of width D at distance d: sines and
    cosines of ``d · base**(-2i/D)``, interleaved (``[sin, cos, sin, cos, ...]``,
    d2l §11.6) or concatenated (``[sin..., cos...]``, Transformer-XL).

    Args:
      g: ``[B, T, N, D]`` per-query coefficients (D even).
      query_positions, key_positions: integer ``[T]``/``[B, T]`` and ``[S]``/``[B, S]``.
      sign: +1 for key minus query (j - i), -1 for query minus key (i - j).
      layout: where the sines and cosines sit in D.
      base: wavelength base.
      key_features: optional ``[B|1, S, D]`` :func:`key_sinusoids` of the key positions,
        computed earlier (a KV cache stores them); computed here when None.

    Returns:
      ``[B, N, T, S]`` float32; no ``[T, S, D]`` tensor is formed.

    Example:
      >>> g = jnp.ones((1, 3, 2, 8))
      >>> sinusoidal_relative_logits(g, jnp.arange(3), jnp.arange(5)).shape
      (1, 2, 3, 5)
    """
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 (key - query) or -1 (query - key), got {sign!r}")
    if layout not in ("interleaved", "half"):
        raise ValueError(f"layout must be 'interleaved' or 'half', got {layout!r}")
    dim = g.shape[-1]
    if dim % 2:
        raise ValueError(f"the sinusoid width must be even, got {dim}")
    freq = inverse_frequencies(dim, base=base)
    alpha = _batched(position_angles(check_positions(query_positions, "query_positions"), freq))  # [B|1, T, F]
    if key_features is None:
        key_features = key_sinusoids(key_positions, dim, base=base)
    elif key_features.shape[-1] != dim:
        raise ValueError(f"key_features must have width D={dim} (the width of g), got shape {key_features.shape}")
    coef = _query_coefficients(g, alpha, sign=sign, layout=layout)  # [B, T, N, 2F]
    key_features = jnp.broadcast_to(_batched(key_features), (coef.shape[0],) + key_features.shape[-2:])
    # Heads ahead of queries before the contraction, so the product comes out [B, N, T, S] as laid out.
    coef = jnp.swapaxes(coef, 1, 2)  # [B, N, T, 2F]
    return jnp.einsum("BNTF,BSF->BNTS", coef, key_features, preferred_element_type=jnp.float32)


def _query_coefficients(g: jax.Array, alpha: jax.Array, *, sign: int, layout: str) -> jax.Array:
    """The per-query half of the sinusoid identity: ``[B, T, N, D]`` coefficients of ``[sin β, cos β]``."""
    dim = g.shape[-1]
    g = g.astype(jnp.float32)
    if layout == "interleaved":
        g_sin, g_cos = g[..., 0::2], g[..., 1::2]
    else:
        g_sin, g_cos = g[..., : dim // 2], g[..., dim // 2 :]
    g_sin = sign * g_sin  # sin(sign·x) = sign·sin(x); cos is even.
    cos_a, sin_a = jnp.cos(alpha)[:, :, None, :], jnp.sin(alpha)[:, :, None, :]  # [B|1, T, 1, F]
    # g·PE(β-α) = Σ_f sin β_f (g_sin cos α_f + g_cos sin α_f) + cos β_f (g_cos cos α_f - g_sin sin α_f)
    coef_sin = g_sin * cos_a + g_cos * sin_a  # [B, T, N, F]
    coef_cos = g_cos * cos_a - g_sin * sin_a
    return jnp.concatenate([coef_sin, coef_cos], axis=-1)


def sinusoidal_relative_features(
    g: jax.Array, query_positions, key_features: jax.Array, *, base: float = 10000.0
) -> tuple[jax.Array, jax.Array]:
    """:func:`sinusoidal_relative_logits` (``sign=1``, interleaved) as per-query and per-key features.

    ``einsum("BTNF,BSF->BNTS", *features)`` is that term: the identity
    ``g·PE(β - α) = Σ coef(g, α)·[sin β, cos β]`` splits it into a per-query ``[B, T, N, D]``
    half and the per-key ``[B|1, S, D]`` :func:`key_sinusoids`. Appended to q and k, the
    content product computes content and term in one contraction, and the term is never a
    ``[B, N, T, S]`` buffer of its own.
    """
    freq = inverse_frequencies(g.shape[-1], base=base)
    alpha = _batched(position_angles(check_positions(query_positions, "query_positions"), freq))
    return _query_coefficients(g, alpha, sign=1, layout="interleaved"), _batched(key_features)


def key_sinusoids(key_positions, dim: int, *, base: float = 10000.0) -> jax.Array:
    """``[sin β, cos β]`` of the key angles ``β = key_pos · base**(-2i/D)``, float32 ``[B|1, S, D]``.

    The per-key half of :func:`sinusoidal_relative_logits`: it depends on each key's
    position alone, so a KV cache computes it once per key.

    Example:
      >>> key_sinusoids(jnp.arange(5), 8).shape
      (1, 5, 8)
    """
    beta = _batched(
        position_angles(check_positions(key_positions, "key_positions"), inverse_frequencies(dim, base=base))
    )
    return jnp.concatenate([jnp.sin(beta), jnp.cos(beta)], axis=-1)


@register_encoding(
    "functional-relative",
    description="The query dotted with the sinusoidal table of j - i (Shaw's R as a fixed function).",
    source=VASWANI,
    hooks=("logits",),
    tiled=(),
    cached=("key_term",),
    prepared=None,
    fused=("features",),
)
@pytree_dataclass
class SinusoidalRelative(ParameterFree):
    """Parameter-free functional relative encoding as a ``logits`` hook.

    ``logits[t, s] = scale · q_t · PE(key_pos[s] - query_pos[t])`` with ``PE`` the
    interleaved sinusoidal table of width H; ``scale`` defaults to the
    attention's score scale (``1/√H`` unless set).

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 5, 2, 8)); pos = jnp.arange(5)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[SinusoidalRelative()]).shape
      (1, 5, 2, 8)
    """

    base: float = 10000.0
    scale: float | None = None

    def __post_init__(self):
        inverse_frequencies(2, base=self.base)  # validates the base
        check_number("scale", self.scale, above=0, optional=True, fix="None follows the attention's score scale")

    def logits(self, q, k, context: AttentionContext):
        return _scaled_logits(self, q, context, None)

    def score_features(self, q, k, context: AttentionContext):
        """The term as features appended to q and k (see :func:`sinusoidal_relative_features`)."""
        return _score_features(self, q, context, key_sinusoids(context.key_positions, q.shape[-1], base=self.base))

    def key_features(self, k, key_positions) -> jax.Array:
        """What a KV cache stores per key: :func:`key_sinusoids` of its position, ``[B, S, H]``."""
        sinusoids = key_sinusoids(key_positions, k.shape[-1], base=self.base)
        return jnp.broadcast_to(sinusoids, (k.shape[0],) + sinusoids.shape[1:])

    def with_key_features(self, features: jax.Array) -> CachedSinusoidalRelative:
        """This hook reading every key's sinusoids from ``features`` (a KV cache's)."""
        return CachedSinusoidalRelative(features, self)


@pytree_dataclass
class CachedSinusoidalRelative:
    """:class:`SinusoidalRelative` with the keys' sinusoids ``[B, S, H]`` computed earlier (a KV cache's)."""

    key_sinusoids: jax.Array = parameter()
    encoding: SinusoidalRelative = dataclasses.field(default_factory=SinusoidalRelative)

    def logits(self, q, k, context: AttentionContext):
        return _scaled_logits(self.encoding, q, context, self.key_sinusoids)

    def map_key_features(self, fn) -> CachedSinusoidalRelative:
        """This hook with its stored key sinusoids ``[B, S, H]`` replaced by ``fn`` of them (blockwise attention
        takes each key tile's)."""
        return dataclasses.replace(self, key_sinusoids=fn(self.key_sinusoids))

    def score_features(self, q, k, context: AttentionContext):
        """The term as features appended to q and k, with the cached key sinusoids."""
        return _score_features(self.encoding, q, context, self.key_sinusoids)


declare_forms(
    CachedSinusoidalRelative, Forms(hooks=("logits",), tiled=(), cached=("key_features",), fused=("features",))
)


def _scaled_logits(encoding: SinusoidalRelative, q, context: AttentionContext, key_features) -> jax.Array:
    scale = context.scale if encoding.scale is None else encoding.scale
    term = sinusoidal_relative_logits(
        q, context.query_positions, context.key_positions, base=encoding.base, key_features=key_features
    )
    return term * jnp.float32(scale)


def _score_features(encoding: SinusoidalRelative, q, context: AttentionContext, key_features):
    """Features whose product, times the attention's scale, is :func:`_scaled_logits`' term."""
    if key_features.shape[-1] != q.shape[-1]:
        raise ValueError(f"key sinusoids must have width H={q.shape[-1]}, got shape {key_features.shape}")
    coef, keys = sinusoidal_relative_features(q, context.query_positions, key_features, base=encoding.base)
    if encoding.scale is not None:  # the content product is multiplied by the attention's scale
        coef = coef * (jnp.float32(encoding.scale) / jnp.float32(context.scale))
    return coef, keys
