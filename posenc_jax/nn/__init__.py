"""Flax NNX modules: parameter-holding wrappers around :mod:`posenc_jax.functional`."""

from posenc_jax.nn.attention import KVCache, MultiHeadAttention
from posenc_jax.nn.encoding import PositionEncoding, resolve_config
from posenc_jax.nn.transformer import Block, Transformer, decode_step

__all__ = ["Block", "KVCache", "MultiHeadAttention", "PositionEncoding", "Transformer", "decode_step", "resolve_config"]
