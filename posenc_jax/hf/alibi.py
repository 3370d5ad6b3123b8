"""The ALiBi families' configs: BLOOM, MPT, and Falcon with ``alibi: true``.

Each reader gives an :class:`~posenc_jax.functional.encodings.alibi.ALiBi` where the checkpoint's
slopes are Press et al.'s, else an :class:`~posenc_jax.functional.encodings.alibi.ALiBiSlopes`
with its own (Falcon's ``get_slopes(N)/√H``, MPT's from ``alibi_bias_max``), and the score scale.
"""

from __future__ import annotations

import math

import numpy as np

from posenc_jax.functional.encodings.alibi import ALiBi, ALiBiSlopes, alibi_slopes
from posenc_jax.hf.encoding import HFEncoding
from posenc_jax.hf.fields import _POSITION_FIELD, _check_reads, _grouped, _head_dim, _num_heads
from posenc_jax.hf.rope import _ROPE_READS, _kv_heads

# MPT's attn_config keys, with MptAttentionConfig's defaults.
_MPT_ATTN_DEFAULTS = {
    "attn_type": "multihead_attention",
    "attn_pdrop": 0.0,
    "attn_impl": "torch",
    "clip_qkv": None,
    "softmax_scale": None,
    "prefix_lm": False,
    "qk_ln": False,
    "attn_uses_sequence_id": False,
    "alibi": True,
    "alibi_bias_max": 8,
    "kv_n_heads": None,
}


def _alibi(fields: dict, model_type: str, notes: list) -> HFEncoding:
    family = {"bloom": _bloom, "falcon": _falcon_alibi, "mpt": _mpt}[model_type]
    encoding, num_heads, head_dim, kv_heads, scale = family(fields, notes)
    notes.append("ALiBi in its causal form m*(j - i), which differs from the checkpoint's m*j by a per-row constant")
    return HFEncoding(
        family="alibi",
        encodings=(encoding,),
        scale=scale,
        head_dim=head_dim,
        num_heads=num_heads,
        notes=tuple(notes),
        model_type=model_type,
        num_kv_heads=kv_heads,
        causal=True,
    )


def _bloom(fields: dict, notes: list):
    """BLOOM: Press et al.'s slopes added to q·k/√H (``alibi.baddbmm(q, k, alpha=1/√H)``)."""
    _check_reads(fields, frozenset({"offset_alibi"}), "bloom")
    num_heads = _num_heads(fields, "n_head")
    head_dim = _head_dim(fields, num_heads, "n_embed")
    if "offset_alibi" in fields:
        notes.append("offset_alibi is a Megatron training setting that transformers' BLOOM does not read")
    return ALiBi(bidirectional=False), num_heads, head_dim, num_heads, head_dim**-0.5


def _falcon_alibi(fields: dict, notes: list):
    """Falcon with ``alibi``: ``(q·k + alibi) / √H``, so the slopes are ``get_slopes(N) / √H``."""
    _check_reads(fields, _ROPE_READS | frozenset({"alibi"}), "falcon")
    num_heads = _num_heads(fields, "n_head")
    head_dim = _head_dim(fields, num_heads, "n_embed")
    slopes = alibi_slopes(num_heads) / math.sqrt(head_dim)
    notes.append(f"Falcon adds ALiBi before dividing the scores by sqrt(H): slopes get_slopes(N) / sqrt({head_dim})")
    encoding = ALiBiSlopes(tuple(float(s) for s in slopes), bidirectional=False)
    return encoding, num_heads, head_dim, _kv_heads(fields, num_heads, "falcon"), head_dim**-0.5


def _mpt(fields: dict, notes: list):
    """MPT: ``q·k · softmax_scale + alibi`` with slopes from ``alibi_bias_max`` (Press et al.'s for 8)."""
    _check_reads(fields, frozenset({"max_seq_len", "learned_pos_emb"}), "mpt")
    num_heads = _num_heads(fields, "n_heads")
    head_dim = _head_dim(fields, num_heads, "d_model")
    attn = _mpt_attention(fields.get("attn_config") or {})
    bias_max = attn["alibi_bias_max"]
    if bias_max == 8:
        encoding = ALiBi(bidirectional=False)  # MPT's slopes are get_slopes(N) for the default 8
    else:
        encoding = ALiBiSlopes(tuple(float(s) for s in _mpt_slopes(num_heads, bias_max)), bidirectional=False)
        notes.append(f"alibi_bias_max = {bias_max}: MPT's slopes (transformers' MPT uses 8 whatever the config)")
    if fields.get("learned_pos_emb"):
        notes.append("learned_pos_emb: no table with ALiBi on (transformers' MPT has none)")
    kv_heads = {"multihead_attention": num_heads, "multiquery_attention": 1}.get(
        attn["attn_type"], _grouped(attn["kv_n_heads"], "attn_config.kv_n_heads", num_heads, "n_heads")
    )
    scale = head_dim**-0.5
    if attn["softmax_scale"] is not None:
        scale = float(attn["softmax_scale"])
        notes.append(f"score scale attn_config.softmax_scale = {scale}")
    return encoding, num_heads, head_dim, kv_heads, scale


def _mpt_attention(attn: dict) -> dict:
    # A transformers object's attn_config.to_dict() carries every generic config field too.
    unknown = sorted(
        k
        for k in attn
        if k not in _MPT_ATTN_DEFAULTS
        and k not in ("rope", "sliding_window_size")
        and (_POSITION_FIELD.search(k) or k.startswith(("attn_", "qk_", "alibi")))
    )
    if unknown:
        raise ValueError(
            f"attn_config has {unknown}, which this loader does not read (it reads {sorted(_MPT_ATTN_DEFAULTS)})"
        )
    if attn.get("rope") or attn.get("sliding_window_size") not in (None, -1):
        raise ValueError(
            f"attn_config rope={attn.get('rope')!r}, sliding_window_size={attn.get('sliding_window_size')!r}: "
            f"transformers' MPT has neither; this loader reads ALiBi MPT checkpoints only"
        )
    attn = {**_MPT_ATTN_DEFAULTS, **{k: v for k, v in attn.items() if k in _MPT_ATTN_DEFAULTS}}
    if not attn["alibi"]:
        raise ValueError("attn_config alibi=False: transformers' MPT always adds ALiBi, so its positions are unknown")
    if attn["prefix_lm"]:
        raise ValueError("attn_config prefix_lm=True: the prefix-LM mask is not reproduced by this loader")
    return attn


def _mpt_slopes(num_heads: int, bias_max: float) -> np.ndarray:
    """MPT's ``build_alibi_bias`` slopes: ``2^(-b·k/N')`` for the next power of two N', reordered if N' > N."""
    padded = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / 2.0 ** (np.arange(1, padded + 1) * (bias_max / padded))
    if padded != num_heads:
        slopes = np.concatenate([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes
