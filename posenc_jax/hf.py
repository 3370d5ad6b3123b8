"""Hugging Face transformers configs in this library's terms.

:func:`from_hf_config` reads the position settings of a transformers config (a dict
such as a ``config.json``, or any object with the same fields) and returns the
encodings that reproduce them:

* **RoPE** (Llama, Mistral, Qwen, Phi-3, DeepSeek, GPT-NeoX ports, ...): ``rope_theta``,
  ``partial_rotary_factor``, ``head_dim`` and ``rope_parameters`` (transformers 5) or
  ``rope_scaling`` (transformers 4) with ``rope_type`` (or the older ``type``)
  ``default``, ``linear``, ``dynamic``, ``yarn`` (``factor``, ``attention_factor``,
  ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate``,
  ``original_max_position_embeddings``), ``llama3`` and ``longrope`` (``short_factor``,
  ``long_factor`` and the optional ``factor`` and ``attention_factor``). These checkpoints
  pair feature i with feature i + R/2 (``rotate_half``), so the RoPE has ``layout="half"``.
* **T5** (``relative_attention_num_buckets``, ``relative_attention_max_distance``):
  bidirectional buckets in the encoder, causal ones in the decoder, and no division by
  √H: T5 adds its bias to raw ``q·k`` scores, so the result's ``scale`` is 1 and its
  encodings carry a :class:`FixedScoreScale` that says so to the attention.
* **DeBERTa-v2/v3** (``relative_attention``, ``position_buckets``,
  ``max_relative_positions``, ``pos_att_type``, ``share_att_key``,
  ``position_biased_input``): the disentangled c2p/p2c terms with the tables only the
  chosen terms read, and a learned absolute table when positions are added to the input.
  :func:`deberta_position_tables` makes the ``[2·span, N, H]`` tables from a checkpoint's
  relative embeddings and projections, as DeBERTa-v2 does at every forward.

Where transformers 4 and 5 differ, this follows transformers 5: a YaRN or LongRoPE
``factor`` given in the config is used as given (transformers 4 replaced it by
``max_position_embeddings / original_max_position_embeddings`` when the latter was set).
Only the configuration is read; loading weights is left to the caller.

Example:
  >>> llama31 = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
  ...            "max_position_embeddings": 131072, "rope_theta": 500000.0,
  ...            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
  ...                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
  >>> loaded = from_hf_config(llama31)
  >>> loaded.encodings[0].layout, loaded.encodings[0].base, loaded.encodings[0].scaling.factor
  ('half', 500000.0, 8.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from posenc_jax.functional.core.hooks import AttentionContext, EncodingConfig, ParameterFree, pytree_dataclass
from posenc_jax.functional.encodings.deberta import DeBERTaConfig
from posenc_jax.functional.encodings.learned_absolute import LearnedAbsoluteConfig
from posenc_jax.functional.encodings.rope import RoPE
from posenc_jax.functional.encodings.rope_scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    YaRNScaling,
)
from posenc_jax.functional.encodings.t5 import T5Config

__all__ = ["FixedScoreScale", "HFEncoding", "ROPE_TYPES", "deberta_position_tables", "from_hf_config"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


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


@dataclasses.dataclass(frozen=True)
class HFEncoding:
    """The position settings of a transformers config, in this library's terms.

    Attributes:
      family: ``"rope"``, ``"t5"`` or ``"deberta-v2"``.
      encodings: the encoding configs, for ``Transformer(encoding=list(encodings))`` or
        ``MultiHeadAttention(encodings=...)`` (an absolute table goes to the Transformer).
      scale: the content-score scale the checkpoint uses: None for ``1/√H`` (or the scale
        an encoding prescribes, as DeBERTa's ``1/√(3H)``), 1.0 for T5.
      head_dim: H.
      num_heads: N.
      notes: what the loader decided that the config left open.
    """

    family: str
    encodings: tuple[EncodingConfig, ...]
    scale: float | None
    head_dim: int
    num_heads: int
    notes: tuple[str, ...] = ()


def _fields(config) -> dict:
    """A transformers config object or dict as a plain dict of its fields."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        fields = dict(config.to_dict())
        # transformers 5 keeps rope_scaling as a property over rope_parameters.
        for name in ("rope_parameters", "rope_scaling", "head_dim", "original_max_position_embeddings"):
            if name not in fields and getattr(config, name, None) is not None:
                fields[name] = getattr(config, name)
        return fields
    if hasattr(config, "__dict__"):
        return {k: v for k, v in vars(config).items() if not k.startswith("_")}
    raise ValueError(f"config must be a dict or a transformers config object (fields as attributes), got {config!r}")


def _required(fields: dict, name: str, what: str):
    if fields.get(name) is None:
        raise ValueError(f"the config has no {name!r}, which {what} needs; add it (as in the model's config.json)")
    return fields[name]


def _heads(fields: dict) -> tuple[int, int]:
    num_heads = int(_required(fields, "num_attention_heads", "the head count"))
    head_dim = fields.get("head_dim") or fields.get("attention_head_size")
    if head_dim is None:
        hidden = int(_required(fields, "hidden_size", "the head dim (hidden_size / num_attention_heads)"))
        head_dim = hidden // num_heads
    return int(head_dim), num_heads


def from_hf_config(config, *, layer_type: str | None = None, decoder: bool | None = None) -> HFEncoding:
    """The encodings of a Hugging Face transformers config (RoPE family, T5 or DeBERTa-v2).

    Args:
      config: a dict (e.g. a parsed ``config.json``) or a transformers config object.
      layer_type: for configs whose ``rope_parameters`` are nested per layer type
        (``"full_attention"``, ``"sliding_attention"``), the one to read.
      decoder: T5 only: the decoder's causal buckets (True) or the encoder's
        bidirectional ones (False); default the config's ``is_decoder``.

    Returns:
      An :class:`HFEncoding`: the encoding configs, the score scale and the sizes.

    Raises:
      ValueError: naming the field, its value and the fix, for a config this loader
        cannot reproduce (an unknown ``rope_type``, no position settings, ...).
    """
    fields = _fields(config)
    if fields.get("relative_attention_num_buckets") is not None:
        return _t5(fields, decoder)
    if (
        "pos_att_type" in fields
        or "position_buckets" in fields
        or fields.get("model_type") in ("deberta-v2", "deberta")
    ):
        return _deberta(fields)
    return _rope(fields, layer_type)


# --- RoPE family -------------------------------------------------------------------------------


def _rope_parameters(fields: dict, layer_type: str | None) -> dict:
    """The flat rope dict (transformers 5 ``rope_parameters`` or 4 ``rope_scaling``), type named."""
    params = fields.get("rope_parameters") or fields.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters / rope_scaling must be a dict, got {params!r}")
    nested = [key for key, value in params.items() if isinstance(value, Mapping)]
    if nested:
        if layer_type is None:
            raise ValueError(
                f"this config's rope_parameters differ by layer type {sorted(nested)}; pass layer_type= one of them"
            )
        if layer_type not in params:
            raise ValueError(
                f"layer_type {layer_type!r} is not in rope_parameters; its layer types are {sorted(nested)}"
            )
        params = params[layer_type]
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _rope(fields: dict, layer_type: str | None) -> HFEncoding:
    params = _rope_parameters(fields, layer_type)
    if not params.get("rope_theta") and fields.get("rope_theta") is None and len(params) == 1:
        model_type = fields.get("model_type", "unknown")
        raise ValueError(
            f"found no position settings in this config (model_type {model_type!r}): expected rope_theta or "
            f"rope_parameters / rope_scaling (RoPE), relative_attention_num_buckets (T5), or pos_att_type (DeBERTa-v2)"
        )
    head_dim, num_heads = _heads(fields)
    base = float(params.get("rope_theta") or fields.get("rope_theta") or 10000.0)
    partial = params.get("partial_rotary_factor", fields.get("partial_rotary_factor"))
    partial = 1.0 if partial is None else float(partial)
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(
            f"head_dim * partial_rotary_factor = {head_dim} * {partial} gives {rotary_dim} rotated features; RoPE "
            f"needs an even number >= 2"
        )
    notes = []
    scaling = _scaling(params, fields, rotary_dim, notes)
    rope = RoPE(base=base, rotary_dim=None if rotary_dim == head_dim else rotary_dim, layout="half", scaling=scaling)
    return HFEncoding("rope", (rope,), None, head_dim, num_heads, tuple(notes))


def _original_context(params: dict, fields: dict, notes: list) -> int:
    # transformers gives a config-level original_max_position_embeddings (Phi-3) priority.
    if fields.get("original_max_position_embeddings") is not None:
        return int(fields["original_max_position_embeddings"])
    if params.get("original_max_position_embeddings") is not None:
        return int(params["original_max_position_embeddings"])
    value = int(_required(fields, "max_position_embeddings", "the original context of a RoPE scaling"))
    notes.append(f"original context: max_position_embeddings = {value} (no original_max_position_embeddings)")
    return value


def _scaling(params: dict, fields: dict, rotary_dim: int, notes: list):
    rope_type = params["rope_type"]
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    if rope_type == "linear":
        return LinearScaling(factor=float(_required(params, "factor", "linear RoPE scaling")))
    if rope_type == "dynamic":
        # transformers' dynamic NTK grows from max_position_embeddings.
        original = int(_required(fields, "max_position_embeddings", "dynamic NTK"))
        return DynamicNTKScaling(factor=float(_required(params, "factor", "dynamic NTK")), original_context=original)
    original = _original_context(params, fields, notes)
    if rope_type == "llama3":
        return Llama3Scaling(
            factor=float(_required(params, "factor", "llama3 RoPE scaling")),
            low_freq_factor=float(_required(params, "low_freq_factor", "llama3 RoPE scaling")),
            high_freq_factor=float(_required(params, "high_freq_factor", "llama3 RoPE scaling")),
            original_context=original,
        )
    if rope_type == "yarn":
        factor = params.get("factor")
        if factor is None:
            factor = int(_required(fields, "max_position_embeddings", "YaRN without a factor")) / original
            notes.append(f"YaRN factor: max_position_embeddings / original context = {factor}")
        return YaRNScaling(
            factor=float(factor),
            original_context=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_scaling=None if params.get("attention_factor") is None else float(params["attention_factor"]),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )
    short = tuple(float(x) for x in _required(params, "short_factor", "LongRoPE"))
    long = tuple(float(x) for x in _required(params, "long_factor", "LongRoPE"))
    if len(short) != rotary_dim // 2:
        raise ValueError(
            f"LongRoPE short_factor has {len(short)} entries but the rotary dim {rotary_dim} needs {rotary_dim // 2}"
        )
    max_context = int(fields.get("max_position_embeddings") or original)
    factor = params.get("factor")
    return LongRoPEScaling(
        short_factor=short,
        long_factor=long,
        original_context=original,
        max_context=max(max_context, original),
        factor=None if factor is None else float(factor),
        attention_scaling=None if params.get("attention_factor") is None else float(params["attention_factor"]),
    )


# --- T5 ----------------------------------------------------------------------------------------


def _t5(fields: dict, decoder: bool | None) -> HFEncoding:
    num_heads = int(_required(fields, "num_heads", "T5's bias table [num_buckets, N]"))
    head_dim = int(_required(fields, "d_kv", "T5's head dim"))
    decoder = bool(fields.get("is_decoder", False)) if decoder is None else bool(decoder)
    t5 = T5Config(
        num_buckets=int(fields["relative_attention_num_buckets"]),
        max_distance=int(fields.get("relative_attention_max_distance") or 128),
        bidirectional=not decoder,
    )
    notes = ("T5 scores are q·k without 1/√H: scale 1 (FixedScoreScale)",)
    return HFEncoding("t5", (t5, FixedScoreScale(1.0)), 1.0, head_dim, num_heads, notes)


# --- DeBERTa-v2 --------------------------------------------------------------------------------


def _deberta_terms(pos_att_type) -> tuple[str, ...]:
    if pos_att_type is None:
        return ()
    if isinstance(pos_att_type, str):
        pos_att_type = pos_att_type.lower().split("|")
    terms = tuple(dict.fromkeys(t.strip() for t in pos_att_type if t.strip()))
    unknown = sorted(set(terms) - {"c2p", "p2c"})
    if unknown:
        raise ValueError(f"pos_att_type {pos_att_type!r} has {unknown}; DeBERTa-v2's terms are 'c2p' and 'p2c'")
    return terms


def _deberta(fields: dict) -> HFEncoding:
    if fields.get("model_type") == "deberta":
        raise ValueError(
            "DeBERTa v1 configs are not supported: v1 slices its relative table by the sequence length; "
            "load a deberta-v2 (or v3) config"
        )
    head_dim, num_heads = _heads(fields)
    encodings: list[EncodingConfig] = []
    notes = []
    if fields.get("position_biased_input", True):
        size = int(_required(fields, "max_position_embeddings", "DeBERTa's absolute table"))
        encodings.append(LearnedAbsoluteConfig(max_positions=size))
        notes.append(f"position_biased_input: a learned absolute table of {size} positions on the embeddings")
    terms = _deberta_terms(fields.get("pos_att_type"))
    if fields.get("relative_attention", False) and terms:
        max_relative = int(fields.get("max_relative_positions", -1) or -1)
        if max_relative < 1:
            max_relative = int(_required(fields, "max_position_embeddings", "DeBERTa's relative span"))
        buckets = int(fields.get("position_buckets", -1) or -1)
        buckets = max(buckets, 0)
        span = buckets if buckets > 0 else max_relative
        encodings.append(
            DeBERTaConfig(span=span, position_buckets=buckets, max_relative_positions=max_relative, terms=terms)
        )
        if fields.get("share_att_key", False):
            notes.append("share_att_key: the position tables come from the layer's own query/key projections")
    else:
        notes.append("no relative attention terms (relative_attention false or pos_att_type empty)")
    return HFEncoding("deberta-v2", tuple(encodings), None, head_dim, num_heads, tuple(notes))


def deberta_position_tables(
    rel_embeddings,
    *,
    num_heads: int,
    terms: tuple[str, ...] = ("c2p", "p2c"),
    key_kernel=None,
    key_bias=None,
    query_kernel=None,
    query_bias=None,
) -> dict:
    """DeBERTa-v2's projected relative tables ``K_r``, ``Q_r`` ``[2·span, N, H]`` from a checkpoint.

    ``K_r = rel_embeddings · W_k + b_k`` (read by c2p), ``Q_r = rel_embeddings · W_q + b_q``
    (read by p2c), split into N heads. With ``share_att_key`` the kernels are the layer's
    own key and query projections, otherwise its ``pos_key_proj`` and ``pos_query_proj``;
    ``rel_embeddings`` is the encoder's table after its LayerNorm when ``norm_rel_ebd``
    says ``layer_norm``, cut to its first ``2·span`` rows.

    Args:
      rel_embeddings: ``[2·span, D]``.
      num_heads: N.
      terms: the terms whose tables to make.
      key_kernel, key_bias: ``[D, N·H]`` and ``[N·H]`` (a torch ``Linear`` weight transposed).
      query_kernel, query_bias: the same for the query side.

    Returns:
      ``{"pos_key": ..., "pos_query": ...}`` (those the terms need), the ``params`` of
      ``DeBERTaConfig.build``.

    Example:
      >>> tables = deberta_position_tables(jnp.ones((8, 16)), num_heads=2, terms=("c2p",),
      ...                                  key_kernel=jnp.ones((16, 16)), key_bias=jnp.zeros(16))
      >>> tables["pos_key"].shape
      (8, 2, 8)
    """
    rel = jnp.asarray(rel_embeddings, jnp.float32)
    if rel.ndim != 2:
        raise ValueError(f"rel_embeddings must have shape [2*span, D], got {rel.shape}")
    sides = {"c2p": ("pos_key", key_kernel, key_bias), "p2c": ("pos_query", query_kernel, query_bias)}
    tables = {}
    for term in terms:
        name, kernel, bias = sides[term]
        if kernel is None:
            raise ValueError(f"the {term} term needs the {name.split('_')[1]} kernel [D, N*H]; pass it")
        projected = rel @ jnp.asarray(kernel, jnp.float32)
        if bias is not None:
            projected = projected + jnp.asarray(bias, jnp.float32)[None, :]
        if projected.shape[-1] % num_heads:
            raise ValueError(
                f"the {term} kernel's output width {projected.shape[-1]} is not a multiple of N={num_heads}"
            )
        tables[name] = projected.reshape(rel.shape[0], num_heads, projected.shape[-1] // num_heads)
    return tables
