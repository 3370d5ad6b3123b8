"""Rotary position embedding (RoPE), Su et al. 2021, arXiv:2104.09864.

RoPE rotates each pair of query/key features by an angle proportional to the
token's position, ``f(x, m) = R(m θ) x``, so that the score
``<f(q, m), f(k, n)> = Re[q* k e^{i(n-m)θ}]`` depends on positions only through
``n - m``. Nothing is materialised but a ``[..., T, R/2]`` cos/sin table.

Two layouts of the pairs inside a head of size H (R = ``rotary_dim`` <= H):

* ``"interleaved"`` (the default): pairs are ``(x[2i], x[2i+1])``, exactly as in
  Su's reference pseudocode (seed 000) and RoFormer / the sinusoidal table of
  d2l, where column 2i is the sine and column 2i+1 the cosine.
* ``"half"``: pairs are ``(x[i], x[i + R/2])``, the split-half (``rotate_half``)
  layout of GPT-NeoX and the Llama ports. Use it to load such checkpoints.

Both use frequencies ``θ_i = base ** (-2i / R)`` for ``i < R/2``, and they are
the same map up to a fixed permutation of the first R features. Dimensions
``R..H`` pass through unchanged (partial rotary, as in GPT-NeoX).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.hooks import AttentionContext, ParameterFree, pytree_dataclass
from posenc_jax.functional.positions import check_positions, inverse_frequencies, position_angles
from posenc_jax.functional.registry import Source, register_encoding

__all__ = [
    "RoPE",
    "apply_rope",
    "apply_rope_qk",
    "rope_inverse_frequencies",
    "rope_tables",
]

Layout = Literal["interleaved", "half"]
_LAYOUTS = ("interleaved", "half")


def rope_inverse_frequencies(rotary_dim: int, *, base: float = 10000.0) -> np.ndarray:
    """RoPE frequencies ``θ_i = base ** (-2i / rotary_dim)``, ``[rotary_dim / 2]`` float64.

    Example:
      >>> rope_inverse_frequencies(8, base=10000.0).shape
      (4,)
    """
    if not isinstance(rotary_dim, (int, np.integer)) or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even integer >= 2 for RoPE, got {rotary_dim!r}")
    return inverse_frequencies(int(rotary_dim), base=base)


def rope_tables(positions, inverse_frequency) -> tuple[jax.Array, jax.Array]:
    """The ``cos`` and ``sin`` tables of RoPE, each ``[..., T, R/2]`` float32.

    Angles are ``positions * inverse_frequency``, reduced modulo 2π exactly (see
    ``posenc_jax.functional.positions.position_angles``), so they stay right at
    position 100,000 and beyond whatever the dtype of the queries.
    """
    angles = position_angles(positions, inverse_frequency)
    return jnp.cos(angles), jnp.sin(angles)


def _check_head(x: jax.Array, rotary_dim: int | None, name: str) -> int:
    if x.ndim < 3:
        raise ValueError(f"{name} must have shape [..., T, N, H], got shape {x.shape}")
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(
            f"head_dim must be even for RoPE, got {head_dim} ({name} shape {x.shape}); RoPE rotates pairs of "
            f"features: use an even head dim"
        )
    if rotary_dim is None:
        return head_dim
    if not isinstance(rotary_dim, (int, np.integer)) or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even integer >= 2 for RoPE, got {rotary_dim!r}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be <= head_dim {head_dim}, got {rotary_dim}")
    return int(rotary_dim)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, layout: Layout) -> jax.Array:
    """Rotates the first R features of ``x`` [..., T, N, H] by the [..., T, R/2] tables."""
    rotary_dim = 2 * cos.shape[-1]
    # [..., T, R/2] -> [..., T, 1, R/2], left-padded to x's rank (no implicit rank promotion).
    table_shape = (1,) * (x.ndim - 1 - cos.ndim) + cos.shape[:-1] + (1, cos.shape[-1])
    cos, sin = cos.reshape(table_shape), sin.reshape(table_shape)
    rot = x[..., :rotary_dim].astype(jnp.float32)
    if layout == "interleaved":
        pairs = rot.reshape(*rot.shape[:-1], rotary_dim // 2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        rotated = rotated.reshape(rot.shape)
    else:
        first, second = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    rotated = rotated.astype(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


def _frequencies(inverse_frequency, rotary_dim: int, base: float):
    if inverse_frequency is None:
        return rope_inverse_frequencies(rotary_dim, base=base)
    if np.shape(inverse_frequency) != (rotary_dim // 2,):
        raise ValueError(
            f"inverse_frequency must have shape [{rotary_dim // 2}] (rotary_dim / 2), got {np.shape(inverse_frequency)}"
        )
    return inverse_frequency


def _check_layout(layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")


def _check_positions_fit(x: jax.Array, positions: jax.Array, name: str) -> None:
    # positions [..., T] must broadcast against x's leading axes [..., T].
    if positions.ndim > x.ndim - 2:
        raise ValueError(f"positions of shape {positions.shape} have more batch axes than {name} of shape {x.shape}")
    if positions.shape[-1] != x.shape[-3]:
        raise ValueError(
            f"positions have length {positions.shape[-1]} but {name} has T = {x.shape[-3]} "
            f"(shape {x.shape}); pass one position per token"
        )
    try:
        np.broadcast_shapes(positions.shape, x.shape[:-2])
    except ValueError:
        raise ValueError(
            f"positions of shape {positions.shape} do not match {name} of shape {x.shape}: "
            f"expected [T] or [B, T] with T = {x.shape[-3]}"
        ) from None


def apply_rope(
    x: jax.Array,
    positions,
    *,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    layout: Layout = "interleaved",
    inverse_frequency=None,
    attention_factor: float = 1.0,
) -> jax.Array:
    """Applies RoPE to queries or keys: ``x'[2i:2i+2] = R(p θ_i) x[2i:2i+2]``.

    For the interleaved layout, with ``c = cos(p θ_i)`` and ``s = sin(p θ_i)``::

        x'[2i]   = x[2i] c - x[2i+1] s
        x'[2i+1] = x[2i+1] c + x[2i] s

    and the same with pairs ``(i, i + R/2)`` for the split-half layout.

    Args:
      x: ``[..., T, N, H]`` queries or keys, any float dtype.
      positions: integer ``[T]`` or ``[..., T]`` (broadcast against x's leading
        axes); any values, so offsets, caches and gaps work.
      base: frequency base (10,000 in the paper).
      rotary_dim: rotate only the first ``rotary_dim`` features (even, <= H);
        default H.
      layout: ``"interleaved"`` (Su's pseudocode, default) or ``"half"``
        (GPT-NeoX / Llama).
      inverse_frequency: optional ``[rotary_dim / 2]`` frequencies replacing
        ``base ** (-2i/R)``, for the RoPE scalings.
      attention_factor: multiplies the rotated features (a scaling's attention
        factor, e.g. YaRN's; scores then scale by its square).

    Returns:
      Rotated array, same shape and dtype as ``x``; the rotation is done in float32.

    Reference: Su et al., "RoFormer: Enhanced Transformer with Rotary Position
    Embedding", 2021, arXiv:2104.09864.

    Example:
      >>> q = jnp.ones((2, 16, 4, 64))
      >>> apply_rope(q, jnp.arange(16)).shape
      (2, 16, 4, 64)
    """
    _check_layout(layout)
    rotary_dim = _check_head(x, rotary_dim, "x")
    positions = check_positions(positions)
    _check_positions_fit(x, positions, "x")
    inverse_frequency = _frequencies(inverse_frequency, rotary_dim, base)
    cos, sin = rope_tables(positions, inverse_frequency)
    return _rotate(x, cos * attention_factor, sin * attention_factor, layout)


def apply_rope_qk(
    q: jax.Array,
    k: jax.Array,
    query_positions,
    key_positions,
    *,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    layout: Layout = "interleaved",
    inverse_frequency=None,
    attention_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Rotates queries ``[..., T, N, H]`` and keys ``[..., S, K, H]`` in one pass.

    The cos/sin tables are computed once when the query and key positions are
    the same array (self-attention), and once for each otherwise (a KV cache
    or cross-segment memory). Arguments as in :func:`apply_rope`.

    Example:
      >>> q, k = jnp.ones((1, 8, 4, 32)), jnp.ones((1, 8, 2, 32))
      >>> pos = jnp.arange(8)
      >>> [a.shape for a in apply_rope_qk(q, k, pos, pos)]
      [(1, 8, 4, 32), (1, 8, 2, 32)]
    """
    _check_layout(layout)
    rotary_dim, query_positions, key_positions = _checked_qk(q, k, query_positions, key_positions, rotary_dim)
    inverse_frequency = _frequencies(inverse_frequency, rotary_dim, base)
    return _rotate_qk(
        q,
        k,
        query_positions,
        key_positions,
        lambda positions: position_angles(positions, inverse_frequency),
        layout,
        attention_factor,
    )


def _checked_qk(q, k, query_positions, key_positions, rotary_dim):
    """Validates q, k and their positions; returns the rotary dim and int32 positions (one array if shared)."""
    rotary_dim = _check_head(q, rotary_dim, "q")
    _check_head(k, rotary_dim, "k")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k must share the head dim, got q {q.shape} and k {k.shape}")
    same_positions = query_positions is key_positions
    query_positions = check_positions(query_positions, "query_positions")
    key_positions = query_positions if same_positions else check_positions(key_positions, "key_positions")
    _check_positions_fit(q, query_positions, "q")
    _check_positions_fit(k, key_positions, "k")
    return rotary_dim, query_positions, key_positions


def _rotate_qk(q, k, query_positions, key_positions, angles_of, layout: Layout, attention_factor: float):
    """Rotates checked q and k by ``angles_of(positions)`` (``[..., T, R/2]``); tables once if positions are shared."""
    q_cos, q_sin = _tables(angles_of(query_positions), attention_factor)
    if key_positions is query_positions:
        k_cos, k_sin = q_cos, q_sin
    else:
        k_cos, k_sin = _tables(angles_of(key_positions), attention_factor)
    return _rotate(q, q_cos, q_sin, layout), _rotate(k, k_cos, k_sin, layout)


def _tables(angles, attention_factor: float):
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


ROFORMER = Source.paper(
    "su2021roformer",
    title="RoFormer: Enhanced Transformer with Rotary Position Embedding",
    authors="Su, Jianlin and Lu, Yu and Pan, Shengfeng and Murtadha, Ahmed and Wen, Bo and Liu, Yunfeng",
    year=2021,
    arxiv="2104.09864",
)


@register_encoding(
    "rope",
    description="Rotary position embedding: queries and keys rotated by angles proportional to their positions.",
    source=ROFORMER,
)
@pytree_dataclass
class RoPE(ParameterFree):
    """RoPE as a ``rotate`` hook of :func:`posenc_jax.functional.dot_product_attention`.

    ``scaling`` takes a RoPE scaling from :mod:`posenc_jax.functional.rope_scaling`
    (linear / PI, NTK, dynamic NTK, YaRN, Llama 3, LongRoPE). Scalings that follow the
    sequence length (dynamic NTK, LongRoPE) take it as ``max(query_positions) + 1``, as
    Hugging Face transformers' ``modeling_rope_utils`` does, so a window of positions
    2500-2599 is scaled as a sequence of 2600 tokens whatever the number of keys, and one
    attention layer with a KV cache (which holds keys unrotated) decodes each token as the
    full forward pass of its prefix does.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> q = k = v = jnp.ones((1, 8, 2, 16))
      >>> pos = jnp.arange(8)
      >>> dot_product_attention(q, k, v, query_positions=pos, key_positions=pos,
      ...                       encodings=[RoPE()], causal=True).shape
      (1, 8, 2, 16)
    """

    base: float = 10000.0
    rotary_dim: int | None = None
    layout: Layout = "interleaved"
    scaling: object | None = None

    def __post_init__(self):
        _check_layout(self.layout)
        if self.rotary_dim is not None:
            rope_inverse_frequencies(self.rotary_dim, base=self.base)
        else:
            inverse_frequencies(2, base=self.base)  # validates the base
        if self.scaling is not None and not (
            hasattr(self.scaling, "inverse_frequencies") and hasattr(self.scaling, "angles")
        ):
            raise ValueError(f"scaling must be a RoPE scaling (e.g. YaRNScaling), got {self.scaling!r}")

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies follow the sequence length (dynamic NTK, LongRoPE)."""
        return bool(self.scaling is not None and self.scaling.length_dependent)

    def frequencies(self, head_dim: int, length: int | None = None) -> tuple[np.ndarray, float]:
        """The ``[R / 2]`` inverse frequencies and the attention factor for a sequence of ``length`` tokens."""
        rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
        if self.scaling is None:
            return rope_inverse_frequencies(rotary_dim, base=self.base), 1.0
        return (
            np.asarray(self.scaling.inverse_frequencies(rotary_dim, self.base, length), np.float64),
            float(self.scaling.attention_factor(length)),
        )

    def rotate(self, q, k, context: AttentionContext):
        _check_head(q, self.rotary_dim, "q")  # before the frequencies: an odd head dim is named as such
        if self.scaling is None or not self.length_dependent:
            freq, factor = self.frequencies(q.shape[-1])
            return apply_rope_qk(
                q,
                k,
                context.query_positions,
                context.key_positions,
                base=self.base,
                rotary_dim=self.rotary_dim,
                layout=self.layout,
                inverse_frequency=freq,
                attention_factor=factor,
            )
        rotary_dim, query_positions, key_positions = _checked_qk(
            q, k, context.query_positions, context.key_positions, self.rotary_dim
        )
        # The current length, as transformers' dynamic RoPE takes it; in float32, as
        # max + 1 leaves int32 at the last int32 position.
        length = jnp.max(query_positions).astype(jnp.float32) + 1

        def angles_of(positions):
            return self.scaling.angles(positions, rotary_dim, self.base, length)

        factor = float(self.scaling.attention_factor(None))
        return _rotate_qk(q, k, query_positions, key_positions, angles_of, self.layout, factor)

    def for_lengths(self, *, train_length: int, max_length: int, head_dim: int) -> RoPE:
        """A scaling's factor and original context set from the training and the longest test length."""
        if self.scaling is None:
            return self
        rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
        return dataclasses.replace(
            self,
            scaling=self.scaling.for_lengths(train_length=train_length, max_length=max_length, rotary_dim=rotary_dim),
        )
