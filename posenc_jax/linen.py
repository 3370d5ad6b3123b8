"""Adapters for Flax Linen users.

* :func:`make_attention_fn` gives an ``attention_fn`` for
  ``flax.linen.MultiHeadDotProductAttention`` that applies parameter-free encodings
  (NoPE, RoPE and its scalings, xPos, ALiBi, Sandwich, the functional relative encoding)
  or built hooks with fixed arrays (``T5Bias(table)``). Linen's attention passes no
  positions, so they are taken per call: ``arange`` for a full forward, the cache index
  for a ``decode=True`` step (see :mod:`posenc_jax.nn.flax_attention`).
* :class:`MultiHeadDotProductAttention` is ``flax.linen.MultiHeadDotProductAttention``'s
  signature and parameters (``query``, ``key``, ``value``, ``out``: Flax's layout, so a Flax
  layer's ``params`` apply to it as they are) with any encodings: the NNX
  :class:`~posenc_jax.nn.MultiHeadAttention` run through ``flax.nnx.bridge``.
* :func:`to_linen` wraps any NNX module of :mod:`posenc_jax.nn` (attention,
  Transformer, any learned encoding) as a Linen module via ``flax.nnx.bridge``;
  :func:`load_linen_params` puts its Linen parameters into an NNX module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.core import FrozenDict
from flax.nnx.nn.linear import default_kernel_init

from posenc_jax.functional.core.normalizers import softmax_weights
from posenc_jax.nn.attention import MultiHeadAttention
from posenc_jax.nn.flax_attention import make_attention_fn as nn_make_attention_fn

__all__ = ["MultiHeadDotProductAttention", "load_linen_params", "make_attention_fn", "to_linen"]


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


class MultiHeadDotProductAttention(linen.Module):
    """``flax.linen.MultiHeadDotProductAttention`` with any encodings: the same fields, parameters and call.

    The NNX :class:`~posenc_jax.nn.MultiHeadAttention` built for the input widths and run
    through ``flax.nnx.bridge.ToLinen`` in this module's own scope, so its parameters are
    ``{"query", "key", "value", "out"}`` (kernels ``[in, heads, head_dim]`` and
    ``[heads, head_dim, out]``) as Flax's: a Flax layer's ``params`` apply here unchanged, and
    with no encodings the outputs are Flax's. The fields after ``use_bias`` are this library's
    (see :class:`~posenc_jax.nn.MultiHeadAttention`). ``decode=True`` is refused: decode with the
    NNX layer (``decode=True`` or ``new_cache``), or with :func:`make_attention_fn` as the
    ``attention_fn`` of Flax's own Linen layer, whose cache then decodes with the encodings.

    Example:
      >>> layer = MultiHeadDotProductAttention(num_heads=2, qkv_features=16, encodings=["rope"])
      >>> x = jnp.ones((1, 5, 16))
      >>> variables = layer.init(jax.random.key(0), x)
      >>> sorted(variables["params"])
      ['key', 'out', 'query', 'value']
      >>> layer.apply(variables, x, causal=True).shape
      (1, 5, 16)
    """

    num_heads: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    qkv_features: int | None = None
    out_features: int | None = None
    broadcast_dropout: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    precision: Any = None
    kernel_init: Callable = default_kernel_init
    out_kernel_init: Callable | None = None
    bias_init: Callable = linen.initializers.zeros_init()
    out_bias_init: Callable | None = None
    use_bias: bool = True
    decode: bool = False
    normalize_qk: bool = False
    encodings: Sequence = ()
    num_kv_heads: int | None = None
    normalizer: Any = softmax_weights
    implementation: str = "auto"
    block_q: int | None = None
    block_k: int | None = None

    @linen.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        dropout_rng: jax.Array | None = None,
        sow_weights: bool = False,
        **kwargs,
    ):
        """As ``flax.linen.MultiHeadDotProductAttention.__call__``; further keywords (``causal``,
        ``query_positions``, ``key_positions``, ``key_mask``, ...) go to
        :meth:`posenc_jax.nn.MultiHeadAttention.__call__`."""
        if self.decode:
            raise ValueError(
                "decode=True: this Linen layer does not decode; decode with posenc_jax.nn.MultiHeadAttention "
                "(decode=True, or new_cache), or give flax.linen.MultiHeadDotProductAttention(decode=True) "
                "attention_fn=posenc_jax.linen.make_attention_fn(encodings)"
            )
        settings = dict(
            qkv_features=self.qkv_features or inputs_q.shape[-1],
            out_features=self.out_features,
            encodings=tuple(self.encodings) if isinstance(self.encodings, list) else self.encodings,
            num_kv_heads=self.num_kv_heads,
            in_kv_features=None if inputs_k is None else inputs_k.shape[-1],
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            broadcast_dropout=self.broadcast_dropout,
            dropout_rate=self.dropout_rate,
            deterministic=self.deterministic,
            precision=self.precision,
            kernel_init=self.kernel_init,
            out_kernel_init=self.out_kernel_init,
            bias_init=self.bias_init,
            out_bias_init=self.out_bias_init,
            use_bias=self.use_bias,
            normalize_qk=self.normalize_qk,
            normalizer=self.normalizer,
            implementation=self.implementation,
            block_q=self.block_q,
            block_k=self.block_k,
        )
        layer = nnx.bridge.ToLinen(
            MultiHeadAttention, args=(self.num_heads, inputs_q.shape[-1]), kwargs=FrozenDict(settings)
        )
        linen.share_scope(layer, self)  # Flax's parameter tree: query, key, value, out at this level
        if dropout_rng is not None:
            kwargs["rngs"] = nnx.Rngs(dropout=dropout_rng)
        return layer(
            inputs_q, inputs_k, inputs_v, mask=mask, deterministic=deterministic, sow_weights=sow_weights, **kwargs
        )
