"""A hook that fixes the attention's score scale, for checkpoints whose scale is not ``1/√H``.

T5 scores ``q·k`` unscaled (scale 1), Gemma by ``query_pre_attn_scalar^-1/2``, DeepSeek by an
mscale-corrected ``1/√H``; :func:`posenc_jax.hf.from_hf_config` puts a :class:`FixedScoreScale`
among such a checkpoint's encodings, so a model built from the encodings alone scores as the
checkpoint does. The attention's ``scale=`` argument does the same for one call.
"""

from __future__ import annotations

import math

import jax

from posenc_jax.functional.core.forms import Forms, declare_forms
from posenc_jax.functional.core.hooks import AttentionContext, ParameterFree, pytree_dataclass

__all__ = ["FixedScoreScale"]


@pytree_dataclass
class FixedScoreScale(ParameterFree):
    """Sets the content-score scale of the attention it is passed to (T5: 1, no 1/√H).

    A ``logits`` hook that adds nothing and prescribes ``scale`` through ``score_scale``,
    so a model built from a list of configs (``Transformer(encoding=[...])``) uses it in
    every layer.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> q = k = v = jnp.ones((1, 3, 2, 4)); pos = jnp.arange(3)
      >>> dot_product_attention(q, k, v, query_positions=pos, key_positions=pos,
      ...                       encodings=[FixedScoreScale(1.0)]).shape
      (1, 3, 2, 4)
    """

    scale: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.scale, (int, float)) and 0 < self.scale < math.inf):
            raise ValueError(f"scale must be a finite number > 0, got {self.scale!r}")

    def score_scale(self, head_dim: int) -> float:
        """The fixed scale, whatever the head dim."""
        return float(self.scale)

    def logits(self, q: jax.Array, k: jax.Array, context: AttentionContext) -> None:
        """No term: this hook only sets the scale."""
        return None


# Not registered (a setting of a checkpoint, not an encoding): it adds no term, so it has no other form.
declare_forms(FixedScoreScale, Forms(hooks=("logits",), tiled=(), scale="prescribed"))
