"""``implementation="pallas"``: what the flash-attention kernels support, checked, and the call handed to them.

Registered as the form of core's ``PALLAS_ATTENTION`` operation for every backend. The kernels
(:mod:`posenc_jax.functional.kernels.pallas`) are imported when first called, so importing the
library never imports Pallas.
"""

from __future__ import annotations

import jax.numpy as jnp

from posenc_jax.functional.core.dispatch import PALLAS_ATTENTION
from posenc_jax.functional.core.forms import declares, forms_of

__all__ = ["SUPPORTED", "pallas_attention", "unsupported"]

SUPPORTED = (
    "implementation='pallas' supports softmax attention with biases that declare a per-head form (ALiBi, T5, Kerple, "
    "Sandwich, the learned clipped bias, FIRE; NoPE adds none), causal or bidirectional, grouped-query heads, explicit "
    "positions, segment ids and key_mask"
)


def unsupported(hooks, normalizer, mask, dropout_rate) -> str | None:
    """Why the kernels cannot compute this call (None: they can)."""
    for hook in hooks:
        if not forms_of(hook).has("tiled", "head"):
            return f"{type(hook).__name__} has no per-head form (the tiled form 'head')"
    if not declares(normalizer, "softmax"):
        return f"the normalizer {type(normalizer).__name__} is not softmax"
    if mask is not None:
        return "an extra mask= is given"
    if dropout_rate:
        return f"dropout_rate={dropout_rate} is not 0"
    return None


@PALLAS_ATTENTION.implement()
def pallas_attention(call, normalizer, masks, dropout, blocks):
    """The attention of stage 1's ``call`` (made with ``build_mask=False``) by the Pallas kernels, float32 or
    the query's dtype ``[B, T, N, H]``; a ValueError naming what the kernels support for anything else."""
    key_mask, query_segment_ids, key_segment_ids, mask = masks
    reason = unsupported(call.hooks, normalizer, mask, dropout[0])
    if reason is not None:
        raise ValueError(f"{SUPPORTED}; here {reason}: use implementation='blockwise' or 'materialize'")
    from posenc_jax.functional.kernels.pallas import flash_attention, joined_head_bias

    context = call.context
    q_len, k_len = call.query.shape[1], call.key.shape[1]
    query_positions = jnp.arange(q_len) if context.query_positions is None else context.query_positions
    key_positions = jnp.arange(k_len) if context.key_positions is None else context.key_positions
    return flash_attention(
        call.query,
        call.key,
        call.value,
        query_positions=query_positions,
        key_positions=key_positions,
        head_bias=joined_head_bias([hook.head_bias(context) for hook in call.hooks]),
        causal=context.causal,
        scale=context.scale,
        query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids,
        key_mask=key_mask,
        block_q=blocks[0],
        block_k=blocks[1],
    )
