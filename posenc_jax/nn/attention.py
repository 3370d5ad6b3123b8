"""Multi-head attention with any positional encoding, as a Flax NNX module.

A thin parameter-holding wrapper: projections ``W_Q``, ``W_K``, ``W_V``, ``W_O``
and the per-layer encodings' parameters; the computation is
:func:`posenc_jax.functional.dot_product_attention`.

Decoding uses an explicit :class:`KVCache` (a pytree of arrays, positions
included), so a step compiles once and runs for any position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from posenc_jax.functional.attention import IMPLEMENTATIONS, dot_product_attention, softmax_weights
from posenc_jax.functional.cache import KVCache
from posenc_jax.functional.hooks import EncodingConfig, Normalize
from posenc_jax.functional.normalizers import normalizer_config
from posenc_jax.nn.encoding import PositionEncoding

__all__ = ["KVCache", "MultiHeadAttention"]


class MultiHeadAttention(nnx.Module):
    """Multi-head (grouped-query) attention composing any encodings.

    Args:
      model_dim: D, the width of the input and output.
      num_heads: N query heads.
      num_kv_heads: K key/value heads (default N); N must be a multiple of K.
      head_dim: H (default D / N).
      encodings: registered names or configs of the encodings this layer owns
        (e.g. ``["rope", "alibi"]``); biases shared across layers are passed per
        call instead (``shared``).
      normalizer: the ``normalize`` hook (softmax by default): a function, a name
        (``"softmax"``, ``"l2"``, ``"relu2"``, ``"urpe"``), or a config with learned
        parameters (``URPEConfig``), which this layer then holds.
      dropout_rate: dropout on the attention weights.
      use_bias: biases in the projections.
      implementation: ``"auto"`` (default), ``"materialize"`` or ``"blockwise"``, passed to
        :func:`~posenc_jax.functional.dot_product_attention` (blockwise: tiles of
        ``block_q`` × ``block_k``, memory linear in the length); a call may override it.
      block_q, block_k: blockwise tile sizes (default 512).
      rngs: ``nnx.Rngs`` with ``params`` (and ``dropout`` when training with dropout).

    Example:
      >>> mha = MultiHeadAttention(64, 4, encodings=["rope"], rngs=nnx.Rngs(0))
      >>> x = jnp.ones((2, 10, 64))
      >>> mha(x, jnp.arange(10), causal=True).shape
      (2, 10, 64)
    """

    def __init__(
        self,
        model_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        encodings: Sequence = (),
        normalizer: Callable = softmax_weights,
        dropout_rate: float = 0.0,
        use_bias: bool = False,
        implementation: str = "auto",
        block_q: int | None = None,
        block_k: int | None = None,
        rngs: nnx.Rngs,
    ):
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
        self.implementation, self.block_q, self.block_k = implementation, block_q, block_k
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None:
            if model_dim % num_heads:
                raise ValueError(f"model_dim={model_dim} is not divisible by num_heads={num_heads}; pass head_dim")
            head_dim = model_dim // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        if isinstance(normalizer, str):
            normalizer = normalizer_config(normalizer)
        if isinstance(normalizer, EncodingConfig):
            self.normalizer = None
            self.normalizer_params = PositionEncoding(
                normalizer, num_heads=num_heads, head_dim=head_dim, model_dim=model_dim, rngs=rngs
            )
        else:
            # A built hook with arrays (e.g. a fixed URPE table) is data of the module, not a static setting.
            has_arrays = isinstance(normalizer, Normalize) and jax.tree.leaves(normalizer)
            self.normalizer = nnx.data(normalizer) if has_arrays else normalizer
            self.normalizer_params = None
        self.dropout_rate = dropout_rate
        self.query = nnx.Linear(model_dim, num_heads * head_dim, use_bias=use_bias, rngs=rngs)
        self.key = nnx.Linear(model_dim, num_kv_heads * head_dim, use_bias=use_bias, rngs=rngs)
        self.value = nnx.Linear(model_dim, num_kv_heads * head_dim, use_bias=use_bias, rngs=rngs)
        self.out = nnx.Linear(num_heads * head_dim, model_dim, use_bias=use_bias, rngs=rngs)
        self.encodings = nnx.List(
            [
                PositionEncoding(e, num_heads=num_heads, head_dim=head_dim, model_dim=model_dim, rngs=rngs)
                for e in encodings
            ]
        )
        for module in self.encodings:
            if module.acts_on not in ("attention", "shared_bias"):
                raise ValueError(
                    f"{type(module.config).__name__} acts on the {module.acts_on}, not in attention; give it to the "
                    f"Transformer, not the attention"
                )
        self.dropout_rngs = rngs if dropout_rate > 0 else None

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        *,
        causal: bool,
        shared: Sequence = (),
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        deterministic: bool = True,
        implementation: str | None = None,
    ):
        """Self-attention over ``x`` ``[B, T, D]`` at ``positions`` ``[T]`` or ``[B, T]``.

        Args:
          causal: mask keys after each query (by position).
          shared: extra encoding hooks for this call (a bias computed once per
            forward, e.g. ``SharedBias``).
          key_mask: ``[B, T]`` booleans, True for real tokens (with a cache: padding
            tokens are cached as invalid slots, which no query attends to).
          segment_ids: ``[B, T]`` ids of packed sequences.
          cache: a :class:`KVCache` to append to and attend over (causal decoding);
            the call then returns ``(output, new_cache)``.
          deterministic: no dropout.
          implementation: overrides the layer's ``implementation`` for this call.

        Returns:
          ``[B, T, D]``, or ``([B, T, D], KVCache)`` with a cache.
        """
        batch, length, _ = x.shape
        q = self.query(x).reshape(batch, length, self.num_heads, self.head_dim)
        k = self.key(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self.value(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        query_positions = positions
        key_positions = positions
        new_cache = None
        if cache is not None:
            if not causal:
                raise ValueError("a KV cache needs causal attention: bidirectional layers cannot decode step by step")
            if segment_ids is not None:
                raise ValueError("decoding with a cache takes no segment_ids: decode one sequence per row")
            positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (batch, length))
            # Padding (key_mask False, e.g. left padding) is stored as invalid slots: never attended.
            new_cache = cache.append(k, v, positions, valid=key_mask)
            k, v = new_cache.key, new_cache.value
            query_positions, key_positions = positions, new_cache.positions
            key_mask = new_cache.valid  # empty slots and padding, whatever their positions
        encodings = [module() for module in self.encodings] + list(shared)
        use_dropout = self.dropout_rate > 0 and not deterministic
        out = dot_product_attention(
            q,
            k,
            v,
            query_positions=query_positions,
            key_positions=key_positions,
            encodings=encodings,
            normalizer=self.normalizer if self.normalizer_params is None else self.normalizer_params(),
            causal=causal,
            key_mask=key_mask,
            query_segment_ids=segment_ids,
            key_segment_ids=segment_ids,
            dropout_rate=self.dropout_rate if use_dropout else 0.0,
            dropout_rng=self.dropout_rngs.dropout() if use_dropout else None,
            implementation=self.implementation if implementation is None else implementation,
            block_q=self.block_q,
            block_k=self.block_k,
        )
        out = self.out(out.reshape(batch, length, self.num_heads * self.head_dim))
        return out if cache is None else (out, new_cache)
