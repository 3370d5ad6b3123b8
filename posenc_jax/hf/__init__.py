"""Hugging Face transformers configs in this library's terms.

:func:`from_hf_config` reads the position settings of a transformers config (a dict
such as a ``config.json``, or any object with the same fields) and returns an
:class:`HFEncoding`: the encodings that reproduce them, with the layout, rotary size,
scaling, layer type and score scale the checkpoint was trained with.
:meth:`HFEncoding.attention_kwargs` gives the keyword arguments of
:func:`posenc_jax.functional.dot_product_attention` for one layer, and
:func:`load_hf_position_weights` maps a checkpoint's position parameters (T5's bias
table, DeBERTa's relative embeddings and projections, a learned absolute table) into
the encodings' parameters.

The families, by ``model_type``, and what each reads (transformers 5.24 for the
formulas; transformers 4 files, with ``rope_scaling``, load the same):

* **Llama 2/3.x, Mistral, Mixtral, Qwen2/2.5/3 and their MoE, Phi-2, Phi-3/3.5/4, StableLM,
  gpt-oss, Falcon (RoPE)**: ``rope_theta``, ``head_dim`` (else ``hidden_size /
  num_attention_heads``, which must divide), ``partial_rotary_factor`` and
  ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4) of type ``default``,
  ``linear``, ``dynamic``, ``yarn``, ``llama3`` or ``longrope``; split-half pairs
  (``rotate_half``); the score scale ``1/√head_dim``; ``sliding_window`` with
  ``layer_types`` (or Qwen's ``use_sliding_window`` / ``max_window_layers``, gpt-oss's
  alternating layers).
* **Gemma 2/3**: as above, with the score scale ``query_pre_attn_scalar^-0.5``; Gemma 3's
  sliding layers use ``rope_local_base_freq``, unscaled (``rope_scaling`` is the full
  layers'); ``attn_logit_softcapping`` (Gemma 2) is reported, not applied.
* **DeepSeek-V2/V3**: the RoPE acts on the last ``qk_rope_head_dim`` features of the
  ``qk_nope_head_dim + qk_rope_head_dim`` query/key heads, in interleaved pairs (V2;
  V3 unless ``rope_interleave`` is false); the score scale is ``qk_head_dim^-0.5 ·
  m(factor, mscale_all_dim)²`` with ``m(s, a) = 0.1·a·ln s + 1``.
* **GPT-NeoX / Pythia**: ``rotary_pct`` of the head rotates, base ``rotary_emb_base``.
* **GPT-J**: the first ``rotary_dim`` features rotate, in interleaved pairs.
* **BLOOM, MPT, Falcon (``alibi: true``)**: ALiBi with Press et al.'s slopes; Falcon adds
  it before dividing by √H (slopes ``m/√H``); MPT's ``attn_config`` gives
  ``alibi_bias_max`` and ``softmax_scale``.
* **T5, mT5, Flan-T5**: bucketed relative bias (bidirectional in the encoder, causal in
  the decoder), no division by √H (score scale 1).
* **DeBERTa-v2/v3**: disentangled c2p/p2c terms over log buckets, score scale
  ``1/√(H·(1 + number of terms))``, and a learned absolute table when
  ``position_biased_input``.

A field that bears on positions or the score scale and that the loader does not read is
an error naming it, as are a missing or unknown ``model_type`` (never read as another
family's), an unknown ``rope_type``, a ``rope_scaling`` key that the type does not have,
and a ``layer_type=`` the config does not have. Every numeric or true/false field it reads
is checked before it is used: a bool, a string, NaN or a value out of range (``rope_theta=True``,
``num_key_value_heads=0`` or one that does not divide the heads, an odd head that RoPE
rotates whole, LongRoPE factors given as strings) is an error naming the field. Where transformers
4 and 5 differ, this follows transformers 5: a YaRN or LongRoPE ``factor`` given in the
config is used as given.

Example:
  >>> llama31 = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
  ...            "max_position_embeddings": 131072, "rope_theta": 500000.0,
  ...            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
  ...                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
  >>> loaded = from_hf_config(llama31)
  >>> loaded.encodings[0].layout, loaded.encodings[0].base, loaded.encodings[0].scaling.factor
  ('half', 500000.0, 8.0)
  >>> round(loaded.scale, 6), loaded.causal
  (0.088388, True)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from posenc_jax.functional.encodings.alibi import ALiBiSlopes
from posenc_jax.functional.encodings.deberta import DeBERTaConfig
from posenc_jax.functional.encodings.learned_absolute import LearnedAbsoluteConfig
from posenc_jax.functional.encodings.rope_decoupled import RoPEOnLastFeatures
from posenc_jax.functional.encodings.score_scale import FixedScoreScale
from posenc_jax.functional.encodings.t5 import T5Config
from posenc_jax.hf.alibi import _alibi
from posenc_jax.hf.deberta import _absolute_weights, _deberta, _deberta_weights, deberta_position_tables
from posenc_jax.hf.encoding import HFEncoding, sliding_window_mask
from posenc_jax.hf.fields import _fields
from posenc_jax.hf.rope import _ROPE_MODEL_TYPES, ROPE_TYPES, _rope
from posenc_jax.hf.t5 import _t5, _t5_weights

__all__ = [
    "ALiBiSlopes",
    "FixedScoreScale",
    "HFEncoding",
    "ROPE_TYPES",
    "RoPEOnLastFeatures",
    "deberta_position_tables",
    "from_hf_config",
    "load_hf_position_weights",
    "sliding_window_mask",
]

# Each family's reader is its module in this package (rope, alibi, t5, deberta), named as the encodings it
# builds in functional/encodings; this module dispatches a config to one by its model_type.
_MODEL_TYPES = frozenset({*_ROPE_MODEL_TYPES, "bloom", "mpt", "t5", "mt5", "deberta-v2"})


def from_hf_config(config, *, layer_type: str | None = None, decoder: bool | None = None) -> HFEncoding:
    """The encodings of a Hugging Face transformers config, with the checkpoint's score scale.

    Args:
      config: a dict (e.g. a parsed ``config.json``) or a transformers config object.
      layer_type: the layer type to read (``"full_attention"``, ``"sliding_attention"``)
        when the config's layers differ (Gemma 2/3, gpt-oss, Qwen with a window, nested
        ``rope_parameters``); it must be one of the config's types.
      decoder: T5 only: the decoder's causal buckets (True) or the encoder's
        bidirectional ones (False); default the config's ``is_decoder``.

    Returns:
      An :class:`HFEncoding`: the encoding configs, the score scale, the sizes, the
      layer type and its window, and whether the attention is causal.

    Raises:
      ValueError: naming the field, its value and the fix, for a config this loader
        cannot reproduce (an unknown ``rope_type`` or field, no position settings, a
        layer type the config does not have, ...).
    """
    notes: list[str] = []
    fields = _fields(config, notes)
    model_type = fields.get("model_type")
    if model_type == "deberta":
        raise ValueError(
            "DeBERTa v1 configs are not supported: v1 slices its relative table by the sequence length; "
            "load a deberta-v2 (or v3) config"
        )
    _check_model_type(model_type)
    if model_type in ("t5", "mt5"):
        loaded = _t5(fields, decoder, notes)
    elif model_type == "deberta-v2":
        loaded = _deberta(fields, notes)
    elif model_type in ("bloom", "mpt") or (model_type == "falcon" and fields.get("alibi")):
        loaded = _alibi(fields, model_type, notes)
    else:
        loaded = _rope(fields, model_type, layer_type, notes)
    if decoder is not None and loaded.family != "t5":
        raise ValueError(f"decoder= is for T5's encoder and decoder; model_type {model_type!r} has one attention")
    loaded = _carrying_scale(loaded)
    if loaded.family == "rope":
        return loaded
    if layer_type not in (None, "full_attention"):
        raise ValueError(
            f"layer_type {layer_type!r} is not one of this config's layer types ['full_attention'] "
            f"(model_type {model_type!r} has one kind of layer)"
        )
    return loaded


def _check_model_type(model_type) -> None:
    """Refuses a config of no family, or of one this loader does not know: how it applies positions is unknown."""
    known = sorted(_MODEL_TYPES)
    if model_type in (None, ""):
        raise ValueError(
            f"the config has no model_type, so which family's positions it holds is unknown; add model_type as in "
            f"the model's config.json (this loader reads {known})"
        )
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not a family this loader knows ({known}); read as another family "
            f"(Llama's RoPE, say) its positions could be silently wrong: load a config of one of these families"
        )


def _carrying_scale(loaded: HFEncoding) -> HFEncoding:
    """``loaded`` with ``FixedScoreScale(scale)`` among its encodings when they would give another scale.

    The attention's default is ``1/√H``; an encoding may prescribe another (T5's
    ``FixedScoreScale(1.0)``, DeBERTa's ``1/√(3H)``). A checkpoint's scale that neither gives
    (Gemma's ``query_pre_attn_scalar``, DeepSeek's mscale, MPT's ``softmax_scale``) goes into the
    encodings too, so a model built from them alone (``MultiHeadAttention(encodings=...)``,
    ``Transformer(encoding=...)``, ``dot_product_attention(encodings=loaded.hooks())``) scores as
    the checkpoint does.
    """
    if any(isinstance(e, (FixedScoreScale, DeBERTaConfig)) for e in loaded.encodings):
        return loaded
    if math.isclose(loaded.scale, loaded.head_dim**-0.5, rel_tol=1e-12):
        return loaded
    note = f"the score scale {loaded.scale:.6g} is not 1/sqrt({loaded.head_dim}): FixedScoreScale carries it"
    return dataclasses.replace(
        loaded, encodings=(*loaded.encodings, FixedScoreScale(loaded.scale)), notes=(*loaded.notes, note)
    )


def load_hf_position_weights(
    config,
    state_dict: Mapping,
    *,
    layer: int | None = None,
    layer_type: str | None = None,
    decoder: bool | None = None,
) -> tuple[dict, ...]:
    """A checkpoint's position parameters as the encodings' ``params``, one dict per encoding.

    The result lines up with ``from_hf_config(config, layer_type=..., decoder=...).encodings``
    and goes to :meth:`HFEncoding.hooks` or :meth:`HFEncoding.attention_kwargs`
    (``params=``). Keys are matched by their ending, so any model prefix (``deberta.``,
    ``encoder.`` of a T5EncoderModel, ...) works; values are NumPy arrays or torch tensors.

    * T5: ``{"table": relative_attention_bias.weight}`` ``[num_buckets, N]`` of the first
      block's self-attention (the one every layer shares), the encoder's or the decoder's.
    * DeBERTa-v2: ``{"pos_key": K_r, "pos_query": Q_r}`` of ``layer``:
      ``rel_embeddings.weight`` (after the encoder's ``LayerNorm`` when ``norm_rel_ebd``
      says ``layer_norm``) through the layer's ``pos_key_proj`` / ``pos_query_proj`` (its
      ``key_proj`` / ``query_proj`` with ``share_att_key``), torch's ``[out, in]`` kernels
      transposed; and ``{"table": embeddings.position_embeddings.weight}`` for the
      absolute table when ``position_biased_input``.
    * RoPE and ALiBi: ``{}`` (no parameters).

    Args:
      config: as for :func:`from_hf_config`.
      state_dict: the checkpoint's ``{name: array}``.
      layer: DeBERTa: the layer whose projections to use (each layer projects the shared
        table with its own weights).
      layer_type, decoder: as for :func:`from_hf_config`.

    Example:
      >>> t5 = {"model_type": "t5", "d_kv": 8, "num_heads": 2, "relative_attention_num_buckets": 32}
      >>> state = {"encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": np.zeros((32, 2))}
      >>> params = load_hf_position_weights(t5, state)
      >>> params[0]["table"].shape, params[1]
      ((32, 2), {})
    """
    loaded = from_hf_config(config, layer_type=layer_type, decoder=decoder)
    fields = _fields(config, [])
    params: list[dict] = []
    for encoding in loaded.encodings:
        if isinstance(encoding, T5Config):
            params.append(_t5_weights(encoding, loaded.num_heads, state_dict))
        elif isinstance(encoding, LearnedAbsoluteConfig):
            params.append(_absolute_weights(encoding, state_dict))
        elif isinstance(encoding, DeBERTaConfig):
            params.append(_deberta_weights(fields, encoding, loaded.num_heads, state_dict, layer))
        else:
            params.append({})
    return tuple(params)
