"""Learned absolute position embeddings (BERT).

It fills the ``embed`` hook: ``x + table[positions]`` on the token embeddings. A
position outside the table is an error, never a silent clip.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import EncodingConfig, Placement, parameter, pytree_dataclass
from posenc_jax.functional.core.positions import add_position_encoding, check_embed_positions, check_positions
from posenc_jax.functional.core.registry import Source, register_encoding
from posenc_jax.functional.core.relative import check_max_distance
from posenc_jax.functional.core.validation import check_init_std, check_values

__all__ = ["LearnedAbsolute", "LearnedAbsoluteConfig", "learned_position_embedding"]

BERT = Source.paper(
    "devlin2018bert",
    title="BERT: Pre-training of Deep Bidirectional Transformers for Language Understanding",
    authors="Devlin, Jacob and Chang, Ming-Wei and Lee, Kenton and Toutanova, Kristina",
    year=2018,
    arxiv="1810.04805",
)


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

    check_values(check, positions, within=(0, num_positions))
    return jnp.take(table, positions, axis=0)


@pytree_dataclass
class LearnedAbsolute:
    """Learned absolute encoding as an ``embed`` hook: ``x + table[positions]``.

    The table (``[P, D]``) is a parameter held by the caller's module.

    Example:
      >>> x = jnp.zeros((2, 5, 8))
      >>> LearnedAbsolute(jnp.ones((16, 8))).embed(x, jnp.arange(5)).shape
      (2, 5, 8)
    """

    table: jax.Array = parameter()

    def embed(self, x: jax.Array, positions) -> jax.Array:
        """Adds ``table[positions]`` to ``x`` ``[..., T, D]``; the sum is in ``x``'s dtype."""
        if self.table.shape[-1] != x.shape[-1]:
            raise ValueError(
                f"learned table width {self.table.shape[-1]} does not match the embedding width {x.shape[-1]}"
            )
        positions = check_embed_positions(x, positions)
        return add_position_encoding(x, learned_position_embedding(self.table, positions))


@register_encoding(
    "learned",
    description="A learned table of absolute position embeddings (BERT); cannot go past its length.",
    source=BERT,
    small_settings=dict(max_positions=32),
    hook=LearnedAbsolute,
    hooks=("embed",),
    tiled=(),
    cached=(),
    prepared=None,
)
@pytree_dataclass
class LearnedAbsoluteConfig(EncodingConfig):
    """Learned absolute table ``[max_positions, D]``, N(0, 0.02) as in BERT."""

    max_positions: int = 512
    init_std: float = 0.02
    acts_on: ClassVar[Placement] = "embeddings"

    def __post_init__(self):
        check_max_distance(self.max_positions, "max_positions")
        check_init_std(self.init_std)

    def init(self, key, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return {"table": jax.random.normal(key, (self.max_positions, model_dim), jnp.float32) * self.init_std}

    def build(self, params: dict) -> LearnedAbsolute:
        return LearnedAbsolute(params["table"])

    def for_lengths(self, *, train_length: int, max_length: int, head_dim: int) -> LearnedAbsoluteConfig:
        """A table as long as the longest evaluation, so the failure to extrapolate is measured, not an error."""
        return dataclasses.replace(self, max_positions=max_length)
