"""``implementation="auto"`` on a GPU: plain attention of rotated queries and keys, handed to cuDNN.

An encoding that only rotates queries and keys (RoPE and its scalings, xPos, axial RoPE), or
acts before attention (absolute encodings, NoPE), leaves softmax attention of the rotated ``q``
and ``k`` with no term in the scores: what cuDNN's fused flash attention, behind
``jax.nn.dot_product_attention(..., implementation="cudnn")``, computes without building the
``[B, N, T, S]`` scores. Core decides from facts of the call known at trace time whether its scores
are plain (:func:`~posenc_jax.functional.core.dispatch.plain_scores`: no term, softmax, no
mask beyond a causal one over indices); this form adds cuDNN's own limits, which
``jax.nn.dot_product_attention`` checks while tracing (float16 or bfloat16, the head sizes and
GPU generations it takes), and returns None for core's own path when they refuse.

Registered for the ``"gpu"`` backend only; the plain form (every other backend) is core's own
attention. The values are those of the plain path to the inputs' precision (cuDNN computes in
the inputs' half-precision type with float32 accumulation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.dispatch import FUSED_ATTENTION

__all__ = ["HALF_PRECISION", "cudnn_attention"]

# The dtypes cuDNN's flash attention takes (float8 aside, which this library does not use).
HALF_PRECISION = (jnp.bfloat16, jnp.float16)


@FUSED_ATTENTION.implement(backend="gpu")
def cudnn_attention(query, key, value, *, causal: bool, scale: float):
    """cuDNN's attention of ``query`` ``[B, T, N, H]``, ``key``, ``value`` ``[B, S, K, H]`` (K divides N),
    causal over indices or not, at ``scale``; None where cuDNN does not take the call (a float32 input,
    a head size or a GPU it refuses while tracing)."""
    if any(x.dtype not in HALF_PRECISION or x.dtype != query.dtype for x in (query, key, value)):
        return None
    try:
        return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=causal, implementation="cudnn")
    except (NotImplementedError, RuntimeError, ValueError):  # cuDNN's limits, checked while tracing
        return None
