"""p-RoPE (Barbero et al. 2024, "Round and Round We Go! What makes Rotary Positional Encodings
useful?", arXiv:2410.06205) as a user would add it: one file, importing only the public contract.

RoPE's angle for frequency pair i is ``θ_i · m``; p-RoPE keeps the ``p`` fraction of pairs with the
highest frequencies and sets the others' frequency to zero, so those dimensions carry content
with no rotation (Gemma's ``rope_proportion``). Importing this module registers ``"p-rope"``.
"""

from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from posenc_jax.functional import (
    Forms,
    ParameterFree,
    apply_rope_qk,
    declare_forms,
    pytree_dataclass,
    register_encoding,
)
from posenc_jax.functional.core.positions import inverse_frequencies
from posenc_jax.functional.core.registry import Source

BARBERO = Source.paper(
    "barbero2024round",
    title="Round and Round We Go! What makes Rotary Positional Encodings useful?",
    authors="Barbero, Federico and Vitvitskyi, Alex and Perivolaropoulos, Christos and Pascanu, Razvan and "
    "Veličković, Petar",
    year=2024,
    arxiv="2410.06205",
)


def p_rope_frequencies(head_dim: int, proportion: float, base: float = 10000.0) -> np.ndarray:
    """``θ_i = base^(-2i/H)`` for the ``⌊p · H/2⌋`` highest frequencies, 0 for the rest."""
    theta = inverse_frequencies(head_dim, base=base)  # highest first
    kept = int(proportion * (head_dim // 2))
    return np.where(np.arange(head_dim // 2) < kept, theta, 0.0)


@pytree_dataclass
class _PRoPE(ParameterFree):
    proportion: float = 0.75
    base: float = 10000.0

    def __post_init__(self):
        if not 0.0 <= self.proportion <= 1.0:
            raise ValueError(f"proportion must be in [0, 1], got {self.proportion!r}")

    def rotate(self, q, k, context):
        frequencies = jnp.asarray(p_rope_frequencies(q.shape[-1], self.proportion, self.base), jnp.float32)
        return apply_rope_qk(
            q, k, context.query_positions, context.key_positions, inverse_frequency=frequencies, layout="half"
        )


@register_encoding(
    "p-rope",
    description="RoPE on the highest-frequency fraction p of its dimension pairs; the rest carry no position.",
    source=BARBERO,
    small_settings=dict(proportion=0.5),
    hooks=("rotate",),  # the hook it fills
    tiled=(),
    cached=("rotation",),  # its keys rotate by their own positions alone: a cache stores them rotated
    prepared=None,
)
@pytree_dataclass
class PRoPE(_PRoPE):
    """p-RoPE, declaring that it rotates each token by its own position (a KV cache stores keys rotated)."""

    rotates_per_token: ClassVar[bool] = True


@pytree_dataclass
class UndeclaredPRoPE(_PRoPE):
    """The same rotation without saying that it rotates per token (not registered): correct, but a KV
    cache would rotate every stored key again at each step; the contract test must catch it. It declares
    its hook (an object whose class declares none is refused), not the form cached.rotation."""


declare_forms(UndeclaredPRoPE, Forms(hooks=("rotate",)))
