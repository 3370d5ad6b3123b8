"""The RoPE families' configs: Llama, Mistral, Qwen, Gemma, Phi, gpt-oss, DeepSeek, GPT-NeoX, GPT-J, Falcon.

:func:`_rope` reads a config's layer types, its ``rope_parameters`` / ``rope_scaling`` (each
``rope_type``'s keys checked), the rotated part of each head, the pair layout and the score
scale into a :class:`~posenc_jax.functional.encodings.rope.RoPE` with its scaling
(:mod:`~posenc_jax.functional.encodings.rope_scaling`), or DeepSeek's
:class:`~posenc_jax.functional.encodings.rope_decoupled.RoPEOnLastFeatures`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from posenc_jax.functional.encodings.rope import RoPE
from posenc_jax.functional.encodings.rope_decoupled import RoPEOnLastFeatures
from posenc_jax.functional.encodings.rope_scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    YaRNScaling,
)
from posenc_jax.hf.encoding import HFEncoding
from posenc_jax.hf.fields import _check_reads, _count, _grouped, _head_dim, _num_heads, _required

__all__ = ["ROPE_TYPES"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")

# The keys each rope_type may have besides rope_type/type, rope_theta and partial_rotary_factor
# (transformers 5's validators).
_ROPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
    "llama3": frozenset({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}),
    "longrope": frozenset(
        {"short_factor", "long_factor", "factor", "original_max_position_embeddings", "attention_factor"}
    ),
}

# Fields every RoPE-family loader reads.
_ROPE_READS = frozenset(
    {
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "head_dim",
        "max_position_embeddings",
        "original_max_position_embeddings",
        "layer_types",
        "sliding_window",
    }
)
_QWEN_READS = frozenset({"use_sliding_window", "max_window_layers"})
# What else each family reads (or knowingly leaves: noted where it is met).
_FAMILY_READS = {
    "qwen2": _QWEN_READS,
    "qwen2_moe": _QWEN_READS,
    "qwen3": _QWEN_READS,
    "qwen3_moe": _QWEN_READS,
    "gemma2": frozenset(
        {"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window_size"}
    ),
    "gemma3_text": frozenset(
        {
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "rope_local_base_freq",
            "sliding_window_pattern",
            "_sliding_window_pattern",  # a transformers 5 object's to_dict()
            "use_bidirectional_attention",
        }
    ),
    "deepseek_v2": frozenset({"qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim"}),
    "deepseek_v3": frozenset({"qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim", "rope_interleave"}),
    "gpt_neox": frozenset({"rotary_pct", "rotary_emb_base"}),
    "gptj": frozenset({"rotary_dim", "rotary", "n_positions", "scale_attn_weights"}),
    "falcon": frozenset({"alibi"}),
}
_ROPE_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_neox",
    "gptj",
    "falcon",
    "phi",  # Phi-1/2 and StableLM: Llama's rotation on the first partial_rotary_factor of each head
    "stablelm",
)
# Families whose sliding_window applies to every layer (no layer types).
_WINDOW_EVERY_LAYER = ("mistral", "mixtral", "phi3")


def _layer_types(fields: dict, model_type: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(each layer's type, in order, or () when the layer count is unknown; the types there are)."""
    given = fields.get("layer_types")
    if given is not None:
        if isinstance(given, str) or not all(isinstance(t, str) for t in given):
            raise ValueError(f"layer_types must be a list of layer type names, got {given!r}")
        return tuple(given), tuple(sorted(set(given)))
    layers = fields.get("num_hidden_layers")
    window = fields.get("sliding_window")

    def sliding(i: int) -> bool:
        if model_type in ("gemma2", "gpt_oss"):
            return bool((i + 1) % 2)
        if model_type == "gemma3_text":
            # Gemma3TextConfig: every sliding_window_pattern-th layer is full (6 by default).
            pattern = fields.get("sliding_window_pattern") or fields.get("_sliding_window_pattern") or 6
            return bool((i + 1) % int(pattern))
        if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
            first = fields.get("max_window_layers", 28)
            return bool(fields.get("use_sliding_window")) and window is not None and i >= first
        return model_type in _WINDOW_EVERY_LAYER and window is not None

    if isinstance(layers, int) and layers > 0:
        per_layer = tuple("sliding_attention" if sliding(i) else "full_attention" for i in range(layers))
        return per_layer, tuple(sorted(set(per_layer)))
    if model_type in ("gemma2", "gpt_oss", "gemma3_text"):
        return (), ("full_attention", "sliding_attention")
    return (), ("sliding_attention",) if sliding(0) else ("full_attention",)


def _pick_layer_type(layer_type: str | None, types: tuple[str, ...], why: str) -> str:
    if layer_type is None:
        if len(types) > 1:
            raise ValueError(f"this config's layers differ by type {list(types)} ({why}); pass layer_type= one of them")
        return types[0]
    if layer_type not in types:
        raise ValueError(f"layer_type {layer_type!r} is not one of this config's layer types {list(types)}")
    return layer_type


def _rope_dict(fields: dict) -> dict:
    """transformers 5's ``rope_parameters`` or transformers 4's ``rope_scaling`` (one of them)."""
    v5, v4 = fields.get("rope_parameters"), fields.get("rope_scaling")
    if v5 and v4 and v5 != v4:
        raise ValueError(
            f"the config has both rope_parameters={v5!r} and rope_scaling={v4!r}, which differ; keep one "
            f"(rope_parameters in transformers 5 files, rope_scaling in transformers 4 files)"
        )
    params = v5 or v4 or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters / rope_scaling must be a dict, got {params!r}")
    return dict(params)


def _rope_params(fields: dict, model_type: str | None, layer_type: str, nested: dict, notes: list) -> dict:
    """The flat rope dict of ``layer_type`` with its ``rope_type`` and ``rope_theta``; keys checked."""
    if nested:
        params = nested[layer_type]
        source = f"rope_parameters[{layer_type!r}]"
        if params is None:
            raise ValueError(f"{source} is null (a layer without RoPE); this loader does not read such layers")
        params = dict(params)
    elif model_type == "gemma3_text" and layer_type == "sliding_attention":
        # transformers 4 form: rope_scaling and rope_theta are the full layers'.
        params = {"rope_type": "default", "rope_theta": float(fields["rope_local_base_freq"])}
        source = "rope_local_base_freq"
        notes.append(
            f"sliding layers: base rope_local_base_freq = {params['rope_theta']}, unscaled (rope_scaling and "
            f"rope_theta are the full-attention layers')"
        )
    else:
        params = _rope_dict(fields)
        source = "rope_parameters" if fields.get("rope_parameters") else "rope_scaling"
    if "rope_type" not in params and "type" not in params:
        settings = sorted(set(params) - {"rope_theta", "partial_rotary_factor"})
        if settings:
            raise ValueError(
                f"{source} {params!r} has {settings} but no 'rope_type' (or 'type'); name its method, e.g. "
                f'"rope_type": "linear" (supported: {ROPE_TYPES})'
            )
        params["rope_type"] = "default"
    named = params.pop("type", None)
    if named is not None and params.get("rope_type", named) != named:
        raise ValueError(f"{source} has rope_type {params['rope_type']!r} and type {named!r}; keep one")
    rope_type = params.setdefault("rope_type", named)
    if model_type == "phi3" and rope_type == "su":
        params["rope_type"] = rope_type = "longrope"
        notes.append("rope_type 'su' read as 'longrope' (its later name, as transformers does for phi3)")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source} rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    unknown = sorted(set(params) - _ROPE_KEYS[rope_type] - {"rope_type", "rope_theta", "partial_rotary_factor"})
    if unknown:
        raise ValueError(
            f"{source} has {unknown}, which rope_type {rope_type!r} does not have (its keys: "
            f"{sorted(_ROPE_KEYS[rope_type])}); this loader does not guess what they mean"
        )
    return params


def _rope(fields: dict, model_type: str | None, layer_type: str | None, notes: list) -> HFEncoding:
    _check_rope_fields(fields, model_type, notes)
    layer_type, per_layer, params = _rope_layer(fields, model_type, layer_type, notes)
    num_heads = _num_heads(fields, "n_head")
    head_dim, rope_head = _rope_heads(fields, model_type, num_heads, notes)
    rotary_dim = _rotary_dim(fields, model_type, params, rope_head, notes)
    layout = "half"
    if model_type in ("gptj", "deepseek_v2") or (model_type == "deepseek_v3" and fields.get("rope_interleave")):
        layout = "interleaved"
        notes.append("interleaved pairs (x[2i], x[2i+1]), as transformers rotates this family")
    scaling = _scaling(params, fields, rotary_dim, notes)
    if scaling is not None and scaling.attention_factor(None) != 1.0:
        notes.append(
            f"{params['rope_type']} attention factor {scaling.attention_factor(None):.6g} multiplies the rotated q "
            f"and k (inside the RoPE), as transformers multiplies cos and sin"
        )
    rope = RoPE(
        base=_base(fields, model_type, params, notes),
        rotary_dim=None if rotary_dim == rope_head else rotary_dim,
        layout=layout,
        scaling=scaling,
    )
    window = fields.get("sliding_window") if layer_type == "sliding_attention" else None
    softcap = fields.get("attn_logit_softcapping") if model_type in ("gemma2", "gemma3_text") else None
    _note_what_is_not_applied(model_type, softcap, notes)
    return HFEncoding(
        family="rope",
        encodings=(RoPEOnLastFeatures(rope, rope_head) if rope_head != head_dim else rope,),
        scale=_rope_scale(fields, model_type, params, head_dim, notes),
        head_dim=head_dim,
        num_heads=num_heads,
        notes=tuple(notes),
        model_type=model_type,
        num_kv_heads=_kv_heads(fields, num_heads, model_type),
        rotary_dim=rotary_dim,
        layer_type=layer_type,
        layer_types=per_layer,
        causal=True,
        sliding_window=None if window is None else _count(fields, "sliding_window", "the sliding window"),
        logit_softcap=None if softcap is None else float(softcap),
    )


def _check_rope_fields(fields: dict, model_type: str | None, notes: list) -> None:
    """Refuses fields the family does not read and settings not reproduced."""
    _check_reads(fields, _ROPE_READS | _FAMILY_READS.get(model_type, frozenset()), model_type)
    if fields.get("use_bidirectional_attention"):
        raise ValueError(
            "use_bidirectional_attention=True (bidirectional Gemma 3): its symmetric window masks are not "
            "reproduced by this loader"
        )
    legacy = fields.get("sliding_window_size")  # Gemma 2 files repeat the window under this name
    if legacy is not None and legacy != fields.get("sliding_window"):
        raise ValueError(
            f"sliding_window_size={legacy!r} differs from sliding_window={fields.get('sliding_window')!r}; "
            f"transformers reads sliding_window"
        )


def _rope_layer(fields: dict, model_type: str | None, layer_type: str | None, notes: list):
    """(the layer type read, each layer's type, that type's flat rope dict)."""
    per_layer, types = _layer_types(fields, model_type)
    raw = _rope_dict(fields)
    # transformers 5 nests rope_parameters by layer type (None: a layer type without RoPE).
    nested = {
        key: value
        for key, value in raw.items()
        if isinstance(value, Mapping) or (value is None and (key in types or key.endswith("_attention")))
    }
    if nested:
        if len(nested) != len(raw):
            raise ValueError(
                f"rope_parameters mixes per-layer-type entries {sorted(nested)} with flat keys "
                f"{sorted(set(raw) - set(nested))}; give every setting inside its layer type"
            )
        if fields.get("layer_types") is None:
            types = tuple(sorted(nested))
        missing = sorted(set(types) - set(nested))
        if missing:
            raise ValueError(f"rope_parameters has no entry for the layer types {missing}; it has {sorted(nested)}")
    why = "rope_parameters differ by layer type" if nested else "their window or RoPE differ"
    layer_type = _pick_layer_type(layer_type, types, why)
    if layer_type not in ("full_attention", "sliding_attention"):
        raise ValueError(f"layer type {layer_type!r} is not supported; supported: full_attention, sliding_attention")
    return layer_type, per_layer, _rope_params(fields, model_type, layer_type, nested, notes)


def _rope_heads(fields: dict, model_type: str | None, num_heads: int, notes: list) -> tuple[int, int]:
    """(the query/key head size, the part of it the RoPE acts on: all of it but for DeepSeek)."""
    if model_type not in ("deepseek_v2", "deepseek_v3"):
        head_dim = _head_dim(fields, num_heads, "n_embd")
        return head_dim, head_dim
    rope_head = _count(fields, "qk_rope_head_dim", "DeepSeek's rotary head")
    head_dim = rope_head + _count(fields, "qk_nope_head_dim", "DeepSeek's query/key head")
    # A transformers 5 object's to_dict() repeats them as head_dim and qk_head_dim.
    for name, value in (("head_dim", rope_head), ("qk_head_dim", head_dim)):
        if fields.get(name) not in (None, value):
            raise ValueError(
                f"{name}={fields[name]!r} contradicts qk_rope_head_dim={rope_head} and qk_nope_head_dim="
                f"{head_dim - rope_head} (transformers sets {name} = {value}); fix or remove it"
            )
    notes.append(
        f"multi-head latent attention: q/k heads of qk_nope_head_dim + qk_rope_head_dim = {head_dim}, the RoPE on "
        f"the last {rope_head} (each query head's and the one shared key part); values of v_head_dim "
        f"{fields.get('v_head_dim')}"
    )
    return head_dim, rope_head


def _note_what_is_not_applied(model_type: str | None, softcap, notes: list) -> None:
    if softcap is not None:
        notes.append(
            f"attn_logit_softcapping = {softcap}: the checkpoint caps scores as c*tanh(s/c) before the softmax, "
            f"which this library's attention does not do (logit_softcap)"
        )
    if model_type == "gpt_oss":
        notes.append(
            "attention sinks: gpt-oss adds a learned per-head logit (its 'sinks' weights) to each softmax "
            "denominator, which this library's softmax does not"
        )


def _kv_heads(fields: dict, num_heads: int, model_type: str | None) -> int:
    if model_type == "falcon":
        if not fields.get("new_decoder_architecture"):
            return 1 if fields.get("multi_query", True) else num_heads
        name = "num_kv_heads"
    else:
        name = "num_key_value_heads"
    heads = next((n for n in ("num_attention_heads", "n_head") if fields.get(n) is not None), "num_attention_heads")
    return _grouped(fields.get(name), name, num_heads, heads)


def _partial_factor(value, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{source} must be a number in (0, 1], the fraction of each head that rotates, got {value!r}")
    return float(value)


def _head_dim_source(fields: dict, head_dim: int) -> str:
    """Where the head size came from, for a message: ``head_dim=15`` or ``hidden_size / ... = 60 / 4 = 15``."""
    given = next((n for n in ("qk_rope_head_dim", "head_dim", "attention_head_size") if n in fields), None)
    if given is not None and fields[given] == head_dim:
        return f"{given}={head_dim}"
    hidden = next((n for n in ("hidden_size", "n_embd", "n_embed") if fields.get(n) is not None), "hidden_size")
    heads = next((n for n in ("num_attention_heads", "n_head") if fields.get(n) is not None), "num_attention_heads")
    return f"the head size {hidden} / {heads} = {fields.get(hidden)} / {fields.get(heads)} = {head_dim}"


def _rotary_dim(fields: dict, model_type: str | None, params: dict, head_dim: int, notes: list) -> int:
    if model_type == "gptj":
        rotary = fields.get("rotary_dim")
        if rotary is None:
            raise ValueError(
                "rotary_dim is null: transformers' GPT-J then rotates by a table of hidden_size, which "
                "does not fit its heads; give rotary_dim (64 in GPT-J-6B)"
            )
        rotary = int(rotary)
        source = f"rotary_dim = {rotary}"
    else:
        partial = params.get("partial_rotary_factor", fields.get("partial_rotary_factor"))
        name = "partial_rotary_factor"
        if partial is None and model_type == "gpt_neox":
            partial, name = fields.get("rotary_pct", 0.25), "rotary_pct"
            if "rotary_pct" not in fields:
                notes.append("rotary_pct = 0.25: transformers' default for gpt_neox (absent from the config)")
        if partial is None:
            if head_dim % 2:
                raise ValueError(
                    f"{_head_dim_source(fields, head_dim)} is odd: RoPE rotates pairs of features, so a head that "
                    f"rotates whole must have an even size; check the head sizes against the model's config.json"
                )
            return head_dim
        partial = _partial_factor(partial, name)
        rotary = int(head_dim * partial)
        source = f"head_dim * {name} = {head_dim} * {partial}"
    if rotary < 2 or rotary % 2 or rotary > head_dim:
        raise ValueError(f"{source} gives {rotary} rotated features; RoPE needs an even number in [2, {head_dim}]")
    return rotary


def _base(fields: dict, model_type: str | None, params: dict, notes: list) -> float:
    if model_type == "gptj":
        return 10000.0  # transformers' GPT-J fixes it
    base = params.get("rope_theta")
    if base is None:
        base = fields.get("rope_theta")
    if base is None and model_type == "gpt_neox":
        base = fields.get("rotary_emb_base")
    if base is None:
        base = 10000.0
        notes.append("rope_theta = 10000: transformers' default (absent from the config)")
    return float(base)


def _rope_scale(fields: dict, model_type: str | None, params: dict, head_dim: int, notes: list) -> float:
    if model_type in ("gemma2", "gemma3_text"):
        scalar = _required(fields, "query_pre_attn_scalar", "Gemma's score scale")
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
            raise ValueError(f"query_pre_attn_scalar must be a number > 0, got {scalar!r}")
        notes.append(f"score scale query_pre_attn_scalar^-0.5 = {scalar}^-0.5")
        return float(scalar) ** -0.5
    scale = head_dim**-0.5
    if (
        model_type in ("deepseek_v2", "deepseek_v3")
        and params["rope_type"] != "default"
        and params.get("mscale_all_dim")
    ):
        factor = float(_required(params, "factor", "DeepSeek's mscale"))
        mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        notes.append(
            f"score scale qk_head_dim^-0.5 * mscale^2 = {head_dim}^-0.5 * {mscale:.6g}^2, mscale = "
            f"0.1 * mscale_all_dim * ln(factor) + 1"
        )
        scale *= mscale * mscale
    return scale


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
