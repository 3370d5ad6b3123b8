"""Axial 2-D RoPE for image patches: one half of each head rotated by column, the other by row.

A common 2-D extension of RoPE (Su et al. 2021, arXiv:2104.09864) for vision
Transformers (e.g. Heo et al. 2024, "Rotary Position Embedding for Vision
Transformer", arXiv:2403.13298, its "axial" variant).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import AttentionContext, ParameterFree, pytree_dataclass, rotation_context
from posenc_jax.functional.core.positions import check_positions, inverse_frequencies
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.encodings.rope import Layout, _check_layout, apply_rope

__all__ = ["AxialRoPE", "apply_rope_2d"]

ROPE_VIT = Source.paper(
    "heo2024rotary",
    title="Rotary Position Embedding for Vision Transformer",
    authors="Heo, Byeongho and Park, Song and Han, Dongyoon and Yun, Sangdoo",
    year=2024,
    arxiv="2403.13298",
)


def apply_rope_2d(x: jax.Array, positions, *, base: float = 10000.0, layout: Layout = "interleaved") -> jax.Array:
    """Axial 2-D RoPE for image patches: the first half of each head by x, the second by y.

    ``positions[..., t, :] = (x, y)`` (column, row) of patch t. Each half of the head
    is a 1-D RoPE of width H/2 with its own frequency ladder, so on a one-row image
    (y = 0) the result is 1-D RoPE on the first half and the identity on the second.

    Args:
      x: ``[..., T, N, H]`` with H divisible by 4.
      positions: integer ``[T, 2]`` or ``[B, T, 2]``.

    Example:
      >>> xy = jnp.stack(jnp.meshgrid(jnp.arange(4), jnp.arange(3)), -1).reshape(12, 2)
      >>> apply_rope_2d(jnp.ones((1, 12, 2, 16)), xy).shape
      (1, 12, 2, 16)
    """
    head_dim = x.shape[-1]
    if head_dim % 4:
        raise ValueError(f"head_dim must be divisible by 4 for axial 2-D RoPE (two even halves), got {head_dim}")
    positions = check_positions(positions)
    if positions.ndim < 2 or positions.shape[-1] != 2:
        raise ValueError(f"2-D positions must have shape [T, 2] or [B, T, 2] (x, y), got {positions.shape}")
    half = head_dim // 2
    first = apply_rope(x[..., :half], positions[..., 0], base=base, layout=layout)
    second = apply_rope(x[..., half:], positions[..., 1], base=base, layout=layout)
    return jnp.concatenate([first, second], axis=-1)


@register_encoding(
    "rope-2d",
    description="Axial 2-D RoPE over a row-major patch grid: half of each head by column, half by row.",
    source=ROPE_VIT,
    small_settings=dict(grid_width=3),
    hooks=("rotate",),
    tiled=(),
    cached=("rotation",),
    prepared=None,
)
@pytree_dataclass
class AxialRoPE(ParameterFree):
    """Axial 2-D RoPE as a ``rotate`` hook, for row-major flattened patch grids.

    The attention's positions stay 1-D: patch index ``p`` of a grid ``grid_width``
    wide is at ``(x, y) = (p % grid_width, p // grid_width)``.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 12, 2, 16)); pos = jnp.arange(12)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[AxialRoPE(grid_width=4)]).shape
      (1, 12, 2, 16)
    """

    grid_width: int
    base: float = 10000.0
    layout: Layout = "interleaved"
    # A key's rotation depends on its own position alone: a KV cache may hold it rotated.
    rotates_per_token: ClassVar[bool] = True

    def __post_init__(self):
        _check_layout(self.layout)
        inverse_frequencies(2, base=self.base)  # validates the base
        if not isinstance(self.grid_width, (int, np.integer)) or self.grid_width < 1:
            raise ValueError(f"grid_width must be an integer >= 1, got {self.grid_width!r}")

    def rotate(
        self, q: jax.Array, k: jax.Array, context: AttentionContext | jax.Array | tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        """Rotates q and k by their patches' (column, row); ``context`` as in :meth:`RoPE.rotate`
        (an :class:`AttentionContext`, 1-D patch indices, or ``(query_positions, key_positions)``)."""
        context = rotation_context(context, "AxialRoPE.rotate")

        def xy(p):
            return jnp.stack([p % self.grid_width, p // self.grid_width], axis=-1)

        return (
            apply_rope_2d(q, xy(context.query_positions), base=self.base, layout=self.layout),
            apply_rope_2d(k, xy(context.key_positions), base=self.base, layout=self.layout),
        )

    def for_lengths(self, *, train_length: int, max_length: int, head_dim: int) -> AxialRoPE:
        """A square grid for the training length (sequences are read as rows of that width)."""
        return dataclasses.replace(self, grid_width=max(1, int(np.sqrt(train_length))))
