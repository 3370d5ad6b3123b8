"""What :func:`posenc_jax.hf.from_hf_config` returns: :class:`HFEncoding`, and a sliding layer's mask."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional.core.hooks import AttentionContext, EncodingConfig, builds_itself
from posenc_jax.functional.core.registry import carries_encodings
from posenc_jax.functional.encodings.rope import RoPE
from posenc_jax.functional.encodings.rope_decoupled import RoPEOnLastFeatures

__all__ = ["HFEncoding", "sliding_window_mask"]


@carries_encodings
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
            if builds_itself(encoding):
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
          >>> from posenc_jax.hf import from_hf_config
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
