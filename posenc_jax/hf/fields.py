"""Reading a transformers config: its fields, and the checks every family's reader shares.

:func:`_fields` gives a config's fields as a dict (a multimodal config's ``text_config``, with
transformers' defaults filled in) after checking every numeric and true/false field against its
rule (``_FIELD_RULES``), whatever the family. A family's reader then refuses the fields bearing on
positions that it does not read (:func:`_check_reads`) and reads the rest through
:func:`_required`, :func:`_count`, :func:`_head_dim` and :func:`_num_heads`. :func:`_find` reads a
state dict's values by the ending of their keys.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import numpy as np

# --- the fields families read and the defaults they fill in -------------------------------------

# A field whose name says it bears on positions or the score scale; one that the family's
# loader does not read is an error, never ignored.
_POSITION_FIELD = re.compile(
    r"rope|rotary|posit|^pos_|_pos_|alibi|relative|window|layer_types|pre_attn|softmax_scale|softcap|"
    r"scale_attn|attn_scal|head_dim|head_size|interleave|mscale|bucket|max_seq_len|n_ctx"
)

# Defaults of transformers' config classes for position fields that shipped config.json
# files leave out (Gemma 3's text_config holds only what differs from Gemma3TextConfig).
_DEFAULTS = {
    "gemma3_text": {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_size": 2304,
        "num_hidden_layers": 26,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "max_position_embeddings": 131_072,
    },
    "gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "sliding_window": 4096},
    "deepseek_v2": {"qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128},
    "deepseek_v3": {"qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "rope_interleave": True},
    "t5": {"relative_attention_max_distance": 128},
    "mt5": {"relative_attention_max_distance": 128},
}

# --- what each numeric and true/false field must be ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rule:
    """What a config field holds: an ``integer``, a ``number``, a ``flag`` (true or false) or
    ``numbers`` (a list of numbers), at least ``low`` (above it when ``low_open``) and at most ``high``."""

    kind: str
    meaning: str
    low: float | None = None
    low_open: bool = False
    high: float | None = None

    def expected(self, finite: bool = False) -> str:
        if self.kind == "flag":
            return "true or false"
        what = {"integer": "an integer", "number": "a number", "numbers": "a list of numbers"}[self.kind]
        if self.low is not None and self.high is not None:
            return f"{what} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        if finite and self.kind == "number":
            what = "a finite number"
        bounds = [] if self.low is None else [f"{'>' if self.low_open else '>='} {self.low:g}"]
        bounds += [] if self.high is None else [f"<= {self.high:g}"]
        return " ".join([what, *bounds])

    def admits(self, number: float) -> bool:
        return (
            math.isfinite(number)
            and (self.kind != "integer" or number.is_integer())
            and (self.low is None or number > self.low or (number == self.low and not self.low_open))
            and (self.high is None or number <= self.high)
        )


def _integer(meaning: str, low: int | None = 1) -> _Rule:
    return _Rule("integer", meaning, low)


def _positive(meaning: str, above: float = 0.0) -> _Rule:
    return _Rule("number", meaning, above, low_open=True)


def _flag(meaning: str) -> _Rule:
    return _Rule("flag", meaning)


_HEADS, _WIDTH, _HEAD = "the query heads", "the model width", "the query/key head size"
_FRACTION = _Rule("number", "the fraction of each head that rotates", 0.0, low_open=True, high=1.0)
_WINDOW = _integer("how many keys a sliding layer's query sees")
_PATTERN = _integer("every n-th layer has full attention")
# Every numeric or true/false field a loader reads, checked wherever it appears before any
# family reads it. In Python a bool is an int and float("1e4") parses: unchecked, True would
# read as 1, a string as its number, and "false" as true.
_FIELD_RULES = {
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), _integer(_HEADS)),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads"), _integer("the key/value heads")),
    **dict.fromkeys(("hidden_size", "n_embd", "n_embed", "d_model"), _integer(_WIDTH)),
    **dict.fromkeys(("head_dim", "attention_head_size", "d_kv", "qk_head_dim"), _integer(_HEAD)),
    "qk_rope_head_dim": _integer("DeepSeek's rotated part of each head"),
    "qk_nope_head_dim": _integer("DeepSeek's unrotated part of each head"),
    "v_head_dim": _integer("the value head size"),
    "num_hidden_layers": _integer("the layer count"),
    "max_position_embeddings": _integer("the context length"),
    "original_max_position_embeddings": _integer("the context length a RoPE scaling extends"),
    "sliding_window": _WINDOW,
    "sliding_window_size": _WINDOW,
    "sliding_window_pattern": _PATTERN,
    "_sliding_window_pattern": _PATTERN,
    "max_window_layers": _integer("the layers before Qwen's sliding ones", low=0),
    "rope_theta": _positive("the RoPE wavelength base", above=1.0),
    "rope_local_base_freq": _positive("the sliding layers' RoPE base", above=1.0),
    "rotary_emb_base": _positive("the RoPE wavelength base", above=1.0),
    "partial_rotary_factor": _FRACTION,
    "rotary_pct": _FRACTION,
    "rotary_dim": _integer("the rotated features of each head", low=2),
    "query_pre_attn_scalar": _positive("Gemma's scores are scaled by its -1/2 power"),
    "attn_logit_softcapping": _positive("Gemma 2's score cap"),
    "final_logit_softcapping": _positive("Gemma's logit cap"),
    "relative_attention_num_buckets": _integer("T5's bias buckets", low=2),
    "relative_attention_max_distance": _integer("T5's farthest bucketed distance"),
    "position_buckets": _integer("DeBERTa's log buckets, <= 0 for none", low=None),
    "max_relative_positions": _integer("DeBERTa's relative span, <= 0 for max_position_embeddings", low=None),
    "layer_norm_eps": _positive("the epsilon of the LayerNorm of DeBERTa's relative table"),
    "use_sliding_window": _flag("whether Qwen's later layers slide"),
    "rope_interleave": _flag("whether DeepSeek rotates interleaved pairs"),
    "alibi": _flag("whether Falcon adds ALiBi"),
    "multi_query": _flag("whether Falcon has one key/value head"),
    "new_decoder_architecture": _flag("whether Falcon groups its key/value heads"),
    "is_decoder": _flag("T5's causal decoder buckets"),
    "use_bidirectional_attention": _flag("bidirectional Gemma 3"),
    "position_biased_input": _flag("DeBERTa's absolute table"),
    "relative_attention": _flag("DeBERTa's relative terms"),
    "share_att_key": _flag("DeBERTa's shared position projections"),
    "learned_pos_emb": _flag("MPT's learned table"),
}
# The keys of rope_scaling / rope_parameters (of each layer type, when nested by type).
_ROPE_RULES = {
    "rope_theta": _FIELD_RULES["rope_theta"],
    "partial_rotary_factor": _FRACTION,
    "original_max_position_embeddings": _FIELD_RULES["original_max_position_embeddings"],
    "factor": _positive("the scaling factor"),
    "low_freq_factor": _positive("Llama 3's low-frequency factor"),
    "high_freq_factor": _positive("Llama 3's high-frequency factor"),
    "attention_factor": _positive("the factor on the rotated q and k"),
    "beta_fast": _positive("YaRN's fast boundary, in rotations"),
    "beta_slow": _positive("YaRN's slow boundary, in rotations"),
    "mscale": _Rule("number", "DeepSeek's mscale, 0 for none", 0.0),
    "mscale_all_dim": _Rule("number", "DeepSeek's mscale_all_dim, 0 for none", 0.0),
    "truncate": _flag("whether YaRN rounds its boundaries"),
    "short_factor": _Rule("numbers", "LongRoPE's per-frequency factors up to the original context", 0.0, True),
    "long_factor": _Rule("numbers", "LongRoPE's per-frequency factors beyond the original context", 0.0, True),
}
_MPT_RULES = {
    "alibi": _flag("MPT's ALiBi"),
    "prefix_lm": _flag("MPT's prefix-LM mask"),
    "alibi_bias_max": _positive("MPT's ALiBi slopes are 2^(-alibi_bias_max * k / N)"),
    "softmax_scale": _positive("MPT's score scale"),
    "kv_n_heads": _integer("MPT's key/value heads"),
}


def _a(value) -> str:
    """What ``value`` is, for a message: "a bool", "a string", "a list", ..."""
    if isinstance(value, (bool, np.bool_)):
        return "a bool"
    return "a string" if isinstance(value, str) else f"a {type(value).__name__}"


def _check_value(name: str, value, rule: _Rule) -> None:
    """Refuses a field ``name`` whose ``value`` is not what ``rule`` says (None: the field is unset)."""
    if value is None:
        return
    if rule.kind == "numbers":
        if not isinstance(value, (list, tuple, np.ndarray)) or len(value) == 0:
            raise ValueError(
                f"{name} must be {rule.expected()} ({rule.meaning}), got {value!r}, {_a(value)}; "
                f"write the list of numbers, as in the model's config.json"
            )
        for i, x in enumerate(value):
            _check_value(f"{name}[{i}]", x, dataclasses.replace(rule, kind="number"))
        return
    if rule.kind == "flag":
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(
                f"{name} must be true or false ({rule.meaning}), got {value!r}, {_a(value)}; "
                f"write true or false, as in the model's config.json"
            )
        return
    integer = isinstance(value, (int, np.integer))
    number = integer or isinstance(value, (float, np.floating))
    if isinstance(value, (bool, np.bool_)) or not number or (rule.kind == "integer" and not integer):
        raise ValueError(
            f"{name} must be {rule.expected()} ({rule.meaning}), got {value!r}, {_a(value)}; "
            f"write the {'integer' if rule.kind == 'integer' else 'number'} itself, as in the model's config.json"
        )
    if not rule.admits(float(value)):
        raise ValueError(
            f"{name} must be {rule.expected(finite=True)} ({rule.meaning}), got {value!r}; "
            f"use the value in the model's config.json"
        )


def _check_values(fields: dict) -> None:
    """Checks each numeric and true/false field (the top level, the rope dicts, MPT's attn_config)."""
    for name, rule in _FIELD_RULES.items():
        _check_value(name, fields.get(name), rule)
    for source in ("rope_scaling", "rope_parameters"):
        rope = fields.get(source)
        if not isinstance(rope, Mapping):
            continue  # None, or not a dict: _rope_dict says so
        by_type = [(f"{source}[{key!r}]", value) for key, value in rope.items() if isinstance(value, Mapping)]
        for where, params in [(source, rope), *by_type]:
            for key, rule in _ROPE_RULES.items():
                _check_value(f"{where}.{key}", params.get(key), rule)
    attn = fields.get("attn_config")
    if isinstance(attn, Mapping):
        for key, rule in _MPT_RULES.items():
            _check_value(f"attn_config.{key}", attn.get(key), rule)


# --- a config's fields, and what a family's reader reads of them --------------------------------


def _as_dict(config) -> dict:
    """A transformers config object or dict as a plain dict of its fields."""
    if config is None:
        return {}
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


def _fields(config, notes: list) -> dict:
    """The config's fields (a multimodal config's text_config), with transformers' defaults filled in."""
    fields = _as_dict(config)
    if fields.get("model_type") == "gemma3" or ("text_config" in fields and fields.get("num_attention_heads") is None):
        text = _as_dict(fields.get("text_config"))
        text.setdefault("model_type", "gemma3_text" if fields.get("model_type") == "gemma3" else None)
        notes.append(f"read text_config (model_type {text['model_type']!r}) of the {fields.get('model_type')!r} config")
        fields = text
    if "attn_config" in fields:
        fields["attn_config"] = _as_dict(fields["attn_config"])
    model_type = fields.get("model_type")
    for name, value in _DEFAULTS.get(model_type, {}).items():
        if name not in fields:
            fields[name] = value
            notes.append(f"{name} = {value!r}: transformers' default for {model_type} (absent from the config)")
    _check_values(fields)
    return fields


def _check_reads(fields: dict, reads: frozenset, what: str) -> None:
    unread = sorted(k for k in fields if _POSITION_FIELD.search(k) and k not in reads)
    if unread:
        shown = ", ".join(f"{k}={fields[k]!r}" for k in unread)
        raise ValueError(
            f"the config has {shown}, which bear(s) on positions or the score scale but which the {what} loader does "
            f"not read; this loader cannot reproduce such a checkpoint (remove the field only if it has no effect)"
        )


def _required(fields: dict, name: str, what: str):
    if fields.get(name) is None:
        raise ValueError(f"the config has no {name!r}, which {what} needs; add it (as in the model's config.json)")
    return fields[name]


def _count(fields: dict, name: str, what: str) -> int:
    value = _required(fields, name, what)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 ({what}), got {value!r}")
    return int(value)


def _head_dim(fields: dict, num_heads: int, *names: str) -> int:
    """The ``head_dim`` (or ``attention_head_size``) field, else ``hidden_size / num_heads``, which must divide."""
    for name in ("head_dim", "attention_head_size"):
        if fields.get(name) is not None:
            return _count(fields, name, "the head dim")
    hidden_name = next((n for n in ("hidden_size", *names) if fields.get(n) is not None), "hidden_size")
    hidden = _count(fields, hidden_name, f"the head dim ({hidden_name} / num_attention_heads)")
    if hidden % num_heads:
        raise ValueError(
            f"{hidden_name}={hidden} is not a multiple of num_attention_heads={num_heads}, so the head dim "
            f"{hidden} / {num_heads} is not a whole number; give head_dim in the config"
        )
    return hidden // num_heads


def _num_heads(fields: dict, *aliases: str) -> int:
    name = next((n for n in ("num_attention_heads", *aliases) if fields.get(n) is not None), "num_attention_heads")
    return _count(fields, name, "the head count")


def _grouped(kv_heads: int | None, name: str, num_heads: int, heads_name: str) -> int:
    """The key/value head count (``num_heads`` when unset), which must divide the query heads."""
    if kv_heads is None:
        return num_heads
    if num_heads % kv_heads:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"{name}={kv_heads} does not divide {heads_name}={num_heads}: each key/value head serves an equal "
            f"group of query heads; give one of {divisors}, as in the model's config.json"
        )
    return int(kv_heads)


# --- a checkpoint's state dict ------------------------------------------------------------------


def _array(value) -> np.ndarray:
    """A state-dict value as float32 NumPy (a torch tensor through ``.detach().cpu().float().numpy()``)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().float().numpy()
    return np.asarray(value, np.float32)


def _find(state_dict: Mapping, suffix: str):
    """The one value whose key is ``suffix`` or ends with ``"." + suffix`` (any model prefix)."""
    keys = [key for key in state_dict if key == suffix or key.endswith("." + suffix)]
    if len(keys) == 1:
        return _array(state_dict[keys[0]])
    if keys:
        raise ValueError(f"several state-dict keys end with {suffix!r}: {sorted(keys)}; pass the one model's weights")
    last = suffix.rsplit(".", 2)[-2]
    near = sorted(key for key in state_dict if last in key)[:5]
    raise ValueError(f"the state dict has no key ending with {suffix!r} (keys with {last!r}: {near})")
