"""Adapters for Flax Linen users.

* :func:`make_attention_fn` gives an ``attention_fn`` for
  ``flax.linen.MultiHeadDotProductAttention`` that applies parameter-free encodings
  (NoPE, RoPE and its scalings, xPos, ALiBi, Sandwich, the functional relative encoding).
  Linen's attention passes no positions, so the factory takes them (default
  ``arange`` over the query and key lengths).
* :func:`to_linen` wraps any NNX module of :mod:`posenc_jax.nn` (attention,
  Transformer, any learned encoding) as a Linen module via ``flax.nnx.bridge``;
  :func:`load_linen_params` puts its Linen parameters into an NNX module.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from posenc_jax.functional.attention import SharedBias, dot_product_attention
from posenc_jax.functional.hooks import ParameterFree
from posenc_jax.nn.encoding import resolve_config

__all__ = ["load_linen_params", "make_attention_fn", "to_linen"]


def make_attention_fn(encodings: Sequence = (), *, causal: bool = False, query_positions=None, key_positions=None):
    """An ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention`` with these encodings.

    Args:
      encodings: parameter-free encodings, by name or object (``["rope", "alibi"]``).
      causal: add a causal mask by position (Linen's own ``mask`` is applied too).
      query_positions, key_positions: integer positions; default ``arange(T)`` and
        ``arange(S)`` for each call.

    Example:
      >>> import flax.linen as nn
      >>> layer = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16,
      ...                                          attention_fn=make_attention_fn(["rope"]))
      >>> x = jnp.ones((1, 5, 16))
      >>> variables = layer.init(jax.random.key(0), x)
      >>> layer.apply(variables, x).shape
      (1, 5, 16)
    """
    hooks = []
    for encoding in encodings:
        config = resolve_config(encoding)
        if not isinstance(config, ParameterFree):
            raise ValueError(
                f"{config!r} has parameters; wrap the NNX MultiHeadAttention with posenc_jax.linen.to_linen instead"
            )
        if config.acts_on not in ("attention", "shared_bias"):
            raise ValueError(f"{type(config).__name__} acts on the {config.acts_on}, not inside attention")
        hooks.append(config.build({}))

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
        **unused,
    ):
        q_len, k_len = query.shape[-3], key.shape[-3]
        if q_len != k_len and (query_positions is None or key_positions is None):
            raise ValueError(
                f"{q_len} queries against {k_len} keys (Linen's decode cache?): the positions are not implied; "
                f"pass query_positions and key_positions to make_attention_fn"
            )
        q_pos = jnp.arange(q_len) if query_positions is None else query_positions
        # The same array for self-attention, so rotation tables are computed once.
        k_pos = q_pos if key_positions is None else key_positions
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

    return attention_fn


def to_linen(module_cls, *args, **kwargs):
    """A Linen module that builds and runs the NNX ``module_cls(*args, **kwargs)``.

    Example:
      >>> from posenc_jax.nn import Transformer
      >>> model = to_linen(Transformer, vocab_size=8, model_dim=16, num_layers=1, num_heads=2,
      ...                  mlp_dim=32, encoding="t5", causal=True)
      >>> tokens = jnp.zeros((1, 4), jnp.int32)
      >>> variables = model.init(jax.random.key(0), tokens, jnp.arange(4))
      >>> model.apply(variables, tokens, jnp.arange(4)).shape
      (1, 4, 8)
    """
    return nnx.bridge.to_linen(module_cls, *args, **kwargs)


def load_linen_params(module: nnx.Module, variables) -> nnx.Module:
    """Copies the ``params`` of a :func:`to_linen` module's variables into an NNX ``module`` (in place)."""
    nnx.update(module, variables["params"])
    return module
