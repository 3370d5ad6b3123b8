"""Flax NNX modules: parameter-holding wrappers around :mod:`posenc_jax.functional`."""

from posenc_jax.nn.attention import KVCache, MultiHeadAttention
from posenc_jax.nn.encoding import PositionEncoding, resolve_config
from posenc_jax.nn.flax_attention import AttentionFunction, make_attention_fn
from posenc_jax.nn.swap import with_encoding
from posenc_jax.nn.transformer import Block, Transformer, decode_step

__all__ = [
    "AttentionFunction",
    "Block",
    "KVCache",
    "MultiHeadAttention",
    "PositionEncoding",
    "Transformer",
    "decode_step",
    "make_attention_fn",
    "resolve_config",
    "with_encoding",
]
