"""The T5 family's configs (T5, mT5, Flan-T5): bucketed relative bias, scores unscaled.

:func:`_t5` reads a config into a :class:`~posenc_jax.functional.encodings.t5.T5Config`, the
encoder's bidirectional buckets or the decoder's causal ones, and a
:class:`~posenc_jax.functional.encodings.score_scale.FixedScoreScale` of 1;
:func:`_t5_weights` reads the checkpoint's bias table.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from posenc_jax.functional.encodings.score_scale import FixedScoreScale
from posenc_jax.functional.encodings.t5 import T5Config
from posenc_jax.hf.encoding import HFEncoding
from posenc_jax.hf.fields import _check_reads, _count, _find


def _t5(fields: dict, decoder: bool | None, notes: list) -> HFEncoding:
    _check_reads(
        fields,
        frozenset({"relative_attention_num_buckets", "relative_attention_max_distance", "n_positions"}),
        "t5",
    )
    num_heads = _count(fields, "num_heads", "T5's bias table [num_buckets, N]")
    head_dim = _count(fields, "d_kv", "T5's head dim")
    decoder = bool(fields.get("is_decoder", False)) if decoder is None else bool(decoder)
    max_distance = fields.get("relative_attention_max_distance")
    if max_distance is None:
        max_distance = 128
        notes.append("relative_attention_max_distance = 128: transformers' default (absent from the config)")
    t5 = T5Config(
        num_buckets=_count(fields, "relative_attention_num_buckets", "T5's bias"),
        max_distance=int(max_distance),
        bidirectional=not decoder,
    )
    notes.append("T5 scores are q·k without 1/√H: scale 1 (FixedScoreScale)")
    if "n_positions" in fields:
        notes.append("n_positions is a legacy field that transformers' T5 does not read (no length limit)")
    return HFEncoding(
        family="t5",
        encodings=(t5, FixedScoreScale(1.0)),
        scale=1.0,
        head_dim=head_dim,
        num_heads=num_heads,
        notes=tuple(notes),
        model_type=fields.get("model_type"),
        num_kv_heads=num_heads,
        causal=decoder,
    )


def _t5_weights(encoding: T5Config, num_heads: int, state_dict: Mapping) -> dict:
    """``{"table": relative_attention_bias.weight}`` of the first block's self-attention, which every layer shares."""
    side = "decoder" if not encoding.bidirectional else "encoder"
    table = _find(state_dict, f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    if table.shape != (encoding.num_buckets, num_heads):
        raise ValueError(
            f"relative_attention_bias has shape {table.shape}, expected [num_buckets, N] = "
            f"{(encoding.num_buckets, num_heads)}"
        )
    return {"table": jnp.asarray(table)}
