"""This library's encodings inside Flax's own attention layers, decode caches included.

``flax.nnx.MultiHeadAttention`` and ``flax.linen.MultiHeadDotProductAttention`` take an
``attention_fn(query, key, value, mask=..., ...)`` and pass it no positions. The
functions made here take them per call:

* a full forward (as many queries as keys): positions ``0 .. T-1`` for both;
* a decoding step of Flax's cache (``decode=True``: one query against the cache's
  ``max_length`` keys): the keys are the cache slots ``0 .. S-1`` and the query sits at
  the cache index, which Flax's decode mask carries (it lets the query see the slots
  ``0 .. index``), so the query's position is the last slot its mask lets it see;
* or positions fixed when the function is made (``query_positions``, ``key_positions``).

Flax caches keys before ``attention_fn`` sees them, unrotated, so RoPE rotates every
cached key by its slot at each step, and decoding gives the full forward's outputs
(tested for RoPE, ALiBi and T5 in both Flax APIs).

:func:`make_attention_fn` takes parameter-free encodings (names or configs) and built
hooks with fixed arrays (``T5Bias(table)``); :class:`AttentionFunction` is an NNX module
that holds learned encodings' parameters (T5's table, ...), so passed as
``nnx.MultiHeadAttention(..., attention_fn=AttentionFunction(["t5"], ...))`` they are
parameters of the layer and train with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from posenc_jax.functional.core.attention import SharedBias, dot_product_attention
from posenc_jax.functional.core.hooks import ATTENTION_HOOKS, EncodingConfig, ParameterFree, hook_names
from posenc_jax.functional.core.registry import resolve_encodings
from posenc_jax.nn.encoding import PositionEncoding, resolve_config

__all__ = ["AttentionFunction", "call_positions", "make_attention_fn"]


def call_positions(query: jax.Array, key: jax.Array, mask, query_positions=None, key_positions=None):
    """The ``(query_positions [B, T], key_positions [S])`` of one Flax attention call.

    Explicit positions win. Otherwise ``arange`` when there are as many queries as keys,
    and for fewer queries than keys (Flax's decode cache) the keys are the slots
    ``0 .. S-1`` and the T queries end at the last slot the mask lets the last query see.
    """
    batch, q_len, k_len = query.shape[0], query.shape[-3], key.shape[-3]
    if query_positions is not None and key_positions is not None:
        return query_positions, key_positions
    if query_positions is not None or key_positions is not None:
        raise ValueError("pass both query_positions and key_positions, or neither (they are then taken per call)")
    if q_len == k_len:
        positions = jnp.arange(q_len)
        return positions, positions
    if q_len > k_len or mask is None:
        raise ValueError(
            f"{q_len} queries against {k_len} keys without a mask: the positions are not implied. With Flax's "
            f"decode cache the mask says where the query is (decode=True passes it); otherwise pass "
            f"query_positions and key_positions when making the attention function"
        )
    mask = jnp.asarray(mask, jnp.bool_)
    if mask.ndim != 4:
        raise ValueError(f"expected a [B, N, T, S] mask (Flax's), got shape {mask.shape}")
    # The last slot the last query may see: the cache index in decode mode.
    seen = jnp.any(mask[..., -1, :], axis=-2)  # [B|1, S]
    last = k_len - 1 - jnp.argmax(seen[..., ::-1], axis=-1)
    query_positions = last[:, None] - (q_len - 1) + jnp.arange(q_len)[None, :]
    return jnp.broadcast_to(query_positions, (batch, q_len)).astype(jnp.int32), jnp.arange(k_len)


def _attend(
    hooks,
    query,
    key,
    value,
    *,
    bias,
    mask,
    causal,
    query_positions,
    key_positions,
    dropout_rng,
    dropout_rate,
    deterministic,
    dtype,
):
    # Flax's masks are often float 0/1 (make_causal_mask, the decode mask): nonzero = attend.
    mask = None if mask is None else jnp.asarray(mask).astype(jnp.bool_)
    q_pos, k_pos = call_positions(query, key, mask, query_positions, key_positions)
    extra = [] if bias is None else [SharedBias(bias)]
    use_dropout = dropout_rate > 0.0 and not deterministic
    out = dot_product_attention(
        query,
        key,
        value,
        query_positions=q_pos,
        key_positions=k_pos,
        encodings=[*hooks, *extra],
        causal=causal,
        mask=mask,
        dropout_rate=dropout_rate if use_dropout else 0.0,
        dropout_rng=dropout_rng if use_dropout else None,
    )
    return out if dtype is None else out.astype(dtype)


def _fixed_hooks(encodings: Sequence) -> list:
    hooks = []
    for encoding in resolve_encodings(encodings):
        if not isinstance(encoding, (str, EncodingConfig)) and set(hook_names(encoding)) & set(ATTENTION_HOOKS):
            hooks.append(encoding)  # a built hook with its arrays (e.g. T5Bias(table))
            continue
        config = resolve_config(encoding)
        if not isinstance(config, ParameterFree):
            raise ValueError(
                f"{config!r} has parameters; wrap the NNX MultiHeadAttention with posenc_jax.linen.to_linen, use "
                f"posenc_jax.nn.AttentionFunction in NNX, or pass a built hook with fixed arrays (e.g. T5Bias(table))"
            )
        if config.acts_on not in ("attention", "shared_bias"):
            raise ValueError(f"{type(config).__name__} acts on the {config.acts_on}, not inside attention")
        hooks.append(config.build({}))
    return hooks


def make_attention_fn(encodings: Sequence = (), *, causal: bool = False, query_positions=None, key_positions=None):
    """An ``attention_fn`` for Flax's ``MultiHeadAttention`` (NNX) or ``MultiHeadDotProductAttention`` (Linen).

    Args:
      encodings: parameter-free encodings by name or config (``["rope", "alibi"]``), or
        built hooks with fixed arrays (``T5Bias(table)``).
      causal: a causal mask by position (Flax's own ``mask`` is applied too); encodings
        with two forms (ALiBi, T5) follow it.
      query_positions, key_positions: fixed integer positions; by default they are taken
        per call (``arange``, or the cache index when decoding; see :func:`call_positions`).

    Returns:
      ``attention_fn(query, key, value, bias=None, mask=None, ...)`` in Flax's signature.

    Example:
      >>> layer = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False,
      ...                                attention_fn=make_attention_fn(["rope"], causal=True),
      ...                                rngs=nnx.Rngs(0))
      >>> x = jnp.ones((1, 5, 16))
      >>> full = layer(x)
      >>> layer.init_cache(x.shape)
      >>> steps = jnp.concatenate([layer(x[:, i : i + 1], decode=True) for i in range(5)], axis=1)
      >>> bool(jnp.allclose(steps, full, atol=1e-5))
      True
    """
    hooks = _fixed_hooks(encodings)

    def attention_fn(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        is_causal=False,
        **unused,
    ):
        return _attend(
            hooks,
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            causal=causal or bool(is_causal),
            query_positions=query_positions,
            key_positions=key_positions,
            dropout_rng=dropout_rng,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
        )

    return attention_fn


class AttentionFunction(nnx.Module):
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` that holds its encodings' parameters.

    Passed as ``attention_fn``, it becomes a submodule of the layer: learned encodings
    (T5's table, Kerple, FIRE, DeBERTa's tables, ...) are ``nnx.Param`` of the layer and
    train with it. Positions are taken per call as in :func:`make_attention_fn`.

    Args:
      encodings: registered names or configs (``["rope", "t5"]``).
      num_heads, head_dim: the layer's N and H (the parameters are made for them).
      causal: a causal mask by position; encodings with two forms follow it.
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    Example:
      >>> fn = AttentionFunction(["t5"], num_heads=2, head_dim=8, causal=True, rngs=nnx.Rngs(0))
      >>> layer = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False,
      ...                                attention_fn=fn, rngs=nnx.Rngs(1))
      >>> layer(jnp.ones((1, 5, 16))).shape, layer.attention_fn.encodings[0].table[...].shape
      ((1, 5, 16), (32, 2))
    """

    def __init__(self, encodings: Sequence, *, num_heads: int, head_dim: int, causal: bool = False, rngs: nnx.Rngs):
        self.causal = causal
        self.encodings = nnx.List(
            [
                PositionEncoding(e, num_heads=num_heads, head_dim=head_dim, model_dim=num_heads * head_dim, rngs=rngs)
                for e in resolve_encodings(encodings)
            ]
        )
        for module in self.encodings:
            if module.acts_on not in ("attention", "shared_bias"):
                raise ValueError(f"{type(module.config).__name__} acts on the {module.acts_on}, not inside attention")

    def __call__(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        is_causal=False,
        **unused,
    ):
        return _attend(
            [m() for m in self.encodings],
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            causal=self.causal or bool(is_causal),
            query_positions=None,
            key_positions=None,
            dropout_rng=dropout_rng,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
        )
