"""DeepSeek's decoupled RoPE: RoPE on the last features of each query and key head.

DeepSeek-V2's multi-head latent attention (section 2.1.3 of the paper) gives each query and
key head a part without positions and a part that carries RoPE, laid out as
``[no-position part | rotary part]``; :class:`RoPEOnLastFeatures` rotates the rotary part
with a :class:`~posenc_jax.functional.encodings.rope.RoPE` and passes the rest, so the scores
are ``q_C·k_C + RoPE(q_R)·RoPE(k_R)``. :func:`posenc_jax.hf.from_hf_config` builds it for
DeepSeek-V2/V3 configs.

Reference: DeepSeek-AI, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts
Language Model", 2024, arXiv:2405.04434.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.forms import Forms, declare_forms
from posenc_jax.functional.core.hooks import AttentionContext, ParameterFree, pytree_dataclass, rotation_context
from posenc_jax.functional.encodings.rope import RoPE

__all__ = ["RoPEOnLastFeatures"]


@pytree_dataclass
class RoPEOnLastFeatures(ParameterFree):
    """``rope`` applied to the last ``num_features`` features of each query and key head.

    DeepSeek's multi-head latent attention lays a query/key head out as
    ``[no-position part (qk_nope_head_dim) | rotary part (qk_rope_head_dim)]``; this hook
    rotates the rotary part and passes the rest, so the heads go to the attention as
    transformers builds them.

    Example:
      >>> q = k = jnp.ones((1, 5, 2, 24)); pos = jnp.arange(5)
      >>> hook = RoPEOnLastFeatures(RoPE(layout="interleaved"), num_features=8)
      >>> context = AttentionContext.from_positions(pos, pos, causal=True, scale=24**-0.5)
      >>> rotated, _ = hook.rotate(q, k, context)
      >>> bool(jnp.all(rotated[..., :16] == 1.0)), rotated.shape
      (True, (1, 5, 2, 24))
    """

    rope: RoPE = dataclasses.field(default_factory=RoPE)
    num_features: int = 64

    def __post_init__(self):
        if not isinstance(self.rope, RoPE):
            raise ValueError(f"rope must be a RoPE, got {self.rope!r}")
        if not isinstance(self.num_features, int) or self.num_features < 2 or self.num_features % 2:
            raise ValueError(f"num_features must be an even integer >= 2, got {self.num_features!r}")
        if self.rope.rotary_dim not in (None, self.num_features):
            raise ValueError(
                f"the RoPE rotates {self.rope.rotary_dim} features of the {self.num_features} it is given; "
                f"make it RoPE(rotary_dim=None)"
            )

    @property
    def length_dependent(self) -> bool:
        return self.rope.length_dependent

    @property
    def rotates_per_token(self) -> bool:
        """As :attr:`RoPE.rotates_per_token` (a KV cache then stores keys rotated)."""
        return self.rope.rotates_per_token

    def frequencies(self, head_dim: int | None = None, length: int | None = None) -> tuple[np.ndarray, float]:
        """The rotary part's ``[num_features / 2]`` inverse frequencies and attention factor."""
        return self.rope.frequencies(self.num_features, length)

    def rotate(
        self, q: jax.Array, k: jax.Array, context: AttentionContext | jax.Array | tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        """Rotates the last ``num_features`` features; ``context`` as in :meth:`RoPE.rotate`."""
        context = rotation_context(context, "RoPEOnLastFeatures.rotate")
        r = self.num_features
        if q.shape[-1] < r or k.shape[-1] < r:
            raise ValueError(f"heads of q {q.shape} and k {k.shape} are narrower than the {r} rotary features")
        q_rot, k_rot = self.rope.rotate(q[..., -r:], k[..., -r:], context)
        return (
            jnp.concatenate([q[..., :-r], q_rot], axis=-1),
            jnp.concatenate([k[..., :-r], k_rot], axis=-1),
        )


# Not registered (its size is a checkpoint's head layout); a KV cache keeps keys rotated as RoPE's.
declare_forms(RoPEOnLastFeatures, Forms(hooks=("rotate",), cached=("rotation",)))
