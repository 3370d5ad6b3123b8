"""The sinusoidal absolute encoding (Vaswani et al. 2017; d2l §11.6).

It fills the ``embed`` hook: added to the token embeddings ``x`` ``[B, T, D]`` before
the first layer, so the attention itself stays position-blind.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import ParameterFree, Placement, pytree_dataclass
from posenc_jax.functional.core.positions import (
    add_position_encoding,
    check_embed_positions,
    inverse_frequencies,
    position_angles,
)
from posenc_jax.functional.core.registry import Source, register_encoding

__all__ = ["Sinusoidal", "sinusoidal_encoding"]

VASWANI = Source.paper(
    "vaswani2017attention",
    title="Attention Is All You Need",
    authors="Vaswani, Ashish and Shazeer, Noam and Parmar, Niki and Uszkoreit, Jakob and Jones, Llion and "
    "Gomez, Aidan N. and Kaiser, Lukasz and Polosukhin, Illia",
    year=2017,
    arxiv="1706.03762",
)


def sinusoidal_encoding(positions, dim: int, *, base: float = 10000.0) -> jax.Array:
    """The fixed sinusoidal position encoding of Vaswani et al. 2017.

    ``P[t, 2i] = sin(t / base**(2i/dim))`` and ``P[t, 2i+1] = cos(t / base**(2i/dim))``:
    sines on even columns, cosines on odd ones, as in d2l §11.6.
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
        raise ValueError(f"dim must be an even integer >= 2 for the sinusoidal encoding (sin/cos pairs), got {dim!r}")
    angles = position_angles(positions, inverse_frequencies(dim, base=base))  # [..., T, D/2]
    # Interleave: column 2i is sin, column 2i+1 is cos.
    pairs = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [..., T, D/2, 2]
    return pairs.reshape(*angles.shape[:-1], dim)


@register_encoding(
    "sinusoidal",
    description="Fixed sinusoids of the position added to the token embeddings (sin on even, cos on odd columns).",
    source=VASWANI,
    hooks=("embed",),
    tiled=(),
    cached=(),
    prepared=None,
)
@pytree_dataclass
class Sinusoidal(ParameterFree):
    """Sinusoidal absolute encoding as an ``embed`` hook: ``x + P[positions]``.

    Example:
      >>> x = jnp.zeros((2, 5, 8))
      >>> Sinusoidal().embed(x, jnp.arange(5)).shape
      (2, 5, 8)
    """

    base: float = 10000.0
    acts_on: ClassVar[Placement] = "embeddings"

    def __post_init__(self):
        inverse_frequencies(2, base=self.base)  # validates the base

    def embed(self, x: jax.Array, positions) -> jax.Array:
        """Adds the encoding to ``x`` ``[..., T, D]``; the sum is in ``x``'s dtype."""
        positions = check_embed_positions(x, positions)
        return add_position_encoding(x, sinusoidal_encoding(positions, x.shape[-1], base=self.base))
