"""Rotary position embedding (RoPE), Su et al. 2021, arXiv:2104.09864.

RoPE rotates each pair of query/key features by an angle proportional to the
token's position, ``f(x, m) = R(m θ) x``, so that the score
``<f(q, m), f(k, n)> = Re[q* k e^{i(n-m)θ}]`` depends on positions only through
``n - m``. Nothing is materialised but a ``[..., T, R/2]`` cos/sin table.

Two layouts of the pairs inside a head of size H (R = ``rotary_dim`` <= H):

* ``"interleaved"`` (the default): pairs are ``(x[2i], x[2i+1])``, exactly as in
  Su's reference pseudocode and RoFormer / the sinusoidal table of
  d2l, where column 2i is the sine and column 2i+1 the cosine.
* ``"half"``: pairs are ``(x[i], x[i + R/2])``, the split-half (``rotate_half``)
  layout of GPT-NeoX and the Llama ports. Use it to load such checkpoints.

Both use frequencies ``θ_i = base ** (-2i / R)`` for ``i < R/2``, and they are
the same map up to a fixed permutation of the first R features. Dimensions
``R..H`` pass through unchanged (partial rotary, as in GPT-NeoX).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.forms import Forms, declare_forms
from posenc_jax.functional.core.hooks import (
    AttentionContext,
    ParameterFree,
    PreparedRotation,
    parameter,
    pytree_dataclass,
    rotation_context,
)
from posenc_jax.functional.core.positions import (
    _position_angles,
    check_positions,
    inverse_frequencies,
    position_angles,
)
from posenc_jax.functional.core.registry import Source, register_encoding

__all__ = [
    "RoPE",
    "RoPEAtLength",
    "RotaryTable",
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
    ``posenc_jax.functional.core.positions.position_angles``), so they stay right at
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


def _pair_table(cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE's table ``[..., T, R]`` float32 from ``[..., T, R/2]`` cos and sin: ``[cos, sin]``.

    Why one concatenation along the last axis: XLA fuses elementwise producers into their
    consumers and, on CPU, counts sin and cos as cheap, so tables computed elementwise are
    recomputed inside every ``[B, T, N, H]`` loop that reads them (sin and cos once per
    element of q and of k instead of once per position). A concatenation along the minor
    axis is kept as its own buffer by XLA:CPU's fusion rules, so the table is computed
    once and the rotation loops only read it. ``tests/test_rope.py`` checks the compiled
    program for this.
    """
    return jnp.concatenate([cos, sin], axis=-1)


def _rotate_by_table(x: jax.Array, table: jax.Array, layout: Layout) -> jax.Array:
    """Rotates the first R features of ``x`` ``[..., T, N, H]`` by a ``[..., T, R]`` table (see :func:`_pair_table`)."""
    half = table.shape[-1] // 2  # R / 2 pairs
    rotary_dim = 2 * half
    # [..., T, R] -> [..., T, 1, 2, R/2] (cos, sin), left-padded to x's rank (no implicit rank promotion).
    lead = (1,) * (x.ndim - table.ndim - 1) + table.shape[:-1]
    table = table.reshape(*lead, 1, 2, half)
    cos, sin = table[..., 0, :], table[..., 1, :]
    rot = x[..., :rotary_dim] if rotary_dim < x.shape[-1] else x
    if layout == "interleaved":  # pair i is features (2i, 2i + 1)
        pairs = rot.astype(jnp.float32).reshape(*rot.shape[:-1], half, 2)
        first, second = pairs[..., 0], pairs[..., 1]
        rotated = jnp.stack([first * cos - second * sin, first * sin + second * cos], axis=-1)
    else:  # pair i is features (i, i + R/2)
        pairs = rot.astype(jnp.float32).reshape(*rot.shape[:-1], 2, half)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        rotated = jnp.stack([first * cos - second * sin, first * sin + second * cos], axis=-2)
    rotated = rotated.reshape(rot.shape).astype(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, layout: Layout) -> jax.Array:
    """Rotates the first R features of ``x`` [..., T, N, H] by the [..., T, R/2] cos and sin tables."""
    return _rotate_by_table(x, _pair_table(cos, sin), layout)


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
    angles = _position_angles(positions, _frequencies(inverse_frequency, rotary_dim, base))
    return _rotate(x, jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor, layout)


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
    same_positions = query_positions is key_positions  # then one table serves both
    rotary_dim = _check_qk_heads(q, k, rotary_dim)
    query_positions = check_positions(query_positions, "query_positions")
    key_positions = query_positions if same_positions else check_positions(key_positions, "key_positions")
    _check_qk_fit(q, k, query_positions, key_positions)
    inverse_frequency = _frequencies(inverse_frequency, rotary_dim, base)

    def angles_of(positions):
        return _position_angles(positions, inverse_frequency)

    return _rotate_qk(q, k, query_positions, key_positions, angles_of, layout, attention_factor)


def _check_qk_heads(q, k, rotary_dim) -> int:
    """Validates q's and k's heads for a rotation of ``rotary_dim`` (None: all) features; returns the rotary dim."""
    rotary_dim = _check_head(q, rotary_dim, "q")
    _check_head(k, rotary_dim, "k")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k must share the head dim, got q {q.shape} and k {k.shape}")
    return rotary_dim


def _check_qk_fit(q, k, query_positions, key_positions) -> None:
    """Checked positions fit q and k (one position per token)."""
    _check_positions_fit(q, query_positions, "q")
    _check_positions_fit(k, key_positions, "k")


def _rotate_qk(q, k, query_positions, key_positions, angles_of, layout: Layout, attention_factor: float):
    """Rotates checked q and k by ``angles_of(positions)`` (``[..., T, R/2]``); one table if positions are shared."""
    q_table = _table(angles_of(query_positions), attention_factor)
    k_table = q_table if key_positions is query_positions else _table(angles_of(key_positions), attention_factor)
    return _rotate_by_table(q, q_table, layout), _rotate_by_table(k, k_table, layout)


def _table(angles, attention_factor: float):
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return _pair_table(cos, sin)


ROFORMER = Source.paper(
    "su2021roformer",
    title="RoFormer: Enhanced Transformer with Rotary Position Embedding",
    authors="Su, Jianlin and Lu, Yu and Pan, Shengfeng and Murtadha, Ahmed and Wen, Bo and Liu, Yunfeng",
    year=2021,
    arxiv="2104.09864",
)


@runtime_checkable
class FrequencyScaling(Protocol):
    """A RoPE scaling (the classes of :mod:`~posenc_jax.functional.encodings.rope_scaling`): it gives
    the inverse frequencies, the angles and the attention factor for a sequence of ``length``
    tokens, and says whether they follow that length."""

    length_dependent: bool

    def inverse_frequencies(self, rotary_dim: int, base: float, length: int | None = None) -> np.ndarray: ...

    def angles(self, positions, rotary_dim: int, base: float, length) -> jax.Array: ...

    def attention_factor(self, length: int | None = None) -> float: ...

    def for_lengths(self, *, train_length: int, max_length: int, rotary_dim: int) -> FrequencyScaling: ...


@register_encoding(
    "rope",
    description="Rotary position embedding: queries and keys rotated by angles proportional to their positions.",
    source=ROFORMER,
    hooks=("rotate",),
    tiled=(),
    cached=("rotation",),
    prepared="tables",
    fused=("per_call",),
)
@pytree_dataclass
class RoPE(ParameterFree):
    """RoPE as a ``rotate`` hook of :func:`posenc_jax.functional.dot_product_attention`.

    ``scaling`` takes a RoPE scaling from :mod:`posenc_jax.functional.encodings.rope_scaling`
    (linear / PI, NTK, dynamic NTK, YaRN, Llama 3, LongRoPE). Scalings that follow the
    sequence length (dynamic NTK, LongRoPE) take it as ``max(query_positions) + 1``, as
    Hugging Face transformers' ``modeling_rope_utils`` does, so a window of positions
    2500-2599 is scaled as a sequence of 2600 tokens whatever the number of keys, and one
    attention layer with a KV cache (which then holds keys unrotated, see
    :attr:`rotates_per_token`) decodes each token as the full forward pass of its prefix does.

    To use another attention kernel (``jax.nn.dot_product_attention``, cuDNN, splash
    attention), rotate q and k with :meth:`rotate` and give them to it: the rotation
    carries the scaling's frequencies and its attention factor (YaRN's multiplies the
    rotated q and k, so the scores by its square), and the kernel's default ``1/√H`` is the
    score scale this library's attention uses.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> q = k = v = jnp.ones((1, 8, 2, 16))
      >>> pos = jnp.arange(8)
      >>> dot_product_attention(q, k, v, query_positions=pos, key_positions=pos,
      ...                       encodings=[RoPE()], causal=True).shape
      (1, 8, 2, 16)
      >>> from posenc_jax.functional import YaRNScaling
      >>> rope = RoPE(scaling=YaRNScaling(factor=4.0, original_context=8))
      >>> jax.nn.dot_product_attention(*rope.rotate(q, k, pos), v, is_causal=True).shape
      (1, 8, 2, 16)
    """

    base: float = 10000.0
    rotary_dim: int | None = None
    layout: Layout = "interleaved"
    scaling: FrequencyScaling | None = None

    def __post_init__(self):
        _check_layout(self.layout)
        if self.rotary_dim is not None:
            rope_inverse_frequencies(self.rotary_dim, base=self.base)
        else:
            inverse_frequencies(2, base=self.base)  # validates the base
        if self.scaling is not None and not isinstance(self.scaling, FrequencyScaling):
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

    @property
    def rotates_per_token(self) -> bool:
        """Whether a key's rotation depends on its own position alone, so a KV cache may hold it rotated.

        True unless the frequencies follow the sequence length (dynamic NTK, LongRoPE), which
        re-rotates every cached key as the sequence grows.
        """
        return not self.length_dependent

    def _angles(self, head_dim: int, query_positions: jax.Array, length: jax.Array | None = None):
        """``(angles_of, attention_factor)``: ``angles_of(positions)`` gives ``[..., T, R/2]`` float32 angles
        (a length-dependent scaling's at ``length``, by default the current length of ``query_positions``)."""
        if not self.length_dependent:
            freq, factor = self.frequencies(head_dim)
            return (lambda positions: _position_angles(positions, freq)), factor
        rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
        if length is None:
            length = _current_length(query_positions)

        def angles_of(positions):
            return self.scaling.angles(positions, rotary_dim, self.base, length)

        return angles_of, float(self.scaling.attention_factor(None))

    def rotate(
        self, q: jax.Array, k: jax.Array, context: AttentionContext | jax.Array | tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        """Rotates queries ``[..., T, N, H]`` and keys ``[..., S, K, H]`` by their positions.

        Args:
          q, k: queries and keys, any float dtype (returned in it; rotated in float32).
          context: the attention's :class:`AttentionContext`, or the positions: one integer
            array ``[T]`` or ``[B, T]`` for queries and keys alike (self-attention), or a pair
            ``(query_positions, key_positions)`` (a decoding step against cached keys).

        Returns:
          ``(q', k')``, ``q`` and ``k`` rotated (and multiplied by the scaling's attention
          factor), ready for any attention kernel.

        Example:
          >>> q = k = jnp.ones((1, 6, 2, 8)); pos = jnp.arange(6)
          >>> q_rot, k_rot = RoPE().rotate(q, k, pos)
          >>> q_last, _ = RoPE().rotate(q[:, -1:], k, (pos[-1:], pos))
          >>> bool(jnp.allclose(q_last, q_rot[:, -1:]))
          True
        """
        return self._rotate_at(q, k, context, None, "RoPE.rotate")

    def _rotate_at(self, q, k, context, length: jax.Array | None, caller: str) -> tuple[jax.Array, jax.Array]:
        """:meth:`rotate`, a length-dependent scaling's frequencies at ``length`` (None: the current length)."""
        # Positions given as arrays are checked by rotation_context; a context's were checked where it was made.
        context = rotation_context(context, caller)
        _check_qk_heads(q, k, self.rotary_dim)
        _check_qk_fit(q, k, context.query_positions, context.key_positions)
        angles_of, factor = self._angles(q.shape[-1], context.query_positions, length)
        return _rotate_qk(q, k, context.query_positions, context.key_positions, angles_of, self.layout, factor)

    def per_token_for(self, context: AttentionContext | jax.Array | tuple[jax.Array, jax.Array]) -> RoPE | RoPEAtLength:
        """This RoPE for the call of ``context``, rotating each token by its own position alone: itself,
        or, for a length-dependent scaling, a :class:`RoPEAtLength` at the call's current length
        (what blockwise attention rotates its tiles by)."""
        if not self.length_dependent:
            return self
        context = rotation_context(context, "RoPE.per_token_for")
        return RoPEAtLength(_current_length(context.query_positions), self)

    def prepare(self, positions: jax.Array | AttentionContext, head_dim: int) -> RotaryTable:
        """This RoPE with its table for ``positions`` computed now, as a ``rotate`` hook.

        A model computes it once per forward pass and gives it to every layer, so the
        cos/sin table is computed once for all layers (like a shared bias), not once per
        layer: each layer rotates its own tokens, at ``positions``, by it
        (:meth:`RotaryTable.rotate_prepared`). Given to an attention as a hook, it uses the
        table when the query and key positions are this very array and rotates from scratch
        otherwise (:meth:`RotaryTable.rotate`).

        Args:
          positions: integer ``[T]`` or ``[B, T]``, or the :class:`AttentionContext` of the
            forward (its query positions, checked when it was made).
          head_dim: H, the head dim of the queries and keys it will rotate.

        Example:
          >>> from posenc_jax.functional import dot_product_attention
          >>> pos = jnp.arange(8); q = k = v = jnp.ones((1, 8, 2, 16))
          >>> hook = RoPE().prepare(pos, head_dim=16)
          >>> hook.table.shape
          (8, 16)
          >>> dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[hook]).shape
          (1, 8, 2, 16)
        """
        # A forward's context holds positions checked when it was made.
        context = isinstance(positions, AttentionContext)
        positions = positions.query_positions if context else check_positions(positions)
        if not isinstance(head_dim, (int, np.integer)) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim!r}")
        rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
        if rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be <= head_dim {head_dim}, got {rotary_dim}")
        angles_of, factor = self._angles(head_dim, positions)
        return RotaryTable(positions, _table(angles_of(positions), factor), self)

    def for_lengths(self, *, train_length: int, max_length: int, head_dim: int) -> RoPE:
        """A scaling's factor and original context set from the training and the longest test length."""
        if self.scaling is None:
            return self
        rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
        return dataclasses.replace(
            self,
            scaling=self.scaling.for_lengths(train_length=train_length, max_length=max_length, rotary_dim=rotary_dim),
        )


def _current_length(query_positions: jax.Array) -> jax.Array:
    """The length a length-dependent scaling follows, ``max(query_positions) + 1``, as transformers'
    dynamic RoPE takes it; in float32, as max + 1 leaves int32 at the last int32 position."""
    return jnp.max(query_positions).astype(jnp.float32) + 1


@pytree_dataclass
class RoPEAtLength:
    """A length-dependent RoPE (dynamic NTK, LongRoPE) with its length fixed (:meth:`RoPE.per_token_for`):
    each token is then rotated by its own position alone.

    Attributes:
      length: float32 scalar, the sequence length the scaling's frequencies are taken at.
      rope: the :class:`RoPE` settings.
    """

    length: jax.Array = parameter()
    rope: RoPE = dataclasses.field(default_factory=RoPE)
    rotates_per_token: ClassVar[bool] = True

    def rotate(
        self, q: jax.Array, k: jax.Array, context: AttentionContext | jax.Array | tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        """As :meth:`RoPE.rotate`, with the scaling's frequencies at :attr:`length`."""
        return self.rope._rotate_at(q, k, context, self.length, "RoPEAtLength.rotate")


@pytree_dataclass
class RotaryTable(PreparedRotation):
    """RoPE with its ``[..., T, R]`` table computed for one array of positions (:meth:`RoPE.prepare`).

    A model's layers rotate their own tokens, at ``positions``, by the stored table
    (:meth:`rotate_prepared`): the model prepared it for those tokens, so nothing need be
    compared. As a ``rotate`` hook given to an attention (:meth:`rotate`) it cannot know that:
    when the query and key positions are ``positions`` itself (the same array object) q and
    k are rotated by the table; otherwise ``rope`` rotates them from the context's
    positions, so the hook is never wrong, only slower. The test is by identity because it
    is the only one free under ``jit``: comparing the values would cost a pass over the
    positions, and a conditional, at every call.

    Attributes:
      positions: int32 ``[T]`` or ``[B, T]``, the positions the table was computed for.
      table: float32 ``[T, R]`` or ``[B, T, R]``: cos then sin of every pair's angle.
      rope: the :class:`RoPE` settings (layout, rotary dim, scaling).
    """

    positions: jax.Array = parameter()
    table: jax.Array = parameter()
    rope: RoPE = dataclasses.field(default_factory=RoPE)

    @property
    def rotates_per_token(self) -> bool:
        """As :attr:`RoPE.rotates_per_token`."""
        return self.rope.rotates_per_token

    def per_token_for(
        self, context: AttentionContext | jax.Array | tuple[jax.Array, jax.Array]
    ) -> RotaryTable | RoPEAtLength:
        """As :meth:`RoPE.per_token_for` (itself when its RoPE's frequencies do not follow the length)."""
        return self if self.rotates_per_token else self.rope.per_token_for(context)

    def rotate(
        self, q: jax.Array, k: jax.Array, context: AttentionContext | jax.Array | tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        """As :meth:`RoPE.rotate`, by the stored table when the positions are :attr:`positions` itself."""
        context = rotation_context(context, "RotaryTable.rotate")
        if context.query_positions is not self.positions or context.key_positions is not self.positions:
            return self.rope.rotate(q, k, context)
        return self.rotate_prepared(q, k)

    def rotate_prepared(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rotates queries ``[..., T, N, H]`` and keys ``[..., T, K, H]`` that are both at :attr:`positions`.

        What a model's layer calls for its own tokens (self-attention, or a decoding step's
        new tokens), at the positions the model prepared the table for: no positions are
        given, so none is compared or checked.

        Example:
          >>> pos = jnp.arange(6); q = k = jnp.ones((1, 6, 2, 8))
          >>> table = RoPE().prepare(pos, head_dim=8)
          >>> got, want = table.rotate_prepared(q, k), RoPE().rotate(q, k, pos)
          >>> all(bool(jnp.allclose(a, b)) for a, b in zip(got, want))
          True
        """
        rotary_dim = _check_qk_heads(q, k, self.rope.rotary_dim)
        _check_qk_fit(q, k, self.positions, self.positions)
        if self.table.shape[-1] != rotary_dim:
            raise ValueError(
                f"this RoPE table rotates {self.table.shape[-1]} features but q has rotary dim {rotary_dim} "
                f"(shape {q.shape}); prepare it with head_dim={q.shape[-1]}"
            )
        return _rotate_by_table(q, self.table, self.rope.layout), _rotate_by_table(k, self.table, self.rope.layout)


# Hooks that RoPE makes (unregistered: a prepared table, a length fixed for a call) declare their forms too.
declare_forms(RoPEAtLength, Forms(hooks=("rotate",), cached=("rotation",)))
declare_forms(RotaryTable, Forms(hooks=("rotate",), cached=("rotation",), fused=("per_call",)))
