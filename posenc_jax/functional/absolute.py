"""Absolute position encodings: sinusoidal, learned, and none (NoPE).

These fill the ``embed`` hook of the design: they are added to the token
embeddings ``x`` of shape ``[B, T, D]`` before the first layer, and the attention
itself stays position-blind.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.parameter_free import ParameterFree
from posenc_jax.functional.positions import check_positions, inverse_frequencies, position_angles

__all__ = [
    "LearnedAbsolute",
    "NoPE",
    "Sinusoidal",
    "learned_position_embedding",
    "sinusoidal_encoding",
]


def sinusoidal_encoding(positions, dim: int, *, base: float = 10000.0) -> jax.Array:
    """The fixed sinusoidal position encoding of Vaswani et al. 2017.

    ``P[t, 2i] = sin(t / base**(2i/dim))`` and ``P[t, 2i+1] = cos(t / base**(2i/dim))``:
    sines on even columns, cosines on odd ones, as in d2l §11.6 (seed 002).
    Any integer positions work (negative, offset, gapped, past any training
    length); there is no ``max_len``. For a fixed offset k, ``P[t+k] = M_k P[t]``
    with ``M_k`` a block rotation that does not depend on t.

    Args:
      positions: integer array ``[T]`` or ``[B, T]``.
      dim: even encoding width D.
      base: wavelength base.

    Returns:
      ``[..., T, D]`` float32 encoding. Phases are reduced modulo 2π exactly,
      so large positions stay accurate (see ``position_angles``).

    Reference: Vaswani et al., "Attention Is All You Need", 2017, arXiv:1706.03762.

    Example:
      >>> sinusoidal_encoding(jnp.arange(60), 32).shape
      (60, 32)
    """
    if not isinstance(dim, (int, np.integer)) or dim < 2 or dim % 2:
        raise ValueError(
            f"dim must be an even integer >= 2 for the sinusoidal encoding (sin/cos pairs), got {dim!r}"
        )
    angles = position_angles(positions, inverse_frequencies(dim, base=base))  # [..., T, D/2]
    # Interleave: column 2i is sin, column 2i+1 is cos.
    pairs = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [..., T, D/2, 2]
    return pairs.reshape(*angles.shape[:-1], dim)


def learned_position_embedding(table: jax.Array, positions) -> jax.Array:
    """Looks up learned absolute position embeddings (BERT): ``table[positions]``.

    A position outside ``[0, P)`` is an error, never a silent clip: with concrete
    positions it raises ``ValueError`` at once; under ``jax.jit`` a host check
    raises the same ``ValueError`` (wrapped in ``JaxRuntimeError``) when the
    computation runs.

    Args:
      table: ``[P, D]`` learned embeddings, one row per position.
      positions: integer array ``[T]`` or ``[B, T]``.

    Returns:
      ``[..., T, D]`` rows of ``table``, in ``table``'s dtype.

    Reference: Devlin et al., "BERT", 2018, arXiv:1810.04805.

    Example:
      >>> table = jnp.zeros((512, 64))
      >>> learned_position_embedding(table, jnp.arange(10)).shape
      (10, 64)
    """
    if np.ndim(table) != 2:
        raise ValueError(f"table must have shape [P, D], got shape {np.shape(table)}")
    positions = check_positions(positions)
    num_positions = table.shape[0]

    def check(pos):
        pos = np.asarray(pos)
        if pos.size and (pos.min() < 0 or pos.max() >= num_positions):
            bad = int(pos.max()) if pos.max() >= num_positions else int(pos.min())
            raise ValueError(
                f"position {bad} is outside the learned table of {num_positions} positions "
                f"[0, {num_positions}); a learned absolute encoding cannot extrapolate: "
                f"train with a larger table or use an encoding without a length ceiling"
            )

    try:
        check(positions)
    except jax.errors.TracerArrayConversionError:
        jax.debug.callback(check, positions)
    return jnp.take(table, positions, axis=0)


def _check_embed_positions(x: jax.Array, positions) -> jax.Array:
    positions = check_positions(positions)
    if x.ndim < 2:
        raise ValueError(f"x must have shape [..., T, D], got {x.shape}")
    if positions.shape[-1] != x.shape[-2] or positions.ndim > x.ndim - 1:
        raise ValueError(
            f"positions of shape {positions.shape} do not fit x of shape {x.shape}: "
            f"expected [T] or [B, T] with T = {x.shape[-2]}"
        )
    return positions


def _add_encoding(x: jax.Array, pe: jax.Array) -> jax.Array:
    """``x + pe`` in float32, cast back to ``x.dtype``; ``pe`` [..., T, D] left-padded to x's rank."""
    if pe.ndim < x.ndim:
        pe = pe.reshape((1,) * (x.ndim - pe.ndim) + pe.shape)
    return (x.astype(jnp.float32) + pe.astype(jnp.float32)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Sinusoidal(ParameterFree):
    """Sinusoidal absolute encoding as an ``embed`` hook: ``x + P[positions]``.

    Example:
      >>> x = jnp.zeros((2, 5, 8))
      >>> Sinusoidal().embed(x, jnp.arange(5)).shape
      (2, 5, 8)
    """

    base: float = 10000.0
    hooks: ClassVar[frozenset[str]] = frozenset({"embed"})

    def embed(self, x: jax.Array, positions) -> jax.Array:
        """Adds the encoding to ``x`` ``[..., T, D]``; the sum is in ``x``'s dtype."""
        positions = _check_embed_positions(x, positions)
        return _add_encoding(x, sinusoidal_encoding(positions, x.shape[-1], base=self.base))


@dataclasses.dataclass(frozen=True)
class LearnedAbsolute:
    """Learned absolute encoding as an ``embed`` hook: ``x + table[positions]``.

    The table (``[P, D]``) is a parameter held by the caller's module.

    Example:
      >>> x = jnp.zeros((2, 5, 8))
      >>> LearnedAbsolute(jnp.ones((16, 8))).embed(x, jnp.arange(5)).shape
      (2, 5, 8)
    """

    table: jax.Array
    hooks: ClassVar[frozenset[str]] = frozenset({"embed"})

    def embed(self, x: jax.Array, positions) -> jax.Array:
        """Adds ``table[positions]`` to ``x`` ``[..., T, D]``; the sum is in ``x``'s dtype."""
        if self.table.shape[-1] != x.shape[-1]:
            raise ValueError(
                f"learned table width {self.table.shape[-1]} does not match the embedding width {x.shape[-1]}"
            )
        positions = _check_embed_positions(x, positions)
        return _add_encoding(x, learned_position_embedding(self.table, positions))


@dataclasses.dataclass(frozen=True)
class NoPE(ParameterFree):
    """No positional encoding, as an explicit choice (Kazemnejad et al. 2023, arXiv:2305.19466).

    It fills no hook that changes anything: ``embed`` is the identity and the
    attention receives no position terms. With a causal mask a decoder can still
    infer positions; a bidirectional encoder cannot.

    Example:
      >>> x = jnp.ones((1, 3, 4))
      >>> bool((NoPE().embed(x, jnp.arange(3)) == x).all())
      True
    """

    hooks: ClassVar[frozenset[str]] = frozenset()

    def embed(self, x: jax.Array, positions) -> jax.Array:
        _check_embed_positions(x, positions)
        return x
