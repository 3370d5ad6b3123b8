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
import re
from collections.abc import Mapping, Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import (
    AttentionContext,
    BiasHook,
    EncodingConfig,
    ParameterFree,
    Placement,
    pytree_dataclass,
    rotation_context,
)
from posenc_jax.functional.encodings.alibi import ALiBi, alibi_bias, alibi_slopes
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


# --- hooks the families need beyond the registered encodings ------------------------------------


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


@pytree_dataclass
class ALiBiSlopes(BiasHook, ParameterFree):
    """ALiBi with given per-head slopes, ``logits[n, t, s] += m_n · (j - i)`` (causal form).

    For checkpoints whose slopes are not Press et al.'s ``get_slopes(N)``: Falcon adds the
    bias before dividing the scores by √H, so its slopes are ``get_slopes(N) / √H``; MPT
    with ``alibi_bias_max`` b has ``2^(-b·k/N')``. ``bidirectional`` as in
    :class:`posenc_jax.functional.ALiBi`.

    Example:
      >>> from posenc_jax.functional import dot_product_attention
      >>> x = jnp.ones((1, 4, 2, 8)); pos = jnp.arange(4)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos,
      ...                       encodings=[ALiBiSlopes((0.25, 0.0625))], causal=True).shape
      (1, 4, 2, 8)
    """

    slopes: tuple[float, ...] = ()
    bidirectional: bool | None = None
    acts_on: ClassVar[Placement] = "shared_bias"

    def __post_init__(self):
        slopes = np.asarray(self.slopes, np.float64)
        if slopes.ndim != 1 or slopes.size == 0 or not np.all(np.isfinite(slopes)):
            raise ValueError(f"slopes must be a non-empty tuple of finite numbers, one per head, got {self.slopes!r}")

    def bias(self, context: AttentionContext) -> jax.Array:
        """The ``[B|1, N, T, S]`` bias, to compute once and share across layers."""
        context.check_heads(len(self.slopes), f"ALiBiSlopes ({len(self.slopes)} slopes)")
        return alibi_bias(
            len(self.slopes),
            context.query_positions,
            context.key_positions,
            bidirectional=context.bidirectional(self.bidirectional),
            slopes=np.asarray(self.slopes, np.float64),
        )


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


# --- the result ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HFEncoding:
    """The position settings of a transformers config, in this library's terms.

    Attributes:
      family: ``"rope"``, ``"alibi"``, ``"t5"`` or ``"deberta-v2"``.
      encodings: the encoding configs, for ``Transformer(encoding=list(encodings))`` or
        ``MultiHeadAttention(encodings=...)`` (an absolute table goes to the Transformer);
        :meth:`hooks` builds them. They carry the score scale: when it is not the
        attention's default ``1/√H`` and no encoding prescribes it, a
        :class:`FixedScoreScale` among them does, so nothing needs forwarding by hand.
      scale: the content-score scale the checkpoint uses: ``q·k`` (after rotation) is
        multiplied by it (``1/√H``, Gemma's ``query_pre_attn_scalar^-0.5``, DeepSeek's
        mscale-corrected ``1/√qk_head_dim``, 1 for T5, ``1/√(3H)`` for DeBERTa with both
        terms). A YaRN or LongRoPE attention factor is not in it: the RoPE multiplies the
        rotated q and k by it, as transformers multiplies cos and sin. For reading only: the
        encodings (and :meth:`attention_kwargs`) already apply it.
      head_dim: H, the query/key head size (DeepSeek: ``qk_head_dim``).
      num_heads: N.
      notes: what the loader decided that the config left open or that this library
        does not apply (Gemma 2's score soft-capping, gpt-oss's attention sinks).
      model_type: the config's ``model_type``.
      num_kv_heads: K, the key/value heads.
      rotary_dim: the number of rotated features per head (RoPE family), else None.
      layer_type: the layer type these settings are for (``"full_attention"``,
        ``"sliding_attention"``).
      layer_types: each layer's type, in order (empty when the config does not say how
        many layers there are).
      causal: whether the checkpoint's attention is causal (decoders).
      sliding_window: for a sliding layer, how many keys a query sees (itself included),
        else None.
      logit_softcap: Gemma 2's ``attn_logit_softcapping`` (scores become ``c·tanh(s/c)``),
        which this library's attention does not apply; None when the config has none.
    """

    family: str
    encodings: tuple[EncodingConfig, ...]
    scale: float
    head_dim: int
    num_heads: int
    notes: tuple[str, ...] = ()
    model_type: str | None = None
    num_kv_heads: int | None = None
    rotary_dim: int | None = None
    layer_type: str = "full_attention"
    layer_types: tuple[str, ...] = ()
    causal: bool = True
    sliding_window: int | None = None
    logit_softcap: float | None = None

    @property
    def rope(self) -> RoPE | None:
        """The RoPE among the encodings (DeepSeek's unwrapped), or None."""
        for encoding in self.encodings:
            if isinstance(encoding, RoPEOnLastFeatures):
                return encoding.rope
            if isinstance(encoding, RoPE):
                return encoding
        return None

    def hooks(self, params: Sequence[Mapping] | None = None) -> list:
        """The built hooks, one per encoding; ``params[i]`` for ``encodings[i]``.

        ``params`` is what :func:`load_hf_position_weights` returns; parameter-free
        encodings (RoPE, ALiBi) need none.
        """
        if params is not None and len(params) != len(self.encodings):
            raise ValueError(
                f"params has {len(params)} entries but there are {len(self.encodings)} encodings "
                f"({[type(e).__name__ for e in self.encodings]}); pass load_hf_position_weights(...)'s result"
            )
        hooks = []
        for i, encoding in enumerate(self.encodings):
            if isinstance(encoding, ParameterFree):
                hooks.append(encoding.build({}))
                continue
            if params is None or not params[i]:
                raise ValueError(
                    f"encodings[{i}] ({type(encoding).__name__}) has parameters: pass "
                    f"params=load_hf_position_weights(config, state_dict, ...) (or its init(...))"
                )
            hooks.append(encoding.build(dict(params[i])))
        return hooks

    def context(self, query_positions, key_positions) -> AttentionContext:
        """The :class:`AttentionContext` of this checkpoint's attention, for calling hooks directly."""
        return AttentionContext.from_positions(
            query_positions,
            key_positions,
            causal=self.causal,
            scale=self.scale,
            head_dim=self.head_dim,
            num_heads=self.num_heads,
        )

    def attention_kwargs(self, query_positions, key_positions=None, *, params: Sequence[Mapping] | None = None) -> dict:
        """The keyword arguments of ``dot_product_attention`` for one layer of this type.

        ``dot_product_attention(q, k, v, **loaded.attention_kwargs(positions))`` computes
        the checkpoint's attention from its projected q ``[B, T, N, H]``, k and v: the
        attention's hooks (an absolute table, which acts on the embeddings, is left out),
        ``scale``, ``causal`` and, for a sliding layer, the window as ``mask``.

        Args:
          query_positions: integer ``[T]`` or ``[B, T]``.
          key_positions: integer ``[S]`` or ``[B, S]``; default the query positions.
          params: the encodings' parameters, as in :meth:`hooks`.

        Example:
          >>> from posenc_jax.functional import dot_product_attention
          >>> loaded = from_hf_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
          >>> q = k = v = jnp.ones((1, 6, 4, 16))
          >>> dot_product_attention(q, k, v, **loaded.attention_kwargs(jnp.arange(6))).shape
          (1, 6, 4, 16)
        """
        key_positions = query_positions if key_positions is None else key_positions
        attention = [
            hook
            for encoding, hook in zip(self.encodings, self.hooks(params), strict=True)
            if encoding.acts_on != "embeddings"
        ]
        kwargs = dict(
            query_positions=query_positions,
            key_positions=key_positions,
            encodings=attention,
            scale=self.scale,
            causal=self.causal,
        )
        if self.sliding_window is not None:
            kwargs["mask"] = sliding_window_mask(query_positions, key_positions, self.sliding_window)
        return kwargs


def sliding_window_mask(query_positions, key_positions, window: int) -> jax.Array:
    """A sliding window as a boolean mask ``[B|1, 1, T, S]``: True where ``query_pos - key_pos < window``.

    transformers' ``sliding_window_overlay``: a query sees the ``window`` most recent keys,
    itself included (the causal mask removes later keys).

    Example:
      >>> sliding_window_mask(jnp.arange(4), jnp.arange(4), 2)[0, 0].astype(int)
      Array([[1, 1, 1, 1],
             [1, 1, 1, 1],
             [0, 1, 1, 1],
             [0, 0, 1, 1]], dtype=int32)
    """
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    q = jnp.asarray(query_positions)
    k = jnp.asarray(key_positions)
    q = q[None] if q.ndim == 1 else q
    k = k[None] if k.ndim == 1 else k
    return (q[:, None, :, None] - k[:, None, None, :]) < window


# --- reading a config ---------------------------------------------------------------------------

# A field whose name says it bears on positions or the score scale; one that the family's
# loader does not read is an error, never ignored.
_POSITION_FIELD = re.compile(
    r"rope|rotary|posit|^pos_|_pos_|alibi|relative|window|layer_types|pre_attn|softmax_scale|softcap|"
    r"scale_attn|attn_scal|head_dim|head_size|interleave|mscale|bucket|max_seq_len|n_ctx"
)

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
_MODEL_TYPES = frozenset({*_ROPE_MODEL_TYPES, "bloom", "mpt", "t5", "mt5", "deberta-v2"})
# Families whose sliding_window applies to every layer (no layer types).
_WINDOW_EVERY_LAYER = ("mistral", "mixtral", "phi3")

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


# --- RoPE family -------------------------------------------------------------------------------


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


# --- ALiBi: BLOOM, MPT, Falcon-RW --------------------------------------------------------------


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


# --- T5 ----------------------------------------------------------------------------------------


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


# --- DeBERTa-v2 --------------------------------------------------------------------------------

_DEBERTA_READS = frozenset(
    {
        "max_position_embeddings",
        "relative_attention",
        "position_buckets",
        "max_relative_positions",
        "pos_att_type",
        "share_att_key",
        "position_biased_input",
        "norm_rel_ebd",
        "attention_head_size",
    }
)


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


def _deberta(fields: dict, notes: list) -> HFEncoding:
    _check_reads(fields, _DEBERTA_READS, "deberta-v2")
    num_heads = _num_heads(fields)
    head_dim = _head_dim(fields, num_heads)
    encodings: list[EncodingConfig] = []
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
    # DisentangledSelfAttention divides by sqrt(H * (1 + number of pos_att_type terms)) whatever relative_attention.
    scale = (head_dim * (1 + len(terms))) ** -0.5
    return HFEncoding(
        family="deberta-v2",
        encodings=tuple(encodings),
        scale=scale,
        head_dim=head_dim,
        num_heads=num_heads,
        notes=tuple(notes),
        model_type=fields.get("model_type"),
        num_kv_heads=num_heads,
        causal=False,
    )


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
    says ``layer_norm``, cut to its first ``2·span`` rows. :func:`load_hf_position_weights`
    does all of this from a state dict.

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


# --- checkpoint weights -------------------------------------------------------------------------


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
            side = "decoder" if not encoding.bidirectional else "encoder"
            table = _find(state_dict, f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
            if table.shape != (encoding.num_buckets, loaded.num_heads):
                raise ValueError(
                    f"relative_attention_bias has shape {table.shape}, expected [num_buckets, N] = "
                    f"{(encoding.num_buckets, loaded.num_heads)}"
                )
            params.append({"table": jnp.asarray(table)})
        elif isinstance(encoding, LearnedAbsoluteConfig):
            table = _find(state_dict, "embeddings.position_embeddings.weight")
            if table.shape[0] != encoding.max_positions:
                raise ValueError(
                    f"position_embeddings has {table.shape[0]} rows, expected max_position_embeddings="
                    f"{encoding.max_positions}"
                )
            params.append({"table": jnp.asarray(table)})
        elif isinstance(encoding, DeBERTaConfig):
            params.append(_deberta_weights(fields, encoding, loaded.num_heads, state_dict, layer))
        else:
            params.append({})
    return tuple(params)


def _deberta_weights(fields: dict, encoding: DeBERTaConfig, num_heads: int, state_dict: Mapping, layer) -> dict:
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(
            f"DeBERTa's position tables differ by layer (each projects the shared table with its own weights): "
            f"pass layer= the layer index (an integer >= 0), got {layer!r}"
        )
    rel = _find(state_dict, "encoder.rel_embeddings.weight")
    if rel.shape[0] < 2 * encoding.span:
        raise ValueError(
            f"rel_embeddings has {rel.shape[0]} rows; DeBERTa with span {encoding.span} needs {2 * encoding.span}"
        )
    norms = [x.strip() for x in str(fields.get("norm_rel_ebd") or "none").lower().split("|")]
    if "layer_norm" in norms:
        weight = _find(state_dict, "encoder.LayerNorm.weight")
        bias = _find(state_dict, "encoder.LayerNorm.bias")
        eps = float(fields.get("layer_norm_eps", 1e-7))
        mean = rel.mean(-1, keepdims=True)
        var = ((rel - mean) ** 2).mean(-1, keepdims=True)
        rel = (rel - mean) / np.sqrt(var + eps) * weight + bias
    shared = bool(fields.get("share_att_key", False))
    prefix = f"encoder.layer.{layer}.attention.self."
    sides = {"c2p": "key_proj" if shared else "pos_key_proj", "p2c": "query_proj" if shared else "pos_query_proj"}
    weights = {}
    for term in encoding.terms:
        # torch's Linear holds [out, in]; the tables need x @ W with W [in, out].
        weights[term] = (
            _find(state_dict, prefix + sides[term] + ".weight").T,
            _find(state_dict, prefix + sides[term] + ".bias"),
        )
    return deberta_position_tables(
        rel[: 2 * encoding.span],
        num_heads=num_heads,
        terms=encoding.terms,
        key_kernel=weights.get("c2p", (None, None))[0],
        key_bias=weights.get("c2p", (None, None))[1],
        query_kernel=weights.get("p2c", (None, None))[0],
        query_bias=weights.get("p2c", (None, None))[1],
    )
