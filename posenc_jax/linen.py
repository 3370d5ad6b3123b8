"""Adapters for Flax Linen users.

* :func:`make_attention_fn` gives an ``attention_fn`` for
  ``flax.linen.MultiHeadDotProductAttention`` that applies parameter-free encodings
  (NoPE, RoPE and its scalings, xPos, ALiBi, Sandwich, the functional relative encoding)
  or built hooks with fixed arrays (``T5Bias(table)``). Linen's attention passes no
  positions, so they are taken per call: ``arange`` for a full forward, the cache index
  for a ``decode=True`` step (see :mod:`posenc_jax.nn.flax_attention`).
* :func:`to_linen` wraps any NNX module of :mod:`posenc_jax.nn` (attention,
  Transformer, any learned encoding) as a Linen module via ``flax.nnx.bridge``;
  :func:`load_linen_params` puts its Linen parameters into an NNX module.
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from posenc_jax.nn.flax_attention import make_attention_fn as nn_make_attention_fn

__all__ = ["load_linen_params", "make_attention_fn", "to_linen"]


def make_attention_fn(encodings: Sequence = (), *, causal: bool = False, query_positions=None, key_positions=None):
    """An ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention`` with these encodings.

    The same function as :func:`posenc_jax.nn.make_attention_fn` (which also serves
    ``flax.nnx.MultiHeadAttention``): positions are taken per call, ``arange`` for a full
    forward and the cache index for a ``decode=True`` step, so Linen's cache decodes with
    RoPE, ALiBi or T5 and gives the full forward's outputs.

    Args:
      encodings: parameter-free encodings, by name or object (``["rope", "alibi"]``), or
        built hooks with fixed arrays (``T5Bias(table)``).
      causal: add a causal mask by position (Linen's own ``mask`` is applied too).
      query_positions, key_positions: fixed integer positions instead of per-call ones.

    Example:
      >>> import flax.linen as nn
      >>> layer = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16,
      ...                                          attention_fn=make_attention_fn(["rope"]))
      >>> x = jnp.ones((1, 5, 16))
      >>> variables = layer.init(jax.random.key(0), x)
      >>> layer.apply(variables, x).shape
      (1, 5, 16)
    """
    return nn_make_attention_fn(encodings, causal=causal, query_positions=query_positions, key_positions=key_positions)


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
